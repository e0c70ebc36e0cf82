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

import bisect
import struct
import dataclasses
import errno
import os
import time
from array import array
from dataclasses import dataclass
from itertools import chain
from typing import Optional, Sequence, Tuple
from collections.abc import Sequence as _SequenceABC

from memunreachable._errors import MemoryUnreadable
from memunreachable._ffi import check, ffi, lib, region_array, u64_view
from memunreachable._types import HeapImage, u64_scratch


@dataclass
class MarkResult:
    """marked[i] == 1 iff allocation i is reachable; the rest are mark statistics."""
    marked: bytearray
    root_bytes: int      # bytes of root ranges scanned
    heap_bytes: int      # bytes of reached allocations scanned
    words: int           # 8-byte words examined (root words included)
    num_marked: int      # allocations reached (== marked.count(1))
    seconds: float       # wall time of the native mark
    stale: int = 0       # references to fresh allocations from unwritten memory ignored
    # the low-memory mark (uncopied regions; native mu_mark_stats): waves run, reads of blocks
    # on demand and their bytes, the bytes a copy would read, the waves' and reads' charged
    # cost, the wave at which it copied the rest (0: never) and the bytes copied then
    waves: int = 0
    reads: int = 0
    read_bytes: int = 0
    copy_budget: int = 0
    overhead: int = 0
    switch_wave: int = 0
    copied_bytes: int = 0
    policy: str = "auto"     # the MARK_METHODS entry it ran with
    size_total: int = 0      # the sum of the image's sizes (every allocation, reached or not)

    def method(self, uncopied: bool) -> Tuple[str, str]:
        """(mark_method, mark_switch_reason) for the sweep's stats: "copy" (the heap was
        copied by the walk), "candidates" (no block read: each one reached was scanned from
        the walk's kept candidates), "on-demand" (blocks read as reached), "on-demand, then
        copy"."""
        mib = 1 << 20
        if not uncopied:
            return "copy", "the walk kept copies of the heaps"
        if not self.waves:
            return ("candidates", "every block reached was scanned from the walk's kept "
                    "candidates: nothing read")
        forced = f"MEMUNREACHABLE_MARK={self.policy}: " if self.policy != "auto" else ""
        if self.switch_wave and forced:
            return "on-demand, then copy", f"{forced}{self.copied_bytes / mib:.1f} MiB copied"
        if self.switch_wave:
            return ("on-demand, then copy",
                    f"before wave {self.switch_wave} ({self.reads} reads so far) the waves' "
                    f"overhead ({self.overhead / mib:.1f} MiB charged) reached the "
                    f"{self.copy_budget / mib:.1f} MiB a copy reads: "
                    f"{self.copied_bytes / mib:.1f} MiB copied")
        return ("on-demand",
                f"{forced}{self.waves} waves, {self.reads} reads ({self.read_bytes / mib:.1f} MiB): "
                f"overhead {self.overhead / mib:.1f} MiB charged, below the "
                f"{self.copy_budget / mib:.1f} MiB a copy reads")


@dataclass
class DeadWords:
    """Words that are not references (native/mu_scan.h mu_dead): ranges, sorted disjoint
    8-aligned (begin, end) pairs anywhere (roots or allocations); head_word, None or n bytes:
    head_word[i] = 1 + word offset of a PyGC_Head (two link words) in allocation i, 0: none."""
    ranges: Sequence[Tuple[int, int]] = ()
    head_word: object = None
    types: Sequence[Tuple[int, int]] = ()    # (type address, object offset), ascending: an
    #   allocation with 0 at that offset followed by that type holds a dead object (unscanned)
    dict_keys: int = 0                       # MU_DICT_KEYS_*: dict key tables scanned to their end
    debug_hooks: bool = False                # CPython's debug hooks: blocks scanned in their
    #   requested bytes only (native mu_dead debug_hooks)
    # the fresh rule (written.py; native mu_dead): over earlier snapshots numbered 1 (oldest)
    # up, fresh[i] (n bytes) is the latest one in which no allocation began at allocation i's
    # address, 0 none; unwritten: sorted disjoint (begin, end, level) triples, memory not
    # written since snapshot `level`. A word there is no reference to i when level <= fresh[i]
    fresh: object = None
    unwritten: Sequence[Tuple[int, int, int]] = ()
    # live_end, None or 4 * n bytes (uint32): live_end[i] - 1 bytes from allocation i's start
    # can hold references, 0 none (a list's item array: its used slots; native mu_dead)
    live_end: object = None

    def __bool__(self) -> bool:
        return (bool(self.ranges) or self.head_word is not None or bool(self.types)
                or bool(self.dict_keys) or self.debug_hooks or self.live_end is not None
                or (self.fresh is not None and bool(self.unwritten)))


