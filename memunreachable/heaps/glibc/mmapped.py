"""mmapped.py: Stage 4 (glibc): chunks in anonymous memory (walk steps 6b and 9).

mmapped chunks (glibc's mmap threshold and above) and the runs of a NONCONTIGUOUS main arena
live in private anonymous mappings that no arena lists: they are found by scanning that
memory for chunk headers (native mu_walk_mmapped, mu_walk_find_headers), and the look-alikes
are dropped by reconciling the scan with mp_'s n_mmaps and mmapped_mem (validate.lookalikes).
Pages never touched (pagemap) are not read: they are zeros and hold no chunk header.
Mixed into walker._Walker, whose state (mem, maps, copies, pieces, heap_ranges, holes, stats)
it uses, as freelists.FreeListsMixin is. References: glibc malloc/malloc.c sysmalloc,
munmap_chunk, mremap_chunk (2.27-2.43).
"""
from __future__ import annotations

from array import array
from typing import List, Optional, Tuple

from memunreachable._ffi import check, ffi, lib
from memunreachable._types import Range, merge_ranges, subtract_ranges
from memunreachable.collect import procfs
from memunreachable.collect.memory import read_many
from memunreachable.heaps.glibc import layout as L
from memunreachable.heaps.glibc import validate as V
from memunreachable.heaps.glibc.copies import Backing, Copy, Piece, alloc_q
from memunreachable.stacks import tracking

HOLE_MIN = 256 << 10     # untouched runs shorter than this are read (and scanned) as before


