"""Unit tests of memunreachable/heaps/cpython on in-memory images (BufferMemory): the layout
tables, the pymalloc pool/block walk (native/mu_pymalloc.c), the arenas walk, data stacks,
free lists and the interpreter/thread-state validation."""
import errno
import random
import struct
from array import array

import pytest

from memunreachable._ffi import ffi, lib
from memunreachable._types import BufferMemory, Mapping, Range, ThreadState
from memunreachable.heaps.cpython import layout as L
from memunreachable.heaps.cpython import locate, obmalloc, walker

PS = 16384                       # 3.10+ pool size
BASE = 0x7F0000000000            # an arena-aligned address


def pool(p, szidx, carved, free=(), count=None, pool_size=PS, pad=0):
    """A pool at p of class szidx with `carved` blocks carved and `free` (block indexes, in
    chain order) on the freeblock chain; count defaults to carved - len(free)."""
    size = 16 * (szidx + 1)
    buf = bytearray(pool_size)
    blk = [p + 48 + i * size for i in range(carved)]
    head = blk[free[0]] if free else 0
    for a, b in zip(free, list(free[1:]) + [None]):
        struct.pack_into("<Q", buf, blk[a] - p, blk[b] if b is not None else 0)
    n = carved - len(free) if count is None else count
    struct.pack_into("<IIQQQIIII", buf, 0, n, pad, head, 0, 0, 0, szidx, 48 + carved * size,
                     pool_size - size)
    for i in range(carved):          # fill used blocks with a recognisable word
        if i not in free:
            struct.pack_into("<Q", buf, blk[i] - p + 8, 0xABCD)
    return bytes(buf)


def c_blocks(data, base, pools, pool_size=PS):
    res = ffi.new("mu_pymalloc_result *")
    cap = 4096
    addr, size = array("Q", [0]) * cap, array("Q", [0]) * cap
    pa = array("Q", pools)
    n = lib.mu_pymalloc_blocks(ffi.from_buffer("uint8_t[]", data), base, len(data), pool_size,
                               ffi.from_buffer("uint64_t[]", pa), len(pa),
                               ffi.from_buffer("uint64_t[]", addr),
                               ffi.from_buffer("uint64_t[]", size), cap, res)
    assert n >= 0
    return list(addr[:n]), list(size[:n]), res


def c_find(data, base, pool_size=PS):
    out = array("Q", [0]) * 64
    n = lib.mu_pymalloc_find_pools(ffi.from_buffer("uint8_t[]", data), base, len(data), pool_size,
                                   ffi.from_buffer("uint64_t[]", out), 64)
    assert n >= 0
    return list(out[:n])


# --- layout tables -------------------------------------------------------------------------
def test_every_supported_version_has_a_table_whose_offsets_fit_their_structs():
    assert sorted(L.LAYOUTS) == [(3, m) for m in range(8, 14)]
    for v, lay in L.LAYOUTS.items():
        assert lay.version == v
        assert lay.interpreters_main == lay.interpreters_head + 8      # struct pyinterpreters
        assert max(lay.interpreters_head, lay.preconfig_allocator) < lay.runtime_size
        assert lay.interp_threads_head < lay.interp_size and lay.interp_next < lay.interp_size
        assert max(lay.tstate_next, lay.tstate_interp, lay.tstate_thread_id) < lay.tstate_size
        assert (lay.datastack is not None) == (v >= (3, 11))
        assert (lay.freelists is not None) == (v >= (3, 10))
        assert (lay.obmalloc.state is not None) == (v >= (3, 12))
        assert lay.debug_offsets == (v >= (3, 13))
        assert lay.obmalloc.pool_size == (4096 if v < (3, 10) else 16384)
        if lay.datastack:
            assert lay.datastack.tstate_limit + 8 <= lay.tstate_size
        if lay.freelists:
            fl = lay.freelists
            assert fl.list_numfree == fl.list_items + 8 * fl.array_len   # int right after the slots
            assert fl.keys_numfree + 4 <= lay.interp_size
            assert fl.tuple_numfree == fl.tuple_heads + 8 * fl.tuple_lists
    assert L.get_layout((3, 14)) is None and L.get_layout(None) is None
    assert L.get_layout((3, 11), {}) is None


# --- pools and blocks (C) --------------------------------------------------------------------
def test_used_blocks_are_the_carved_ones_minus_the_free_chain():
    img = pool(BASE, szidx=3, carved=10, free=(7, 2, 9))            # 64-byte blocks
    addr, size, res = c_blocks(img, BASE, [BASE])
    want = [BASE + 48 + 64 * i for i in range(10) if i not in (2, 7, 9)]
    assert addr == want and size == [64] * 7
    assert (res.pools, res.used, res.used_bytes, res.free_blocks) == (1, 7, 7 * 64, 3)
    assert res.virgin_blocks == (PS - 48 - 640) // 64
    assert res.bad_pools == 0


def test_empty_pool_yields_nothing_and_counts_as_empty():
    img = pool(BASE, szidx=0, carved=5, free=(0, 1, 2, 3, 4))
    addr, _, res = c_blocks(img, BASE, [BASE])
    assert addr == [] and res.empty_pools == 1 and res.pools == 0 and res.bad_pools == 0


@pytest.mark.parametrize("kind,img,reason", [
    ("count", pool(BASE, 1, 8, free=(3,), count=6), 3),
    ("loop", None, 2),
    ("header", pool(BASE, 1, 8, pad=1), 1),
])
def test_pools_that_do_not_add_up_are_rejected_whole(kind, img, reason):
    if img is None:                      # a free chain 1 -> 4 -> 1
        img = bytearray(pool(BASE, 1, 8, free=(1, 4)))
        struct.pack_into("<Q", img, 48 + 4 * 32, BASE + 48 + 32)
        struct.pack_into("<I", img, 0, 6)
        img = bytes(img)
    addr, _, res = c_blocks(img, BASE, [BASE])
    assert addr == [] and res.bad_pools == 1 and res.bad_at == BASE and res.bad_reason == reason


def test_find_pools_accepts_only_consistent_headers():
    good = pool(BASE, 5, 3, free=(1,))
    imgs = [good,
            bytes(PS),                                                   # zero page
            pool(BASE, 5, 3, pad=7),                                     # padding after count
            bytearray(good), bytearray(good), bytearray(good), bytearray(good)]
    struct.pack_into("<I", imgs[3], 36, 32)                              # szidx out of range
    struct.pack_into("<I", imgs[4], 44, PS - 16)                         # maxnextoffset of class 0
    struct.pack_into("<I", imgs[5], 40, 48 + 96 * 3 + 8)                 # nextoffset off a block
    struct.pack_into("<Q", imgs[6], 8, BASE + 48 + 8)                    # freeblock off a block
    data = b"".join(bytes(i) for i in imgs)
    assert c_find(data, BASE) == [BASE]
    assert c_find(data[PS:], BASE + PS) == []