def with_dead_ranges(dead: Optional["DeadWords"],
                     ranges: Sequence[Tuple[int, int]]) -> Optional["DeadWords"]:
    """dead with the 8-aligned (begin, end) `ranges` added (None stays None if none)."""
    if not ranges:
        return dead
    base = dead if dead is not None else DeadWords()
    return dataclasses.replace(base, ranges=merge_pairs(base.ranges, ranges))


class FlatPairs(_SequenceABC):
    """(begin, end) pairs kept as one flat array("Q") [b0, e0, b1, e1, ...]: what merge_pairs
    returns. A sequence of tuples to read; the native passes take .flat as it is."""
    __slots__ = ("flat",)

    def __init__(self, flat: array) -> None:
        self.flat = flat

    def __len__(self) -> int:
        return len(self.flat) // 2

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(self)[i]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("pair index out of range")
        return (self.flat[2 * i], self.flat[2 * i + 1])

    def __iter__(self):
        return zip(self.flat[0::2], self.flat[1::2])

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def __repr__(self) -> str:
        return f"FlatPairs({list(self)!r})"


def _flat(pairs) -> array:
    if isinstance(pairs, FlatPairs):
        return pairs.flat
    return array("Q", chain.from_iterable(pairs))


def merge_pairs(*sources) -> FlatPairs:
    """_types.merge_ranges over (begin, end) pairs (sequences of tuples, or FlatPairs): sorted,
    coalesced, empty ones dropped, in one native pass (mu_merge_pairs): a test process's
    ~12,000 dead ranges took 5 ms as sorted tuples."""
    flats = [_flat(pairs) for pairs in sources]
    # sized once and filled by slices: extend grew the array by reallocation (8 M pairs of a
    # Python process's dead ranges: 0.06 s)
    flat, off = u64_scratch(sum(len(f) for f in flats)), 0
    for f in flats:
        flat[off:off + len(f)] = f if isinstance(f, memoryview) else memoryview(f)
        off += len(f)
    n = check(lib.mu_merge_pairs(ffi.from_buffer("uint64_t[]", flat), len(flat) // 2)
              if len(flat) else 0, "merge dead ranges")
    return FlatPairs(flat[:2 * n])


# Returns (mu_dead * or NULL, objects to keep alive) for a DeadWords over n allocations.
def dead_words(dead: "DeadWords", n: int):
    if not dead:
        return ffi.NULL, None
    cached = dead.__dict__.get("_flat")     # the mark and the folds of a sweep share one
    if cached is not None and cached[0] is dead.ranges:
        flat = cached[1]
    else:
        flat = _flat(dead.ranges)
        dead.__dict__["_flat"] = (dead.ranges, flat)
    c = ffi.new("mu_dead *")
    keep = [c, flat]
    if flat:
        c.ranges = ffi.from_buffer("uint64_t[]", flat)
        keep.append(c.ranges)
    c.nranges = len(dead.ranges)
    c.dict_keys = dead.dict_keys
    c.debug_hooks = int(dead.debug_hooks)
    if dead.types:
        tflat = array("Q", chain.from_iterable(dead.types))
        c.types = ffi.from_buffer("uint64_t[]", tflat)
        c.ntypes = len(dead.types)
        keep += [tflat, c.types]
    if dead.head_word is not None:
        if len(dead.head_word) != n:
            raise ValueError(f"head_word has {len(dead.head_word)} bytes for {n} allocations")
        c.head_word = ffi.from_buffer("uint8_t[]", dead.head_word) if n else ffi.NULL
        keep.append(c.head_word)
    if dead.live_end is not None:
        if len(dead.live_end) != 4 * n:
            raise ValueError(f"live_end has {len(dead.live_end)} bytes for {n} allocations")
        c.live_end = ffi.from_buffer("uint32_t[]", dead.live_end) if n else ffi.NULL
        keep.append(c.live_end)
    if dead.fresh is not None and dead.unwritten and n:
        if len(dead.fresh) != n:
            raise ValueError(f"fresh has {len(dead.fresh)} bytes for {n} allocations")
        uflat = array("Q", chain.from_iterable(dead.unwritten))
        if len(uflat) != 3 * len(dead.unwritten):
            raise ValueError("unwritten ranges are (begin, end, level) triples")
        c.fresh = ffi.from_buffer("uint8_t[]", dead.fresh)
        c.unwritten = ffi.from_buffer("uint64_t[]", uflat)
        c.nunwritten = len(dead.unwritten)
        keep += [uflat, c.fresh, c.unwritten]
    return c, keep


# Returns MarkResult; raises OSError(EINVAL) for unsorted/overlapping allocations, an
# allocation outside every heap region or overlapping regions, or bad dead words; OSError(ENOMEM)
# when out of memory. dead: DeadWords (GC links, dead slots) ignored by the scan, or None.
# A region of image whose buffer is a heaps/glibc/copies.Uncopied is read on demand through its fd
# (the low-memory mark: the blocks reached there are read wave by wave, then dropped); the
# result equals the mark over a copy; MemoryUnreadable when those bytes cannot be read.
# parallel: mark on one thread per CPU whatever the heap's size (by default only from 2^18
# allocations on, or always after use_every_cpu()); the result is the same (the tests compare
# the two). method: when the low-memory mark copies the rest (mark_policy; None: by the
# environment).
_EVERY_CPU = False

# When the low-memory mark switches to a copy (native mu_mark_policy, issue 25): the fixed
# costs of a wave (its sort, its threads) and of a read (a pread of /proc/PID/mem: syscall,
# page walk), in bytes of a large read. bench/bench_shapes.py's 256 MiB of linked lists read
# on demand: 64,636 waves of about 8 reads in 9.4-9.9 s, 150 us a wave, what 1 MiB reads move
# in 150-300 KB (0.9-2 GB/s); charged 64 KiB + 8 x 16 KiB = 192 KiB.
MARK_WAVE_COST = 64 << 10
MARK_READ_COST = 16 << 10
# MEMUNREACHABLE_MARK=on-demand: never copy (the mark before issue 25); =copy: copy the rest
# before the first wave; unset or auto: by the charges.
MARK_METHODS = ("auto", "on-demand", "copy")


def mark_policy(method: Optional[str] = None) -> Tuple[str, int, int]:
    """(method, wave_cost, read_cost) of mu_mark_policy for a method of MARK_METHODS (None:
    the MEMUNREACHABLE_MARK environment variable, default auto). ValueError for another name."""
    if method is None:
        method = os.environ.get("MEMUNREACHABLE_MARK") or "auto"
    if method not in MARK_METHODS:
        raise ValueError(f"MEMUNREACHABLE_MARK={method!r}: one of {', '.join(MARK_METHODS)}")
    return (method,) + {"auto": (MARK_WAVE_COST, MARK_READ_COST), "on-demand": (0, 0),
                        "copy": (2**64 - 1, 0)}[method]


def use_every_cpu() -> None:
    """From now on every mark of this process runs on one thread per CPU, whatever the heap's
    size: for the in-process checks' helper, whose caller waits idle in a read while it
    sweeps, so the caller's CPU is free. A pytest process's check (136,000 blocks, 14 MB):
    mark medians about 15 ms on two threads against 25 ms on one (2 vCPUs, 4 sessions)."""
    global _EVERY_CPU
    _EVERY_CPU = True


def mark(image: HeapImage, roots: Sequence[Tuple[int, object]], words: Sequence[int] = (),
         dead=None, parallel: bool = False, method: Optional[str] = None) -> MarkResult:
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
    dead_c, keep_d = dead_words(dead, n)
    policy = ffi.new("mu_mark_policy *")
    method, policy.wave_cost, policy.read_cost = mark_policy(method)
    t0 = time.perf_counter()
    rc = lib.mu_mark(begins, sizes, n, heap, len(image.regions), root_regions, len(roots),
                     word_arr, len(word_arr), marked_c, stats,
                     lib.MU_MARK_PARALLEL if parallel or _EVERY_CPU else 0, dead_c, policy)
    seconds = time.perf_counter() - t0
    if rc == -errno.EIO:
        raise MemoryUnreadable("the snapshot's heap could not be read during the mark (the "
                               "snapshot process died?)")
    check(rc, "mark")
    del keep_b, keep_s, keep_h, keep_r, keep_w, keep_d
    return MarkResult(marked=marked, root_bytes=stats.root_bytes, heap_bytes=stats.heap_bytes,
                      words=stats.words, num_marked=stats.marked, seconds=seconds,
                      stale=stats.stale, waves=stats.waves, reads=stats.reads,
                      read_bytes=stats.read_bytes, copy_budget=stats.copy_budget,
                      overhead=stats.overhead, switch_wave=stats.switch_wave,
                      copied_bytes=stats.copied_bytes, policy=method,
                      size_total=stats.size_total)


# Returns [(begin, memoryview or bytes)] of the words mark scans in each marked allocation of
# image: none for a dead or reference-free object, a typed object up to its live end
# (mu_scanned_len) but for the words it skips in the middle (mu_scanned_head: a GC head's
# links, a dict's integer header, unwritten words, a dict key table's or a set table's
# hashes), else the whole allocation; and each value object's handles (an int's value, a
# float's or short bytes' words: mu_value_words, at most MU_HANDLE_SLACK bytes into a block
# that is no GC object, as mu_value_target_native) as 8 bytes at the address it was read from
# (an int's digits). For diagnostics (explain.py): one Python step per allocation.
def scanned_blocks(image: HeapImage, marked, dead: Optional["DeadWords"] = None) -> list:
    begins, sizes = image.begins, image.sizes
    dc, keep = dead_words(dead, len(begins))
    bases = [b for b, _ in image.regions]
    vals, at = ffi.new("uint64_t[8]"), ffi.new("uint64_t[8]")
    hb, he, zb, ze, zs = (ffi.new("uint64_t *") for _ in range(5))
    out = []
    for j in range(len(begins)):
        if not marked[j] or not sizes[j]:
            continue
        k = bisect.bisect_right(bases, begins[j]) - 1
        base, buf = image.regions[k]
        view = memoryview(buf)[begins[j] - base:]
        data = ffi.from_buffer("uint8_t[]", view)
        n = lib.mu_scanned_len(dc, data, begins[j], sizes[j], len(view))
        if dead is not None and dead.live_end is not None:     # mu_live_end
            e = struct.unpack_from("<I", dead.live_end, 4 * j)[0]
            n = min(n, e - 1) if e and not e & lib.MU_LIVE_SET_TABLE else n
        if n:
            lib.mu_scanned_head(dc, j, data, begins[j], sizes[j], len(view), hb, he, zb, ze, zs)
            cut = (hb[0] - begins[j], he[0] - begins[j]) if hb[0] or he[0] else (n, n)
            if cut[0] > 0 and cut[1] < n:       # the words it skips in the middle
                parts = [(0, cut[0]), (cut[1], n)]
            else:
                parts = [(0, n)]
            if ze[0]:                           # the words between a table's hashes
                z0, z1, step = zb[0] - begins[j], min(ze[0] - begins[j], n), zs[0]
                parts = [(a, min(e, z0)) for a, e in parts] + [
                    (max(a, k + 8), min(e, k + step, z1)) for a, e in parts
                    for k in range(z0, z1, step)] + [(max(a, z1), e) for a, e in parts]
            out += [(begins[j] + a, view[a:e]) for a, e in parts if a < e]
        for h in range(lib.mu_value_words(dc, data, begins[j], sizes[j], len(view), vals, at)):
            k = bisect.bisect_right(begins, vals[h]) - 1     # a handle: near a block's start
            gc_object = dead is not None and dead.head_word is not None and dead.head_word[k]
            if k >= 0 and vals[h] - begins[k] <= lib.MU_HANDLE_SLACK and not gc_object:
                out.append((at[h], struct.pack("<Q", vals[h])))
    del keep
    return out
