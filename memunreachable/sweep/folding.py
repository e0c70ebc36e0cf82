"""Stage 7: fold. Group the unreachable allocations into leak entries.

Input: the HeapImage that was marked and the marked flags (MarkResult.marked; 0 = leak).
Output: one FoldedLeak per head SCC of the leak graph (an SCC no other leak points into), in
address order of its representative, the SCC's lowest-address member. referenced_count /
referenced_size count every other leak reachable from the head SCC, its other members
included; a leak reachable from two heads is counted under both (libmemunreachable.md 5.3,
"[ours]": one entry per head SCC, where upstream emits one per member).
The graph, the iterative Tarjan SCC and the sums run in mu_fold (native/mu_fold.c).
Pure over plain data: no pid, no ptrace.
"""
from __future__ import annotations

from typing import List, Tuple

from memunreachable._ffi import check, ffi, lib, region_array, u64_view
from memunreachable._types import FrozenFields, HeapImage, set_fields
from memunreachable.sweep.mark import dead_words


# output arrays are written by mu_fold up to its return value: no need to zero them first
_new_uncleared = ffi.new_allocator(should_clear_after_alloc=False)


class FoldedLeak(FrozenFields):
    """A head SCC: index of its lowest-address member, what it references beyond it, and
    `blocks`: the indices of the other unreachable allocations this entry lists (its indirect
    leaks, ascending): those it reaches that no entry before it (by index) reaches. Every
    unreachable allocation is the index or in the blocks of exactly one entry, so entries
    add up to the leak totals; referenced_* count a shared one under each head that reaches it."""
    __slots__ = ("index", "referenced_count", "referenced_size", "blocks")

    def __init__(self, index: int, referenced_count: int, referenced_size: int,
                 blocks: Tuple[int, ...] = ()):
        set_fields(self, index, referenced_count, referenced_size, tuple(blocks))


# Returns the entries ordered by index; raises OSError(EINVAL) on invalid input (as mark),
# OSError(ENOMEM) when out of memory. `marked` is a bytes-like of length n, or a MarkResult;
# dead: DeadWords (mark.py) whose words are not edges, or None.
def fold(image: HeapImage, marked, dead=None) -> List[FoldedLeak]:
    marked = getattr(marked, "marked", marked)
    begins, keep_b = u64_view(image.begins)
    sizes, keep_s = u64_view(image.sizes)
    n = len(begins)
    if len(sizes) != n or len(marked) != n:
        raise ValueError(f"{n} allocation begins, {len(sizes)} sizes, {len(marked)} marked flags")
    # read only here: the caller's bytes as they are (a copy was 48 MB for 48 M blocks)
    flags = marked if isinstance(marked, (bytes, bytearray)) else bytes(marked)
    cap = flags.count(0)
    heap, keep_h = region_array(image.regions)
    rep = _new_uncleared("uint64_t[]", max(cap, 1))
    ref_count = _new_uncleared("uint64_t[]", max(cap, 1))
    ref_size = _new_uncleared("uint64_t[]", max(cap, 1))
    flags_c = ffi.from_buffer("uint8_t[]", flags) if n else ffi.NULL
    dead_c, keep_d = dead_words(dead, n)
    owner = _new_uncleared("uint64_t[]", max(n, 1))
    rc = lib.mu_fold(begins, sizes, n, heap, len(image.regions), flags_c,
                     rep, ref_count, ref_size, cap, dead_c, owner)
    check(rc, "fold")
    del keep_b, keep_s, keep_h, keep_d
    reps = ffi.unpack(rep, rc)
    counts = ffi.unpack(ref_count, rc)
    rsizes = ffi.unpack(ref_size, rc)
    blocks: List[List[int]] = [[] for _ in range(rc)]
    i = flags.find(0)
    while i >= 0:
        k = owner[i]
        if reps[k] != i:
            blocks[k].append(i)
        i = flags.find(0, i + 1)
    return [FoldedLeak(i, c, s, b) for i, c, s, b in zip(reps, counts, rsizes, blocks)]


# Returns (number of flagged allocations, their bytes) for sizes (array('Q')) and mask (n
# bytes, non-zero: flagged; with zero, the zero ones are: the mark's flags, unmarked), in one
# C pass that reads sizes only where flagged.
def flagged_sizes(sizes, mask, zero: bool = False) -> Tuple[int, int]:
    view, keep = u64_view(sizes)
    selected = ffi.new("uint64_t *")
    n = check(lib.mu_sum_sizes(view, ffi.from_buffer("uint8_t[]", mask) if len(mask) else ffi.NULL,
                               len(mask), int(zero), selected), "sum sizes")
    del keep
    return n, selected[0]
