"""Stage 2b: the pages the target wrote since an earlier snapshot (in-process checks).

A conservative mark takes every word that holds a block's address for a reference. A word that
the target has not written since an earlier snapshot, though, cannot point at a block that did
not exist then: it is a stale copy of an address freed before, which a new block reuses (a
leak that such a word kept "reachable" was the last miss of the pytest plugin's real-extension
suite). So:
- the in-process checks' target opens a userfaultfd of its own (open_fd: write-protection in
  its asynchronous mode, Linux 6.7) and hands it to its helper, which keeps a WriteTracker;
- at every freeze, with the target stopped at the instant of its snapshot, the tracker reads
  and re-arms the pages written since its last look (mu_written.h, PAGEMAP_SCAN); after the
  thaw it registers the writable private mappings it does not track yet (tracked from the
  next look on);
- a sweep asks since(epoch): for each snapshot recorded before it since the last but one
  swept (levels 1, the oldest, up), the memory tracked then and written by none of the looks
  since, and the allocations that began in it. mark's fresh rule (mark.DeadWords) drops a word
  of memory unwritten since snapshot u that points into a block whose address began no block
  in snapshot f >= u: the word predates the block. More levels than one: a check that finds
  a leak confirms it with a second snapshot, whose last swept one already holds the leak; and
  the pytest plugin's batches sweep one snapshot in ten, the others only walked for their
  allocations (deferred.record_allocations), so a leak of a batch's first test is fresh
  for the sweep at its end only through the level of the snapshot before that test.
Anything not tracked counts as written (the rule then changes nothing): memory mapped since,
a mapping replaced under a tracked range, a look that failed. Not for the CLI: another
process's userfaultfd cannot be opened from outside.

    open_fd()                       in the target: (fd, "") or (-1, why not)
    fresh_levels(begins, prevs)     mark's fresh levels (pure)
    unwritten_levels(...)           the range arithmetic (pure)
    WriteTracker(pid, fd)           in the helper (takes over the fd)
      .at_freeze() -> epoch         while the target is frozen for a snapshot (native only)
      .register(maps)               at the start, after each thaw: the mappings not tracked yet
      .since(epoch) -> Since | None what a sweep of that snapshot may rule out
References: Documentation/admin-guide/mm/userfaultfd.rst ("Write Protect Notifications",
UFFD_FEATURE_WP_ASYNC) and pagemap.rst (PAGEMAP_SCAN), Linux 6.7.
"""
from __future__ import annotations

import os
from array import array
from typing import Dict, List, Optional, Sequence, Tuple

from memunreachable._ffi import ffi, lib, u64_view
from memunreachable._types import extend_u64

MAX_MAPPING = 1 << 30       # larger writable mappings stay untracked (pte markers per page)
KEEP_SWEPT = 32             # recorded snapshots whose allocations are kept, at most (the
                            # levels: a batch of the pytest plugin records each of its own)


def open_fd() -> Tuple[int, str]:
    """In the process to track: a userfaultfd for asynchronous write-protection, or (-1, the
    reason it cannot be had)."""
    fd = lib.mu_wt_open()
    if fd >= 0:
        return int(fd), ""
    return -1, f"no write tracking: userfaultfd: {os.strerror(-fd)}"


class Since:
    """What a sweep of one snapshot may rule out: prevs, the allocations (ascending begins) of
    the earlier swept snapshots, oldest first (levels 1 up); unwritten, (begin, end, level)
    triples (mark.DeadWords). swept(begins) records this snapshot's allocations."""

    def __init__(self, tracker: "WriteTracker", epoch: int, prevs, unwritten) -> None:
        self.tracker, self.epoch = tracker, epoch
        self.prevs, self.unwritten = prevs, unwritten

    def fresh(self, begins) -> Tuple[bytearray, int]:
        return fresh_levels(begins, self.prevs)

    def swept(self, begins) -> None:
        self.tracker.swept(self.epoch, begins)