def test_bad_arguments_are_einval():
    res = ffi.new("mu_pymalloc_result *")
    assert lib.mu_pymalloc_find_pools(ffi.from_buffer("uint8_t[]", bytearray(8)), 0, 8, 3000,
                                      ffi.NULL, 0) == -22
    assert lib.mu_pymalloc_blocks(ffi.NULL, 0, 0, PS, ffi.NULL, 0, ffi.NULL, ffi.NULL, 0, res) == -22


def c_text_heads(data, base, blocks, cap=64):
    out = array("Q", [0]) * max(cap, 1)
    ba = array("Q", blocks)
    n = lib.mu_pymalloc_text_heads(ffi.from_buffer("uint8_t[]", data), base, len(data),
                                   ffi.from_buffer("uint64_t[]", ba), len(ba),
                                   ffi.from_buffer("uint64_t[]", out), cap)
    assert n >= 0
    return list(out[:min(n, cap)]), n


def test_a_short_string_over_a_free_link_is_found_and_nothing_else():
    # 32-byte blocks of one pool; a free block's link is the address of another block of the
    # pool: a string of 1-4 printable bytes and a NUL written over it keeps the link's high
    # bytes, which are the holder's own
    img = bytearray(pool(BASE, 1, 12))
    blk = [BASE + 48 + 32 * i for i in range(12)]
    link = blk[9]

    def put(i, text=None, word=None):
        v = word if word is not None else \
            int.from_bytes(text, "little") | (link & ~((1 << 8 * len(text)) - 1))
        struct.pack_into("<Q", img, blk[i] - BASE, v)
        return v

    assert put(0, b"<?\0") == (link & ~0xFFFFFF) | 0x3F3C               # ctypes' format of c_bool
    put(1, b"y\0")                                                      # 1 byte and its NUL
    put(2, b"abcd\0")                                                   # 4 bytes: the longest
    put(3, b"abcde\0")                 # 5 bytes: only 2 of the link's bytes left, not matched
    put(4, b"0\0")                     # 8-aligned: an object's address is never dismissed
    put(5, word=link + 1)               # an unaligned pointer whose low byte is no text: kept
    put(6, word=(0x7E0000000000 | 0x3F3C))      # the string's tail is not the holder's: kept
    put(7, word=0x41)                   # a reference count of 65 ("A\0"): no address at all
    put(8, b"\x01<\0")                 # not printable: kept
    heads, n = c_text_heads(bytes(img), BASE, blk)
    assert heads == [blk[0], blk[1], blk[2]] and n == 3
    assert c_text_heads(bytes(img), BASE, blk, cap=1) == ([blk[0]], 3)   # the count past cap
    # blocks outside the copy are left alone
    assert c_text_heads(bytes(img), BASE + PS, blk) == ([], 0)
    assert lib.mu_pymalloc_text_heads(ffi.NULL, 0, 0, ffi.NULL, 0, ffi.NULL, 0) == -22


def test_the_pool_walk_lists_the_text_heads_of_used_blocks():
    img = bytearray(pool(BASE, 1, 6, free=(5,)))
    word = (BASE & ~0xFFFF) | 0x31                      # "1\0" over a link to the pool
    struct.pack_into("<Q", img, 48 + 32 * 2, word)
    mem = BufferMemory({BASE: bytes(img)})
    w = obmalloc.scan_pools(mem, [anon(BASE, BASE + PS)], L.LAYOUTS[(3, 11)])
    assert list(w.text_heads) == [BASE + 48 + 64]


# --- pool scan and arenas walk over a Memory ---------------------------------------------------
def anon(begin, end):
    return Mapping(begin, end, "rw-p", 0, "00:00", 0, "")


def test_pool_scan_finds_pools_in_anonymous_memory_only_and_keeps_copies():
    lay = L.LAYOUTS[(3, 11)]
    a = pool(BASE, 2, 20, free=(4,))
    b = pool(BASE + PS, 0, 3)
    filebacked = BASE + 0x100000
    mem = BufferMemory({BASE: a + b, filebacked: pool(filebacked, 2, 20)})
    maps = [anon(BASE, BASE + 2 * PS),
            Mapping(filebacked, filebacked + PS, "rw-p", 0, "08:01", 1234, "/lib/x.so")]
    w = obmalloc.scan_pools(mem, maps, lay)
    assert w.in_use and w.problems == [] and w.warnings == []
    assert list(w.blocks) == ([BASE + 48 + 48 * i for i in range(20) if i != 4]
                              + [BASE + PS + 48 + 16 * i for i in range(3)])
    assert set(w.sizes[:19]) == {48} and set(w.sizes[19:]) == {16}
    assert w.heap_ranges == [Range(BASE, BASE + 2 * PS)]
    (rbase, rbuf), = w.regions
    assert rbase == BASE and bytes(rbuf) == a + b


def test_pool_scan_leaves_a_pool_that_does_not_add_up_to_the_old_treatment():
    lay = L.LAYOUTS[(3, 10)]
    good, bad = pool(BASE, 2, 4), pool(BASE + PS, 2, 4, free=(1,), count=1)
    w = obmalloc.scan_pools(BufferMemory({BASE: good + bad}), [anon(BASE, BASE + 2 * PS)], lay)
    assert len(w.blocks) == 4 and w.problems == []
    assert w.heap_ranges == [Range(BASE, BASE + PS)]
    assert len(w.warnings) == 1 and "did not add up" in w.warnings[0]


def arena_state(lay, state, table_addr, entries, narenas):
    """Obmalloc state bytes at `state` and the arenas array at table_addr."""
    st = lay.obmalloc.state
    blob = bytearray(st.sizeof)
    struct.pack_into("<Q", blob, st.arenas, table_addr)
    struct.pack_into("<I", blob, st.maxarenas, len(entries))
    struct.pack_into("<Q", blob, st.narenas_currently_allocated, narenas)
    table = bytearray(48 * len(entries))
    for i, (address, pool_address, nfree, ntotal) in enumerate(entries):
        struct.pack_into("<QQII", table, 48 * i, address, pool_address, nfree, ntotal)
    return {state: bytes(blob), table_addr: bytes(table)}


