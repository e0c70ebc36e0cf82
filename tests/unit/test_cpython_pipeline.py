"""Unit tests of heaps/cpython merge.py (pymalloc into the allocations), gclists.py and
typerules.py (dead words of GC objects and the types that get them) and
cpython/objects.py (naming objects, telling cyclic garbage from leaks), on in-memory data."""
import struct
from array import array
from types import SimpleNamespace

import pytest

from memunreachable._ffi import TWO_THREADS_MIN, lib
from memunreachable._types import BufferMemory, HeapImage, Range, merge_ranges
from memunreachable.heaps.cpython import layout as L
from memunreachable.heaps.cpython import objects as O
from memunreachable.heaps.cpython import gclists as G, merge as M, typerules as T

A = 0x5555_0000_0000
POOL = 0x7F00_0000_0000


def image(begins, sizes, regions):
    return HeapImage(array("Q", begins), array("Q", sizes), regions)


def test_merge_disjoint_regions_in_address_order():
    glibc = image([A + 16, A + 64], [40, 24], [(A, bytearray(128))])
    py = image([POOL + 48, POOL + 64], [16, 16], [(POOL, bytearray(4096))])
    m = M.merge_images(glibc, py)
    assert list(m.begins) == [A + 16, A + 64, POOL + 48, POOL + 64]
    assert list(m.sizes) == [40, 24, 16, 16]
    assert [b for b, _ in m.regions] == [A, POOL]


def test_merge_overlapping_copies_of_one_mapping():
    # glibc copied a whole anonymous mapping that also holds a pymalloc arena
    glibc = image([A + 16], [40], [(A, bytearray(b"g" * 0x3000))])
    py = image([A + 0x1030, A + 0x1040], [16, 16], [(A + 0x1000, bytearray(b"p" * 0x1000))])
    m = M.merge_images(glibc, py)
    assert list(m.begins) == [A + 16, A + 0x1030, A + 0x1040]
    assert len(m.regions) == 1 and m.regions[0][0] == A       # the covering copy is kept
    # neither covers the other: consecutive parts of both, each byte from the copy that
    # begins first (views of the copies, not a new copy)
    gbuf = bytearray(b"g" * 0x1800)
    pbuf = bytearray(b"p" * 0x1000)
    glibc = image([A + 16], [40], [(A, gbuf)])
    py = image([A + 0x1030, A + 0x17f0, A + 0x1f00], [16, 16, 256], [(A + 0x1000, pbuf)])
    m = M.merge_images(glibc, py)                   # (A + 0x17f0 ends at the cut: in one part)
    assert [(b, bytes(buf)) for b, buf in m.regions] == [(A, bytes(gbuf)),
                                                          (A + 0x1800, b"p" * 0x800)]
    gbuf[0] = pbuf[0x800] = ord("x")                            # views: no byte copied
    assert bytes(m.regions[0][1][:1]) == bytes(m.regions[1][1][:1]) == b"x"
    assert list(m.begins) == [A + 16, A + 0x1030, A + 0x17f0, A + 0x1f00]
    # an allocation across the cut (A + 0x1800) would have its bytes in two parts: one new
    # copy of the union then, each part's bytes in it
    py = image([A + 0x17f0, A + 0x1f00], [32, 256], [(A + 0x1000, pbuf)])
    m = M.merge_images(glibc, py)
    (base, buf), = m.regions
    assert base == A and len(buf) == 0x2000
    assert bytes(buf[:4]) == b"xggg" and bytes(buf[0x1fff:0x2000]) == b"p"
    # three copies in a chain, one inside another: two cuts, the inner one adds none
    c0, c1, c2 = bytearray(b"a" * 0x1000), bytearray(b"b" * 0x1000), bytearray(b"c" * 0x1000)
    inner = bytearray(b"i" * 0x100)
    glibc = image([A + 16], [40], [(A, c0), (A + 0x1800, c2)])
    py = image([A + 0x1f00], [16], [(A + 0xc00, c1), (A + 0xd00, inner)])
    m = M.merge_images(glibc, py)
    assert [(b, len(buf), bytes(buf[:1])) for b, buf in m.regions] == [
        (A, 0x1000, b"a"), (A + 0x1000, 0xc00, b"b"), (A + 0x1c00, 0xc00, b"c")]


def test_merge_rejects_overlapping_allocations():
    glibc = image([A + 0x1020], [64], [(A, bytearray(0x3000))])
    py = image([A + 0x1030], [16], [(A + 0x1000, bytearray(0x1000))])
    with pytest.raises(ValueError):
        M.merge_images(glibc, py)


def test_pools_overlapping_glibc_allocations_are_dropped():
    ps = 4096
    cp = SimpleNamespace(blocks=array("Q", [POOL + 48, POOL + 64, POOL + ps + 48]),
                         sizes=array("Q", [16, 16, 32]),
                         heap_ranges=[Range(POOL, POOL + 2 * ps)])
    glibc = image([POOL + ps + 16], [400], [(POOL + ps, bytearray(ps))])    # inside pool 2
    blocks, sizes, kept, dropped = M.drop_overlapping(cp, glibc, ps)
    assert (list(blocks), list(sizes), dropped) == ([POOL + 48, POOL + 64], [16, 16], 1)
    assert kept == [Range(POOL, POOL + ps)]
    blocks, _, kept, dropped = M.drop_overlapping(cp, image([A], [16], [(A, bytearray(16))]), ps)
    assert dropped == 0 and list(blocks) == list(cp.blocks)


def test_drop_blocks():
    img = image([A, A + 32, A + 64, A + 96], [16, 16, 16, 16], [(A, bytearray(128))])
    out, n = M.drop_blocks(img, [A + 32, A + 96, A + 8])
    assert (list(out.begins), n) == ([A, A + 64], 2)


# --- objects -------------------------------------------------------------------------------
TYPE_TYPE, LIST_TYPE, STR_TYPE, INT_TYPE = 0x7E00_0000_0000, 0x7E00_0000_1000, 0x7E00_0000_2000, 0x7E00_0000_3000
NAMES = 0x7E00_0001_0000
HAVE_GC = 1 << 14


def type_object(name_addr, flags):
    """A ready type object (Py_TPFLAGS_READY in its flags besides `flags`)."""
    t = bytearray(400)
    struct.pack_into("<QQ", t, 0, 1, TYPE_TYPE)
    struct.pack_into("<Q", t, 24, name_addr)
    struct.pack_into("<Q", t, 168, flags | L.TPFLAGS_READY)
    return bytes(t)


def memory(version=(3, 12)):
    blocks = {TYPE_TYPE: type_object(NAMES, L.TPFLAGS_TYPE_SUBCLASS), LIST_TYPE: type_object(NAMES + 16, HAVE_GC),
              STR_TYPE: type_object(NAMES + 32, 0), INT_TYPE: type_object(NAMES + 48, 0),
              NAMES: b"type\0".ljust(16, b"\0") + b"list\0".ljust(16, b"\0")
              + b"str\0".ljust(16, b"\0") + b"int\0".ljust(16, b"\0")}
    return BufferMemory(blocks)


def test_object_reader_names_types_and_values():
    mem = memory()
    ascii_str = struct.pack("<QQqqI", 2, STR_TYPE, 5, -1, 0x64).ljust(40, b"\0") + b"hello\0"
    mem.blocks[A] = ascii_str
    r = O.ObjectReader(mem, (3, 12))
    info = r.object_in(A, 64)
    assert (info.address, info.type_name, info.refcount, info.repr) == (A, "str", 2, "'hello'")
    # a GC list at +16 after its head: found there, not at 0
    mem.blocks[A + 0x100] = struct.pack("<QQQQ", A, A, 1, LIST_TYPE)
    info = r.object_in(A + 0x100, 64)
    assert (info.address, info.type_name, info.refcount) == (A + 0x110, "list", 1)
    # 3.12 int 12345678901 (2 digits): lv_tag = ndigits << 3
    v = 12345678901
    mem.blocks[A + 0x200] = struct.pack("<QQQII", 1, INT_TYPE, 2 << 3, v & (2**30 - 1), v >> 30)
    assert r.object_in(A + 0x200, 32).repr == "12345678901"
    # an immortal (3.12+) and a pointer-sized junk refcount
    mem.blocks[A + 0x300] = struct.pack("<QQ", 0xFFFFFFFF, STR_TYPE) + bytes(48)
    assert r.object_in(A + 0x300, 64).immortal
    mem.blocks[A + 0x400] = struct.pack("<QQ", A, 0x1234)
    assert r.object_in(A + 0x400, 64) is None



