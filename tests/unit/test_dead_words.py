"""Unit tests of the dead-word mask (mark.DeadWords, native mu_dead) and the CPython GC list
walk (native mu_gc_walk, cpython/gclinks.py), on in-memory heaps.

A GC-tracked object sits in a block after its PyGC_Head (two link words): those words, and the
generation list heads, must keep nothing alive (cpython-memory.md section 4).
"""
import errno
import struct
from array import array

import pytest

from memunreachable._ffi import ffi, lib
from memunreachable.sweep.folding import FoldedLeak, fold
from memunreachable.sweep.mark import DeadWords, mark, scanned_blocks
from tests.unit.test_mark import BASE, ROOT, Heap, words_buffer


def test_dead_range_in_root_keeps_nothing():
    h = Heap([32, 32])
    root = words_buffer(h.addrs[0], h.addrs[1])
    res = mark(h.image(), [(ROOT, root)], dead=DeadWords(ranges=[(ROOT + 8, ROOT + 16)]))
    assert list(res.marked) == [1, 0]
    assert res.words == 1 + 4                # one root word, the 4 words of block 0
    res = mark(h.image(), [(ROOT, root)])
    assert list(res.marked) == [1, 1] and res.words == 2 + 8


def test_dead_range_inside_an_allocation():
    # the 3.10 interpreter is a glibc chunk: its free-list array words are dead
    h = Heap([64, 16, 16])
    h.link(0, 2, 1)
    h.link(0, 5, 2)
    a0 = h.addrs[0]
    dead = DeadWords(ranges=[(a0 + 16, a0 + 24)])
    res = mark(h.image(), [], [a0], dead=dead)
    assert list(res.marked) == [1, 0, 1]
    # fold: the dead word is no edge either
    assert fold(h.image(), bytearray(3), dead=dead) == [FoldedLeak(0, 1, 16, [2]), FoldedLeak(1, 0, 0)]
    assert fold(h.image(), bytearray(3)) == [FoldedLeak(0, 2, 32, [1, 2])]


def test_head_word_skips_two_link_words_only():
    # A: [gc_next -> B][gc_prev -> C][ob_refcnt][ob_type -> D]: the links keep neither B nor C
    h = Heap([32, 32, 32, 32])
    h.link(0, 0, 1)
    h.link(0, 1, 2)
    h.link(0, 3, 3)
    hw = bytearray([1, 0, 0, 0])            # a PyGC_Head at word 0 of allocation 0
    res = mark(h.image(), [], [h.addrs[0] + 16], dead=DeadWords(head_word=hw))
    assert list(res.marked) == [1, 0, 0, 1]
    hw = bytearray([2, 0, 0, 0])            # at word 1 (debug-hook prefix): words 1, 2
    res = mark(h.image(), [], [h.addrs[0] + 24], dead=DeadWords(head_word=hw))
    assert list(res.marked) == [1, 1, 0, 1]
    assert fold(h.image(), bytearray([0, 1, 1, 0]), dead=DeadWords(head_word=bytearray([1, 0, 0, 0]))) \
        == [FoldedLeak(0, 1, 32, [3])]


def test_partial_last_word_and_dead_ranges_together():
    h = Heap([20, 16])                       # a 20-byte block: last word starts at +16
    h.link(0, 2, 1)
    res = mark(h.image(), [], [h.addrs[0]], dead=DeadWords(ranges=[(h.addrs[0], h.addrs[0] + 8)]))
    assert list(res.marked) == [1, 1]
    res = mark(h.image(), [], [h.addrs[0]],
               dead=DeadWords(ranges=[(h.addrs[0] + 16, h.addrs[0] + 24)]))
    assert list(res.marked) == [1, 0]


def test_bad_dead_ranges_rejected():
    h = Heap([16])
    for ranges in ([(ROOT + 8, ROOT + 8)], [(ROOT + 4, ROOT + 16)],
                   [(ROOT + 16, ROOT + 32), (ROOT, ROOT + 24)]):
        with pytest.raises(OSError) as e:
            mark(h.image(), [], dead=DeadWords(ranges=ranges))
        assert e.value.errno == errno.EINVAL
    with pytest.raises(ValueError):
        mark(h.image(), [], dead=DeadWords(head_word=bytearray(2)))


# --- the GC list walk -----------------------------------------------------------------------
HEAD = 0x5555_0000_1000


def gc_heap(n, gc_off=0, gap=16):
    """n 48-byte blocks, each with a PyGC_Head at gc_off, linked into one circular list
    with HEAD; returns (heap, head triple)."""
    h = Heap([48] * n, gap=gap)
    nodes = [a + gc_off for a in h.addrs]
    ring = [HEAD] + nodes
    for k, node in enumerate(nodes, start=1):
        nxt, prv = ring[(k + 1) % len(ring)], ring[k - 1]
        struct.pack_into("<QQ", h.buf, node - h.base, nxt | (1 if k == 2 else 0), prv | 2)
    return h, (HEAD, nodes[0] if nodes else HEAD, nodes[-1] if nodes else HEAD)


def gc_walk(h, heads, max_nodes=1 << 20):
    img = h.image()
    hw = bytearray(len(img.begins))
    st = ffi.new("mu_gc_walk_stats *")
    flat = array("Q", [w for t in heads for w in t])
    rc = lib.mu_gc_walk(ffi.from_buffer("uint64_t[]", img.begins), ffi.from_buffer("uint64_t[]", img.sizes),
                        len(img.begins), *_regions(img), ffi.from_buffer("uint64_t[]", flat), len(heads),
                        max_nodes, ffi.from_buffer("uint8_t[]", hw), ffi.NULL, 0, st)
    return rc, hw, st


_keep = []


def _regions(img):
    from memunreachable._ffi import region_array
    r, keep = region_array(img.regions)
    _keep.append(keep)
    return r, len(img.regions)


def test_gc_walk_marks_every_head():
    h, head = gc_heap(5)
    rc, hw, st = gc_walk(h, [head])
    assert rc == 5 and list(hw) == [1] * 5
    h, head = gc_heap(3, gc_off=16)
    rc, hw, _ = gc_walk(h, [head])
    assert rc == 3 and list(hw) == [3] * 3
    h, head = gc_heap(0)
    assert gc_walk(h, [head])[0] == 0


def test_gc_walk_lists_each_type_once():
    """The types of the GC objects, ascending, each once: runs of one type, types that share
    a slot of the walk's cache of recent types, and the all-ones and zero words."""
    import random
    rng = random.Random(9)
    pool = [0x7000_0000 + 0x1000 * k for k in range(600)]
    kinds = [(1 << 64) - 1, 0] + [t for t in rng.choices(pool, k=3000)      # each first once
                                  for _ in range(rng.randrange(1, 4))]
    h, head = gc_heap(len(kinds))
    for a, tp in zip(h.addrs, kinds):
        struct.pack_into("<Q", h.buf, a + 24 - h.base, tp)
    img = h.image()
    hw, out = bytearray(len(img.begins)), array("Q", bytes(8 * 1000))
    st = ffi.new("mu_gc_walk_stats *")
    flat = array("Q", head)
    rc = lib.mu_gc_walk(ffi.from_buffer("uint64_t[]", img.begins), ffi.from_buffer("uint64_t[]", img.sizes),
                        len(img.begins), *_regions(img), ffi.from_buffer("uint64_t[]", flat), 1,
                        1 << 20, ffi.from_buffer("uint8_t[]", hw), ffi.from_buffer("uint64_t[]", out),
                        len(out), st)
    assert rc == len(kinds)
    assert list(out[:st.ntypes]) == sorted(set(kinds))


def test_gc_walk_rejects_broken_lists():
    h, head = gc_heap(4)
    assert gc_walk(h, [head], max_nodes=3)[0] == -errno.ELOOP
    # a prev link that does not point back
    struct.pack_into("<Q", h.buf, h.addrs[2] + 8 - h.base, h.addrs[0])
    rc, _, st = gc_walk(h, [head])
    assert rc == -errno.EPROTO and st.bad_node == h.addrs[2]
    # a node outside every allocation
    h, head = gc_heap(3)
    struct.pack_into("<Q", h.buf, h.addrs[0] - h.base, ROOT)
    rc, _, st = gc_walk(h, [head])
    assert rc == -errno.EFAULT and st.bad_node == ROOT
    # a node met twice (a loop that never returns to the head)
    h, head = gc_heap(3)
    struct.pack_into("<QQ", h.buf, h.addrs[2] - h.base, h.addrs[1], h.addrs[1])
    assert gc_walk(h, [head])[0] in (-errno.ELOOP, -errno.EPROTO)
    # the head's prev must be the last node
    h, head = gc_heap(3)
    assert gc_walk(h, [(head[0], head[1], h.addrs[0])])[0] == -errno.EPROTO