def fresh_levels(begins, prevs) -> Tuple[bytearray, int]:
    """(levels, count): levels[i] = the last k (1-based) such that prevs[k-1] (ascending begins
    of an earlier sweep; oldest first) holds no allocation beginning at begins[i], 0 for none;
    count: the allocations with a level."""
    out = bytearray(len(begins))
    if not len(begins):
        return out, 0
    cur, keep = u64_view(begins)
    out_c = ffi.from_buffer("uint8_t[]", out)
    for level, prev in enumerate(prevs, 1):
        prev_c, keep_p = u64_view(prev)
        if lib.mu_wt_fresh(cur, len(begins), prev_c if len(prev) else ffi.NULL, len(prev),
                           level, out_c) < 0:
            raise ValueError("allocation begins must ascend")
    del keep
    return out, len(out) - out.count(0)


def merged(*flats) -> array:
    """The union of flat (begin, end) pair arrays, sorted and coalesced (mu_merge_pairs)."""
    out = array("Q")
    for f in flats:
        out.extend(f)
    n = lib.mu_merge_pairs(ffi.from_buffer("uint64_t[]", out), len(out) // 2) if out else 0
    del out[2 * n:]
    return out


def subtracted(a: array, b: array) -> array:
    """The parts of pairs a (sorted, disjoint) that pairs b (sorted, disjoint) do not cover."""
    if not a or not b:
        return array("Q", a)
    out = array("Q", bytes(8 * (len(a) + len(b))))
    n = lib.mu_pairs_subtract(ffi.from_buffer("uint64_t[]", a), len(a) // 2,
                              ffi.from_buffer("uint64_t[]", b), len(b) // 2,
                              ffi.from_buffer("uint64_t[]", out))
    if n < 0:
        raise ValueError("pairs must ascend")
    del out[2 * n:]
    return out


def unwritten_levels(tracked: Sequence[array],
                     looks: Sequence[array]) -> List[Tuple[int, int, int]]:
    """(begin, end, level) triples, ascending: tracked[k] (flat pairs) is the memory tracked at
    earlier snapshot k + 1 (oldest first), looks[k] what the looks after it up to the next one
    reported written (the last: up to now; a failed look's range whole). Each piece of memory
    that some snapshot tracked and no look since reported written gets the oldest such level."""
    out: List[Tuple[int, int, int]] = []
    covered = array("Q")
    for k, mem in enumerate(tracked):
        fresh = subtracted(subtracted(mem, merged(*looks[k:])), covered)
        out += [(fresh[j], fresh[j + 1], k + 1) for j in range(0, len(fresh), 2)]
        covered = merged(covered, fresh)
    out.sort()
    return out


def trackable(maps) -> array:
    """The mappings worth tracking, as flat (begin, end) pairs, one per mapping, ascending:
    private, readable and writable (data, bss, heap, anonymous memory, stacks), at most
    MAX_MAPPING bytes."""
    return array("Q", [x for m in maps if m.readable and m.writable and not m.shared
                       and m.end - m.begin <= MAX_MAPPING and not m.path.startswith("[v")
                       for x in (m.begin, m.end)])


class WriteTracker:
    """The helper's side (module docstring). Not thread-safe: the helper serves one request
    at a time."""

    def __init__(self, pid: int, fd: int) -> None:
        self.pid, self.fd = pid, fd
        self.pagemap = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        self.tracked = array("Q")           # registered and armed: sorted flat pairs
        self.epoch = 0
        # epoch -> (the memory tracked at its look, what that look reported written)
        self.looks: Dict[int, Tuple[array, array]] = {}
        self.swept_begins: Dict[int, array] = {}
        self.full: set = set()              # the epochs of swept_begins a sweep recorded
        self.failures = 0
        self.cap = 1                # written runs a look can report: half the pages, + ranges

    def close(self) -> None:
        for fd in (self.pagemap, self.fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.pagemap = self.fd = -1

    def register(self, maps) -> int:
        """Registers and arms the trackable mappings not tracked yet (tracked from the next
        look on; the target may run); returns how many."""
        new = subtracted(trackable(maps), self.tracked)     # one mapping's part per pair:
        added = array("Q")                                  # one that fails costs no other
        for j in range(0, len(new), 2):
            b, e = new[j], new[j + 1]
            if lib.mu_wt_register(self.fd, b, e - b) != 0:
                continue
            if lib.mu_wt_scan(self.pagemap, b, e, ffi.NULL, 0) < 0:
                continue        # not armed: not tracked
            added.extend((b, e))
        if added:
            self.tracked = merged(self.tracked, added)
            t = self.tracked
            self.cap = sum(t[j + 1] - t[j] for j in range(0, len(t), 2)) // 8192 + len(t) // 2 + 1
        return len(added) // 2

    def at_freeze(self) -> int:
        """The look of one snapshot's freeze (the target stopped: only native work here);
        returns its epoch (for since())."""
        n = len(self.tracked) // 2
        failed = bytearray(n)
        cap = self.cap          # set when the tracked memory grew; dropped ranges only shrink it
        out = array("Q", bytes(16 * cap))
        got = lib.mu_wt_look(self.pagemap, ffi.from_buffer("uint64_t[]", self.tracked)
                             if n else ffi.NULL, n, ffi.from_buffer("uint64_t[]", out), cap,
                             ffi.from_buffer("uint8_t[]", failed) if n else ffi.NULL)
        if got < 0:
            raise OSError(-got, os.strerror(-got), "look at the written pages")
        del out[2 * got:]
        if any(failed):
            self.failures += failed.count(1)
            self.tracked = array("Q", [x for k in range(n) if not failed[k]
                                       for x in self.tracked[2 * k:2 * k + 2]])
        self.epoch += 1
        self.looks[self.epoch] = (self.tracked, out)
        return self.epoch

    def since(self, epoch: int) -> Optional[Since]:
        """The rule for a sweep of epoch's snapshot (levels: the snapshots recorded before it,
        back to the last but one that was swept, whose looks since are all known); None when
        the epoch is unknown."""
        if epoch not in self.looks:
            return None
        fulls = sorted(e for e in self.full if e < epoch and e in self.swept_begins)
        start = fulls[-2] if len(fulls) >= 2 else 0
        prevs = sorted(e for e in self.swept_begins if start <= e < epoch and e in self.looks)
        if not prevs or any(e not in self.looks for e in range(prevs[0], epoch + 1)):
            return Since(self, epoch, [], [])
        # the written pages between consecutive levels, and from the last one to epoch
        bounds = prevs + [epoch]
        looks = [merged(*(self.looks[e][1] for e in range(a + 1, b + 1)))
                 for a, b in zip(bounds, bounds[1:])]
        unwritten = unwritten_levels([self.looks[e][0] for e in prevs], looks)
        return Since(self, epoch, [self.swept_begins[e] for e in prevs], unwritten)

    def swept(self, epoch: int, begins, full: bool = True) -> None:
        """Keep the allocations of epoch's snapshot, swept (full) or only walked for them
        (deferred.record_allocations); drop what no later sweep can use: the records
        before the last but two swept snapshots (a batch's sweeps of its waiting snapshots
        look back past the last), at most KEEP_SWEPT, and the looks before the oldest kept."""
        kept = self.swept_begins[epoch] = array("Q")
        extend_u64(kept, begins)
        if full:
            self.full.add(epoch)
        fulls = sorted(e for e in self.full if e in self.swept_begins)
        for e in sorted(self.swept_begins)[:-KEEP_SWEPT]:
            del self.swept_begins[e]
        if len(fulls) >= 3:
            for e in [e for e in self.swept_begins if e < fulls[-3]]:
                del self.swept_begins[e]
        self.full &= set(self.swept_begins)
        oldest = min(self.swept_begins)
        for e in [e for e in self.looks if e < oldest]:
            del self.looks[e]
