"""Unit tests of stage 6 (mark): the upstream HeapWalker cases on in-memory heaps.

Heaps are Python buffers at addresses we pick; pointers are packed with struct.
Drawings: `X -> Y` means a word of X holds an address inside Y.
"""
import errno
import platform
import random
import struct
from array import array

import pytest

from memunreachable._types import HeapImage
from memunreachable.sweep.mark import mark

BASE = 0x7F3A_0000_1000


class Heap:
    """Blocks laid out from `base`, each on a 16-byte boundary after the previous one."""

    def __init__(self, sizes, base=BASE, gap=16):
        self.base = base
        self.addrs = []
        addr = base
        for size in sizes:
            self.addrs.append(addr)
            addr += (max(size, 1) + 15) // 16 * 16 + gap
        self.sizes = list(sizes)
        self.buf = bytearray(addr - base)

    def point(self, src, slot, value):
        """Store value in word `slot` of block src."""
        struct.pack_into("<Q", self.buf, self.addrs[src] + 8 * slot - self.base, value)

    def link(self, src, slot, dst, delta=0):
        self.point(src, slot, self.addrs[dst] + delta)

    def image(self):
        return HeapImage(array("Q", self.addrs), array("Q", self.sizes), [(self.base, self.buf)])


def words_buffer(*values):
    return bytearray(struct.pack(f"<{len(values)}Q", *values))


ROOT = 0x5555_0000_0000


# HeapWalker.leak: pointers just before the block and just past its end keep nothing alive.
def test_leak_pointer_before_and_one_past_end():
    h = Heap([16])
    a = h.addrs[0]
    root = words_buffer(a - 8, a + 16, a + 15 + 8, a - 1)
    res = mark(h.image(), [(ROOT, root)])
    assert list(res.marked) == [0]
    assert (res.num_marked, res.root_bytes, res.heap_bytes, res.words) == (0, 32, 0, 4)


# HeapWalker.live: a root word pointing at any byte of the block (4 slots x 16 offsets).
@pytest.mark.parametrize("slot", range(4))
@pytest.mark.parametrize("offset", range(16))
def test_live_interior_pointers(slot, offset):
    h = Heap([16])
    values = [0, 0, 0, 0]
    values[slot] = h.addrs[0] + offset
    res = mark(h.image(), [(ROOT, words_buffer(*values))])
    assert list(res.marked) == [1]
    assert (res.num_marked, res.heap_bytes, res.words) == (1, 16, 4 + 2)


# HeapWalker.unaligned: root range [root+i, root+32-j); the pointer sits in word 1.
@pytest.mark.parametrize("i", range(8))
@pytest.mark.parametrize("j", range(8))
def test_unaligned_root_range(i, j):
    h = Heap([16])
    buf = words_buffer(0, h.addrs[0], 0, 0)
    res = mark(h.image(), [(ROOT + i, memoryview(buf)[i:32 - j])])
    assert list(res.marked) == [1]
    assert res.root_bytes == 32 - i - j


def test_unaligned_start_skips_the_straddling_word():
    h = Heap([16])
    buf = words_buffer(h.addrs[0], 0)
    # the range starts at ROOT+1: rounded up to ROOT+8, so word 0 (the pointer) is never read
    res = mark(h.image(), [(ROOT + 1, memoryview(buf)[1:])])
    assert list(res.marked) == [0]
    assert res.words == 1


def test_root_tail_word_is_zero_padded_past_the_buffer():
    low = Heap([16], base=0x1000)            # an address that fits in 4 bytes
    buf = words_buffer(0, low.addrs[0])
    assert list(mark(low.image(), [(ROOT, memoryview(buf)[:12])]).marked) == [1]
    high = Heap([16])                        # upper bytes cut off: the word reads as a low value
    buf = words_buffer(0, high.addrs[0])
    assert list(mark(high.image(), [(ROOT, memoryview(buf)[:12])]).marked) == [0]


def test_heap_tail_word_is_read_whole_inside_the_region():
    # A(12) -> B: the pointer is in the word at A+8, which starts before A's end (A+12)
    h = Heap([12, 16])
    h.link(0, 1, 1)
    root = words_buffer(h.addrs[0])
    res = mark(h.image(), [(ROOT, root)])
    assert list(res.marked) == [1, 1]
    assert (res.heap_bytes, res.words) == (12 + 16, 1 + 2 + 2)


# HeapWalker.cycle: two one-word blocks pointing at each other, no roots: 2 leaks of 2w.
def test_cycle_without_roots_is_two_leaks():
    h = Heap([8, 8], gap=0)
    h.link(0, 0, 1)
    h.link(1, 0, 0)
    res = mark(h.image(), [])
    assert list(res.marked) == [0, 0]
    assert res.num_marked == 0
    leaked = sum(s for s, m in zip(h.sizes, res.marked) if not m)
    assert leaked == 16


# HeapWalker.zero: a zero-size block counts as 1 byte, [begin, begin+1).
def test_zero_size_block_counts_as_one_byte():
    a = BASE
    img = HeapImage(array("Q", [a, a + 1, a + 16]), array("Q", [0, 0, 16]), [(BASE, bytearray(32))])
    assert list(mark(img, [], [a + 1]).marked) == [0, 1, 0]
    assert list(mark(img, [], [a]).marked) == [1, 0, 0]
    assert list(mark(img, [], [a + 2]).marked) == [0, 0, 0]
    res = mark(img, [], [a, a + 1])
    assert (res.num_marked, res.heap_bytes, res.words) == (2, 0, 2)


def test_root_words_registers():
    h = Heap([16, 32, 24])
    a, b, c = h.addrs
    res = mark(h.image(), [], [0, 1, b + 31, c + 24, a - 1, 0xFFFF_FFFF_FFFF_FFFF])
    assert list(res.marked) == [0, 1, 0]
    assert (res.root_bytes, res.words, res.heap_bytes) == (0, 6 + 4, 32)


def test_transitive_chain_and_stats():
    # root -> A -> B -> C; D unreached; C -> one past D's end (not D)
    h = Heap([16, 24, 32, 16])
    h.link(0, 1, 1)
    h.link(1, 2, 2, delta=23)
    h.link(2, 0, 3, delta=16)
    res = mark(h.image(), [(ROOT, words_buffer(0, h.addrs[0]))])
    assert list(res.marked) == [1, 1, 1, 0]
    assert res.num_marked == 3
    assert res.root_bytes == 16
    assert res.heap_bytes == 16 + 24 + 32
    assert res.words == 2 + 2 + 3 + 4
    assert res.size_total == 16 + 24 + 32 + 16      # every allocation's size, reached or not


def test_cycle_hanging_off_a_root_is_reachable():
    # global -> B, B <-> C; A alone
    h = Heap([16, 16, 16])
    h.link(1, 0, 2)
    h.link(2, 1, 1)
    res = mark(h.image(), [(ROOT, words_buffer(h.addrs[1]))])
    assert list(res.marked) == [0, 1, 1]