class MmappedMixin:
    """Anonymous memory's chunks for walker._Walker."""

    # -- step 6b and 9: anonymous memory: NONCONTIGUOUS main runs and mmapped chunks ----
    def anonymous_ranges(self) -> List[Range]:
        """Private anonymous memory not claimed yet, adjacent mappings merged (an mprotect or
        madvise inside an mmapped chunk or a NONCONTIGUOUS run splits its VMA: read-only
        pieces count too)."""
        cands = [m.range for m in self.maps
                 if m.readable and not m.shared and m.anonymous and
                 (not m.path.startswith("[") or m.path.startswith("[anon:"))
                 and not tracking.holds_table(self.mem, m)]
        claimed = list(self.heap_ranges) + [Range(c.base, c.end) for c in self.copies]
        return [r for r in subtract_ranges(cands, claimed) if r.begin % L.PAGE == 0]

    def anonymous(self, arena: int, top: int, need_runs: bool,
                  expect: Tuple[int, int] = (-1, -1),
                  fmt: L.MmapChunk = L.MMAP_CHUNK_227) -> Tuple[int, int, bool]:
        """Scan anonymous memory; returns (mmapped count, mmapped bytes, top reached).
        expect: mp_'s n_mmaps and mmapped_mem, which lookalikes() reconciles the scan with.
        Runs of pages never touched (pagemap: neither present nor swapped out) are zeros:
        they are not read, and no chunk header starts there (one may span them: a calloc'd
        chunk's untouched pages); those outside every chunk are left in self.holes."""
        ranges = self.anonymous_ranges()
        runs = None if need_runs else self.runs_in_use(ranges)
        cps, limits = self.read_anonymous(ranges, runs)
        scanned, top_reached = self.scan_anonymous(cps, limits, arena, top, need_runs, fmt)
        found, found_bytes, kept = self.keep_mmapped(scanned, expect, fmt)
        if runs is not None:
            self.join_spanned(cps, kept)
            have = merge_ranges([Range(cp.base, cp.end) for cp in self.copies if cp.ptr is not None]
                                + [r for _, r in kept])
            self.holes = subtract_ranges(ranges, have)
            self.stats["untouched_bytes"] = sum(r.size for r in self.holes)
        return found, found_bytes, top_reached

    def read_anonymous(self, ranges: List[Range], runs: Optional[dict]) -> Tuple[List[Copy], list]:
        """(a copy of each part of ranges in use (runs: runs_in_use's, None: all of each range),
        read; the end of each copy's range, where a chunk found in it must end)."""
        parts = []                      # (begin, end) to copy, the end of its range, its Backing
        for r in ranges:
            got = runs.get((r.begin, r.end)) if runs is not None else None
            if got is None or list(got) == [(r.begin, r.end)]:
                parts.append((r.begin, r.end, r.end, None))
                continue
            # the runs' copies are views of one mapping of the range: a chunk that spans
            # untouched pages is then one view more (join_spanned), not a copy of its runs
            within = Backing(r.begin, r.size)
            parts += [(b, e, r.end, within) for b, e in got]
        cps = [self.copy(b, e - b, read=False, within=within) for b, e, _, within in parts]
        for err in read_many(self.mem, [(cp.base, cp.buf) for cp in cps], sparse=True):
            if err is not None:
                raise err           # the first unreadable range, as reading one by one
        return cps, [limit for _, _, limit, _ in parts]

    def scan_anonymous(self, cps: List[Copy], limits: List[int], arena: int, top: int,
                       need_runs: bool, fmt: L.MmapChunk = L.MMAP_CHUNK_227) -> Tuple[list, bool]:
        """([(copy, span begin, user, usable)] of the mmapped-chunk look-alikes each copy's
        spans hold, top reached). need_runs: the main arena is NONCONTIGUOUS; its runs are
        found first (page starts that walk to the top or a fencepost) and accepted, and only
        the memory between them is scanned for mmapped chunks."""
        top_reached = False
        scanned = []
        res_m = ffi.new("mu_mmap_result *")
        skip = 0                        # the end of the last chunk found: the next scans start there
        for cp, limit in zip(cps, limits):
            spans = [Range(cp.base, cp.end)]
            if need_runs:
                spans = []
                cursor = cp.base
                for start in self.page_run_starts(cp):
                    if start < cursor:
                        continue
                    res, piece = self.walk_run(cp, start, top, False)
                    if res.status in (V.WALK_TOP, V.WALK_FENCE2):
                        self.accept(arena, res, piece)
                        self.heap_ranges.append(Range(start, res.end))
                        self.stats["main_runs"] += 1
                        cp.used = True
                        spans.append(Range(cursor, start))
                        cursor = (res.end + L.PAGE - 1) & ~(L.PAGE - 1)
                        top_reached |= res.status == V.WALK_TOP
                spans.append(Range(cursor, cp.end))
            for s in spans:
                s = Range(max(s.begin, skip), s.end) if s.end > skip else None
                if s is None or s.size < L.PAGE:
                    continue
                cap = max(16, s.size // (64 * L.PAGE))
                while True:
                    user, usable = alloc_q(cap), alloc_q(cap)
                    n = check(lib.mu_walk_mmapped(cp.ptr + (s.begin - cp.base), s.begin, s.size,
                                                  limit - s.begin, L.PAGE, fmt.tail,
                                                  fmt.usable_delta, fmt.prev_flags,
                                                  ffi.from_buffer("uint64_t[]", user),
                                                  ffi.from_buffer("uint64_t[]", usable), cap, res_m),
                              "scan mmapped")
                    if res_m.found <= cap:
                        break
                    cap = res_m.found
                if n:
                    del user[n:]
                    del usable[n:]
                    scanned.append((cp, s.begin, user, usable))
                    self.stats["mmapped_moved"] += res_m.moved
                    skip = max(skip, user[n - 1] + usable[n - 1] + fmt.usable_delta + fmt.tail -
                               L.CHUNK_HDR)
        return scanned, top_reached

    def keep_mmapped(self, scanned: list, expect: Tuple[int, int],
                     fmt: L.MmapChunk = L.MMAP_CHUNK_227):
        """(count, bytes, [(copy, extent)]) of the mmapped chunks scan_anonymous found, less
        the page starts lookalikes() drops; each kept chunk is an allocation of its copy."""
        found = found_bytes = 0
        spans = {}                      # user address -> its span's bytes (the memalign header too)
        for cp, _b, user, usable in scanned:
            for u, us in zip(user, usable):
                chunk = u - L.CHUNK_HDR
                spans[u] = (chunk - (self.moved_offset(cp, chunk) & ~fmt.prev_flags),
                            chunk + us + fmt.usable_delta + fmt.tail)
        drop = V.lookalikes({u: e - b for u, (b, e) in spans.items()}, *expect,
                            fmt.mremap_overcount, L.PAGE)
        if drop:
            self.stats["mmapped_lookalikes"] = len(drop)
        kept = []
        for cp, begin, user, usable in scanned:
            keep = [k for k, u in enumerate(user) if u not in drop]
            if not keep:
                continue
            self.pieces.append(Piece(begin, array("Q", [user[k] for k in keep]),
                                     array("Q", [usable[k] for k in keep])))
            cp.used = True
            for k in keep:
                found += 1
                found_bytes += spans[user[k]][1] - spans[user[k]][0]
                kept.append((cp, Range(*spans[user[k]])))
                self.heap_ranges.append(kept[-1][1])    # with a stale memalign header
        return found, found_bytes, kept

    def runs_in_use(self, ranges: List[Range]) -> Optional[dict]:
        """procfs.read_runs_in_use of the snapshot for the ranges of at least HOLE_MIN bytes
        read from it alone (None without a pid, or when pagemap cannot be read: every page is
        then read). Memory the snapshot lacks (MADV_DONTFORK, MADV_WIPEONFORK: copied from the
        target during the pause, ProcessMemory.overlays) is absent from its pagemap: read."""
        pid, plain = getattr(self.mem, "pid", None), getattr(self.mem, "plain", None)
        big = [(r.begin, r.end) for r in ranges
               if r.size >= HOLE_MIN and plain is not None and plain(r.begin, r.size)]
        if pid is None or not big:
            return None
        return procfs.read_runs_in_use(pid, big, HOLE_MIN)

    def join_spanned(self, cps: List[Copy], kept: List[Tuple[Copy, Range]]) -> None:
        """Give each chunk that spans untouched pages past its copy one copy of its own
        extent, which replaces the copies it spans (one region per allocation): a view of
        their Backing (read_anonymous), else their bytes copied into a zeroed buffer of that
        size (the untouched pages stay zeros, never written). A copy of 16 MB of pymalloc
        arenas before a list's 8 MB item array, whose last pages were never touched, took
        10 ms of a 1 M-object Python process's check."""
        spans = sorted(r for _, r in kept)
        for cp, span in kept:
            if span.end <= cp.end or cp.ptr is None:
                continue
            end, grown = span.end, True
            while grown:                # the copies and chunks that start before the end
                parts = [c for c in cps if c.ptr is not None and c.base < end and c.end > cp.base]
                new_end = max([end] + [c.end for c in parts]
                              + [r.end for r in spans if cp.base <= r.begin < end])
                grown, end = new_end > end, new_end
            within = cp.within
            if within is not None and all(c.within is within for c in parts) and end <= within.end:
                # views of one Backing: the untouched pages between them are its zeros
                joined = self.copy(cp.base, end - cp.base, read=False, within=within)
            else:
                joined = self.copy(cp.base, end - cp.base, read=False, private=True)   # zeros
                for c in parts:
                    joined.buf[c.base - joined.base:c.end - joined.base] = \
                        memoryview(c.buf)[:c.size]
            for c in parts:
                c.close()
                c.ptr = None
                self.copies.remove(c)
            joined.used = True

    @staticmethod
    def moved_offset(cp: Copy, chunk: int) -> int:
        """prev_size of an mmapped chunk: its offset from the mapping start (memalign)."""
        return cp.u64(chunk)

    def page_run_starts(self, cp: Copy) -> List[int]:
        cap = max(16, cp.size // L.PAGE)
        out = alloc_q(cap)
        n = check(lib.mu_walk_find_headers(cp.ptr, cp.base, cp.size, L.PAGE, L.PREV_INUSE,
                                           L.MINSIZE, L.CHUNK_HDR,
                                           ffi.from_buffer("uint64_t[]", out), cap), "find headers")
        return list(out[:min(n, cap)])
