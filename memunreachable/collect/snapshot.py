"""snapshot.py: Stage 3: a copy-on-write snapshot of a frozen process.

Input: a Frozen (freeze.py). Output: a Snapshot
    .pid          the snapshot child (mode "clone"), or the target itself (mode "direct")
    .mode/.reason "clone", or "direct" with the reason (no thread whose seccomp rules allow
                  the injected syscalls, clone refused, job-control stop)
    .open_memory() -> memory.ProcessMemory over /proc/<.pid>/mem
    .release()    kill the child, collect it as its tracer, then reap its zombie in the target
                  (a short injected wait4); idempotent; also `with take_snapshot(fz) as snap:`
    .inject_ms, .reap_pause_ms, .lifetime_ms   the figures the report shows
reap_leftovers(fz) reaps the clones an earlier, killed check of the same target left
(leftovers.py: the per-target record); take_snapshot() runs it first, while frozen.
The caller thaws the target right after take_snapshot() in clone mode (the pause stays in
milliseconds); in direct mode it keeps the target frozen for the whole sweep.

seccomp (issue 7, seccomp.py): a syscall is injected only into a thread whose seccomp rules
ALLOW/LOG both injected syscalls (clone, wait4); a strict-mode thread never gets one.
Mechanics (ptrace-snapshot.md sections 4-7, 10, 12): clone(flags=0) injected by
native/mu_ptrace.c, guarded (sites.find_guard: a `syscall; ret` pair and an rt_sigreturn stub
of ld.so or libc; the sigreturn frames on the thread's stack make a checker's death at any
step harmless), else at a `syscall` instruction (rip-2 of a thread stopped in a syscall, else
one found in [vdso] or another executable mapping); never a code write. Where and in which
thread: sites.py (choose_thread). exit_signal 0: no
SIGCHLD reaches the target and only waitpid(__WALL) sees the child.
References: clone(2), wait4(2), ptrace(2); kernel kernel/exit.c (wait_task_zombie hands a
traced child back to its real parent after the tracer collected it).
"""
from __future__ import annotations

import errno
import logging
import os
import signal
import threading
import time
from typing import Dict, List, Optional, Tuple

from memunreachable.collect import diagnose, leftovers, procfs, seccomp, sites
from memunreachable._errors import (AccessDenied, CollectionError, NoSuchProcess,
                                    UnsupportedTarget)
from memunreachable._ffi import ffi, lib
from memunreachable._types import REG_NAMES, Fields
from memunreachable.collect.freeze import Frozen, frozen
from memunreachable.collect.interrupts import critical
from memunreachable.collect.memory import ProcessMemory

log = logging.getLogger("memunreachable")

RIP, ORIG_RAX = REG_NAMES.index("rip"), REG_NAMES.index("orig_rax")
REFUSALS = (errno.EPERM, errno.EAGAIN, errno.ENOMEM, errno.ENOSYS, errno.EACCES)
STEP_NAMES = {lib.MU_STEP_START: "start", lib.MU_STEP_OPTIONS: "set options",
              lib.MU_STEP_SETREGS: "set registers", lib.MU_STEP_ENTER: "syscall entry",
              lib.MU_STEP_EVENT: "clone event", lib.MU_STEP_EXIT: "syscall exit",
              lib.MU_STEP_RESTORED: "restore", lib.MU_STEP_PARKED: "park child"}