def test_roots_scanned_in_order_each_block_once():
    h = Heap([16, 16])
    h.link(0, 0, 1)
    h.link(1, 0, 0)
    r1 = words_buffer(h.addrs[0], h.addrs[1])
    r2 = words_buffer(h.addrs[1] + 8)
    res = mark(h.image(), [(ROOT, r1), (ROOT + 0x1000, r2)], [h.addrs[0]])
    assert list(res.marked) == [1, 1]
    assert (res.root_bytes, res.heap_bytes, res.words) == (24, 32, 2 + 1 + 1 + 4)


def test_two_regions_and_the_gap_between_them():
    lo = Heap([16, 16], base=BASE)
    hi = Heap([16, 16], base=BASE + 0x10_0000)
    lo.link(0, 0, 1)                      # lo0 -> lo1 -> hi1
    lo.point(1, 0, hi.addrs[1])
    img = HeapImage(array("Q", lo.addrs + hi.addrs), array("Q", lo.sizes + hi.sizes),
                    [(lo.base, lo.buf), (hi.base, hi.buf)])
    gap = BASE + 0x8_0000
    res = mark(img, [(ROOT, words_buffer(gap, BASE - 16, hi.base + len(hi.buf), lo.addrs[0]))])
    assert list(res.marked) == [1, 1, 0, 1]
    assert res.num_marked == 3
    assert res.size_total == 4 * 16                 # the sizes of both regions' allocations


def test_plain_lists_are_accepted():
    h = Heap([16, 16])
    img = HeapImage(list(h.addrs), list(h.sizes), [(h.base, bytes(h.buf))])
    assert list(mark(img, [(ROOT, bytes(words_buffer(h.addrs[1])))], [h.addrs[0]]).marked) == [1, 1]


def test_empty_inputs():
    img = HeapImage(array("Q"), array("Q"), [])
    res = mark(img, [(ROOT, words_buffer(BASE))], [BASE])
    assert res.marked == bytearray()
    assert (res.num_marked, res.root_bytes, res.words) == (0, 8, 2)


def _image(begins, sizes, regions=((0x1000, 0x100),)):
    return HeapImage(array("Q", begins), array("Q", sizes), [(b, bytearray(n)) for b, n in regions])


# HeapWalker.allocation/overlap/zero/mapping: our input is sorted arrays, so the
# insertion-order checks become "valid sorted input" vs EINVAL.
@pytest.mark.parametrize("begins,sizes", [
    ([0x1000, 0x1002, 0x1003, 0x1004, 0x1006], [1, 1, 1, 1, 1]),      # allocation
    ([0x1001, 0x1002, 0x1003, 0x1004], [1, 1, 1, 1]),                 # overlap: the accepted ones
    ([0x1001, 0x1002, 0x1003], [0, 0, 0]),                            # zero
    ([0x1000, 0x10F8], [8, 8]),                                       # ends exactly at the region end
])
def test_valid_allocations(begins, sizes):
    assert list(mark(_image(begins, sizes), []).marked) == [0] * len(begins)


@pytest.mark.parametrize("begins,sizes,regions", [
    ([0x1002, 0x1002], [1, 1], None),          # identical duplicate
    ([0x1002, 0x1001], [1, 2], None),          # unsorted
    ([0x1001, 0x1002], [2, 1], None),          # overlap
    ([0x1001, 0x1003], [3, 1], None),
    ([0x1002, 0x1002], [0, 0], None),          # zero-size duplicate
    ([0x1002, 0x1002], [0, 1], None),          # zero-size counts as 1 byte: (2,2) vs (2,3)
    ([0x0FF8], [16], None),                    # mapping: starts below the region
    ([0x10F8], [16], None),                    # crosses the region end
    ([0x2000], [8], None),                     # outside every region
    ([0x1000], [0x200], [(0x1000, 0x100), (0x1100, 0x100)]),   # spans two regions
    ([0x1000], [8], [(0x1000, 0x100), (0x1080, 0x100)]),       # overlapping regions
    ([0x1000], [8], [(0x2000, 0x100), (0x1000, 0x100)]),       # unsorted regions
    ([0xFFFF_FFFF_FFFF_FFF8], [16], [(0xFFFF_FFFF_FFFF_FF00, 0xF0)]),  # wraps around
    ([0x1000, 0x1180], [8, 8], [(0x1000, 0x100), (0x1200, 0x100)]),    # in the gap between two
    ([0x1200, 0x1000], [8, 8], [(0x1000, 0x100), (0x1200, 0x100)]),    # unsorted across regions
    ([0x1000 + 8 * k for k in range(20)] + [0x1008] + [0x1100 + 8 * k for k in range(20)],
     [8] * 41, [(0x1000, 0x100), (0x1100, 0x100)]),                    # one step back, far in
])
def test_invalid_allocations_raise_einval(begins, sizes, regions):
    img = _image(begins, sizes) if regions is None else _image(begins, sizes, regions)
    with pytest.raises(OSError) as exc:
        mark(img, [])
    assert exc.value.errno == errno.EINVAL


def test_the_index_accepts_exactly_what_the_plain_check_accepts():
    # mu_scan_index_init validates in its page tables' pass; mu_scan_index_check, a plain loop,
    # must agree on every input (sorted, overlapping, outside or between regions, unsorted)
    from memunreachable._ffi import lib
    from memunreachable.heaps.cpython.gclists import image_args
    rnd = random.Random(25)
    verdicts = set()
    for _ in range(3000):
        regions, at = [], 0x10000
        for _ in range(rnd.randint(1, 3)):
            at += rnd.choice([0, 0x10, 0x100])
            size = rnd.choice([0x40, 0x48, 0x100, 0xF8, 0x1000])    # 8-byte multiples
            regions.append((at, size))
            at += size
        begins, sizes = [], []
        pos = regions[0][0] - rnd.choice([0, 0, 0, 8])
        for _ in range(rnd.randint(0, 40)):
            pos += rnd.choice([0, 8, 16, 16, 32, 48, 0x80])
            if rnd.random() < 0.03:
                pos -= rnd.choice([8, 16, 64])
            begins.append(pos)
            sizes.append(rnd.choice([0, 8, 8, 16, 24, 40]))
            pos += sizes[-1]
        img = _image(begins, sizes, regions)
        expected = lib.mu_scan_index_check(*image_args(img))
        try:
            mark(img, [])
            got = 0
        except OSError as exc:
            got = -exc.errno
        assert got == expected, (begins, sizes, regions)
        verdicts.add(got)
    assert verdicts == {0, -errno.EINVAL}


def test_mismatched_lengths_raise_valueerror():
    with pytest.raises(ValueError):
        mark(HeapImage(array("Q", [0x1000]), array("Q"), [(0x1000, bytearray(16))]), [])