@pytest.mark.parametrize("nfree,narenas,ok", [(62, 1, True), (61, 1, False), (62, 2, False)])
def test_arenas_walk_checks_nfreepools_and_the_arena_count(nfree, narenas, ok):
    lay = L.LAYOUTS[(3, 12)]
    arena = BASE + 0x1000                      # not pool aligned: first pool rounds up
    first = BASE + PS
    blocks = {first: pool(first, 1, 5) + pool(first + PS, 1, 2, free=(0, 1))}   # used + empty
    # 63 pools fit; 2 carved (1 empty) -> nfreepools = 1 empty + 61 uncarved = 62
    mem = BufferMemory({**blocks, **arena_state(lay, 0x5000, 0x9000,
                                                [(0, 0, 0, 0), (arena, first + 2 * PS, nfree, 63)],
                                                narenas)})
    w = obmalloc.walk_arenas(mem, lay, [0x5000])
    assert (w.problems == []) == ok, w.problems
    assert list(w.blocks) == [first + 48 + 32 * i for i in range(5)]
    assert w.heap_ranges == [Range(arena, arena + (1 << 20))]
    assert w.stats["empty_pools"] == 1 and w.stats["arenas"] == 1


def test_the_arenas_walk_gives_the_unused_entries_as_dead():
    # a freed arena's entry keeps its pool_address (here into memory a later mmap may take)
    lay = L.LAYOUTS[(3, 12)]
    first = BASE + PS
    mem = BufferMemory({first: pool(first, 1, 5),
                        **arena_state(lay, 0x5000, 0x9000,
                                      [(0, BASE + (8 << 20), 0, 64), (BASE + 0x1000, first + PS, 62, 63),
                                       (0, 0, 0, 0), (0, 0, 0, 0)], 1)})
    w = obmalloc.walk_arenas(mem, lay, [0x5000])
    assert w.problems == []
    # the unused entries whole, the links of the one in use
    assert w.dead == [Range(0x9000, 0x9030), Range(0x9050, 0x90C0)]


TABLE = 0x5560_0000_1010             # a malloc'd arenas array (3.8-3.11)


def arena_table(entries, links=(), usable=None):
    """{address: bytes} of a malloc chunk at TABLE - 16 holding arena entries (address,
    pool_address, nfreepools, ntotalpools) and (entry, nextarena, prevarena) links."""
    usable = usable if usable is not None else 16 * 48 + 8
    table = bytearray(usable)
    for i, (address, pool_address, nfree, ntotal) in enumerate(entries):
        struct.pack_into("<QQII", table, 48 * i, address, pool_address, nfree, ntotal)
    for i, nxt, prv in links:
        struct.pack_into("<QQ", table, 48 * i + 32, nxt, prv)
    return {TABLE - 16: struct.pack("<QQ", 0, (usable + 8) | 1) + bytes(table)}


@pytest.mark.parametrize("case", ["found", "pools outside", "small", "bad arena", "no word"])
def test_a_scanned_runtime_s_arenas_array_is_found_by_its_shape(case):
    lay = L.LAYOUTS[(3, 11)]                   # 1 MiB arenas of 16 KiB pools
    om = lay.obmalloc
    arena = BASE + 0x1000
    first = BASE + PS
    entries = [(arena, first + 3 * PS, 0, 63), (0, BASE + (5 << 20), 0, 63), (0, 0, 0, 0)]
    links = [(1, TABLE + 96, 0x5560_0000_0100)]     # a stale prevarena
    pools = [Range(first, first + 3 * PS)]
    if case == "pools outside":
        pools.append(Range(BASE + (2 << 20), BASE + (2 << 20) + PS))
    elif case == "bad arena":
        entries[0] = (arena, first + 3 * PS + 8, 0, 63)
    heap = [Range(TABLE - 0x1000, TABLE + 0x10000)]
    data = bytearray(64)
    if case != "no word":
        struct.pack_into("<Q", data, 40, TABLE)
    spans = [(0x7000_0000, 0x7000_0000 + len(data))]
    obmalloc._ARENA_STATICS.clear()
    usable = 15 * 48 + 8 if case == "small" else None   # fewer than obmalloc's first 16
    mem = BufferMemory({0x7000_0000: bytes(data), **arena_table(entries, links, usable)})
    dead = obmalloc.scanned_arena_dead(mem, spans, heap, om, pools)
    if case == "found":
        assert dead == [Range(TABLE + 32, TABLE + 16 * 48 + 8)]    # and malloc's slack
        assert obmalloc._ARENA_STATICS == {((0x7000_0000, 0x7000_0040),): 0x7000_0000 + 40}
        # the next check reads the remembered word first
        assert obmalloc.scanned_arena_dead(mem, spans, heap, om, pools) == dead
    else:
        assert dead == []


def test_arenas_listed_out_of_address_order_give_ascending_blocks():
    # the arenas array's order is not the arenas' address order: entry 0 is the higher arena
    # (mmap gives each new arena a lower address). The arenas are walked in address order, so
    # the outputs hold the blocks ascending as written: their views, with the room for the
    # merge in place (no sorted copy)
    lay = L.LAYOUTS[(3, 12)]
    hi, lo = BASE + (4 << 20), BASE
    mem = BufferMemory({hi: pool(hi, 2, 7, free=(3,)), lo: pool(lo, 0, 5) + pool(lo + PS, 1, 2),
                        **arena_state(lay, 0x5000, 0x9000,
                                      [(hi, hi + PS, 63, 64), (lo, lo + 2 * PS, 62, 64)], 2)})
    w = obmalloc.walk_arenas(mem, lay, [0x5000])
    assert w.problems == []
    want = ([lo + 48 + 16 * i for i in range(5)] + [lo + PS + 48 + 32 * i for i in range(2)]
            + [hi + 48 + 48 * i for i in range(7) if i != 3])
    assert list(w.blocks) == want
    assert list(w.sizes) == [16] * 5 + [32] * 2 + [48] * 6
    begins, sizes = w.room
    assert list(begins[:len(want)]) == want and list(sizes[:len(want)]) == list(w.sizes)
    assert w.heap_ranges == [Range(lo, lo + (1 << 20)), Range(hi, hi + (1 << 20))]


def test_two_interpreters_arenas_interleaved_give_ascending_blocks():
    # two obmalloc states (subinterpreters with their own allocator) whose arenas interleave:
    # each array is walked in address order, the whole is not, and is sorted at the end (a
    # copy: no room for a merge in place)
    lay = L.LAYOUTS[(3, 12)]
    a1, b1, a2 = BASE, BASE + (2 << 20), BASE + (4 << 20)
    mem = BufferMemory({a1: pool(a1, 0, 3), b1: pool(b1, 1, 2), a2: pool(a2, 2, 4, free=(0,)),
                        **arena_state(lay, 0x100000, 0x300000,
                                      [(a2, a2 + PS, 63, 64), (a1, a1 + PS, 63, 64)], 2),
                        **arena_state(lay, 0x200000, 0x310000, [(b1, b1 + PS, 63, 64)], 1)})
    w = obmalloc.walk_arenas(mem, lay, [0x100000, 0x200000])
    assert w.problems == []
    want = ([a1 + 48 + 16 * i for i in range(3)] + [b1 + 48 + 32 * i for i in range(2)]
            + [a2 + 48 + 48 * i for i in range(1, 4)])
    assert list(w.blocks) == want
    assert list(w.sizes) == [16] * 3 + [32] * 2 + [48] * 3
    assert w.room is None


