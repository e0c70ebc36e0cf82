"""Unit tests of the mark's lookup and scan shortcuts (native/mu_scan.c), on in-memory heaps.

The mark finds a value's heap region through a region map (64 KiB granules by their low bits;
a binary search when two regions share a slot), decides the type rules of a block through a
hash of the types, skips the search of the dead ranges for blocks no range meets, and marks
with plain stores on one thread. Each case compares the marks and every statistic with a plain
model written here (the type rules through mu_scanned_len, whose binary search over the types
is independent of the mark's hash), on one thread and on one thread per CPU (parallel=True).
"""
import bisect
import random
import struct
from array import array

import pytest

from memunreachable._ffi import ffi, lib
from memunreachable._types import HeapImage
from memunreachable.sweep.mark import DeadWords, dead_words, mark

GRANULE = 1 << 16
ALIAS = GRANULE << 13           # two granules this far apart share a slot of the smallest map
ROOT = 0x5555_0000_0000
SLOT_MUL = 0x9E3779B97F4A7C15


def model(begins, sizes, regions, roots, words, dead=None):
    """(marked, heap_bytes, words) of libmemunreachable.md section 3 with mu_dead's rules."""
    n = len(begins)
    ends = [b + max(s, 1) for b, s in zip(begins, sizes)]
    hw = dead.head_word if dead is not None else None
    ranges = list(dead.ranges) if dead is not None else []
    rstarts = [b for b, _ in ranges]
    dc, keep = dead_words(dead, n) if dead is not None else (ffi.NULL, None)
    bases = [b for b, _ in regions]

    def find(v):
        k = bisect.bisect_right(begins, v) - 1
        if k < 0 or v >= ends[k]:
            return None
        if hw is not None and hw[k] and v < begins[k] + 8 * hw[k] + 8:
            return None
        return k

    def is_dead(w, hb):
        j = bisect.bisect_right(rstarts, w) - 1
        return (j >= 0 and w < ranges[j][1]) or (hb is not None and hb <= w < hb + 16)

    def scan(addr, length, buf, off, hb=None):
        """Values of the live words of [addr, addr+length) at buf[off:] (zero-padded)."""
        out = []
        w = (addr + 7) & ~7
        while w < addr + length:
            if not is_dead(w, hb):
                chunk = bytes(buf[off + w - addr:off + w - addr + 8])
                out.append(int.from_bytes(chunk.ljust(8, b"\0"), "little"))
            w += 8
        return out

    marked = bytearray(n)
    heap_bytes = nwords = 0
    work = []

    def reach(values):
        for v in values:
            k = find(v)
            if k is not None and not marked[k]:
                marked[k] = 1
                work.append(k)

    for base, buf in roots:
        vals = scan(base, len(buf), buf, 0)
        nwords += len(vals)
        reach(vals)
    nwords += len(words)
    reach(words)
    while work:
        k = work.pop()
        r = bisect.bisect_right(bases, begins[k]) - 1
        base, buf = regions[r]
        off = begins[k] - base
        view = memoryview(buf)[off:]
        live = lib.mu_scanned_len(dc, ffi.from_buffer("uint8_t[]", view), begins[k], sizes[k],
                                  len(view)) if sizes[k] else 0
        hb = begins[k] + 8 * (hw[k] - 1) if hw is not None and hw[k] else None
        vals = scan(begins[k], live, buf, off, hb)
        heap_bytes += live
        nwords += len(vals)
        reach(vals)
    del keep
    return marked, heap_bytes, nwords


def check_both_ways(begins, sizes, regions, roots, words, dead=None):
    img = HeapImage(array("Q", begins), array("Q", sizes), regions)
    expect, heap_bytes, nwords = model(begins, sizes, regions, roots, words, dead)
    for parallel in (False, True):
        res = mark(img, roots, words, dead=dead, parallel=parallel)
        assert res.marked == expect, parallel
        assert res.num_marked == sum(expect)
        assert res.heap_bytes == heap_bytes
        assert res.words == nwords
        assert res.root_bytes == sum(len(b) for _, b in roots)
    return expect