class Snapshot(Fields):
    __slots__ = ("pid", "target_pid", "mode", "reason", "inject_ms", "reap_pause_ms",
                 "lifetime_ms", "released", "zombie_left", "warnings", "syscall_insn",
                 "restore_rt", "inject_tid", "timeout", "allow_seccomp", "_fz", "_inject_out", "_note_pending",
                 "_created")

    def __init__(self, pid: int, target_pid: int,
                 mode: str,                     # "clone" | "direct"
                 reason: str = "",
                 inject_ms: float = 0.0,        # the clone injection (part of the freeze pause)
                 # the second, short pause that reaps the child's zombie
                 reap_pause_ms: float = 0.0,
                 # snapshot created -> killed (COW faults slow the target)
                 lifetime_ms: float = 0.0, released: bool = False,
                 # the child's zombie could not be reaped in the target
                 zombie_left: bool = False, warnings: Optional[List[str]] = None,
                 syscall_insn: int = 0,
                 restore_rt: int = 0,           # the guard's rt_sigreturn stub, 0: unguarded
                 inject_tid: int = 0, timeout: float = 2.0,
                 # inject wait4 into a thread whose filters cannot be read
                 allow_seccomp: bool = False, _fz: Optional[Frozen] = None,
                 _inject_out: object = None,    # the mu_inject of the clone
                 _note_pending: bool = False,   # note_clone() deferred to the thaw
                 _created: Optional[float] = None):
        self.pid = pid
        self.target_pid = target_pid
        self.mode = mode
        self.reason = reason
        self.inject_ms = inject_ms
        self.reap_pause_ms = reap_pause_ms
        self.lifetime_ms = lifetime_ms
        self.released = released
        self.zombie_left = zombie_left
        self.warnings = [] if warnings is None else warnings
        self.syscall_insn = syscall_insn
        self.restore_rt = restore_rt
        self.inject_tid = inject_tid
        self.timeout = timeout
        self.allow_seccomp = allow_seccomp
        self._fz = _fz
        self._inject_out = _inject_out
        self._note_pending = _note_pending
        self._created = time.monotonic() if _created is None else _created

    @property
    def inject_steps_ms(self) -> Dict[str, float]:
        """How long each step of the clone injection took (ms), keyed by STEP_NAMES."""
        out = self._inject_out
        if out is None:
            return {}
        steps, last = {}, out.t_ns[lib.MU_STEP_START]
        for step in range(lib.MU_STEP_OPTIONS, lib.MU_STEP_PARKED + 1):
            t = out.t_ns[step]
            if t and last:
                steps[STEP_NAMES[step]] = (t - last) / 1e6
                last = t
        return steps

    def open_memory(self) -> ProcessMemory:
        if self.released:
            raise CollectionError(f"snapshot of process {self.target_pid} was already released")
        try:
            return ProcessMemory(self.pid)
        except FileNotFoundError:
            raise NoSuchProcess(self.pid, "the snapshot process is gone") from None

    # Kills and reaps the child (clone mode); a no-op in direct mode. Idempotent. Never
    # raises for cleanup trouble (it lands in .warnings / .zombie_left); a signal that
    # arrives meanwhile is deferred (interrupts.critical) and raised as FreezeInterrupted after
    # the cleanup. A child left as a zombie stays in the check record (leftovers.py), so the
    # next check of the target reaps it.
    def release(self) -> None:
        if self.released:
            return
        self.note_clone()
        with critical():
            self.lifetime_ms = (time.monotonic() - self._created) * 1000.0
            if self.mode == "clone":
                _kill_child(self.pid, self.timeout)
                self._reap()
                leftovers.note_released(self, reaped=not self.zombie_left)
            self.released = True

    def note_clone(self) -> None:
        """Name the clone in the check record (leftovers.note_clone). Deferred by the snapshot
        until the target is thawed (the record's injection window covers it until then);
        idempotent."""
        if self._note_pending:
            self._note_pending = False
            leftovers.note_clone(self.target_pid, self.pid, self)
            # it counts the pages it shares with the target as its own: the OOM killer
            # would as soon pick the target
            procfs.oom_first(self.pid)

    def _reap(self) -> None:
        """Reap the child's zombie in the target with an injected wait4(child, __WALL|WNOHANG)."""
        fz = self._fz
        try:
            if fz is not None and not fz.thawed:
                # still frozen (an error path before the thaw): the injected thread first
                tid, insn, rt, why = self._reap_thread(fz, prefer=self.inject_tid)
                if not tid:
                    raise CollectionError(why)
                self._inject_wait4(fz, tid, insn, rt)
                return
            # the first live thread; when its seccomp rules forbid wait4, every thread
            for one_thread in (True, False):
                with frozen(self.target_pid, timeout=self.timeout,
                            one_thread=one_thread) as fz1, fz1.critical():
                    tid, insn, rt, why = self._reap_thread(fz1)
                    if tid:
                        self._inject_wait4(fz1, tid, insn, rt)
                self.reap_pause_ms += fz1.pause_ms
                if tid:
                    return
            raise CollectionError(why)
        except NoSuchProcess:
            pass        # the target is gone: init (or a subreaper) reaps the child
        except (CollectionError, AccessDenied, OSError) as exc:
            self.zombie_left = True
            self.warnings.append(f"snapshot process {self.pid} is left as a zombie of process "
                                 f"{self.target_pid}: {exc}")

    # Returns (tid, syscall instruction, restore_rt, "") of a thread of fz (prefer first)
    # whose seccomp rules let it run wait4(child, NULL, __WALL|WNOHANG, NULL) (seccomp.py):
    # guarded at the snapshot's pair when the clone was (with the guard's syscalls allowed),
    # else at rip-2 when it sits after a `syscall` instruction, else at the snapshot's
    # instruction; (0, 0, 0, why) when no thread may (a strict-mode thread, or a filter added
    # since the snapshot).
    def _reap_thread(self, fz: Frozen, prefer: int = 0) -> Tuple[int, int, int, str]:
        refusals: List[seccomp.Verdict] = []
        # the reap's own one-thread freeze reads no maps: a stack is judged by the snapshot's
        # (a thread whose stack pointer left the mapping it had then gets no guard)
        maps = fz.maps or (self._fz.maps if self._fz is not None else [])
        for t in sorted(fz.threads, key=lambda t: t.tid != prefer):
            own = self.syscall_insn
            if sites.signed(t.regs[ORIG_RAX]) >= 0 and \
                    sites.after_syscall_insn(fz.pid, t.tid, t.regs[RIP]):
                own = t.regs[RIP] - 2
            insn, rt, refusal = sites.first_allowed(
                     fz.pid, t.tid,
                     (sites.guard_for(fz, t.tid, self.syscall_insn, self.restore_rt, maps), (own, 0)),
                     lambda i, r: seccomp.reap_calls(i, self.pid, r), self.allow_seccomp)
            if insn:
                return t.tid, insn, rt, ""
            refusals.append(refusal)
        return 0, 0, 0, ("no thread may run the reaping wait4 under its seccomp rules ("
                         f"{_why(refusals)})")

    def _inject_wait4(self, fz: Frozen, tid: int, insn: int, restore_rt: int) -> None:
        out = ffi.new("mu_inject *")
        with fz.critical():
            rc = lib.mu_inject_wait4(tid, insn, restore_rt, fz.regs_at_freeze(tid), self.pid,
                                     int(self.timeout * 1000), out)
            fz.record_signals(tid, list(out.signals)[:out.nsignals])
        if rc < 0:
            _raise_inject(fz, tid, rc, out, "wait4")
        if out.ret != self.pid and out.ret != -errno.ECHILD:
            self.zombie_left = True
            self.warnings.append(f"wait4 in process {self.target_pid} for the snapshot process "
                                 f"{self.pid} returned {out.ret}; it stays a zombie until the "
                                 "target exits")

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _kill_child(child: int, timeout: float) -> None:
    """SIGKILL the stopped child and collect its exit as its tracer (then it is the target's
    zombie, which the injected wait4 reaps)."""
    try:
        os.kill(child, signal.SIGKILL)
    except ProcessLookupError:
        return
    status = ffi.new("int *")
    deadline = time.monotonic() + timeout
    while True:     # a stop it reported before the kill and we never collected comes first
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        if lib.mu_wait_tid(child, left_ms, status) <= 0 or not os.WIFSTOPPED(status[0]) \
                or time.monotonic() >= deadline:
            return