@pytest.mark.parametrize("limit", ["ESTIMATE_BLOCK", "ESTIMATE_MAX", "reserved"])
def test_the_pool_scan_grows_its_output_and_keeps_every_window_s_blocks(monkeypatch, limit):
    # one window per pool and room for a window at first (no estimate, or one capped where no
    # address space can be reserved, as under strict overcommit): the outputs double again and
    # again. With the estimate reserved: one pair of outputs, never grown
    monkeypatch.setattr(obmalloc, "SCAN_WINDOW", PS)
    if limit == "ESTIMATE_BLOCK":
        monkeypatch.setattr(obmalloc, limit, 1 << 40)
    elif limit == "ESTIMATE_MAX":
        monkeypatch.setattr(obmalloc, limit, 1)
        monkeypatch.setattr(obmalloc, "u64_reserve", lambda n: None)
    else:
        def no_scratch(n):
            raise AssertionError("the reserved outputs grew")
        monkeypatch.setattr(obmalloc, "u64_scratch", no_scratch)
        monkeypatch.setattr(obmalloc, "ESTIMATE_MAX", 1)
        monkeypatch.setattr(obmalloc, "ESTIMATE_BLOCK", PS)
    lay = L.LAYOUTS[(3, 11)]
    pools = [pool(BASE + k * PS, k % 3, 100 + k, free=(k,)) for k in range(6)]
    w = obmalloc.scan_pools(BufferMemory({BASE: b"".join(pools)}), [anon(BASE, BASE + 6 * PS)],
                            lay)
    want = [(BASE + k * PS + 48 + 16 * (k % 3 + 1) * i, 16 * (k % 3 + 1))
            for k in range(6) for i in range(100 + k) if i != k]
    assert list(zip(w.blocks, w.sizes)) == want and w.problems == [] and w.warnings == []


def test_arenas_walk_without_arenas_is_pymalloc_unused():
    lay = L.LAYOUTS[(3, 13)]
    w = obmalloc.walk_arenas(BufferMemory(arena_state(lay, 0x5000, 0, [], 0)), lay, [0x5000])
    assert not w.in_use and w.method == "none" and w.problems == []


# --- data stacks, free lists, interpreters -----------------------------------------------------
def test_datastack_live_and_dead_parts():
    lay = L.LAYOUTS[(3, 12)]
    ds = lay.datastack
    ts, cur, old = 0x1000, 0x20000, 0x30000
    t = bytearray(lay.tstate_size)
    struct.pack_into("<Q", t, ds.tstate_chunk, cur)
    struct.pack_into("<Q", t, ds.tstate_top, cur + 24 + 800)
    struct.pack_into("<Q", t, ds.tstate_limit, cur + 16384)
    mem = BufferMemory({ts: bytes(t), cur: struct.pack("<QQQ", old, 16384, 0),
                        old: struct.pack("<QQQ", 0, 16384, 2033)})
    info = walker.read_datastack(mem, lay, ts)
    assert info.live == [Range(cur + 24, cur + 824), Range(old + 24, old + 24 + 8 * 2033)]
    assert info.dead == [Range(cur + 824, cur + 16384), Range(old + 24 + 8 * 2033, old + 16384)]
    struct.pack_into("<Q", t, ds.tstate_limit, cur + 8192)            # limit != chunk + size
    with pytest.raises(locate.LayoutMismatch):
        walker.read_datastack(BufferMemory({ts: bytes(t), cur: struct.pack("<QQQ", 0, 16384, 0)}),
                              lay, ts)


def freelist_interp(lay, interp, floats, lists, refcnt=0):
    """Interpreter bytes with `floats` chained on the float list and `lists` in the list array;
    each object gets ob_refcnt `refcnt`."""
    fl = lay.freelists
    blob = bytearray(fl.keys_numfree + 8)
    struct.pack_into("<i", blob, fl.float_numfree, len(floats))
    struct.pack_into("<Q", blob, fl.float_head, floats[0] if floats else 0)
    struct.pack_into("<i", blob, fl.list_numfree, len(lists))
    for k, o in enumerate(lists):
        struct.pack_into("<Q", blob, fl.list_items + 8 * k, o)
    struct.pack_into("<Q", blob, fl.list_items + 8 * len(lists), 0xDEAD0)   # a stale slot
    blocks = {interp: bytes(blob)}
    for a, b in zip(floats, floats[1:] + [0]):
        blocks[a] = struct.pack("<QQ", refcnt, b)
    for o in lists:
        blocks[o] = struct.pack("<QQ", refcnt, 0x1234)
    return blocks


@pytest.mark.parametrize("version", [(3, 10), (3, 11), (3, 12), (3, 13)])
def test_free_lists_give_dead_blocks_and_dead_array_ranges(version):
    lay = L.LAYOUTS[version]
    interp = 0x100000
    mem = BufferMemory(freelist_interp(lay, interp, [0x50000, 0x50100], [0x60010]))
    dead, ranges = walker.read_freelists(mem, lay, interp)
    assert sorted(dead) == [0x50000, 0x50100, 0x60000]    # floats as is, list minus its GC head
    fl = lay.freelists
    assert Range(interp + fl.list_items, interp + fl.list_items + 640) in ranges
    assert Range(interp + fl.float_head, interp + fl.float_head + 8) in ranges
    live = BufferMemory(freelist_interp(lay, interp, [0x50000], [], refcnt=1))
    with pytest.raises(walker._FreeListError):
        walker.read_freelists(live, lay, interp)


def runtime_image(lay, rt, interp, tstates, back=None, main=None):
    """_PyRuntime -> one interpreter -> the thread states (linked); back overrides tstate->interp."""
    blocks = {}
    r = bytearray(lay.runtime_size)
    struct.pack_into("<QQ", r, lay.interpreters_head, interp, interp if main is None else main)
    blocks[rt] = bytes(r)
    i = bytearray(lay.interp_size)
    struct.pack_into("<Q", i, lay.interp_threads_head, tstates[0][0] if tstates else 0)
    blocks[interp] = bytes(i)
    for k, (ts, tid) in enumerate(tstates):
        t = bytearray(lay.tstate_size)
        struct.pack_into("<Q", t, lay.tstate_next, tstates[k + 1][0] if k + 1 < len(tstates) else 0)
        struct.pack_into("<Q", t, lay.tstate_interp, interp if back is None else back)
        struct.pack_into("<Q", t, lay.tstate_native_thread_id, tid)
        blocks[ts] = bytes(t)
    return blocks


def regs(tid):
    return ThreadState(tid, tuple([0] * 27))


