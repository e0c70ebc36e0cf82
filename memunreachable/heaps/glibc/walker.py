"""Stage 4: enumerate the live glibc malloc allocations of a snapshot (our malloc_iterate).

Input: a Memory reader of the snapshot, its mappings, its threads, its pid (for map_files).
Output: HeapWalk: every in-use chunk as (user address, usable size) equal to
malloc_usable_size(), local copies of the memory holding them (or, for a low-memory walk,
Uncopied regions read on demand: walk_heap(uncopied_from=...)), the heap ranges (never roots),
glibc's metadata ranges (main_arena, mp_), soft issues, the block sizes a broken free list
makes uncertain, and counters.
Steps (glibc-heap.md section 1): detect the allocator, locate main_arena/mp_, follow the arena
ring, walk the main arena's runs (across adjacent [heap] VMAs) and every thread arena's heaps,
scan anonymous memory for mmapped chunks (mmapped.py), subtract the verified tcache and
fastbin chains (freelists.py), validate. Each region is read once in bulk into a local copy
(copies.py); the chunk loops run in native/mu_walk.c. References: glibc malloc/malloc.c, arena.c (2.27-2.43).
"""
from __future__ import annotations

import bisect
import mmap
import struct
from array import array
from typing import Dict, List, Optional, Tuple

from memunreachable.sweep import detect
from memunreachable._errors import UnsupportedTarget
from memunreachable._ffi import TWO_THREADS_MIN, check, ffi, in_thread, lib
from memunreachable._types import (Allocator, Fields, HeapImage, Mapping, Range, ThreadState,
                                   extend_u64, local_buffer, merge_ranges)
from memunreachable.heaps.glibc import layout as L
from memunreachable.heaps.glibc import locate
from memunreachable.heaps.glibc import validate as V
from memunreachable.heaps.glibc.copies import WORD, Copy, Piece, alloc_q, is_uncopied
from memunreachable.heaps.glibc.freelists import FreeListsMixin, tcache_context
from memunreachable.heaps.glibc.mmapped import MmappedMixin
from memunreachable.heaps.glibc.validate import HeapInconsistent
from memunreachable.collect.memory import plain_page

__all__ = ["walk_heap", "HeapWalk", "HeapInconsistent"]

MAX_ARENAS = 4096           # hard bound on the arena ring (arena_max / 8*ncpu is far below)
MAX_HEAPS_PER_ARENA = 1 << 16
RUN_START_TRIES = 64        # candidate run starts tried after a main-arena double fencepost
# A low-memory walk keeps the reference candidates (mu_cands: 12 bytes per word that may point
# at an allocation) of at most 1/DIVISOR of the bytes of each heap; the mark reads the rest.
# 4 (issue 25; 16 before the index and the walk stopped copying 32 bytes a block): at 256 MiB,
# doubly linked lists keep every candidate (2.4 M words, no wave) and peak at 0.36x the bytes
# scanned instead of 0.60x, mark 0.11-0.20 s instead of 0.21-0.26 s (613 waves); 4 KiB
# pointer arrays (5.7 M words) 0.86x instead of 0.68x, mark 0.22 s instead of 0.36-0.39 s
# (247 MiB read again). A pointer-dense heap's candidates stop at 0.25x.
CANDIDATE_BUDGET_DIVISOR = 4
# The records of the words the free-list walks read in a walked heap (mu_read_job.rec, 32
# bytes each; without a copy they spare a read a word): one per this many bytes at most (a
# heap of 200-byte chunks, half of them free, needs one per 400 bytes), and in-use chunks up
# to the largest tcache chunk (64 bins: 1040 bytes) when their first word is a free-list link
RECORD_BUDGET_DIVISOR = 256
RECORD_MAX_INUSE = 1040
PAGE_SIZE = 4096


class HeapWalk(Fields):
    __slots__ = ("allocator", "image", "heap_ranges", "metadata_ranges", "soft_issues", "stats",
                 "uncertain_sizes", "spare", "holes")

    def __init__(self, allocator: Allocator, image: HeapImage, heap_ranges: List[Range],
                 metadata_ranges: List[Range], soft_issues: Optional[List[str]] = None,
                 stats: Optional[dict] = None,
                 # usable size -> warning: a free list (tcache bin, fastbin) of that size was
                 # broken or in transit, so an unreachable block of that size may be a free chunk:
                 # report it as "uncertain", never as a leak (usable = chunk size - 8)
                 uncertain_sizes: Optional[Dict[int, str]] = None,
                 # [(base, buffer)]: copies the walk made that hold no allocation (anonymous memory
                 # without mmapped chunks: pymalloc arenas, thread stacks, user mmaps). Later
                 # stages read them from here instead of the snapshot again (memory.CopiedMemory);
                 # the caller closes them.
                 spare: Optional[list] = None,
                 # [Range]: anonymous pages never touched (zeros), in no allocation: no roots
                 holes: Optional[List[Range]] = None):
        self.allocator = allocator
        self.image = image
        self.heap_ranges = heap_ranges
        self.metadata_ranges = metadata_ranges
        self.soft_issues = [] if soft_issues is None else soft_issues
        self.stats = {} if stats is None else stats
        self.uncertain_sizes = {} if uncertain_sizes is None else uncertain_sizes
        self.spare = [] if spare is None else spare
        self.holes = [] if holes is None else holes