def region_layout(rnd):
    """Region bases: two regions sharing a 64 KiB granule, one a multiple of ALIAS away from
    the first (the same slot of the region map: the binary search decides), one far away."""
    b0 = 0x7F00_0000_0000 + rnd.randrange(1, 8) * GRANULE - rnd.randrange(1, 8) * 0x1000
    len0 = rnd.randrange(2, 6) * 0x1000 + rnd.randrange(0, 4) * 16
    b1 = b0 + len0                                  # adjacent: its first granule is b0's last
    len1 = rnd.randrange(1, 4) * 0x1000
    b2 = b0 + ALIAS * rnd.randrange(1, 3) + rnd.randrange(0, 4) * 16
    b3 = b0 + (1 << 40)
    return [(b0, len0), (b1, len1), (b2, rnd.randrange(1, 3) * 0x1000),
            (b3, rnd.randrange(1, 3) * 0x1000)]


def random_heap(rnd, layout):
    regions, begins, sizes = [], [], []
    for base, length in layout:
        addr = base + rnd.randrange(0, 3) * 16
        while True:
            size = rnd.choice([0, 8, 24, 40, 56, 72, 100, 200, 600])
            if addr + max(size, 1) + 8 > base + length:
                break
            begins.append(addr)
            sizes.append(size)
            addr += (max(size, 1) + 15) // 16 * 16 + rnd.choice([0, 16, 16, 48])
        regions.append((base, bytearray(length)))
    return regions, begins, sizes


def store(regions, addr, value):
    for base, buf in regions:
        if base <= addr and addr + 8 <= base + len(buf):
            struct.pack_into("<Q", buf, addr - base, value)
            return
    raise AssertionError(hex(addr))