@pytest.mark.parametrize("case,ok", [("good", True), ("back", False), ("main", False),
                                     ("tid", False)])
def test_interpreter_walk_validates_the_layout(case, ok):
    lay = L.LAYOUTS[(3, 12)]
    rt, interp = 0x400000, 0x600000
    ts = [(0x800000, 101), (0x810000, 102)]
    mem = BufferMemory(runtime_image(lay, rt, interp, ts, back=0x999 if case == "back" else None,
                                     main=0x700000 if case == "main" else None))
    maps = [anon(0x400000, 0x900000)]
    runtime = locate.Runtime("/x/libpython3.12.so", rt, (3, 12), None, "test", True, "dynsym")
    threads = [regs(555)] if case == "tid" else [regs(101)]
    if ok:
        (info,) = locate.walk_interpreters(mem, maps, runtime, lay, threads)
        assert info.address == interp
        assert [(t.address, t.native_thread_id) for t in info.threads] == ts
    else:
        with pytest.raises(locate.LayoutMismatch):
            locate.walk_interpreters(mem, maps, runtime, lay, threads)


def test_runtime_candidates_are_python_objects_not_extension_modules():
    from memunreachable._types import Mapping
    from memunreachable.heaps.cpython.locate import _candidates
    paths = ["/usr/lib/x86_64-linux-gnu/libc.so.6",
             "/opt/py/lib/python3.11/lib-dynload/_bisect.cpython-311-x86_64-linux-gnu.so",
             "/opt/py/lib/python3.11/site-packages/numpy/core/_multiarray_umath.cpython-311-x86_64-linux-gnu.so",
             "/opt/py/bin/python3.11", "/opt/py/lib/libpython3.11.so.1.0"]
    maps = [Mapping(0x1000 * (i + 1), 0x1000 * (i + 2), "r--p", 0, "08:01", 10 + i, p)
            for i, p in enumerate(paths)]
    # the libpython first, then the executable; libc and extension modules never (a process
    # with 27 extension modules parsed each of them on every check: 400 ms)
    assert [p for p, _ in _candidates(maps, None)] == [paths[4], paths[3]]


@pytest.mark.parametrize("copied", ["all", "first", "none"])
def test_free_list_chains_followed_natively_in_the_copies_give_the_same_answers(copied):
    # read_freelists follows the float and tuple chains in the sweep's copies natively
    # (mu_follow_chain) and the rest through mem: a chain wholly, partly or not at all in the
    # copies gives the same dead blocks and the same errors
    from memunreachable.collect.memory import CopiedMemory
    lay = L.LAYOUTS[(3, 11)]
    interp, floats = 0x100000, [0x50000, 0x50100, 0x50200, 0x50300]
    def mem_of(blocks):
        keep = {"all": floats, "first": floats[:2], "none": []}[copied]
        return CopiedMemory(BufferMemory(blocks), [(a, bytearray(blocks[a])) for a in keep])
    blocks = freelist_interp(lay, interp, floats, [0x60010])
    dead, _ = walker.read_freelists(mem_of(blocks), lay, interp)
    assert sorted(dead) == floats + [0x60000]
    mem = mem_of(blocks)
    native = walker._follow_chain(mem, walker._copy_regions(mem), floats[0], 4, L.OB_TYPE)
    assert list(native) == {"all": floats, "first": floats[:2], "none": []}[copied]
    assert native.next == (floats + [0])[len(native)]       # where mem takes over
    bad = dict(blocks)
    bad[0x50200] = struct.pack("<QQ", 1, 0x50300)           # a live object on the list
    with pytest.raises(walker._FreeListError, match="float entry 0x50200 is not a dead object"):
        walker.read_freelists(mem_of(bad), lay, interp)
    short = dict(blocks)
    short[0x50200] = struct.pack("<QQ", 0, 0)               # the chain ends after 3 of 4
    with pytest.raises(walker._FreeListError, match="float free list shorter than numfree"):
        walker.read_freelists(mem_of(short), lay, interp)


# --- 3.13+: layouts from the runtime's own _Py_DebugOffsets (issue 22) ----------------------
# What each build's _Py_DebugOffsets says, as offsetof() printed it against that build's
# headers (layout.SUPPLEMENTS' comments): PY_VERSION_HEX, then group.field -> value.
BUILDS = {
    "3.13.0": (0x030D00F0, {"runtime_state.size": 283320, "runtime_state.interpreters_head": 632,
                            "interpreter_state.size": 194968, "interpreter_state.next": 7264,
                            "interpreter_state.threads_head": 7344, "interpreter_state.gc": 7400,
                            "thread_state.size": 304, "thread_state.next": 8,
                            "thread_state.interp": 16, "thread_state.thread_id": 152,
                            "thread_state.native_thread_id": 160,
                            "thread_state.datastack_chunk": 232, "tuple_object.ob_item": 24,
                            "interpreter_frame.localsplus": 72}),
    "3.13.5": (0x030D05F0, {"runtime_state.size": 283376, "interpreter_state.size": 194976}),
    "3.13.18": (0x030D12F0, {"runtime_state.size": 283408, "interpreter_state.size": 194984,
                             "thread_state.size": 312}),
    "3.14.10": (0x030E0AF0, {"runtime_state.size": 316616, "runtime_state.interpreters_head": 808,
                             "interpreter_state.size": 225864, "interpreter_state.next": 7272,
                             "interpreter_state.threads_head": 7344, "interpreter_state.gc": 7408,
                             "thread_state.size": 832, "thread_state.next": 8,
                             "thread_state.interp": 16, "thread_state.thread_id": 152,
                             "thread_state.native_thread_id": 160,
                             "thread_state.datastack_chunk": 232, "tuple_object.ob_item": 32,
                             "interpreter_frame.localsplus": 80}),
    "3.15.2": (0x030F02F0, {"runtime_state.size": 346560, "runtime_state.interpreters_head": 936,
                            "interpreter_state.size": 226232, "interpreter_state.next": 7264,
                            "interpreter_state.threads_head": 7336, "interpreter_state.gc": 7400,
                            "thread_state.size": 888, "thread_state.next": 8,
                            "thread_state.interp": 16, "thread_state.thread_id": 176,
                            "thread_state.native_thread_id": 184,
                            "thread_state.datastack_chunk": 256, "tuple_object.ob_item": 32,
                            "interpreter_frame.localsplus": 80}),
}
# (preconfig.allocator, GC generations, interp->obmalloc, datastack_cached_chunk) per build
EXPECT = {"3.13.0": (10396, 24, 10800, None), "3.13.5": (10396, 20, 10800, None),
          "3.13.18": (10420, 20, 10800, 304), "3.14.10": (10612, 24, 10904, 824),
          "3.15.2": (10732, 8, 10880, 280)}