def kill_unseen_clones(target: int, born_after: int, timeout: float) -> List[int]:
    """Kill the clones this thread traces whose birth was never reported: a target killed
    after clone() made the child but before its clone event (a dying thread skips the event
    stop) leaves the child in its first stop, traced by this thread, with exit_signal 0 and
    its parent gone, its pid unknown. Found by a scan of /proc (this error path only): traced
    by this thread, exit_signal 0, born at or after born_after (stat ticks); killed and
    collected as any clone (its new parent reaps it). Returns their pids."""
    me, found = threading.get_native_id(), []
    try:
        pids = [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != target]
    except OSError:
        return found
    for pid in pids:
        st = leftovers.read_stat(pid)
        if st is None or st.exit_signal != 0 or st.state in ("Z", "X") or \
                (st.start or 0) < born_after or leftovers.tracer_of(pid) != me:
            continue
        _kill_child(pid, timeout)
        found.append(pid)
    if found:
        log.warning("killed snapshot process(es) %s of process %d, whose birth was never "
                    "reported (the target died during the clone)", found, target)
    return found


def _raise_inject(fz: Frozen, tid: int, rc: int, out, what: str):
    err = -rc
    if err == errno.ESRCH:
        _check_alive(fz.pid)
    if err == errno.ESRCH and procfs.task_state(fz.pid, tid) in ("", "Z", "X"):
        raise NoSuchProcess(fz.pid, f"process {fz.pid} exited during the snapshot",
                            hint=diagnose.hint_no_process(fz.pid))
    exc = CollectionError(
        f"injecting {what} into thread {tid} of process {fz.pid} failed at step "
        f"'{STEP_NAMES.get(out.step, out.step)}': {os.strerror(err)}"
        + ("" if out.restored else " (its registers could not be restored)"))
    # the target thread is whole again and only the new child failed (it was killed while
    # being parked): a fresh snapshot may succeed
    exc.snapshot_lost = bool(what == "clone" and out.child > 0 and out.restored
                             and err == errno.ESRCH)
    raise exc


