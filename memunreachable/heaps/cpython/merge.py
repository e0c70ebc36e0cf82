"""merge.py: Stage 4 (CPython): pymalloc's used blocks merged into glibc's allocations.

    drop_overlapping(cp, image, pool_size) -> (blocks, sizes, heap ranges kept, pools dropped)
                                    pools that overlap a glibc allocation are not pymalloc's
    merge_images(a, b) -> HeapImage  one ascending image of two (regions merged)
    merge_dropping(a, b, drop) -> (HeapImage, dropped)   and without the blocks at `drop`
    drop_blocks(image, addresses) -> (HeapImage, dropped)
The loops over millions of blocks are C (native/mu_cpython.c, mu_pymalloc.c).
"""
from __future__ import annotations

import bisect
import errno
from array import array
from typing import List, Optional, Sequence, Tuple

from memunreachable._ffi import TWO_THREADS_MIN, check, ffi, in_thread, lib, u64_view
from memunreachable._types import (HeapImage, Range, extend_u64, local_buffer, subtract_ranges,
                                   u64_scratch)
from memunreachable.heaps.cpython.walker import CPythonMap


def _nbytes(buf) -> int:
    return memoryview(buf).nbytes


# Returns (blocks, sizes, heap ranges kept, pools dropped): cp's pymalloc blocks minus every
# pool that overlaps a glibc allocation (a pool header look-alike inside malloc's memory).
# The pools are tested in one native pass (mu_pools_overlapping).
def drop_overlapping(cp: CPythonMap, image: HeapImage, pool_size: int):
    bad = _overlapping_pools(cp.blocks, pool_size, image.begins, image.sizes)
    if not bad:
        return cp.blocks, cp.sizes, cp.heap_ranges, 0
    blocks, sizes = array("Q"), array("Q")
    lo = 0
    for p in bad:                       # keep the runs of blocks between the bad pools
        cut, hi = _slice(cp.blocks, p, p + pool_size)
        extend_u64(blocks, cp.blocks[lo:cut])
        extend_u64(sizes, cp.sizes[lo:cut])
        lo = hi
    extend_u64(blocks, cp.blocks[lo:])
    extend_u64(sizes, cp.sizes[lo:])
    holes = [Range(p, p + pool_size) for p in bad]
    return blocks, sizes, subtract_ranges(cp.heap_ranges, holes), len(bad)


def _overlapping_pools(blocks, pool_size: int, gbegins, gsizes) -> List[int]:
    """Ascending addresses of the pools of `blocks` a glibc allocation overlaps."""
    if not len(blocks) or not len(gbegins):
        return []
    b, kb = u64_view(blocks)
    gb, kg = u64_view(gbegins)
    gs, ks = u64_view(gsizes)
    cap = 64
    while True:
        out = array("Q", bytes(8 * cap))
        n = check(lib.mu_pools_overlapping(b, len(blocks), pool_size, gb, gs, len(gbegins),
                                           ffi.from_buffer("uint64_t[]", out), cap),
                  "find pools overlapping allocations")
        if n <= cap:
            break
        cap = n
    del kb, kg, ks
    return list(out[:n])


def _slice(begins, lo_addr: int, hi_addr: int) -> Tuple[int, int]:
    return bisect.bisect_left(begins, lo_addr), bisect.bisect_left(begins, hi_addr)


# Returns the union of two HeapImages whose allocations do not overlap (ValueError otherwise):
# allocations ascending; regions sorted and disjoint. Overlapping regions (copies of the same
# snapshot memory, e.g. glibc's copy of an anonymous mapping the kernel merged with a
# pymalloc arena) become the one that covers them all, or consecutive parts of them (views,
# no copy), or, when an allocation would cross from one part into the next, one new copy of
# their union. Only allocations inside a region are kept.
def merge_images(a: HeapImage, b: HeapImage) -> HeapImage:
    return merge_dropping(a, b, ())[0]