def build_offsets(name):
    vhex, values = BUILDS[name]
    if name in ("3.13.5", "3.13.18"):
        values = dict(BUILDS["3.13.0"][1], **values)
    return vhex, values


def debug_image(vhex, values, free_threaded=0, cookie=L.DEBUG_COOKIE):
    """The bytes of a _Py_DebugOffsets of version vhex: values by group.field, others 0."""
    version = (vhex >> 24, (vhex >> 16) & 0xFF)
    keys = [f"{g}.{n}" for g, names in L.DEBUG_FIELDS[version] for n in names.split()]
    return cookie + struct.pack(f"<QQ{len(keys)}Q", vhex, free_threaded,
                                *[values.get(k, 0) for k in keys])


def preconfig(alloc=1):
    """An initialised PyPreConfig: python init, parse_argv, use_environment, configure_locale."""
    return struct.pack("<10i", 2, 1, 0, 1, 1, 0, 0, 0, 0, alloc)


RT, INTERP, TS = 0x400000, 0x600000, 0x800000


def debug_runtime(name, alloc=1, free_threaded=0, cookie=L.DEBUG_COOKIE, pre_at=None,
                  gen0=None):
    """A _PyRuntime image of build `name` (its debug offsets, PyPreConfig at its place or at
    pre_at, one interpreter whose GC state's generation0 pointer says gen0, one thread state):
    (BufferMemory, Runtime)."""
    vhex, d = build_offsets(name)
    pre, gens = EXPECT[name][:2]
    r = bytearray(d["runtime_state.size"])
    img = debug_image(vhex, d, free_threaded, cookie)
    r[:len(img)] = img
    head = d["runtime_state.interpreters_head"]
    struct.pack_into("<QQ", r, head, INTERP, INTERP)
    at = (pre if pre_at is None else pre_at) - L.PRECONFIG_ALLOCATOR
    r[at:at + 40] = preconfig(alloc)
    i = bytearray(d["interpreter_state.size"])
    struct.pack_into("<Q", i, d["interpreter_state.threads_head"], TS)
    if vhex >> 16 == 0x030D:           # 3.13: PyGC_Head *generation0 -> generations[0].head
        gc = INTERP + d["interpreter_state.gc"]
        struct.pack_into("<Q", i, d["interpreter_state.gc"] + 96, gc + (gens if gen0 is None
                                                                        else gen0))
    t = bytearray(d["thread_state.size"])
    struct.pack_into("<Q", t, d["thread_state.interp"], INTERP)
    struct.pack_into("<Q", t, d["thread_state.native_thread_id"], 101)
    mem = BufferMemory({RT: bytes(r), INTERP: bytes(i), TS: bytes(t)})
    version = (vhex >> 24, (vhex >> 16) & 0xFF)
    return mem, locate.Runtime("/usr/bin/python3.x", RT, version, vhex, "Py_Version", False,
                               "dynsym")


def test_debug_offsets_structs_have_the_sizes_of_their_headers():
    # sizeof(_Py_DebugOffsets) printed against 3.13.0/3.13.5/3.13.18, 3.14.10, 3.15.2 headers
    assert [L.debug_offsets_size(v) for v in ((3, 13), (3, 14), (3, 15))] == [584, 760, 888]
    assert L.debug_offsets_size((3, 16)) is None and L.parse_debug_offsets(b"", (3, 16)) is None
    assert L.parse_debug_offsets(bytes(100), (3, 13)) is None        # too short


@pytest.mark.parametrize("name", list(BUILDS))
def test_debug_offsets_parse_every_field_in_order(name):
    vhex, d = build_offsets(name)
    version = (vhex >> 24, (vhex >> 16) & 0xFF)
    keys = [f"{g}.{n}" for g, names in L.DEBUG_FIELDS[version] for n in names.split()]
    numbered = {k: 1000 + n for n, k in enumerate(keys)}
    got = L.parse_debug_offsets(debug_image(vhex, numbered) + b"tail", version)
    assert got == numbered
    assert len(debug_image(vhex, d)) == L.debug_offsets_size(version)


@pytest.mark.parametrize("name", list(BUILDS))
def test_layout_from_an_in_memory_runtime_of_each_build(name):
    mem, rt = debug_runtime(name)
    _, d = build_offsets(name)
    pre, gens, obm, cached = EXPECT[name]
    lay = locate.debug_layout(mem, rt)
    assert lay.source == "_Py_DebugOffsets" and lay.version == rt.version
    assert (lay.runtime_size, lay.interpreters_head, lay.interp_next, lay.interp_threads_head,
            lay.tstate_next, lay.tstate_interp, lay.tstate_thread_id,
            lay.tstate_native_thread_id) == tuple(d[k] for k in (
                "runtime_state.size", "runtime_state.interpreters_head", "interpreter_state.next",
                "interpreter_state.threads_head", "thread_state.next", "thread_state.interp",
                "thread_state.thread_id", "thread_state.native_thread_id"))
    assert lay.interpreters_main == lay.interpreters_head + 8
    assert lay.preconfig_allocator == pre and lay.obmalloc.state.interp_offset == obm
    ds = lay.datastack
    chunk = d["thread_state.datastack_chunk"]
    assert (ds.tstate_chunk, ds.tstate_top, ds.tstate_limit, ds.tstate_cached_chunk) == \
        (chunk, chunk + 8, chunk + 16, cached)
    assert lay.tuple_items == d["tuple_object.ob_item"]
    assert lay.frame_localsplus == d["interpreter_frame.localsplus"]
    assert lay.gc.offset == d["interpreter_state.gc"]
    assert (lay.freelists is not None) == (rt.version == (3, 13))
    assert (lay.freelist_heads is not None) == (rt.version >= (3, 14))
    # validated by walking: the interpreter, its thread state, the GC generations' place
    (info,) = locate.walk_interpreters(mem, [anon(0x400000, 0x900000)], rt, lay, [regs(101)])
    assert [t.address for t in info.threads] == [TS]
    lay = locate.resolve_gc(mem, lay, [info])
    assert lay.gc.generations == gens and lay.gc.generation0 is None
    assert locate.read_allocator(mem, rt, lay) == 1


def test_free_list_heads_of_3_14_and_3_15_sit_where_offsetof_says():
    # probe output: 3.14.10 tuples 11152, lists 11472, dictkeys 11536, pymethodobjects 11728;
    # 3.15.2 complexes 11112, tuples 11144, lists 11464, dictkeys 11528, bytes_writers 11688
    for v, want in (((3, 14), {"tuples[0]": 11152, "lists": 11472, "dictkeys": 11536,
                               "pymethodobjects": 11728}),
                    ((3, 15), {"complexes": 11112, "tuples[0]": 11144, "lists": 11464,
                               "dictkeys": 11528, "bytes_writers": 11688,
                               "pymethodobjects": 11736})):
        lists = {name: (off, obj) for name, off, obj in L.SUPPLEMENTS[v].freelist_heads.lists()}
        assert {k: lists[k][0] for k in want} == want
        assert not lists["dictkeys"][1] and lists["lists"][1] and lists["tuples[19]"][1]
    assert L.SUPPLEMENTS[(3, 14)].freelist_heads.sizeof == 624
    assert L.SUPPLEMENTS[(3, 15)].freelist_heads.sizeof == 656


