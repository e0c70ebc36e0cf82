"""unreachable.py: the orchestrator of `check <pid>` (docs/how-it-works.md).

    1. preflight   the pid is a user process we may trace              collect/preflight.py
    2. collect     freeze every thread, capture registers and maps      collect/freeze.py
    3. snapshot    inject clone(0) -> a copy-on-write child; thaw the target at once
                                                                        collect/snapshot.py
    4-8. sweep     in a forked sweeper (the in-process checks' helper: in itself, sweep_here):
                   enumerate allocations, roots, mark, fold             sweep/steps.py
    9. symbolize   allocation stacks -> frames; suppressions; leaks grouped by stack (issue 9)
   10. report      UnreachableMemoryInfo (sorted, limited); the CLI renders it

A result is valid or it is an error. A snapshot that cannot give a valid result is retaken,
bounded (MAX_RETRIES; the judgement is sweep/retake.py's): a hard heap inconsistency (a thread
stopped inside malloc; the same inconsistency twice with no thread there is a corrupt heap: an
error at once), memory the snapshot lacks (MADV_DONTFORK: known from the target's smaps before
the clone and copied during the same pause; a retake copies what appeared in between), a
snapshot process that died during the sweep (once). Docs: docs/reliability.md.

deferred.py takes steps 1-3 now and leaves 4-10 for later (the in-process checks' batches: a
baseline swept only when the check after it finds a leak); it shares steps 9-10 with check().
"""
from __future__ import annotations

import logging
import time
from typing import List, Optional, Sequence, Tuple

from memunreachable.collect import diagnose, leftovers
from memunreachable.collect import preflight as preflight_stage
from memunreachable.collect.freeze import frozen
from memunreachable.collect.memory import capture
from memunreachable.collect.snapshot import prepare as prepare_snapshot, take_snapshot
from memunreachable.heaps.glibc.walker import HeapInconsistent
from memunreachable.stacks import tracking
from memunreachable.sweep import retake, steps
from memunreachable.sweep.sweeper import SweepEntry, SweepResult
from memunreachable._errors import CollectionError, HeapWalkError, IncompleteCheck, MemoryUnreadable
from memunreachable._types import merge_ranges, subtract_ranges
from memunreachable.reporters.report import (Leak, UnreachableMemoryInfo, group_leaks, members,
                                            sort_and_limit)

log = logging.getLogger("memunreachable")

MAX_RETRIES = 20


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
    rules = suppression_rules(suppressions)            # a bad file fails before any pause
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
        info.warnings.append(f"snapshot retaken {n} time(s): {retake.RETAKE_WORDS[kind]}")
    # 9. Symbolize, suppress, group
    leaks = fill_info(info, result, limit)
    symbolize_and_group(info, leaks, limit, symbolize, rules)
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


def _snapshot_and_sweep(pid: int, info: UnreachableMemoryInfo, confirm, **opts) -> SweepResult:
    """Steps 2-8, retaking the snapshot when it cannot give a valid result; returns the
    SweepResult or raises (HeapCorrupt, HeapWalkError, CollectionError, ...)."""
    st = retake.Attempts()
    for attempt in range(MAX_RETRIES + 1):
        try:
            return _one_snapshot(pid, info, confirm, st, **opts)
        except retake.Retake as r:
            if r.kind == "inflight":
                retake.judge_inconsistency(pid, st, r.error)
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


def _one_snapshot(pid: int, info: UnreachableMemoryInfo, confirm, st: retake.Attempts, *,
                  timeout: float, sweep_timeout: float, allow_direct: bool,
                  allow_seccomp: bool, sweep_here: bool = False,
                  dead_ranges: Sequence[Tuple[int, int]] = (),
                  waiting_tids: Sequence[int] = (), tracker=None) -> SweepResult:
    """One freeze + snapshot + sweep. Raises retake.Retake when a fresh snapshot may succeed."""
    # 2. Collect: freeze every thread, registers, maps
    log.info("collecting thread info for process %d", pid)
    prepare_snapshot(pid, timeout)          # record write and first-time reads: not in the pause
    to_copy = merge_ranges(st.capture + retake.lacking_before_clone(pid))
    info.snapshots += 1
    with frozen(pid, timeout=timeout) as fz:
        # 3. Snapshot: clone(0) injected into a stopped thread, then thaw at once
        try:
            snap = take_snapshot(fz, allow_direct=allow_direct, allow_seccomp=allow_seccomp)
        except CollectionError as exc:
            if getattr(exc, "snapshot_lost", False):
                retake.snapshot_died(pid, st, str(exc))   # killed while it was being parked
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
            epoch = look_at_writes(tracker)
            if snap.mode == "clone":
                fz.thaw()
                track_new_mappings(tracker, fz)
            elif not any(w.startswith("no snapshot") for w in info.warnings):
                info.warnings.append(f"no snapshot ({snap.reason}): the target stayed "
                                     "stopped for the whole sweep")
            log.info("target paused %.2f ms (%d threads), snapshot %s",
                     fz.pause_ms, len(fz.threads), snap.mode)
            plan, unseen = retake.plan_reads(fz, snap, overlays, st, info)
            # 4-8. Sweep in a forked process
            try:
                return steps.sweep_snapshot(snap, fz, st, sweep_timeout, confirm, overlays, plan,
                                            unseen, sweep_here, dead_ranges, waiting_tids,
                                            written_since(tracker, epoch))
            except HeapInconsistent as exc:
                log.info("heap was mid-update (%s)", exc)
                raise retake.Retake("inflight", str(exc), exc) from None
            except MemoryUnreadable as exc:
                retake.judge_unreadable(pid, fz, snap, st, exc)
        finally:
            snap.release()
            if snap.mode != "clone":
                fz.thaw()
            info.pause_ms += fz.pause_ms + snap.reap_pause_ms
            info.snapshot_ms += snap.lifetime_ms
            info.snapshot_mode = snap.mode
            info.threads = len(fz.threads)
            info.warnings.extend(w for w in snap.warnings if w not in info.warnings)


def look_at_writes(tracker) -> Optional[int]:
    """The tracker's look at the pages written since its last one (target frozen); its epoch,
    None without a tracker or when the look failed (the sweep then has no fresh rule)."""
    if tracker is None:
        return None
    try:
        return tracker.at_freeze()
    except Exception as exc:  # noqa: BLE001 - a lost look only loses the rule
        log.info("no look at the written pages: %s", exc)
        return None


def track_new_mappings(tracker, fz) -> None:
    """After the thaw: the tracker registers the mappings it does not track yet."""
    if tracker is not None:
        try:
            tracker.register(fz.maps)
        except Exception as exc:  # noqa: BLE001 - untracked memory only counts as written
            log.info("no write tracking of new mappings: %s", exc)


def written_since(tracker, epoch):
    return tracker.since(epoch) if tracker is not None and epoch is not None else None


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
def suppression_rules(suppressions) -> list:
    """suppressions.as_rules(suppressions)."""
    if suppressions is None:
        return []
    from memunreachable.stacks import suppressions as suppressions_stage
    return suppressions_stage.as_rules(suppressions)


def symbolize_and_group(info: UnreachableMemoryInfo, leaks: List[Leak], limit: Optional[int],
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
def fill_info(info: UnreachableMemoryInfo, res: SweepResult, limit: Optional[int]) -> List[Leak]:
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
