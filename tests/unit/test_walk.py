"""Unit tests of the C chunk walker (native/mu_walk.c) on synthetic in-memory chunk runs."""
import ctypes
import errno
import mmap
import os
import random
import struct
import threading
from array import array

import pytest

from memunreachable._ffi import ffi, lib

BASE = 0x10000000
P, M, N = 1, 2, 4


class Run:
    """Builds a heap image: chunks appended at increasing addresses."""

    def __init__(self, base=BASE, size=1 << 16):
        self.base = base
        self.buf = bytearray(size)
        self.cur = base
        self.chunks = []           # (addr, size, in_use)

    def hdr(self, addr, size_word, prev=0):
        struct.pack_into("<QQ", self.buf, addr - self.base, prev, size_word)

    def chunk(self, size, in_use=True, flags=0):
        a = self.cur
        self.chunks.append((a, size, in_use))
        self.hdr(a, size | flags | P)
        self.cur += size
        return a

    def finish_top(self, top_size=0x100):
        """Fix PREV_INUSE bits from the in_use list, then a top chunk."""
        top = self.cur
        self.hdr(top, top_size | P)
        for i, (a, s, used) in enumerate(self.chunks):
            nxt = a + s
            w = struct.unpack_from("<Q", self.buf, nxt - self.base + 8)[0]
            w = (w | P) if used else (w & ~P)
            struct.pack_into("<Q", self.buf, nxt - self.base + 8, w)
        return top

    def set_word(self, addr, value):
        struct.pack_into("<Q", self.buf, addr - self.base, value)


def walk(run, first, top, non_main=0, cap=1000):
    user, usable = array("Q", bytes(8 * cap)), array("Q", bytes(8 * cap))
    res = ffi.new("mu_walk_result *")
    n = lib.mu_walk_run(ffi.from_buffer(run.buf), run.base, len(run.buf), first, top, non_main,
                        ffi.from_buffer("uint64_t[]", user), ffi.from_buffer("uint64_t[]", usable),
                        cap, res)
    assert n >= 0
    return list(zip(user[:n], usable[:n])), res


def test_in_use_by_next_prev_inuse_and_top():
    r = Run()
    a = r.chunk(0x20)
    b = r.chunk(0x90, in_use=False)
    c = r.chunk(0x410)
    top = r.finish_top(0x1000)
    got, res = walk(r, BASE, top)
    assert got == [(a + 16, 0x18), (c + 16, 0x408)]
    assert res.status == lib.MU_WALK_TOP and res.end == top + 0x1000
    assert (res.chunks, res.in_use, res.free_chunks, res.free_bytes) == (3, 2, 1, 0x90)
    assert res.in_use_bytes == 0x430
    assert b not in [u - 16 for u, _ in got]


def test_double_fencepost_ends_a_main_run():
    r = Run()
    a = r.chunk(0x30)
    r.finish_top()
    fence = r.cur
    r.hdr(fence, 0x10 | P)
    r.hdr(fence + 16, 0x10 | P)
    got, res = walk(r, BASE, 0)
    assert got == [(a + 16, 0x28)]
    assert res.status == lib.MU_WALK_FENCE2 and res.end == fence + 32


def test_heap_end_fencepost_and_pseudo_chunk_never_reported():
    r = Run()
    a = r.chunk(0x40, flags=N)
    pseudo = r.cur
    r.hdr(pseudo, 0x20 | P)          # old top < MINSIZE+16 became a 0x20 pseudo chunk
    r.hdr(pseudo + 0x20, 0 | P)
    r.set_word(a + 0x40 + 8, 0x20 | P)
    got, res = walk(r, BASE, 0, non_main=1)
    assert got == [(a + 16, 0x38)]
    assert res.status == lib.MU_WALK_FENCE0 and res.end == pseudo + 0x30
    # the usual {0x10|1, 0|1} pair
    r2 = Run()
    b = r2.chunk(0x40, flags=N)
    r2.hdr(r2.cur, 0x10 | P)
    r2.hdr(r2.cur + 16, 0 | P)
    got, res = walk(r2, BASE, 0, non_main=1)
    assert got == [(b + 16, 0x38)] and res.status == lib.MU_WALK_FENCE0


def test_broken_chains_are_reported():
    r = Run()
    r.chunk(0x30)
    bad = r.cur
    r.hdr(bad, 0x38 | P)             # not a multiple of 16
    _, res = walk(r, BASE, 0)
    assert res.status == lib.MU_WALK_BAD_SIZE and res.bad_at == bad
    r = Run()
    a = r.chunk(0x30)                # main arena chunk in a non-main walk: wrong flags
    top = r.finish_top()
    _, res = walk(r, BASE, top, non_main=1)
    assert res.status == lib.MU_WALK_BAD_FLAGS and res.bad_at == a
    r = Run()
    r.chunk(0x30)
    r.chunk(0x30)
    _, res = walk(r, BASE, BASE + 0x40)   # top inside the second chunk: stepped over
    assert res.status == lib.MU_WALK_PAST_TOP


def test_cap_counts_beyond_storage():
    r = Run()
    for _ in range(10):
        r.chunk(0x20)
    top = r.finish_top()
    got, res = walk(r, BASE, top, cap=4)
    assert len(got) == 4 and res.in_use == 10


def test_mmapped_scan_with_memalign_moved_header():
    buf = bytearray(0x40000)
    base = 0x7f0000000000
    struct.pack_into("<QQ", buf, 0, 0, 0x5000 | M)                 # plain chunk
    struct.pack_into("<QQ", buf, 0x5000, 0, 0x10000 | M)           # stale memalign header
    struct.pack_into("<QQ", buf, 0x5000 + 0x3ff0, 0x3ff0, (0x10000 - 0x3ff0) | M)
    struct.pack_into("<QQ", buf, 0x20000, 0, 0x1000 | M | P)       # flags wrong: not a chunk
    user, usable = array("Q", bytes(80)), array("Q", bytes(80))
    res = ffi.new("mu_mmap_result *")
    n = lib.mu_walk_mmapped(ffi.from_buffer(buf), base, len(buf), len(buf), 4096, 0, 16, 0,
                            ffi.from_buffer("uint64_t[]", user), ffi.from_buffer("uint64_t[]", usable),
                            10, res)
    assert n == 2
    assert list(zip(user[:2], usable[:2])) == [(base + 16, 0x5000 - 16),
                                               (base + 0x5000 + 0x3ff0 + 16, 0x10000 - 0x3ff0 - 16)]
    assert (res.found, res.bytes, res.moved) == (2, 0x15000, 1)


def regions(*runs):
    tab = ffi.new("mu_region[]", len(runs))
    keep = []
    for i, r in enumerate(sorted(runs, key=lambda r: r.base)):
        p = ffi.from_buffer(r.buf)
        keep.append(p)
        tab[i].base, tab[i].len, tab[i].data = r.base, len(r.buf), ffi.cast("uint8_t *", p)
    return tab, keep


def in_use(run):
    """Ascending (user, usable) arrays of the run's in-use chunks, as the walk reports them."""
    pairs = sorted((a + 16, s - 8) for a, s, used in run.chunks if used)
    return array("Q", [u for u, _ in pairs]), array("Q", [z for _, z in pairs])


def chain(tab, n, run, head, bias, mangled, size, max_nodes, arena=0, cap=64, size_max=None):
    user, usable = in_use(run)
    out = array("Q", bytes(8 * cap))
    res = ffi.new("mu_chain_result *")
    k = lib.mu_walk_chain(tab, n, ffi.from_buffer("uint64_t[]", user), ffi.from_buffer("uint64_t[]", usable),
                          len(user), head, bias, mangled, size, size if size_max is None else size_max,
                          arena, max_nodes, ffi.from_buffer("uint64_t[]", out), cap, res)
    assert k == res.nodes
    return res.status, list(out[:min(k, cap)]), res


def test_tcache_and_fastbin_chains_safe_linking():
    r = Run()
    nodes = [r.chunk(0x30) for _ in range(4)]
    r.finish_top()
    users = [c + 16 for c in nodes]
    # tcache chain users[0] -> users[2] -> users[3] -> NULL, mangled with the field address
    links = {users[0]: users[2], users[2]: users[3], users[3]: 0}
    for at, nxt in links.items():
        r.set_word(at, (at >> 12) ^ nxt)
    tab, keep = regions(r)
    st, got, res = chain(tab, 1, r, users[0], 0, 1, 0x30, 3)
    assert (st, got) == (lib.MU_CHAIN_NULL, [users[0], users[2], users[3]]) and res.last == users[3]
    st, got, res = chain(tab, 1, r, users[0], 0, 0, 0x30, 3)        # wrong decoding: breaks at once
    assert st == lib.MU_CHAIN_BAD and got == [users[0]] and res.last == users[0]
    st, got, res = chain(tab, 1, r, users[0], 0, 1, 0x40, 3)        # wrong bin size: the head fails
    assert (st, got, res.reason, res.last, res.bad) == (lib.MU_CHAIN_BAD, [], lib.MU_LINK_WRONG_SIZE,
                                                        0, users[0])
    st, got, res = chain(tab, 1, r, users[0], 0, 1, 0x30, 2)        # longer than allowed
    assert (st, got, res.last, res.bad) == (lib.MU_CHAIN_LONG, users[:1] + users[2:3], users[2], users[3])
    # fastbin: chunk pointers, bias 16, raw (pre-2.32); main arena only (NON_MAIN_ARENA clear)
    r.set_word(users[1], nodes[0])
    r.set_word(users[0], 0)
    assert chain(tab, 1, r, nodes[1], 16, 0, 0x30, 10)[:2] == (lib.MU_CHAIN_NULL, [users[1], users[0]])
    assert chain(tab, 1, r, nodes[1], 16, 0, 0x30, 10, arena=1)[0] == lib.MU_CHAIN_NULL
    st, got, res = chain(tab, 1, r, nodes[1], 16, 0, 0x30, 10, arena=2)
    assert (st, res.reason, got) == (lib.MU_CHAIN_BAD, lib.MU_LINK_WRONG_ARENA, [])


