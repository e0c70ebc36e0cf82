"""deferred.py: a check in two halves, for the in-process checks' batches (_tracer.py).

    check_later(pid, ...) -> Pending | None   steps 1-3 of check() now (the same pause), or
                                    None when a later sweep could not give a valid result
                                    (the caller runs check() instead)
    record_allocations(pending)     the allocations of a waiting snapshot, for the write
                                    tracker's fresh rule (written.py), without a sweep
    sweep_pending(pending, ...) -> UnreachableMemoryInfo   steps 4-10 over it, then its release
    Pending.release()               kill and reap the snapshot process, drop the lock
A baseline taken this way is swept only when the check after it finds a leak. The steps
themselves are unreachable.py's (check); this module only defers the sweep. No retake is
possible once the target ran on: what check() would retake is an error here.
"""
from __future__ import annotations

import logging
import struct
import time
from typing import Optional, Sequence, Tuple

from memunreachable import unreachable
from memunreachable.collect import diagnose, leftovers, procfs
from memunreachable.collect import preflight as preflight_stage
from memunreachable.collect.freeze import frozen
from memunreachable.collect.memory import CopiedMemory, ProcessMemory, SnapshotPlan
from memunreachable.collect.snapshot import prepare as prepare_snapshot, take_snapshot
from memunreachable.heaps.cpython import probe
from memunreachable.heaps.glibc.walker import HeapInconsistent, walk_heap
from memunreachable.stacks import tracking
from memunreachable.sweep import detect, retake, steps
from memunreachable.sweep.sweeper import SweepResult
from memunreachable._errors import (CollectionError, HeapWalkError, MemoryUnreadable,
                                    MemunreachableError)
from memunreachable.reporters.report import UnreachableMemoryInfo

log = logging.getLogger("memunreachable")

DEFER_MAX_RSS = 256 << 20       # check_later: larger processes are swept at once


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
            except (retake.Retake, MemunreachableError) as exc:
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
    later sweep cannot copy); raises what retake.plan_reads raises."""
    plan, unseen = retake.plan_reads(fz, snap, [], retake.Attempts(), info)
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
            epoch = unreachable.look_at_writes(tracker)
            fz.thaw()
            unreachable.track_new_mappings(tracker, fz)
            info.modules = tracking.modules(fz.maps)
            plan = None
            if not plan_later:
                try:
                    plan, lacking = _pending_plan(fz, snap, info)
                except retake.Retake:
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
    rules = unreachable.suppression_rules(suppressions)
    info, fz, snap = pending.info, pending.fz, pending.snap
    try:
        result = _sweep_pending(pending)
    except retake.Retake as r:
        raise CollectionError(f"the snapshot of process {fz.pid} could not be swept "
                              f"({r.reason}); nothing was reported", hint="try again") from None
    finally:
        pending.release()
    info.snapshot_ms += snap.lifetime_ms
    info.warnings.extend(w for w in snap.warnings if w not in info.warnings)
    leaks = unreachable.fill_info(info, result, limit)
    unreachable.symbolize_and_group(info, leaks, limit, symbolize, rules)
    info.duration_ms = (time.monotonic() - started) * 1000.0
    return unreachable.verdict(info, partial)


def record_allocations(pending: Pending) -> bool:
    """Record the allocations of a waiting snapshot with its write tracker (written.py), as a
    sweep of it would: the fresh rule of the sweeps after it then counts from its moment too
    (the pytest plugin's batches sweep one snapshot in ten, and a stale copy of an address
    freed during the batch, hidden in memory unwritten since, would point into a block that
    leaked at that address later in it). Only the walks, about a third of a sweep. False when
    nothing was recorded (no tracker, a walk that failed: the rule counts from an earlier
    snapshot then, as without tracking)."""
    tracker, fz, snap = pending.tracker, pending.fz, pending.snap
    if tracker is None or pending.epoch is None or snap.released or not retake.alive(snap.pid):
        return False
    plan = pending.plan         # None: not planned (complete()), read as it is
    try:
        mem = ProcessMemory(snap.pid, overlays=[], tolerated=plan.tolerated if plan else [],
                            guarded=plan.guarded if plan else [])
    except OSError:
        return False
    try:
        steps.warm_caches(fz.maps, fz.pid)
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
    if not retake.alive(snap.pid):
        raise retake.Retake("died", "the snapshot process died before its sweep")
    if not pending.complete():
        raise retake.Retake("lacking", f"it lacks memory ({pending.lacking})")
    try:
        return steps.sweep_snapshot(snap, fz, retake.Attempts(), 600.0, None, [], pending.plan, [],
                                    True, pending.dead_ranges, pending.waiting_tids,
                                    unreachable.written_since(pending.tracker, pending.epoch))
    except HeapInconsistent as exc:
        raise HeapWalkError(f"the heap of process {fz.pid} was inconsistent in a snapshot taken "
                            f"with no thread inside malloc/free ({exc}); nothing was reported",
                            hint="the heap may be corrupt; run the program under valgrind or "
                                 "with MALLOC_CHECK_=3") from None
    except MemoryUnreadable as exc:
        retake.judge_unreadable(fz.pid, fz, snap, retake.Attempts(), exc)      # raises
