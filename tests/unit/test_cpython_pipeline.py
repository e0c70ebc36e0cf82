"""Unit tests of cpython/pipeline.py (merging pymalloc into the allocations) and
cpython/objects.py (naming objects, telling cyclic garbage from leaks), on in-memory data."""
import struct
from array import array
from types import SimpleNamespace

import pytest

from memunreachable._types import BufferMemory, HeapImage, Range
from memunreachable.cpython import layout as L
from memunreachable.cpython import objects as O
from memunreachable.cpython import pipeline as P

A = 0x5555_0000_0000
POOL = 0x7F00_0000_0000


def image(begins, sizes, regions):
    return HeapImage(array("Q", begins), array("Q", sizes), regions)


def test_merge_disjoint_regions_in_address_order():
    glibc = image([A + 16, A + 64], [40, 24], [(A, bytearray(128))])
    py = image([POOL + 48, POOL + 64], [16, 16], [(POOL, bytearray(4096))])
    m = P.merge_images(glibc, py)
    assert list(m.begins) == [A + 16, A + 64, POOL + 48, POOL + 64]
    assert list(m.sizes) == [40, 24, 16, 16]
    assert [b for b, _ in m.regions] == [A, POOL]


def test_merge_overlapping_copies_of_one_mapping():
    # glibc copied a whole anonymous mapping that also holds a pymalloc arena
    glibc = image([A + 16], [40], [(A, bytearray(b"g" * 0x3000))])
    py = image([A + 0x1030, A + 0x1040], [16, 16], [(A + 0x1000, bytearray(b"p" * 0x1000))])
    m = P.merge_images(glibc, py)
    assert list(m.begins) == [A + 16, A + 0x1030, A + 0x1040]
    assert len(m.regions) == 1 and m.regions[0][0] == A       # the covering copy is kept
    # neither covers the other: one new copy of the union, both parts in it
    glibc = image([A + 16], [40], [(A, bytearray(b"g" * 0x1800))])
    m = P.merge_images(glibc, py)
    (base, buf), = m.regions
    assert base == A and len(buf) == 0x2000
    assert bytes(buf[:4]) == b"gggg" and bytes(buf[0x1fff:0x2000]) == b"p"


def test_merge_rejects_overlapping_allocations():
    glibc = image([A + 0x1020], [64], [(A, bytearray(0x3000))])
    py = image([A + 0x1030], [16], [(A + 0x1000, bytearray(0x1000))])
    with pytest.raises(ValueError):
        P.merge_images(glibc, py)


def test_pools_overlapping_glibc_allocations_are_dropped():
    ps = 4096
    cp = SimpleNamespace(blocks=array("Q", [POOL + 48, POOL + 64, POOL + ps + 48]),
                         sizes=array("Q", [16, 16, 32]),
                         heap_ranges=[Range(POOL, POOL + 2 * ps)])
    glibc = image([POOL + ps + 16], [400], [(POOL + ps, bytearray(ps))])    # inside pool 2
    blocks, sizes, kept, dropped = P.drop_overlapping(cp, glibc, ps)
    assert (list(blocks), list(sizes), dropped) == ([POOL + 48, POOL + 64], [16, 16], 1)
    assert kept == [Range(POOL, POOL + ps)]
    blocks, _, kept, dropped = P.drop_overlapping(cp, image([A], [16], [(A, bytearray(16))]), ps)
    assert dropped == 0 and list(blocks) == list(cp.blocks)


def test_drop_blocks():
    img = image([A, A + 32, A + 64, A + 96], [16, 16, 16, 16], [(A, bytearray(128))])
    out, n = P.drop_blocks(img, [A + 32, A + 96, A + 8])
    assert (list(out.begins), n) == ([A, A + 64], 2)


# --- objects -------------------------------------------------------------------------------
TYPE_TYPE, LIST_TYPE, STR_TYPE, INT_TYPE = 0x7E00_0000_0000, 0x7E00_0000_1000, 0x7E00_0000_2000, 0x7E00_0000_3000
NAMES = 0x7E00_0001_0000
HAVE_GC = 1 << 14


def type_object(name_addr, flags):
    t = bytearray(400)
    struct.pack_into("<QQ", t, 0, 1, TYPE_TYPE)
    struct.pack_into("<Q", t, 24, name_addr)
    struct.pack_into("<Q", t, 168, flags)
    return bytes(t)


def memory(version=(3, 12)):
    blocks = {TYPE_TYPE: type_object(NAMES, 0), LIST_TYPE: type_object(NAMES + 16, HAVE_GC),
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
    garbage, internal = O.split_garbage(begins, sizes, range(7), objs,
                                        lambda i: array("Q", words[i]))
    assert garbage == {0, 1}
    assert internal == {0: 1, 1: 1, 2: 1, 4: 1}
    # a non-object block that holds an object pointer and only garbage reaches: garbage too
    words[6] = [objs[0].address]
    garbage, _ = O.split_garbage(begins, sizes, range(7), objs, lambda i: array("Q", words[i]))
    assert garbage == {0, 1, 6}
    # a dead object (refcount 0) has no edges and explains nothing: Y's count is a surplus,
    # Y is leaked, and so is what it reaches
    objs[0] = O.PyObjectInfo(begins[0] + 16, "list", 0)
    garbage, internal = O.split_garbage(begins, sizes, range(7), objs, lambda i: array("Q", words[i]))
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
    garbage, _ = O.split_garbage(begins, sizes, range(7), objs, lambda i: array("Q", words[i]))
    assert garbage == {0, 1, 2, 3, 5, 6}
    # without the typed fields (the rule before): both buffers read as native leaks
    plain = dict(objs)
    plain[0], plain[1] = O.PyObjectInfo(d.address, "dict", 1), O.PyObjectInfo(x.address, "list", 1)
    garbage, _ = O.split_garbage(begins, sizes, range(7), plain, lambda i: array("Q", words[i]))
    assert garbage == {0, 1, 5, 6}


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
    assert P.type_docs(img, head_word, [META]) == [Range(0x2000, 0x2028)]
    assert P.type_docs(img, head_word, [META, OTHER_META]) == [Range(0x2000, 0x2028),
                                                               Range(0x2100, 0x2128)]
    assert P.type_docs(img, head_word, []) == []


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
    assert P.list_slack(img, head_word, LIST) == [Range(0x2010, 0x2028), Range(0x2300, 0x2310)]
    assert P.list_slack(img, bytes(len(blocks)), LIST) == []     # no GC objects known


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
    assert P.io_buffers(img, head_word, [WRITER]) == [Range(0x3000, 0x3000 + 4104)]
    assert P.io_buffers(img, head_word, []) == []