def test_chain_cycles_are_cut_exactly():
    r = Run()
    nodes = [r.chunk(0x50) for _ in range(6)]
    r.finish_top()
    u = [c + 16 for c in nodes]
    tab, keep = regions(r)
    # u0 -> u1 -> u2 -> u3 -> u4 -> u2: 5 distinct nodes, the link of u4 loops back to u2
    for a, b in [(0, 1), (1, 2), (2, 3), (3, 4), (4, 2)]:
        r.set_word(u[a], (u[a] >> 12) ^ u[b])
    st, got, res = chain(tab, 1, r, u[0], 0, 1, 0x50, 1000)
    assert (st, got, res.last, res.bad) == (lib.MU_CHAIN_CYCLE, u[:5], u[4], u[2])
    # with a small output buffer the prefix count and the closing node are still exact
    st, got, res = chain(tab, 1, r, u[0], 0, 1, 0x50, 1000, cap=2)
    assert (st, res.nodes, got, res.last, res.bad) == (lib.MU_CHAIN_CYCLE, 5, u[:2], u[4], u[2])
    # a node linking to itself
    r.set_word(u[5], (u[5] >> 12) ^ u[5])
    st, got, res = chain(tab, 1, r, u[5], 0, 1, 0x50, 1000)
    assert (st, got, res.last, res.bad) == (lib.MU_CHAIN_CYCLE, [u[5]], u[5], u[5])


def test_chain_refuses_what_is_not_an_in_use_chunk_of_the_size():
    r = Run()
    a = r.chunk(0x50)
    f = r.chunk(0x50, in_use=False)
    b = r.chunk(0x50)
    r.finish_top()
    tab, keep = regions(r)
    for target, reason in [(a + 16 + 8, lib.MU_LINK_MISALIGNED), (f + 16, lib.MU_LINK_NOT_CHUNK),
                           (0x4141414141414140, lib.MU_LINK_NOT_CHUNK), (b + 32, lib.MU_LINK_NOT_CHUNK)]:
        r.set_word(a + 16, target)
        st, got, res = chain(tab, 1, r, a + 16, 0, 0, 0x50, 7)
        assert (st, res.reason, got, res.last, res.bad) == (lib.MU_CHAIN_BAD, reason, [a + 16], a + 16, target)


def tcache_struct(r, counts, heads, tc):
    """Allocate a struct of tc's chunk size in r holding counts/heads; returns its user address."""
    c = r.chunk(tc.chunk_size)
    u = c + 16
    for i, n in enumerate(counts):
        struct.pack_into("<H", r.buf, u - r.base + 2 * i, n)
    for i, h in enumerate(heads):
        r.set_word(u + tc.entries + 8 * i, h)
    return u


def bin_ranges(tc):
    """(bin_min, bin_max) arrays of tc's chunk sizes per bin, as mu_walk_tcache_scan takes them."""
    ranges = [tc.bin_size_range(i) for i in range(tc.nbins)]
    return array("Q", [a for a, _ in ranges]), array("Q", [b for _, b in ranges])


def scan(tab, n, r, tc, active=64, max_count=7, cap=16, want=0, only=None):
    user, usable = in_use(r)
    out = ffi.new("mu_tcache_cand[]", cap)
    lo, hi = bin_ranges(tc)
    among = array("Q", only or ())
    k = lib.mu_walk_tcache_scan(tab, n, ffi.from_buffer("uint64_t[]", user),
                                ffi.from_buffer("uint64_t[]", usable), len(user),
                                tc.chunk_size - 8, 16, tc.count_width, tc.entries, tc.nbins, active,
                                max_count, int(tc.remaining), ffi.from_buffer("uint64_t[]", lo),
                                ffi.from_buffer("uint64_t[]", hi), 8, want,
                                ffi.NULL if only is None else ffi.from_buffer("uint64_t[]", among),
                                len(among), out, cap)
    return [(o.addr, o.key, o.nonempty, o.heads, o.want_key, o.self_key, o.mismatched)
            for o in out[0:min(k, cap)]]


def test_tcache_scan_prefilter_and_keys():
    from memunreachable.heaps.glibc.layout import TCACHE_U16 as tc
    r = Run(size=1 << 16)
    n0 = r.chunk(0x20)              # bin 0 chunk
    n1 = r.chunk(0x30)              # bin 1 chunk
    n2 = r.chunk(0x30)
    key = 0x1234567890ABCDEF
    real = tcache_struct(r, [1, 1] + [0] * 62, [n0 + 16, n1 + 16] + [0] * 62, tc)
    r.set_word(n0 + 16 + 8, key)
    r.set_word(n1 + 16 + 8, key)
    self_keyed = tcache_struct(r, [0, 1] + [0] * 62, [0, n2 + 16] + [0] * 62, tc)
    r.set_word(n2 + 16 + 8, self_keyed)
    too_many = tcache_struct(r, [8] + [0] * 63, [n0 + 16] + [0] * 63, tc)       # count > max
    wrong_size = tcache_struct(r, [0, 0, 1] + [0] * 61, [0, 0, n1 + 16] + [0] * 61, tc)
    empty = tcache_struct(r, [0] * 64, [0] * 64, tc)
    r.finish_top()
    tab, keep = regions(r)
    got = scan(tab, 1, r, tc)
    assert got == [(real, key, 2, 2, 0, 0, 0), (self_keyed, self_keyed, 1, 1, 0, 1, 0)]
    # the key is counted in every head: one overwritten key still leaves the other
    r.set_word(n0 + 16 + 8, 0x4242)
    assert scan(tab, 1, r, tc, want=key) == [(real, 0x4242, 2, 2, 1, 0, 0)]
    assert {too_many, wrong_size, empty}.isdisjoint(a for a, *_ in got)
    # bins beyond mp_.tcache_bins must be empty
    assert [g[0] for g in scan(tab, 1, r, tc, active=2)] == [real, self_keyed]
    assert [g[0] for g in scan(tab, 1, r, tc, active=1)] == []
    assert len(scan(tab, 1, r, tc, cap=1)) == 1
    # over given blocks alone (a scan for a key over the first scan's candidates): the same
    # records for those; an address that starts no in-use chunk, or a block the prefilter
    # refuses, gives none
    assert scan(tab, 1, r, tc, want=key, only=[real, self_keyed]) == [(real, 0x4242, 2, 2, 1, 0, 0)]
    assert scan(tab, 1, r, tc, only=[n0 + 16, real + 8, self_keyed]) == [
        (self_keyed, self_keyed, 1, 1, 0, 1, 0)]
    assert scan(tab, 1, r, tc, only=[too_many, wrong_size, empty]) == []
    assert scan(tab, 1, r, tc, only=[]) == []


def test_tcache_scan_passes_each_of_many_lookalikes():
    # 20,000 structs of the shape, each with its own head: every one a candidate, in address
    # order (how long the scan takes is bench_shapes.py's walk figure, not a timed test)
    from memunreachable.heaps.glibc.layout import TCACHE_U16 as tc
    n = 20000
    r = Run(size=n * (tc.chunk_size + 0x20) + 0x1000)
    structs = []
    for _ in range(n):
        node = r.chunk(0x20)
        structs.append(tcache_struct(r, [1] + [0] * 63, [node + 16] + [0] * 63, tc))
    r.finish_top()
    tab, keep = regions(r)
    user, usable = in_use(r)
    out = ffi.new("mu_tcache_cand[]", n)
    lo, hi = bin_ranges(tc)
    k = lib.mu_walk_tcache_scan(tab, 1, ffi.from_buffer("uint64_t[]", user),
                                ffi.from_buffer("uint64_t[]", usable), len(user), tc.chunk_size - 8,
                                16, 2, tc.entries, 64, 64, 7, 0, ffi.from_buffer("uint64_t[]", lo),
                                ffi.from_buffer("uint64_t[]", hi), 8, 0, ffi.NULL, 0, out, n)
    assert k == n and [out[i].addr for i in range(n)] == structs
    assert all(out[i].heads == 1 and out[i].nonempty == 1 for i in range(n))


def test_tcache_scan_of_a_big_heap_tests_both_halves():
    # past TWO_WAYS_MIN chunks the sizes are tested on two threads first: a struct below and
    # one above a million other chunks are both found, as when the scan is given them alone
    from memunreachable.heaps.glibc.layout import TCACHE_U16 as tc
    key = 0x1234567890ABCDEF
    runs, reals = [], []
    for base in (0x1000_0000, 0x3000_0000):
        r = Run(base=base)
        node = r.chunk(0x20)
        reals.append(tcache_struct(r, [1] + [0] * 63, [node + 16] + [0] * 63, tc))
        r.set_word(node + 16 + 8, key)
        r.finish_top()
        runs.append(r)
    (u1, z1), (u2, z2) = in_use(runs[0]), in_use(runs[1])
    fill = 1_100_000
    user = u1 + array("Q", range(0x2000_0000, 0x2000_0000 + 32 * fill, 32)) + u2
    usable = z1 + array("Q", [24]) * fill + z2
    tab, keep = regions(*runs)
    lo, hi = bin_ranges(tc)

    def records(only):
        out = ffi.new("mu_tcache_cand[]", 8)
        among = array("Q", only or ())
        k = lib.mu_walk_tcache_scan(tab, 2, ffi.from_buffer("uint64_t[]", user),
                                    ffi.from_buffer("uint64_t[]", usable), len(user),
                                    tc.chunk_size - 8, 16, 2, tc.entries, 64, 64, 7, 0,
                                    ffi.from_buffer("uint64_t[]", lo),
                                    ffi.from_buffer("uint64_t[]", hi), 8, 0,
                                    ffi.NULL if only is None else ffi.from_buffer("uint64_t[]", among),
                                    len(among), out, 8)
        return [(o.addr, o.key, o.nonempty, o.heads) for o in out[0:k]]
    got = records(None)
    assert got == [(reals[0], key, 1, 1), (reals[1], key, 1, 1)]
    assert got == records(reals)