def test_gc_walk_in_any_order_and_next_allocation_nodes_checked_as_others():
    """The walk tries the allocation after the last node's first (objects made one after
    another): a list in any order gives the same heads, and a node inside that next allocation
    is still refused when misaligned or too close to its end."""
    import random
    order = list(range(40))
    random.Random(3).shuffle(order)
    order[10:20] = sorted(order[10:20])         # a run in address order within the shuffle
    h = Heap([48] * 40)
    nodes = [h.addrs[k] for k in order]
    ring = [HEAD] + nodes
    for k, node in enumerate(nodes, start=1):
        struct.pack_into("<QQ", h.buf, node - h.base, ring[(k + 1) % len(ring)], ring[k - 1])
    rc, hw, st = gc_walk(h, [(HEAD, nodes[0], nodes[-1])])
    assert rc == 40 and list(hw) == [1] * 40 and st.nodes == 40
    for bad in (h.addrs[1] + 4, h.addrs[1] + 40):       # misaligned; its 16 bytes past the end
        h, head = gc_heap(3)
        struct.pack_into("<Q", h.buf, h.addrs[0] - h.base, bad)
        rc, _, st = gc_walk(h, [head])
        assert rc == -errno.EFAULT and st.bad_node == bad


def test_gc_links_keep_nothing_alive_and_objects_still_reach():
    # three GC objects in one list; only the middle one is referenced from a root; its
    # links point at its neighbours' heads, which must not keep them
    h, head = gc_heap(3)
    rc, hw, _ = gc_walk(h, [head])
    assert rc == 3
    root = words_buffer(h.addrs[1] + 16)
    res = mark(h.image(), [(ROOT, root)], dead=DeadWords(head_word=hw))
    assert list(res.marked) == [0, 1, 0]
    res = mark(h.image(), [(ROOT, root)])
    assert list(res.marked) == [1, 1, 1]
    assert fold(h.image(), bytearray(3), dead=DeadWords(head_word=hw)) == \
        [FoldedLeak(0, 0, 0), FoldedLeak(1, 0, 0), FoldedLeak(2, 0, 0)]


def test_pointer_into_a_gc_head_is_no_reference():
    # a stale copy of a GC link (pointing at the head, not the object) keeps nothing
    h, head = gc_heap(2)
    rc, hw, _ = gc_walk(h, [head])
    assert rc == 2
    for delta, kept in ((0, 0), (8, 0), (15, 0), (16, 1), (40, 1)):
        root = words_buffer(h.addrs[1] + delta)
        res = mark(h.image(), [(ROOT, root)], dead=DeadWords(head_word=hw))
        assert list(res.marked) == [0, kept], delta
    h, head = gc_heap(2, gc_off=16)          # debug-hook prefix: head at +16, object at +32
    rc, hw, _ = gc_walk(h, [head])
    for delta, kept in ((0, 0), (16, 0), (31, 0), (32, 1)):
        res = mark(h.image(), [(ROOT, words_buffer(h.addrs[1] + delta))], dead=DeadWords(head_word=hw))
        assert list(res.marked) == [0, kept], delta


# --- objects whose words are not scanned (mu_dead types) ------------------------------------
INT_TYPE, TUPLE_TYPE, STR_TYPE = 0x7F00_0000_1000, 0x7F00_0000_2000, 0x7F00_0000_3000
OPAQUE, STR, DEAD = lib.MU_TYPE_OPAQUE << 8, lib.MU_TYPE_STR << 8, lib.MU_TYPE_DEAD_AT_ZERO << 8


def typed_heap(first_words, target_size=16):
    """Block 0 (64 bytes) starts with first_words and points at block 1 from its last word."""
    h = Heap([64, target_size])
    for k, w in enumerate(first_words):
        h.point(0, k, w)
    h.link(0, 7, 1)
    return h


@pytest.mark.parametrize("words, types, kept", [
    ([1, INT_TYPE], [(INT_TYPE, 0 | OPAQUE)], 0),                  # an int: not scanned
    ([0xFFFFFFFF, INT_TYPE], [(INT_TYPE, 0 | OPAQUE)], 0),         # immortal (3.12, 3.13)
    ([0x0001_0000_C000_0000, INT_TYPE], [(INT_TYPE, 0 | OPAQUE)], 0),   # immortal (3.14+)
    ([0x0005_0000_C000_0000, INT_TYPE], [(INT_TYPE, 0 | OPAQUE)], 0),   # static immortal
    ([0xC000_0000, INT_TYPE], [(INT_TYPE, 0 | OPAQUE)], 1),        # no flags: a non-PIE address
    ([0x0001_0000_9000_0000, INT_TYPE], [(INT_TYPE, 0 | OPAQUE)], 0),   # decayed, interned
    ([0x0001_0001_C000_0000, INT_TYPE], [(INT_TYPE, 0 | OPAQUE)], 1),   # no count: a pointer
    ([0x7000_0000, INT_TYPE], [(INT_TYPE, 0 | OPAQUE)], 1),        # 1.9 G references: no
    ([BASE + 0x500, INT_TYPE], [(INT_TYPE, 0 | OPAQUE)], 1),       # an item array [x, int]
    ([1, INT_TYPE], [(INT_TYPE, 16 | OPAQUE)], 1),                 # wrong offset for the type
    ([0, 0, 0, TUPLE_TYPE], [(TUPLE_TYPE, 16 | DEAD)], 0),         # a dead GC tuple
    ([0, 0, 1, TUPLE_TYPE], [(TUPLE_TYPE, 16 | DEAD)], 1),         # a live one
    ([1, STR_TYPE, 3, 0, 0x64], [(STR_TYPE, 0 | STR)], 0),         # compact ASCII str (kind 1)
    ([1, STR_TYPE, 3, 0, 0x28], [(STR_TYPE, 0 | STR)], 1),         # compact, kind 2, not ASCII
])
def test_typed_objects_scanned_or_not(words, types, kept):
    h = typed_heap(words)
    dead = DeadWords(types=types)
    res = mark(h.image(), [], [h.addrs[0]], dead=dead)
    assert list(res.marked) == [1, kept]
    entries = fold(h.image(), bytearray(2), dead=dead)
    assert entries == ([FoldedLeak(0, 1, 16, [1])] if kept else [FoldedLeak(0, 0, 0), FoldedLeak(1, 0, 0)])


def test_bad_types_rejected():
    h = Heap([16])
    for types in ([(INT_TYPE, 3 | OPAQUE)], [(INT_TYPE, 0 | (lib.MU_TYPE_LAST + 1) << 8)],
                  [(STR_TYPE, 0), (INT_TYPE, 0)]):
        with pytest.raises(OSError) as e:
            mark(h.image(), [], dead=DeadWords(types=types))
        assert e.value.errno == errno.EINVAL


FRAME_TYPE = 0x7F00_0000_4000
FRAME = lib.MU_TYPE_FRAME << 8