def test_a_module_and_a_class_are_named():
    # PyModuleObject: head, md_dict, md_def, md_state, md_weaklist, md_name (48; 3.15 dropped
    # md_def: 40); the name is a str object of its own
    for version, at in (((3, 12), 48), ((3, 15), 40)):
        mem = memory()
        mod_type, name = 0x7E00_0000_4000, A + 0x800
        mem.blocks[mod_type] = type_object(NAMES + 64, HAVE_GC)
        mem.blocks[NAMES + 64] = b"module\0".ljust(16, b"\0")
        mem.blocks[name] = struct.pack("<QQqqI", 1, STR_TYPE, 9, -1, 0x64).ljust(40, b"\0") + b"_warnings\0"
        obj = bytearray(struct.pack("<QQQQ", A, A, 4, mod_type)) + bytes(64)
        struct.pack_into("<Q", obj, 16 + at, name)
        mem.blocks[A] = bytes(obj)
        r = O.ObjectReader(mem, version)
        info = r.object_in(A, 80)
        assert (info.address, info.type_name, info.refcount) == (A + 16, "module", 4)
        assert r.short_repr("module", A + 16, A + 80) == "<module '_warnings'>"
        mem.blocks[name] = struct.pack("<QQ", 1, LIST_TYPE) + bytes(48)     # no str: no name
        assert O.ObjectReader(mem, version).short_repr("module", A + 16, A + 80) is None
    # a class is named by its tp_name; what is no type has no repr
    r = O.ObjectReader(memory(), (3, 12))
    assert r.short_repr("type", LIST_TYPE, LIST_TYPE + 400) == "<class 'list'>"
    assert r.short_repr("type", A, A + 64) is None


def test_an_item_array_of_nones_is_no_object_of_type_none():
    # None -> NoneType -> type: a chain that ends in type, but None is no type (its type has
    # no TYPE_SUBCLASS flag); a list's item array [None, None, ...] (trixie's 3.13: None's
    # "name", what follows it in .data, read "C.utf8") is no object
    mem = memory()
    none_type, none = 0x7E00_0000_5000, 0x7E00_0000_6000
    mem.blocks[none_type] = type_object(NAMES + 16, 0)
    mem.blocks[none] = struct.pack("<QQQQ", 1, none_type, 0, NAMES + 32)
    mem.blocks[A] = struct.pack("<QQQQ", none, none, none, A)
    r = O.ObjectReader(mem, (3, 13))
    assert r.type_info(none) is None and r.type_info(none_type) == ("list", L.TPFLAGS_READY)
    assert r.object_in(A, 64) is None


def test_an_array_of_pointers_is_no_type():
    # an extension's .bss array of pointers whose second is &PyType_Type and whose fourth a
    # printable string (scipy's, read as a type named ")"): its "tp_flags" is an address (a
    # tuple's, which then stopped counting), not a ready type's flags
    mem = memory()
    arr = 0x7E00_0000_7000
    body = bytearray(type_object(NAMES + 16, 0))
    struct.pack_into("<Q", body, 168, A + 0x1040)      # an address where flags would be (bit 12 set)
    mem.blocks[arr] = bytes(body)
    r = O.ObjectReader(mem, (3, 11))
    assert r.type_info(arr) is None
    # flags below 2**32 but not ready: no type either; ready ones: a type
    struct.pack_into("<Q", body, 168, HAVE_GC)
    mem.blocks[arr + 0x1000] = bytes(body)
    struct.pack_into("<Q", body, 168, HAVE_GC | L.TPFLAGS_READY)
    mem.blocks[arr + 0x2000] = bytes(body)
    assert r.type_info(arr + 0x1000) is None
    assert r.type_info(arr + 0x2000) == ("list", HAVE_GC | L.TPFLAGS_READY)

def test_a_dead_gc_object_needs_an_untracked_head():
    # refcount 0 at +16 under a GC type: dead (free-listed) only after an untracked PyGC_Head;
    # a live list's item array [item, stale, NULL, stale &list] is no object at all
    mem = memory()
    r = O.ObjectReader(mem, (3, 12))
    mem.blocks[A] = struct.pack("<QQQQ", 0, 1, 0, LIST_TYPE)
    info = r.object_in(A, 40)
    assert (info.address, info.type_name, info.refcount) == (A + 16, "list", 0)
    mem.blocks[A + 0x100] = struct.pack("<QQQQ", A + 0x500, A + 0x600, 0, LIST_TYPE)
    assert r.object_in(A + 0x100, 40) is None
    assert r.object_in(A + 0x100, 40, data=mem.blocks[A + 0x100]) is None


def test_split_garbage_cycle_leak_and_native_block():
    # blocks: 0 list X (refcount 1) <-> 1 list Y (refcount 1): a cycle, explained;
    # 2 list L (refcount 2, one reference inside: leaked) -> 3 item array -> 4 int
    # 5 native block referenced by nothing; 6 a native block a stale word of X points into
    begins = [A + 0x100 * k for k in range(7)]
    sizes = [64] * 7
    objs = {0: O.PyObjectInfo(begins[0] + 16, "list", 1), 1: O.PyObjectInfo(begins[1] + 16, "list", 1),
            2: O.PyObjectInfo(begins[2] + 16, "list", 2), 4: O.PyObjectInfo(begins[4], "int", 1)}
    words = {0: [objs[1].address, begins[6] + 8], 1: [objs[0].address], 2: [begins[3], objs[2].address],
             3: [objs[4].address], 4: [], 5: [], 6: []}
    garbage, internal, _ = O.split_garbage(begins, sizes, range(7), objs,
                                        lambda i: array("Q", words[i]))
    assert garbage == {0, 1}
    assert internal == {0: 1, 1: 1, 2: 1, 4: 1}
    # a non-object block that holds an object pointer and only garbage reaches: garbage too
    words[6] = [objs[0].address]
    garbage, _, _ = O.split_garbage(begins, sizes, range(7), objs, lambda i: array("Q", words[i]))
    assert garbage == {0, 1, 6}
    # a dead object (refcount 0) has no edges and explains nothing: Y's count is a surplus,
    # Y is leaked, and so is what it reaches
    objs[0] = O.PyObjectInfo(begins[0] + 16, "list", 0)
    garbage, internal, _ = O.split_garbage(begins, sizes, range(7), objs, lambda i: array("Q", words[i]))
    assert internal[1] == 0 and garbage == set()