def test_bin_list_walk():
    r = Run()
    a = r.chunk(0x100, in_use=False)
    r.chunk(0x20)
    b = r.chunk(0x100, in_use=False)
    r.chunk(0x20)
    r.finish_top()
    arena = Run(base=0x20000000, size=0x100)
    binc = arena.base + 0x40
    arena.set_word(binc + 16, a)        # fd
    arena.set_word(binc + 24, b)        # bk
    r.set_word(a + 16, b)
    r.set_word(a + 24, binc)
    r.set_word(b + 16, binc)
    r.set_word(b + 24, a)
    tab, keep = regions(r, arena)
    nodes, nbytes, bitfree = ffi.new("uint64_t *"), ffi.new("uint64_t *"), ffi.new("uint64_t *")
    bad = ffi.new("uint64_t *")
    assert lib.mu_walk_bin(tab, 2, binc, 100, nodes, nbytes, bitfree, bad) == 0
    assert (nodes[0], nbytes[0], bitfree[0], bad[0]) == (2, 0x200, 2, 0)
    r.set_word(b + 24, binc)            # b->bk no longer a: broken at b
    assert lib.mu_walk_bin(tab, 2, binc, 100, nodes, nbytes, bitfree, bad) == 1 and bad[0] == b
    empty = arena.base + 0x80
    arena.set_word(empty + 16, empty)
    arena.set_word(empty + 24, empty)
    assert lib.mu_walk_bin(tab, 2, empty, 100, nodes, nbytes, bitfree, bad) == 0 and nodes[0] == 0


def test_bins_of_an_arena_sum_each_bin_walk():
    # mu_walk_bins over consecutive fake chunks (16 bytes apart, as an arena's bins): the sums
    # of mu_walk_bin's results, the first broken bin's bad node
    r, free = Run(), []
    for _ in range(4):                              # free chunks between in-use ones
        free.append(r.chunk(0x100, in_use=False))
        r.chunk(0x20)
    r.finish_top()
    arena = Run(base=0x20000000, size=0x200)
    bins = [arena.base + 0x40 + 16 * i for i in range(6)]
    for b in bins:                                  # empty: pointing at itself
        arena.set_word(b + 16, b)
        arena.set_word(b + 24, b)

    def link(binc, nodes):
        for k, node in enumerate(nodes):
            r.set_word(node + 16, nodes[k + 1] if k + 1 < len(nodes) else binc)
            r.set_word(node + 24, nodes[k - 1] if k else binc)
        arena.set_word(binc + 16, nodes[0])
        arena.set_word(binc + 24, nodes[-1])
    link(bins[1], free[:2])                         # two nodes
    link(bins[3], [free[2]])                        # one node, broken below
    link(bins[4], [free[3]])
    r.set_word(free[2] + 24, 0x1230)                # its bk is not the bin: broken at free[2]
    arena.set_word(bins[5] + 16, 0x7000_0000)       # an fd outside every region: broken there
    tab, keep = regions(r, arena)
    nodes, nbytes, bitfree = ffi.new("uint64_t *"), ffi.new("uint64_t *"), ffi.new("uint64_t *")
    bad = ffi.new("uint64_t *")
    want = [0, 0, 0, 0]
    for b in bins:
        rc = lib.mu_walk_bin(tab, 2, b, 100, nodes, nbytes, bitfree, bad)
        want = [want[0] + rc, want[1] + nodes[0], want[2] + bitfree[0], want[3] or bad[0]]
    out = ffi.new("uint64_t[4]")
    assert lib.mu_walk_bins(tab, 2, bins[0], 16, len(bins), 100, out) == 0
    assert list(out) == want and want[:2] == [2, 3] and want[3] == free[2]


def test_subtract():
    user = array("Q", [16, 48, 80, 112, 144])
    usable = array("Q", [1, 2, 3, 4, 5])
    drop = array("Q", [144, 48, 48, 999])
    removed, distinct = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    n = lib.mu_walk_subtract(ffi.from_buffer("uint64_t[]", user), ffi.from_buffer("uint64_t[]", usable),
                             5, ffi.from_buffer("uint64_t[]", drop), 4, removed, distinct)
    assert n == 3 and list(user[:3]) == [16, 80, 112] and list(usable[:3]) == [1, 3, 4]
    assert removed[0] == 2 and distinct[0] == 3         # 999 is no chunk: the walk's fail


@pytest.mark.parametrize("seed", range(6))
def test_subtract_removes_exactly_the_listed_entries(seed):
    # runs moved down between dropped entries: the first, the last, neighbours, repeats,
    # addresses between entries and beyond the ends, and none at all
    rng = random.Random(seed)
    n = rng.choice([0, 1, 7, 1000, 5000])
    user = array("Q", sorted(rng.sample(range(16, 16 + 64 * n + 64, 16), n)))
    usable = array("Q", [u * 3 + 1 for u in user])
    picked = rng.sample(list(user), min(n, rng.choice([0, 1, 2, 50, n])))
    if n and seed % 2:
        picked += [user[0], user[-1], user[-1]]
    drop = array("Q", picked + [8, user[-1] + 16 if n else 24] + [u + 8 for u in picked[:5]])
    rng.shuffle(drop)
    want = [u for u in user if u not in set(picked)]
    removed = ffi.new("uint64_t *")
    got = lib.mu_walk_subtract(ffi.from_buffer("uint64_t[]", user),
                               ffi.from_buffer("uint64_t[]", usable), n,
                               ffi.from_buffer("uint64_t[]", drop), len(drop), removed, ffi.NULL)
    assert got == len(want) and list(user[:got]) == want
    assert list(usable[:got]) == [u * 3 + 1 for u in want]
    assert removed[0] == len(set(picked))