@pytest.mark.parametrize("seed", range(16))
def test_random_heaps_with_dead_words_and_types_match_the_model(seed):
    rnd = random.Random(seed)
    layout = region_layout(rnd)
    regions, begins, sizes = random_heap(rnd, layout)
    n = len(begins)
    # ~60 types (the hash has 256 slots: some share one), each with one object offset and kind
    types = sorted({0x5600_0000_0000 + 8 * rnd.randrange(1 << 20) for _ in range(60)})
    codes = []
    for _ in types:
        off = rnd.choice([0, 16, 32, 48])
        kind = rnd.choice([lib.MU_TYPE_OPAQUE, lib.MU_TYPE_SIZED, lib.MU_TYPE_DEAD_AT_ZERO,
                           lib.MU_TYPE_STR])
        codes.append(off | kind << 8 | (rnd.choice([24, 40, 64]) << 16 if kind == lib.MU_TYPE_SIZED
                                        else 0))

    def candidate():
        k = rnd.randrange(n)
        base, length = layout[rnd.randrange(len(layout))]
        return rnd.choice([
            begins[k], begins[k] + rnd.randrange(max(sizes[k], 1) + 1), begins[k] - 8,
            begins[k] + max(sizes[k], 1) - 8,
            base + rnd.randrange(-GRANULE, length + GRANULE),      # around a region
            base + ALIAS * rnd.randrange(1, 4) + rnd.randrange(length),  # an aliased granule
            rnd.randrange(1 << 64)])

    head_word = bytearray(n)
    for k in range(n):
        b, s = begins[k], sizes[k]
        for w in range(0, s - 7, 8):
            if rnd.random() < 0.25:
                store(regions, b + w, candidate())
        if s >= 32 and rnd.random() < 0.5:          # an object header under a listed type
            t = rnd.randrange(len(types))
            off = codes[t] & 0xff
            if off + 16 <= s:
                store(regions, b + off, rnd.choice([1, 5, 0]))
                store(regions, b + off + 8, types[t])
        if s >= 24 and rnd.random() < 0.3:
            head_word[k] = 1 + rnd.randrange(min(s // 8 - 1, 6))
    ranges = []
    for _ in range(rnd.randrange(0, 30)):
        k = rnd.randrange(n)
        b = (begins[k] + 8 * rnd.randrange(max(sizes[k] // 8, 1))) & ~7
        ranges.append((b, b + 8 * rnd.choice([1, 1, 2, 20])))   # some span several blocks
    roots = []
    for r in range(3):
        buf = bytearray(8 * rnd.randrange(1, 40))
        for off in range(0, len(buf), 8):
            if rnd.random() < 0.5:
                struct.pack_into("<Q", buf, off, candidate())
        roots.append((ROOT + r * 0x1000, buf))
    ranges.append((ROOT + 8, ROOT + 24))                           # dead words in a root too
    merged = []
    for b, e in sorted(ranges):
        if merged and b <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(e, merged[-1][1]))
        else:
            merged.append((b, e))
    dead = DeadWords(ranges=merged, head_word=head_word, types=list(zip(types, codes)),
                     dict_keys=lib.MU_DICT_KEYS_311)
    words = [candidate() for _ in range(4)]
    expect = check_both_ways(begins, sizes, regions, roots, words, dead)
    assert 0 < sum(expect)
    check_both_ways(begins, sizes, regions, roots, words, None)


def test_regions_sharing_a_granule_and_a_map_slot():
    # A | B share the granule at 0x...0000 (B starts mid-granule); C is ALIAS above A (the same
    # slot); the gap before A and the granule ALIAS above B hold values in no region.
    a = 0x7F00_0001_0000 - 0x800
    regions = [(a, bytearray(0x800)), (a + 0x800, bytearray(0x800)), (a + ALIAS, bytearray(0x100))]
    begins = [a + 0x10, a + 0x7f0, a + 0x800, a + 0x900, a + ALIAS + 0x40]
    sizes = [24, 8, 40, 24, 24]
    store(regions, begins[0], begins[2] + 8)        # A -> B (interior)
    store(regions, begins[2], begins[4])            # B -> C (the aliased region)
    store(regions, begins[2] + 8, a - 0x100)        # before A, in A's granule: no region
    store(regions, begins[2] + 16, a + 0x800 + ALIAS + 0x900)   # B's aliased granule: nothing
    store(regions, begins[4], begins[1])            # C -> A's last block
    roots = [(ROOT, struct.pack("<Q", begins[0]))]
    assert list(check_both_ways(begins, sizes, regions, roots, [])) == [1, 1, 1, 0, 1]


def _slot(tp, bits):
    return ((tp * SLOT_MUL) & (2**64 - 1)) >> (64 - bits)


def test_types_sharing_a_hash_slot():
    # Three type addresses on one slot of the 64-slot hash (two types listed): the second
    # listed one is found past the first, and the unlisted one is no type at all.
    first = 0x5600_0000_0000
    same = [t for t in range(first, first + (1 << 20) * 8, 8) if _slot(t, 6) == _slot(first, 6)]
    t1, t2, t3 = same[:3]
    base = 0x7F00_0000_0000
    regions = [(base, bytearray(0x400))]
    begins = [base + 0x10 + 0x40 * k for k in range(6)]
    sizes = [48] * 6
    for k, tp in ((0, t1), (1, t2), (2, t3)):       # blocks 0-2: refcnt 1, a type, a pointer
        store(regions, begins[k], 1)
        store(regions, begins[k] + 8, tp)
        store(regions, begins[k] + 16, begins[k + 3])
    opaque = lib.MU_TYPE_OPAQUE << 8
    dead = DeadWords(types=[(t1, opaque), (t2, opaque)])
    roots = [(ROOT, struct.pack("<3Q", *begins[:3]))]
    marked = check_both_ways(begins, sizes, regions, roots, [], dead)
    assert list(marked) == [1, 1, 1, 0, 0, 1]       # only t3's block is scanned
