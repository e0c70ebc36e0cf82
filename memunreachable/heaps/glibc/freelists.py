"""Stage 4 (allocations): glibc's free lists that hide free chunks which look in use.

tcache and fastbin chunks keep the PREV_INUSE bit of the next chunk set, so the chunk walk
counts them in use (glibc-heap.md 2.4). This module finds the real tcaches (by glibc's own
evidence, never by shape alone: 10.1-10.3), follows every tcache bin and fastbin with
validation (mu_walk_chain: each node an in-use chunk of the list's size, cycles cut exactly),
and marks the verified prefixes free. A broken or in-transit list is a soft issue that names
it and makes its block size uncertain (validate.py). Mixed into walker._Walker, whose state
(mem, maps, stats, verdict, free_nodes, regions_table) it uses. References: glibc
malloc/malloc.c tcache_put/tcache_get/_int_free (2.27-2.41), tcache_put_n/tcache_get_n/
tcache_put_large (2.42-2.43: num_slots, large bins sorted by size; 2.43: no fastbins).
"""
from __future__ import annotations

import bisect
import struct
from array import array
from typing import List, Optional, Tuple

from memunreachable.collect import procfs
from memunreachable.sweep import detect
from memunreachable._ffi import check, ffi, lib
from memunreachable._types import Fields, Mapping, Range, ThreadState
from memunreachable.heaps.glibc import layout as L
from memunreachable.heaps.glibc import locate
from memunreachable.heaps.glibc import validate as V
from memunreachable.heaps.glibc.copies import alloc_q


class TcacheContext(Fields):
    """What identifies and decodes the target's tcaches (glibc-heap.md 10)."""
    __slots__ = ("layouts", "key_kind", "mangled", "active_bins", "max_count", "data_ranges",
                 "threads")

    def __init__(self,
                 layouts: Tuple[L.Tcache, ...],   # struct layouts to look for
                 # L.KEY_*; None: decide from the evidence (static <= 2.34)
                 key_kind: Optional[str],
                 mangled: Optional[bool],         # safe-linking; None: decide from the chains
                 active_bins: int,                # mp_.tcache_bins
                 max_count: int,                  # mp_.tcache_count
                 # writable data of the malloc object (holds tcache_key)
                 data_ranges: List[Range], threads: List[ThreadState]):
        self.layouts = layouts
        self.key_kind = key_kind
        self.mangled = mangled
        self.active_bins = active_bins
        self.max_count = max_count
        self.data_ranges = data_ranges
        self.threads = threads


# Returns how to find and decode this target's tcaches: from the version string when libc has
# one, else from mp_'s layout family (2.35+), else None fields decided from the evidence.
def tcache_context(w, loc: locate.Located, scan: detect.AllocatorScan,
                   threads: List[ThreadState]) -> TcacheContext:
    lay = loc.layout
    v = L.version_tuple(loc.version)
    if v is not None:
        layouts = ((L.TCACHE_76,) if v >= L.TCACHE_76_FROM else
                   (L.TCACHE_U16,) if v >= L.U16_COUNTS_FROM else (L.TCACHE_U8,))
        kind, mangled = L.tcache_key_kind(v), v >= L.SAFE_LINKING_FROM
    elif lay.par.hp_pagesize is not None:   # mp_ grew in 2.35: tcache_key, safe-linking, u16
        layouts, kind, mangled = lay.par.tcaches, L.KEY_GLOBAL, True
    else:
        layouts, kind, mangled = L.TCACHES, None, None
    small = w.word(loc.mp + lay.par.tcache_bins)
    max_bytes = w.word(loc.mp + lay.par.tcache_max_bytes)
    count = min(w.word(loc.mp + lay.par.tcache_count), 0xFFFF)
    return TcacheContext(layouts, kind, mangled, _active_bins(lay.par, layouts, small, max_bytes),
                         count, _object_data(w.maps, scan), threads)


def _active_bins(par: L.MallocPar, layouts: Tuple[L.Tcache, ...], small: int, max_bytes: int) -> int:
    """Bins that may hold chunks: mp_.tcache_bins (<= 2.41); 2.42+: the bins whose smallest
    chunk size is below mp_.tcache_max_bytes (a free caches a chunk when size < max_bytes)."""
    nbins = max(tc.nbins for tc in layouts)
    if par.max_bytes_kind == L.MAX_BYTES_USABLE:
        return min(small, nbins)
    tc = layouts[0]
    return sum(1 for i in range(tc.nbins) if tc.bin_size_range(i)[0] < max_bytes)