def test_split_garbage_owned_buffers_are_parts_of_garbage():
    # Nodes C (5) <-> Y (6) form a cycle; C also holds dict D (0) and list X (1), each
    # referenced once, by C. D's key table (2) is empty and X's item array (3) holds small
    # ints: no unreachable object in either, yet they are the garbage's parts (typed fields:
    # dict ma_keys, list ob_item), not leaks. 4: a native block a stale word in D's slack
    # points at: still a leak.
    begins = [A + 0x100 * k for k in range(7)]
    sizes = [80] * 7
    d = O.PyObjectInfo(begins[0] + 16, "dict", 1,
                       owned=L.owned_fields("dict", L.TPFLAGS_DICT_SUBCLASS, (3, 12)))
    x = O.PyObjectInfo(begins[1] + 16, "list", 1,
                       owned=L.owned_fields("list", L.TPFLAGS_LIST_SUBCLASS, (3, 12)))
    c = O.PyObjectInfo(begins[5] + 16, "Node", 1)
    y = O.PyObjectInfo(begins[6] + 16, "Node", 1)
    objs = {0: d, 1: x, 5: c, 6: y}
    # words from the block start: GC head (2 words, zeroed), ob_refcnt, ob_type, then fields
    words = {0: [0, 0, 1, 0x7000, 0, 0, begins[2], 0, 0, begins[4]],
             1: [0, 0, 1, 0x7100, 2, begins[3], 2, 0, 0, 0],
             2: [1, 0x303, 4, 1, 0xFFFFFFFFFFFFFFFE], 3: [0x7200, 0x7210], 4: [],
             5: [0, 0, 1, 0x7300, d.address, x.address, y.address],
             6: [0, 0, 1, 0x7300, c.address]}
    garbage, _, _ = O.split_garbage(begins, sizes, range(7), objs, lambda i: array("Q", words[i]))
    assert garbage == {0, 1, 2, 3, 5, 6}
    # without the typed fields (the rule before): both buffers read as native leaks
    plain = dict(objs)
    plain[0], plain[1] = O.PyObjectInfo(d.address, "dict", 1), O.PyObjectInfo(x.address, "list", 1)
    garbage, _, _ = O.split_garbage(begins, sizes, range(7), plain, lambda i: array("Q", words[i]))
    assert garbage == {0, 1, 5, 6}