def _check_alive(pid: int) -> procfs.Status:
    """The target's status; NoSuchProcess when it exited or a SIGKILL is on its way."""
    status = procfs.read_status(pid)
    if status.dying:
        raise NoSuchProcess(pid, f"process {pid} exited while frozen",
                            hint=diagnose.hint_no_process(pid), name=status.name)
    return status


def _why(refusals) -> str:
    """'thread 12: <reason>; thread 13: <reason>' for seccomp.Verdicts."""
    return "; ".join(f"thread {v.tid}: {v.reason}" for v in refusals)


# Returns (why a snapshot could make the kernel kill processes, a hint for --no-fallback), or
# ("", ""). A snapshot shares the target's private pages; each one either of them writes while
# it lives is copied and charged to the target's memory cgroup (the clone is born in it) and
# taken from the machine, up to all of the target's resident private memory. When the cgroup
# (or an ancestor) has less room left before its limit, or the machine has less available
# memory and free swap, the OOM killer could run, and killing the snapshot first
# (oom_score_adj 1000) did not save the target: it was killed in 5 of 6 such OOMs in a memory
# cgroup (reliability record). Then the sweep reads the stopped target instead, which writes
# none of its pages.
def _no_room(pid: int) -> Tuple[str, str]:
    try:
        room = procfs.memory_room(pid)
        need = procfs.read_rss_anon(pid)
    except (OSError, ValueError) as exc:
        log.debug("process %d's memory cgroup not read: %s", pid, exc)
        return "", ""
    copy = f"the {need >> 20} MiB of private memory a copy-on-write snapshot may have to copy"
    if room is not None and room[0] < need:
        return (f"its memory cgroup {room[1]} has {room[0] >> 20} MiB left before its limit, "
                f"less than {copy} there, and its OOM killer could then kill the target",
                "raise the memory limit of that cgroup, or leave out --no-fallback: the check "
                "then reads the stopped target directly")
    free = procfs.machine_room()
    if free is not None and free < need:
        return (f"the machine has {free >> 20} MiB of available memory and free swap, less "
                f"than {copy}, and the kernel's OOM killer could then kill the target",
                "free memory on the machine, or leave out --no-fallback: the check then reads "
                "the stopped target directly")
    return "", ""


def _direct(fz: Frozen, reason: str, allow_direct: bool, seccomp: bool = False,
            unreadable: bool = False, hint: Optional[str] = None) -> Snapshot:
    sess = leftovers.session(fz.pid)
    if sess is not None and sess.injecting:
        leftovers.note_clone(fz.pid, 0)     # no clone: close the window noted ahead
    _check_alive(fz.pid)
    if not allow_direct:
        raise UnsupportedTarget(f"no snapshot of process {fz.pid}: {reason}",
                                hint=diagnose.hint_seccomp(fz.pid, unreadable) if seccomp
                                else hint)
    return Snapshot(pid=fz.pid, target_pid=fz.pid, mode="direct", reason=reason,
                    timeout=fz.timeout, _fz=fz)