def test_subtract_of_big_arrays_moves_both_on_two_threads():
    # past the size from which user[] and usable[] move on two threads (TWO_WAYS_MIN): the
    # same result as the model, the first and last entries dropped too
    n = 1_300_000
    user = array("Q", range(16, 16 + 16 * n, 16))
    usable = array("Q", range(7, 7 + n))
    rng = random.Random(5)
    picked = sorted(set(rng.sample(range(n), 3000)) | {0, 1, n // 2, n - 1})
    drop = array("Q", [16 + 16 * k for k in picked] + [8, 24 + 16 * n])
    removed = ffi.new("uint64_t *")
    got = lib.mu_walk_subtract(ffi.from_buffer("uint64_t[]", user),
                               ffi.from_buffer("uint64_t[]", usable), n,
                               ffi.from_buffer("uint64_t[]", drop), len(drop), removed, ffi.NULL)
    gone = set(picked)
    keep = [k for k in range(n) if k not in gone]
    assert got == len(keep) and removed[0] == len(picked)
    assert user[:got] == array("Q", [16 + 16 * k for k in keep])
    assert usable[:got] == array("Q", [7 + k for k in keep])


def test_a_long_run_of_chunks_is_walked_whole():
    # (its speed: bench/bench_check.py's walk figures, not a timed test)
    n = 500_000
    size = 0x40
    buf = bytearray(n * size + 0x100)
    # every header {prev 0, 0x40|P}: all chunks in use; top at the end
    hdr = struct.pack("<QQ", 0, size | P) + bytes(size - 16)
    buf[:n * size] = hdr * n
    top = BASE + n * size
    struct.pack_into("<QQ", buf, n * size, 0, 0x100 | P)
    r = Run(size=0)
    r.buf = buf
    user, usable = array("Q", bytes(8 * n)), array("Q", bytes(8 * n))
    res = ffi.new("mu_walk_result *")
    k = lib.mu_walk_run(ffi.from_buffer(buf), BASE, len(buf), BASE, top, 0,
                        ffi.from_buffer("uint64_t[]", user), ffi.from_buffer("uint64_t[]", usable), n, res)
    assert k == n and res.status == lib.MU_WALK_TOP and res.in_use == n
    assert user[0] == BASE + 16 and user[-1] == top - size + 16
    assert set(usable) == {size - 8} and all(b - a == size for a, b in zip(user[:1000], user[1:1001]))


# ---- validate.py: verdicts on free lists and hard inconsistencies (pure policy) -------------

def test_tcache_bin_verdicts():
    from memunreachable.heaps.glibc import validate as V
    v = V.Verdict()
    t = 0x5000
    assert V.judge_tcache_bin(v, t, 3, 72, 3, V.CHAIN_NULL, 3, 0, 0x7010, 0, False) == (3, False)
    assert v.soft == [] and v.uncertain == {}
    # one bin off by one: a thread inside tcache_put; its chain is free, its size uncertain
    assert V.judge_tcache_bin(v, t, 1, 40, 2, V.CHAIN_NULL, 3, 0, 0x7010, 0, False) == (3, True)
    assert v.uncertain == {40: v.soft[0]} and "count says 2" in v.soft[0]
    # garbage: the verified prefix is free, the warning names the tcache, bin, node and link
    free, _ = V.judge_tcache_bin(v, t, 3, 72, 3, V.CHAIN_BAD, 1, 2, 0x7010, 0x4141414141414141, True)
    assert free == 1
    assert v.uncertain[72] == ("tcache 0x5000 bin 3 (72-byte blocks): chain broken at 0x7010: next "
                               "pointer 0x4141414141414141 is not an in-use chunk of the heap; "
                               "unreachable 72-byte blocks may be free")
    # a second off-by-one bin in the same tcache is no longer "in transit"
    free, transit = V.judge_tcache_bin(v, t, 5, 104, 2, V.CHAIN_NULL, 1, 0, 0x8010, 0, True)
    assert (free, transit) == (1, False) and "chain broken at 0x8010" in v.uncertain[104]
    # longer than the count: only count nodes are taken as free
    assert V.judge_tcache_bin(v, t, 6, 120, 2, V.CHAIN_LONG, 3, 0, 0x9010, 0x9110, True)[0] == 2
    assert v.hard == []


def test_fastbin_verdicts():
    from memunreachable.heaps.glibc import validate as V
    v = V.Verdict()
    assert V.judge_fastbin(v, 0xa000, 4, 88, V.CHAIN_NULL, 5, 0, 0, 0) == 5 and v.soft == []
    assert V.judge_fastbin(v, 0xa000, 4, 88, V.CHAIN_CYCLE, 2, 0, 0x7010, 0x7110) == 2
    assert v.soft == [v.uncertain[88]] == [
        "arena 0xa000 fastbin 4 (88-byte blocks): chain broken at 0x7010: next pointer 0x7110 loops "
        "back into the chain; unreachable 88-byte blocks may be free"]
    V.judge_fastbin(v, 0xa000, 0, 24, V.CHAIN_BAD, 0, 1, 0, 0x123)
    assert v.uncertain[24].startswith("arena 0xa000 fastbin 0 (24-byte blocks): chain broken at its "
                                      "head: fastbinsY[0] (as a user pointer) 0x123 is not 16-byte "
                                      "aligned")
    v2 = V.Verdict()
    V.judge_tcache_bin(v2, 0x5000, 2, 56, 1, V.CHAIN_BAD, 0, 2, 0, 0x9990, False)
    assert v2.uncertain[56] == ("tcache 0x5000 bin 2 (56-byte blocks): chain broken at its head: "
                                "entries[2] 0x9990 is not an in-use chunk of the heap; unreachable "
                                "56-byte blocks may be free")


def test_heap_inconsistent_carries_first_bad_and_pickles():
    import pickle
    from memunreachable.heaps.glibc import validate as V

    def verdict():
        v = V.Verdict()
        V.check_mmapped(v, 1, 4096, 2, 8192)                       # no address
        V.check_run(v, "heap 0x7000", V.WALK_TOP + 3, 0, 0x7230, (V.WALK_TOP,))
        V.check_bins(v, 0xa000, 2, 0, 0, 0, bad_at=0x9990)
        return v

    with pytest.raises(V.HeapInconsistent) as e1:
        verdict().raise_if_hard()
    with pytest.raises(V.HeapInconsistent) as e2:
        verdict().raise_if_hard()
    assert e1.value.first_bad == 0x7230
    assert str(e1.value) == str(e2.value) == (
        "heap walk inconsistent: mmapped chunks: found 1 (4096 bytes), mp_ says 2 (8192 bytes); "
        "heap 0x7000: chunk chain broke at 0x7230 (bad chunk size); arena 0xa000: 2 bin lists are broken")
    back = pickle.loads(pickle.dumps(e1.value))
    assert type(back) is V.HeapInconsistent and back.first_bad == 0x7230 and str(back) == str(e1.value)
    v = V.Verdict()
    V.check_mmapped(v, 1, 4096, 2, 8192)
    with pytest.raises(V.HeapInconsistent) as e3:
        v.raise_if_hard()
    assert e3.value.first_bad == 0


# ---- mu_read_walk: copy through /proc/<pid>/mem and walk while the pieces arrive ------------
def _mapped_run(size, fill):
    """A Run at the real address of a fresh mapping of this process, built by fill(run)."""
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = int(ffi.cast("uintptr_t", ffi.from_buffer(m)))
    r = Run(base=addr, size=size)
    ret = fill(r)
    m[:] = r.buf
    return m, r, ret


def _random_chunks(rnd, r, end, flags=0):
    while r.cur + 0x1000 < end:
        r.chunk(rnd.randrange(2, 130) * 16, in_use=rnd.random() < 0.8, flags=flags)


def _thread_heap(rnd, r):
    """A non-main heap of random chunks ending in a pseudo chunk and {0|1}: (first, top)."""
    _random_chunks(rnd, r, r.base + len(r.buf) - 0x2000, flags=N)
    pseudo = r.cur
    r.finish_top(0x20)
    r.hdr(pseudo + 0x20, 0 | P)
    return r.base, 0


def _broken(rnd, r, past):
    """Random chunks to the top, the first chunk `past` bytes in given a bad size."""
    _random_chunks(rnd, r, r.base + len(r.buf) - 0x2000)
    top = r.finish_top()
    c = next(a for a, s, u in r.chunks if a > r.base + past)
    r.hdr(c, 0x38 | P)
    return r.base, top


def _fields(res):
    return (res.chunks, res.in_use, res.in_use_bytes, res.free_chunks, res.free_bytes, res.end,
            res.bad_at, res.status)


@pytest.mark.parametrize("seed", range(2))
def test_read_walk_equals_read_then_walk(seed):
    rnd = random.Random(seed)

    def main_run(r):                     # 6 MiB run to top: chunks straddle the 1 MiB pieces
        _random_chunks(rnd, r, r.base + len(r.buf) - 0x2000)
        return r.base, r.finish_top()

    def many(r):                         # more in-use chunks than cap
        _random_chunks(rnd, r, r.base + len(r.buf) - 0x2000)
        return r.base, r.finish_top()

    specs = [(6 << 20, main_run, 0, None), (3 << 20, lambda r: _thread_heap(rnd, r), 1, None),
             (2 << 20, lambda r: _broken(rnd, r, (1 << 20) + 4096), 0, None),   # the second MiB
             (1 << 20, many, 0, 100),
             (1 << 20, lambda r: (0, 0), 0, None)]          # copy only
    keep, jobs = [], ffi.new("mu_read_job[]", len(specs))
    expect = []
    for k, (size, fill, non_main, cap) in enumerate(specs):
        src, run, (first, top) = _mapped_run(size, fill)
        dst = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        cap = cap or 1 + size // 32
        user, usable = array("Q", bytes(8 * cap)), array("Q", bytes(8 * cap))
        pu, pv, pd = (ffi.from_buffer("uint64_t[]", user), ffi.from_buffer("uint64_t[]", usable),
                      ffi.from_buffer(dst))
        keep += [src, dst, user, usable, pu, pv, pd]
        jobs[k].addr, jobs[k].len, jobs[k].buf = run.base, size, ffi.cast("uint8_t *", pd)
        jobs[k].first, jobs[k].top, jobs[k].non_main = first, top, non_main
        jobs[k].user, jobs[k].usable, jobs[k].cap = pu, pv, cap
        if first:
            got, res = walk(run, first, top, non_main, cap)
            expect.append((got, _fields(res), min(res.in_use, cap)))
        else:
            expect.append(([], None, 0))
    fd = os.open("/proc/self/mem", os.O_RDONLY)
    try:
        assert lib.mu_read_walk(fd, jobs, len(specs)) == 0
    finally:
        os.close(fd)
    for k, (size, fill, non_main, cap) in enumerate(specs):
        src, dst, user, usable = keep[7 * k:7 * k + 4]
        assert jobs[k].bad == 0 and jobs[k].first_bad == 0
        assert dst[:] == src[:]
        got, fields, stored = expect[k]
        assert jobs[k].stored == stored
        assert list(zip(user[:stored], usable[:stored])) == got
        if fields is not None:
            assert _fields(jobs[k].res) == fields
    statuses = [expect[k][1][-1] for k in range(4)]
    assert statuses == [lib.MU_WALK_TOP, lib.MU_WALK_FENCE0, lib.MU_WALK_BAD_SIZE, lib.MU_WALK_TOP]
    assert expect[3][1][1] > 100                      # in_use counted past the cap


def test_read_walk_counts_unreadable_pages():
    m = mmap.mmap(-1, 3 * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m[:] = b"\x11" * len(m)
    addr = int(ffi.cast("uintptr_t", ffi.from_buffer(m)))
    dst = bytearray(b"\xff" * len(m))
    pd = ffi.from_buffer(dst)
    jobs = ffi.new("mu_read_job[]", 1)
    jobs[0].addr, jobs[0].len, jobs[0].buf = addr, len(m), ffi.cast("uint8_t *", pd)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    assert libc.munmap(addr + 4096, 4096) == 0       # a hole in the middle
    fd = os.open("/proc/self/mem", os.O_RDONLY)
    try:
        assert lib.mu_read_walk(fd, jobs, 1) == 0
    finally:
        os.close(fd)
    assert jobs[0].bad == 4096 and jobs[0].first_bad == addr + 4096
    assert dst == b"\x11" * 4096 + bytes(4096) + b"\x11" * 4096


# ---- the low-memory walk: uncopied regions, dropped copies, kept candidates ----------------
def uncopied_regions(fd, *runs):
    """regions() whose bytes are read through fd (a memfd holding each run at its address)."""
    tab = ffi.new("mu_region[]", len(runs))
    for i, r in enumerate(sorted(runs, key=lambda r: r.base)):
        os.pwrite(fd, bytes(r.buf), r.base)
        tab[i].base, tab[i].len, tab[i].uncopied, tab[i].fd = r.base, len(r.buf), 1, fd
    return tab


def test_list_walks_read_uncopied_regions_as_copies():
    from memunreachable.heaps.glibc.layout import TCACHE_U16 as tc
    r = Run(size=1 << 16)
    nodes = [r.chunk(0x50) for _ in range(6)]
    n0 = r.chunk(0x20)
    key = 0x1234567890ABCDEF
    real = tcache_struct(r, [1] + [0] * 63, [n0 + 16] + [0] * 63, tc)
    r.set_word(n0 + 16 + 8, key)
    a = r.chunk(0x100, in_use=False)
    r.chunk(0x20)
    r.finish_top()
    u = [c + 16 for c in nodes]
    for x, y in [(0, 1), (1, 2), (2, 3), (3, 4), (4, 2)]:        # a cycle
        r.set_word(u[x], (u[x] >> 12) ^ u[y])
    arena = Run(base=0x20000000, size=0x100)
    binc = arena.base + 0x40
    for at, v in [(binc + 16, a), (binc + 24, a)]:
        arena.set_word(at, v)
    r.set_word(a + 16, binc)
    r.set_word(a + 24, binc)
    copied, keep = regions(r, arena)
    fd = os.memfd_create("heap")
    try:
        lazy = uncopied_regions(fd, r, arena)
        for tab in (copied, lazy):
            st, got, res = chain(tab, 2, r, u[0], 0, 1, 0x50, 1000)
            assert (st, got, res.last, res.bad) == (lib.MU_CHAIN_CYCLE, u[:5], u[4], u[2])
            assert scan(tab, 2, r, tc) == [(real, key, 1, 1, 0, 0, 0)]
            nodes_, nbytes, bitfree, bad = (ffi.new("uint64_t *") for _ in range(4))
            assert lib.mu_walk_bin(tab, 2, binc, 100, nodes_, nbytes, bitfree, bad) == 0
            assert (nodes_[0], nbytes[0], bitfree[0]) == (1, 0x100, 1)
        os.ftruncate(fd, r.base + 0x40)         # unreadable now: a refused link, never zeros
        st, got, res = chain(lazy, 2, r, u[0], 0, 1, 0x50, 1000)
        assert (st, res.reason) == (lib.MU_CHAIN_BAD, lib.MU_LINK_UNREADABLE)
    finally:
        os.close(fd)


def resident_kib(p, size) -> int:
    """Rss of this process's mappings inside [p, p+size) (/proc/self/smaps), without
    touching them."""
    lo = int(ffi.cast("uintptr_t", p))
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                b, e = (int(x, 16) for x in head.split("-"))
                inside = lo <= b and e <= lo + size
            elif inside and head == "Rss:":
                total += int(line.split()[1])
    return total


def test_read_walk_drop_releases_the_copy_and_keeps_the_candidates():
    rnd = random.Random(7)

    def main_run(r):
        _random_chunks(rnd, r, r.base + len(r.buf) - 0x2000)
        for a, s, used in r.chunks[::3]:                     # pointers into the run
            r.set_word(a + 16, r.base + rnd.randrange(len(r.buf)))
        return r.base, r.finish_top()

    size = 3 << 20
    src, run, (first, top) = _mapped_run(size, main_run)
    expect_got, expect_res = walk(run, first, top, 0, size // 32)
    lo, hi = run.base, run.base + size
    in_range = sum(1 for o in range(0, size, 8)
                   if lo <= struct.unpack_from("<Q", src, o)[0] < hi)
    dst = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    cap = size // 32
    user, usable = array("Q", bytes(8 * cap)), array("Q", bytes(8 * cap))
    out = ffi.new("mu_cands **")
    assert lib.mu_cands_new(run.base, size, ffi.new("uint64_t[]", [lo, hi]), 1, size, out) == 0
    cands = ffi.gc(out[0], lib.mu_cands_free)
    jobs = ffi.new("mu_read_job[]", 1)
    pd = ffi.from_buffer(dst)
    jobs[0].addr, jobs[0].len, jobs[0].buf = run.base, size, ffi.cast("uint8_t *", pd)
    jobs[0].first, jobs[0].top, jobs[0].drop, jobs[0].cands = first, top, 1, cands
    jobs[0].user, jobs[0].usable, jobs[0].cap = (ffi.from_buffer("uint64_t[]", user),
                                                 ffi.from_buffer("uint64_t[]", usable), cap)
    fd = os.open("/proc/self/mem", os.O_RDONLY)
    try:
        assert lib.mu_read_walk(fd, jobs, 1) == 0
    finally:
        os.close(fd)
    assert jobs[0].bad == 0
    assert list(zip(user[:jobs[0].stored], usable[:jobs[0].stored])) == expect_got
    assert _fields(jobs[0].res) == _fields(expect_res)
    assert resident_kib(pd, size) == 0          # released: nothing of the copy is kept
    assert dst[:] == bytes(size)                # and no hole (pages moved out stay mapped)
    pieces = ffi.new("uint64_t *")
    assert lib.mu_cands_words(cands, pieces) == in_range and pieces[0] == 3
    del pd


def _in_range_words(src, lo, hi) -> int:
    words = array("Q", bytes(src))
    return sum(1 for w in words if lo <= w < hi)


def test_read_walk_drop_walks_heaps_larger_than_its_ring_as_a_copy_would():
    """A dropped job's pieces pass through a ring of a few 1 MiB slots (mu_walk.c RW_RING):
    heaps many times its size, a chunk whose end lies past what the ring can hold (its next
    size is read apart), a top chunk and a pair of fenceposts past the ring too, a fencepost
    pair whose second header begins the next piece, a thread heap's end, a broken chain and
    a job with no walk, in one call: each walk and each job's candidates as from a copy."""
    ring = 8 << 20
    mib = 1 << 20
    rnd = random.Random(11)

    def plain(r):                           # 2.5 rings of chunks straddling the pieces
        _random_chunks(rnd, r, r.base + len(r.buf) - 0x2000)
        return r.base, r.finish_top()

    def huge_chunk(r):                      # 11 MiB in use, then a 3 MiB free one
        _random_chunks(rnd, r, r.base + mib)
        r.chunk(11 * mib + 0x30)
        _random_chunks(rnd, r, r.cur + mib)
        r.chunk(3 * mib + 0x50, in_use=False)
        _random_chunks(rnd, r, r.base + len(r.buf) - 0x2000)
        return r.base, r.finish_top()

    def huge_top(r):                        # the top chunk spans most of the job
        _random_chunks(rnd, r, r.base + 2 * mib)
        return r.base, r.finish_top(r.base + len(r.buf) - r.cur)

    def fence_on_a_piece_end(r):            # foreign sbrk: the pair's second header begins
        _random_chunks(rnd, r, r.base + 3 * mib - 0x1000)       # the fourth piece
        r.chunk(r.base + 3 * mib - 16 - 0x20 - r.cur)
        r.finish_top(0x20)
        fence = r.cur + 0x20
        r.hdr(fence, 0x10 | P)
        r.hdr(fence + 16, 0x10 | P)
        r.hdr(fence + 32, 0x10 | P)         # an old top smaller than MINSIZE: a third
        return r.base, 0

    def fence_past_the_ring(r):             # the same after 9 MiB of chunks
        _random_chunks(rnd, r, r.base + 9 * mib)
        r.finish_top(0x40)
        r.hdr(r.cur + 0x40, 0x10 | P)
        r.hdr(r.cur + 0x50, 0x10 | P)
        return r.base, 0

    copied = 3 * mib                        # a job that keeps its copy, between them
    specs = [(20 * mib, plain, 0), (18 * mib, huge_chunk, 0), (12 * mib, huge_top, 0),
             (5 * mib, lambda r: (0, 0), 0),                             # no walk: candidates
             (copied, plain, 0),
             (6 * mib, fence_on_a_piece_end, 0), (12 * mib, fence_past_the_ring, 0),
             (9 * mib, lambda r: _thread_heap(rnd, r), 1),
             (10 * mib, lambda r: _broken(rnd, r, 5 * mib + 4096), 0)]          # the sixth MiB
    assert sum(size for size, _, _ in specs) > 10 * ring
    keep, jobs = [], ffi.new("mu_read_job[]", len(specs))
    expect = []
    for k, (size, fill, non_main) in enumerate(specs):
        def fill_words(r, fill=fill):       # pointers into the job between the chunks' words
            ret = fill(r)
            for a, s, used in r.chunks[::5]:
                r.set_word(a + 16, r.base + rnd.randrange(len(r.buf)))
            return ret
        src, run, (first, top) = _mapped_run(size, fill_words)
        cap = 1 + size // 32
        user, usable = array("Q", bytes(8 * cap)), array("Q", bytes(8 * cap))
        out = ffi.new("mu_cands **")
        assert lib.mu_cands_new(run.base, size, ffi.new("uint64_t[]", [run.base, run.base + size]),
                                1, size, out) == 0
        cands = ffi.gc(out[0], lib.mu_cands_free)
        pu, pv = ffi.from_buffer("uint64_t[]", user), ffi.from_buffer("uint64_t[]", usable)
        keep += [src, user, usable, pu, pv, cands]
        dst = bytearray(size) if k == 4 else None
        jobs[k].addr, jobs[k].len = run.base, size
        jobs[k].buf = ffi.from_buffer("uint8_t[]", dst) if dst is not None else ffi.NULL
        jobs[k].first, jobs[k].top, jobs[k].non_main = first, top, non_main
        jobs[k].user, jobs[k].usable, jobs[k].cap = pu, pv, cap
        jobs[k].drop, jobs[k].cands = (0 if dst is not None else lib.MU_READ_DROP), cands
        keep.append(dst)
        ref = walk(run, first, top, non_main, cap) if first else ([], None)
        expect.append((ref, _in_range_words(src, run.base, run.base + size), size // mib))
    fd = os.open("/proc/self/mem", os.O_RDONLY)
    rc = []
    try:        # on a thread: a walk waiting for a piece the ring cannot hold fails, not hangs
        t = threading.Thread(target=lambda: rc.append(lib.mu_read_walk(fd, jobs, len(specs))),
                             daemon=True)
        t.start()
        t.join(120)
        assert rc == [0], "mu_read_walk did not return"
    finally:
        if rc:
            os.close(fd)
    statuses = []
    for k, (size, fill, non_main) in enumerate(specs):
        (got, res), in_range, pieces = expect[k]
        src, user, usable, _, _, cands, dst = keep[7 * k:7 * k + 7]
        assert dst is None or dst == src[:]
        assert jobs[k].bad == 0 and jobs[k].first_bad == 0
        if res is not None:
            assert jobs[k].stored == len(got)
            assert list(zip(user[:len(got)], usable[:len(got)])) == got
            assert _fields(jobs[k].res) == _fields(res)
            statuses.append(res.status)
        kept = ffi.new("uint64_t *")
        assert (lib.mu_cands_words(cands, kept), kept[0]) == (in_range, pieces)
    assert statuses == [lib.MU_WALK_TOP, lib.MU_WALK_TOP, lib.MU_WALK_TOP, lib.MU_WALK_TOP,
                        lib.MU_WALK_FENCE2, lib.MU_WALK_FENCE2, lib.MU_WALK_FENCE0,
                        lib.MU_WALK_BAD_SIZE]
    assert jobs[5].res.end == jobs[5].addr + 3 * mib + 32          # three headers from 3 MiB - 16


def test_chunk_lookalikes_are_told_apart_by_mp_s_counters_only_when_unambiguous():
    from memunreachable.heaps.glibc import validate as V
    real = {0x1010: 1925120, 0x2010: 294912, 0x3010: 135168, 0x4010: 266240}
    total = sum(real.values())
    # a page of a pymalloc arena that began 0, 0x2002: one 8 KiB chunk too many
    assert V.lookalikes({**real, **{0x9010: 8192}}, 4, total) == {0x9010}
    # two too many, one set of two sums to the surplus
    two = {**real, **{0xa010: 8192, 0xb010: 12288}}
    assert V.lookalikes(two, 4, total) == {0xa010, 0xb010}
    # ambiguous: a real chunk of the look-alike's size, or two sets of the surplus
    assert V.lookalikes({**real, **{0xc010: 135168}}, 4, total) == set()
    assert V.lookalikes({**real, **{0xa010: 4096, 0xb010: 12288, 0xc010: 8192, 0xd010: 8192}}, 6,
                        total + 4096 + 12288) == set()
    # nothing to reconcile: as many as mp_ counts, fewer, too many, or counters unknown
    assert V.lookalikes(real, 4, total) == set()
    assert V.lookalikes(real, 5, total + 4096) == set()
    assert V.lookalikes({**real, **{0xa010: 4096, 0xb010: 4096, 0xc010: 4096}}, 4, total) == set()
    assert V.lookalikes({**real, **{0xa010: 4096}}, -1, -1) == set()
    assert V.lookalikes({**real, **{0xa010: 4096}}, 4, total + 4096) == set()     # no surplus bytes


def test_glibc_243_mp_counts_16_bytes_more_per_mremap_for_good():
    # glibc 2.43 mremap_chunk: mmapped_mem += new_size - size - offset, the mapping's change
    # + CHUNK_HDR_SZ since mmap_size() = offset + size + 16; munmap_chunk subtracts mmap_size
    from memunreachable.heaps.glibc import layout as L
    from memunreachable.heaps.glibc import validate as V
    over = L.MMAP_CHUNK_243.mremap_overcount
    assert over == 16 and L.MMAP_CHUNK_227.mremap_overcount == 0
    real = {0x1010: 3149824, 0x2010: 3149824}
    total = sum(real.values())
    for drift in (0, 32, 16 * 1000):          # two mremaps (fixtures/realloc.c), a thousand
        v = V.Verdict()
        assert V.check_mmapped(v, 2, total, 2, total + drift, over) == drift and not v.hard
    for found, mp_bytes in ((2, total + 8), (2, total - 16), (1, total + 16)):
        v = V.Verdict()
        V.check_mmapped(v, found, total, 2, mp_bytes, over)
        assert v.hard
    v = V.Verdict()
    V.check_mmapped(v, 2, total, 2, total + 32)            # <= 2.42: exact
    assert v.hard
    # a look-alike page with a drift below a page: the drift is the surplus' rest
    assert V.lookalikes({**real, 0x9010: 8192}, 2, total + 48, over) == {0x9010}
    assert V.lookalikes({**real, 0x9010: 8192, 0xa010: 4096}, 2, total + 48, over) == {0x9010, 0xa010}
    assert V.lookalikes({**real, 0x9010: 8192}, 2, total + 48) == set()      # exact counters
    assert V.lookalikes({**real, 0x9010: 8192}, 2, total + 40, over) == set()   # not 16s
    assert V.lookalikes({**real, 0x9010: 8192, 0xa010: 8192}, 3, total + 8192 + 48, over) == set()


# ---- glibc 2.42+ / 2.43 (issue 22) --------------------------------------------------------
def test_mmapped_scan_243_layout_keeps_a_header_after_the_chunk():
    # 2.43: size = mapping - offset - 16, usable = size - 8; prev_size bit 0 = MMAP_HP
    from memunreachable.heaps.glibc.layout import MMAP_CHUNK_243 as f
    buf = bytearray(0x40000)
    base = 0x7f0000000000
    struct.pack_into("<QQ", buf, 0, 0, (0x5000 - 16) | M)                  # plain chunk
    struct.pack_into("<QQ", buf, 0x5000, 0, (0x10000 - 16) | M)            # stale memalign header
    struct.pack_into("<QQ", buf, 0x5000 + 0x3ff0, 0x3ff0, (0x10000 - 0x3ff0 - 16) | M)
    struct.pack_into("<QQ", buf, 0x15000, 1, (0x2000 - 16) | M)            # a hugetlb one (MMAP_HP)
    struct.pack_into("<QQ", buf, 0x20000, 0, 0x1000 | M)                    # the 2.42 format: not one
    user, usable = array("Q", bytes(80)), array("Q", bytes(80))
    res = ffi.new("mu_mmap_result *")

    def scan(tail, delta, mask):
        n = lib.mu_walk_mmapped(ffi.from_buffer(buf), base, len(buf), len(buf), 4096, tail, delta,
                                mask, ffi.from_buffer("uint64_t[]", user),
                                ffi.from_buffer("uint64_t[]", usable), 10, res)
        return list(zip(user[:n], usable[:n]))

    assert scan(f.tail, f.usable_delta, f.prev_flags) == [
        (base + 16, 0x5000 - 16 - 8), (base + 0x5000 + 0x3ff0 + 16, 0x10000 - 0x3ff0 - 16 - 8),
        (base + 0x15000 + 16, 0x2000 - 16 - 8)]
    assert (res.found, res.bytes, res.moved) == (3, 0x17000, 1)
    # read as the old format, the 2.43 chunks are no chunks (their mappings are not page sized)
    assert scan(0, 16, 0) == [(base + 0x20000 + 16, 0x1000 - 16)]
    assert lib.mu_walk_mmapped(ffi.from_buffer(buf), base, len(buf), len(buf), 4096, 16, 8, 0x10,
                               ffi.NULL, ffi.NULL, 0, res) == -22


def test_range_chain_of_a_large_tcache_bin_is_sorted():
    # 2.42+ large bin 64 holds chunk sizes 0x420-0x7f0, its chain sorted by ascending size
    r = Run()
    sizes = [0x420, 0x600, 0x600, 0x7f0]
    nodes = [r.chunk(s) for s in sizes]
    other = r.chunk(0x800)
    r.finish_top()
    u = [c + 16 for c in nodes]
    tab, keep = regions(r)

    def link(order):
        for a, b in zip(order, order[1:] + [0]):
            r.set_word(a, (a >> 12) ^ b)

    link(u)
    st, got, res = chain(tab, 1, r, u[0], 0, 1, 0x420, 17, size_max=0x7f0)
    assert (st, got) == (lib.MU_CHAIN_NULL, u)
    # out of order: the 0x420 node after the 0x7f0 one is refused (glibc would never link it)
    link([u[1], u[3], u[0]])
    st, got, res = chain(tab, 1, r, u[1], 0, 1, 0x420, 17, size_max=0x7f0)
    assert (st, res.reason, got, res.last, res.bad) == (lib.MU_CHAIN_BAD, lib.MU_LINK_ORDER,
                                                        [u[1], u[3]], u[3], u[0])
    # a chunk above the bin's range
    link([u[0], other + 16])
    st, got, res = chain(tab, 1, r, u[0], 0, 1, 0x420, 17, size_max=0x7f0)
    assert (st, res.reason, got) == (lib.MU_CHAIN_BAD, lib.MU_LINK_WRONG_SIZE, [u[0]])
    # one size (the small bins) as before: equal sizes are no order violation
    link([u[1], u[2]])
    assert chain(tab, 1, r, u[1], 0, 1, 0x600, 17)[:2] == (lib.MU_CHAIN_NULL, [u[1], u[2]])


def tcache76_struct(r, tc, counts, heads, max_count=16):
    """A 2.42+ tcache_perthread_struct: num_slots = max_count - count per bin."""
    c = r.chunk(tc.chunk_size)
    u = c + 16
    for i in range(tc.nbins):
        n = counts.get(i, 0)
        struct.pack_into("<H", r.buf, u - r.base + 2 * i, max_count - n if n >= 0 else -n)
    for i, h in heads.items():
        r.set_word(u + tc.entries + 8 * i, h)
    return u


def test_tcache_scan_reads_num_slots_as_room_left_and_large_bin_ranges():
    from memunreachable.heaps.glibc.layout import TCACHE_76 as tc
    r = Run(size=1 << 16)
    small, large = r.chunk(0x20), r.chunk(0x600)
    key = 0x1234567890ABCDEF
    r.set_word(small + 24, key)
    r.set_word(large + 24, key)
    real = tcache76_struct(r, tc, {0: 1, 64: 1}, {0: small + 16, 64: large + 16})
    # num_slots above tcache_count (16): no 2.42 tcache
    garbage = tcache76_struct(r, tc, {0: -17}, {0: small + 16})
    # the large head in a bin whose range it is not in (bin 65: 0x800-0xff0)
    wrong = tcache76_struct(r, tc, {65: 1}, {65: large + 16})
    fresh = tcache76_struct(r, tc, {}, {})          # all num_slots 16: empty
    r.finish_top()
    tab, keep = regions(r)
    assert scan(tab, 1, r, tc, active=76, max_count=16) == [(real, key, 2, 2, 0, 0, 0)]
    # large bins beyond tcache_max_bytes (defaults: only the 64 small bins) must be empty
    assert scan(tab, 1, r, tc, active=64, max_count=16) == []
    assert {garbage, wrong, fresh}.isdisjoint(a for a, *_ in scan(tab, 1, r, tc, 76, 16))
    # read with the old meaning (counts), every bin of the fresh struct would hold 16 chunks
    assert tc.entry_count(16, 16) == 0 and tc.entry_count(13, 16) == 3
    assert tc.entry_count(17, 16) is None


def test_tcache_scan_accepts_a_struct_16_bytes_larger():
    # malloc hands out a whole bin chunk when the rest would be below MINSIZE: a static 2.43
    # program's tcache (allocated at its first free) sat in a 0x310 chunk
    from memunreachable.heaps.glibc.layout import TCACHE_76 as tc
    r = Run(size=1 << 16)
    node = r.chunk(0x20)
    structs = []
    for extra in (0x10, 0x20):
        c = r.chunk(tc.chunk_size + extra)
        u = c + 16
        for i in range(tc.nbins):
            struct.pack_into("<H", r.buf, u - r.base + 2 * i, 15 if i == 0 else 16)
        r.set_word(u + tc.entries, node + 16)
        structs.append(u)
    r.finish_top()
    tab, keep = regions(r)
    assert [g[0] for g in scan(tab, 1, r, tc, active=64, max_count=16)] == structs[:1]


# --- assemble: run_jobs' pieces compacted in their scratch ----------------------------------
def _scratch_with(caps, outputs):
    """A walker._Scratch for jobs of the given caps (bases ascending), job k's chunks
    outputs[k] (user addresses; usable = address // 16) written at its offset, and its Pieces."""
    from memunreachable.heaps.glibc.copies import Piece
    from memunreachable.heaps.glibc.walker import _Scratch

    class Job:
        def __init__(self, base, cap):
            self.cp, self.cap = type("Cp", (), {"base": base})(), cap
    jobs = [Job(0x1000_0000 * (k + 1), c) for k, c in enumerate(caps)]
    sc = _Scratch(jobs)
    pieces = []
    for k, out in enumerate(outputs):
        at = sc.at[k]
        for i, u in enumerate(out):
            sc.user_q[at + i], sc.usable_q[at + i] = u, u // 16
        pieces.append(Piece(jobs[k].cp.base, sc.user_q[at:at + len(out)],
                            sc.usable_q[at:at + len(out)], at))
    return sc, pieces


def _arr(addrs):
    from memunreachable.heaps.glibc.copies import Piece
    return Piece(addrs[0], array("Q", addrs), array("Q", [a // 16 for a in addrs]))


def test_assemble_compacts_the_scratch_in_place_with_other_pieces_between():
    """run_jobs' pieces move down to the scratch's start, arrays (mmapped chunks, runs walked
    again) are written in the room before the next piece: the result is every chunk in
    address order, as views of the scratch, and its tail pages are released."""
    from memunreachable.heaps.glibc.walker import _Walker
    rng = random.Random(3)
    outs = [sorted(0x1000_0000 * (k + 1) + 16 * rng.randrange(1, 1 << 20) for _ in range(n))
            for k, n in enumerate([3000, 0, 700, 5000])]
    outs = [sorted(set(o)) for o in outs]
    sc, pieces = _scratch_with([6000, 100, 2000, 9000], outs)
    w = _Walker(None, [], 0)
    extra = [_arr([0x0800_0000 + 16 * i for i in range(50)]),          # below every job
             _arr([0x1800_0000 + 16 * i for i in range(900)]),         # between jobs 0 and 1
             _arr([0x5000_0000 + 16 * i for i in range(10)])]          # after the last
    want = sorted([a for o in outs for a in o] + [a for p in extra for a in p.user])
    w.pieces, w.scratch = pieces + extra, sc
    user, usable = w.assemble()
    assert isinstance(user, memoryview) and list(user) == want
    assert list(usable) == [a // 16 for a in want]
    assert w.v.hard == [] and w.scratch is None and w.pieces == []


def test_assemble_compacts_big_pieces_on_two_threads():
    """Past a million entries compact() moves user and usable on two threads: the same
    result, the usable values still beside their addresses."""
    from memunreachable._ffi import TWO_THREADS_MIN
    from memunreachable.heaps.glibc.walker import _Walker
    sizes = [600_000, 0, 500_000]
    outs = [[0x1000_0000 * (k + 1) + 16 * i for i in range(n)] for k, n in enumerate(sizes)]
    sc, pieces = _scratch_with([700_000, 100, 650_000], outs)
    w = _Walker(None, [], 0)
    extra = [_arr([0x1800_0000 + 16 * i for i in range(900)])]
    want = sorted([a for o in outs for a in o] + list(extra[0].user))
    assert len(want) >= TWO_THREADS_MIN
    w.pieces, w.scratch = pieces + extra, sc
    user, usable = w.assemble()
    assert isinstance(user, memoryview) and user.tolist() == want
    assert usable.tolist() == [a // 16 for a in want]


def test_assemble_copies_when_an_array_does_not_fit_before_the_next_piece():
    from memunreachable.heaps.glibc.walker import _Walker
    outs = [[0x1000_0000 + 16 * i for i in range(100)], [0x2000_0000 + 16 * i for i in range(100)]]
    sc, pieces = _scratch_with([100, 100], outs)
    w = _Walker(None, [], 0)
    # more than the front room and job 0's: no room before job 1's piece
    big = _arr([0x1800_0000 + 16 * i for i in range(sc.at[1])])
    want = sorted(outs[0] + outs[1] + list(big.user))
    w.pieces, w.scratch = pieces + [big], sc
    user, usable = w.assemble()
    assert isinstance(user, array) and list(user) == want and list(usable) == [a // 16 for a in want]


def test_assemble_leaves_out_a_piece_that_overlaps_the_one_before():
    from memunreachable.heaps.glibc.walker import _Walker
    outs = [[0x1000_0000 + 16 * i for i in range(100)], [0x2000_0000 + 16 * i for i in range(10)]]
    sc, pieces = _scratch_with([200, 200], outs)
    w = _Walker(None, [], 0)
    w.pieces, w.scratch = pieces + [_arr([0x1000_0000 + 16 * 50, 0x1000_0000 + 16 * 51])], sc
    user, _ = w.assemble()
    assert list(user) == outs[0] + outs[1]
    assert any("overlapping chunk runs" in m for m in w.v.hard)


def _pattern(n, seed):
    return random.Random(seed).randbytes(n)


@pytest.mark.parametrize("dst,src,n", [
    (5 * 8, 64 << 12, 3 << 12),             # one mremap step, then the rest of the shift
    (1000 * 8, 20 << 12, 200 << 12),        # many steps (the data is longer than the shift)
    (0, 32 << 12, (40 << 12) + 8),          # a page multiple: no memmove after the pages
])
def test_move_down_moves_whole_pages_and_leaves_the_bytes_below(dst, src, n):
    """mu_move_down (the scratch's compaction): the n bytes land at dst and every byte below
    dst is kept; the pages went down whole (their old place reads as zeros), not copied."""
    import mmap
    from memunreachable._ffi import ffi, lib
    size = src + n + (1 << 16)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    low, data = _pattern(dst, 1), _pattern(n, 2)
    buf[:dst], buf[src:src + n] = low, data
    p = ffi.cast("uint8_t *", ffi.from_buffer(buf))
    assert lib.mu_move_down(p, dst, src, n, 1) == 0
    assert buf[:dst] == low and buf[dst:dst + n] == data
    top = max(dst + n, src + n - ((src - dst) & ~4095))     # past the moved pages' result
    assert buf[max(top, src):src + n] == bytes(src + n - max(top, src))
    del p
    buf.close()


@pytest.mark.parametrize("dst,src,pages", [
    (8, 64 << 12, 0),           # not a mapping of ours: memmove
    (8, (64 << 12) + 8, 1),     # src not page aligned
    (8, 8 << 12, 1),            # a shift under MU_MOVE_MIN_PAGES pages
])
def test_move_down_copies_when_pages_cannot_move(dst, src, pages):
    import mmap
    from memunreachable._ffi import ffi, lib
    n = 300 << 12               # with MU_MOVE_MIN_PAGES' shift: more steps than allowed too
    buf = mmap.mmap(-1, src + n + 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    data = _pattern(n, 3)
    buf[src:src + n] = data
    p = ffi.cast("uint8_t *", ffi.from_buffer(buf))
    assert lib.mu_move_down(p, dst, src, n, pages) == 0
    assert buf[dst:dst + n] == data
    tail = buf[max(dst + n, src):src + n]
    assert tail == data[len(data) - len(tail):]       # a copy leaves its source as it was
    assert lib.mu_move_down(p, src, dst, n, pages) == -errno.EINVAL
    del p
    buf.close()


def test_assemble_moves_big_pieces_down_by_pages():
    """Jobs with rooms of hundreds of pages, partly used: the compaction moves their pages (as
    a 1 GiB heap's would) and the result is every chunk in address order."""
    from memunreachable.heaps.glibc.walker import _Walker
    rng = random.Random(5)
    caps, used = [300_000, 90_000, 500_000, 200_000], [120_000, 0, 410_000, 7]
    outs = [sorted({0x1000_0000 * (k + 1) + 16 * rng.randrange(1, 1 << 24) for _ in range(n)})
            for k, n in enumerate(used)]
    sc, pieces = _scratch_with(caps, outs)
    assert all(a % 512 == 0 for a in sc.at)             # page-aligned rooms
    w = _Walker(None, [], 0)
    w.pieces, w.scratch = pieces, sc
    user, usable = w.assemble()
    want = sorted(a for o in outs for a in o)
    assert isinstance(user, memoryview) and list(user) == want
    assert list(usable) == [a // 16 for a in want]


# --- join_spanned: a chunk over untouched pages gets one copy of its extent -----------------
class _Joiner:
    """The part of walker._Walker that mmapped.MmappedMixin.join_spanned uses."""

    def __init__(self):
        self.copies = []

    def copy(self, base, size, read=True, private=False, within=None):
        from memunreachable.heaps.glibc.copies import Copy
        c = Copy(None, base, size, False, private, within)
        self.copies.append(c)
        return c

    from memunreachable.heaps.glibc.mmapped import MmappedMixin
    join_spanned = MmappedMixin.join_spanned


@pytest.mark.parametrize("shared", [True, False])
def test_a_chunk_over_untouched_pages_becomes_one_copy_of_its_runs_and_zeros(shared):
    # a range of 8 pages read as two runs (pages 0-1 and 5-6, the rest untouched), a chunk
    # from page 1 to the range's end: one copy of pages 0-7 replaces both runs' copies. With
    # the runs' copies views of one Backing (read_anonymous) it is a view of it too (nothing
    # copied); without, their bytes copied into zeros: the same bytes either way
    from memunreachable._types import Range
    from memunreachable.heaps.glibc.copies import Backing
    pg, base = 4096, 0x7F00_0000_0000
    within = Backing(base, 8 * pg) if shared else None
    w = _Joiner()
    runs = [w.copy(base, 2 * pg, within=within), w.copy(base + 5 * pg, 2 * pg, within=within)]
    for c, fill in zip(runs, (b"\xaa", b"\xbb")):
        c.buf[:] = fill * c.size
    w.join_spanned(runs, [(runs[0], Range(base + pg + 16, base + 8 * pg))])
    joined, = w.copies
    assert (joined.base, joined.size) == (base, 8 * pg)
    assert bytes(joined.buf) == b"\xaa" * 2 * pg + bytes(3 * pg) + b"\xbb" * 2 * pg + bytes(pg)
    assert (joined.within is within) and all(c.ptr is None for c in runs)
    if shared:          # a view of the same pages: a write shows through the Backing
        joined.buf[0] = 1
        assert within.mapping[0] == 1


def test_a_backing_gives_views_inside_it_only():
    from memunreachable.heaps.glibc.copies import Backing
    b = Backing(0x1000, 0x3000)
    assert len(b.view(0x2000, 0x2000)) == 0x2000
    for base, size in ((0x0, 0x1000), (0x3000, 0x2000)):
        with pytest.raises(ValueError):
            b.view(base, size)


# ---- the walk's records of the free-list words (mu_read_job.rec) ---------------------------
def _expected_records(run, lo, hi, mangled, max_size):
    """The records mu_read_walk keeps over run (its chunks up to the top), by the rule in
    mu_walk.h: free chunks, and in-use ones of at most max_size whose first word is a link."""
    out = []
    for a, s, used in run.chunks:
        sz, w16, w24 = struct.unpack_from("<QQQ", run.buf, a - run.base + 8)
        if used:
            d = w16 ^ ((a + 16) >> 12) if mangled else w16
            if s > max_size or (d and (d & 15 or not lo <= d < hi)):
                continue
        out.append((a | (not used), sz, w16, w24))
    return out


@pytest.mark.parametrize("ring", [True, False], ids=["dropped", "kept"])
def test_read_walk_records_the_free_list_words_and_the_walks_read_only_them(ring):
    # a 3 MiB run: a mangled fastbin chain of 0x50 chunks across the pieces, in-use chunks
    # whose first word is data (not recorded), a big in-use chunk, free chunks in a bin
    # (doubly linked through an arena's bin header); the run walked with records, then the
    # chain and the bin walked over an uncopied region whose fd reads nothing: every word
    # comes from the records, and the results equal the walks over the copy
    rnd = random.Random(3)
    holder = {}

    def fill(r):
        fast, free = [], []
        while r.cur + 0x3000 < r.base + len(r.buf):
            k = rnd.randrange(4)
            if k == 0:
                fast.append(r.chunk(0x50))
            elif k == 1:
                free.append(r.chunk(0x100, in_use=False))
                r.chunk(0x20)           # free chunks never touch: glibc coalesces them
            elif k == 2:
                a = r.chunk(0x60)
                r.set_word(a + 16, 0x4142434445464748)       # data, no link
            else:
                r.chunk(0x800)                               # past rec_max when set below it
        top = r.finish_top()
        u = [c + 16 for c in fast]
        for x, y in zip(u, u[1:] + [0]):
            r.set_word(x, (x >> 12) ^ y)                     # safe-linking, NULL at the end
        holder.update(fast=fast, free=free)
        return r.base, top

    size = 3 << 20
    src, run, (first, top) = _mapped_run(size, fill)
    arena = Run(base=0x20000000, size=0x100)
    binc = arena.base + 0x40
    free = holder["free"]
    ring_ = [binc] + free + [binc]
    for prev, cur, nxt in zip(ring_, ring_[1:], ring_[2:]):
        run.set_word(cur + 16, nxt)
        run.set_word(cur + 24, prev)
    arena.set_word(binc + 16, free[0])
    arena.set_word(binc + 24, free[-1])
    src[:] = run.buf
    lo, hi, rec_max = run.base, run.base + size, 0x400
    want = _expected_records(run, lo, hi, True, rec_max)
    assert sum(1 for r in want if r[0] & 1) == len(free) and len(want) > len(free) + 100
    cap = size // 32
    user, usable = array("Q", bytes(8 * cap)), array("Q", bytes(8 * cap))
    rec, ix = array("Q", bytes(32 * (len(want) + 10))), array("I", bytes(4 * ((size >> 12) + 2)))
    dst = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pd = ffi.from_buffer(dst)
    jobs = ffi.new("mu_read_job[]", 1)
    j = jobs[0]
    j.addr, j.len, j.buf, j.first, j.top = run.base, size, ffi.cast("uint8_t *", pd), first, top
    j.drop = lib.MU_READ_DROP if ring else 0
    j.user, j.usable, j.cap = (ffi.from_buffer("uint64_t[]", user),
                               ffi.from_buffer("uint64_t[]", usable), cap)
    j.rec, j.rec_ix, j.rec_cap = ffi.from_buffer("uint64_t[]", rec), ffi.from_buffer("uint32_t[]", ix), len(rec) // 4
    j.rec_lo, j.rec_hi, j.rec_max, j.rec_mangled = lo, hi, rec_max, 1
    fd = os.open("/proc/self/mem", os.O_RDONLY)
    try:
        assert lib.mu_read_walk(fd, jobs, 1) == 0
    finally:
        os.close(fd)
    n = j.rec_stored
    assert [tuple(rec[4 * k:4 * k + 4]) for k in range(n)] == want
    assert all(ix[p] == sum(1 for r in want if (r[0] & ~1) - lo < p << 12)
               for p in range(0, (size >> 12) + 2, 97))
    copied, keep = regions(run, arena)
    lazy = ffi.new("mu_region[]", 2)                # the heap uncopied, read through no fd
    lazy[0].base, lazy[0].len, lazy[0].data = arena.base, len(arena.buf), copied[0].data
    lazy[1].base, lazy[1].len, lazy[1].uncopied, lazy[1].fd = run.base, size, 1, -1
    lazy[1].rec, lazy[1].rec_ix, lazy[1].nrec = ffi.from_buffer("uint64_t[]", rec), ffi.from_buffer("uint32_t[]", ix), n
    head = holder["fast"][0] + 16
    results = []
    for tab in (copied, lazy):
        st, got, res = chain(tab, 2, run, head, 0, 1, 0x50, 100000, cap=100000)
        nodes_, nbytes, bitfree, bad = (ffi.new("uint64_t *") for _ in range(4))
        rc = lib.mu_walk_bin(tab, 2, binc, 100000, nodes_, nbytes, bitfree, bad)
        results.append((st, got, rc, nodes_[0], nbytes[0], bitfree[0], bad[0]))
    assert results[0] == results[1]
    assert results[0][:1] == (lib.MU_CHAIN_NULL,) and results[0][1] == [c + 16 for c in holder["fast"]]
    assert results[0][2:6] == (0, len(free), 0x100 * len(free), len(free))
    # without the records the same walks cannot read a word
    lazy[1].rec, lazy[1].nrec = ffi.NULL, 0
    st, got, res = chain(lazy, 2, run, head, 0, 1, 0x50, 100000, cap=100000)
    assert (st, res.reason) == (lib.MU_CHAIN_BAD, lib.MU_LINK_UNREADABLE)
    del pd
