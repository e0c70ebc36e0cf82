"""Stage 4 (allocations, CPython): pymalloc as an allocator: arenas -> pools -> used blocks.

Input: a Memory reader, the mappings, the version's layout (cpython/layout.py) and, on 3.12+,
the addresses of the interpreters' struct _obmalloc_state. Output: PymallocWalk: every used
block (address, size class bytes), the ranges pymalloc owns (never roots: free blocks, virgin
tails, empty and uncarved pools lie inside them), local copies of the memory holding the
blocks, counters, and problems (any problem: the walk must not be trusted).
Two ways to find the pools (cpython-memory.md section 2):
    arenas     3.12+: the arenas array from the obmalloc state; every carved pool of every
               arena must pass, and nfreepools must equal empty + uncarved pools.
    pool scan  3.8-3.11 (the arenas array is a static of Objects/obmalloc.c, unexported):
               every pool-aligned header in private anonymous rw memory that passes the
               structural checks; a header that passes them but whose free chain does not
               add up is left alone (scanned as before) and reported as a warning.
The block loop runs in native/mu_pymalloc.c.
"""
from __future__ import annotations

import bisect
import mmap
import queue
import struct
import threading
from array import array
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from memunreachable._errors import MemoryUnreadable
from memunreachable._ffi import check, ffi, lib, u64_results
from memunreachable._types import Mapping, Range, merge_ranges, u64_reserve, u64_scratch
from memunreachable.collect.memory import local_copy
from memunreachable.heaps.cpython import layout as L

SCAN_WINDOW = 16 << 20          # pool scan reads anonymous memory in windows of this size
MIN_BLOCK = 16                  # the smallest size class (3.8+: ALIGNMENT 16)
ESTIMATE_BLOCK = 64             # blocks reserved at first: one per this many bytes (grown),
ESTIMATE_MAX = 1 << 22          # at most this many (mappings may be huge and mostly unused)
MAX_ARENAS = 1 << 22
BAD_REASONS = {1: "header fails the checks", 2: "free chain broken", 3: "count disagrees",
               4: "outside its arena"}


@dataclass
class PymallocWalk:
    in_use: bool                    # pymalloc holds memory (some arena or pool was found)
    method: str                     # "arenas", "pool scan" or "none"
    blocks: array = field(default_factory=lambda: array("Q"))   # used block addresses, ascending
    sizes: array = field(default_factory=lambda: array("Q"))    # their size classes (bytes)
    heap_ranges: List[Range] = field(default_factory=list)      # pymalloc's memory: never roots
    regions: List[Tuple[int, object]] = field(default_factory=list)  # copies covering the blocks
    text_heads: array = field(default_factory=lambda: array("Q"))   # blocks whose first word
    #                                        is a short string over a free link (no reference)
    stats: dict = field(default_factory=dict)
    # (begins, sizes) outputs whose first entries are blocks and sizes, with room for a merge
    # in place (merge_dropping's room), or None
    room: Optional[Tuple[object, object]] = None
    # the unused entries of the arenas array (unused_arena_entries): no references
    dead: List[Range] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)   # hard: do not trust the walk
    warnings: List[str] = field(default_factory=list)   # soft: parts left to the old treatment


def _zeros(n: int) -> array:
    return array("Q", (0,)) * n