def _reference_mark(begins, sizes, regions, roots, words):
    """Straightforward model of libmemunreachable.md section 3 (slow, for comparison)."""
    spans = [(b, b + max(s, 1)) for b, s in zip(begins, sizes)]

    def find(v):
        for k, (b, e) in enumerate(spans):
            if b <= v < e:
                return k
        return None

    def read(addr, nbytes, holders):
        for base, buf in holders:
            if base <= addr < base + len(buf):
                chunk = bytes(buf[addr - base:addr - base + nbytes])
                return int.from_bytes(chunk.ljust(8, b"\0"), "little")
        raise AssertionError(addr)

    def scan(addr, length, holders):
        out = []
        a = (addr + 7) & ~7
        while a < addr + length:
            out.append(read(a, 8, holders))
            a += 8
        return out

    marked = [0] * len(begins)
    work = []
    values = []
    for base, buf in roots:
        values += scan(base, len(buf), [(base, buf)])
    values += list(words)
    for v in values:
        k = find(v)
        if k is not None and not marked[k]:
            marked[k] = 1
            work.append(k)
    while work:
        k = work.pop()
        for v in scan(begins[k], sizes[k], regions):
            j = find(v)
            if j is not None and not marked[j]:
                marked[j] = 1
                work.append(j)
    return marked


@pytest.mark.parametrize("seed", range(12))
def test_random_heaps_match_the_reference_model(seed):
    rnd = random.Random(seed)
    regions, begins, sizes = [], [], []
    base = 0x7F00_0000_0000
    for _ in range(rnd.randint(1, 4)):
        base += rnd.randrange(1, 64) * 0x1000
        addr = base + rnd.randrange(0, 4) * 16
        length = rnd.randrange(1, 6) * 0x1000
        while True:
            size = rnd.choice([0, 1, 8, 12, 24, 40, 100, 500, 3000, 9000])
            if addr + max(size, 1) > base + length:
                size = 8
                if addr + size > base + length:
                    break
            begins.append(addr)
            sizes.append(size)
            addr += (max(size, 1) + 7) // 8 * 8 + rnd.choice([0, 0, 8, 16, 4096, 3])
        regions.append((base, bytearray(length)))
        base += length

    def candidate():
        k = rnd.randrange(len(begins))
        return rnd.choice([begins[k], begins[k] + max(sizes[k], 1) - 1, begins[k] + max(sizes[k], 1),
                           begins[k] + rnd.randrange(max(sizes[k], 1)), begins[k] - 1,
                           rnd.randrange(1 << 64), regions[0][0] - 8])

    for rbase, buf in regions:
        for off in range(0, len(buf) - 8, 8):
            if rnd.random() < 0.02:
                struct.pack_into("<Q", buf, off, candidate())
    roots = []
    for r in range(2):
        buf = bytearray(rnd.randrange(8, 200))
        for off in range(0, len(buf) - 8, 8):
            if rnd.random() < 0.1:
                struct.pack_into("<Q", buf, off, candidate())
        roots.append((ROOT + r * 0x1000 + rnd.randrange(8), buf))
    words = [candidate() for _ in range(3)]
    img = HeapImage(array("Q", begins), array("Q", sizes), regions)
    res = mark(img, roots, words)
    expect = _reference_mark(begins, sizes, regions, roots, words)
    assert list(res.marked) == expect
    assert res.num_marked == sum(expect)
    assert res.heap_bytes == sum(s for s, m in zip(sizes, expect) if m)


# A word into a block's last 8 bytes is a reference, as any word into [begin, end): on a
# glibc in-heap chunk (usable size 8 mod 16) that is the next chunk's header address, which a
# struct linked through its last member holds (PostgreSQL's background-worker list).
def test_a_word_at_a_blocks_last_8_bytes_is_a_reference():
    img = _image([0x1010, 0x1050, 0x1090], [40, 48, 24])    # 48: an mmapped chunk's (0 mod 16)
    got = mark(img, [], [0x1010 + 40 - 8, 0x1050 + 48 - 8, 0x1090 + 24])
    assert list(got.marked) == [1, 1, 0]                    # one past the end is not


# More than 2^18 allocations: mu_mark runs on one thread per CPU (up to 4), sharing work.
# The marked set and every statistic must be exactly those of a breadth-first search over
# the edges the test itself stored (two regions, a random graph with long chains, few roots).
@pytest.mark.parametrize("seed", range(3))
def test_parallel_mark_matches_a_graph_search(seed):
    rnd = random.Random(seed)
    n = 280_000
    half = n // 2
    sizes = [rnd.choice([24, 40, 56]) for _ in range(n)]
    bases = [0x7F10_0000_0000, 0x7F20_0000_0000]
    begins, regions = [], []
    for r, (lo, hi) in enumerate([(0, half), (half, n)]):
        addr = bases[r] + 16
        for k in range(lo, hi):
            begins.append(addr)
            addr += sizes[k] + 8
        regions.append((bases[r], bytearray(addr - bases[r])))
    edges = [[] for _ in range(n)]
    for k in range(n):
        for slot in range(rnd.choice([0, 1, 1, 2, 3])):
            j = rnd.randrange(n) if rnd.random() < 0.7 else (k + 1) % n   # chains and jumps
            off = rnd.randrange(max(sizes[j], 1))                          # interior pointers
            r = 0 if begins[k] < bases[1] else 1
            struct.pack_into("<Q", regions[r][1], begins[k] - bases[r] + 8 * slot, begins[j] + off)
            edges[k].append(j)
    root_blocks = [rnd.randrange(n) for _ in range(5)]
    roots = [(ROOT, words_buffer(*(begins[j] for j in root_blocks[:3])))]
    words = [begins[j] + 1 for j in root_blocks[3:]]
    expect = bytearray(n)
    todo = list(root_blocks)
    for j in todo:
        expect[j] = 1
    while todo:
        k = todo.pop()
        for j in edges[k]:
            if not expect[j]:
                expect[j] = 1
                todo.append(j)
    res = mark(HeapImage(array("Q", begins), array("Q", sizes), regions), roots, words)
    assert res.marked == expect
    assert res.num_marked == sum(expect)
    assert 0 < res.num_marked < n
    assert res.heap_bytes == sum(s for s, m in zip(sizes, expect) if m)
    assert res.words == 3 + 2 + res.heap_bytes // 8


# ---- the low-memory mark: uncopied regions read on demand (mu_region.uncopied) ---------------
# The heap's bytes sit in a sparse memfd at file offset == address: pread(fd, addr) is what a
# read of /proc/<pid>/mem at that address gives. Each case marks the same heap from a copy and
# uncopied (waves of reads, kept candidates, or both) and needs identical results.
import os

from memunreachable._ffi import ffi, lib
from memunreachable.heaps.glibc.copies import Uncopied
from memunreachable.sweep.mark import DeadWords

UNCOPIED_BASE = 1 << 32         # page aligned (mu_cands)


def memfd_of(base, buf):
    fd = os.memfd_create("heap")
    os.pwrite(fd, bytes(buf), base)
    return fd


def cands_of(base, buf, lo, hi, max_words, split=False):
    """mu_cands of buf keeping values in [lo, hi); split: as three ranges (the range list
    path: [lo, mid), [mid, hi) and one beyond)."""
    out = ffi.new("mu_cands **")
    mid = (lo + hi) // 2 & ~7
    ranges = [lo, mid, mid, hi, hi + 4096, hi + 8192] if split else [lo, hi]
    assert lib.mu_cands_new(base, len(buf), ffi.new("uint64_t[]", ranges), len(ranges) // 2,
                            max_words, out) == 0
    c = ffi.gc(out[0], lib.mu_cands_free)
    assert lib.mu_cands_fill(c, ffi.from_buffer(buf), base, len(buf)) >= 0
    return c