def _object_data(maps: List[Mapping], scan: detect.AllocatorScan) -> List[Range]:
    """The malloc object's writable mappings and the anonymous .bss continuation after each."""
    objects = set(scan.object_mappings)         # hashed once: not a list search per mapping
    return [m.range for m in procfs.object_data(maps, objects.__contains__)]


class FreeListsMixin:
    """tcache and fastbin subtraction for walker._Walker."""

    def chain(self, tab, ntab, user: array, usable: array, head: int, bias: int, mangled: bool,
              size: int, arena: int, max_nodes: int, size_max: Optional[int] = None):
        """(mu_chain_result, verified prefix) of one free list (see mu_walk_chain) of chunk
        size `size`, or [size, size_max] (a 2.42+ large tcache bin)."""
        cap = min(max_nodes + 1, 64)       # grown below when a chain is longer (fastbins)
        res = ffi.new("mu_chain_result *")
        pu, pz = ffi.from_buffer("uint64_t[]", user), ffi.from_buffer("uint64_t[]", usable)
        while True:
            out = alloc_q(cap)
            n = check(lib.mu_walk_chain(tab, ntab, pu, pz, len(user), head, bias, int(mangled), size,
                                        size if size_max is None else size_max, arena, max_nodes,
                                        ffi.from_buffer("uint64_t[]", out), cap, res),
                      "walk chain")
            if n <= cap:
                break
            cap = n
        del out[n:]
        return res, out

    # -- which 0x290 blocks are real tcaches (glibc-heap.md 10.1-10.3) ---------------------
    def tcache_candidates(self, tab, ntab, user: array, usable: array, tc: L.Tcache,
                          active_bins: int, max_count: int, want_key: int = 0,
                          among: Optional[array] = None):
        """(mu_tcache_cand[], n): blocks shaped like tc that pass mu_walk_tcache_scan's
        prefilter (linear, in C); with want_key, only those with a head holding it; with
        among (ascending user addresses: an earlier scan's candidates), only those blocks."""
        cap = 64            # a tcache per thread; mu_walk_tcache_scan says when more are needed
        ranges = [tc.bin_size_range(i) for i in range(tc.nbins)]
        lo = array("Q", [r[0] for r in ranges])
        hi = array("Q", [r[1] for r in ranges])
        only = ffi.from_buffer("uint64_t[]", among) if among is not None else ffi.NULL
        while True:
            out = ffi.new("mu_tcache_cand[]", cap)
            n = check(lib.mu_walk_tcache_scan(
                tab, ntab, ffi.from_buffer("uint64_t[]", user), ffi.from_buffer("uint64_t[]", usable),
                len(user), tc.chunk_size - L.ARENA_USABLE_DELTA, L.TCACHE_STRUCT_SLACK, tc.count_width,
                tc.entries, tc.nbins,
                min(active_bins, tc.nbins), max_count, int(tc.remaining),
                ffi.from_buffer("uint64_t[]", lo), ffi.from_buffer("uint64_t[]", hi),
                tc.key or 0, want_key, only, len(among) if among is not None else 0, out, cap),
                "scan tcache candidates")
            if n <= cap:
                return out, n
            cap = n

    @staticmethod
    def cand_tuples(out, n: int) -> List[Tuple[int, int, int, int, int, int, int]]:
        """(addr, key, nonempty, heads, want_key heads, self_key heads, mismatched) each."""
        rec = struct.Struct("<QQIIIIII")
        return [r[:7] for r in rec.iter_unpack(ffi.buffer(out, n * rec.size))]

    @staticmethod
    def cand_keys(out, n: int) -> set:
        """The keys the candidates' first heads hold (read as words: no per-record Python)."""
        words = memoryview(ffi.buffer(out, n * ffi.sizeof("mu_tcache_cand"))).cast("Q")
        return set(words[1::ffi.sizeof("mu_tcache_cand") // 8])

    def is_mapped(self, addr: int) -> bool:
        i = bisect.bisect_right(self.map_begins, addr) - 1
        return i >= 0 and addr < self.maps[i].end

    def tcache_key_values(self, keys: set, data_ranges: List[Range]) -> set:
        """Which of keys are glibc's tcache_key (2.34+): a random word that is stored in the
        malloc object's writable data and is no address of the process."""
        found = set()
        for r in data_ranges if keys else ():
            found |= keys.intersection(array("Q", self.mem.read(r.begin, r.size)))
        return {k for k in found if k > 0xFFFF and not self.is_mapped(k)}

    def tls_words(self, threads: List[ThreadState]) -> set:
        """Words of every thread's static TLS area: up to L.TLS_TCACHE_WINDOW bytes below
        fs_base, within the readable mappings (where libc's `tcache` pointer lives)."""
        words = set()
        for t in threads:
            fs = t.fs_base & ~7
            m = self.mapping_at(fs - 8) if fs else None
            if m is None or not m.readable:
                continue
            lo = fs - L.TLS_TCACHE_WINDOW
            begin = m.begin
            k = self.maps.index(m)
            while k > 0 and begin > lo and self.maps[k - 1].end == begin and self.maps[k - 1].readable:
                k -= 1
                begin = self.maps[k].begin
            lo = max(lo, begin)
            words.update(array("Q", self.mem.read(lo, fs - lo)))
        return words

    def find_tcaches(self, tab, ntab, user: array, usable: array, ctx: TcacheContext):
        """[(addr, Tcache)] of the real tcaches: candidates that glibc's own evidence supports
        (glibc-heap.md 10.1-10.3): a list head whose key is tcache_key (2.34+: a random word
        stored in libc's data, no address), or the struct itself (2.29-2.33) plus a reference
        from a thread's static TLS when threads are known; for 2.27-2.28 (no key) the TLS
        reference. Shape alone never suffices when threads are known. Linear in the heap:
        the per-block work is in C."""
        scans = [(tc, self.tcache_candidates(tab, ntab, user, usable, tc, ctx.active_bins,
                                             ctx.max_count)) for tc in ctx.layouts]
        self.stats["tcache_candidates"] = sum(n for _, (_, n) in scans)
        if not self.stats["tcache_candidates"]:
            return []
        kind = ctx.key_kind
        if kind in (L.KEY_GLOBAL, None):
            first_keys = set()
            for _, (out, n) in scans:
                first_keys.update(self.cand_keys(out, n))
            keys = self.tcache_key_values(first_keys, ctx.data_ranges)
            if kind is None:
                kind = (L.KEY_GLOBAL if keys else
                        L.KEY_SELF if any(c[5] for _, (o, n) in scans for c in self.cand_tuples(o, n))
                        else L.KEY_NONE)
            if kind == L.KEY_GLOBAL:
                self.stats["tcache_key_kind"] = kind
                if not keys:
                    return []
                # each candidate needs one head holding the key (a program may have
                # overwritten some free chunk's key). Several such words (a static build holds
                # the program's data too, e.g. a random cookie its nodes carry): only keys
                # held by a tcache that some thread's TLS points at, when threads are known.
                tls = self.tls_words(ctx.threads) if ctx.threads and len(keys) > 1 else None
                out = []
                # the scans for a key test the first scans' candidates alone (a superset)
                among = [array("Q", sorted(c[0] for c in self.cand_tuples(o, n)))
                         for _, (o, n) in scans]
                for k in sorted(keys):
                    got = []
                    for tc, some in zip(ctx.layouts, among):
                        o, n = self.tcache_candidates(tab, ntab, user, usable, tc, ctx.active_bins,
                                                      ctx.max_count, k, some)
                        got += [(c[0], tc) for c in self.cand_tuples(o, n)]
                    if tls is None or any(a in tls for a, _ in got):
                        out += got
                return sorted(set(out), key=lambda x: x[0])
        self.stats["tcache_key_kind"] = kind
        tls = self.tls_words(ctx.threads) if ctx.threads else None
        out = []
        for tc, (o, n) in scans:
            for addr, key, nonempty, heads, want, self_key, mism in self.cand_tuples(o, n):
                if kind == L.KEY_SELF:
                    ok = self_key > 0 and (tls is None or addr in tls)
                else:
                    ok = addr in tls if tls is not None else (heads == nonempty and mism == 0)
                if ok:
                    out.append((addr, tc))
        return out

    def tcache_bins(self, tab, ntab, user: array, usable: array, addr: int, tc: L.Tcache,
                    mangled: bool, max_count: int):
        """[(bin, count, mu_chain_result, prefix)] of every bin of the tcache at addr that has
        a count or a head (count: chunks the bin says it holds; 2.42+: max_count - num_slots)."""
        data = self.read(addr, tc.entries + 8 * tc.nbins)
        fmt = "<%d%s" % (tc.nbins, "B" if tc.count_width == 1 else "H")
        stored = struct.unpack_from(fmt, data, 0)
        entries = struct.unpack_from("<%dQ" % tc.nbins, data, tc.entries)
        out = []
        for i in range(tc.nbins):
            count = tc.entry_count(stored[i], max_count)
            if count is None:               # num_slots above tcache_count: garbage
                count = 0
            if count == 0 and entries[i] == 0:
                continue
            lo, hi = tc.bin_size_range(i)
            res, nodes = self.chain(tab, ntab, user, usable, entries[i], L.TCACHE_LINK_BIAS, mangled,
                                    lo, 0, count + 1, hi)
            out.append((i, count, res, nodes))
        return out

    def subtract_tcaches(self, user: array, usable: array, ctx: TcacheContext) -> Optional[bool]:
        """Mark the verified chains of every real tcache free; returns the safe-linking
        decision (None: undecided)."""
        tab, ntab = self.regions_table()
        mangled = ctx.mangled
        for addr, tc in self.find_tcaches(tab, ntab, user, usable, ctx):
            if mangled is None:     # no version hint (static 2.27-2.34): the decoding that fits
                scored = []
                for m in (True, False):
                    bins = self.tcache_bins(tab, ntab, user, usable, addr, tc, m, ctx.max_count)
                    ok = sum(1 for _, cnt, r, _n in bins if r.status == V.CHAIN_NULL and r.nodes == cnt)
                    scored.append((ok, m, bins))
                ok, m, bins = max(scored, key=lambda x: x[0])
                if ok:
                    mangled = m
            else:
                bins = self.tcache_bins(tab, ntab, user, usable, addr, tc, mangled, ctx.max_count)
            transit = False
            for i, count, r, nodes in bins:
                lo, hi = tc.bin_size_range(i)
                usable_i = lo - L.ARENA_USABLE_DELTA
                usable_max = present = None
                if hi != lo:            # a large bin: the sizes of it the heap holds
                    usable_max = hi - L.ARENA_USABLE_DELTA
                    exact = r.status == V.CHAIN_NULL and r.nodes == count
                    present = () if exact else {u for u in usable if usable_i <= u <= usable_max}
                free, t = V.judge_tcache_bin(self.v, addr, i, usable_i, count, r.status, r.nodes,
                                             r.reason, r.last, r.bad, transit, usable_max,
                                             present or ())
                transit |= t
                self.free_nodes.extend(nodes[:free])
                self.stats["tcache_free"] += free
                self.stats["tcache_free_bytes"] += (
                    free * lo if hi == lo else
                    sum(usable[bisect.bisect_left(user, u)] + L.ARENA_USABLE_DELTA
                        for u in nodes[:free]))
            self.stats["tcaches"].append(addr)
        return mangled

    def subtract_fastbins(self, user: array, usable: array, arenas: List[int], lay: L.Layout,
                          mangled: Optional[bool]) -> None:
        st_ = lay.state
        if not st_.nfastbins:       # 2.43+: no fastbins
            return
        tab, ntab = self.regions_table()
        for k, arena in enumerate(arenas):
            heads = struct.unpack("<%dQ" % st_.nfastbins, self.read(arena + st_.fastbins,
                                                                         8 * st_.nfastbins))
            limit = self.arena_chunks.get(arena, 0)
            for i, head in enumerate(heads):
                if not head:
                    continue
                size = L.MINSIZE + 2 * L.SIZE_SZ * i
                tries = (True, False) if mangled is None else (mangled,)
                r = out = None
                for m in tries:
                    r2, out2 = self.chain(tab, ntab, user, usable, head, L.FASTBIN_LINK_BIAS, m, size,
                                          1 if k == 0 else 2, limit)
                    if r is None or r2.status == V.CHAIN_NULL or r2.nodes > r.nodes:
                        r, out = r2, out2
                    if r.status == V.CHAIN_NULL:
                        break
                free = V.judge_fastbin(self.v, arena, i, size - L.ARENA_USABLE_DELTA, r.status,
                                       r.nodes, r.reason, r.last, r.bad)
                self.stats["fastbin_free"] += free
                self.free_nodes.extend(out[:free])