@pytest.mark.parametrize("stacktop, owned, kept", [
    (2, True, [1, 1, 0, 1]),     # slots 0-1 live (block 1), slot 5 above stacktop: stale
    (6, True, [1, 1, 1, 1]),     # stacktop covers slot 5: both live
    (2, False, [1, 0, 0, 1]),    # the frame runs elsewhere: its inline data is unwritten
    (-1, True, [1, 1, 1, 1]),    # an impossible stacktop: scanned whole
])
def test_frame_object_scanned_up_to_its_stacktop(stacktop, owned, kept):
    # a 3.11+ frame object (GC head at 0, object at 16) owning its frame data at object + 48:
    # the data's stacktop (int at +64) bounds the live slots (from +72); f_back (+16, block 3)
    # is live in every case
    h = Heap([256, 16, 16, 16])
    data = h.addrs[0] + 16 + 48
    for slot, w in enumerate([0, 0, 1, FRAME_TYPE, 0, data if owned else BASE + 0x9000]):
        h.point(0, slot, w)
    struct.pack_into("<i", h.buf, data + 64 - h.base, stacktop)
    h.link(0, (data + 72 - h.addrs[0]) // 8, 1)           # slot 0
    h.link(0, (data + 72 - h.addrs[0]) // 8 + 5, 2)       # slot 5
    h.link(0, 4, 3)                                       # f_back
    dead = DeadWords(types=[(FRAME_TYPE, 16 | FRAME | 48 << 16)])
    res = mark(h.image(), [], [h.addrs[0]], dead=dead)
    assert list(res.marked) == kept
    folded = fold(h.image(), bytearray(4), dead=dead)
    assert folded[0].referenced_count == sum(kept) - 1


SIZED = lib.MU_TYPE_SIZED << 8
DICT_TYPE = 0x7F00_0000_5000
DICT_CODE = 16 | lib.MU_TYPE_DICT << 8 | 48 << 16


@pytest.mark.parametrize("tracked", [True, False])
@pytest.mark.parametrize("code, kept", [
    (DICT_CODE, [1, 0, 1, 0]),                  # the version tag (object + 24) is an integer
    (16 | SIZED | 48 << 16, [1, 1, 1, 0]),      # a sized type's header words are scanned
])
def test_a_dicts_version_tag_is_no_reference(tracked, code, kept):
    # a dict (GC head at 0, object at 16: refcount, type, ma_used, version tag, ma_keys,
    # ma_values); the allocator's slack after its 48 bytes is dead either way
    h = Heap([80, 16, 16, 16])
    for slot, w in enumerate([0, 0, 1, DICT_TYPE, 3]):
        h.point(0, slot, w)
    h.link(0, 5, 1)                     # the version tag
    h.link(0, 6, 2)                     # ma_keys
    h.link(0, 8, 3)                     # block offset 64: slack
    dead = DeadWords(types=[(DICT_TYPE, code)],
                     head_word=bytearray([1, 0, 0, 0]) if tracked else None)
    assert list(mark(h.image(), [], [h.addrs[0] + 16], dead=dead).marked) == kept
    folded = fold(h.image(), bytearray(4), dead=dead)
    assert folded[0].referenced_count == sum(kept) - 1


@pytest.mark.parametrize("refcnt, head, kept", [
    (0, (0, 0), [1, 0, 0]),         # a free-listed dict (3.8-3.13): its words are stale
    (1, (0, 0), [1, 1, 0]),         # a live untracked dict: its ma_keys is a reference
    (0, (BASE, BASE), [1, 1, 1]),   # refcount 0 but linked: no rule holds, all scanned
])
def test_a_free_listed_dict_holds_no_references(refcnt, head, kept):
    # 3.8-3.10 gave dicts the dead-at-zero rule of every GC type; made MU_TYPE_DICT (for its
    # version tag) they keep it: a dict's refcount is 0 only on the free list
    h = Heap([80, 16, 16])
    for slot, w in enumerate(list(head) + [refcnt, DICT_TYPE, 3]):
        h.point(0, slot, w)
    h.link(0, 6, 1)                     # ma_keys
    h.link(0, 8, 2)                     # block offset 64: slack
    dead = DeadWords(types=[(DICT_TYPE, DICT_CODE)])
    assert list(mark(h.image(), [], [h.addrs[0] + 16], dead=dead).marked) == kept


@pytest.mark.parametrize("basic, kept", [
    (40, [1, 1, 0]),        # object ends at 16 + 40: the word at 64 is allocator slack
    (56, [1, 1, 1]),        # the type says the object reaches it: scanned
])
def test_sized_objects_scanned_up_to_their_basicsize(basic, kept):
    h = Heap([80, 16, 16])              # GC head at 0, object at 16
    for slot, w in enumerate([0, 0, 1, INT_TYPE + 0x100]):
        h.point(0, slot, w)
    h.link(0, 4, 1)                     # inside the object
    h.link(0, 8, 2)                     # at block offset 64
    dead = DeadWords(types=[(INT_TYPE + 0x100, 16 | SIZED | basic << 16)])
    assert list(mark(h.image(), [], [h.addrs[0]], dead=dead).marked) == kept


@pytest.mark.parametrize("code, tracked, kept", [
    (0 | SIZED | 64 << 16 | 4 << 48 | 2 << 56, False, [1, 1, 0, 0, 1]),  # words 4-5 unwritten
    (0 | SIZED | 64 << 16, False, [1, 1, 1, 1, 1]),                      # no such words
    (0 | SIZED | 64 << 16 | 4 << 48 | 1 << 56, False, [1, 1, 0, 1, 1]),  # word 4 only
    (16 | SIZED | 64 << 16 | 4 << 48 | 2 << 56, True, [1, 1, 1, 1, 1]),  # GC links win
])
def test_a_sized_object_s_unwritten_words_are_no_references(code, tracked, kept):
    # a 3.14 code object's _co_unique_id and _co_firsttraceable's padding (words 23-24 of a
    # default build's header): no write reaches them, so a block's earlier user's words stay
    h = Heap([80, 16, 16, 16, 16])
    off = code & 0xff
    for slot, w in enumerate([0, 0] * (off // 16) + [1, INT_TYPE + 0x100]):
        h.point(0, slot, w)
    start = off // 8
    h.link(0, start + 3, 1)             # a header word before them
    h.link(0, start + 4, 2)
    h.link(0, start + 5, 3)
    h.link(0, 8 if off else 7, 4)       # after them, inside the object (or the slack)
    dead = DeadWords(types=[(INT_TYPE + 0x100, code)],
                     head_word=bytearray([1, 0, 0, 0, 0]) if tracked else None)
    assert list(mark(h.image(), [], [h.addrs[0] + off], dead=dead).marked) == kept
    folded = fold(h.image(), bytearray(5), dead=dead)
    assert folded[0].referenced_count == sum(kept) - 1


# --- dict key tables: the allocator's slack after them ----------------------------------------

def keys_311(h, k, log2=3, kind=1, used=2, at=0):
    """A 3.11+ PyDictKeysObject in block k (`at` bytes in): 32-byte header, 1 << log2 index
    bytes, 16-byte entries (24 for kind 0) x USABLE_FRACTION; returns its size."""
    frac = ((1 << log2) << 1) // 3
    off = h.addrs[k] + at - h.base
    struct.pack_into("<QBBBxIqq", h.buf, off, 1, log2, log2, kind, 0, frac - used, used)
    return 32 + (1 << log2) + (24 if kind == 0 else 16) * frac


def keys_38(h, k, size=8, used=2, at=0):
    """A 3.8-3.10 PyDictKeysObject: {refcnt, dk_size, dk_lookup, dk_usable, dk_nentries}."""
    frac = (size << 1) // 3
    struct.pack_into("<5Q", h.buf, h.addrs[k] + at - h.base, 1, size, 0x7F00_0000_1000,
                     frac - used, used)
    return 40 + size + 24 * frac


def debug_hooks_block(h, k, requested):
    """CPython's debug hooks around `requested` bytes of block k: the 16-byte prefix (the size,
    big-endian, the API's letter, 7 forbidden bytes) and the 8 forbidden bytes after them."""
    off = h.addrs[k] - h.base
    h.buf[off:off + 16] = requested.to_bytes(8, "big") + b"m" + b"\xfd" * 7
    h.buf[off + 16 + requested:off + 24 + requested] = b"\xfd" * 8


@pytest.mark.parametrize("layout, make, block", [
    (lib.MU_DICT_KEYS_311, keys_311, 128),     # 120-byte table in a 128-byte pymalloc block
    (lib.MU_DICT_KEYS_38, keys_38, 176),       # 168-byte table in a 176-byte pymalloc block
])
def test_dict_key_table_slack_is_not_scanned(layout, make, block):
    h = Heap([block, 32, 32])
    size = make(h, 0)
    assert block - 16 < size < block
    h.link(0, size // 8, 1)                    # a stale pointer in the slack
    h.link(0, 5, 2)                            # a live one inside the table (an entry's key)
    roots = [h.addrs[0]]
    res = mark(h.image(), [], roots, dead=DeadWords(dict_keys=layout))
    assert list(res.marked) == [1, 0, 1]
    res = mark(h.image(), [], roots)
    assert list(res.marked) == [1, 1, 1]
    # the fold agrees: the stale word does not make block 1 part of block 0's leak
    leaks = fold(h.image(), bytearray(3), dead=DeadWords(dict_keys=layout))
    assert {(e.index, e.referenced_count) for e in leaks} == {(0, 1), (1, 0)}


@pytest.mark.parametrize("layout, make, block", [
    (lib.MU_DICT_KEYS_311, keys_311, 128),
    (lib.MU_DICT_KEYS_38, keys_38, 176),
])
def test_a_dict_key_table_s_header_is_no_reference(layout, make, block):
    # under a non-PIE interpreter the heap lies in the first GiB: a 3.11 table's second word
    # (log2 sizes, kind, a padding byte 0x40, its version 0) read 0x40010606, inside a leaked
    # block; a 3.8-3.10 table's third is its lookup function
    h = Heap([block, 0x20000], base=0x4000_0000)
    make(h, 0)
    if layout == lib.MU_DICT_KEYS_311:
        h.buf[11] = 0x40                       # the padding byte
        assert h.addrs[1] < struct.unpack_from("<Q", h.buf, 8)[0] < h.addrs[1] + 0x20000
    else:
        h.link(0, 2, 1, 0x1000)                # dk_lookup, a number
    keys = DeadWords(dict_keys=layout)
    assert list(mark(h.image(), [], [h.addrs[0]], dead=keys).marked) == [1, 0]
    assert list(mark(h.image(), [], [h.addrs[0]]).marked) == [1, 1]    # the rule off: a word
    leaks = fold(h.image(), bytearray(2), dead=keys)
    assert {(e.index, e.referenced_count) for e in leaks} == {(0, 0), (1, 0)}
    h.link(0, 7, 1)                            # an entry's key: a reference
    assert list(mark(h.image(), [], [h.addrs[0]], dead=keys).marked) == [1, 1]


def test_dict_key_table_rule_needs_every_field_consistent():
    h = Heap([128, 32])
    size = keys_311(h, 0)
    h.link(0, size // 8, 1)
    bad = [(8, 4),            # log2_size 4 with index bytes for 3: inconsistent
           (10, 3),           # kind 3 does not exist
           (0, 0)]            # refcount 0
    for off, value in bad:
        saved = bytes(h.buf[h.addrs[0] - h.base:h.addrs[0] - h.base + 16])
        h.buf[h.addrs[0] - h.base + off] = value
        res = mark(h.image(), [], [h.addrs[0]], dead=DeadWords(dict_keys=lib.MU_DICT_KEYS_311))
        assert list(res.marked) == [1, 1], off
        h.buf[h.addrs[0] - h.base:h.addrs[0] - h.base + 16] = saved
    # a block 32 bytes or more larger than the table is something else; 16-31 bytes more is
    # glibc's chunk handed out whole (sid's 3.13: a 208-byte table in a 232-byte block)
    for block, kept in ((144, 0), (152, 1), (160, 1)):
        h2 = Heap([block, 32])
        size = keys_311(h2, 0)
        assert block - size in (24, 32, 40)
        h2.link(0, size // 8, 1)
        res = mark(h2.image(), [], [h2.addrs[0]], dead=DeadWords(dict_keys=lib.MU_DICT_KEYS_311))
        assert list(res.marked) == [1, kept], block



@pytest.mark.parametrize("layout, make, kind, block", [
    (lib.MU_DICT_KEYS_311, keys_311, 0, 160),  # a general table (non-str keys), exactly 160 bytes
    (lib.MU_DICT_KEYS_311, keys_311, 0, 168),  # the same, 8 bytes of slack
    (lib.MU_DICT_KEYS_38, keys_38, None, 176), # 3.8-3.10: every table's entries hold hashes
])
def test_a_dict_key_table_s_hashes_are_no_references(layout, make, kind, block):
    # a base type's tp_subclasses is keyed by its subclasses' id(): an int's hash is its value,
    # so the hash word of each entry held a leaked class's address
    h = Heap([block, 64, 64, 64])
    size = make(h, 0, **({"kind": kind} if kind is not None else {}))
    assert size <= block < size + 16
    entries = (size - 24 * ((8 << 1) // 3)) // 8     # the first entry's word index
    h.link(0, entries, 1, 16)          # entry 0: hash = block 1's object address
    h.link(0, entries + 1, 3)          #          its key (an int) elsewhere
    h.link(0, entries + 3, 2, 16)      # entry 1: hash = block 2's, its key and value below
    h.link(0, entries + 5, 2)          #          its value: a reference
    keys = DeadWords(dict_keys=layout)
    assert list(mark(h.image(), [], [h.addrs[0]], dead=keys).marked) == [1, 0, 1, 1]
    assert list(mark(h.image(), [], [h.addrs[0]]).marked) == [1, 1, 1, 1]     # the rule off
    leaks = fold(h.image(), bytearray(4), dead=keys)
    assert {(e.index, e.referenced_count) for e in leaks} == {(0, 2), (1, 0)}
    # explain reads the words as mark does: no hash among them
    words = {a + o for a, data in scanned_blocks(h.image(), bytearray([1, 0, 0, 0]), keys)
             for o in range(0, len(data) - 7, 8)}
    base = h.addrs[0]
    assert base + 8 * entries not in words and base + 8 * (entries + 3) not in words
    assert {base + 8 * (entries + k) for k in (1, 2, 4, 5)} <= words


@pytest.mark.parametrize("layout, make, kind", [
    (lib.MU_DICT_KEYS_311, keys_311, 0), (lib.MU_DICT_KEYS_38, keys_38, None)])
def test_a_dict_key_table_s_header_and_hashes_under_the_debug_hooks(layout, make, kind):
    # python -X dev (which the pytest docs advise): the table starts after the hooks' prefix
    h = Heap([256, 64, 64, 64])
    size = make(h, 0, at=16, **({"kind": kind} if kind is not None else {}))
    debug_hooks_block(h, 0, size)
    table = h.addrs[0] + 16
    entries = (size - 24 * ((8 << 1) // 3)) // 8
    h.link(0, 2 + entries, 1, 16)      # entry 0's hash: block 1's object address
    h.link(0, 2 + entries + 1, 3)      #          its key
    h.link(0, (16 + size + 8) // 8, 2)  # the allocator's slack after the hooks' tail
    keys = DeadWords(dict_keys=layout, debug_hooks=True)
    assert list(mark(h.image(), [], [table], dead=keys).marked) == [1, 0, 0, 1]
    assert list(mark(h.image(), [], [table], dead=DeadWords(debug_hooks=True)).marked) == \
        [1, 1, 0, 1]                   # the table rule off: its hash a word, the slack not
    words = {a + o for a, data in scanned_blocks(h.image(), bytearray([1, 0, 0, 0]), keys)
             for o in range(0, len(data) - 7, 8)}
    assert table + 8 * entries not in words and table + 8 * (entries + 1) in words


def test_a_str_keyed_table_has_no_hashes():
    # 3.11+ tables of str keys (kind 1) hold {key, value}: the same word is a key, a reference
    h = Heap([128, 64])
    size = keys_311(h, 0, kind=1)
    h.link(0, (size - 16 * 5) // 8, 1)
    assert list(mark(h.image(), [], [h.addrs[0]],
                     dead=DeadWords(dict_keys=lib.MU_DICT_KEYS_311)).marked) == [1, 1]


def debug_hooks_block(h, k, n, api=b"o"):
    """CPython's debug-hook frame in block k (Objects/obmalloc.c _PyMem_DebugRawAlloc): the
    requested size n big-endian, the API id, 7 bytes 0xfd, n bytes, then 8 bytes 0xfd."""
    off = h.addrs[k] - h.base
    h.buf[off:off + 16] = n.to_bytes(8, "big") + api + b"\xfd" * 7
    h.buf[off + 16 + n:off + 24 + n] = b"\xfd" * 8


# The CI miss at b4cc4b1 (malloc_debug, 3.11): a 152-byte glibc block holding a 120-byte dict
# key table; the word at 144, after the tail, is glibc's slack and kept a leaked buffer's
# address. n = 115: a tail that starts inside a word (the word at 128 is half requested bytes,
# scanned; the tail ends at 139, slack from there).
@pytest.mark.parametrize("n, stale_slot", [(120, 18), (115, 18), (0, 3)])
def test_debug_hook_slack_after_the_tail_is_not_scanned(n, stale_slot):
    h = Heap([152, 32, 32])
    debug_hooks_block(h, 0, n)
    h.link(0, stale_slot, 1)                   # slack after the tail
    if n:
        h.link(0, 2, 2)                        # the first requested word: a reference
    roots = [h.addrs[0]]
    dead = DeadWords(debug_hooks=True)
    assert list(mark(h.image(), [], roots, dead=dead).marked) == [1, 0, int(n > 0)]
    assert list(mark(h.image(), [], roots).marked) == [1, 1, int(n > 0)]
    leaks = fold(h.image(), bytearray(3), dead=dead)
    assert (leaks[0].index, leaks[0].referenced_count) == (0, int(n > 0))


@pytest.mark.parametrize("spoil", ["api", "pad", "tail", "size"])
def test_debug_hook_rule_needs_prefix_and_tail(spoil):
    # a block of code that is not CPython's (a C extension's malloc) is scanned whole
    h = Heap([152, 32])
    debug_hooks_block(h, 0, 120)
    off = h.addrs[0] - h.base
    if spoil == "api":
        h.buf[off + 8] = ord("x")
    elif spoil == "pad":
        h.buf[off + 15] = 0
    elif spoil == "tail":
        h.buf[off + 16 + 120 + 7] = 0
    else:                                      # a size past the block's end
        h.buf[off:off + 8] = (152 - 16 - 8 + 8).to_bytes(8, "big")
    h.link(0, 18, 1)
    res = mark(h.image(), [], [h.addrs[0]], dead=DeadWords(debug_hooks=True))
    assert list(res.marked) == [1, 1]


@pytest.mark.parametrize("basic, kept", [
    (32, [1, 0, 0]),        # the object ends first (at 64): its rule still applies
    (104, [1, 1, 0]),       # the requested bytes end first (at 112): the object's rule
])                          #   (end 136) does not reach past them
def test_debug_hook_rule_and_object_rules_meet(basic, kept):
    # under the hooks a sized object sits after the prefix (and its GC head)
    h = Heap([128, 32, 32])
    debug_hooks_block(h, 0, 96)                 # requested bytes 16..112, tail 112..120
    h.point(0, 4, 1)                            # GC head at 16 (zeros), object at 32
    h.point(0, 5, INT_TYPE + 0x300)
    h.link(0, 8, 1)                             # offset 64
    h.link(0, 15, 2)                            # offset 120: the slack after the tail
    types = [(INT_TYPE + 0x300, 32 | lib.MU_TYPE_SIZED << 8 | basic << 16)]
    roots = [h.addrs[0]]
    both = DeadWords(types=types, debug_hooks=True)
    assert list(mark(h.image(), [], roots, dead=both).marked) == kept
    assert list(mark(h.image(), [], roots, dead=DeadWords(debug_hooks=True)).marked) == [1, 1, 0]


VARSIZED = lib.MU_TYPE_VARSIZED << 8
TUPLE = INT_TYPE + 0x200
TUPLE_CODE = 16 | VARSIZED | 24 << 16 | 8 << 48


@pytest.mark.parametrize("count, kept", [
    (3, [1, 1, 0]),         # items at 40..64: the word at 64 is the 112-byte block's slack
    (4, [1, 1, 1]),         # a fourth item reaches it: scanned
    (-1, [1, 1, 1]),        # an impossible count: scanned whole
    (99, [1, 1, 1]),
])
def test_tuples_scanned_up_to_their_last_item(count, kept):
    h = Heap([80, 16, 16])              # GC head at 0, tuple at 16: refcnt, type, ob_size
    for slot, w in enumerate([0, 0, 1, TUPLE, count & (2 ** 64 - 1)]):
        h.point(0, slot, w)
    h.link(0, 5, 1)                     # item 0
    h.link(0, 8, 2)                     # block offset 64: item 3
    dead = DeadWords(types=[(TUPLE, TUPLE_CODE)])
    assert list(mark(h.image(), [], [h.addrs[0]], dead=dead).marked) == kept
    folded = fold(h.image(), bytearray(3), dead=dead)
    assert folded[0].referenced_count == sum(kept) - 1


def test_a_tuple_at_refcount_zero_is_dead():
    # a free-listed tuple (3.8-3.10's static free lists): nothing it holds is a reference
    h = Heap([64, 16])
    for slot, w in enumerate([0, 0, 0, TUPLE, 2]):
        h.point(0, slot, w)
    h.link(0, 5, 1)
    dead = DeadWords(types=[(TUPLE, TUPLE_CODE)])
    assert list(mark(h.image(), [], [h.addrs[0]], dead=dead).marked) == [1, 0]


@pytest.mark.parametrize("code", [TUPLE_CODE, 16 | DEAD], ids=["tuple", "dead at zero"])
def test_an_item_array_whose_slack_looks_like_a_dead_object_is_scanned(code):
    # a live list's item array [obj, obj, NULL, stale &Type]: words 2-3 read as ob_refcnt 0
    # and a ruled type at offset 16, but words 0-1 are pointers, not an untracked PyGC_Head
    # (a false leak of both items on 3.9/3.10 before the head was checked)
    h = Heap([64, 16, 16])
    h.link(0, 0, 1)
    h.link(0, 1, 2)
    h.point(0, 2, 0)
    h.point(0, 3, TUPLE)
    dead = DeadWords(types=[(TUPLE, code)])
    assert list(mark(h.image(), [], [h.addrs[0]], dead=dead).marked) == [1, 1, 1]
    # the same words after an untracked head (0, finalized bit): a dead object, not scanned
    h.point(0, 0, 0)
    h.point(0, 1, 1)
    h.link(0, 4, 1)
    assert list(mark(h.image(), [], [h.addrs[0]], dead=dead).marked) == [1, 0, 0]


CLS = INT_TYPE + 0x400
CLS_CODE = 16 | VARSIZED | 32 << 16          # 32-byte objects, no items: sized and dead at 0


@pytest.mark.parametrize("refcnt, head, kept", [
    (1, (0, 0), [1, 0, 1]),         # live: scanned up to 16 + 32 bytes; the word at 48 is slack
    (0, (0, 0), [1, 0, 0]),         # refcount 0 after an untracked head: a dead object
    (0, (BASE, BASE), [1, 1, 1]),   # refcount 0 after a tracked head: no object to trust, whole
])
def test_a_var_sized_rule_of_no_items_is_a_size_and_the_dead_at_zero_rule(refcnt, head, kept):
    # 3.8-3.10 give every GC type the dead-at-zero rule; a class's size rides along with it
    h = Heap([64, 16, 16])
    for slot, w in enumerate([head[0], head[1], refcnt, CLS, 2 ** 63 + 5]):   # no count
        h.point(0, slot, w)
    h.link(0, 6, 1)                     # block offset 48: the allocator's slack
    h.link(0, 5, 2)                     # object offset 24: a field
    dead = DeadWords(types=[(CLS, CLS_CODE)])
    assert list(mark(h.image(), [], [h.addrs[0]], dead=dead).marked) == kept


GEN = INT_TYPE + 0x500
GEN_CODE = 16 | lib.MU_TYPE_GEN_FRAME << 8 | 80 << 16     # 3.11: the frame at object offset 80


@pytest.mark.parametrize("state, top, slots, kept", [
    (-1, 1, 2, [1, 1, 0, 0]),   # suspended, 1 slot in use: slot 1 is above the top
    (-2, 2, 2, [1, 1, 1, 0]),   # created, 2 slots: both live, the word after them is slack
    (0, 1, 2, [1, 1, 1, 0]),    # running: its real top is in a register: all its 2 slots
    (1, 1, 2, [1, 1, 1, 0]),    # completing: the same
    (4, 1, 2, [1, 0, 0, 0]),    # cleared (finished): its slots were released, not zeroed
    (0, 1, -3, [1, 1, 1, 1]),   # running with a slot count we cannot trust: scanned whole
    (0, 1, 40, [1, 1, 1, 1]),   # a count past the block: scanned whole
    (-1, -5, 2, [1, 1, 1, 1]),  # a top we cannot trust: scanned whole
    (-1, 40, 2, [1, 1, 1, 1]),  # past the block: scanned whole
])
def test_a_generators_inline_frame_is_scanned_up_to_its_stacktop(state, top, slots, kept):
    h = Heap([256, 16, 16, 16])         # GC head, then the generator at 16; frame at 96
    for slot, w in enumerate([0, 0, 1, GEN, slots % 2 ** 64]):
        h.point(0, slot, w)
    frame = 16 + 80
    struct.pack_into("<b", h.buf, h.addrs[0] - h.base + frame - 5, state)
    struct.pack_into("<i", h.buf, h.addrs[0] - h.base + frame + 64, top)
    h.link(0, (frame + 72) // 8, 1)     # localsplus[0]
    h.link(0, (frame + 80) // 8, 2)     # localsplus[1]
    h.link(0, (frame + 88) // 8, 3)     # past ob_size slots: the allocator's slack
    dead = DeadWords(types=[(GEN, GEN_CODE)])
    assert list(mark(h.image(), [], [h.addrs[0]], dead=dead).marked) == kept
    folded = fold(h.image(), bytearray(4), dead=dead)
    assert folded[0].referenced_count == sum(kept) - 1


@pytest.mark.parametrize("flavour, state, top, kept", [
    (lib.MU_FRAME_FLAVOUR_314, -2, 1, [1, 1, 0, 0]),  # suspended: slot 1 above the pointer
    (lib.MU_FRAME_FLAVOUR_314, -3, 2, [1, 1, 1, 0]),  # created, 2 slots live
    (lib.MU_FRAME_FLAVOUR_314, 4, 1, [1, 0, 0, 0]),   # cleared: the head only
    (lib.MU_FRAME_FLAVOUR_314, 0, 1, [1, 1, 1, 1]),   # running: scanned whole
    (lib.MU_FRAME_FLAVOUR_314, -2, None, [1, 1, 1, 1]),  # a pointer off the slots: whole
    (lib.MU_FRAME_FLAVOUR_315, 1, 1, [1, 1, 0, 0]),   # 3.15 suspended (1)
    (lib.MU_FRAME_FLAVOUR_315, 0, 2, [1, 1, 1, 0]),   # 3.15 created (0)
    (lib.MU_FRAME_FLAVOUR_315, 5, 1, [1, 0, 0, 0]),   # 3.15 cleared (5)
    (lib.MU_FRAME_FLAVOUR_315, 4, 1, [1, 1, 1, 1]),   # 3.15 executing (4): whole
])
def test_a_314_generators_frame_is_scanned_up_to_its_stackpointer(flavour, state, top, kept):
    # 3.14+: the frame's stackpointer (at +64) points past its last live slot; slots from +80
    h = Heap([256, 16, 16, 16])         # GC head, then the generator at 16; frame at 96
    for slot, w in enumerate([0, 0, 1, GEN, 2]):
        h.point(0, slot, w)
    frame = 16 + 80
    slots = h.addrs[0] + frame + 80
    struct.pack_into("<b", h.buf, h.addrs[0] - h.base + frame - 5, state)
    struct.pack_into("<Q", h.buf, h.addrs[0] - h.base + frame + 64,
                     slots + 8 * top if top is not None else slots + 4)
    h.link(0, (frame + 80) // 8, 1)     # localsplus[0]
    h.link(0, (frame + 88) // 8, 2)     # localsplus[1]
    h.link(0, (frame + 96) // 8, 3)     # localsplus[2]: never live here
    dead = DeadWords(types=[(GEN, GEN_CODE | flavour << 32)])
    assert list(mark(h.image(), [], [h.addrs[0]], dead=dead).marked) == kept
    folded = fold(h.image(), bytearray(4), dead=dead)
    assert folded[0].referenced_count == sum(kept) - 1


@pytest.mark.parametrize("owned, kept", [(True, [1, 1, 0, 1]), (False, [1, 0, 0, 1])])
def test_a_314_frame_object_is_scanned_up_to_its_stackpointer(owned, kept):
    # 3.14+: a frame object owning its data at object + 64 (stackpointer at +64 of the data,
    # slots from +80): slot 0 live, slot 5 above; f_back (+16) always live
    h = Heap([256, 16, 16, 16])
    data = h.addrs[0] + 16 + 64
    for slot, w in enumerate([0, 0, 1, FRAME_TYPE, 0, data if owned else BASE + 0x9000]):
        h.point(0, slot, w)
    struct.pack_into("<Q", h.buf, data + 64 - h.base, data + 80 + 8)
    h.link(0, (data + 80 - h.addrs[0]) // 8, 1)           # slot 0
    h.link(0, (data + 80 - h.addrs[0]) // 8 + 5, 2)       # slot 5
    h.link(0, 4, 3)                                       # f_back
    code = 16 | FRAME | 64 << 16 | lib.MU_FRAME_FLAVOUR_314 << 32
    res = mark(h.image(), [], [h.addrs[0]], dead=DeadWords(types=[(FRAME_TYPE, code)]))
    assert list(res.marked) == kept


MV = INT_TYPE + 0x600
MV_BASIC = 56                           # a memoryview-like header: view.suboffsets at 32
MV_CODE = 16 | lib.MU_TYPE_MEMORYVIEW << 8 | MV_BASIC << 16


@pytest.mark.parametrize("count, suboffsets, kept", [
    (3, 0, [1, 1, 0, 0]),       # ndim 1, no suboffsets: shape and strides only
    (3, 1, [1, 1, 1, 0]),       # with suboffsets: all three; the slack after them dead
    (4, 0, [1, 1, 1, 1]),       # not 3 * ndim: scanned whole
])
def test_a_memoryview_is_scanned_up_to_the_arrays_it_uses(count, suboffsets, kept):
    h = Heap([112, 16, 16, 16])         # GC head, then the object at 16; arrays from 72
    for slot, w in enumerate([0, 0, 1, MV, count]):
        h.point(0, slot, w)
    h.point(0, (16 + MV_BASIC - 24) // 8, 0x1000 if suboffsets else 0)    # view.suboffsets
    h.link(0, (16 + MV_BASIC + 8) // 8, 1)          # strides[0]
    h.link(0, (16 + MV_BASIC + 16) // 8, 2)         # suboffsets[0]
    h.link(0, (16 + MV_BASIC + 24) // 8, 3)         # the allocator's slack
    dead = DeadWords(types=[(MV, MV_CODE)])
    marked = list(mark(h.image(), [], [h.addrs[0]], dead=dead).marked)
    assert marked == kept


# --- ints, bytes and floats that hold an address (python-magic's handle, ctypes' c_void_p) ----
INT_CODE = {"ob_size": 0 | lib.MU_TYPE_INT << 8 | lib.MU_INT_OB_SIZE << 16,
            "lv_tag": 0 | lib.MU_TYPE_INT << 8 | lib.MU_INT_LV_TAG << 16}


def long_words(value, layout, immortal=False):
    """The bytes of a PyLongObject's size word and 30-bit digits (after ob_refcnt, ob_type):
    3.8-3.11 ob_size = sign * ndigits; 3.12+ lv_tag = ndigits << 3 | sign (0 +, 1 zero, 2 -),
    3.14's small ints with bit 2 (immortal) set."""
    digits, n = [], abs(value)
    while n:
        digits.append(n & (2 ** 30 - 1))
        n >>= 30
    digits = digits or [0]
    nd = len(digits) if value else 0
    if layout == "ob_size":
        tag = (nd if value >= 0 else -nd) & (2 ** 64 - 1)
    else:
        tag = nd << 3 | (0 if value > 0 else 1 if value == 0 else 2) | (4 if immortal else 0)
    return struct.pack(f"<Q{len(digits)}I", tag, *digits)


def int_heap(value, layout, size=32, immortal=False, target=64):
    """Block 0 (size bytes) an int of value (pointing into block 1 when value is an address
    there), block 1 the target; the int's header at offset 0 (no GC head: ints are no GC
    objects)."""
    h = Heap([size, target])
    h.point(0, 0, 1)
    h.point(0, 1, INT_TYPE)
    raw = long_words(value(h) if callable(value) else value, layout, immortal)
    at = h.addrs[0] + 16 - h.base
    h.buf[at:at + len(raw)] = raw
    return h


@pytest.mark.parametrize("layout", ["ob_size", "lv_tag"])
@pytest.mark.parametrize("value, kept", [
    (lambda h: h.addrs[1], 1),              # the block's address: 2 digits (47-bit address)
    (lambda h: h.addrs[1] + 8, 1),          # C++ new[]'s count before the array
    (lambda h: h.addrs[1] + 16, 1),         # CPython's debug hooks' prefix (MU_HANDLE_SLACK)
    (lambda h: h.addrs[1] + 24, 0),         # deeper inside: a number (1 << 29 inside a large
    (lambda h: h.addrs[1] + 40, 0),         # block of a non-PIE interpreter's brk heap)
    (lambda h: h.addrs[1] + 64, 0),         # one past its end (the gap after it)
    (lambda h: -h.addrs[1], 0),             # negative: no address
    (0, 0),
    (256, 0),                               # a small int: below every heap
])
def test_an_ints_value_is_a_reference(layout, value, kept):
    h = int_heap(value, layout)
    dead = DeadWords(types=[(INT_TYPE, INT_CODE[layout])])
    assert list(mark(h.image(), [], [h.addrs[0]], dead=dead).marked) == [1, kept]
    # fold: a leaked int holding the block's address leaks it along with itself
    assert fold(h.image(), bytearray(2), dead=dead) == \
        ([FoldedLeak(0, 1, 64, [1])] if kept else [FoldedLeak(0, 0, 0), FoldedLeak(1, 0, 0)])
    # opaque (before ints were read): never a reference
    opaque = DeadWords(types=[(INT_TYPE, 0 | OPAQUE)])
    assert list(mark(h.image(), [], [h.addrs[0]], dead=opaque).marked) == [1, 0]


def test_3_14_immortal_bit_is_no_part_of_the_digit_count():
    h = int_heap(lambda h: h.addrs[1], "lv_tag", immortal=True)
    dead = DeadWords(types=[(INT_TYPE, INT_CODE["lv_tag"])])
    assert list(mark(h.image(), [], [h.addrs[0]], dead=dead).marked) == [1, 1]


HIGH = 0x7F3A_0000_0000_0000   # a heap above 2**60: its addresses need a third digit


@pytest.mark.parametrize("layout", ["ob_size", "lv_tag"])
@pytest.mark.parametrize("delta, size, kept", [
    (0, 48, 1),             # 3 digits, all inside the 48-byte block
    (0, 32, 0),             # 3 digits, the third past the 32-byte block's end: not read
    (2 ** 64, 48, 0),       # 2**64 + address: 3 digits, too large for an address
    (2 ** 90, 48, 0),       # 4 digits: too large
])
def test_three_digit_ints_and_the_blocks_bounds(layout, delta, size, kept):
    h = Heap([size, 64], base=HIGH)
    h.point(0, 0, 1)
    h.point(0, 1, INT_TYPE)
    raw = long_words(h.addrs[1] + 8 + delta, layout)
    at = h.addrs[0] + 16 - h.base
    h.buf[at:at + len(raw)] = raw          # (past a 32-byte block: into the gap after it)
    dead = DeadWords(types=[(INT_TYPE, INT_CODE[layout])])
    assert list(mark(h.image(), [], [h.addrs[0]], dead=dead).marked) == [1, kept]


def test_digits_that_are_not_30_bit_are_no_int():
    h = int_heap(lambda h: h.addrs[1], "lv_tag")
    struct.pack_into("<I", h.buf, h.addrs[0] + 24 - h.base, 1 << 30)     # digit 0's bit 30
    dead = DeadWords(types=[(INT_TYPE, INT_CODE["lv_tag"])])
    assert list(mark(h.image(), [], [h.addrs[0]], dead=dead).marked) == [1, 0]


BYTES_TYPE, FLOAT_TYPE = INT_TYPE + 0x600, INT_TYPE + 0x700
BYTES_CODE = 0 | lib.MU_TYPE_BYTES << 8 | 32 << 16     # ob_sval at 32


@pytest.mark.parametrize("data, at, kept", [
    (8, 32, 1),             # struct.pack("P", p): the data's only word
    (20, 40, 1),            # the data's second whole word
    (64, 88, 1),            # the last word of 64 bytes (a small packed struct)
    (72, 32, 0),            # more than 64 bytes: data (a file's; a read in progress: stale)
    (12, 40, 0),            # a word that only starts in the data (4 bytes, the NUL, slack)
    (8, 40, 0),             # after the data: the allocator's slack
])
def test_short_bytes_words_are_handles(data, at, kept):
    h = Heap([128, 16])
    for slot, w in enumerate([1, BYTES_TYPE, data, 2 ** 64 - 1]):    # ob_shash -1: not computed
        h.point(0, slot, w)
    h.link(0, at // 8, 1)
    dead = DeadWords(types=[(BYTES_TYPE, BYTES_CODE)])
    assert list(mark(h.image(), [], [h.addrs[0]], dead=dead).marked) == [1, kept]
    assert fold(h.image(), bytearray(2), dead=dead) == \
        ([FoldedLeak(0, 1, 16, [1])] if kept else [FoldedLeak(0, 0, 0), FoldedLeak(1, 0, 0)])
    opaque = DeadWords(types=[(BYTES_TYPE, OPAQUE)])
    assert list(mark(h.image(), [], [h.addrs[0]], dead=opaque).marked) == [1, 0]


def test_a_floats_8_bytes_are_a_handle():
    # PyFloatObject: refcnt, type, ob_fval (24 bytes); the 32-byte block's slack is not read
    h = Heap([32, 16, 16])
    for slot, w in enumerate([1, FLOAT_TYPE]):
        h.point(0, slot, w)
    h.link(0, 2, 1)                     # ob_fval
    h.link(0, 3, 2)                     # the slack
    dead = DeadWords(types=[(FLOAT_TYPE, 0 | lib.MU_TYPE_FLOAT << 8)])
    assert list(mark(h.image(), [], [h.addrs[0]], dead=dead).marked) == [1, 1, 0]
    h.point(0, 0, 0)                    # refcount 0: no float (a free-listed one's next link)
    assert list(mark(h.image(), [], [h.addrs[0]], dead=dead).marked) == [1, 1, 1]


@pytest.mark.parametrize("target, kept", [
    ("native", 1),          # a malloc'd block: the int is its handle
    ("gc", 0),              # a GC object (its PyGC_Head known): the int is its id()
    ("typed", 0),           # an object of a ruled type (a str): its id() too
    ("typed, refcount 0", 1),   # no object (a type pointer after a zero word): native
])
def test_an_ints_value_refers_to_native_blocks_not_to_objects(target, kept):
    # id(x) kept in a memo dict keeps nothing alive in Python: a leaked object whose id() is
    # still around is reported
    h = int_heap(lambda h: h.addrs[1] + (16 if target == "gc" else 0), "lv_tag")
    types = [(INT_TYPE, INT_CODE["lv_tag"]), (STR_TYPE, 0 | STR)]
    head_word = None
    if target == "gc":
        head_word = bytearray([0, 1])               # a PyGC_Head at word 0 of block 1
        h.point(1, 2, 1)
        h.point(1, 3, TUPLE_TYPE)
    elif target.startswith("typed"):
        h.point(1, 0, 0 if "0" in target else 1)
        h.point(1, 1, STR_TYPE)
    dead = DeadWords(types=types, head_word=head_word)
    assert list(mark(h.image(), [], [h.addrs[0]], dead=dead).marked) == [1, kept]
    assert fold(h.image(), bytearray(2), dead=dead) == \
        ([FoldedLeak(0, 1, 64, [1])] if kept else [FoldedLeak(0, 0, 0), FoldedLeak(1, 0, 0)])


def test_int_handles_in_the_low_memory_mark():
    # uncopied regions (read on demand): the int's target header is read through the fd
    from tests.unit.test_mark import UNCOPIED_BASE, all_ways, stats
    h = Heap([32, 64, 32, 64], base=UNCOPIED_BASE)
    for k, target in ((0, 1), (2, 3)):
        h.point(k, 0, 1)
        h.point(k, 1, INT_TYPE)
        raw = long_words(h.addrs[target] + 8, "lv_tag")
        h.buf[h.addrs[k] + 16 - h.base:h.addrs[k] + 16 + len(raw) - h.base] = raw
    h.point(3, 0, 1)                    # block 3 is a str: block 2's int is its id()
    h.point(3, 1, STR_TYPE)
    dead = DeadWords(types=[(INT_TYPE, INT_CODE["lv_tag"]), (STR_TYPE, 0 | STR)])
    roots = [(ROOT, words_buffer(h.addrs[0], h.addrs[2]))]
    copied, waves, kept = all_ways(h, roots, dead=dead)
    assert list(copied.marked) == [1, 1, 1, 0]
    assert stats(waves) == stats(copied) and stats(kept) == stats(copied)


# --- live ends: a list's item array scanned up to its used slots -------------------------------

@pytest.mark.parametrize("end, kept", [
    (0, [1, 1, 1]),         # no limit: every word
    (17, [1, 1, 0]),        # 2 slots used: the third (a stale pointer) is no reference
    (9, [1, 0, 0]),         # 1 slot used
    (1, [1, 0, 0]),         # none used: the whole array is stale
    (1000, [1, 1, 1]),      # past the block: the block
])
def test_a_live_end_limits_the_words_scanned(end, kept):
    h = Heap([32, 16, 16])
    h.link(0, 1, 1)                         # slot 1
    h.link(0, 2, 2)                         # slot 2
    live = bytearray(struct.pack("<3I", end, 0, 0))
    dead = DeadWords(live_end=live)
    assert list(mark(h.image(), [], [h.addrs[0]], dead=dead).marked) == kept
    # the fold agrees: a leaked array keeps only what its used slots point at
    leaks = fold(h.image(), bytearray(3), dead=dead)
    inside = sum(kept[1:])
    assert {(e.index, e.referenced_count) for e in leaks} == \
        {(0, inside)} | {(k, 0) for k in (1, 2) if not kept[k]}
    # explain's view of the block is the mark's
    from memunreachable.sweep.mark import scanned_blocks
    seen = dict((b, len(v)) for b, v in scanned_blocks(h.image(), bytes([1, 1, 1]), dead))
    assert seen.get(h.addrs[0], 0) == (min(32, end - 1) if end else 32)
    with pytest.raises(ValueError):         # one uint32 per allocation
        mark(h.image(), [], [h.addrs[0]], dead=DeadWords(live_end=bytearray(8)))


# --- cffi's plain cdata: the slack after its 40 bytes, unless a casted primitive's value -------

@pytest.mark.parametrize("size, data, kept", [
    (48, 0, 0),             # ffi.NULL, a pointer cdata: +40 is the block's slack
    (48, 0x1234_5678_0000, 0),                  # data elsewhere (a pointer's target): slack
    (48, lambda h: h.addrs[0] + 40, 1),         # a casted primitive: its value lies at +40
    (64, lambda h: h.addrs[0] + 48, 1),         # or at +48, aligned for a long double
    (48, lambda h: h.addrs[0] + 48, 0),         # past the block: not this one's value
])
def test_cffi_cdata_slack_is_stale_unless_its_value_is_inline(size, data, kept):
    CDATA_TYPE = INT_TYPE + 0x900
    h = Heap([size, 16])
    for slot, w in enumerate([1, CDATA_TYPE, 0x7000, data(h) if callable(data) else data, 0]):
        h.point(0, slot, w)
    h.link(0, 5 if size == 48 else 6, 1)    # +40 (+48 in the aligned one)
    dead = DeadWords(types=[(CDATA_TYPE, 0 | lib.MU_TYPE_CDATA << 8 | 40 << 16)])
    assert list(mark(h.image(), [], [h.addrs[0]], dead=dead).marked) == [1, kept]
    leaks = fold(h.image(), bytearray(2), dead=dead)
    assert {(e.index, e.referenced_count) for e in leaks} == \
        ({(0, 1)} if kept else {(0, 0), (1, 0)})


# --- sets keyed by id(): their tables' hashes ----------------------------------------------
SET_TYPE = 0x7500


def set_heap(table_offset=0, tracked=True):
    """A set with a table of its own (block 1: 8 entries, `table_offset` bytes into its
    allocation, the debug hooks' prefix) and a set in its smalltable (block 4), each holding
    an entry whose key points at one block (2, 6) and whose hash at another (3, 5): an int key
    whose value, and so its hash, is that block's id(). Untracked: in no GC list (3.15's
    frozensets). Returns (heap, head_word)."""
    h = Heap([216, table_offset + 128 + (8 if table_offset else 0), 32, 32, 216, 32, 32])
    for s in (0, 4):
        obj = h.addrs[s] + 16
        h.point(s, 3, SET_TYPE)                     # ob_type (object word 1)
        h.point(s, 6, 7)                            # mask: 8 slots
        h.point(s, 7, obj + 64 if s == 4 else h.addrs[1] + table_offset)   # table
    h.point(1, table_offset // 8, h.addrs[2] + 16)  # entry 0: key, hash
    h.point(1, table_offset // 8 + 1, h.addrs[3] + 16)
    h.link(4, 10, 6, 16)                            # smalltable entry 0: key, hash
    h.link(4, 11, 5, 16)
    h.point(4, 13, 0x1234_5679)                     # entry 1's hash: a str's, no address
    for s in (0, 4):
        h.point(s, 2, 1)                            # ob_refcnt
    return h, bytearray([int(tracked), 0, 0, 0, int(tracked), 0, 0])


@pytest.mark.parametrize("tracked", [True, False], ids=["tracked", "untracked"])
@pytest.mark.parametrize("table_offset", [0, 16])
def test_a_set_s_hashes_keep_nothing_alive_its_keys_do(table_offset, tracked):
    from memunreachable.heaps.cpython import gclists as G
    h, hw = set_heap(table_offset, tracked)
    img = h.image()
    live = bytearray(4 * len(img.begins))
    pairs, counts = G.gc_dead_ranges(img, hw, 0, [], [], live, sets=[SET_TYPE])
    obj4 = h.addrs[4] + 16
    assert list(pairs) == [(obj4 + 72, obj4 + 80)]         # the one address-like hash
    assert counts == (0, 0, 0, 0, 1, 1)
    ends = struct.unpack(f"<{len(img.begins)}I", live)
    assert ends == (0, lib.MU_LIVE_SET_TABLE | table_offset, 0, 0, 0, 0, 0)
    roots = [h.addrs[0] + 16, obj4]
    dead = DeadWords(ranges=list(pairs), head_word=hw, live_end=live)
    assert list(mark(img, [], roots, dead=dead).marked) == [1, 1, 1, 0, 1, 0, 1]
    assert list(mark(img, [], roots, dead=DeadWords(head_word=hw)).marked) == [1] * 7
    # the fold: the hashes are no edges either
    folded = fold(img, bytearray([1, 0, 0, 0, 1, 1, 1]), dead=dead)
    assert [(f.index, list(f.blocks)) for f in folded] == [(1, [2]), (3, [])]
    # explain's words (scanned_blocks): the table's keys, not its hashes
    words = {a for b, v in scanned_blocks(img, bytearray([0, 1, 0, 0, 0, 0, 0]), dead)
             for a in range(b, b + len(v), 8)}
    table = h.addrs[1] + table_offset
    assert table in words and table + 8 not in words and table + 16 in words
    assert table + 24 not in words and table + 120 not in words


def test_a_set_table_is_marked_only_where_it_fits_and_never_over_a_list_s_live_end():
    from memunreachable.heaps.cpython import gclists as G
    h, hw = set_heap()
    h.point(0, 6, 15)                       # 16 slots: more than block 1 holds
    live = bytearray(4 * 7)
    G.gc_dead_ranges(h.image(), hw, 0, [], [], live, sets=[SET_TYPE])
    assert bytes(live) == bytes(28)
    h, hw = set_heap()
    live = bytearray(4 * 7)
    struct.pack_into("<I", live, 4, 9)      # block 1 is a list's item array (live end 8 bytes)
    G.gc_dead_ranges(h.image(), hw, 0, [], [], live, sets=[SET_TYPE])
    assert struct.unpack_from("<I", live, 4)[0] == 9
    live = bytearray(4 * 7)                 # no set type: no rule
    pairs, counts = G.gc_dead_ranges(h.image(), hw, 0, [], [], live)
    assert bytes(live) == bytes(28) and counts[4:] == (0, 0) and not list(pairs)