def test_a_runtime_size_of_no_known_build_takes_the_one_plausible_preconfig():
    # a 3.13.x of another size: the PyPreConfig at one of the known places decides
    mem, rt = debug_runtime("3.13.18")
    r = bytearray(mem.blocks[RT])
    struct.pack_into("<Q", r, 24, 283999)                         # runtime_state.size
    mem.blocks[RT] = bytes(r)
    assert locate.debug_layout(mem, rt).preconfig_allocator == 10420
    # neither place holds one: refused
    r[10420 - 36:10420 + 4] = bytes(40)
    mem.blocks[RT] = bytes(r)
    with pytest.raises(locate.LayoutMismatch, match="0 of the known PyPreConfig places"):
        locate.debug_layout(mem, rt)


@pytest.mark.parametrize("ints,ok", [((2, 1, 0, 1, 1, 0, 0, 0, 0, 3), True),
                                     ((1, 0, 1, 0, 0, 2, 1, -1, -1, 0), True),
                                     ((0, 1, 0, 1, 1, 0, 0, 0, 0, 1), False),
                                     ((2, 1, 0, 1, 1, 0, 0, 0, 0, 9), False),
                                     ((2, 5, 0, 1, 1, 0, 0, 0, 0, 1), False),
                                     ((2, 1, 0, 1), False)])
def test_preconfig_plausibility(ints, ok):
    assert L.preconfig_plausible(ints) == ok


def test_a_wrong_cookie_or_version_is_refused():
    mem, rt = debug_runtime("3.14.10", cookie=b"xdebugpz")
    with pytest.raises(locate.LayoutMismatch, match="no _Py_DebugOffsets cookie"):
        locate.debug_layout(mem, rt)
    mem, rt = debug_runtime("3.14.10")
    with pytest.raises(locate.LayoutMismatch, match="says version 0x30e0af0"):
        locate.debug_layout(mem, locate.Runtime(rt.object_path, RT, (3, 13), None, "file name",
                                                False, "dynsym"))


def test_the_free_threaded_flag_is_recognised():
    mem, rt = debug_runtime("3.14.10", free_threaded=1)
    with pytest.raises(locate.FreeThreaded):
        locate.debug_layout(mem, rt)


def test_generation0_elsewhere_than_a_known_place_does_not_fit():
    mem, rt = debug_runtime("3.13.5", gen0=28)
    lay = locate.debug_layout(mem, rt)
    interps = locate.walk_interpreters(mem, [anon(0x400000, 0x900000)], rt, lay, [regs(101)])
    with pytest.raises(locate.LayoutMismatch, match=r"generations at \[28\]"):
        locate.resolve_gc(mem, lay, interps)


def _walk_fake(monkeypatch, mem, rt):
    monkeypatch.setattr(locate, "find_runtime", lambda mem, maps, pid=None: rt)
    return walker.walk_cpython(mem, [anon(0x400000, 0x900000)], [regs(101)])


def test_walker_refuses_free_threaded_builds_by_name(monkeypatch):
    mem, rt = debug_runtime("3.14.10", free_threaded=1)
    cm = _walk_fake(monkeypatch, mem, rt)
    assert cm.found and not cm.usable and cm.layout is None
    (w,) = cm.warnings
    assert "free-threaded CPython 3.14t is not supported: its objects live in mimalloc" in w


@pytest.mark.parametrize("case", ["cookie", "tstate", "mimalloc", "3.16"])
def test_walker_leaves_a_layout_that_does_not_fit_unusable(monkeypatch, case):
    mem, rt = debug_runtime("3.15.2", cookie=b"nodebug!" if case == "cookie" else L.DEBUG_COOKIE,
                            alloc=7 if case == "mimalloc" else 1)
    if case == "tstate":                # the thread state does not point back
        mem.blocks[TS] = bytes(len(mem.blocks[TS]))
    if case == "3.16":
        rt = locate.Runtime(rt.object_path, RT, (3, 16), 0x031000F0, "Py_Version", False, "dynsym")
    cm = _walk_fake(monkeypatch, mem, rt)
    assert cm.found and not cm.usable and len(cm.warnings) == 1
    want = {"cookie": "the CPython 3.15 layout does not fit (no _Py_DebugOffsets cookie",
            "tstate": "the CPython 3.15 layout does not fit (thread state",
            "mimalloc": "the mimalloc allocator (PYTHONMALLOC) is not supported",
            "3.16": "is 3.16, which has no known memory layout"}[case]
    assert want in cm.warnings[0] and "cannot be checked" in cm.warnings[0]


def test_3_14_free_lists_are_chains_through_the_first_word():
    lay = L.SUPPLEMENTS[(3, 14)]
    fh = lay.freelist_heads
    lists = {name: off for name, off, _ in fh.lists()}
    meta, flt, tup = 0x500000, 0x500400, 0x500800          # type, float, tuple type objects
    types = bytearray(0x1000)
    for t, flags in ((meta, 0), (flt, 0), (tup, L.TPFLAGS_HAVE_GC)):
        struct.pack_into("<Q", types, t - meta + L.OB_TYPE, meta)
        struct.pack_into("<Q", types, t - meta + L.TP_FLAGS, flags)
    i = bytearray(fh.offset + fh.sizeof)
    blocks = {meta: bytes(types)}
    f1, f2, t1, k1 = 0x700000, 0x700100, 0x700210, 0x700300     # t1: a tuple, its GC head before
    for name, head, n in (("floats", f1, 2), ("tuples[2]", t1, 1), ("dictkeys", k1, 1),
                          ("lists", 0, -1)):
        struct.pack_into("<Qq", i, lists[name], head, n)
    blocks[f1] = struct.pack("<QQ", f2, flt)                  # f1 -> f2 -> NULL
    blocks[f2] = struct.pack("<QQ", 0, flt)
    blocks[t1] = struct.pack("<QQ", 0, tup)
    blocks[k1] = struct.pack("<Q", 0)
    blocks[INTERP] = bytes(i)
    got_lay = L.LAYOUTS[(3, 13)]._replace(version=(3, 14), freelists=None, freelist_heads=fh)
    dead, ranges = walker.read_freelist_heads(BufferMemory(blocks), got_lay, INTERP)
    assert sorted(dead) == [f1, f2, t1 - 16, k1]
    assert ranges == [Range(INTERP + fh.offset, INTERP + fh.offset + 624)]
    assert sorted(walker.read_freelist_heads(BufferMemory(blocks), got_lay, INTERP, 16)[0]) == \
        [f1 - 16, f2 - 16, t1 - 32, k1 - 16]
    # a count that the chain does not match, an entry without a type: not used
    for name, head, n in (("floats", f1, 3), ("floats", f1, 1)):
        bad = bytearray(i)
        struct.pack_into("<Qq", bad, lists[name], head, n)
        with pytest.raises(walker._FreeListError):
            walker.read_freelist_heads(BufferMemory({**blocks, INTERP: bytes(bad)}),
                                       got_lay, INTERP)
    blocks[f2] = struct.pack("<QQ", 0, 0x123456)
    with pytest.raises(walker._FreeListError, match="has no type"):
        walker.read_freelist_heads(BufferMemory(blocks), got_lay, INTERP)