class _Acc:
    """Accumulates the used blocks of every walked window and the counters. The C loop writes
    each window's blocks straight after the ones before, into one pair of outputs (uninitialised
    mappings, grown by doubling): a 1 GiB heap's 12 M blocks were copied twice more, into a
    slice per window and then into the sorted whole (0.18 s of a 2.3 s check)."""

    def __init__(self, text_heads: bool = True, estimate: int = 0):
        self.addr = self.size = None
        self.n = 0
        self.bases: List[int] = []      # each window's base, in walk order
        self.starts: List[int] = []     # where its blocks start in the outputs
        self.estimate = estimate        # entries to reserve at the first window
        self.text_heads = array("Q")
        self.find_text_heads = text_heads
        # each window's text heads are found on a second thread while the next windows are
        # walked (a pass over every used block's first word: 0.17 s of 12 M blocks)
        self._heads_todo: "queue.Queue" = queue.Queue()
        self._heads_thread: Optional[threading.Thread] = None
        self._heads_error: List[BaseException] = []
        self.room = None                # assemble(): the outputs its views start, if they do
        self.stats = dict(arenas=0, pools=0, empty_pools=0, used_blocks=0, used_bytes=0,
                          free_blocks=0, virgin_blocks=0, bad_pools=0)

    def _room(self, need: int) -> None:
        """Room for need more entries past n (only the pages written cost anything)."""
        cap = len(self.addr) if self.addr is not None else 0
        if self.n + need <= cap:
            return
        self._heads_join()              # the outputs move: the windows queued read them
        new = max(self.n + need, 2 * cap, min(self.estimate, ESTIMATE_MAX))
        addr = size = None
        if not cap:
            # the estimate's bytes at one block per MIN_BLOCK, as address space alone: never
            # grown (each growth copied every entry so far into fresh pages, 0.09 s of a
            # 1 GiB heap's 12 M blocks)
            bound = max(new, self.estimate * (ESTIMATE_BLOCK // MIN_BLOCK))
            addr, size = u64_reserve(bound), u64_reserve(bound)
        if addr is None or size is None:
            addr, size = u64_scratch(new), u64_scratch(new)
        if self.n:
            addr[:self.n] = self.addr[:self.n]
            size[:self.n] = self.size[:self.n]
        self.addr, self.size = addr, size

    def walk(self, buf, base: int, pool_size: int, pools: array):
        """Run the C block loop over pools inside buf (a copy of [base, ...)); returns res."""
        res = ffi.new("mu_pymalloc_result *")
        data = ffi.from_buffer("uint8_t[]", buf)
        room = len(buf) // MIN_BLOCK + 1        # more than a window's pools can hold
        self._room(room)
        out_a = ffi.from_buffer("uint64_t[]", self.addr) + self.n
        out_s = ffi.from_buffer("uint64_t[]", self.size) + self.n
        n = check(lib.mu_pymalloc_blocks(data, base, len(buf), pool_size,
                                         ffi.from_buffer("uint64_t[]", pools), len(pools),
                                         out_a, out_s, room, res), "walk pymalloc pools")
        if res.used > room:
            raise ValueError(f"pymalloc window at {base:#x}: {res.used} blocks in {len(buf)} "
                             "bytes")
        if self.find_text_heads and n:
            self._heads_later(buf, base, self.n, n)
        self.bases.append(base)
        self.starts.append(self.n)
        self.n += n
        s = self.stats
        s["pools"] += res.pools
        s["empty_pools"] += res.empty_pools
        s["used_blocks"] += res.used
        s["used_bytes"] += res.used_bytes
        s["free_blocks"] += res.free_blocks
        s["virgin_blocks"] += res.virgin_blocks
        s["bad_pools"] += res.bad_pools
        return res

    def _heads_later(self, buf, base: int, start: int, n: int) -> None:
        """Queues the window buf (at base) whose blocks are the outputs' [start, start + n) for
        _text_heads on the second thread."""
        if self._heads_thread is None:
            self._heads_thread = threading.Thread(target=self._heads_worker, daemon=True,
                                                  name="memunreachable-text-heads")
            self._heads_thread.start()
        self._heads_todo.put((buf, base, start, n))

    def _heads_worker(self) -> None:
        while True:
            job = self._heads_todo.get()
            if job is None:
                return
            try:
                if not self._heads_error:
                    self._text_heads(*job)
            except BaseException as exc:        # handed to the walking thread
                self._heads_error.append(exc)

    def abandon(self) -> None:
        """Stops the second thread after a failed walk (what it found or raised is dropped)."""
        self._heads_error.append(RuntimeError("abandoned"))
        try:
            self._heads_join()
        except BaseException:
            pass

    def _heads_join(self) -> None:
        """Waits for the queued windows' text heads; raises what their search raised."""
        if self._heads_thread is not None:
            self._heads_todo.put(None)
            self._heads_thread.join()
            self._heads_thread = None
        if self._heads_error:
            raise self._heads_error[0]

    def _text_heads(self, buf, base: int, start: int, n: int) -> None:
        """Adds the blocks among the outputs' [start, start + n) (inside buf, a copy of
        [base, ...)) whose first word is a short C string written over a free block's link
        (mu_pymalloc_text_heads): that word is no reference."""
        data = ffi.from_buffer("uint8_t[]", buf)
        addr = ffi.from_buffer("uint64_t[]", self.addr) + start
        cap = 64
        while True:
            out = _zeros(cap)
            k = check(lib.mu_pymalloc_text_heads(data, base, len(buf), addr, n,
                                                 ffi.from_buffer("uint64_t[]", out), cap),
                      "find pymalloc text heads")
            if k <= cap:
                self.text_heads.extend(out[:k])
                return
            cap = k

    def assemble(self) -> Tuple[object, object]:
        """The blocks and sizes, ascending: views of the outputs when the windows were walked
        in address order (the pool scan's, and usually the arenas'), else a sorted copy."""
        self._heads_join()
        if self.addr is None:
            return array("Q"), array("Q")
        if self.bases == sorted(self.bases):
            self.room = (self.addr, self.size)
            return self.addr[:self.n], self.size[:self.n]
        blocks, sizes = u64_scratch(self.n), u64_scratch(self.n)
        ends = self.starts[1:] + [self.n]
        off = 0
        for _, b, e in sorted(zip(self.bases, self.starts, ends)):
            blocks[off:off + e - b] = self.addr[b:e]
            sizes[off:off + e - b] = self.size[b:e]
            off += e - b
        return blocks, sizes


def _bad(res) -> str:
    return f"pool {res.bad_at:#x}: {BAD_REASONS.get(res.bad_reason, res.bad_reason)}"


@dataclass(frozen=True)
class ArenaArray:
    """Where one obmalloc keeps its arenas: the addresses of the `arenas` pointer, the
    `maxarenas` uint and the `narenas_currently_allocated` size_t."""
    arenas: int
    maxarenas: int
    narenas: int


def state_arrays(lay: L.Layout, states: Sequence[int]) -> List[ArenaArray]:
    """The ArenaArray of each struct _obmalloc_state address (3.12+)."""
    st = lay.obmalloc.state
    return [ArenaArray(s + st.arenas, s + st.maxarenas, s + st.narenas_currently_allocated)
            for s in states]


# Returns the walk of the arenas arrays of the obmalloc states at `states` (3.12+: one per
# interpreter with its own allocator; shared states listed once). Problems are hard: an arena
# or pool that does not add up means the layout or the snapshot is wrong.
def walk_arenas(mem, lay: L.Layout, states: Sequence[int],
                text_heads: bool = True) -> PymallocWalk:
    return walk_arena_arrays(mem, lay, state_arrays(lay, states), text_heads)


# Returns the walk of the given arenas arrays (walk_arenas; tests also pass the 3.8-3.11
# statics of Objects/obmalloc.c found in an unstripped libpython's .symtab).
def walk_arena_arrays(mem, lay: L.Layout, arrays: Sequence[ArenaArray],
                      text_heads: bool = True) -> PymallocWalk:
    out = PymallocWalk(False, "arenas")
    acc = _Acc(text_heads)
    try:
        for arr in arrays:
            _walk_array(mem, lay, arr, out, acc)
    except BaseException:
        acc.abandon()
        raise
    out.blocks, out.sizes = acc.assemble()
    out.room = acc.room
    out.text_heads = acc.text_heads
    out.in_use = acc.stats["arenas"] > 0
    out.method = "arenas" if out.in_use else "none"
    out.stats = acc.stats
    return out


def _walk_array(mem, lay: L.Layout, arr: ArenaArray, out: PymallocWalk, acc: _Acc) -> None:
    om = lay.obmalloc
    try:
        arenas = struct.unpack("<Q", mem.read(arr.arenas, 8))[0]
        maxarenas = struct.unpack("<I", mem.read(arr.maxarenas, 4))[0]
        narenas = struct.unpack("<Q", mem.read(arr.narenas, 8))[0]
        if arenas == 0 or maxarenas == 0:
            if narenas:
                out.problems.append(f"no arenas array at {arr.arenas:#x} but {narenas} arenas "
                                    "allocated")
            return
        if maxarenas > MAX_ARENAS or arenas % 8:
            out.problems.append(f"arenas array {arenas:#x} x {maxarenas} is implausible")
            return
        table = mem.read(arenas, maxarenas * L.ARENA.sizeof)
    except MemoryUnreadable as exc:
        out.problems.append(f"obmalloc state unreadable at {exc.address:#x}")
        return
    ps = om.pool_size
    out.dead.extend(unused_arena_entries(table, arenas))
    acc.estimate = max(acc.estimate, narenas * om.arena_size // ESTIMATE_BLOCK)
    found = 0
    for address, i in _by_address(table, maxarenas):
        off = i * L.ARENA.sizeof
        pool_address = struct.unpack_from("<Q", table, off + L.ARENA.pool_address)[0]
        nfree, ntotal = struct.unpack_from("<II", table, off + L.ARENA.nfreepools)
        first, end = _arena_span(address, om)
        if not _arena_fits(address, pool_address, ntotal, om):
            out.problems.append(f"arena {i} at {address:#x}: pool_address {pool_address:#x} / "
                                f"{ntotal} pools do not fit the arena")
            continue
        found += 1
        acc.stats["arenas"] += 1
        out.heap_ranges.append(Range(address, end))
        carved = (pool_address - first) // ps
        if carved == 0:
            continue
        try:
            buf = local_copy(mem, first, pool_address - first)
        except MemoryUnreadable as exc:
            out.problems.append(f"arena {i} unreadable at {exc.address:#x}")
            continue
        pools = array("Q", range(first, pool_address, ps))
        res = acc.walk(buf, first, ps, pools)
        if res.bad_pools:
            out.problems.append(f"arena {i}: {res.bad_pools} bad pool(s), first {_bad(res)}")
        if nfree != res.empty_pools + (ntotal - carved):
            out.problems.append(f"arena {i}: nfreepools {nfree} != {res.empty_pools} empty + "
                                f"{ntotal - carved} uncarved pools")
        out.regions.append((first, buf))
    if found != narenas:
        out.problems.append(f"{found} arenas found in {arenas:#x}, obmalloc counts {narenas}")


def _by_address(table, maxarenas: int) -> List[Tuple[int, int]]:
    """(address, entry index) of the arenas array's entries in use, in address order: each
    arena is walked as a window, and windows walked in address order leave their blocks
    ascending in the outputs (assemble's views, the merge in place). mmap gives a new arena
    an address below the last, so the array's order is most often the reverse (a 3.13
    process's 1 M objects: their 2 M blocks sorted by copying, 31 ms, and merged into fresh
    arrays)."""
    size, at = L.ARENA.sizeof, L.ARENA.address
    return sorted((a, i) for i in range(maxarenas)
                  for a in struct.unpack_from("<Q", table, i * size + at) if a)


def _arena_span(address: int, om: L.Obmalloc) -> Tuple[int, int]:
    """(its first pool, its end) of the arena at `address`."""
    return (address + om.pool_size - 1) & ~(om.pool_size - 1), address + om.arena_size


def _arena_fits(address: int, pool_address: int, ntotal: int, om: L.Obmalloc) -> bool:
    """Whether an arena entry's pool_address lies at a pool boundary inside its arena and its
    pool count is the arena's."""
    first, end = _arena_span(address, om)
    return (first <= pool_address <= end and (pool_address - first) % om.pool_size == 0
            and ntotal == (end - first) // om.pool_size)


# Returns the ranges of an arenas array read as `table` from `base` that hold no references:
# its unused entries (address 0) whole, and the links (nextarena, prevarena) of the others. A
# freed arena's entry keeps its pool_address and free pool list, and an entry the array grew
# by has only its address and nextarena written (obmalloc.c new_arena); a full arena's links
# may still point into the array's previous, freed copy. Pointers to memory that a later
# allocation may take (a 3.8 target's freed arena entry pointed into a leaked 4 MiB block
# whose mmap took the arena's place: the leak was missed). An arena's own address is kept (an
# arena allocator may take arenas from malloc).
def unused_arena_entries(table, base: int) -> List[Range]:
    size, links = L.ARENA.sizeof, L.ARENA.nextarena
    return merge_ranges([Range(base + off + (links if address else 0), base + off + size)
                         for off in range(0, len(table) - size + 1, size)
                         for address in struct.unpack_from("<Q", table, off + L.ARENA.address)])


# Returns the entry count of the arenas array at `base` read as `table` when it is one: every
# entry in use (address not 0) holds an arena that fits (pool_address at a pool boundary inside
# it, the pool count of the arena size, as _walk_array checks) and every pool run the scan
# found lies in one of its arenas (its first and last byte); 0 when not. (The links are no
# sign: unused entries' prevarena are never written, full arenas' may point elsewhere.)
def arena_table_fits(table, base: int, om: L.Obmalloc, pools: Sequence[Range]) -> int:
    size = L.ARENA.sizeof
    n = len(table) // size
    arenas = []
    for off in range(0, n * size, size):
        address, pool_address, nfree, ntotal = struct.unpack_from("<QQII", table, off)
        if address == 0:
            continue
        if not (_arena_fits(address, pool_address, ntotal, om) and nfree <= ntotal):
            return 0
        arenas.append((address, _arena_span(address, om)[1]))
    if not arenas or not pools:
        return 0
    arenas.sort()
    begins = [a for a, _ in arenas]

    def inside(addr: int) -> bool:
        i = bisect.bisect_right(begins, addr) - 1
        return i >= 0 and addr < arenas[i][1]
    # (a run may span adjacent arenas: its ends are checked)
    if not all(inside(r.begin) and inside(r.end - 1) for r in pools):
        return 0
    return n


# {the runtime's writable mappings: the address of the word that held the arenas array}
_ARENA_STATICS: dict = {}


# Returns the ranges of the unused entries of a 3.8-3.11 runtime's arenas array (a static of
# Objects/obmalloc.c, unexported), found by its shape: a word of the runtime's writable data
# (`spans`: (begin, end) of its .data and .bss, the anonymous mapping right after them
# included) pointing at a malloc'd chunk of at least 16 entries that arena_table_fits; [] when
# no word does. `heap`: the ranges a table may lie in; `pools`: the pool scan's runs. The
# word's address is remembered per spans (read first at the next check, searched when it
# no longer fits).
def scanned_arena_dead(mem, spans, heap: Sequence[Range], om: L.Obmalloc,
                       pools: Sequence[Range]) -> List[Range]:
    key = tuple(spans)
    known = _ARENA_STATICS.get(key)
    if known is not None:
        found = _arena_table_at(mem, known, heap, om, pools)
        if found:
            return found
    # the words that point into malloc's memory, not into pymalloc's pools (a native pass:
    # a 3.11 runtime has 190,000 words, 48 ms in Python)
    inside = array("Q", [x for r in merge_ranges(list(heap)) for x in (r.begin, r.end)])
    outside = array("Q", [x for r in merge_ranges(list(pools)) for x in (r.begin, r.end)])
    for base, end in spans:
        try:
            words = array("Q", mem.read(base, (end - base) // 8 * 8))
        except MemoryUnreadable:
            continue
        idx = words_into(words, inside, outside)
        for k in idx:
            found = _arena_table_at(mem, base + 8 * k, heap, om, pools, words[k])
            if found:
                if len(_ARENA_STATICS) >= 16:
                    _ARENA_STATICS.clear()
                _ARENA_STATICS[key] = base + 8 * k
                return found
    return []


def words_into(words: array, inside: array, outside: array) -> array:
    """The indexes of `words` that are 16-aligned addresses in one of the (begin, end) pairs
    `inside` (flat, sorted, disjoint) and in none of `outside` (mu_words_into)."""
    return u64_results(lambda idx: lib.mu_words_into(
        ffi.from_buffer("uint64_t[]", words), len(words),
        ffi.from_buffer("uint64_t[]", inside), len(inside) // 2,
        ffi.from_buffer("uint64_t[]", outside), len(outside) // 2,
        ffi.from_buffer("uint64_t[]", idx), len(idx)), "words into ranges")


def words_equal(data, values: Sequence[int]) -> array:
    """The indexes of the whole 8-byte words of data (a buffer) equal to one of `values`
    (mu_words_equal)."""
    vals = array("Q", sorted(set(values)))
    n = memoryview(data).nbytes // 8
    if not n or not vals:
        return array("Q")
    return u64_results(lambda idx: lib.mu_words_equal(
        ffi.cast("uint64_t *", ffi.from_buffer(data)), n, ffi.from_buffer("uint64_t[]", vals),
        len(vals), ffi.from_buffer("uint64_t[]", idx), len(idx)), "words equal to values")


def _arena_table_at(mem, at: int, heap, om, pools, table: Optional[int] = None) -> List[Range]:
    """unused_arena_entries of the table the word at `at` points at, if arena_table_fits."""
    try:
        if table is None:
            table = struct.unpack("<Q", mem.read(at, 8))[0]
        head = struct.unpack("<Q", mem.read(table - 8, 8))[0]
        usable = (head & ~7) - (16 if head & 2 else 8)          # glibc: IS_MMAPPED
        n = min(usable, MAX_ARENAS * L.ARENA.sizeof) // L.ARENA.sizeof
        if n < 16 or not any(r.begin <= table and table + n * L.ARENA.sizeof <= r.end
                             for r in heap):
            return []
        data = mem.read(table, n * L.ARENA.sizeof)
    except MemoryUnreadable:
        return []
    if not arena_table_fits(data, table, om, pools):
        return []
    # (and malloc's slack after the last entry: a 256-entry table's last 8 usable bytes held a
    # pointer into a freed arena)
    tail = [Range(table + len(data), table + usable)] if usable > len(data) else []
    return merge_ranges(unused_arena_entries(data, table) + tail)


def scan_candidates(maps: Sequence[Mapping], pool_size: int) -> List[Mapping]:
    """Private anonymous rw mappings big enough for a pool (where mmap puts arenas)."""
    return [m for m in maps
            if m.readable and m.writable and not m.shared and m.inode == 0
            and (m.path == "" or m.path.startswith("[anon:"))
            and m.end - m.begin >= pool_size]


# Returns the walk of every pool found by header checks in private anonymous memory
# (3.8-3.11, or any version without a usable arenas array). heap_ranges are the pools found.
def scan_pools(mem, maps: Sequence[Mapping], lay: L.Layout,
               text_heads: bool = True) -> PymallocWalk:
    ps = lay.obmalloc.pool_size
    out = PymallocWalk(False, "pool scan")
    candidates = scan_candidates(maps, ps)
    acc = _Acc(text_heads, sum(m.end - m.begin for m in candidates) // ESTIMATE_BLOCK)
    try:
        _scan_windows(mem, candidates, ps, out, acc)
    except BaseException:
        acc.abandon()
        raise
    out.heap_ranges = merge_ranges(out.heap_ranges)
    out.blocks, out.sizes = acc.assemble()
    out.room = acc.room
    out.text_heads = acc.text_heads
    out.in_use = acc.stats["pools"] + acc.stats["empty_pools"] > 0
    out.stats = acc.stats
    return out


def _scan_windows(mem, candidates: Sequence[Mapping], ps: int, out: PymallocWalk,
                  acc: _Acc) -> None:
    for m in candidates:
        lo = m.begin
        while lo < m.end:
            hi = min(m.end, (lo // SCAN_WINDOW + 1) * SCAN_WINDOW)
            try:
                buf = local_copy(mem, lo, hi - lo)
            except MemoryUnreadable as exc:
                out.warnings.append(f"anonymous memory at {exc.address:#x} could not be read for "
                                    "the pool scan: it is scanned as before")
                lo = hi
                continue
            data = ffi.from_buffer("uint8_t[]", buf)
            cap = (hi - lo) // ps + 1
            found = _zeros(cap)
            n = check(lib.mu_pymalloc_find_pools(data, lo, hi - lo, ps,
                                                 ffi.from_buffer("uint64_t[]", found), cap),
                      "find pymalloc pools")
            pools = array("Q", (p for p in found[:n] if p + ps <= hi))
            del data                    # release the export before the buffer can close
            if not pools:
                if isinstance(buf, mmap.mmap):
                    buf.close()
                lo = hi
                continue
            res = acc.walk(buf, lo, ps, pools)
            if res.bad_pools:
                out.warnings.append(f"{res.bad_pools} pool-like header(s) did not add up "
                                    f"(first {_bad(res)}): that memory is scanned as before")
                good = _good_pools(pools, res, acc, buf, lo, ps)
            else:
                good = pools
            out.heap_ranges.extend(_runs(good, ps))
            out.regions.append((lo, buf))
            lo = hi


def _runs(pools: array, ps: int) -> List[Range]:
    """Ascending pool addresses -> ranges of adjacent pools."""
    out: List[Range] = []
    lo = end = None
    for p in pools:
        if p != end:
            if lo is not None:
                out.append(Range(lo, end))
            lo = p
        end = p + ps
    if lo is not None:
        out.append(Range(lo, end))
    return out


def _good_pools(pools: array, res, acc: _Acc, buf, base: int, ps: int) -> array:
    """The pools of a window whose walk succeeded, found by walking them one at a time."""
    good = array("Q")
    one = ffi.new("mu_pymalloc_result *")
    data = ffi.from_buffer("uint8_t[]", buf)
    for p in pools:
        arr = array("Q", [p])
        check(lib.mu_pymalloc_blocks(data, base, len(buf), ps, ffi.from_buffer("uint64_t[]", arr),
                                     1, ffi.NULL, ffi.NULL, 0, one), "walk pymalloc pool")
        if one.bad_pools == 0:
            good.append(p)
    return good