def stats(res):
    return (bytes(res.marked), res.num_marked, res.root_bytes, res.heap_bytes, res.words)


def random_heap(n, seed, big=()):
    """n blocks of 24-392 bytes (glibc usable sizes; `big`: indices given 3 MiB), each
    pointing at 0-3 random blocks (interior too), some words noise; ~1/3 reachable."""
    rnd = random.Random(seed)
    sizes = [3 << 20 if i in big else 16 * rnd.randrange(2, 26) - 8 for i in range(n)]
    h = Heap(sizes, base=UNCOPIED_BASE, gap=8)
    for i in range(n):
        for slot in range(rnd.randrange(4)):
            j = rnd.randrange(n)
            h.link(i, slot, j, delta=8 * rnd.randrange(max(1, h.sizes[j] // 8)))
        if sizes[i] > 40:
            h.point(i, 4, rnd.getrandbits(64))
    roots = words_buffer(*(h.addrs[rnd.randrange(n)] for _ in range(max(1, n // 50))))
    return h, [(ROOT, roots)]


def all_ways(h, roots, dead=None, budget=None, split=False):
    """(copied result, uncopied-with-waves result, uncopied-with-candidates result); the
    candidates are filled by both builds of the filter (the CPU's and the baseline one,
    mu_cands_filter), whose marks must be the same."""
    fd = memfd_of(h.base, h.buf)
    try:
        img = h.image()
        copied = mark(img, roots, dead=dead)
        waves = mark(HeapImage(img.begins, img.sizes, [(h.base, Uncopied(len(h.buf), fd))]),
                     roots, dead=dead)
        lo, hi = h.base, h.base + len(h.buf)
        kept = []
        for build in (-1, 0):
            assert lib.mu_cands_filter(build) == -1
            try:
                c = cands_of(h.base, h.buf, lo, hi, len(h.buf) if budget is None else budget,
                             split)
            finally:
                lib.mu_cands_filter(-1)
            kept.append(mark(HeapImage(img.begins, img.sizes,
                                       [(h.base, Uncopied(len(h.buf), fd, c))]),
                             roots, dead=dead))
        assert bytes(kept[0].marked) == bytes(kept[1].marked) and stats(kept[0]) == stats(kept[1])
    finally:
        os.close(fd)
    return copied, waves, kept[0]


def test_the_candidate_filter_s_builds_are_chosen_and_restored():
    # -1: the CPU's (the default), 0: the baseline one, 1: AVX2 where the CPU has it
    assert lib.mu_cands_filter(0) == -1
    assert lib.mu_cands_filter(-1) == 0
    assert lib.mu_cands_filter(2) == -errno.EINVAL and lib.mu_cands_filter(-2) == -errno.EINVAL
    with open("/proc/cpuinfo") as f:
        avx2 = " avx2" in f.read() and platform.machine() == "x86_64"
    assert lib.mu_cands_filter(1) == (-1 if avx2 else -errno.ENOTSUP)
    assert lib.mu_cands_filter(-1) == (1 if avx2 else -1)


@pytest.mark.parametrize("n,seed,split", [(3000, 1, False), (3000, 2, True),
                                          (300_000, 3, True)])   # 300,000: parallel
def test_uncopied_mark_equals_the_mark_over_a_copy(n, seed, split):
    h, roots = random_heap(n, seed)
    copied, waves, kept = all_ways(h, roots, split=split)
    assert 0 < copied.num_marked < n
    assert stats(waves) == stats(copied)
    assert stats(kept) == stats(copied)


def test_uncopied_mark_with_part_of_the_candidates_and_blocks_over_a_read():
    # blocks of 3 MiB (more than one wave read, several candidate pieces), and a candidate
    # budget that keeps only some pieces: the rest are read
    h, roots = random_heap(6000, 4, big={10, 2000, 4000})
    for i in (10, 2000, 4000):
        h.link(i, (3 << 20) // 8 - 1, 11)           # the big blocks' last words point on
    roots.append((ROOT + 0x10000, words_buffer(h.addrs[10], h.addrs[2000], h.addrs[4000])))
    c = cands_of(h.base, h.buf, h.base, h.base + len(h.buf), 3000)
    pieces = ffi.new("uint64_t *")
    lib.mu_cands_words(c, pieces)
    assert 0 < pieces[0] < (len(h.buf) + (1 << 20) - 1) >> 20
    copied, waves, kept = all_ways(h, roots, budget=3000)
    assert copied.marked[11] == 1
    assert stats(waves) == stats(copied)
    assert stats(kept) == stats(copied)


def test_uncopied_mark_of_pointer_free_blocks_between_pointing_ones():
    # The candidates mark takes a block with no candidate for a leaf (marked at its hit, never
    # scanned). Leaves mixed with blocks whose only pointer is the first or the last word, or a
    # word of a block straddling a 1 MiB piece, zero-size blocks and a dead range over a leaf
    # and over a pointer: every way gives the same marks, words and bytes.
    rnd = random.Random(7)
    sizes = [0 if i % 97 == 5 else 16 * rnd.randrange(2, 9) - 8 for i in range(40_000)]
    sizes[20_000] = 3 << 20                     # straddles pieces: its pointer in the third
    h = Heap(sizes, base=UNCOPIED_BASE, gap=8)
    chain = [i for i in range(0, 40_000, 3) if sizes[i]]
    for a, b in zip(chain, chain[1:]):          # a chain through every third block
        h.link(a, 0 if a % 2 else sizes[a] // 8 - 1, b)
    h.link(20_000, (5 << 17) // 8, 20_003)      # its only pointer, 2.5 MiB into it
    for i in range(1, 40_000, 3):               # the blocks after the chain's: leaves, held by
        h.link(chain[rnd.randrange(len(chain))], 1, i)      # a chain block (or none: the
    dead_leaf, dead_ptr = chain[7] + 1, chain[100]          # slot is written again)
    roots = [(ROOT, words_buffer(h.addrs[chain[0]], h.addrs[20_000]))]
    dead = DeadWords(ranges=[(h.addrs[dead_leaf], h.addrs[dead_leaf] + 8),
                             (h.addrs[dead_ptr] + 8, h.addrs[dead_ptr] + 16)])
    results = all_ways(h, roots, dead=dead) + all_ways(h, roots)
    copied = results[0]
    assert copied.marked[20_003] == 1 and copied.marked[chain[-1]] == 1
    assert 0 < copied.num_marked < len(sizes)
    for r in results[1:3]:
        assert stats(r) == stats(copied)
    for r in results[4:]:
        assert stats(r) == stats(results[3])


def test_uncopied_mark_of_a_deep_list_and_dead_words_and_a_copied_region():
    # a descending list of 2,000 blocks (a wave each), a dead word inside one block that would
    # otherwise reach a leak, and a second, copied region the list runs through
    h = Heap([40] * 2000 + [24], base=UNCOPIED_BASE)
    for i in range(1, 2000):
        h.link(i, 0, i - 1)
    h.link(1000, 2, 2000)                       # dead: not a reference
    other = Heap([40] * 10, base=UNCOPIED_BASE + (1 << 24))
    h.point(0, 1, other.addrs[0])
    for i in range(1, 10):
        other.link(i - 1, 0, i)
    roots = [(ROOT, words_buffer(h.addrs[1999]))]
    dead = DeadWords(ranges=[(h.addrs[1000] + 16, h.addrs[1000] + 24)])
    fd = memfd_of(h.base, h.buf)
    try:
        img = HeapImage(array("Q", h.addrs + other.addrs), array("Q", h.sizes + other.sizes),
                        [(h.base, h.buf), (other.base, other.buf)])
        copied = mark(img, roots, dead=dead)
        c = cands_of(h.base, h.buf, h.base, other.base + len(other.buf), 1 << 20)
        for cands in (None, c):
            lazy = HeapImage(img.begins, img.sizes,
                             [(h.base, Uncopied(len(h.buf), fd, cands)), (other.base, other.buf)])
            assert stats(mark(lazy, roots, dead=dead)) == stats(copied)
    finally:
        os.close(fd)
    assert copied.num_marked == 2010 and copied.marked[2000] == 0


def test_uncopied_bytes_that_cannot_be_read_are_an_error_never_zeros():
    from memunreachable._errors import MemoryUnreadable
    h = Heap([40, 40], base=UNCOPIED_BASE)
    h.link(0, 0, 1)
    fd = memfd_of(h.base, h.buf[:16])           # the file ends inside block 0
    try:
        img = HeapImage(array("Q", h.addrs), array("Q", h.sizes),
                        [(h.base, Uncopied(len(h.buf), fd))])
        with pytest.raises(MemoryUnreadable):
            mark(img, [(ROOT, words_buffer(h.addrs[0]))])
    finally:
        os.close(fd)


def test_candidates_keep_the_words_in_range_within_the_budget():
    buf = bytearray(3 << 20)                    # three pieces
    lo, hi = 0x1000, 0x2000
    for off, v in [(0, 0x1000), (8, 0x2000), (4096, 0x1ff8), ((1 << 20) + 8, 0x1800),
                   ((2 << 20) + 16, 0x1234), ((2 << 20) + 24, 0x1235)]:
        struct.pack_into("<Q", buf, off, v)
    c = cands_of(1 << 32, buf, lo, hi, 3)       # pieces hold 2, 1, 2: the third is over
    pieces = ffi.new("uint64_t *")
    assert lib.mu_cands_words(c, pieces) == 3 and pieces[0] == 2
    # two ranges: a value between them (0x1800) or at an end (0x2000) is no candidate
    two = ffi.new("uint64_t[]", [0x1000, 0x1240, 0x1ff8, 0x2008])
    out = ffi.new("mu_cands **")
    assert lib.mu_cands_new(1 << 32, len(buf), two, 2, 100, out) == 0
    c2 = ffi.gc(out[0], lib.mu_cands_free)
    assert lib.mu_cands_fill(c2, ffi.from_buffer(buf), 1 << 32, len(buf)) == 3
    assert lib.mu_cands_words(c2, pieces) == 5 and pieces[0] == 3   # 0x1000 0x2000 0x1ff8 0x1234 0x1235
    out = ffi.new("mu_cands **")
    ranges = ffi.new("uint64_t[]", [0, 1, 8, 16])
    assert lib.mu_cands_new((1 << 32) + 8, 16, ranges, 1, 0, out) == -errno.EINVAL   # unaligned
    assert lib.mu_cands_new(1 << 32, 16, ranges + 2, 1, 0, out) == 0
    lib.mu_cands_free(out[0])
    ranges[2] = 0
    assert lib.mu_cands_new(1 << 32, 16, ranges, 2, 0, out) == -errno.EINVAL     # unsorted


def test_merge_pairs_is_merge_ranges_over_tuples():
    from memunreachable._types import Range, merge_ranges
    from memunreachable.sweep.mark import merge_pairs
    rng = random.Random(7)
    for _ in range(200):
        pairs = []
        for _ in range(rng.randrange(0, 30)):
            b = rng.randrange(0, 400) * 8
            pairs.append((b, max(0, b + rng.randrange(-2, 12) * 8)))     # empty, reversed too
        want = [(r.begin, r.end) for r in merge_ranges([Range(b, e) for b, e in pairs])]
        assert merge_pairs(pairs) == want
    assert merge_pairs([(16, 32), (0, 8), (8, 16), (40, 48), (44, 46)]) == [(0, 32), (40, 48)]


@pytest.mark.parametrize("spread", [12, 30, 47, 64])
def test_merge_pairs_of_many_ranges_is_merge_ranges(spread):
    """Past 4,096 pairs the sort is a radix sort (digits every begin shares are skipped):
    begins spread over 2**spread bytes above a high base, sorted runs, duplicates, empty and
    reversed pairs; the result equals merge_ranges'."""
    from memunreachable._types import Range, merge_ranges
    from memunreachable.sweep.mark import merge_pairs
    rng = random.Random(spread)
    base = 0x7f00_0000_0000 if spread < 48 else 0
    for n in (4095, 4096, 20_000):
        pairs = []
        for _ in range(n):
            b = base + (rng.getrandbits(spread) & ~7)
            pairs.append((b, max(0, min(b + rng.randrange(-2, 40) * 8, 2**64 - 1))))
        pairs += sorted(pairs[:500]) + pairs[:50]           # a sorted run, duplicates
        want = [(r.begin, r.end) for r in merge_ranges([Range(b, e) for b, e in pairs])]
        assert merge_pairs(pairs) == want
        assert merge_pairs(sorted(pairs)) == want           # already sorted
        tail = pairs[:n // 10]
        assert merge_pairs(sorted(pairs[n // 10:]) + tail) == want  # a sorted run, a tail
        run = sorted(pairs[n // 10:])
        for part in (sorted(tail)[-20:], sorted(tail)[:20]):        # a tail above, below
            assert merge_pairs(run + part) == [
                (r.begin, r.end) for r in merge_ranges([Range(b, e) for b, e in run + part])]


TEXT = int.from_bytes(b"AES-128-", "little")       # a word of 8 printable bytes


def _tail_into(h, j):
    """A word that ends a string ("E", then a NUL) glued to the high bytes of an address
    inside block j (which must span an address whose low 16 bits are 0x0045)."""
    v = ((h.addrs[j] + 0xffff) & ~0xffff) + ord("E")
    assert h.addrs[j] <= v < h.addrs[j] + h.sizes[j] and v.to_bytes(8, "little")[1] == 0
    return v


def test_a_text_tail_is_no_reference_on_every_mark_path():
    # S0 = ["AES-128-", "E\0" + an old pointer's high bytes] -> T1: text, T1 unreachable;
    # twins that are references: after a word that is not text (S1 -> T2), a pointer whose
    # NUL is its low byte (S2 -> T3), a tail that is the first word of its block after a block
    # ending in text (S4 -> T5); and in block B0 the text ends at a 1 MiB piece boundary of
    # the uncopied region's candidates (B0 -> T4: text, whichever path reads it)
    # S5 = [2 and "vers", "ion\0" + high bytes] -> T6: a string starting mid-word is text too;
    # S6 = [2 and "\0ers", the same tail] -> T7: 3 printable high bytes: a reference;
    # S7 = [text, "H\0" + high bytes] -> T8: 8-aligned (an object's address): a reference
    big, t = 2 << 20, 256 << 10
    h = Heap([big, t, 32, t, 32, t, 32, t, 32, 32, t, 32, t, 32, t, 32, t],
             base=UNCOPIED_BASE, gap=8)
    B0, T1, S0, T2, S1, T3, S2, T4, S3, S4, T5, S5, T6, S6, T7, S7, T8 = range(17)
    h.point(S7, 0, TEXT)
    h.point(S7, 1, _tail_into(h, T8) - ord("E") + ord("H"))
    h.point(S5, 0, 2 | int.from_bytes(b"vers", "little") << 32)
    h.point(S5, 1, _tail_into(h, T6))
    h.point(S6, 0, 2 | int.from_bytes(b"\0ers", "little") << 32)
    h.point(S6, 1, _tail_into(h, T7))
    h.point(S0, 0, TEXT)
    h.point(S0, 1, _tail_into(h, T1))
    h.point(S1, 0, 0x1234)
    h.point(S1, 1, _tail_into(h, T2))
    h.point(S2, 0, TEXT)
    h.point(S2, 1, (h.addrs[T3] + 0xffff) & ~0xffff)
    boundary = (1 << 20) - (h.addrs[B0] - h.base)        # B0's offset of the piece boundary
    h.point(B0, boundary // 8 - 1, TEXT)
    h.point(B0, boundary // 8, _tail_into(h, T4))
    h.point(S3, 3, TEXT)
    h.point(S4, 0, _tail_into(h, T5))
    roots = [(ROOT, words_buffer(*(h.addrs[i] for i in (B0, S0, S1, S2, S3, S4, S5, S6, S7))))]
    for res in all_ways(h, roots):
        assert list(res.marked) == [1, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1]
    # the fold: a leaked block's text tail is no edge either (S0 and T1 stay two leaks)
    from memunreachable.sweep.folding import fold
    by = {f.index: f for f in fold(h.image(), bytearray(17))}
    assert T1 in by and by[S0].referenced_count == 0


def test_a_text_tail_into_the_block_after_a_pointers_target_is_no_reference():
    # S = [-> A, text, "E\0" + an old pointer's high bytes into T]: A and T are neighbours
    # (allocations i and i + 1, whose marks the candidates mark share a word of), but the tail
    # is text: T stays unreachable on every path
    t = 256 << 10
    h = Heap([32, 32, t] + [32] * 8, base=UNCOPIED_BASE, gap=8)
    S, A, T = range(3)
    h.link(S, 0, A)
    h.point(S, 1, TEXT)
    h.point(S, 2, _tail_into(h, T))
    for res in all_ways(h, [(ROOT, words_buffer(h.addrs[S]))]):
        assert list(res.marked) == [1, 1] + [0] * 9


def test_an_8_aligned_text_tail_after_two_words_of_text_is_no_reference_on_every_mark_path():
    # glibc's setenv keeps every string it was given: "PYTEST_CURRENT_TEST=test_orphan.py::
    # test_c_orphans (setup)" ends in the word "p)", a NUL and an old pointer's high bytes, an
    # 8-aligned address inside a leaked 34 MB block (every run of the suite, untracked).
    # S0 = [text, text, "p)\0" + high bytes] -> T0: text; twins that are references: one word
    # of text before it (S1 -> T1), a pointer then text before it (S2 -> T2: a dict entry's
    # value, hash, key), 8 printable bytes but for one (S3 -> T3); and in B0 the tail is the
    # second word of a 1 MiB piece of the uncopied region's candidates (B0 -> T4: text)
    big, t = 2 << 20, 256 << 10
    h = Heap([big, t, 48, t, 48, t, 48, t, 48, t], base=UNCOPIED_BASE, gap=8)
    B0, T4, S0, T0, S1, T1, S2, T2, S3, T3 = range(10)

    def tail_into(j):
        v = ((h.addrs[j] + 0xffff) & ~0xffff) + int.from_bytes(b"p)", "little")
        assert h.addrs[j] <= v < h.addrs[j] + h.sizes[j] and v % 8 == 0
        return v
    for k, w in enumerate([TEXT, TEXT, tail_into(T0)]):
        h.point(S0, k, w)
    for k, w in enumerate([0x1234, TEXT, tail_into(T1)]):
        h.point(S1, k, w)
    for k, w in enumerate([h.addrs[S2], TEXT, tail_into(T2)]):
        h.point(S2, k, w)
    for k, w in enumerate([TEXT, TEXT - ord("A") + 0x80, tail_into(T3)]):  # "\x80ES-128-"
        h.point(S3, k, w)
    boundary = (1 << 20) - (h.addrs[B0] - h.base)        # B0's offset of the piece boundary
    h.point(B0, boundary // 8 - 1, TEXT)
    h.point(B0, boundary // 8, TEXT)
    h.point(B0, boundary // 8 + 1, tail_into(T4))
    roots = [(ROOT, words_buffer(*(h.addrs[i] for i in (B0, S0, S1, S2, S3))))]
    for res in all_ways(h, roots):
        assert list(res.marked) == [1, 0, 1, 0, 1, 1, 1, 1, 1, 1]
    from memunreachable.sweep.folding import fold
    by = {f.index: f for f in fold(h.image(), bytearray(10))}
    assert T0 in by and by[S0].referenced_count == 0 and by[S1].referenced_count == 1


# ---- issue 25: the low-memory mark copies the rest when its waves get small (mu_mark_policy) --
# A linked list gives one block per wave: read on demand it costs a wave and a pread per node.
# Each wave and read is charged (mark.MARK_WAVE_COST, MARK_READ_COST); once the charges reach
# the bytes a copy reads (the pieces whose candidates were not kept), the pieces still holding
# blocks to scan are copied and the rest of the mark scans them there. Every way gives the
# same marked set and statistics as the mark over a copy.
from memunreachable.sweep.mark import MARK_READ_COST, MARK_WAVE_COST, mark_policy


def deep_list(n, size=104):
    """   root -> B[n-1] -> B[n-2] -> ... -> B[0]       (each also -> the block after it)
    plus one leak L (pointed at by nothing) in the middle of the heap."""
    h = Heap([size] * n, base=UNCOPIED_BASE)
    for i in range(1, n):
        h.link(i, 0, i - 1)
        if i + 1 < n:
            h.link(i, 1, i + 1)
    leak = n // 2
    h.link(leak + 1, 0, leak - 1)               # the list skips L
    h.point(leak - 1, 1, 0)
    return h, [(ROOT, words_buffer(h.addrs[n - 1]))], leak


def every_method(h, roots, cands=None):
    fd = memfd_of(h.base, h.buf)
    try:
        img = h.image()
        lazy = HeapImage(img.begins, img.sizes, [(h.base, Uncopied(len(h.buf), fd, cands))])
        return mark(img, roots), {m: mark(lazy, roots, method=m) for m in
                                  ("on-demand", "auto", "copy")}
    finally:
        os.close(fd)


def test_a_deep_list_read_on_demand_copies_the_rest_and_marks_exactly():
    n = 20_000                                  # 2.3 MiB: three pieces
    h, roots, leak = deep_list(n)
    copied, by = every_method(h, roots)
    assert copied.num_marked == n - 1 and copied.marked[leak] == 0
    for res in by.values():
        assert stats(res) == stats(copied)
    old, auto, first = by["on-demand"], by["auto"], by["copy"]
    # on demand: a wave and a read per node
    assert old.switch_wave == 0 and old.waves >= n - 2 and old.reads >= n - 2
    # auto: the charges reached the copy's bytes (the whole region: no candidates), then no read
    assert auto.copy_budget == len(h.buf)
    # after the switch a wave per piece the list enters (three)
    assert 0 < auto.switch_wave < 100 and auto.waves <= auto.switch_wave + 3
    assert auto.overhead >= auto.copy_budget
    assert auto.overhead - MARK_WAVE_COST - MARK_READ_COST * auto.reads < auto.copy_budget
    assert auto.copied_bytes <= len(h.buf)
    assert first.switch_wave == 1 and first.reads == 0 and first.waves <= 3
    assert auto.method(True)[0] == "on-demand, then copy"
    assert old.method(True) == ("on-demand", "MEMUNREACHABLE_MARK=on-demand: "
                                f"{old.waves} waves, {old.reads} reads (2.1 MiB): overhead "
                                "0.0 MiB charged, below the 2.4 MiB a copy reads")
    assert first.method(True) == ("on-demand, then copy",
                                  "MEMUNREACHABLE_MARK=copy: 2.4 MiB copied")
    assert copied.method(False)[0] == "copy"


def test_kept_candidates_are_not_copied():
    # the first piece keeps its candidates: the copy reads the other pieces only
    h, roots, leak = deep_list(30_000)           # 3.4 MiB: four pieces
    c = cands_of(h.base, h.buf, h.base, h.base + len(h.buf), 2 * 10_100)
    pieces = ffi.new("uint64_t *")
    lib.mu_cands_words(c, pieces)
    assert pieces[0] == 1
    copied, by = every_method(h, roots, c)
    for res in by.values():
        assert stats(res) == stats(copied)
    auto = by["auto"]
    assert auto.copy_budget == len(h.buf) - (1 << 20)
    assert auto.switch_wave and auto.copied_bytes <= auto.copy_budget
    assert by["copy"].copied_bytes == len(h.buf) - (1 << 20)


def test_a_mark_from_every_candidate_reads_nothing_and_says_so():
    # every piece keeps its candidates: no wave, no read, and the stats name the candidates
    h, roots, leak = deep_list(30_000)
    c = cands_of(h.base, h.buf, h.base, h.base + len(h.buf), 1 << 30)
    pieces = ffi.new("uint64_t *")
    lib.mu_cands_words(c, pieces)
    assert pieces[0] == 4
    copied, by = every_method(h, roots, c)
    for res in by.values():
        assert stats(res) == stats(copied)
        assert (res.waves, res.reads, res.copied_bytes) == (0, 0, 0)
    assert by["auto"].method(True) == (
        "candidates", "every block reached was scanned from the walk's kept candidates: "
        "nothing read")


def test_a_shallow_tree_stays_on_demand():
    # a balanced binary tree in breadth-first order (each level contiguous): 15 waves of few
    # reads, charged far below the copy's 6 MiB
    n = (1 << 15) - 1
    h = Heap([184] * n, base=UNCOPIED_BASE)
    for i in range(n // 2):
        h.link(i, 0, 2 * i + 1)
        h.link(i, 1, 2 * i + 2)
    roots = [(ROOT, words_buffer(h.addrs[0]))]
    copied, by = every_method(h, roots)
    assert copied.num_marked == n
    for res in by.values():
        assert stats(res) == stats(copied)
    auto = by["auto"]
    assert auto.switch_wave == 0 and auto.copied_bytes == 0 and 10 <= auto.waves <= 16
    assert auto.overhead < auto.copy_budget == len(h.buf)
    assert auto.method(True)[0] == "on-demand"


def test_mark_policy_by_name_and_environment(monkeypatch):
    assert mark_policy("auto") == ("auto", MARK_WAVE_COST, MARK_READ_COST)
    assert mark_policy("on-demand") == ("on-demand", 0, 0)
    assert mark_policy("copy")[1] == 2**64 - 1
    monkeypatch.setenv("MEMUNREACHABLE_MARK", "on-demand")
    assert mark_policy() == ("on-demand", 0, 0)
    monkeypatch.delenv("MEMUNREACHABLE_MARK")
    assert mark_policy() == mark_policy("auto")
    with pytest.raises(ValueError, match="MEMUNREACHABLE_MARK"):
        mark_policy("lazy")


# 4 bytes of a count, a flag or a short string beside 4 bytes that kept an old pointer's high
# half read as an address just past a 4 GiB boundary. A block spanning that boundary (a 34 MB
# mmapped chunk next to the libraries) was kept in about 1 run in 40 by such words in an
# in-process check's frames (0x7fa900000000, ...01, ...02) and in a ctypes type's last word
# ("FIX\0" beside 0x7f37: MEMUNREACHABLE_EXPLAIN). Such a word less than 8 MiB past the
# boundary keeps no block that began below it (mu_types.h MU_PAIR_LOW_MAX); the block's start,
# a word before the boundary, a word 8 MiB or more past it, and any word into a block that
# begins at the boundary still do.
SPAN = 0x7FA9_0000_0000


@pytest.mark.parametrize("value, kept", [
    (SPAN | 0x0000_0000, False), (SPAN | 0x0000_0002, False), (SPAN | 0x0000_FFF8, False),
    (SPAN | 0x0058_4946, False), (SPAN | 0x007F_FFF8, False),
    (SPAN - 0x1000, True), (SPAN - 8, True), (SPAN | 0x0080_0000, True),
    (SPAN | 0x0080_0008, True)])
def test_an_int32_pair_past_a_4_gib_boundary_keeps_no_block_that_spans_it(value, kept):
    h = Heap([0x900000], base=SPAN - 0x1000)        # [SPAN - 4 KiB, SPAN + 9 MiB - 4 KiB)
    res = mark(h.image(), [(ROOT, words_buffer(value))])
    assert list(res.marked) == [int(kept)]


@pytest.mark.parametrize("value, kept", [
    (SPAN, True), (SPAN | 0x10, True), (SPAN | 0xFE8, True),     # its first 4 KiB: headers
    (SPAN | 0xFF0, False), (SPAN | 0x2000, False)])
def test_words_near_the_start_of_a_block_spanning_a_4_gib_boundary_stay_references(value, kept):
    # a glibc block that began 16 bytes below the boundary held a CPython GC object right at
    # it (the debug hooks' 16-byte prefix): the GC list's link to it is the boundary itself,
    # and the GC walk lost that node while the pair rule took it (s39ci6)
    h = Heap([0x10000], base=SPAN - 0x10)
    res = mark(h.image(), [(ROOT, words_buffer(value))])
    assert list(res.marked) == [int(kept)]


@pytest.mark.parametrize("value", [SPAN, SPAN | 0x8, SPAN | 0x0058_4946])
def test_a_block_that_begins_at_a_4_gib_boundary_is_kept_by_any_word_into_it(value):
    h = Heap([0x600000], base=SPAN)
    res = mark(h.image(), [(ROOT, words_buffer(value))])
    assert list(res.marked) == [1]


def test_a_low_heap_s_pointers_that_read_as_text_stay_references():
    # under a non-PIE interpreter the heap lies below 4 GiB: a pointer is 4 bytes, then zeros,
    # and in 1 of 50 those 4 are printable ("PL7+": 0x2b374c50). Only a word with old bytes after
    # its NUL is text (mu_old_bytes_after_nul): the stale-parts tests of sid's 3.13-3.15 lost
    # 24-byte blocks to the aligned tail rule without it
    low = Heap([0x10000], base=0x2B37_0000)
    h = Heap([48], base=ROOT + 0x10000)
    for k, w in enumerate([TEXT, TEXT, 0x2B37_4C50]):      # after two words of text
        h.point(0, k, w)
    image = HeapImage(array("Q", low.addrs + h.addrs), array("Q", low.sizes + h.sizes),
                      [(low.base, low.buf), (h.base, h.buf)])
    res = mark(image, [(ROOT, words_buffer(h.addrs[0]))])
    assert list(res.marked) == [1, 1]


def test_kept_candidates_repeating_values_mark_as_over_a_copy():
    # the mark looks a piece's kept candidates up at once, a value met before in the piece
    # once (a repeat of one still in the batch waits for its lookup): blocks whose words
    # repeat a few targets many times, in one batch and across batches, and values in the
    # gaps between blocks (no hit), on a chain through every block; 300,000 blocks: parallel
    rnd = random.Random(7)
    n = 300_000
    h = Heap([48] * n, base=UNCOPIED_BASE, gap=16)
    hubs = [rnd.randrange(n) for _ in range(5)]
    for i in range(n):
        if i + 1 < n:
            h.link(i, 0, i + 1, delta=8 * rnd.randrange(6))
        for slot in range(1, 6):
            if rnd.random() < 0.6:
                h.link(i, slot, hubs[(i + slot) % len(hubs)])
            else:
                h.link(i, slot, rnd.randrange(n), delta=56)     # a gap: no block there
    roots = [(ROOT, words_buffer(h.addrs[n // 2]))]
    copied, waves, kept = all_ways(h, roots)
    assert stats(kept) == stats(copied) and stats(waves) == stats(copied)
    assert copied.num_marked == n - min(hubs + [n // 2])     # the chain on from each hub


@pytest.mark.parametrize("n_arrays", [40, 4000])     # 4000 x 65 blocks: parallel
def test_kept_candidates_of_arrays_of_neighbours_mark_as_over_a_copy(n_arrays):
    # a piece's candidates are first searched among the neighbours of the last block hit
    # (an array's pointers to the nodes allocated after it, a list's to the block before),
    # and two threads mark up to 8 neighbours with one atomic OR: arrays of 64 pointers to
    # the 64 nodes after them (interior offsets), mixed with pointers into the gaps after
    # nodes (no block), to the first and last blocks (the ends of the neighbour window), to
    # far blocks, and lists through the nodes (each node -> the node before); every array is
    # a root but every 3rd, so some nodes are reached only from a neighbour's list
    rnd = random.Random(n_arrays)
    per = 64
    sizes = []
    for _ in range(n_arrays):
        sizes += [8 * per] + [24 + 8 * rnd.randrange(3) for _ in range(per)]
    h = Heap(sizes, base=UNCOPIED_BASE, gap=16)
    n = len(sizes)
    arrays = list(range(0, n, per + 1))
    for a in arrays:
        for k in range(per):
            node = a + 1 + k
            pick = rnd.random()
            if pick < 0.7:
                h.link(a, k, node, delta=8 * rnd.randrange(3))
            elif pick < 0.8:
                h.link(a, k, node, delta=(h.sizes[node] + 15) // 16 * 16 + 8)   # in the gap
            elif pick < 0.85:
                h.link(a, k, rnd.choice([0, n - 1]))
            elif pick < 0.9:
                h.link(a, k, rnd.randrange(n))
            if k and rnd.random() < 0.3:
                h.link(node, 1, node - 1)
    roots = [(ROOT, words_buffer(*(h.addrs[a] for i, a in enumerate(arrays) if i % 3)))]
    copied, waves, kept = all_ways(h, roots)
    assert 0 < copied.num_marked < n
    assert stats(kept) == stats(copied) and stats(waves) == stats(copied)


def test_an_index_of_a_million_blocks_in_two_regions_is_built_on_two_threads():
    # 1,100,000 blocks (an index of 2^20 or more in several regions is built by two threads,
    # the second taking the regions from the middle block on): 600,001 and 499,999 blocks, so
    # that the leaf bits of one 64-bit word come from both threads. Every 8th block holds the
    # next such block and the block after it: those are reached, the other blocks never; the
    # blocks after them have no candidate (leaves, marked without a scan). Copied, or uncopied
    # with kept candidates: the same marks, words, bytes and sizes' sum.
    counts = (600_001, 499_999)
    heaps = [Heap([16] * c, base=UNCOPIED_BASE + (k << 28), gap=16) for k, c in enumerate(counts)]
    for h in heaps:
        words = memoryview(h.buf).cast("Q")
        arrays = range(0, len(h.addrs) - 8, 8)
        words[0:32 * len(arrays):32] = array("Q", (h.addrs[i + 8] for i in arrays))
        words[1:32 * len(arrays):32] = array("Q", (h.addrs[i + 1] for i in arrays))
        del words
    begins = array("Q", heaps[0].addrs + heaps[1].addrs)
    sizes = array("Q", heaps[0].sizes + heaps[1].sizes)
    roots = [(ROOT, words_buffer(heaps[0].addrs[0], heaps[1].addrs[0]))]
    copied = mark(HeapImage(begins, sizes, [(h.base, h.buf) for h in heaps]), roots)
    reached = sum(2 * len(range(0, c - 8, 8)) + 1 for c in counts)   # + each last array
    assert copied.num_marked == reached and copied.size_total == 16 * sum(counts)
    fd = os.memfd_create("heap")
    try:
        regions = []
        for h in heaps:
            os.pwrite(fd, bytes(h.buf), h.base)
            c = cands_of(h.base, h.buf, heaps[0].base, heaps[1].base + len(heaps[1].buf), 1 << 30)
            regions.append((h.base, Uncopied(len(h.buf), fd, c)))
        kept = mark(HeapImage(begins, sizes, regions), roots)
    finally:
        os.close(fd)
    assert stats(kept) == stats(copied) and kept.size_total == copied.size_total
    # an overlap in the second thread's regions: the index refuses the allocations
    bad = array("Q", begins)
    bad[-5] = bad[-6] + 8
    with pytest.raises(OSError) as e:
        mark(HeapImage(bad, sizes, [(h.base, h.buf) for h in heaps]), roots)
    assert e.value.errno == errno.EINVAL