# Returns warnings (for the report). Reaps, through a thread of the frozen target, the
# snapshot processes an earlier check of it left behind (leftovers.find_leftovers: children
# named in the check record, or born in a recorded injection window, still with exit_signal
# 0): a zombie with an injected wait4(pid, NULL, __WALL|WNOHANG); one still alive and
# untraced (never seen: the clone inherits EXITKILL at birth) is SIGKILLed first. A clone
# it cannot reap stays in the record (a warning says so). Raises like take_snapshot() when
# the injection itself fails.
def reap_leftovers(fz: Frozen, allow_seccomp: bool = False) -> List[str]:
    found = leftovers.find_leftovers(fz.pid)
    if not found:
        leftovers.settle_leftovers(fz.pid, [])
        return []
    pids = [p for p, _ in found]
    left = [leftovers.Clone(p, st.start) for p, st in found]
    why = ""
    tid, insn, restore_rt, refusals = sites.choose_thread(fz, allow_unreadable=allow_seccomp)
    if not tid or not insn:
        why = ("; ".join(f"thread {r.tid}: {r.reason}"
                         for r in refusals) if refusals else
               "no thread of the target can run a wait4 now (job-control stopped?)")
    if why:
        leftovers.settle_leftovers(fz.pid, left)
        return [f"snapshot process(es) {pids} left by an earlier check of process {fz.pid} "
                f"were not reaped: {why}"]
    reaped, notes = [], []
    try:
        with fz.critical():
            for pid, st in found:
                if st.state not in ("Z", "X"):
                    tracer = leftovers.tracer_of(pid)
                    if tracer:
                        notes.append(f"snapshot process {pid} of an earlier check is traced "
                                     f"by process {tracer}: left alone")
                        continue
                    _kill_leftover(pid)
                out = ffi.new("mu_inject *")
                rc = lib.mu_inject_wait4(tid, insn, restore_rt, fz.regs_at_freeze(tid), pid,
                                         int(fz.timeout * 1000), out)
                fz.record_signals(tid, list(out.signals)[:out.nsignals])
                if rc < 0:
                    _raise_inject(fz, tid, rc, out, "wait4")
                if out.ret == pid or out.ret == -errno.ECHILD:
                    reaped.append(pid)
                    left = [c for c in left if c.pid != pid]
                else:
                    notes.append(f"wait4 for the leftover snapshot process {pid} returned "
                                 f"{out.ret}; the next check retries")
    finally:
        leftovers.settle_leftovers(fz.pid, left)
    if reaped:
        notes.insert(0, f"reaped {len(reaped)} snapshot process(es) (pid {', '.join(map(str, reaped))}) "
                        f"left in process {fz.pid} by an earlier check that was killed")
        log.warning("%s", notes[0])
    return notes


