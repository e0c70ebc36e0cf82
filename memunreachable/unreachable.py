"""unreachable.py: the orchestrator of `check <pid>` (docs/how-it-works.md).

    1. preflight   the pid is a user process we may trace
    2. collect     freeze every thread, capture registers and maps
    3. snapshot    inject clone(0) -> a copy-on-write child; thaw the target at once
    4-8. sweep     in a forked sweeper (the in-process checks' helper: in itself, sweep_here):
                   enumerate allocations, roots, mark, fold
    9. symbolize   allocation stacks -> frames; suppressions; leaks grouped by stack (issue 9)
   10. report      UnreachableMemoryInfo (sorted, limited); the CLI renders it

A result is valid or it is an error. A snapshot that cannot give a valid result is retaken,
bounded: a hard heap inconsistency (a thread stopped inside malloc; the same inconsistency
twice with no thread there is a corrupt heap: an error at once), memory the snapshot lacks
(MADV_DONTFORK: known from the target's smaps before the clone and copied during the same
pause; a retake copies what appeared in between), a snapshot process that died during the
sweep (once). Docs: docs/reliability.md.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import logging
from array import array
import struct
import os
import signal
import time
from itertools import compress
from typing import Dict, List, Optional, Sequence, Tuple

from memunreachable.sweep import detect
from memunreachable.collect import diagnose, leftovers, procfs
from memunreachable.heaps import libstate
from memunreachable.stacks import tracking
from memunreachable.collect import preflight as preflight_stage
from memunreachable._errors import (CollectionError, HeapCorrupt, HeapWalkError, IncompleteCheck,
                                    MemoryUnreadable, MemunreachableError, NoSuchProcess)
from memunreachable._types import Fields, HeapImage, Range, merge_ranges, subtract_ranges
from memunreachable.sweep.classify import classify, data_ranges, loaded_objects, stack_maps, waiting
from memunreachable.heaps.cpython import probe
from memunreachable.sweep.folding import FoldedLeak, fold, size_totals
from memunreachable.collect.freeze import frozen
from memunreachable.heaps.glibc import linkmaps, locate
from memunreachable.heaps.glibc.walker import HeapInconsistent, is_uncopied, walk_heap
from memunreachable.sweep.mark import DeadWords, mark, with_dead_ranges
from memunreachable.collect.memory import (CopiedMemory, ProcessMemory, SnapshotPlan, capture,
                                           lacking_in_fork, read_copies, mapped_file_size, plan_snapshot,
                                           unwritten_file_pages)
from memunreachable.reporters.report import (Leak, UnreachableMemoryInfo, group_leaks, members,
                                            sort_and_limit)
from memunreachable.collect.snapshot import prepare as prepare_snapshot, take_snapshot
from memunreachable.sweep.sweeper import SweepEntry, SweepResult, retain_list, run_here, run_sweeper

log = logging.getLogger("memunreachable")

MAX_RETRIES = 20
SNAPSHOT_DEATH_RETRIES = 1       # a snapshot process killed during the sweep: retake once
MAX_CAPTURE_BYTES = 512 << 20    # MADV_DONTFORK memory copied during a pause, at most
CONTENTS_BYTES = 32
# The low-memory sweep (docs/performance.md, issue 10): heaps of at least this many bytes are
# walked without keeping copies, and the mark reads the blocks it reaches from the snapshot
# (mark.py, glibc/walker.py walk_heap(uncopied_from=...)). Not for a process with a CPython
# runtime (its stages read object headers from the copies) nor under MEMUNREACHABLE_EXPLAIN.
UNCOPIED_MIN_BYTES = 256 << 20
DEFER_MAX_RSS = 256 << 20       # check_later: larger processes are swept at once
RETAKE_WORDS = {"inflight": "a thread was inside malloc/free",
                "capture": "memory not in the snapshot (MADV_DONTFORK/WIPEONFORK) had to be "
                           "copied during the pause",
                "died": "the snapshot process died during the sweep"}


@diagnose.hinted()      # a process gone under a /proc read: the hint
@leftovers.guarded     # signals, per-target lock, no snapshot process left (leftovers.py)
def check(pid: int, *, limit: Optional[int] = 100, timeout: float = 2.0,
          sweep_timeout: float = 600.0, allow_direct: bool = True,
          allow_seccomp: bool = False, symbolize: bool = True,
          suppressions=None, sweep_here: bool = False,
          dead_ranges: Sequence[Tuple[int, int]] = (),
          waiting_tids: Sequence[int] = (), tracker=None,
          partial: bool = False) -> UnreachableMemoryInfo:
    """Find the unreachable allocations of process `pid`.

    limit: how many leak groups to keep (largest first); None keeps all.
    symbolize: name the frames of allocation stacks (False: module+offset and build-id only).
    suppressions: None, a path to an LSan suppressions file, or suppressions.parse() rules;
    suppressed leaks are in none of the counts (info.suppressions_used says what matched).
    timeout: bound on the pause (freeze); sweep_timeout: bound on the sweep (a forked sweeper).
    sweep_here: run stages 4-8 in this process instead of a forked sweeper (sweeper.run_here:
    same result, no fork; sweep_timeout is not enforced), for a caller whose own process is
    disposable: the in-process checks' helper (_tracer.py).
    dead_ranges: (begin, end) ranges of the target that hold no references (the in-process
    caller's idle alternate signal stack): neither roots nor scanned inside allocations.
    waiting_tids: threads blocked in a wait for this check (the in-process caller's requesting
    thread): only the registers a call preserves are roots (classify.waiting).
    tracker: the written.WriteTracker of pid (the in-process checks' helper): a word the target
    has not written since an earlier swept snapshot is no reference to a block that began
    after it (sweep_here only).
    partial: when part of the process could not be seen (info.incomplete), return what could
    be checked instead of raising IncompleteCheck (which carries that result as .info).
    Raises MemunreachableError subclasses when the check cannot be done.
    """
    started = time.monotonic()
    rules = _rules(suppressions)            # a bad file fails before any pause
    # 1. Preflight
    target = preflight_stage.preflight(pid)
    info = UnreachableMemoryInfo(pid=pid, comm=target.name)
    info.warnings.extend(target.warnings)
    opts = dict(timeout=timeout, sweep_timeout=sweep_timeout, allow_direct=allow_direct,
                allow_seccomp=allow_seccomp, sweep_here=sweep_here,
                dead_ranges=tuple(dead_ranges), waiting_tids=tuple(waiting_tids),
                tracker=tracker if sweep_here else None)
    # 2-8. Collect, snapshot, sweep
    result = _snapshot_and_sweep(pid, info, confirm=None, **opts)
    if result.meta.get("suspect_tids") or result.meta.get("soft_issues"):
        # A thread was inside the allocator: a block in flight in malloc/free can look
        # unreachable. Confirm with a second snapshot: only blocks unreachable in both count.
        first = set(result.leak_addresses)
        result = _snapshot_and_sweep(pid, info, confirm=first, **opts)
        dropped = len(first - set(result.leak_addresses)) + result.meta.get("unconfirmed", 0)
        info.confirmed = True
        if dropped:
            info.warnings.append(f"{dropped} block(s) unreachable in only one of two snapshots "
                                 "(in flight in malloc/free) were not reported")
    for kind, n in sorted(info.retake_counts.items()):
        info.warnings.append(f"snapshot retaken {n} time(s): {RETAKE_WORDS[kind]}")
    # 9. Symbolize, suppress, group
    leaks = _fill(info, result, limit)
    _symbolize_and_group(info, leaks, limit, symbolize, rules)
    # 10. Report: a verdict only when the whole process was seen
    info.duration_ms = (time.monotonic() - started) * 1000.0
    log.info("check done in %.1f ms: %d bytes in %d unreachable allocations",
             info.duration_ms, info.leak_bytes, info.num_leaks)
    return verdict(info, partial)


def verdict(info: UnreachableMemoryInfo, partial: bool = False) -> UnreachableMemoryInfo:
    """info when the check saw the whole process, or when partial was asked for (info then
    says it is incomplete); else IncompleteCheck with the reasons, carrying info (issue 22:
    a check that could not see part of the process never answers "no leaks")."""
    if not info.incomplete or partial:
        return info
    reasons = info.incomplete
    raise IncompleteCheck(
        f"part of process {info.pid} could not be checked, so no verdict is given: "
        + "; ".join(reasons),
        hint="`memunreachable check --partial PID` (API: partial=True) reports what could be "
             "checked, marked incomplete; docs/supported-environments.md lists what is "
             "supported", reasons=reasons, info=info)


class Pending:
    """A snapshot taken now, swept later or never (check_later, sweep_pending): the baseline
    of an in-process check whose sweep is only needed when the check after it finds a leak.
    The target runs meanwhile; the snapshot process (a copy-on-write clone, stopped) and the
    per-target lock are held until release()."""

    def __init__(self, info: UnreachableMemoryInfo, fz, snap, plan: Optional[SnapshotPlan],
                 dead_ranges, guard, waiting_tids=(), tracker=None,
                 epoch: Optional[int] = None) -> None:
        self.info, self.fz, self.snap, self.plan = info, fz, snap, plan
        self.dead_ranges, self._guard = tuple(dead_ranges), guard
        self.waiting_tids = tuple(waiting_tids)
        self.tracker, self.epoch = tracker, epoch   # the write look of its freeze (written.py)
        self.lacking: Optional[str] = None          # why it cannot be swept (complete())

    def complete(self) -> bool:
        """Reads the snapshot's plan if check_later(plan_later=True) left it (its smaps: 2 ms
        the caller need not wait for); False, with `lacking` set, when the snapshot lacks
        memory (MADV_DONTFORK, MADV_WIPEONFORK: a retake could have copied it during the
        pause, a later sweep cannot) or could not be planned."""
        if self.plan is None and self.lacking is None:
            try:
                plan, self.lacking = _pending_plan(self.fz, self.snap, self.info)
            except (_Retake, MemunreachableError) as exc:
                self.lacking = str(getattr(exc, "reason", exc))
                return False
            if self.lacking is None:
                self.plan = plan
        return self.lacking is None

    def release(self) -> None:
        """Kill and reap the snapshot process, drop the lock. Idempotent."""
        guard, self._guard = self._guard, None
        if guard is not None:
            try:
                self.snap.release()
                self.info.pause_ms += self.snap.reap_pause_ms
            finally:
                guard.close()


def _pending_plan(fz, snap, info) -> Tuple[SnapshotPlan, Optional[str]]:
    """(the plan of a snapshot that is to wait for its sweep, what it lacks or None: memory a
    later sweep cannot copy); raises what _plan_reads raises."""
    plan, unseen = _plan_reads(fz, snap, [], _Attempts(), info)
    if unseen or plan.missing:
        return plan, plan.why_missing() or "memory the snapshot lacks"
    return plan, None


@diagnose.hinted()
def check_later(pid: int, *, timeout: float = 2.0, allow_seccomp: bool = False,
                dead_ranges: Sequence[Tuple[int, int]] = (),
                waiting_tids: Sequence[int] = (), tracker=None,
                plan_later: bool = False) -> Optional[Pending]:
    """Steps 1-3 now (the pause is the same as check()'s), the sweep left to sweep_pending().
    None when this snapshot could need a retake or a confirmation that a later sweep could not
    take (no clone, a thread that may be inside malloc/free, memory the snapshot lacks): the
    caller runs check() instead; None too for a process of more than DEFER_MAX_RSS resident
    anonymous bytes: while the snapshot waits, each page the target writes is copied once
    (a test that rewrites a large array would pay for the copy in time and memory).
    plan_later: the snapshot's plan (whether it lacks memory) is left to Pending.complete(),
    which a sweep calls first (the helper calls it once its reply is sent). Raises what
    check() raises for steps 1-3."""
    import contextlib
    target = preflight_stage.preflight(pid)
    if procfs.read_rss_anon(pid) > DEFER_MAX_RSS:
        return None
    info = UnreachableMemoryInfo(pid=pid, comm=target.name)
    info.warnings.extend(target.warnings)
    guard = contextlib.ExitStack()
    guard.enter_context(leftovers.guard(pid))
    pending = None
    try:
        pending = _take_pending(pid, info, guard, timeout, allow_seccomp, dead_ranges,
                                waiting_tids, tracker, plan_later)
    except CollectionError as exc:
        if not getattr(exc, "snapshot_lost", False):
            raise
    finally:
        if pending is None:
            guard.close()
    return pending


def _take_pending(pid: int, info: UnreachableMemoryInfo, guard, timeout: float,
                  allow_seccomp: bool, dead_ranges, waiting_tids, tracker,
                  plan_later: bool = False) -> Optional[Pending]:
    prepare_snapshot(pid, timeout)
    info.snapshots += 1
    with frozen(pid, timeout=timeout) as fz:
        snap = take_snapshot(fz, allow_seccomp=allow_seccomp)
        keep = False
        try:
            # any futex in the allocator's code counts: the arenas are not known yet
            if snap.mode != "clone" or detect.threads_in_allocator(fz.threads, fz.maps, pid, None):
                return None
            epoch = _look_at_writes(tracker)
            fz.thaw()
            _track_new_mappings(tracker, fz)
            info.modules = tracking.modules(fz.maps)
            plan = None
            if not plan_later:
                try:
                    plan, lacking = _pending_plan(fz, snap, info)
                except _Retake:
                    return None
                if lacking is not None:
                    return None
            keep = True
        finally:
            if not keep:            # reaped while still frozen when it can be
                snap.release()
    info.pause_ms += fz.pause_ms
    info.snapshot_mode, info.threads = snap.mode, len(fz.threads)
    return Pending(info, fz, snap, plan, dead_ranges, guard, waiting_tids, tracker, epoch)


@diagnose.hinted()
def sweep_pending(pending: Pending, *, limit: Optional[int] = 100, symbolize: bool = True,
                  suppressions=None, partial: bool = False) -> UnreachableMemoryInfo:
    """Steps 4-10 of check() over a check_later() snapshot, then its release. No retake is
    possible: a snapshot process that died or a heap caught mid-update (no thread was inside
    the allocator when it was taken: a corrupt heap, or a writer behind malloc's back) raise
    CollectionError or HeapWalkError. A block in flight in malloc/free cannot be confirmed
    either: it counts as unreachable (a baseline then errs toward more leaks, never fewer)."""
    started = time.monotonic()
    rules = _rules(suppressions)
    info, fz, snap = pending.info, pending.fz, pending.snap
    try:
        result = _sweep_pending(pending)
    except _Retake as r:
        raise CollectionError(f"the snapshot of process {fz.pid} could not be swept "
                              f"({r.reason}); nothing was reported", hint="try again") from None
    finally:
        pending.release()
    info.snapshot_ms += snap.lifetime_ms
    info.warnings.extend(w for w in snap.warnings if w not in info.warnings)
    leaks = _fill(info, result, limit)
    _symbolize_and_group(info, leaks, limit, symbolize, rules)
    info.duration_ms = (time.monotonic() - started) * 1000.0
    return verdict(info, partial)


def record_allocations(pending: Pending) -> bool:
    """Record the allocations of a waiting snapshot with its write tracker (written.py), as a
    sweep of it would: the fresh rule of the sweeps after it then counts from its moment too
    (the pytest plugin's batches sweep one snapshot in ten, and a stale copy of an address
    freed during the batch, hidden in memory unwritten since, would point into a block that
    leaked at that address later in it). Only the walks, about a third of a sweep. False when
    nothing was recorded (no tracker, a walk that failed: the rule counts from an earlier
    snapshot then, as without tracking)."""
    tracker, fz, snap = pending.tracker, pending.fz, pending.snap
    if tracker is None or pending.epoch is None or snap.released or not _alive(snap.pid):
        return False
    plan = pending.plan         # None: not planned (complete()), read as it is
    try:
        mem = ProcessMemory(snap.pid, overlays=[], tolerated=plan.tolerated if plan else [],
                            guarded=plan.guarded if plan else [])
    except OSError:
        return False
    try:
        _warm_caches(fz.maps, fz.pid)
        hw = walk_heap(mem, fz.maps, fz.threads, snap.pid)
        image = hw.image
        if probe.may_hold_runtime(fz.maps, snap.pid):
            from memunreachable.heaps.cpython import pipeline
            image = pipeline.allocations(CopiedMemory(mem, list(hw.image.regions) + hw.spare),
                                         fz.maps, fz.threads, snap.pid, image)
        tracker.swept(pending.epoch, image.begins, full=False)
        return True
    except MemoryUnreadable as exc:     # memory the snapshot lacks? complete() tells
        pending.complete()
        log.info("allocations of a waiting snapshot not recorded: %s", exc)
        return False
    except (MemunreachableError, OSError, ValueError, struct.error) as exc:
        log.info("allocations of a waiting snapshot not recorded: %s", exc)
        return False
    finally:
        mem.close()


def _sweep_pending(pending: Pending) -> SweepResult:
    fz, snap = pending.fz, pending.snap
    if not _alive(snap.pid):
        raise _Retake("died", "the snapshot process died before its sweep")
    if not pending.complete():
        raise _Retake("lacking", f"it lacks memory ({pending.lacking})")
    try:
        return _sweep_snapshot(snap, fz, _Attempts(), 600.0, None, [], pending.plan, [], True,
                               pending.dead_ranges, pending.waiting_tids,
                               _since(pending.tracker, pending.epoch))
    except HeapInconsistent as exc:
        raise HeapWalkError(f"the heap of process {fz.pid} was inconsistent in a snapshot taken "
                            f"with no thread inside malloc/free ({exc}); nothing was reported",
                            hint="the heap may be corrupt; run the program under valgrind or "
                                 "with MALLOC_CHECK_=3") from None
    except MemoryUnreadable as exc:
        _judge_unreadable(fz.pid, fz, snap, _Attempts(), exc)      # raises


class _Retake(Exception):
    """This snapshot cannot give a valid result, a fresh one may: kind says why."""

    def __init__(self, kind: str, reason: str, error: Exception = None):
        super().__init__(reason)
        self.kind, self.reason, self.error = kind, reason, error


class _Attempts(Fields):
    """What one snapshot teaches the next: memory to capture during the pause, the last
    heap inconsistency (to tell a corrupt heap from one in flight), deaths seen."""
    __slots__ = ("capture", "capture_tried", "last_inconsistency", "last_suspect", "suspect_seen",
                 "deaths")

    def __init__(self, capture: Optional[List[Range]] = None, capture_tried: bool = False,
                 last_inconsistency: str = "", last_suspect: bool = True,
                 suspect_seen: bool = False,
                 deaths: Optional[List[str]] = None):  # how each snapshot process was lost
        self.capture = [] if capture is None else capture
        self.capture_tried = capture_tried
        self.last_inconsistency = last_inconsistency
        self.last_suspect = last_suspect
        self.suspect_seen = suspect_seen
        self.deaths = [] if deaths is None else deaths


def _snapshot_and_sweep(pid: int, info: UnreachableMemoryInfo, confirm, **opts) -> SweepResult:
    """Steps 2-8, retaking the snapshot when it cannot give a valid result; returns the
    SweepResult or raises (HeapCorrupt, HeapWalkError, CollectionError, ...)."""
    st = _Attempts()
    for attempt in range(MAX_RETRIES + 1):
        try:
            return _one_snapshot(pid, info, confirm, st, **opts)
        except _Retake as r:
            if r.kind == "inflight":
                _judge_inconsistency(pid, st, r.error)
            log.info("retaking the snapshot: %s", r.reason)
            info.retries += 1
            info.retake_counts[r.kind] = info.retake_counts.get(r.kind, 0) + 1
        time.sleep(0.002 + 0.001 * min(attempt, 3))
    if st.suspect_seen:
        raise HeapWalkError(
            f"the heap stayed inconsistent in {MAX_RETRIES + 1} snapshots ({st.last_inconsistency})",
            hint="a thread was inside malloc/free each time: the target allocates very heavily; "
                 "try again, or check a quieter moment")
    raise HeapWalkError(
        f"the heap was inconsistent in {MAX_RETRIES + 1} snapshots, differently each time, with "
        f"no thread inside malloc/free ({st.last_inconsistency}); nothing was checked",
        hint="the heap may be corrupt, or the target changes it without malloc's knowledge; "
             "run it under valgrind or with MALLOC_CHECK_=3")


def _judge_inconsistency(pid: int, st: _Attempts, exc: HeapInconsistent) -> None:
    """Raise HeapCorrupt when two snapshots in a row show the same inconsistency and no thread
    was inside the allocator in either (an idle target: nothing could have been in flight)."""
    text = str(exc)
    suspect = bool(getattr(exc, "suspect_tids", None))
    st.suspect_seen |= suspect
    if text == st.last_inconsistency and not suspect and not st.last_suspect:
        first_bad = exc.first_bad
        where = f" (first bad chunk at {first_bad:#x})" if first_bad else ""
        err = HeapCorrupt(
            f"the heap of process {pid} is corrupt{where}: {text}; it was the same in two "
            "snapshots with no thread inside malloc/free, so nothing was checked",
            hint="a heap overflow or a use-after-free wrote over glibc's chunk headers; run "
                 "the program under valgrind or with MALLOC_CHECK_=3 to find the writer")
        err.first_bad = first_bad
        raise err
    st.last_inconsistency, st.last_suspect = text, suspect


def _one_snapshot(pid: int, info: UnreachableMemoryInfo, confirm, st: _Attempts, *,
                  timeout: float, sweep_timeout: float, allow_direct: bool,
                  allow_seccomp: bool, sweep_here: bool = False,
                  dead_ranges: Sequence[Tuple[int, int]] = (),
                  waiting_tids: Sequence[int] = (), tracker=None) -> SweepResult:
    """One freeze + snapshot + sweep. Raises _Retake when a fresh snapshot may succeed."""
    # 2. Collect: freeze every thread, registers, maps
    log.info("collecting thread info for process %d", pid)
    prepare_snapshot(pid, timeout)          # record write and first-time reads: not in the pause
    to_copy = merge_ranges(st.capture + _lacking_before_clone(pid))
    info.snapshots += 1
    with frozen(pid, timeout=timeout) as fz:
        # 3. Snapshot: clone(0) injected into a stopped thread, then thaw at once
        try:
            snap = take_snapshot(fz, allow_direct=allow_direct, allow_seccomp=allow_seccomp)
        except CollectionError as exc:
            if getattr(exc, "snapshot_lost", False):
                _snapshot_died(pid, st, str(exc))   # killed while it was being parked
            raise
        info.modules = tracking.modules(fz.maps)
        try:
            overlays = []
            if snap.mode == "clone" and to_copy:
                # 3b. memory the snapshot cannot show (MADV_DONTFORK/WIPEONFORK), known from
                # the target's smaps or an earlier snapshot: copied during this pause
                overlays = capture(pid, subtract_ranges(to_copy, subtract_ranges(
                    to_copy, [m.range for m in fz.maps if m.readable])))
            # 3c. The pages written since the last look, at the snapshot's instant (written.py)
            epoch = _look_at_writes(tracker)
            if snap.mode == "clone":
                fz.thaw()
                _track_new_mappings(tracker, fz)
            elif not any(w.startswith("no snapshot") for w in info.warnings):
                info.warnings.append(f"no snapshot ({snap.reason}): the target stayed "
                                     "stopped for the whole sweep")
            log.info("target paused %.2f ms (%d threads), snapshot %s",
                     fz.pause_ms, len(fz.threads), snap.mode)
            plan, unseen = _plan_reads(fz, snap, overlays, st, info)
            # 4-8. Sweep in a forked process
            try:
                return _sweep_snapshot(snap, fz, st, sweep_timeout, confirm, overlays, plan, unseen,
                                       sweep_here, dead_ranges, waiting_tids,
                                       _since(tracker, epoch))
            except HeapInconsistent as exc:
                log.info("heap was mid-update (%s)", exc)
                raise _Retake("inflight", str(exc), exc) from None
            except MemoryUnreadable as exc:
                _judge_unreadable(pid, fz, snap, st, exc)
        finally:
            snap.release()
            if snap.mode != "clone":
                fz.thaw()
            info.pause_ms += fz.pause_ms + snap.reap_pause_ms
            info.snapshot_ms += snap.lifetime_ms
            info.snapshot_mode = snap.mode
            info.threads = len(fz.threads)
            info.warnings.extend(w for w in snap.warnings if w not in info.warnings)


def _plan_reads(fz, snap, overlays, st: _Attempts, info) -> tuple:
    """(SnapshotPlan, unseen ranges) for the sweep; raises _Retake once when the snapshot lacks
    memory that a fresh snapshot can capture during its pause."""
    if snap.mode != "clone":
        return _direct_plan(fz.pid, fz.maps), []
    try:
        smaps = procfs.read_smaps_flags(snap.pid)
    except (NoSuchProcess, OSError, ValueError) as exc:
        _snapshot_died(fz.pid, st, f"its smaps could not be read: {exc}")
    if not _alive(snap.pid):    # killed while (or before) its smaps were read: they are empty
        _snapshot_died(fz.pid, st, "killed before its mappings were read")
    plan = plan_snapshot(fz.maps, smaps, mapped_file_size(fz.pid, loaded_objects(fz.maps)))
    _note_lacking(fz.pid, bool(plan.missing))
    have = merge_ranges([Range(b, b + len(buf)) for b, buf in overlays])
    unseen = subtract_ranges(plan.missing, have)
    if unseen and not st.capture_tried and plan.missing_bytes <= MAX_CAPTURE_BYTES:
        st.capture, st.capture_tried = plan.missing, True
        raise _Retake("capture", plan.why_missing() + ": copying it during the next pause")
    if overlays and not unseen:
        info.warnings.append(
            f"{sum(len(b) for _, b in overlays)} bytes of memory the snapshot lacks "
            f"({plan.why_missing()}) were copied from the stopped target during the pause")
    if unseen:
        info.warnings.append(_unseen_reason(plan, unseen))
    return plan, unseen


def _unseen_reason(plan: SnapshotPlan, unseen: List[Range]) -> str:
    """What a sweep with memory the snapshot lacks cannot see (a warning, and the reason its
    check is incomplete)."""
    return (f"{sum(r.size for r in unseen)} bytes of the target's memory are not in the "
            f"snapshot ({plan.why_missing()}) and could not be copied during the pause: "
            "every unreachable block is reported as uncertain, not as a leak")


# (pid, start time) -> whether the last snapshot of that process lacked memory; one process at
# a time (the plugin checks the same one after every test), like snapshot._GUARDS
_LACKED: Dict[Tuple[int, int], bool] = {}


def _process_key(pid: int) -> Tuple[int, int]:
    st = leftovers.read_stat(pid)
    return pid, st.start if st is not None else -1


def _lacking_before_clone(pid: int) -> List[Range]:
    """The ranges a fork of pid will lack (memory.lacking_in_fork), read from its smaps before
    the freeze (2 ms for a node or pytest process, outside the pause); [] without reading when
    its last snapshot lacked nothing: should that change, the capture retake copies it."""
    if _LACKED.get(_process_key(pid)) is False:
        return []
    try:
        ranges = lacking_in_fork(procfs.read_smaps_flags(pid))[0]
    except (NoSuchProcess, OSError, ValueError):
        return []           # the freeze says what is wrong
    return ranges if sum(r.size for r in ranges) <= MAX_CAPTURE_BYTES else []


def _note_lacking(pid: int, lacked: bool) -> None:
    _LACKED.clear()
    _LACKED[_process_key(pid)] = lacked


def _direct_plan(pid: int, maps) -> SnapshotPlan:
    """The ranges of the target whose pages may legitimately be unreadable (direct mode: no
    snapshot, the stopped target is read): tolerated and guarded."""
    try:
        flags = dict(procfs.read_smaps_flags(pid))
    except (NoSuchProcess, OSError, ValueError):
        flags = {}
    plan = plan_snapshot(maps, [(m, flags.get(m, frozenset())) for m in maps],
                         mapped_file_size(pid))
    return SnapshotPlan(tolerated=plan.tolerated, guarded=plan.guarded)


def _alive(pid: int) -> bool:
    """A healthy snapshot process is always in a traced stop ('t'); after a SIGKILL it runs
    (R/D, its memory already gone) for a moment before it becomes a zombie."""
    return procfs.task_state(pid, pid) == "t"


def _snapshot_died(pid: int, st: _Attempts, how: str) -> None:
    """The snapshot process is gone: raise _Retake the first time, then CollectionError."""
    st.deaths.append(how)
    if len(st.deaths) <= SNAPSHOT_DEATH_RETRIES:
        raise _Retake("died", f"the snapshot process died during the sweep ({how})") from None
    raise CollectionError(
        f"the snapshot process of process {pid} died during the sweep "
        f"({len(st.deaths)} times: {'; '.join(st.deaths)}); nothing was reported",
        hint="something kills the target's children (an OOM killer, a process reaper, a "
             "supervisor); try again, or look for what sends the signals") from None


def _judge_unreadable(pid: int, fz, snap, st: _Attempts, exc: MemoryUnreadable) -> None:
    """Turn a failed read into a retake (the snapshot process died: once) or an error."""
    if snap.mode == "clone" and not _alive(snap.pid):
        _snapshot_died(pid, st, f"a read failed: {exc}")
    if procfs.task_state(pid, pid) in ("", "X") or procfs.read_status(pid).dying:
        raise NoSuchProcess(pid, f"process {pid} exited during the check",
                            hint=diagnose.hint_no_process(pid)) from None
    m = next((m for m in fz.maps if m.begin <= exc.address < m.end), None)
    where = (f"in {m.begin:#x}-{m.end:#x} {m.perms} {m.path or '(anonymous)'}" if m
             else "outside every mapping of the target")
    raise CollectionError(
        f"memory of process {pid} at {exc.address:#x} ({where}) could not be read from the "
        f"{'snapshot' if snap.mode == 'clone' else 'stopped target'}; nothing was reported",
        hint="this is unexpected; please report it with the output of -vv and "
             f"/proc/{pid}/smaps") from None


def _sweep_snapshot(snap, fz, st: _Attempts, sweep_timeout: float, confirm, overlays,
                    plan: SnapshotPlan, unseen: List[Range], here: bool = False,
                    dead_ranges: Sequence[Tuple[int, int]] = (),
                    waiting_tids: Sequence[int] = (), since=None) -> SweepResult:
    if snap.released:
        raise CollectionError(f"snapshot of process {snap.target_pid} was already released")
    try:
        mem = ProcessMemory(snap.pid, overlays=overlays, tolerated=plan.tolerated,
                            guarded=plan.guarded)
    except (FileNotFoundError, ProcessLookupError) as exc:
        if snap.mode == "clone":
            _snapshot_died(fz.pid, st, f"its memory could not be opened: {exc}")
        raise NoSuchProcess(fz.pid, f"process {fz.pid} exited during the check",
                            hint=diagnose.hint_no_process(fz.pid)) from None
    _warm_caches(fz.maps, fz.pid)
    maps = fz.maps
    if unseen:          # memory the sweep cannot see is neither read nor a root
        maps = [m for m in maps if not any(m.range.overlaps(u) for u in unseen)]
    def work():
        return sweep(mem, maps, waiting(fz.threads, waiting_tids), snap.pid, confirm,
                     all_uncertain=bool(unseen),
                     unwritten=plan.unwritten, retain=retain_list(),
                     release_snapshot=_early_release(snap), dead_ranges=dead_ranges,
                     since=since if here else None)
    try:
        res = run_here(work) if here else run_sweeper(work, sweep_timeout)
    finally:
        mem.close()
    if unseen:          # no verdict: a block only referenced from there would look leaked
        res.meta.setdefault("incomplete", []).append(_unseen_reason(plan, unseen))
    return res


def _look_at_writes(tracker) -> Optional[int]:
    """The tracker's look at the pages written since its last one (target frozen); its epoch,
    None without a tracker or when the look failed (the sweep then has no fresh rule)."""
    if tracker is None:
        return None
    try:
        return tracker.at_freeze()
    except Exception as exc:  # noqa: BLE001 - a lost look only loses the rule
        log.info("no look at the written pages: %s", exc)
        return None


def _track_new_mappings(tracker, fz) -> None:
    """After the thaw: the tracker registers the mappings it does not track yet."""
    if tracker is not None:
        try:
            tracker.register(fz.maps)
        except Exception as exc:  # noqa: BLE001 - untracked memory only counts as written
            log.info("no write tracking of new mappings: %s", exc)


def _since(tracker, epoch):
    return tracker.since(epoch) if tracker is not None and epoch is not None else None


def _early_release(snap):
    """For the sweeper: kill the snapshot process as soon as the sweep has copied all it reads
    (sweep(release_snapshot=...)). Only a clone: a direct sweep reads the target itself. The
    checker still collects and reaps it (Snapshot.release: a SIGKILL to a dead child is a
    no-op); until then its pid, a traced child not yet reaped, cannot be reused."""
    if snap.mode != "clone":
        return None
    pid = snap.pid

    def release():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return release


def block_tails(image: HeapImage, tails: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """The 8-aligned (begin, end) ranges past `used` bytes of each allocation that starts at
    `address`, for (address, used) in tails; an address that starts no allocation gives none."""
    out = []
    begins, sizes = image.begins, image.sizes
    for address, used in tails:
        i = bisect.bisect_left(begins, address)
        if i < len(begins) and begins[i] == address:
            b, e = (address + used + 7) & ~7, (address + sizes[i]) & ~7
            if b < e:
                out.append((b, e))
    return out


def _explain_addresses() -> List[int]:
    """MEMUNREACHABLE_EXPLAIN: hex addresses (separated by spaces or commas), or @FILE holding
    them, one per line (read at each sweep)."""
    v = os.environ["MEMUNREACHABLE_EXPLAIN"]
    if v.startswith("@"):
        try:
            with open(v[1:]) as f:
                v = f.read()
        except OSError:
            return []
    return [int(w, 16) for w in v.replace(",", " ").split()]


def _warm_caches(maps, pid: int) -> None:
    """Parse the malloc object's and the Python runtime's ELF files and import the CPython
    stages here, in the long-lived checker, so that every forked sweeper inherits them
    (elf.py: a few ms per file; the CPython imports ~60 ms, only for a Python target).
    Once per set of mapped files of a pid: the caches it fills stay (the in-process checks'
    helper checks one process again and again)."""
    global _WARMED
    key = (pid, tuple([(m.path, m.dev, m.inode, m.begin) for m in maps if m.inode]))
    if key == _WARMED:
        return
    scan = detect.scan_maps(maps, pid)
    if scan.object_mappings:
        locate.read_image(scan.object_mappings, pid)
    libstate.warm(maps, pid)
    if probe.may_hold_runtime(maps, pid):   # else the CPython stages are never loaded
        from memunreachable.heaps.cpython import (locate as cpython_locate, pipeline,  # noqa: F401
                                                  objects)
        cpython_locate.warm(maps, pid)
    _WARMED = key


_WARMED: Optional[tuple] = None


def sweep(mem, maps, threads, pid: int, confirm: Optional[set] = None,
          all_uncertain: bool = False, unwritten: Sequence[Range] = (),
          retain: Optional[list] = None, release_snapshot=None,
          dead_ranges: Sequence[Tuple[int, int]] = (), since=None) -> SweepResult:
    """Stages 4-8 over a memory image; runs inside the sweeper process.

    confirm: addresses found unreachable in an earlier snapshot; a block unreachable now but
    not then is in flight, and is treated as a root (as LSan treats suppressed blocks).
    When a thread may hold a chunk in flight (or the walk saw in-transit states), every
    unreachable address is returned too, for the confirming snapshot.
    Uncertain blocks (unreachable, but of a size a broken free list may hold; or every
    unreachable block when all_uncertain, because memory that may reference them was not
    seen) are returned apart and treated as roots, so nothing they point to is a leak.
    unwritten: file mappings the process never wrote (SnapshotPlan.unwritten): not roots.
    retain: a list that keeps the copies of the snapshot's memory past the return (the
    sweeper process, which exits right after sending the result, never frees them itself).
    release_snapshot: called once nothing more is read from the snapshot (after the roots,
    when no CPython stage and no tracking table read it later): the snapshot process can be
    killed then, its teardown overlapping the mark, and the target's copy-on-write costs end.
    dead_ranges: 8-aligned (begin, end) ranges of the target that hold no references (an
    in-process check's own alternate signal stack, idle while it waits).
    since: written.Since of this snapshot, or None: a word of memory not written since an
    earlier swept snapshot is no reference to an allocation that began after it; this sweep's
    allocations are recorded for the next.
    """
    t0 = time.monotonic()
    # 4. Enumerate allocations
    log.info("searching process %d for allocations", pid)
    uncopied_from = None
    if not probe.may_hold_runtime(maps, pid) and not os.environ.get("MEMUNREACHABLE_EXPLAIN"):
        uncopied_from = UNCOPIED_MIN_BYTES
    snapshot_mem = mem
    try:
        hw = walk_heap(mem, maps, threads, pid, uncopied_from=uncopied_from)
    except HeapInconsistent as exc:
        exc.suspect_tids = detect.threads_in_allocator(threads, maps, pid, ())
        raise
    suspect = detect.threads_in_allocator(threads, maps, pid, hw.stats.get("arena_addresses", ()))
    # 4b. CPython: pymalloc blocks are allocations, its arenas and dead memory are not roots,
    # GC links are not references (cpython/pipeline.py)
    # what the walk copied is not read again; the data mappings are read once, here
    uncopied = bool(hw.stats.get("uncopied_bytes"))     # the low-memory sweep
    mem = CopiedMemory(mem, [r for r in hw.image.regions if not is_uncopied(r[1])] + hw.spare
                       + read_copies(mem, data_ranges(maps, unwritten), skip_unreadable=True),
                       unwritten_file_pages(maps, unwritten))
    cps = _see_through_cpython(mem, maps, threads, pid, hw.image)
    image, dead = cps.image, cps.dead
    # 4c. ld.so's l_gnu_chain_zero words: addresses computed below an object, not references;
    # its path strings' stale slack past their NUL
    found = linkmaps.of_process(mem, pid, maps)
    chain_words = [(w, w + 8) for w in found.words]
    # 4e. readline's keymap padding, its line buffer, terminfo's tables, the environment's
    # strings: stale bytes, text
    libs = libstate.of_process(mem, maps, pid)
    dead = with_dead_ranges(dead, chain_words + libs.ranges + block_tails(image, libs.tails + found.string_tails)
                            + list(dead_ranges))
    t_walk = time.monotonic()
    # 4d. Tracking table (memunreachable run): never a root, it points at every block
    table = tracking.find_table(mem, maps)
    # 5. Roots
    roots = classify(maps, threads, hw.heap_ranges, hw.metadata_ranges,
                     list(cps.root_cuts) + list(unwritten) + list(hw.holes)
                     + (table.cuts if table is not None else []),
                     procfs.read_guard_runs(pid, stack_maps(maps, threads)))
    root_buffers = []
    for r in roots.ranges:
        buf = mem.view(r.begin, r.size)
        if buf is None:
            buf = bytearray(r.size)
            mem.read_into(r.begin, buf)
        root_buffers.append((r.begin, buf))
    if release_snapshot is not None and not cps.usable and table is None and not uncopied:
        release_snapshot()          # every byte the sweep needs is copied now
    # 5b. Written pages (in-process checks): stale words are no references to fresh blocks
    nfresh = 0
    if since is not None and since.unwritten:
        levels, nfresh = since.fresh(image.begins)
        if nfresh:
            dead = dataclasses.replace(dead or DeadWords(), fresh=levels,
                                       unwritten=since.unwritten)
    t_roots = time.monotonic()
    # 6. Mark
    log.info("sweeping process %d for unreachable memory", pid)
    marked = mark(image, root_buffers, roots.words, dead=dead)
    begins, sizes = image.begins, image.sizes
    leaks = None
    if uncopied:
        # the unreachable blocks' bytes, read now (the fold, the contents, uncertain roots)
        leaks = _LeakImage(snapshot_mem, image, marked.marked)
        contents = _ContentsReader(leaks.image)
    else:
        contents = _ContentsReader(image)
    unsure_sizes = hw.uncertain_sizes
    unmarked = _unmarked(marked.marked) if (confirm is not None or unsure_sizes or
                                            all_uncertain) else []
    uncertain = [i for i in unmarked if all_uncertain or sizes[i] in unsure_sizes]
    unconfirmed = 0
    extra = []
    if confirm is not None:
        unsure = set(uncertain)
        extra = [i for i in unmarked if begins[i] not in confirm and i not in unsure]
        unconfirmed = len(extra)
    if uncertain or extra:
        # treat them as roots: what they point to is not reported either
        more = uncertain + extra
        root_buffers += [(begins[i], contents.view(begins[i], sizes[i])) for i in more]
        marked = mark(image, root_buffers, list(roots.words) + [begins[i] for i in more],
                      dead=dead)
    if uncopied and release_snapshot is not None and table is None:
        release_snapshot()          # the mark has read all it needs; the leaks are copied
    if since is not None:
        since.swept(image.begins)
    t_mark = time.monotonic()
    explained = _explain_addresses() if os.environ.get("MEMUNREACHABLE_EXPLAIN") else []
    if explained:                       # diagnostic: explain.py (no address yet: no cost)
        from memunreachable.sweep.explain import explain
        from memunreachable.sweep.mark import scanned_blocks
        blocks = functools.lru_cache(1)(lambda: scanned_blocks(image, marked.marked, dead))
        lines = [line for addr in explained
                 for line in explain(addr, image, root_buffers, marked.marked,
                                     dead.ranges if dead else (), blocks, threads,
                                     dead.head_word if dead else None, maps, mem)]
        for line in lines:
            log.warning("%s", line)
        if os.environ.get("MEMUNREACHABLE_EXPLAIN_LOG"):   # where no capture hides them
            with open(os.environ["MEMUNREACHABLE_EXPLAIN_LOG"], "a") as f:
                f.write("".join(line + "\n" for line in lines))
    del root_buffers
    # 6b. CPython: unreachable Python objects, and which of them are cyclic garbage
    py = _python_objects(mem, cps, image, marked.marked, contents) if cps.usable else None
    leak_flags = marked.marked if py is None else py.leak_flags
    # 7. Fold
    log.info("folding related leaks")
    if leaks is not None:
        folded = leaks.fold(leak_flags, dead=dead)
    else:
        folded = fold(image, leak_flags, dead=dead)
    garbage = (fold(image, py.garbage_flags, dead=dead)
               if py is not None and py.garbage else [])
    t_fold = time.monotonic()
    # 8. Result
    leaked_mask = bytes(leak_flags).translate(_INVERT)
    mark_method, mark_reason = marked.method(uncopied)
    num_leaks, all_bytes, leak_bytes = size_totals(sizes, leaked_mask)
    res = SweepResult(
        num_allocations=len(sizes),
        allocation_bytes=all_bytes,
        num_leaks=num_leaks,
        leak_bytes=leak_bytes,
        bytes_scanned=marked.root_bytes + marked.heap_bytes,
    )
    objects = py.objects if py is not None else {}
    if py is not None:      # a short repr only for the objects that head an entry
        from memunreachable.heaps.cpython.objects import with_repr
        for f in list(folded) + list(garbage):
            if f.index in objects:
                objects[f.index] = with_repr(py.reader, objects[f.index],
                                             begins[f.index] + sizes[f.index])
    for f in folded:
        res.entries.append(_entry(f, begins, sizes, contents, objects))
    for f in garbage:
        res.cyclic_garbage.append(_entry(f, begins, sizes, contents, objects))
    # 8b. Allocation stacks and requested sizes of the leaks, from the tracking table
    if table is not None:
        # under CPython's debug hooks a block starts with their 16-byte prefix: the tracker
        # recorded the pointer the hooks hand out (the domains are routed around them)
        debug = False
        if cps.cpython is not None and cps.cpython.found:
            from memunreachable.heaps.cpython.pipeline import has_debug_hooks
            from memunreachable.heaps.cpython.layout import DEBUG_HOOK_PREFIX
            debug = has_debug_hooks(cps.cpython)
        for e in res.entries + res.cyclic_garbage:
            for b in [e] + e.indirect:
                a = table.annotate(b.address, b.size)
                if debug and a.status == "untracked":
                    a = table.annotate(b.address + DEBUG_HOOK_PREFIX, b.size - DEBUG_HOOK_PREFIX)
                b.stack, b.python_stack, b.stack_status = a.stack, a.python_stack, a.status
                b.requested_size, b.epoch = a.requested, a.epoch
    for i in uncertain:
        res.uncertain.append(SweepEntry(begins[i], sizes[i], 0, 0,
                                        contents.read(begins[i], min(sizes[i], CONTENTS_BYTES))))
    res.meta = {
        "allocator": {"name": hw.allocator.name, "version": hw.allocator.version},
        "warnings": list(hw.soft_issues) + _tolerated_warning(mem) + cps.warnings
                    + (py.warnings if py is not None else []),
        # what could not be seen: no "no leaks" verdict then (check's verdict())
        "incomplete": list(cps.blind),
        "stats": dict(hw.stats),
        "seconds": {"walk": t_walk - t0, "roots": t_roots - t_walk, "mark": t_mark - t_roots,
                    "fold": t_fold - t_mark},
        "root_bytes": marked.root_bytes,
        "heap_bytes": marked.heap_bytes,
        "soft_issues": list(hw.soft_issues),
        "unconfirmed": unconfirmed,
        "suspect_tids": suspect,
        "fresh_blocks": nfresh,
        "stale_words": marked.stale,
        # which way the mark read the heap and why (issue 25; mark.MarkResult.method)
        "mark_method": mark_method,
        "mark_switch_reason": mark_reason,
        "mark_waves": marked.waves,
        "mark_reads": marked.reads,
    }
    if table is not None:
        res.meta["tracking"] = table.summary()
    if cps.cpython is not None and cps.cpython.found:
        res.meta["cpython"] = dict(cps.stats, usable=cps.usable,
                                   garbage_blocks=len(py.garbage) if py is not None else 0,
                                   dead_objects=py.dead if py is not None else 0)
    if suspect or hw.soft_issues or confirm is not None:
        res.leak_addresses = list(compress(begins, leaked_mask))
    if retain is not None:
        retain.append((hw, cps, mem, image, marked))
    return res


# Indirect leaks sent per entry (each with its stack); the entry's counts cover all of them.
INDIRECT_LIMIT = 1000


def _entry(f, begins, sizes, contents, objects) -> SweepEntry:
    addr, size = begins[f.index], sizes[f.index]
    e = SweepEntry(addr, size, f.referenced_count, f.referenced_size,
                   contents.read(addr, min(size, CONTENTS_BYTES)),
                   num_indirect=len(f.blocks), indirect_size=sum(sizes[b] for b in f.blocks),
                   indirect=[SweepEntry(begins[b], sizes[b], 0, 0, b"")
                             for b in f.blocks[:INDIRECT_LIMIT]])
    info = objects.get(f.index)
    if info is not None:
        e.python_type, e.refcount, e.repr = info.type_name, info.refcount, info.repr
    return e


def _see_through_cpython(mem, maps, threads, pid, image):
    """cpython.pipeline.prepare, or glibc's image alone with a warning if it fails: a bug in
    the CPython map must never turn into a wrong answer."""
    if not probe.may_hold_runtime(maps, pid):
        return _NoCPython(image)    # what pipeline.prepare gives, without loading it
    from memunreachable.heaps.cpython import pipeline
    try:
        return pipeline.prepare(mem, maps, threads, pid, image)
    except (OSError, ValueError, MemoryUnreadable, struct.error) as exc:
        log.warning("CPython map failed: %s", exc)
        out = pipeline.CPythonSweep(None, image)
        out.cannot_see(f"CPython's memory could not be mapped ({exc}): it is scanned whole as "
                       "roots")
        return out


class _NoCPython(Fields):
    """pipeline.CPythonSweep of a process without a CPython runtime (cpython/probe.py)."""
    __slots__ = ("image", "cpython", "root_cuts", "dead", "warnings", "stats", "usable")
    blind: tuple = ()

    def __init__(self, image: object, cpython: None = None, root_cuts: Optional[list] = None,
                 dead: None = None, warnings: Optional[list] = None, stats: Optional[dict] = None,
                 usable: bool = False):
        self.image = image
        self.cpython = cpython
        self.root_cuts = [] if root_cuts is None else root_cuts
        self.dead = dead
        self.warnings = [] if warnings is None else warnings
        self.stats = {} if stats is None else stats
        self.usable = usable


class _PythonLeaks(Fields):
    __slots__ = ("objects", "garbage", "leak_flags", "garbage_flags", "warnings", "dead", "reader")

    def __init__(self,
                 objects: dict,           # allocation index -> PyObjectInfo
                 garbage: set,            # indices of cyclic garbage (not leaks)
                 # marked flags with the garbage marked too: fold the leaks
                 leak_flags: bytearray,
                 # marked flags with the leaks marked too: fold the garbage
                 garbage_flags: bytearray, warnings: list,
                 dead: int = 0,           # unreachable refcount-0 (dead) objects, not reported
                 reader: object = None):  # the ObjectReader (reprs of the entries' heads)
        self.objects = objects
        self.garbage = garbage
        self.leak_flags = leak_flags
        self.garbage_flags = garbage_flags
        self.warnings = warnings
        self.dead = dead
        self.reader = reader


def _python_objects(mem, cps, image, marked, contents) -> _PythonLeaks:
    """Name the unreachable Python objects and split off the cyclic garbage
    (cpython/objects.py)."""
    from memunreachable.heaps.cpython import objects as O
    from memunreachable.heaps.cpython.pipeline import object_reader
    reader = object_reader(mem, cps.cpython)
    begins, sizes = image.begins, image.sizes
    unmarked = _unmarked(marked)
    warnings = []
    if len(unmarked) > O.MAX_OBJECTS:
        warnings.append(f"{len(unmarked)} unreachable blocks are too many to name Python "
                        "objects and tell cyclic garbage from leaks: all are reported as leaks")
        return _PythonLeaks({}, set(), bytearray(marked), bytearray(marked), warnings, 0, reader)
    objects = O.objects_in(reader, begins, sizes, unmarked, contents.read)
    head_word = cps.dead.head_word if cps.dead is not None else None
    garbage, _ = O.split_garbage(begins, sizes, unmarked, objects,
                                 lambda i: O.block_words(contents.view(begins[i], sizes[i]),
                                                         head_word, i))
    if garbage is None:
        warnings.append(f"{len(unmarked)} unreachable blocks are too many to tell cyclic "
                        "garbage from leaks: all are reported as leaks")
        garbage = set()
    # refcount-0 objects are dead (free-listed, zombie frames): neither leak nor garbage
    dead = {i for i in garbage if i in objects and objects[i].refcount == 0
            and not objects[i].immortal}
    garbage -= dead
    leak_flags = bytearray(marked)
    garbage_flags = bytearray(marked)
    for i in garbage | dead:
        leak_flags[i] = 1
    for i in unmarked:
        if i not in garbage:
            garbage_flags[i] = 1
    return _PythonLeaks(objects, garbage, leak_flags, garbage_flags, warnings, len(dead), reader)


def _unmarked(marked) -> list:
    """Indices of unmarked allocations."""
    out, i = [], marked.find(0)
    while i >= 0:
        out.append(i)
        i = marked.find(0, i + 1)
    return out


_INVERT = bytes([1] + [0] * 255)


def _tolerated_warning(mem) -> list:
    n = getattr(mem, "tolerated_bytes", 0)
    return [f"{n} bytes of file pages past the end of their file (or device memory) could "
            "not be read; they cannot hold pointers"] if n else []


# Unreachable blocks closer than this share one read (_LeakImage).
LEAK_READ_GAP = 4096


class _LeakImage:
    """The unreachable blocks of a low-memory sweep's image, copied from the snapshot once
    the mark is done: image (a HeapImage of them alone, each inside a copy of its run of
    neighbours closer than LEAK_READ_GAP) serves the fold and the reported contents."""

    def __init__(self, mem, image, marked):
        self.index = _unmarked(marked)
        begins, sizes = image.begins, image.sizes
        lb, ls = array("Q", (begins[i] for i in self.index)), array("Q", (sizes[i] for i in self.index))
        runs: List[Range] = []
        for b, n in zip(lb, ls):
            e = b + max(n, 1)
            if runs and b <= runs[-1].end + LEAK_READ_GAP:
                runs[-1] = Range(runs[-1].begin, max(runs[-1].end, e))
            else:
                runs.append(Range(b, e))
        self.image = HeapImage(lb, ls, read_copies(mem, runs))

    # fold() over the whole image with these flags, computed over the unreachable blocks
    # alone (the fold follows edges between unreachable blocks only): indices are the image's.
    def fold(self, flags, dead) -> list:
        sub = bytearray(flags[i] for i in self.index)
        ix = self.index
        return [FoldedLeak(ix[f.index], f.referenced_count, f.referenced_size,
                           [ix[b] for b in f.blocks])
                for f in fold(self.image, sub, dead=dead)]


class _ContentsReader:
    """First bytes of an allocation, from the walker's local copies of the heap."""

    def __init__(self, image):
        self.regions = sorted(image.regions, key=lambda r: r[0])
        self.bases = [r[0] for r in self.regions]

    def view(self, addr: int, n: int) -> memoryview:
        i = bisect.bisect_right(self.bases, addr) - 1
        if i < 0:
            return memoryview(b"")
        base, buf = self.regions[i]
        off = addr - base
        return memoryview(buf)[off:off + n]

    def read(self, addr: int, n: int) -> bytes:
        return bytes(self.view(addr, n))


def _tracking_warnings(t: Optional[dict]) -> List[str]:
    """A full tracking table is never silent: blocks without a stack are said."""
    if not t:
        return []
    out = []
    if t.get("table_full_blocks"):
        out.append(f"{t['table_full_blocks']} block(s) got no allocation stack: the stack table "
                   f"is full ({t.get('budget_bytes', 0) // (1 << 20)} MiB budget; raise "
                   "MEMUNREACHABLE_TRACK_BUDGET or `run --budget`)")
    if t.get("dropped_blocks"):
        out.append(f"{t['dropped_blocks']} block(s) are not in the tracking table: its live-block "
                   "table is full (raise MEMUNREACHABLE_TRACK_BUDGET or `run --budget`)")
    return out


def _leak(e: SweepEntry) -> Leak:
    return Leak(e.address, e.size, e.referenced_count, e.referenced_size, e.contents,
                python_type=e.python_type, refcount=e.refcount, repr=e.repr,
                stack=list(e.stack), python_stack=list(e.python_stack),
                stack_status=e.stack_status, requested_size=e.requested_size, epoch=e.epoch,
                num_indirect=e.num_indirect, indirect_size=e.indirect_size,
                indirect=[_leak(b) for b in e.indirect])


# suppressions.py and symbolize.py load only when a check needs them (issue 10, fast start)
def _rules(suppressions) -> list:
    """suppressions.as_rules(suppressions)."""
    if suppressions is None:
        return []
    from memunreachable.stacks import suppressions as suppressions_stage
    return suppressions_stage.as_rules(suppressions)


def _symbolize_and_group(info: UnreachableMemoryInfo, leaks: List[Leak], limit: Optional[int],
                         resolve: bool, rules) -> None:
    """Step 9: backtraces for the leaks (all of them when suppressions must see them, else only
    the groups kept), suppressed leaks out of the counts, groups by stack, the limit."""
    t0 = time.monotonic()
    opts = dict(resolve=resolve, pid=info.pid)
    if rules:
        from memunreachable.stacks import suppressions as suppressions_stage
        _backtraces(info, leaks, opts)
        leaks, gone = suppressions_stage.apply(rules, leaks)
        info.num_suppressed = sum(l.entry_count for l in gone)
        info.suppressed_bytes = sum(l.entry_size for l in gone)
        info.num_leaks -= info.num_suppressed
        info.leak_bytes -= info.suppressed_bytes
        info.suppressions_used = suppressions_stage.used(rules)
    info.groups, info.truncated = group_leaks(leaks, limit)
    info.leaks = members(info.groups)
    if not rules:
        _backtraces(info, info.leaks, opts)
    _backtraces(info, [b for l in info.leaks for b in l.indirect], opts)
    info.stats["symbolize_seconds"] = time.monotonic() - t0


def _backtraces(info: UnreachableMemoryInfo, leaks: List[Leak], opts: dict) -> None:
    """symbolize.symbolize_leaks; a failure there costs the names (module+offset is still
    shown, with a warning), never the report. Without any stack there is nothing to name:
    every backtrace stays []."""
    if not any(leak.stack or leak.python_stack for leak in leaks):
        return
    from memunreachable.stacks import symbolize as symbolize_stage
    try:
        symbolize_stage.symbolize_leaks(leaks, info.modules, **opts)
    except Exception as exc:  # noqa: BLE001 - a symbolizer bug must not lose the leaks
        log.warning("symbolization failed: %s", exc, exc_info=True)
        info.warnings.append(f"allocation stacks could not be symbolized ({type(exc).__name__}: "
                             f"{exc}): frames are shown as module+offset")
        symbolize_stage.symbolize_leaks(leaks, info.modules, **dict(opts, resolve=False))


# Returns every leak entry of the sweep as a Leak (unsorted); fills the rest of info.
def _fill(info: UnreachableMemoryInfo, res: SweepResult, limit: Optional[int]) -> List[Leak]:
    info.allocator_name = res.meta.get("allocator", {}).get("name", "glibc")
    info.allocator_version = res.meta.get("allocator", {}).get("version")
    info.num_allocations = res.num_allocations
    info.allocation_bytes = res.allocation_bytes
    info.num_leaks = res.num_leaks
    info.leak_bytes = res.leak_bytes
    info.bytes_scanned = res.bytes_scanned
    info.warnings.extend(res.meta.get("warnings", []))
    info.incomplete = list(dict.fromkeys(info.incomplete + res.meta.get("incomplete", [])))
    info.stats = res.meta
    info.tracking = res.meta.get("tracking")
    info.warnings.extend(_tracking_warnings(info.tracking))
    leaks = [_leak(e) for e in res.entries]
    info.num_uncertain = len(res.uncertain)
    info.uncertain_bytes = sum(e.size for e in res.uncertain)
    info.uncertain, _ = sort_and_limit([Leak(e.address, e.size, 0, 0, e.contents)
                                        for e in res.uncertain], limit)
    info.num_cyclic_garbage = sum(1 + e.num_indirect for e in res.cyclic_garbage)
    info.cyclic_garbage_bytes = sum(e.size + e.indirect_size for e in res.cyclic_garbage)
    info.cyclic_garbage, _ = sort_and_limit([_leak(e) for e in res.cyclic_garbage], limit)
    return leaks
