"""Stage 6: mark. Conservative reachability from the roots over the snapshot's allocations.

Inputs: a HeapImage (sorted allocation begins and usable sizes, plus local copies of the heap
regions that hold them), root ranges as (address, buffer) pairs scanned in order, and root
words (register values of every thread, fs_base included) scanned as one more range.
Output: MarkResult, with marked[i] == 1 for every allocation reachable from a root.
Rules (libmemunreachable.md section 3): 8-byte words from the range start rounded up to 8,
interior pointers count, one-past-the-end does not, a zero-size block spans 1 byte, iterative
worklist. The hot loop is mu_mark (native/mu_scan.c); this module only packs the arguments.
Pure over plain data: no pid, no ptrace.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence, Tuple

from memunreachable._ffi import check, ffi, lib, region_array, u64_view
from memunreachable._types import HeapImage


@dataclass
class MarkResult:
    """marked[i] == 1 iff allocation i is reachable; the rest are mark statistics."""
    marked: bytearray
    root_bytes: int      # bytes of root ranges scanned
    heap_bytes: int      # bytes of reached allocations scanned
    words: int           # 8-byte words examined (root words included)
    num_marked: int      # allocations reached (== marked.count(1))
    seconds: float       # wall time of the native mark


# Returns MarkResult; raises OSError(EINVAL) for unsorted/overlapping allocations, an
# allocation outside every heap region or overlapping regions, OSError(ENOMEM) when out of memory.
def mark(image: HeapImage, roots: Sequence[Tuple[int, object]], words: Sequence[int] = (),
         glibc_chunks: bool = False) -> MarkResult:
    begins, keep_b = u64_view(image.begins)
    sizes, keep_s = u64_view(image.sizes)
    n = len(begins)
    if len(sizes) != n:
        raise ValueError(f"{n} allocation begins but {len(sizes)} sizes")
    heap, keep_h = region_array(image.regions)
    root_regions, keep_r = region_array(list(roots))
    word_arr, keep_w = u64_view(words)
    marked = bytearray(n)
    marked_c = ffi.from_buffer("uint8_t[]", marked) if n else ffi.NULL
    stats = ffi.new("mu_mark_stats *")
    t0 = time.perf_counter()
    rc = lib.mu_mark(begins, sizes, n, heap, len(image.regions), root_regions, len(roots),
                     word_arr, len(word_arr), marked_c, stats,
                     lib.MU_GLIBC_CHUNKS if glibc_chunks else 0)
    seconds = time.perf_counter() - t0
    check(rc, "mark")
    del keep_b, keep_s, keep_h, keep_r, keep_w
    return MarkResult(marked=marked, root_bytes=stats.root_bytes, heap_bytes=stats.heap_bytes,
                      words=stats.words, num_marked=stats.marked, seconds=seconds)