class _Job(Fields):
    """A copy to read and the run to walk from `first` in it (_Walker.run_jobs)."""
    __slots__ = ("cp", "first", "top", "non_main", "res", "piece", "cap", "arena", "heap",
                 "holds_top", "heap_end")

    def __init__(self, cp: "Copy", first: int, top: int, non_main: bool, res: object = None,
                 piece: Optional[Piece] = None, cap: int = 0, arena: int = 0,
                 heap: int = 0, holds_top: bool = False, heap_end: int = 0):
        self.cp = cp
        self.first = first
        self.top = top
        self.non_main = non_main
        self.res = res
        self.piece = piece
        self.cap = cap
        self.arena = arena
        self.heap = heap
        self.holds_top = holds_top
        self.heap_end = heap_end


_PAGE_ENTRIES = PAGE_SIZE // 8


class _Scratch:
    """run_jobs' output: one user and one usable mapping (local_buffer, not zeroed: only
    the pages written cost anything), job k's chunks from entry at[k] on (room for j.cap, in
    the jobs' address order), after FRONT entries of room for the chunks found below the
    first job (mmapped chunks below the heaps)."""
    FRONT = 1 << 16

    def __init__(self, jobs: List["_Job"]):
        self.at, total = [0] * len(jobs), self.FRONT
        for k in sorted(range(len(jobs)), key=lambda k: jobs[k].cp.base):
            self.at[k] = total = -(-total // _PAGE_ENTRIES) * _PAGE_ENTRIES  # compact's pages
            total += jobs[k].cap
        self.user = local_buffer(8 * max(total, 1), zeroed=False)
        self.usable = local_buffer(8 * max(total, 1), zeroed=False)
        self.user_q, self.usable_q = memoryview(self.user).cast("Q"), memoryview(self.usable).cast("Q")
        self.n = 0

    def compact(self, pieces: List[Piece]) -> bool:
        """Moves the pieces (ascending, disjoint) to the scratch's start, one after another:
        run_jobs' own pieces move down (memmove), the others (arrays) are written into the
        room before the next piece still to move. False, with nothing moved, when some piece
        would not fit there (the caller copies them all instead)."""
        starts = [p.at for p in pieces if p.at >= 0]
        d, nxt = 0, 0
        for p in pieces:                            # the plan: every move fits
            if p.at >= 0:
                if d > p.at:
                    return False
                nxt += 1
            elif d + len(p.user) > (starts[nxt] if nxt < len(starts) else len(self.user_q)):
                return False
            d += len(p.user)
        # the two mappings on two threads (cffi lets go of the GIL in the moves): a move runs
        # at one thread's memory bandwidth here (1 GiB of 4 KiB pointer arrays' small nodes:
        # 78 ms for both on one thread)
        usable = [p.usable for p in pieces]
        other = in_thread(self._compact_one, self.usable, pieces, usable, d) \
            if d >= TWO_THREADS_MIN else None
        self._compact_one(self.user, pieces, [p.user for p in pieces], d)
        if other is None:
            self._compact_one(self.usable, pieces, usable, d)
        else:
            other()
        for p in pieces:
            p.user = p.usable = None
        self.n = d
        return True

    @staticmethod
    def _compact_one(buf, pieces: List[Piece], values: list, total: int) -> None:
        """compact()'s moves of one mapping, buf: values[k] are pieces[k]'s entries there."""
        b = ffi.from_buffer("uint64_t[]", buf)
        # whole pages moved, not copied into the room's unused pages (faulted in and zeroed:
        # 0.1 s of 1.4 at 1 GiB of 4 KiB pointer arrays' small nodes); malloc's buffers: copied
        pages = int(isinstance(buf, mmap.mmap))
        d = 0
        for p, v in zip(pieces, values):
            n = len(v)
            if p.at >= 0:
                if p.at != d:
                    check(lib.mu_move_down(ffi.cast("uint8_t *", b), 8 * d, 8 * p.at, 8 * n,
                                           pages), "compact the chunks found")
                    # its old place above the end is no one's destination: freed now, so
                    # that the pages the moves fill (the rooms' unused parts) do not add up
                    # with the ones they leave (list2, 1 GiB: +40 MiB of peak)
                    _Scratch._release(buf, max(p.at, d + n, total), p.at + n)
            else:
                ffi.memmove(b + d, ffi.from_buffer("uint64_t[]", v), 8 * n)
            d += n
        _Scratch._release(buf, d, len(buf) // 8)     # the rest holds nothing

    @staticmethod
    def _release(buf, lo: int, hi: int) -> None:
        """Frees the whole pages of entries [lo, hi) of the mapping buf (reading as zeros)."""
        b, e = (8 * lo + PAGE_SIZE - 1) & ~(PAGE_SIZE - 1), (8 * hi) & ~(PAGE_SIZE - 1)
        if isinstance(buf, mmap.mmap) and b < e:
            buf.madvise(mmap.MADV_DONTNEED, b, e - b)


class _Walker(FreeListsMixin, MmappedMixin):
    def __init__(self, mem, maps: List[Mapping], pid: int):
        self.holes: List[Range] = []    # anonymous pages never touched, in no chunk (anonymous())
        self.mem = mem
        self.maps = sorted(maps, key=lambda m: m.begin)
        self.map_begins = [m.begin for m in self.maps]
        self.pid = pid
        self.v = V.Verdict()
        self.copies: List[Copy] = []
        self.pieces: List[Piece] = []
        self.heap_ranges: List[Range] = []
        self.stats: Dict[str, object] = dict(arenas=0, heaps=0, main_runs=0, chunks=0, in_use=0,
                                             free_chunks=0, tcache_free=0, fastbin_free=0,
                                             mmapped=0, mmapped_moved=0, tcaches=[],
                                             # bytes, as glibc's mallinfo2() counts them
                                             in_use_bytes=0, free_bytes=0, top_bytes=0,
                                             system_mem=0, mmapped_bytes=0, tcache_free_bytes=0)
        self.free_nodes = array("Q")     # the tcache and fastbin nodes (user addresses)
        self.arena_free: Dict[int, int] = {}   # arena -> bit-free chunks found by the walk
        self.arena_chunks: Dict[int, int] = {}
        self._pages: Dict[int, Optional[bytes]] = {}   # read(): page address -> bytes or None
        self.scratch: Optional[_Scratch] = None         # run_jobs' output, compacted by assemble

    # -- memory helpers -------------------------------------------------------------
    def word(self, addr: int) -> int:
        return WORD.unpack(self.read(addr, 8))[0]

    def i32(self, addr: int) -> int:
        return struct.unpack("<i", self.read(addr, 4))[0]

    def read(self, addr: int, size: int) -> bytes:
        """mem.read(addr, size); a read inside one page comes from that page, read whole once
        (main_arena's and mp_'s fields, heap headers, tcache structs: ~15 reads of a few pages
        a check, each a read of the snapshot that faults its page in). Only pages no overlay
        or tolerated range meets (mem.plain); any other read, or a page that cannot be read
        whole, goes to mem.read as before (same bytes, same errors)."""
        page = addr & ~(PAGE_SIZE - 1)
        if 0 < size and addr + size <= page + PAGE_SIZE:
            if page not in self._pages:
                self._pages[page] = plain_page(self.mem, page)
            data = self._pages[page]
            if data is not None:
                return data[addr - page:addr - page + size]
        return self.mem.read(addr, size)

    def copy(self, base: int, size: int, read: bool = True, private: bool = False,
             within=None) -> Copy:
        c = Copy(self.mem, base, size, read, private, within)
        self.copies.append(c)
        return c

    # -- heap copies read and walked in one pass --------------------------------------
    def run_jobs(self, jobs: List["_Job"], uncopied_from: Optional[int] = None,
                 safe_linking: Optional[bool] = None) -> bool:
        """Copy each job's range and walk its first run: in one native pass (mu_read_walk, the
        walk follows the reads) when every range comes from the snapshot's fd alone, else
        with mem.read_into then walk_run. Sets job.res and job.piece. uncopied_from: when the
        ranges (fast path only) total at least this many bytes, no copy is kept: each piece
        is released once walked and the copies become Uncopied regions (the low-memory
        sweep). The walk records the words the free-list walks will read (mu_read_job.rec: free
        chunks, and in-use chunks whose first word is a link, as safe_linking says: mangled,
        raw, or None for either): each job's copy keeps them (Copy.rec). Returns True when
        the copies were dropped."""
        fast = getattr(self.mem, "plain", None)
        if not jobs:
            return False
        if fast is None or not all(fast(j.cp.base, j.cp.size) for j in jobs):
            for j in jobs:
                self.mem.read_into(j.cp.base, j.cp.buf)
                j.res, j.piece = self.walk_run(j.cp, j.first, j.top, j.non_main)
            return False
        drop = uncopied_from is not None and sum(j.cp.size for j in jobs) >= uncopied_from
        cands, recs = {}, {}
        if drop:
            self.stats["heaps_read_again"] = 0      # dropped copies read twice (no room)
            spans = array("Q", [a for r in self.allocation_ranges(jobs) for a in (r.begin, r.end)])
            for j in jobs:
                out = ffi.new("mu_cands **")
                check(lib.mu_cands_new(j.cp.base, j.cp.size, ffi.from_buffer("uint64_t[]", spans),
                                       len(spans) // 2,
                                       j.cp.size // CANDIDATE_BUDGET_DIVISOR // 12, out),
                      "reference candidates")
                cands[id(j)] = ffi.gc(out[0], lib.mu_cands_free)
        # the free-list walks' words (mu_read_job.rec), in address space that costs only what
        # is written: a heap half free chunks was walked one read a word, 1.3 s of 256 MiB
        # uncopied; from the copies, one cache miss and more a node (a search of the chunks)
        for j in jobs:
            if j.first:
                recs[id(j)] = (local_buffer(32 * max(1, j.cp.size // RECORD_BUDGET_DIVISOR)),
                               local_buffer(4 * ((j.cp.size >> 12) + 2)))
        lo, hi = min(j.cp.base for j in jobs), max(j.cp.end for j in jobs)
        tab = ffi.new("mu_read_job[]", len(jobs))
        # room for every chunk a run can hold: the scratch costs only the pages written, and
        # a run past its room is walked again (dropped copies from a fresh copy of their heap:
        # 4 KiB arrays of 500 pointers to 32-48 byte nodes walked 314 MiB twice, 1.1 s instead
        # of 0.5, and peaked at a full copy; kept copies into fresh zeroed arrays: a Python
        # process's 1 GiB heap of 32-192 byte chunks, 0.27 s more, and 0.1 s more to assemble)
        for j in jobs:
            j.cap = max(256, (j.cp.end - j.first) // L.MINSIZE + 1)
        # the chunks found go to one pair of scratch mappings (only the pages written cost
        # anything), each job's at its offset, in address order: assemble() compacts them in
        # place into the walk's arrays (a copy into fresh arrays was 0.9 s of a 4 GiB heap's
        # 7.9 s walk, most of it the kernel zeroing fresh pages)
        sc = self.scratch = _Scratch(jobs)
        keep = [ffi.from_buffer("uint64_t[]", sc.user), ffi.from_buffer("uint64_t[]", sc.usable)]
        for k, j in enumerate(jobs):
            t = tab[k]
            t.addr, t.len, t.buf = j.cp.base, j.cp.size, j.cp.ptr
            t.first, t.top, t.non_main = j.first, j.top, int(j.non_main)
            t.drop = lib.MU_READ_DROP if drop else 0
            t.user, t.usable, t.cap = keep[0] + sc.at[k], keep[1] + sc.at[k], j.cap
            t.cands = cands.get(id(j), ffi.NULL)
            if j.first:
                rec, ix = recs[id(j)]
                keep += [ffi.from_buffer("uint64_t[]", rec), ffi.from_buffer("uint32_t[]", ix)]
                t.rec, t.rec_ix, t.rec_cap = keep[-2], keep[-1], len(rec) // 32
                t.rec_lo, t.rec_hi, t.rec_max = lo, hi, RECORD_MAX_INUSE
                t.rec_mangled = 2 if safe_linking is None else int(safe_linking)
        check(lib.mu_read_walk(self.mem.fd, tab, len(jobs)), "read and walk heaps",
              pid=self.mem.pid)
        del keep
        for k, j in enumerate(jobs):
            at = sc.at[k]
            mu, mv = sc.user_q[at:at + j.cap], sc.usable_q[at:at + j.cap]
            t = tab[k]
            if t.bad:
                # unreadable pages (or an error): the reader's own path decides (tolerated
                # ranges, MemoryUnreadable), then the walk is redone on what it read
                check(t.bad if t.bad < 0 else 0, "read memory", pid=self.mem.pid)
                self.mem.read_into(j.cp.base, j.cp.buf)
                j.res, j.piece = self.walk_run(j.cp, j.first, j.top, j.non_main)
                continue
            res = ffi.new("mu_walk_result *")
            res[0] = t.res
            if res.in_use > j.cap:          # more chunks than the estimate: walk again
                if drop:                    # (its pieces were not kept: read them again)
                    self.mem.read_into(j.cp.base, j.cp.buf)
                    self.stats["heaps_read_again"] += 1
                j.res, j.piece = self.walk_run(j.cp, j.first, j.top, j.non_main)
                continue
            j.res, j.piece = res, Piece(j.first, mu[:t.stored], mv[:t.stored], at)
        for k, j in enumerate(jobs):      # (none from a job with unreadable pages: zeros)
            if j.first:
                j.cp.rec = recs[id(j)] + (0 if tab[k].bad else tab[k].rec_stored,)
        self.stats["list_word_records"] = sum(j.cp.rec[2] for j in jobs if j.first)
        if drop:
            for j in jobs:
                j.cp.drop(self.mem.fd, cands[id(j)])
            self.stats["uncopied_bytes"] = sum(j.cp.size for j in jobs)
            kept = [j.cp.buf.kept() for j in jobs]
            self.stats["candidate_words"] = sum(w for w, _ in kept)
            self.stats["candidate_pieces"] = sum(p for _, p in kept)
        return drop

    def allocation_ranges(self, jobs: List["_Job"]) -> List[Range]:
        """Sorted, merged ranges holding every allocation the walk can find: the private
        anonymous memory ([heap], thread heaps, mmapped chunks) and the jobs' heaps (mu_cands
        keeps the words whose values lie inside: the others hit no allocation)."""
        return merge_ranges([m.range for m in self.maps if m.readable and not m.shared and
                             m.anonymous] + [Range(j.cp.base, j.cp.end) for j in jobs])

    def mapping_at(self, addr: int) -> Optional[Mapping]:
        i = bisect.bisect_right(self.map_begins, addr) - 1
        return self.maps[i] if i >= 0 and addr < self.maps[i].end else None

    def span_end(self, m: Mapping) -> int:
        """End of the run of address-adjacent readable mappings that starts with m and carry its
        name: the kernel splits one heap into several [heap] VMAs (brk growth after fork(),
        mprotect, madvise). Unnamed anonymous neighbours are left to anonymous(), which
        merges them itself (they may hold NONCONTIGUOUS runs and mmapped chunks)."""
        k = self.maps.index(m)
        end = m.end
        while (m.path and k + 1 < len(self.maps) and self.maps[k + 1].begin == end and
               self.maps[k + 1].readable and self.maps[k + 1].path == m.path):
            k += 1
            end = self.maps[k].end
        return end

    def walk_run(self, cp: Copy, first: int, top: int, non_main: bool):
        """(result, piece) of one run; the piece's arrays are trimmed to the in-use count."""
        res = ffi.new("mu_walk_result *")
        cap = max(256, (cp.end - first) // 192)
        while True:
            user, usable = alloc_q(cap), alloc_q(cap)
            n = check(lib.mu_walk_run(cp.ptr, cp.base, cp.size, first, top, int(non_main),
                                      ffi.from_buffer("uint64_t[]", user),
                                      ffi.from_buffer("uint64_t[]", usable), cap, res), "walk run")
            if res.in_use <= cap:
                break
            cap = res.in_use
        del user[n:]
        del usable[n:]
        return res, Piece(first, user, usable)

    def accept(self, arena: int, res, piece: Piece) -> None:
        self.pieces.append(piece)
        self.stats["chunks"] += res.chunks
        self.stats["free_chunks"] += res.free_chunks
        self.stats["in_use_bytes"] += res.in_use_bytes
        self.stats["free_bytes"] += res.free_bytes
        self.arena_free[arena] = self.arena_free.get(arena, 0) + res.free_chunks
        self.arena_chunks[arena] = self.arena_chunks.get(arena, 0) + res.chunks

    # -- step 4: the arena ring -------------------------------------------------------
    def arenas(self, main: int, lay: L.Layout) -> List[int]:
        ring, a = [main], self.word(main + lay.state.next)
        while a != main:
            if len(ring) >= MAX_ARENAS or a == 0 or a % 16 or self.mapping_at(a) is None:
                raise UnsupportedTarget(
                    f"glibc arena ring from main_arena {main:#x} does not close (unknown malloc "
                    f"layout); nothing was checked")
            ring.append(a)
            a = self.word(a + lay.state.next)
        return ring

    # -- step 6: main arena runs ------------------------------------------------------
    def plan_main(self, top: int, sbrk_base: int) -> Optional["_Job"]:
        """The main arena's copy (from its sbrk_base mapping) and first run, or None."""
        first = (sbrk_base + L.CHUNK_HDR - 1) & ~(L.CHUNK_HDR - 1)
        m = self.mapping_at(first)
        if m is None:
            self.v.fail(f"main arena: sbrk_base {sbrk_base:#x} is not mapped", sbrk_base)
            return None
        cp = self.copy(m.begin, self.span_end(m) - m.begin, read=False)
        self.main_copy = cp
        return _Job(cp, first, top, False)

    def main_runs(self, arena: int, top: int, job: "_Job") -> bool:
        """Walk runs from sbrk_base (and after foreign-sbrk gaps), the first one done by the
        job. True once top was reached."""
        cp, start = job.cp, job.first
        res, piece = job.res, job.piece
        while True:
            if res.status in (V.WALK_TOP, V.WALK_FENCE2):
                self.accept(arena, res, piece)
                self.heap_ranges.append(Range(start, res.end))
                self.stats["main_runs"] += 1
                cp.used = True
                if res.status == V.WALK_TOP:
                    return True
                if cp.ptr is None:              # dropped (low-memory walk): read it again
                    cp.restore(self.mem)
                nxt = self.next_run_start(cp, res.end, top)
                if nxt is None:
                    return False
                start = nxt
                res, piece = self.walk_run(cp, start, top, False)
                continue
            V.check_run(self.v, f"main arena run at {start:#x}", res.status, res.end, res.bad_at,
                        (V.WALK_TOP, V.WALK_FENCE2))
            return False

    def next_run_start(self, cp: Copy, after: int, top: int) -> Optional[int]:
        """After a foreign sbrk: the first {0, S|PREV_INUSE} header from which a run ends exactly."""
        cap = RUN_START_TRIES
        out = alloc_q(cap)
        n = check(lib.mu_walk_find_headers(cp.ptr + (after - cp.base), after, cp.end - after,
                                           L.CHUNK_HDR, L.PREV_INUSE, L.MINSIZE, L.CHUNK_HDR,
                                           ffi.from_buffer("uint64_t[]", out), cap), "find headers")
        for cand in out[:min(n, cap)]:
            res = ffi.new("mu_walk_result *")
            lib.mu_walk_run(cp.ptr, cp.base, cp.size, cand, top, 0, ffi.NULL, ffi.NULL, 0, res)
            if res.status in (V.WALK_TOP, V.WALK_FENCE2):
                return cand
        return None

    # -- step 5: thread arenas ----------------------------------------------------------
    def heap_max(self, lay: L.Layout, mp: int) -> int:
        """HEAP_MAX: 64 MiB; 2.35-2.42: 4 * mp_.hp_pagesize when set (2.43: never)."""
        if lay.par.heap_max_from_hp:
            hp = self.word(mp + lay.par.hp_pagesize)
            if hp:
                return 4 * hp
        return L.HEAP_MAX_DEFAULT

    def plan_thread_arena(self, arena: int, lay: L.Layout, top: int, heap_max: int) -> list:
        """The heaps of a thread arena, top's first, as [_Job] (their copies not read yet) and
        ("fail", message, address) steps, in the order their verdicts are given."""
        hi = lay.heap_info
        first_heap = arena - hi.sizeof
        if top == lay.state.initial_top(arena) or top == 0:
            return []
        steps = []
        h = top & ~(heap_max - 1)
        seen = 0
        while h:
            if seen > MAX_HEAPS_PER_ARENA or self.word(h + hi.ar_ptr) != arena:
                steps.append(("fail", f"arena {arena:#x}: heap {h:#x} does not belong to it", h))
                return steps
            size = self.word(h + hi.size)
            prev = self.word(h + hi.prev)
            is_first = prev == 0
            if is_first and h != first_heap:
                steps.append(("fail", f"arena {arena:#x}: first heap {h:#x} is not arena - "
                                      f"{hi.sizeof}", h))
                return steps
            if size < hi.sizeof or size > heap_max:
                steps.append(("fail", f"arena {arena:#x}: heap {h:#x} has size {size:#x}", h))
                return steps
            cp = self.copy(h, size, read=False)
            cp.used = True
            holds_top = h <= top < h + size
            job = _Job(cp, hi.first_chunk(h, lay.state, is_first), top if holds_top else 0, True)
            job.arena, job.heap, job.holds_top, job.heap_end = arena, h, holds_top, h + heap_max
            steps.append(job)
            seen += 1
            h = prev
        return steps

    def thread_arena(self, steps: list) -> None:
        """The verdicts on a planned thread arena's heaps (plan_thread_arena), once walked."""
        for job in steps:
            if not isinstance(job, _Job):
                self.v.fail(job[1], job[2])
                continue
            h, res = job.heap, job.res
            if job.holds_top:
                ok = V.check_run(self.v, f"heap {h:#x}", res.status, res.end, res.bad_at,
                                 (V.WALK_TOP,), h + job.cp.size)
            else:
                ok = V.check_run(self.v, f"heap {h:#x}", res.status, res.end, res.bad_at,
                                 (V.WALK_FENCE0,))
            if ok:
                self.accept(job.arena, res, job.piece)
            self.heap_ranges.append(Range(h, self.readable_end(h, job.heap_end)))
            self.stats["heaps"] += 1

    def readable_end(self, lo: int, hi: int) -> int:
        """End of the readable part of [lo, hi) that starts at lo (heap reservations are ---p)."""
        end = lo
        for m in self.maps:
            if m.begin <= end < m.end and m.readable:
                end = min(m.end, hi)
        return max(end, lo)

    # -- step 8: tcache and fastbins ----------------------------------------------------
    def regions_table(self):
        live = sorted((c for c in self.copies if c.ptr is not None or is_uncopied(c.buf)),
                      key=lambda c: c.base)
        tab = ffi.new("mu_region[]", max(1, len(live)))
        for i, c in enumerate(live):
            tab[i].base, tab[i].len = c.base, c.size
            if c.ptr is not None:
                tab[i].data = c.ptr
            else:                       # dropped: the list walks read it through the fd
                tab[i].uncopied, tab[i].fd = 1, c.buf.uncopied_fd
            if c.rec is not None and c.rec[2]:      # and first from the walk's records
                # (their buffers live as long as the copy: the pointers stay valid)
                rec, ix, n = c.rec
                tab[i].rec, tab[i].rec_ix, tab[i].nrec = (ffi.from_buffer("uint64_t[]", rec),
                                                          ffi.from_buffer("uint32_t[]", ix), n)
        return tab, len(live)

    def check_bins(self, arenas: List[int], lay: L.Layout) -> None:
        tab, ntab = self.regions_table()
        sums = ffi.new("uint64_t[4]")
        st = lay.state
        for arena in arenas:
            limit = self.arena_chunks.get(arena, 0) + 1
            check(lib.mu_walk_bins(tab, ntab, st.bin_chunk(arena, 1),
                                   st.bin_chunk(arena, 2) - st.bin_chunk(arena, 1), st.nbins - 2,
                                   limit, sums), "walk bins")
            broken, binned, binned_free, first_bad = sums
            V.check_bins(self.v, arena, broken, binned, binned_free, self.arena_free.get(arena, 0),
                         first_bad)

    # -- step 10: emit ----------------------------------------------------------------
    def assemble(self) -> Tuple[object, object]:
        """The in-use chunks of every piece, ascending: 'Q' memoryviews of the scratch when
        run_jobs' pieces were compacted there, else arrays. A piece overlapping the one before
        it fails the walk and is left out."""
        pieces, kept = sorted(self.pieces, key=lambda p: p.lo), []
        for p in pieces:
            if len(p.user) and kept and len(kept[-1].user) and p.user[0] <= kept[-1].user[-1]:
                self.v.fail(f"overlapping chunk runs at {p.user[0]:#x}", p.user[0] - L.CHUNK_HDR)
                continue
            if len(p.user):
                kept.append(p)
        self.pieces, sc, self.scratch = [], self.scratch, None
        if len(kept) == 1 and isinstance(kept[0].user, array):
            return kept[0].user, kept[0].usable
        if sc is not None and sc.compact(kept):
            return sc.user_q[:sc.n], sc.usable_q[:sc.n]
        user, usable = array("Q"), array("Q")
        for p in kept:
            extend_u64(user, p.user)        # an array, or a view of the scratch
            extend_u64(usable, p.usable)
        return user, usable

    # Returns (the HeapImage, [(base, buffer)] of the copies that hold no allocation).
    def image(self, user: array, usable: array) -> Tuple[HeapImage, list]:
        keep, spare = [], []
        for c in sorted(self.copies, key=lambda c: c.base):
            (keep if c.used else spare).append((c.base, c.buf))
        return HeapImage(user, usable, keep), spare


def _trim(values, n: int):
    """values[:n]: in place for an array, a view of a memoryview."""
    if isinstance(values, array):
        del values[n:]
        return values
    return values[:n]


def _find_objects(mem, maps, pid) -> Tuple[detect.AllocatorScan, locate.Located]:
    scan = detect.scan_maps(maps, pid)
    if not scan.object_mappings:
        raise UnsupportedTarget(detect.not_glibc_message(scan, "no libc is mapped"),
                                hint=detect.GLIBC_BUILD_HINT)
    loc = locate.locate_in_file(scan.object_mappings, pid, scan.malloc_object)
    if loc is None:
        img = locate.read_image(scan.object_mappings, pid)
        version = img.version if img else None
        if scan.static and version is None:
            loc = None if scan.musl else locate.locate_in_memory(
                mem, maps, scan.object_mappings, scan.malloc_object, None)
        else:
            loc = locate.locate_in_memory(mem, maps, scan.object_mappings, scan.malloc_object, version)
    if loc is None:
        if scan.foreign:
            raise UnsupportedTarget(detect.foreign_message(scan),
                                    hint=detect.allocator_hint(scan.foreign, pid))
        raise UnsupportedTarget(detect.not_glibc_message(scan, "no glibc main_arena was found"),
                                hint=detect.GLIBC_BUILD_HINT)
    v = L.version_tuple(loc.version)
    if v is not None and not (L.MIN_MINOR <= v[1] <= L.MAX_MINOR):
        raise UnsupportedTarget(f"glibc {loc.version} is outside the supported range "
                                f"2.{L.MIN_MINOR}-2.{L.MAX_MINOR}; nothing was checked",
                                hint=detect.glibc_range_hint(v, L.MIN_MINOR, L.MAX_MINOR))
    return scan, loc


# Returns the addresses of the glibc arenas in mem (each arena's mutex is its first word): a
# frozen live process's memory will do. Raises UnsupportedTarget as walk_heap does when malloc
# is not glibc's or the arena ring does not close.
def arena_addresses(mem, maps: List[Mapping], pid: int) -> List[int]:
    _scan, loc = _find_objects(mem, maps, pid)
    return _Walker(mem, maps, pid).arenas(loc.main_arena, loc.layout)


# Returns the walk of the snapshot's glibc heap. threads: every thread's registers (their
# fs_base locates the static TLS that holds each thread's `tcache` pointer; [] is allowed).
# Never reports a free chunk as in use silently: a broken or in-transit tcache bin or fastbin
# is a soft issue and its usable size is in HeapWalk.uncertain_sizes. Raises UnsupportedTarget
# (not glibc malloc, unknown layout, arenas unused), HeapInconsistent (hard inconsistency:
# retake the snapshot; .first_bad and a deterministic message tell a corrupt heap apart).
# uncopied_from: when the heaps (main arena and thread-arena heaps) read straight from the
# snapshot's fd total at least this many bytes, they are walked without keeping a copy: the
# image's regions for them are Uncopied (read through mem.fd by mu_mark and the free-list
# walks; the snapshot must stay alive until the mark ends); None keeps every copy.
def walk_heap(mem, maps: List[Mapping], threads: List[ThreadState], pid: int,
              uncopied_from: Optional[int] = None) -> HeapWalk:
    # 1. which allocator, and where are main_arena and mp_
    scan, loc = _find_objects(mem, maps, pid)
    lay = loc.layout
    w = _Walker(mem, maps, pid)
    main = loc.main_arena
    top = w.word(main + lay.state.top)
    allocator = Allocator("glibc", loc.version)
    metadata = [Range(main, main + lay.state.sizeof), Range(loc.mp, loc.mp + lay.par.sizeof)]
    unused = top == 0 or top == lay.state.initial_top(main)
    if scan.foreign and unused:
        raise UnsupportedTarget(detect.foreign_message(scan),
                                hint=detect.allocator_hint(scan.foreign, pid))
    if unused:
        # an allocator we do not know by name may have taken malloc over (glibc-heap.md 13)
        interposers = detect.malloc_interposers(maps, scan, pid)
        if interposers:
            raise UnsupportedTarget(detect.interposer_message(interposers),
                                    hint=detect.allocator_hint(interposers, pid))
        if top != 0:
            raise UnsupportedTarget(detect.unused_arenas_message(),
                                    hint=detect.allocator_hint([], pid))
    if scan.foreign:
        w.v.soft.append(f"{', '.join(scan.foreign)} is loaded too: its heap is not checked")
    if top == 0:       # malloc never initialised: nothing allocated
        return HeapWalk(allocator, HeapImage(array("Q"), array("Q"), []), [], metadata,
                        w.v.soft, dict(w.stats, method=loc.method))
    w.copy(main, lay.state.sizeof)    # bin heads for the chain and bin walks (not an image region)
    # 2. the arena ring
    arenas = w.arenas(main, lay)
    w.stats["arenas"] = len(arenas)
    w.stats["arena_addresses"] = arenas      # each arena's mutex is its first word
    heap_max = w.heap_max(lay, loc.mp)
    # 3. main arena: runs from sbrk_base
    top_reached = unused
    main_job = None
    if not unused:
        main_job = w.plan_main(top, w.word(loc.mp + lay.par.sbrk_base))
    # 4. thread arenas and their heaps
    plans = [w.plan_thread_arena(a, lay, w.word(a + lay.state.top), heap_max) for a in arenas[1:]]
    # 3b-4b. copy the main arena's memory and every heap, walking each while it is read
    v = L.version_tuple(loc.version)
    safe = None if v is None else v >= L.SAFE_LINKING_FROM
    dropped = w.run_jobs(([main_job] if main_job else []) +
                         [j for steps in plans for j in steps if isinstance(j, _Job)],
                         uncopied_from, safe)
    if main_job is not None:
        top_reached = w.main_runs(main, top, main_job)
        if dropped and main_job.cp.ptr is not None:
            main_job.cp.drop(mem.fd)        # restored for a later run: dropped again
    for steps in plans:
        w.thread_arena(steps)
    # 5. anonymous memory: NONCONTIGUOUS main runs, mmapped chunks
    flags = w.i32(main + lay.state.flags)
    need_runs = not top_reached and bool(flags & lay.state.noncontiguous_bit)
    n_mmaps = w.i32(loc.mp + lay.par.n_mmaps)
    mmapped_mem = w.word(loc.mp + lay.par.mmapped_mem)
    found, found_bytes, reached = w.anonymous(main, top, need_runs, (n_mmaps, mmapped_mem),
                                              lay.par.mmap_chunk)
    if not top_reached and not reached:
        w.v.fail(f"main arena: no run reaches top {top:#x}", top)
    # mp_'s bytes beyond the chunks' on 2.43: 16 per mremap ever made (layout.MMAP_CHUNK_243)
    drift = V.check_mmapped(w.v, found, found_bytes, n_mmaps, mmapped_mem,
                            lay.par.mmap_chunk.mremap_overcount)
    w.stats["mmapped"] = found
    w.stats["mmapped_bytes"] = found_bytes
    w.stats["mmapped_mem_drift"] = drift
    for a in arenas:
        t = w.word(a + lay.state.top)
        w.stats["system_mem"] += w.word(a + lay.state.system_mem)
        if t and t != lay.state.initial_top(a):
            w.stats["top_bytes"] += L.chunksize(w.word(t + L.SIZE_SZ))
    # 6. subtract tcache and fastbin free chunks
    user, usable = w.assemble()
    mangled = w.subtract_tcaches(user, usable, tcache_context(w, loc, scan, threads))
    w.subtract_fastbins(user, usable, arenas, lay, mangled)
    w.check_bins(arenas, lay)
    drop = w.free_nodes
    removed, distinct = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    n = check(lib.mu_walk_subtract(ffi.from_buffer("uint64_t[]", user),
                                   ffi.from_buffer("uint64_t[]", usable), len(user),
                                   ffi.from_buffer("uint64_t[]", drop), len(drop), removed,
                                   distinct), "subtract free chunks")
    user, usable = _trim(user, n), _trim(usable, n)
    if removed[0] != distinct[0]:
        w.v.fail(f"{distinct[0] - removed[0]} free-list nodes are not in-use chunks")
    # 7. validate: hard issues retake the snapshot
    w.v.raise_if_hard()
    w.stats["in_use"] = len(user)
    w.stats["method"] = loc.method
    image, spare = w.image(user, usable)
    return HeapWalk(allocator, image, sorted(w.heap_ranges), metadata,
                    w.v.soft, w.stats, dict(w.v.uncertain), spare, w.holes)