# Returns (merge_images(a, b) without the allocations that begin at one of `drop`, how many of
# `drop` matched one). The allocations are merged, checked and dropped in one native pass
# (mu_merge_blocks) into arrays sized once: a pytest process's 130k blocks took 2.5 ms of
# array slicing and copying in Python. a and b are not modified, unless room is given:
# (begins, sizes) 'Q' views whose first entries are b's arrays themselves (pymalloc's reserved
# outputs), with room for a's too. Then b moves up by len(a) there and the merge writes in
# front of it, b's arrays are overwritten, and the result is views of room: no fresh output
# (faulting in and zeroing 2 x 12 M entries was most of a 1 GiB Python heap's 0.12 s merge).
def merge_dropping(a: HeapImage, b: HeapImage, drop: Sequence[int],
                   room: Optional[Tuple[object, object]] = None) -> Tuple[HeapImage, int]:
    if not len(b.begins) and not len(drop):
        return a, 0
    flat = None                         # every allocation kept (one image alone)
    cuts: List[int] = []
    if not len(b.begins):
        regions = a.regions
    elif not len(a.begins) and not a.regions:
        regions = sorted(b.regions, key=lambda r: r[0])
    else:
        regions, spans, cuts = _merge_regions(a.regions + b.regions)
        flat = array("Q", [x for s in spans for x in s])
    dropped = array("Q", sorted(drop))
    na, nb = len(a.begins), len(b.begins)
    total = na + nb
    ab, k1 = u64_view(a.begins)
    asz, k2 = u64_view(a.sizes)
    bb, k3 = u64_view(b.begins)
    bsz, k4 = u64_view(b.sizes)
    if room is not None and _starts(room, bb, bsz, total):
        begins, sizes = room
        ob, osz = ffi.from_buffer("uint64_t[]", begins), ffi.from_buffer("uint64_t[]", sizes)
        # never read below what the merge wrote; the two moves on two threads (a move runs at
        # one thread's memory bandwidth here)
        moves = [(ffi.cast("uint8_t *", o), 8 * na, 0, 8 * nb) for o in (osz, ob)]
        other = in_thread(lib.mu_move, *moves[0]) if nb >= TWO_THREADS_MIN else None
        check(lib.mu_move(*moves[1]), "merge allocations")
        check(other() if other else lib.mu_move(*moves[0]), "merge allocations")
        bb, bsz = ob + na, osz + na
    else:
        begins, sizes = u64_scratch(total), u64_scratch(total)
        ob, osz = ffi.from_buffer("uint64_t[]", begins), ffi.from_buffer("uint64_t[]", sizes)
    st = ffi.new("mu_merge_stats *")
    n = lib.mu_merge_blocks(ab, asz, na, bb, bsz, nb,
                            ffi.NULL if flat is None else ffi.from_buffer("uint64_t[]", flat),
                            0 if flat is None else len(flat) // 2,
                            ffi.from_buffer("uint64_t[]", dropped), len(dropped),
                            ob, osz, total, st)
    del k1, k2, k3, k4, ob, osz
    if n == -errno.ERANGE:
        raise ValueError(f"allocations overlap at {st.overlap_at:#x}")
    check(n, "merge allocations")
    if any(_crosses(begins, sizes, n, c) for c in cuts):
        regions = _merge_regions(a.regions + b.regions, union=True)[0]
    return HeapImage(begins[:n], sizes[:n], regions), st.removed


def _crosses(begins, sizes, n: int, cut: int) -> bool:
    """Whether one of the first n allocations begins below cut and ends past it."""
    k = bisect.bisect_left(begins, cut, 0, n) - 1
    return k >= 0 and begins[k] + max(sizes[k], 1) > cut


def _starts(room, bb, bsz, total: int) -> bool:
    """Whether room's views begin where b's arrays (bb, bsz) do and hold total entries."""
    begins, sizes = room
    return (len(begins) >= total and len(sizes) >= total
            and ffi.cast("uintptr_t", ffi.from_buffer("uint64_t[]", begins))
            == ffi.cast("uintptr_t", bb)
            and ffi.cast("uintptr_t", ffi.from_buffer("uint64_t[]", sizes))
            == ffi.cast("uintptr_t", bsz))


def _merge_regions(pairs, union: bool = False) -> Tuple[list, List[Tuple[int, int]], List[int]]:
    """(regions sorted and disjoint, the (lo, hi) spans of the groups of overlapping copies,
    the addresses where a group was cut): a group becomes the copy that covers it all, else
    consecutive parts of its copies, each byte from the first copy (by address) that holds it
    (views: 17 MB copied again at 1 M Python objects, 50 MB at 1 GiB, before), or with union
    one new copy of them all. The copies hold the same snapshot's bytes."""
    spans = sorted([(base, base + _nbytes(buf), buf) for base, buf in pairs],
                   key=lambda t: (t[0], -t[1]))
    groups = []
    for lo, hi, buf in spans:
        if groups and lo < groups[-1][1]:
            g = groups[-1]
            g[1] = max(g[1], hi)
            g[2].append((lo, hi, buf))
        else:
            groups.append([lo, hi, [(lo, hi, buf)]])
    regions, cuts = [], []
    for lo, hi, members in groups:
        whole = next((m for m in members if m[0] == lo and m[1] == hi), None)
        if whole is not None:
            regions.append((lo, whole[2]))
        elif union:
            buf = local_buffer(hi - lo)
            view = memoryview(buf)
            for mlo, mhi, mbuf in members:
                view[mlo - lo:mhi - lo] = memoryview(mbuf).cast("B")
            regions.append((lo, buf))
        else:
            at = lo
            for mlo, mhi, mbuf in members:      # each begins below `at` (or at lo)
                if mhi > at:
                    if at > lo:
                        cuts.append(at)
                    regions.append((at, memoryview(mbuf).cast("B")[at - mlo:]))
                    at = mhi
    return regions, [(lo, hi) for lo, hi, _ in groups], cuts


# Returns (image without the allocations that begin at one of `addresses`, how many went).
# image is not modified.
def drop_blocks(image: HeapImage, addresses: Sequence[int]) -> Tuple[HeapImage, int]:
    if not len(addresses) or not len(image.begins):
        return image, 0
    out, n = merge_dropping(image, HeapImage(array("Q"), array("Q"), []), addresses)
    return (out, n) if n else (image, 0)