def test_words_into_keeps_aligned_addresses_inside_and_not_excluded():
    words = array("Q", [0, 0x1000, 0x1008, 0x1010, 0x2000, 0x2ff0, 0x3000, 0x1810, 0x5000])
    inside = array("Q", [0x1000, 0x2000, 0x2800, 0x3000])       # [0x1000, 0x2000), [0x2800, 0x3000)
    outside = array("Q", [0x1800, 0x1900])
    # 0x1008 unaligned, 0x2000 and 0x3000 at ranges' ends, 0x1810 excluded, 0x5000 outside
    assert list(obmalloc.words_into(words, inside, outside)) == [1, 3, 5]
    assert list(obmalloc.words_into(words, inside, array("Q"))) == [1, 3, 5, 7]
    many = array("Q", [0x1010] * 3000)                          # past the first output's room
    assert list(obmalloc.words_into(many, inside, outside)) == list(range(3000))


def test_words_equal_finds_every_whole_word_of_any_value():
    rng = random.Random(7)
    values = [0x7f0000001000, 0x7f0000001008, 0x55550000a0c0]
    for trial in range(20):
        n = rng.randrange(0, 3000)
        words = [rng.choice(values + [0, 1, 0x7f0000001010, 0x7f0000000ff8, 2**64 - 1])
                 for _ in range(n)]
        data = struct.pack(f"<{n}Q", *words) + bytes(rng.randrange(8))     # a partial tail
        want = [k for k, w in enumerate(words) if w in values]
        # any order, repeats: the same set
        given = rng.sample(values, len(values)) + values[:trial % 3]
        assert list(obmalloc.words_equal(data, given)) == want
        assert list(obmalloc.words_equal(memoryview(data), values[:1])) == \
            [k for k, w in enumerate(words) if w == values[0]]
    assert list(obmalloc.words_equal(struct.pack("<2Q", 5, 5) + b"\5", [5])) == [0, 1]
    assert list(obmalloc.words_equal(b"", values)) == []
    assert list(obmalloc.words_equal(struct.pack("<Q", 5), [])) == []
    many = struct.pack("<Q", values[2]) * 5000                  # past the first output's room
    assert list(obmalloc.words_equal(many, values)) == list(range(5000))
    # the values must be sorted and distinct (words_equal sorts them)
    vals = array("Q", [9, 5])
    w = array("Q", [5, 9])
    out = array("Q", [0, 0])
    assert lib.mu_words_equal(ffi.from_buffer("uint64_t[]", w), 2,
                              ffi.from_buffer("uint64_t[]", vals), 2,
                              ffi.from_buffer("uint64_t[]", out), 2) == -errno.EINVAL


def test_the_type_version_cache_is_found_and_checked():
    # 3.14+: interp->types.type_version_cache holds borrowed type pointers (no references); an
    # entry's index is its type's tp_version_tag modulo the size
    size, off = L.TYPE_VERSION_CACHE_SIZE, 0x100
    interp, meta, types = 0x10000, 0x80000, [0x90000 + 0x1000 * k for k in range(6)]
    lay = L.LAYOUTS[(3, 13)]._replace(type_version_cache=off)
    assert walker.version_cache_dead(BufferMemory({}), L.LAYOUTS[(3, 13)], interp) == []
    def memory(entries, tags=None, meta_flags=L.TPFLAGS_TYPE_SUBCLASS):
        cache = bytearray(8 * size + 0x200)         # the cache and the words around it
        for k, t in entries:
            struct.pack_into("<Q", cache, off + 8 * k, t)
        struct.pack_into("<Q", cache, off + 8 * size, 0x12345678)     # the next field
        blocks = {interp: bytes(cache), meta: bytes(L.TP_FLAGS) + struct.pack("<Q", meta_flags)}
        for k, t in entries:
            tag = (tags or {}).get(t, k + 3 * size)
            blocks[t] = (struct.pack("<QQ", 1, meta) + bytes(L.TP_VERSION_TAG - 16)
                         + struct.pack("<I", tag))
        return BufferMemory(blocks)
    entries = [(7 * k + 1, t) for k, t in enumerate(types)]
    got = walker.version_cache_dead(memory(entries), lay, interp)
    assert got == [Range(interp + off, interp + off + 8 * size)]
    assert walker.version_cache_dead(memory([]), lay, interp) == [Range(interp + off,
                                                                        interp + off + 8 * size)]
    # one stale entry in six (a type given a new tag keeps its old entry): still the cache
    stale = {types[0]: 5}
    assert walker.version_cache_dead(memory(entries, stale), lay, interp)
    # a window 8 bytes off: no entry at its type's tag (and, past the end, the next field's
    # word read as an entry)
    for shifted in (off - 8, off + 8):
        with pytest.raises(walker.LayoutMismatch, match="version tag|is no type"):
            walker.version_cache_dead(memory(entries), lay._replace(type_version_cache=shifted),
                                      interp)
    with pytest.raises(walker.LayoutMismatch, match="version tag"):
        walker.version_cache_dead(memory(entries, {t: 5 for t in types[:2]}), lay, interp)
    with pytest.raises(walker.LayoutMismatch, match="no type"):
        walker.version_cache_dead(memory(entries, meta_flags=0), lay, interp)
    with pytest.raises(walker.LayoutMismatch, match="no address"):
        walker.version_cache_dead(memory(entries + [(99, types[0] + 4)]), lay, interp)
    # the tables: 3.14 and 3.15 by sizeof(PyInterpreterState), none before
    assert dict(L.SUPPLEMENTS[(3, 14)].type_version_cache) == {225864: 190344}
    assert dict(L.SUPPLEMENTS[(3, 15)].type_version_cache) == {226240: 190512, 226232: 190512}
    assert L.SUPPLEMENTS[(3, 13)].type_version_cache == ()
