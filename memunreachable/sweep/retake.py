"""retake.py: Stages 2-8 judgement: can this snapshot give a valid result, or is a fresh one
needed (docs/how-it-works.md, docs/reliability.md)?

A result is valid or it is an error. A snapshot that cannot give one raises Retake (kind:
"inflight", "capture", "died"), and the orchestrator (unreachable.py) takes another, bounded:
    judge_inconsistency(pid, st, exc)   a heap caught mid-update: retake, unless it is the same
                                        twice with no thread inside malloc/free (HeapCorrupt)
    plan_reads(fz, snap, overlays, st, info) -> (SnapshotPlan, unseen)
                                        memory the snapshot lacks (MADV_DONTFORK/WIPEONFORK):
                                        retake once, copying it during the next pause
    snapshot_died(pid, st, how)         the snapshot process was killed: retake once
    judge_unreadable(pid, fz, snap, st, exc)   a failed read: a death, an exit, or an error
Attempts carries what one snapshot teaches the next. lacking_before_clone(pid) reads, before
the freeze, what a fork of pid will lack.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from memunreachable.collect import diagnose, leftovers, procfs
from memunreachable._errors import CollectionError, HeapCorrupt, MemoryUnreadable, NoSuchProcess
from memunreachable._types import Fields, Range, merge_ranges, subtract_ranges
from memunreachable.sweep.classify import loaded_objects
from memunreachable.heaps.glibc.walker import HeapInconsistent
from memunreachable.collect.memory import (SnapshotPlan, lacking_in_fork, mapped_file_size,
                                           plan_snapshot)

SNAPSHOT_DEATH_RETRIES = 1       # a snapshot process killed during the sweep: retake once
MAX_CAPTURE_BYTES = 512 << 20    # MADV_DONTFORK memory copied during a pause, at most
RETAKE_WORDS = {"inflight": "a thread was inside malloc/free",
                "capture": "memory not in the snapshot (MADV_DONTFORK/WIPEONFORK) had to be "
                           "copied during the pause",
                "died": "the snapshot process died during the sweep"}


class Retake(Exception):
    """This snapshot cannot give a valid result, a fresh one may: kind says why."""

    def __init__(self, kind: str, reason: str, error: Exception = None):
        super().__init__(reason)
        self.kind, self.reason, self.error = kind, reason, error


class Attempts(Fields):
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


def judge_inconsistency(pid: int, st: Attempts, exc: HeapInconsistent) -> None:
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


def plan_reads(fz, snap, overlays, st: Attempts, info) -> tuple:
    """(SnapshotPlan, unseen ranges) for the sweep; raises Retake once when the snapshot lacks
    memory that a fresh snapshot can capture during its pause."""
    if snap.mode != "clone":
        return _direct_plan(fz.pid, fz.maps), []
    try:
        smaps = procfs.read_smaps_flags(snap.pid)
    except (NoSuchProcess, OSError, ValueError) as exc:
        snapshot_died(fz.pid, st, f"its smaps could not be read: {exc}")
    if not alive(snap.pid):    # killed while (or before) its smaps were read: they are empty
        snapshot_died(fz.pid, st, "killed before its mappings were read")
    plan = plan_snapshot(fz.maps, smaps, mapped_file_size(fz.pid, loaded_objects(fz.maps)))
    _note_lacking(fz.pid, bool(plan.missing))
    have = merge_ranges([Range(b, b + len(buf)) for b, buf in overlays])
    unseen = subtract_ranges(plan.missing, have)
    if unseen and not st.capture_tried and plan.missing_bytes <= MAX_CAPTURE_BYTES:
        st.capture, st.capture_tried = plan.missing, True
        raise Retake("capture", plan.why_missing() + ": copying it during the next pause")
    if overlays and not unseen:
        info.warnings.append(
            f"{sum(len(b) for _, b in overlays)} bytes of memory the snapshot lacks "
            f"({plan.why_missing()}) were copied from the stopped target during the pause")
    if unseen:
        info.warnings.append(unseen_reason(plan, unseen))
    return plan, unseen


def unseen_reason(plan: SnapshotPlan, unseen: List[Range]) -> str:
    """What a sweep with memory the snapshot lacks cannot see (a warning, and the reason its
    check is incomplete)."""
    return (f"{sum(r.size for r in unseen)} bytes of the target's memory are not in the "
            f"snapshot ({plan.why_missing()}) and could not be copied during the pause: "
            "every unreachable block is reported as uncertain, not as a leak")


# (pid, start time) -> whether the last snapshot of that process lacked memory; one process at
# a time (the plugin checks the same one after every test), like sites.GUARDS
_LACKED: Dict[Tuple[int, int], bool] = {}


def _process_key(pid: int) -> Tuple[int, int]:
    st = leftovers.read_stat(pid)
    return pid, st.start if st is not None else -1


def lacking_before_clone(pid: int) -> List[Range]:
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


def alive(pid: int) -> bool:
    """A healthy snapshot process is always in a traced stop ('t'); after a SIGKILL it runs
    (R/D, its memory already gone) for a moment before it becomes a zombie."""
    return procfs.task_state(pid, pid) == "t"


def snapshot_died(pid: int, st: Attempts, how: str) -> None:
    """The snapshot process is gone: raise Retake the first time, then CollectionError."""
    st.deaths.append(how)
    if len(st.deaths) <= SNAPSHOT_DEATH_RETRIES:
        raise Retake("died", f"the snapshot process died during the sweep ({how})") from None
    raise CollectionError(
        f"the snapshot process of process {pid} died during the sweep "
        f"({len(st.deaths)} times: {'; '.join(st.deaths)}); nothing was reported",
        hint="something kills the target's children (an OOM killer, a process reaper, a "
             "supervisor); try again, or look for what sends the signals") from None


def judge_unreadable(pid: int, fz, snap, st: Attempts, exc: MemoryUnreadable) -> None:
    """Turn a failed read into a retake (the snapshot process died: once) or an error."""
    if snap.mode == "clone" and not alive(snap.pid):
        snapshot_died(pid, st, f"a read failed: {exc}")
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