def _kill_leftover(pid: int, timeout: float = 1.0) -> None:
    """SIGKILL a leftover clone that is still alive; wait (bounded) until it is a zombie."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = leftovers.read_stat(pid)
        if st is None or st.state in ("Z", "X"):
            return
        time.sleep(0.001)


# Called before frozen(), so that the pause pays neither for the check record's write nor
# for first-time costs: records in pid's check record (leftovers.note_injection) that a clone
# injection may happen from now until the freeze (at most timeout) and the injection (at most
# timeout) ended, and reads once what sites.choose_thread() reads while the target is stopped (the
# guard's gadgets, cached; the leader's seccomp state: its /proc entries are then cached; a
# first lookup cost 60-100 us).
def prepare(pid: int, timeout: float) -> None:
    leftovers.note_injection(pid, 2 * timeout + 1.0)
    try:
        if not any(key[0] == pid for key in sites.GUARDS):   # a repeated check: cached already
            sites.find_guard(pid, procfs.read_maps(pid))  # 0.2-0.4 ms the pause no longer pays
        procfs.read_seccomp(pid, pid)
        seccomp.injected_calls(0)
        sites.read_target(pid, 0, 0)
    except (NoSuchProcess, OSError):
        pass                # the freeze says what is wrong


def _injection_noted(pid: int, timeout: float) -> bool:
    """The record's injection window (prepare) still covers an injection that
    starts now and ends within timeout."""
    sess = leftovers.session(pid)
    if sess is None:
        return True         # no check record (outside a guard): nothing to note
    window = sess.injecting
    return window is not None and \
        window[1] >= leftovers.now_ticks() + int((timeout + 1.0) * leftovers.HZ) + 1


# Returns a Snapshot of the frozen process, after reaping what an earlier killed check left
# (reap_leftovers; its warnings come first in .warnings). See _take_snapshot().
def take_snapshot(fz: Frozen, allow_direct: bool = True, allow_seccomp: bool = False,
                  tid: Optional[int] = None, guarded: bool = True) -> Snapshot:
    fz.check_owner()
    notes = reap_leftovers(fz, allow_seccomp) if not fz.thawed else []
    snap = _take_snapshot(fz, allow_direct, allow_seccomp, tid, guarded)
    snap.warnings[:0] = notes
    return snap


# Returns a Snapshot of the frozen process. Mode "direct" (with .reason) when no thread may
# run the injected syscalls under its seccomp rules (strict mode, a filter that does not
# ALLOW/LOG clone or wait4, or unreadable filters without allow_seccomp: see choose_thread),
# when the clone is refused (-EPERM, -EAGAIN, -ENOMEM), or when no thread sits at an
# interrupt stop; with allow_direct False those raise UnsupportedTarget (with a hint).
# Raises NoSuchProcess (the target exited) or CollectionError (a ptrace step failed; any
# child was killed and reaped). The target stays frozen: thaw it next.
# tid: inject into that thread (tests); default: the best candidate.
def _take_snapshot(fz: Frozen, allow_direct: bool = True, allow_seccomp: bool = False,
                   tid: Optional[int] = None, guarded: bool = True) -> Snapshot:
    fz.check_owner()
    if fz.thawed:
        raise CollectionError(f"process {fz.pid} must be frozen to take a snapshot")
    short, hint = _no_room(fz.pid)
    if short:
        return _direct(fz, short, allow_direct, hint=hint)
    # (a target killed meanwhile fails the injection with ESRCH: _raise_inject names it)
    tid, insn, restore_rt, refusals = sites.choose_thread(fz, tid, allow_unreadable=allow_seccomp,
                                                    guarded=guarded)
    if refusals and not tid:
        return _direct(fz, "no thread can run the injected clone and wait4 under its seccomp "
                           "rules (" + _why(refusals) + ")", allow_direct, seccomp=True,
                       unreadable=any(v.unreadable for v in refusals))
    if not tid and next(fz.interrupt_stops(), None) is None:
        return _direct(fz, "no thread stopped at an interrupt stop (job-control stopped "
                           "or signal pending)", allow_direct)
    if not tid or not insn:
        return _direct(fz, "no readable `syscall` instruction in the target", allow_direct)
    out = ffi.new("mu_inject *")
    snap = None
    try:
        with fz.critical():
            if not _injection_noted(fz.pid, fz.timeout):
                leftovers.note_injection(fz.pid, fz.timeout)    # before the clone can exist
            t0, born_after = time.monotonic(), leftovers.now_ticks() - 1
            rc = lib.mu_inject_clone(tid, insn, restore_rt, fz.regs_at_freeze(tid),
                                     int(fz.timeout * 1000), out)
            inject_ms = (time.monotonic() - t0) * 1000.0
            fz.record_signals(tid, list(out.signals)[:out.nsignals])
            if out.child > 0:
                snap = Snapshot(pid=out.child, target_pid=fz.pid, mode="clone",
                                inject_ms=inject_ms, syscall_insn=insn,
                                restore_rt=restore_rt if out.guarded else 0, inject_tid=tid,
                                timeout=fz.timeout, allow_seccomp=allow_seccomp, _fz=fz,
                                _inject_out=out)
            if snap is not None and rc == 0 and out.ret > 0:
                # named in the record once the target runs again (the window covers it)
                snap._note_pending = True
                fz.after_thaw.append(snap.note_clone)
            else:
                leftovers.note_clone(fz.pid, out.child, snap)
            if rc < 0:
                if snap is not None and out.restored:
                    snap.release()
                elif snap is not None:
                    _kill_child(snap.pid, fz.timeout)
                else:
                    kill_unseen_clones(fz.pid, born_after, fz.timeout)
                _raise_inject(fz, tid, rc, out, "clone")
            if out.ret < 0:
                err = -out.ret
                why = errno.errorcode.get(err, str(err))
                if err not in REFUSALS:
                    raise CollectionError(f"the injected clone in process {fz.pid} "
                                          f"returned {why}")
                return _direct(fz, f"the target's clone() was refused ({why}"
                                   + (": a seccomp filter?" if err == errno.EPERM else "")
                                   + ")", allow_direct, seccomp=err == errno.EPERM)
    except BaseException:
        if snap is not None:
            snap.release()
        raise
    return snap