def test_split_garbage_a_heap_type_s_buffers_are_parts_of_it():
    # a class K (0) that _simple_enum replaced: cyclic garbage (its MRO tuple (1) holds it).
    # Its docstring copy (2, text) and its instances' empty shared keys (3) hold no object,
    # yet are its parts (typed fields: tp_doc, ht_cached_keys), as is 3.12's _ht_tpname (4);
    # 5: a native block nothing holds: a leak. `import ssl` reported 2 to 5 such keys and a
    # docstring as leaks on 3.11-3.13 (LeakSanitizer: none).
    version = (3, 12)
    owned = L.owned_fields("type", L.TPFLAGS_TYPE_SUBCLASS | L.TPFLAGS_HAVE_GC, version)
    assert owned == (L.TP_DOC, 880, 896)
    begins = [A + 0x1000 * k for k in range(6)]
    sizes = [16 + 920, 64, 80, 776, 32, 48]
    k = O.PyObjectInfo(begins[0] + 16, "type", 1, owned=owned)
    mro = O.PyObjectInfo(begins[1] + 16, "tuple", 1)
    words = {0: [0] * (sizes[0] // 8), 1: [0, 0, 1, 0x7000, 1, k.address], 2: [0x746e65746e6f43] * 10,
             3: [1, 0x1e00000000020606, 30] + [2**64 - 1] * 8, 4: [0x6d616e], 5: []}
    w0 = words[0]
    w0[2], w0[3] = 1, 0x7300                                  # ob_refcnt, ob_type
    w0[(16 + L.TP_DOC) // 8] = begins[2]
    w0[(16 + 880) // 8] = begins[3]
    w0[(16 + 896) // 8] = begins[4]
    w0[(16 + 344) // 8] = mro.address                         # tp_mro
    objs = {0: k, 1: mro}
    garbage, _, _ = O.split_garbage(begins, sizes, range(6), objs, lambda i: array("Q", words[i]))
    assert garbage == {0, 1, 2, 3, 4}
    # without the typed fields (the rule before): the docstring, keys and name read as leaks
    plain = {0: O.PyObjectInfo(k.address, "type", 1), 1: mro}
    garbage, _, _ = O.split_garbage(begins, sizes, range(6), plain, lambda i: array("Q", words[i]))
    assert garbage == {0, 1}


def test_leak_heads_names_the_leaked_object_of_a_cycle():
    # 0 a key table (native), 1 a module (refcount 4: 3 from its functions), 2-4 its functions,
    # 5 its dict: module -> dict -> key table -> functions -> module, one cycle
    mod = O.PyObjectInfo(A + 0x110, "module", 4)
    objs = {1: mod, 5: O.PyObjectInfo(A + 0x510, "dict", 1)}
    objs.update({k: O.PyObjectInfo(A + 0x100 * k, "builtin_function_or_method", 1)
                 for k in (2, 3, 4)})
    edges = {0: [2, 3, 4], 1: [5], 2: [1], 3: [1], 4: [1], 5: [0]}
    words = {0: [0x303, objs[2].address, objs[3].address, objs[4].address], 1: [objs[5].address],
             2: [mod.address], 3: [mod.address, 7], 4: [mod.address], 5: [1, A]}
    def heads(entries, objects=objs, e=edges, w=words):
        return O.leak_heads(entries, objects, e, lambda i: w.get(i, ()))
    assert heads([(0, (1, 2, 3, 4, 5))]) == {0: 1}
    # a native block that holds the module but that the module does not reach heads its entry
    assert heads([(0, (1, 2, 3, 4, 5))], e={**edges, 5: []}) == {}
    # a head whose own reference leaked stays
    assert heads([(1, (0, 2, 3, 4, 5))]) == {}
    # a stale copy of the module's address in a block outside the cycle changes nothing (a
    # head must stay from check to check); inside it, it is one more reference held
    assert heads([(0, (1, 2, 3, 4, 5)), (6, ())], w={**words, 6: [mod.address]}) == {0: 1}
    assert heads([(0, (1, 2, 3, 4, 5))], w={**words, 5: [1, A, mod.address]}) == {}
    # an immortal object never heads (its count is no leak)
    immortal = {**objs, 1: O.PyObjectInfo(A + 0x110, "module", 4, immortal=True)}
    assert heads([(0, (1, 2, 3, 4, 5))], objects=immortal) == {}


def test_reheaded_entries_keep_their_blocks_and_totals():
    from memunreachable.sweep.folding import FoldedLeak
    from memunreachable.sweep.steps import _reheaded
    sizes = [584, 80, 64, 64, 48]
    folded = [FoldedLeak(0, 3, 80 + 64 + 64, (1, 2, 3)), FoldedLeak(4, 0, 0, ())]
    out = _reheaded(folded, {0: 1}, sizes)
    assert [(f.index, f.referenced_count, f.referenced_size, f.blocks) for f in out] == \
        [(1, 3, 584 + 64 + 64, (0, 2, 3)), (4, 0, 0, ())]
    assert _reheaded(folded, {}, sizes) is folded

def test_owned_fields_per_version():
    assert L.owned_fields("dict", L.TPFLAGS_DICT_SUBCLASS, (3, 8)) == (32, 40)
    assert L.owned_fields("MyList", L.TPFLAGS_LIST_SUBCLASS, (3, 13)) == (24,)
    assert L.owned_fields("frozenset", 0, (3, 10)) == (40,)
    assert L.owned_fields("bytearray", 0, (3, 11)) == (32,)
    # managed dict values: 3.11 obj - 32, 3.12 obj - 24 (tagged), 3.13 inline (none)
    assert L.owned_fields("C", L.TPFLAGS_MANAGED_DICT, (3, 11)) == (-32,)
    assert L.owned_fields("C", L.TPFLAGS_MANAGED_DICT, (3, 12)) == (-24,)
    assert L.owned_fields("C", L.TPFLAGS_MANAGED_DICT, (3, 13)) == ()
    assert L.owned_fields("tuple", 0, (3, 12)) == ()
    # a type object on the heap (its type has TYPE_SUBCLASS): tp_doc, ht_cached_keys and
    # (3.11+) _ht_tpname, offsetof from each version's headers
    meta = L.TPFLAGS_TYPE_SUBCLASS
    assert L.owned_fields("type", meta, (3, 8)) == (176, 872)
    assert L.owned_fields("type", meta, (3, 9)) == (176, 864)
    assert L.owned_fields("EnumType", meta, (3, 11)) == (176, 872, 888)
    assert L.owned_fields("type", meta, (3, 14)) == (176, 880, 896)
    assert L.owned_fields("type", meta, (3, 15)) == (176, 888, 904)
    assert L.owned_fields("type", meta, (3, 16)) == (176,)       # unknown: tp_doc alone


def test_type_docs_are_the_heap_types_docstring_blocks():
    META, OTHER_META, PLAIN = 0x7000, 0x7100, 0x7200
    HEAP = 1 << 9

    def typeobj(meta, flags, doc):
        body = bytearray(200)
        struct.pack_into("<QQ", body, 0, 1, meta)
        struct.pack_into("<QQ", body, 168, flags, doc)
        return bytes(16) + bytes(body)                  # PyGC_Head, then the type object
    docs = [0x2000, 0x2100, 0x2200, 0x2300]
    blocks = [(0x1000, typeobj(META, HEAP, docs[0])),          # a heap type: its doc is text
              (0x1100, typeobj(OTHER_META, HEAP, docs[1])),    # a metaclass not listed
              (0x1200, typeobj(META, 0, docs[2])),             # a static type: doc in .rodata
              (0x1300, typeobj(META, HEAP, docs[3] + 8)),      # doc not at a block's start
              (0x1400, typeobj(META, HEAP, 0))]                # no doc
    data = bytearray(0x1400)
    for b, d in blocks:
        data[b - 0x1000:b - 0x1000 + len(d)] = d
    begins = [b for b, _ in blocks] + docs
    sizes = [216] * len(blocks) + [40, 40, 40, 40]
    img = HeapImage(array("Q", begins), array("Q", sizes), [(0x1000, data)])
    head_word = bytes([1] * len(blocks) + [0] * len(docs))
    assert G.type_docs(img, head_word, [META]) == [Range(0x2000, 0x2028)]
    assert G.type_docs(img, head_word, [META, OTHER_META]) == [Range(0x2000, 0x2028),
                                                               Range(0x2100, 0x2128)]
    assert G.type_docs(img, head_word, []) == []


def test_list_slack_is_the_item_array_above_ob_size():
    LIST, OTHER = 0x7000, 0x7100
    head = bytes(16)                                   # PyGC_Head (links unused here)

    def obj(tp, size, items, allocated):
        return head + struct.pack("<5Q", 1, tp, size, items, allocated)
    blocks = [(0x1000, obj(LIST, 2, 0x2000, 5)),        # 3 stale slots
              (0x1100, obj(LIST, 4, 0x2100, 4)),        # full: none
              (0x1200, obj(OTHER, 1, 0x2200, 8)),       # not a list
              (0x1300, obj(LIST, 0, 0x2300, 2)),        # popped empty: both slots stale
              (0x1400, obj(LIST, 3, 0x2403, 6))]        # misaligned items: not trusted
    data = bytearray(0x600)
    for b, d in blocks:
        data[b - 0x1000:b - 0x1000 + len(d)] = d
    img = HeapImage(array("Q", [b for b, _ in blocks]), array("Q", [56] * len(blocks)),
                    [(0x1000, data)])
    head_word = bytes([1] * len(blocks))               # each block starts with a GC head
    assert G.list_slack(img, head_word, LIST) == [Range(0x2010, 0x2028), Range(0x2300, 0x2310)]
    assert G.list_slack(img, bytes(len(blocks)), LIST) == []     # no GC objects known
    # with the item arrays as allocations of the image: the allocator's slack after the
    # `allocated` slots is stale too (a full list's as well); an array smaller than its
    # `allocated` slots is not trusted past them
    arrays = [(0x2000, 56), (0x2100, 40), (0x2300, 8)]
    alloc = sorted([(b, 56) for b, _ in blocks] + arrays)
    img = HeapImage(array("Q", [b for b, _ in alloc]), array("Q", [z for _, z in alloc]),
                    [(0x1000, data + bytes(0x1400))])
    head_word = bytes(1 if b < 0x2000 else 0 for b, _ in alloc)
    assert G.list_slack(img, head_word, LIST) == [Range(0x2010, 0x2038), Range(0x2120, 0x2128),
                                                  Range(0x2300, 0x2310)]


def test_io_buffers_are_the_blocks_of_buffered_objects_buffer_field():
    WRITER, OTHER = 0x7000, 0x7100

    def buffered(tp, buf):
        body = bytearray(152)
        struct.pack_into("<QQ", body, 0, 1, tp)
        struct.pack_into("<Q", body, L.BUFFERED_BUFFER, buf)
        return bytes(16) + bytes(body)                  # PyGC_Head, then the object
    bufs = [0x3000, 0x4000, 0x5000]
    blocks = [(0x1000, buffered(WRITER, bufs[0])),     # its buffer: data, never a reference
              (0x1100, buffered(OTHER, bufs[1])),      # another type's field at 56: kept
              (0x1200, buffered(WRITER, bufs[2] + 8))]  # not a block's start: kept
    data = bytearray(0x300)
    for b, d in blocks:
        data[b - 0x1000:b - 0x1000 + len(d)] = d
    begins = [b for b, _ in blocks] + bufs
    sizes = [168] * len(blocks) + [4104] * len(bufs)
    img = HeapImage(array("Q", begins), array("Q", sizes), [(0x1000, data)])
    head_word = bytes([1] * len(blocks) + [0] * len(bufs))
    assert G.io_buffers(img, head_word, [WRITER]) == [Range(0x3000, 0x3000 + 4104)]
    assert G.io_buffers(img, head_word, []) == []


# --- the native array passes against the Python they replaced --------------------------------
def _ref_overlapping_pools(blocks, pool_size, gb, gs):
    """drop_overlapping's Python loop before mu_pools_overlapping."""
    import bisect
    pools = sorted({b - b % pool_size for b in blocks})
    bad = []
    for p in pools:
        i = bisect.bisect_left(gb, p + pool_size)
        if i and gb[i - 1] + max(gs[i - 1], 1) > p:
            bad.append(p)
    return bad


def _ref_merge(a, b, drop):
    """merge_images (region groups, then interleave) and drop_blocks before mu_merge_blocks,
    as a plain model: allocations inside the merged regions' spans, address order, a-b
    neighbours must not overlap, then the ones beginning at a drop address removed."""
    spans = sorted((base, base + len(buf)) for base, buf in a.regions + b.regions)
    groups = []
    for lo, hi in spans:
        if groups and lo < groups[-1][1]:
            groups[-1][1] = max(groups[-1][1], hi)
        else:
            groups.append([lo, hi])
    inside = lambda x: any(lo <= x < hi for lo, hi in groups)
    items = sorted([(x, 0, s) for x, s in zip(a.begins, a.sizes) if inside(x)]
                   + [(x, 1, s) for x, s in zip(b.begins, b.sizes) if inside(x)])
    for (x, src, s), (y, src2, _) in zip(items, items[1:]):
        if src != src2 and x + max(s, 1) > y:
            raise ValueError(y)
    drop = set(drop)
    kept = [(x, s) for x, _, s in items if x not in drop]
    return [x for x, _ in kept], [s for _, s in kept], len(drop & {x for x, _, _ in items})


def _random_images(rng):
    """A glibc-like image and a pymalloc-like image over a shared address space."""
    regions = [(A + k * 0x10000, bytearray(rng.choice([0x4000, 0x8000, 0x10000])))
               for k in range(6)]
    ga, gs, pa, ps = [], [], [], []
    for base, buf in regions:
        x = base + rng.randrange(0, 64, 16)
        while x < base + len(buf) - 512:
            size = rng.randrange(16, 400, 8)
            (ga if (x // 0x2000) % 2 else pa).append(x)
            (gs if (x // 0x2000) % 2 else ps).append(size)
            x += size + rng.choice([0, 16, 48])
    ga.append(A + 0x90000)                   # outside every region: left out
    gs.append(32)
    glibc = image(ga, gs, [r for k, r in enumerate(regions) if k % 2 == 0])
    py = image(pa, ps, [r for k, r in enumerate(regions) if k % 2 == 1 or k == 0])
    return glibc, py


def test_merge_dropping_equals_the_python_model_on_random_images():
    import random
    rng = random.Random(7)
    for _ in range(30):
        glibc, py = _random_images(rng)
        every = list(glibc.begins) + list(py.begins)
        drop = rng.sample(every, 25) + [A + 8, A + 0x7FFF8]        # two that match nothing
        begins, sizes, removed = _ref_merge(glibc, py, drop)
        out, n = M.merge_dropping(glibc, py, drop)
        assert (list(out.begins), list(out.sizes), n) == (begins, sizes, removed)
        assert list(M.merge_images(glibc, py).begins) == _ref_merge(glibc, py, [])[0]


def _in_room(img, extra):
    """img with its arrays at the start of 'Q' views of room for len(img) + extra entries."""
    n = len(img.begins)
    room = tuple(memoryview(bytearray(8 * (n + extra))).cast("Q") for _ in range(2))
    room[0][:n], room[1][:n] = img.begins, img.sizes
    return HeapImage(room[0][:n], room[1][:n], img.regions), room


def test_merge_dropping_in_room_equals_the_python_model_on_random_images():
    # pymalloc's outputs merged in place: the same result, as views of the room; a room
    # too small, or not where b's arrays start, leaves b as it was
    import random
    rng = random.Random(8)
    for k in range(20):
        glibc, py = _random_images(rng)
        drop = rng.sample(list(glibc.begins) + list(py.begins), 25)
        begins, sizes, removed = _ref_merge(glibc, py, drop)
        inroom, room = _in_room(py, len(glibc.begins))
        out, n = M.merge_dropping(glibc, inroom, drop, room=room)
        assert (list(out.begins), list(out.sizes), n) == (begins, sizes, removed)
        assert out.begins.obj is room[0].obj and out.sizes.obj is room[1].obj
        small, room2 = _in_room(py, len(glibc.begins) - 1)
        other = (room2[0][1:], room2[1][1:]) if k % 2 else room2
        out, n = M.merge_dropping(glibc, small, drop, room=other)
        assert (list(out.begins), list(out.sizes), n) == (begins, sizes, removed)
        assert list(small.begins) == list(py.begins) and list(small.sizes) == list(py.sizes)
    glibc, py = _random_images(rng)                 # no glibc blocks: b moves by nothing
    empty = image([], [], glibc.regions)
    inroom, room = _in_room(py, 0)
    out, n = M.merge_dropping(empty, inroom, [py.begins[3]], room=room)
    assert list(out.begins) == _ref_merge(empty, py, [py.begins[3]])[0] and n == 1


def test_merge_dropping_in_a_big_room_moves_both_arrays_on_two_threads():
    # past a million pymalloc blocks the room's two arrays move up on two threads: the same
    # result as the model, in the room, their sizes still beside their addresses
    nb = TWO_THREADS_MIN + 1000
    py = image(array("Q", range(A, A + 32 * nb, 32)), array("Q", [16, 32]) * (nb // 2),
               [(A, bytearray(32 * nb))])
    glibc = image([A - 0x1000 + 64 * k for k in range(40)], [48] * 40,
                  [(A - 0x1000, bytearray(0x1000))])
    drop = [A - 0x1000 + 64 * 3, A + 32 * 5, A + 32 * (nb - 1)]
    inroom, room = _in_room(py, len(glibc.begins))
    out, n = M.merge_dropping(glibc, inroom, drop, room=room)
    gone = set(drop)
    want = [(b, z) for b, z in zip(list(glibc.begins) + list(py.begins),
                                   list(glibc.sizes) + list(py.sizes)) if b not in gone]
    assert n == 3 and out.begins.obj is room[0].obj
    assert out.begins.tolist() == [b for b, _ in want]
    assert out.sizes.tolist() == [z for _, z in want]


def test_merge_dropping_rejects_overlap_between_the_images_only():
    glibc = image([A + 0x100, A + 0x110], [0x20, 0x20], [(A, bytearray(0x1000))])  # overlap
    py = image([A + 0x200], [16], [(A, bytearray(0x1000))])
    out, _ = M.merge_dropping(glibc, py, [])        # within one image: not this stage's test
    assert list(out.begins) == [A + 0x100, A + 0x110, A + 0x200]
    py = image([A + 0x118], [16], [(A, bytearray(0x1000))])
    with pytest.raises(ValueError, match=hex(A + 0x118)):
        M.merge_dropping(glibc, py, [])
    zero = image([A + 0x300], [0], [(A, bytearray(0x1000))])     # a 0-byte block spans 1
    with pytest.raises(ValueError):
        M.merge_dropping(zero, image([A + 0x300], [16], [(A, bytearray(0x1000))]), [])


def test_overlapping_pools_equal_the_python_loop():
    import random
    rng = random.Random(3)
    ps = 0x4000
    for _ in range(50):
        blocks = sorted({POOL + rng.randrange(0, 40 * ps, 16) for _ in range(300)})
        gb, gs, x = [], [], POOL - ps
        while x < POOL + 41 * ps:
            x += rng.randrange(ps // 2, 3 * ps, 16)
            gb.append(x)
            gs.append(rng.choice([0, 16, rng.randrange(16, 2 * ps, 8)]))
            x += gs[-1]
        want = _ref_overlapping_pools(blocks, ps, gb, gs)
        assert M._overlapping_pools(array("Q", blocks), ps, array("Q", gb), array("Q", gs)) == want
    many = array("Q", [POOL + k * ps + 48 for k in range(200)])     # more than the first cap
    assert M._overlapping_pools(many, ps, array("Q", [POOL]), array("Q", [200 * ps])) == \
        [POOL + k * ps for k in range(200)]


def test_gc_dead_ranges_equals_the_three_passes_and_the_type_flags_on_random_objects():
    import random
    rng = random.Random(11)
    LIST, META, OTHER_META, BUF, OTHER = 0x7000, 0x7100, 0x7200, 0x7300, 0x7400
    base, nobj, ntarget = 0x10000, 300, 40
    targets = [base + 0x40000 + 0x100 * k for k in range(ntarget)]
    data = bytearray(0x40000)
    begins, sizes, head = [], [], []
    for k in range(nobj):
        at = base + 0x200 * k
        tp = rng.choice([LIST, META, OTHER_META, BUF, OTHER, META])
        words = [rng.choice([0, 1, 2, 5, 9]) for _ in range(30)]
        words[0], words[1] = 1, tp                       # ob_refcnt, ob_type (after the head)
        words[2], words[4] = rng.randrange(0, 6), rng.randrange(0, 8)     # list size, allocated
        words[3] = rng.choice(targets) + rng.choice([0, 0, 3])            # list items
        words[(L.TP_FLAGS) // 8] = rng.choice([0, L.TPFLAGS_HEAPTYPE])
        words[L.TP_DOC // 8] = rng.choice(targets + [0, targets[0] + 8])
        words[L.BUFFERED_BUFFER // 8] = rng.choice(targets + [0])
        body = bytes(16) + struct.pack("<30Q", *words)
        data[at - base:at - base + len(body)] = body
        begins.append(at)
        sizes.append(rng.choice([256, 56, 190]))          # some too small for a rule's fields
        head.append(rng.choice([1, 1, 1, 0]))
    begins += targets
    sizes += [0x80] * ntarget
    head += [0] * ntarget
    pieces = [(base + k, bytearray(data[k:k + 0x10000])) for k in range(0, 0x40000, 0x10000)
              if k != 0x20000]                  # four regions, one left out: objects unread
    img = HeapImage(array("Q", begins), array("Q", sizes),
                    pieces + [(base + 0x40000, bytearray(0x100 * ntarget))])
    hw = bytes(head)
    for list_type, metas, buffered in [(LIST, [META], [BUF]), (0, [META, OTHER_META], []),
                                       (LIST, [], [BUF, META]), (LIST, [META], [META])]:
        slack = G.list_slack(img, hw, list_type) if list_type else []
        docs = G.type_docs(img, hw, metas)
        bufs = G.io_buffers(img, hw, buffered)
        pairs, counts = G.gc_dead_ranges(img, hw, list_type, metas, buffered)
        # a type object's tp_flags word (a number): every GC object of a metatype whose
        # object reaches past the word
        flags = [(b + 16 + L.TP_FLAGS, b + 24 + L.TP_FLAGS) for b, n, h in zip(begins, sizes, hw)
                 if h and b - base < 0x40000 and not 0x20000 <= b - base < 0x30000
                 and struct.unpack_from("<Q", data, b - base + 24)[0] in metas
                 and 16 + L.TP_FLAGS + 8 <= n]
        assert counts == (len(slack), len(docs), len(bufs), len(flags), 0, 0)    # no sets
        assert sorted(pairs) == sorted([(r.begin, r.end) for r in slack + docs + bufs] + flags)
        assert sum(counts) > 5 and (len(flags) > 5) == bool(metas)
        # the slack to an item array's end as that allocation's live end instead: the same
        # words (two lists naming one array: the fewer used slots), the other pairs as before
        live = bytearray(4 * len(begins))
        lpairs, lcounts = G.gc_dead_ranges(img, hw, list_type, metas, buffered, live)
        ends = struct.unpack(f"<{len(begins)}I", live)
        implied = [(b + e - 1, b + n) for b, n, e in zip(begins, sizes, ends) if e]
        assert lcounts == counts and (len(implied) > 5) == bool(list_type)
        assert len(lpairs) == len(pairs) - len(slack) + sum(
            1 for r in slack if not any(b <= r.begin and r.end == b + n
                                        for b, n in zip(begins, sizes)))
        assert merge_ranges([Range(b, e) for b, e in list(lpairs) + implied]) == \
            merge_ranges([Range(b, e) for b, e in pairs])


def test_with_sizes_adds_size_rules_and_merges_them_with_dead_at_zero_rules():
    dead_at_zero = 16 | lib.MU_TYPE_DEAD_AT_ZERO << 8
    opaque = 16 | lib.MU_TYPE_OPAQUE << 8
    sized = [(0x3000, 16 | lib.MU_TYPE_SIZED << 8 | 40 << 16),      # no rule yet: added
             (0x1000, 16 | lib.MU_TYPE_SIZED << 8 | 24 << 16),      # dead-at-zero: both
             (0x2000, 16 | lib.MU_TYPE_SIZED << 8 | 24 << 16),      # opaque: left opaque
             (0x4000, 32 | lib.MU_TYPE_SIZED << 8 | 24 << 16)]      # another offset: left
    rules = T.with_sizes([(0x1000, dead_at_zero), (0x2000, opaque), (0x4000, dead_at_zero)], sized)
    assert rules == [(0x1000, 16 | lib.MU_TYPE_VARSIZED << 8 | 24 << 16), (0x2000, opaque),
                     (0x3000, sized[0][1]), (0x4000, dead_at_zero)]


def _image_of(blocks, extra=(), heads=None):
    """HeapImage of blocks [(address, bytes)] in one region from 0x1000, plus extra
    [(address, size)] allocations inside it, and its head_word: the blocks are GC objects
    (head word 1, or heads[address]: 1 + the GC head's word index)."""
    data = bytearray(0x3000)
    for b, d in blocks:
        data[b - 0x1000:b - 0x1000 + len(d)] = d
    alloc = sorted([(b, max(len(d), 16)) for b, d in blocks] + list(extra))
    gc = {b for b, _ in blocks}
    img = HeapImage(array("Q", [b for b, _ in alloc]), array("Q", [s for _, s in alloc]),
                    [(0x1000, data)])
    return img, bytes((heads or {}).get(b, 1) if b in gc else 0 for b, _ in alloc)


def test_stale_set_smalltables_are_dead_once_the_table_moved():
    SET, OTHER = 0x7000, 0x7100

    def setobj(tp, table_at):
        body = bytearray(200)
        struct.pack_into("<QQ", body, 0, 1, tp)
        struct.pack_into("<Q", body, 40, table_at)
        return bytes(16) + bytes(body)
    blocks = [(0x1000, setobj(SET, 0x2000)),            # resized: its smalltable is stale
              (0x1100, setobj(SET, 0x1100 + 16 + 64)),  # still in its smalltable: live
              (0x1200, setobj(OTHER, 0x2000))]          # not a set
    img, hw = _image_of(blocks, [(0x2000, 512)])
    pairs, counts = G.gc_stale_parts(img, hw, (3, 11), [SET], [], 0, 0, [], [], [])
    assert pairs == [(0x1000 + 16 + 64, 0x1000 + 16 + 192)] and counts == (1, 0, 0, 0, 0, 0)


def values_block(prefix, order, nslots):
    """A PyDictValues allocation: prefix bytes (order indices at values[-3 - j], their count
    at values[-2], the prefix size at values[-1]; the rest stale 0xee), then nslots slots."""
    pre = bytearray(b"\xee" * prefix)
    pre[-1], pre[-2] = prefix, len(order)
    for j, ix in enumerate(order):
        pre[-3 - j] = ix
    return bytes(pre) + b"\xee" * (8 * nslots)


@pytest.mark.parametrize("version, field, tag", [((3, 11), -32, "MU_VALUES_PLAIN"),
                                                  ((3, 12), -24, "MU_VALUES_TAGGED")])
def test_dict_values_prefix_and_unused_slots_are_dead(version, field, tag):
    CLS, DICT = 0x7000, 0x7100
    V1, V2, V3 = 0x2000 + 8, 0x2100 + 16, 0x2200 + 8

    def instance(values):                   # pre-header (values, dict), GC head, object
        word = values if tag == "MU_VALUES_PLAIN" else values - 1
        pre = bytearray(32)
        struct.pack_into("<Q", pre, 32 + field, word)
        return bytes(pre) + struct.pack("<QQ", 1, CLS) + bytes(16)

    def dictobj(values):
        return bytes(16) + struct.pack("<6Q", 1, DICT, 1, 0, 0x2800, values)
    blocks = [(0x1000, instance(V1)), (0x1100, dictobj(V2)), (0x1200, instance(V3 + 8))]
    img, hw = _image_of(blocks, [(0x2000, 64), (0x2100, 128), (0x2200, 64)],
                        heads={0x1000: 3, 0x1200: 3})
    data = img.regions[0][1]
    for at, prefix, order, n in [(0x2000, 8, [0, 2, 1], 7), (0x2100, 16, [4], 14),
                                 (0x2200, 8, [1], 7)]:
        blk = values_block(prefix, order, n)
        data[at - 0x1000:at - 0x1000 + len(blk)] = blk
    pairs, counts = G.gc_stale_parts(img, hw, version, [], [CLS], field, getattr(lib, tag), [],
                                     [DICT], [])
    # instance: 3 slots in use of 7; dict: slot 4 the highest of 14; the third's word points
    # 8 bytes past its array (its prefix byte then reads as a slot: 0xee, not a prefix size)
    assert pairs == [(0x2000, V1), (V1 + 24, 0x2040), (0x2100, V2), (V2 + 40, 0x2180)]
    assert counts == (0, 2, 0, 0, 0, 0)
    # an order index beyond the slots: not an array we can read; nothing dead
    blk = values_block(8, [0, 9], 7)
    data[0x1000:0x1000 + len(blk)] = blk
    assert G.gc_stale_parts(img, hw, version, [], [CLS], field, getattr(lib, tag), [], [],
                            [])[0] == []


@pytest.mark.parametrize("version", [(3, 11), (3, 12)])
def test_non_compact_str_subclass_buffers_are_text(version):
    STR, OTHER = 0x7000, 0x7100
    utf8, data_field = L.str_buffer_fields(version)

    def strobj(tp, state, data, u8):
        body = bytearray(96)
        struct.pack_into("<QQQqI", body, 0, 1, tp, 10, -1, state)
        struct.pack_into("<Q", body, data_field, data)
        struct.pack_into("<Q", body, utf8, u8)
        return bytes(48) + bytes(body)      # pre-header and GC head (3.11+), then the str
    blocks = [(0x1000, strobj(STR, 0xc4, 0x2000, 0x2000)),   # ASCII: one buffer
              (0x1100, strobj(STR, 0x84, 0x2100, 0x2200)),   # non-ASCII with its utf8 copy
              (0x1200, strobj(STR, 0xe4, 0x2300, 0x2300)),   # compact: text inline, no rule
              (0x1300, strobj(OTHER, 0xc4, 0x2400, 0x2400))]
    img, hw = _image_of(blocks, [(a, 16) for a in (0x2000, 0x2100, 0x2200, 0x2300, 0x2400)],
                        heads={b: 5 for b, _ in blocks})    # the object after 32 + 16 bytes
    pairs, counts = G.gc_stale_parts(img, hw, version, [], [], 0, 0, [], [], [STR])
    assert pairs == [(0x2000, 0x2010), (0x2100, 0x2110), (0x2200, 0x2210)]
    assert counts == (0, 0, 2, 0, 0, 0)


def test_heap_types_name_copies_are_text():
    META, OTHER = 0x7000, 0x7100
    HEAP = 1 << 9

    def typeobj(meta, flags, name):
        body = bytearray(200)
        struct.pack_into("<QQ", body, 0, 1, meta)
        struct.pack_into("<Q", body, L.TP_NAME, name)
        struct.pack_into("<Q", body, L.TP_FLAGS, flags)
        return bytes(16) + bytes(body)
    blocks = [(0x1000, typeobj(META, HEAP, 0x2000)),        # PyType_FromSpec's copy: text
              (0x1100, typeobj(META, HEAP, 0x2108)),        # inside a str's data: no block
              (0x1200, typeobj(META, 0, 0x2200)),           # a static type: .rodata
              (0x1300, typeobj(OTHER, HEAP, 0x2300))]       # not a metatype's instance
    img, hw = _image_of(blocks, [(0x2000, 16), (0x2100, 48), (0x2200, 16), (0x2300, 16)])
    pairs, counts = G.gc_stale_parts(img, hw, (3, 13), [], [], 0, 0, [], [], [], metas=[META])
    assert pairs == [(0x2000, 0x2010)] and counts == (0, 0, 0, 0, 1, 0)


@pytest.mark.parametrize("mode, blocks", [("MU_FRAME_39", 120), ("MU_FRAME_310", 112)])
def test_old_frames_scalars_block_stack_and_slots_above_the_top_are_dead(mode, blocks):
    FRAME = 0x7000
    local = blocks + 240                # f_localsplus: 2 locals, then the value stack

    def frame(state_top):
        body = bytearray(local + 8 * 6)
        struct.pack_into("<QQq", body, 0, 1, FRAME, 6)
        struct.pack_into("<Q", body, 64, 0x1000 + 16 + local + 16)     # f_valuestack
        if mode == "MU_FRAME_39":
            struct.pack_into("<Q", body, 72, 0x1000 + 16 + local + 16 + 8 * state_top[1])
        else:
            struct.pack_into("<i", body, 80, state_top[1])
            struct.pack_into("<b", body, 108, state_top[0])
        return bytes(16) + bytes(body)
    img, hw = _image_of([(0x1000, frame((-1, 1)))])
    end = 0x1000 + 16 + local + 48
    obj = 0x1010
    pairs, counts = G.gc_stale_parts(img, hw, (3, 9), [], [], 0, 0, [], [], [],
                                     frame=(FRAME, blocks, getattr(lib, mode)))
    assert pairs == [(obj + blocks - 32, obj + blocks - 24), (obj + blocks - 16, obj + local),
                     (obj + local + 24, end)]
    assert counts == (0, 0, 0, 0, 0, 1)
    if mode == "MU_FRAME_310":          # running: its depth is stale, the stack is scanned
        img, hw = _image_of([(0x1000, frame((0, 1)))])
        pairs, _ = G.gc_stale_parts(img, hw, (3, 10), [], [], 0, 0, [], [], [],
                                    frame=(FRAME, blocks, getattr(lib, mode)))
        assert pairs == [(obj + blocks - 32, obj + blocks - 24), (obj + blocks - 16, obj + local)]


def _deque_image(objects, blocks):
    """HeapImage of deque objects [(address, type, len, leftblock, rightblock, leftindex,
    rightindex, freeblocks)] (GC objects: a 16-byte head, then 216 bytes) and raw blocks
    [(address, size, rightlink)], in one region from 0x1000; its head_word."""
    data = bytearray(0x3000)
    for a, tp, n, lb, rb, li, ri, free in objects:
        struct.pack_into("<QQqQQqqQqq", data, a + 16 - 0x1000, 1, tp, n, lb, rb, li, ri, 0, -1,
                         len(free))
        struct.pack_into(f"<{len(free)}Q", data, a + 16 + 80 - 0x1000, *free)
        struct.pack_into("<Q", data, a + 16 + 80 + 8 * len(free) - 0x1000, 0xdead0)  # stale
    for a, _size, right in blocks:
        struct.pack_into("<Q", data, a + 520 - 0x1000, right)
    alloc = sorted([(o[0], 16 + 216) for o in objects] + [(a, s) for a, s, _ in blocks])
    gc = {o[0] for o in objects}
    img = HeapImage(array("Q", [b for b, _ in alloc]), array("Q", [s for _, s in alloc]),
                    [(0x1000, data)])
    return img, bytes(1 if b in gc else 0 for b, _ in alloc)


@pytest.mark.parametrize("free_off", [0, T.DEQUE_FREE])
def test_deque_blocks_words_outside_the_items_are_dead(free_off):
    DEQ, OTHER = 0x9000, 0x9100
    objects = [
        # 10 items: data[60..64) of 0x1400 (560 bytes: 32 of slack), data[0..6) of 0x1800
        (0x1000, DEQ, 10, 0x1400, 0x1800, 60, 5, [0x2400]),
        # empty: its one block is dead whole (leftindex 32, rightindex 31), and its slack
        (0x1100, DEQ, 0, 0x1c00, 0x1c00, 32, 31, []),
        # a count that does not match the indexes: none
        (0x1200, DEQ, 11, 0x2800, 0x2800, 32, 31, []),
        # not a deque
        (0x1300, OTHER, 0, 0x2800, 0x2800, 32, 31, []),
    ]
    blocks = [(0x1400, 560, 0x1800), (0x1800, 528, 0), (0x1c00, 544, 0), (0x2400, 528, 0),
              (0x2800, 528, 0)]
    img, hw = _deque_image(objects, blocks)
    pairs, count = G.deque_dead_ranges(img, hw, [DEQ], free_off)
    first = [(0x1400, 0x1400 + 8 + 8 * 60), (0x1800 + 16 + 8 * 5, 0x1800 + 528),
             (0x1400 + 528, 0x1400 + 560)]
    empty = [(0x1c00, 0x1c00 + 8 + 8 * 32), (0x1c00 + 16 + 8 * 31, 0x1c00 + 528),
             (0x1c00 + 528, 0x1c00 + 544)]
    if free_off:        # 3.11+: the cached free block, and the unused slots after it
        first += [(0x2400, 0x2400 + 528), (0x1000 + 16 + 88, 0x1000 + 16 + 80 + 128)]
        empty += [(0x1100 + 16 + 80, 0x1100 + 16 + 80 + 128)]
    assert sorted(pairs) == sorted(first + empty) and count == 2
    # a chain that does not reach rightblock: that deque gives nothing
    blocks[0] = (0x1400, 560, 0x2400)
    img, hw = _deque_image(objects, blocks)
    pairs, count = G.deque_dead_ranges(img, hw, [DEQ], free_off)
    assert sorted(pairs) == sorted(empty) and count == 1


@pytest.mark.parametrize("version, int_param", [((3, 11), lib.MU_INT_OB_SIZE),
                                                ((3, 12), lib.MU_INT_LV_TAG),
                                                ((3, 14), lib.MU_INT_LV_TAG)])
def test_value_types_read_ints_floats_and_bytes_for_addresses(version, int_param):
    mem = memory(version)
    FLOAT, BYTES, INT15 = 0x7E00_0000_7000, 0x7E00_0000_7200, 0x7E00_0000_7400
    for t, name, basic, item in ((INT_TYPE, 48, 24, 4), (FLOAT, 64, 24, 0), (BYTES, 80, 33, 1),
                                 (INT15, 48, 24, 2)):
        body = bytearray(type_object(NAMES + name, 0))
        struct.pack_into("<qq", body, L.TP_BASICSIZE, basic, item)
        mem.blocks[t] = bytes(body)
    mem.blocks[NAMES] += b"float\0".ljust(16, b"\0") + b"bytes\0".ljust(16, b"\0")
    cp = SimpleNamespace(version=version, allocator="pymalloc",
                         layout=SimpleNamespace(frame_localsplus=80))
    statics = {"PyLong_Type": INT_TYPE, "PyFloat_Type": FLOAT, "PyBytes_Type": BYTES,
               "PyUnicode_Type": STR_TYPE}
    assert sorted(T.value_types(mem, cp, statics)) == sorted([
        (INT_TYPE, lib.MU_TYPE_INT << 8 | int_param << 16),
        (FLOAT, lib.MU_TYPE_FLOAT << 8),
        (BYTES, lib.MU_TYPE_BYTES << 8 | 32 << 16),
        (STR_TYPE, lib.MU_TYPE_STR << 8)])
    # 15-bit digits (uint16, a --enable-big-digits=15 build): not read, never scanned
    assert T.value_types(mem, cp, {"PyLong_Type": INT15}) == [(INT15, lib.MU_TYPE_OPAQUE << 8)]


def test_a_broken_gc_list_retakes_the_snapshot_while_a_thread_runs_user_code():
    # a thread stopped in user code may be linking an object into a GC list: retake (the
    # glibc heap's in-flight path); every thread inside a system call: nothing was moving
    from memunreachable._types import ThreadState
    from memunreachable.heaps.cpython.pipeline import retake_if_moving
    from memunreachable.heaps.glibc.validate import HeapInconsistent
    in_syscall = [0] * 27
    in_syscall[15] = 0          # read(2)
    in_user = list(in_syscall)
    in_user[15] = 0xFFFFFFFFFFFFFFFF
    waiting = ThreadState(7, tuple(in_syscall))
    retake_if_moving("has a back link that does not match", [waiting])    # no raise
    with pytest.raises(HeapInconsistent) as e:
        retake_if_moving("has a back link that does not match",
                         [waiting, ThreadState(8, tuple(in_user))])
    assert e.value.suspect_tids == [8] and "back link" in str(e.value)


def test_a_pass_in_the_background_gives_its_result_or_its_exception():
    """pipeline._in_background: the pass runs on another thread with the image's native
    arguments held (even once prepare() clears their cache), its result or its exception
    comes back at the join."""
    import threading
    from memunreachable.heaps.cpython import pipeline as P
    img = HeapImage(array("Q", [0x1000, 0x1040]), array("Q", [48, 48]), [(0x1000, bytearray(128))])
    started = threading.Event()
    go = threading.Event()

    def count(image, extra):
        started.set()
        go.wait(5)
        return G.image_args(image)[2] + extra, threading.current_thread().name

    res = P._in_background(count, img, 10)
    assert started.wait(5)
    G.IMAGE_ARGS.clear()                    # as prepare() does when it leaves
    go.set()
    assert res() == (12, "memunreachable-pipeline")

    def fail(image):
        raise ValueError("bad image")
    with pytest.raises(ValueError, match="bad image"):
        P._in_background(fail, img)()
    G.IMAGE_ARGS.clear()


def test_owned_data_cuts_the_bss_at_the_end_of_its_object_s_image():
    # a .data mapping, then an anonymous one that holds the rest of the .bss and a pymalloc
    # arena the kernel merged into it: the types search reads up to the image's end only
    from memunreachable._types import Mapping
    from memunreachable.stacks import elf
    path = "/lib/x86_64-linux-gnu/libc.so.6"
    head = open(path, "rb").read(elf.PAGE)
    span = elf.image_span(head)
    base = 0x7f0000000000
    bss_end = (base + span + 4095) & ~4095
    maps = [Mapping(base, base + 0x28000, "r--p", 0, "fe:00", 7, path),
            Mapping(bss_end - 0x8000, bss_end - 0x3000, "rw-p", 0x1e0000, "fe:00", 7, path),
            Mapping(bss_end - 0x3000, bss_end + (1 << 20), "rw-p", 0, "00:00", 0, ""),
            Mapping(bss_end + (2 << 20), bss_end + (3 << 20), "rw-p", 0, "00:00", 0, "")]

    class Mem:
        def read(self, addr, n):
            assert (addr, n) == (base, elf.PAGE)
            return head
    T._SPANS.clear()
    got = T.owned_data(Mem(), maps, {path})
    assert [(m.begin, m.end) for m in got] == [(bss_end - 0x8000, bss_end - 0x3000),
                                               (bss_end - 0x3000, bss_end)]

    class Unreadable:
        def read(self, addr, n):
            raise T.MemoryUnreadable("gone")
    T._SPANS.clear()            # headers that do not read: the mapping is left whole
    got = T.owned_data(Unreadable(), maps, {path})
    assert got[-1].end == bss_end + (1 << 20)
    T._SPANS.clear()


def test_dict_headers_makes_dict_s_sized_rule_a_dict_rule_on_every_version():
    # 3.11+: a sized rule; 3.8-3.10: sized and dead at zero, a var-sized rule of no items
    d, other = 0x5000, 0x6000
    sized = 16 | lib.MU_TYPE_SIZED << 8 | 48 << 16
    no_items = 16 | lib.MU_TYPE_VARSIZED << 8 | 48 << 16
    tuple_like = 16 | lib.MU_TYPE_VARSIZED << 8 | 24 << 16 | 8 << 48
    dict_code = 16 | lib.MU_TYPE_DICT << 8 | 48 << 16
    for code in (sized, no_items):
        assert T.dict_headers([(d, code), (other, code)], d) == [(d, dict_code), (other, code)]
    assert T.dict_headers([(d, tuple_like)], d) == [(d, tuple_like)]     # items: not a dict's
    assert T.dict_headers([(d, sized)], None) == [(d, sized)]            # no PyDict_Type found



def test_member_entries_read_only_a_member_def_array():
    name, doc = 0x7F00_0000_1000, 0x7F00_0000_2000
    def entry(n=name, kind=6, offset=24, flags=1, d=doc, pad=0x7F00):
        return struct.pack("<QiiqiiQ", n, kind, pad, offset, flags, pad, d)
    good = entry() + entry(kind=19, offset=32, flags=0, d=0) + bytes(40)
    assert T.member_entries(good) == 2
    assert T.member_entries(good + entry()) == 2              # past the sentinel: not read
    assert T.member_entries(bytes(40)) == 0
    # scipy's dangling tp_members: a code object took the freed array's block (ob_refcnt 2
    # where a name would be), its co_localsplusnames and co_localspluskinds then read as
    # member numbers
    code = struct.pack("<QQQQQQ", 2, 0x7F00_0000_5B00, 0x12, 0x7F00_0000_CB58,
                       0x7F00_0000_CB58, 0x7F00_0000_08A8) + bytes(40)
    assert T.member_entries(code) is None
    for bad in (entry(n=0x12), entry(kind=32), entry(kind=-1), entry(flags=256),
                entry(d=0x10)):
        assert T.member_entries(bad + bytes(40)) is None
    # the words the rule makes dead may hold anything (a stale pointer's high half in the
    # padding; the test of member padding plants an address in the offset)
    assert T.member_entries(entry(offset=0x7F00_1234_5670, pad=-1) + bytes(40)) == 1
    assert T.member_entries(entry() + entry()) is None        # no sentinel
