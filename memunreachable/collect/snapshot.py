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
native/mu_ptrace.c, guarded (find_guard: a `syscall; ret` pair and an rt_sigreturn stub of
ld.so or libc; the sigreturn frames on the thread's stack make a checker's death at any
step harmless), else at a `syscall` instruction (rip-2 of a thread stopped in a syscall, else
one found in [vdso] or another executable mapping); never a code write. exit_signal 0: no
SIGCHLD reaches the target and only waitpid(__WALL) sees the child.
References: clone(2), wait4(2), ptrace(2); kernel kernel/exit.c (wait_task_zombie hands a
traced child back to its real parent after the tracer collected it).
"""
from __future__ import annotations

import errno
import logging
import os
import signal
import time
from typing import Dict, List, Optional, Tuple

from memunreachable.collect import diagnose, leftovers, procfs, seccomp
from memunreachable._errors import (AccessDenied, CollectionError, NoSuchProcess,
                                    UnsupportedTarget)
from memunreachable._ffi import ffi, lib
from memunreachable._types import FS_BASE_INDEX, REG_NAMES, RSP_INDEX, Fields
from memunreachable.collect.freeze import Frozen, frozen
from memunreachable.collect.interrupts import critical
from memunreachable.collect.memory import ProcessMemory

log = logging.getLogger("memunreachable")

SYSCALL_INSN = b"\x0f\x05"
SYSCALL_RET = b"\x0f\x05\xc3"                          # syscall; ret
RESTORE_RT = b"\x48\xc7\xc0\x0f\x00\x00\x00\x0f\x05"    # mov $15, %rax; syscall
RIP, ORIG_RAX = REG_NAMES.index("rip"), REG_NAMES.index("orig_rax")
REFUSALS = (errno.EPERM, errno.EAGAIN, errno.ENOMEM, errno.ENOSYS, errno.EACCES)
STEP_NAMES = {lib.MU_STEP_START: "start", lib.MU_STEP_OPTIONS: "set options",
              lib.MU_STEP_SETREGS: "set registers", lib.MU_STEP_ENTER: "syscall entry",
              lib.MU_STEP_EVENT: "clone event", lib.MU_STEP_EXIT: "syscall exit",
              lib.MU_STEP_RESTORED: "restore", lib.MU_STEP_PARKED: "park child"}


def _signed(word: int) -> int:
    return word - (1 << 64) if word >= 1 << 63 else word


def _read_target(pid: int, addr: int, size: int) -> bytes:
    """Bytes of the (traced) target, b"" when unreadable."""
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        return os.pread(fd, size, addr)
    except OSError:
        return b""
    finally:
        os.close(fd)


def _after_syscall_insn(pid: int, tid: int, rip: int) -> bool:
    """The two bytes before rip in stopped tracee tid are a `syscall` instruction. One
    PTRACE_PEEKDATA (a few us while the target is stopped), else /proc/PID/mem."""
    word = ffi.new("uint64_t *")
    if lib.mu_peek(tid, rip - 2, word) == 0:
        return word[0] & 0xFFFF == int.from_bytes(SYSCALL_INSN, "little")
    return _read_target(pid, rip - 2, 2) == SYSCALL_INSN   # rip-2 near the end of a mapping


# Returns, for each needle, the address of its first occurrence in the code of mappings
# (searched in that order, at most limit bytes each), 0 where none is readable.
def _find_in_code(pid: int, mappings, needles: Tuple[bytes, ...], limit: int) -> List[int]:
    found = [0] * len(needles)
    for m in mappings:
        data = _read_target(pid, m.begin, min(m.end - m.begin, limit))
        for i, needle in enumerate(needles):
            if not found[i] and (at := data.find(needle)) >= 0:
                found[i] = m.begin + at
        if all(found):
            break
    return found


# Returns the address of a `syscall` instruction in an executable mapping of pid ([vdso]
# first), or 0 when none is readable. Any 0f 05 pair works: execution starts at it, and the
# thread is stopped at the syscall exit before it could run the bytes that follow.
def find_syscall_insn(pid: int, maps) -> int:
    ranked = sorted((m for m in maps if m.executable and m.readable),
                    key=lambda m: (m.path != "[vdso]", m.begin))
    return _find_in_code(pid, ranked[:8], (SYSCALL_INSN,), 1 << 20)[0]


# Returns (gadget, restore_rt) for the guard of native/mu_ptrace.c: the address of a
# `syscall; ret` pair and of an rt_sigreturn stub (`mov $15, %rax; syscall`, glibc's
# __restore_rt) in ld.so's, else libc's (or a static executable's) code, read from the
# target; (0, 0) when one is missing, or when the target runs with a shadow stack
# (x86_Thread_features: shstk: a `ret` into the stub would fault). Cached per pid and
# mapping: a later check of the same process reads nothing (prepare() fills the cache before
# the freeze).
def find_guard(pid: int, maps) -> Tuple[int, int]:
    code = [m for m in maps if m.executable and m.readable and m.path.startswith("/")]
    ranked = sorted(code, key=lambda m: (not os.path.basename(m.path).startswith("ld-"),
                                         not os.path.basename(m.path).startswith("libc."),
                                         m.begin))[:3]
    key = (pid, tuple((m.begin, m.end, m.path) for m in ranked))
    found = _GUARDS.get(key)
    if found is None:
        found = (0, 0) if _shadow_stack(pid) else _search_guard(pid, ranked)
        _GUARDS.clear()             # one target at a time (the plugin: the same one)
        _GUARDS[key] = found
    return found


_GUARDS: Dict[tuple, Tuple[int, int]] = {}


def _shadow_stack(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            return shadow_stack_in(f.read())
    except OSError:
        return True                 # unknown: no guard rather than a fault


def shadow_stack_in(status: bytes) -> bool:
    """A /proc/PID/status text says the process runs with a user shadow stack (x86 CET:
    `x86_Thread_features: shstk ...`, Linux 6.6+)."""
    for line in status.splitlines():
        if line.startswith(b"x86_Thread_features:"):
            return b"shstk" in line.split()[1:]
    return False


def _search_guard(pid: int, mappings) -> Tuple[int, int]:
    gadget, restore_rt = _find_in_code(pid, mappings, (SYSCALL_RET, RESTORE_RT), 8 << 20)
    return (gadget, restore_rt) if gadget and restore_rt else (0, 0)


# True when tid's stack pointer lies in a stack that glibc or the kernel made: the main
# thread's [stack], or the mapping that holds the thread's own TCB (fs_base: glibc puts it at
# the top of each pthread stack, a user-supplied one included). Only there may the guard
# write below the red zone, as a signal would: a stack that a runtime carves out of its heap
# (Go's goroutines, coroutine libraries) may have another one right below it, and such
# runtimes take their signals on an alternate stack for that reason.
# maps: those to judge by (default fz.maps; a one-thread freeze reads none: the snapshot's).
def stack_takes_frames(fz: Frozen, tid: int, maps=None) -> bool:
    regs = fz.regs_at_freeze(tid)
    if regs == ffi.NULL:
        return False
    sp, fs_base = regs[RSP_INDEX], regs[FS_BASE_INDEX]
    for m in fz.maps if maps is None else maps:
        if m.begin <= sp < m.end:
            return m.path == "[stack]" or m.begin <= fs_base < m.end
    return False


# Returns the guard (gadget, restore_rt) that thread tid of fz may take: the pair given,
# when there is one and tid's stack takes its frames (stack_takes_frames, judged by maps);
# else (0, 0).
def _guard_for(fz: Frozen, tid: int, gadget: int, restore_rt: int,
               maps=None) -> Tuple[int, int]:
    return (gadget, restore_rt) if restore_rt and stack_takes_frames(fz, tid, maps) else (0, 0)


# Returns (insn, restore_rt, None) of the first of tries, [(insn, restore_rt)] (insn 0:
# skipped), whose calls(insn, restore_rt) thread tid's seccomp rules allow, else (0, 0, the
# last refusal: a seccomp.Verdict, None when nothing was tried).
def _first_allowed(pid: int, tid: int, tries, calls, allow_unreadable: bool) -> tuple:
    verdict = None
    for insn, rt in tries:
        if insn:
            verdict = seccomp.thread_verdict(pid, tid, calls(insn, rt), allow_unreadable)
            if verdict.ok:
                return insn, rt, None
    return 0, 0, verdict


# Returns (tid, syscall instruction address, restore_rt, refusals) for the injection: the
# first thread at an interrupt stop whose seccomp state allows every injected syscall
# (seccomp.py: clone, and the wait4 that reaps the child) at that address. Guarded first
# (restore_rt non-zero: find_guard's pair, with the guard's own syscalls allowed too), else
# preferring a thread stopped right after a `syscall` instruction (rip-2), else one found in
# [vdso] or another executable mapping. (0, 0, 0, refusals) when no thread qualifies:
# refusals holds the seccomp.Verdict of each thread that was considered and refused ([]
# when no thread sits at an interrupt stop: all in group-stop or signal-delivery-stop, leave
# them as found). A thread in seccomp strict mode, or whose filters would not ALLOW/LOG a
# call, is never chosen; one whose filters cannot be read only with allow_unreadable
# (--allow-seccomp-target).
# tid: only consider that thread (tests inject into each kind of waiting thread).
# guarded: False to take the legacy sequence (tests).
def choose_thread(fz: Frozen, tid: Optional[int] = None, allow_unreadable: bool = False,
                  guarded: bool = True) -> Tuple[int, int, int, List[seccomp.Verdict]]:
    gadget, restore_rt = find_guard(fz.pid, fz.maps) if guarded else (0, 0)
    refusals: List[seccomp.Verdict] = []

    def allowed(t: int, own: int) -> Tuple[int, int]:
        """(insn, restore_rt) that thread t may run, guarded first; (0, 0) and the refusal
        recorded when none."""
        insn, rt, refusal = _first_allowed(
            fz.pid, t, (_guard_for(fz, t, gadget, restore_rt), (own, 0)),
            lambda i, r: seccomp.injected_calls(i, restore_rt=r), allow_unreadable)
        if refusal is not None:
            refusals.append(refusal)
        return insn, rt

    first = fz.syscall_candidate() if tid is None else None
    if first is not None:
        # the first pass's first candidate, found by mu_freeze: most often the answer;
        # seccomp mode 0 (the leader's status is open since before the freeze: one pread)
        # is the verdict "ok" without building the calls
        t, own = first
        if t == fz.pid and fz.leader_seccomp_mode() == 0:
            guard = _guard_for(fz, t, gadget, restore_rt)
            return (t, *guard, []) if guard[1] else (t, own, 0, [])
        insn, rt = allowed(t, own)
        if insn:
            return t, insn, rt, refusals
        refusals.clear()
    candidates = (c for c in fz.interrupt_stops() if tid is None or c[0] == tid)
    others = []
    for t, orig_rax, rip in candidates:     # first pass: threads right after a `syscall`
        if _signed(orig_rax) >= 0 and _after_syscall_insn(fz.pid, t, rip):
            insn, rt = allowed(t, rip - 2)
            if insn:
                return t, insn, rt, refusals
        else:
            others.append(t)
    own = find_syscall_insn(fz.pid, fz.maps) if others and not restore_rt else gadget
    for t in others if own else ():
        insn, rt = allowed(t, own)
        if insn:
            return t, insn, rt, refusals
    return 0, 0, 0, refusals


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
            if _signed(t.regs[ORIG_RAX]) >= 0 and \
                    _after_syscall_insn(fz.pid, t.tid, t.regs[RIP]):
                own = t.regs[RIP] - 2
            insn, rt, refusal = _first_allowed(
                fz.pid, t.tid,
                (_guard_for(fz, t.tid, self.syscall_insn, self.restore_rt, maps), (own, 0)),
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


def _direct(fz: Frozen, reason: str, allow_direct: bool, seccomp: bool = False,
            unreadable: bool = False) -> Snapshot:
    sess = leftovers.session(fz.pid)
    if sess is not None and sess.injecting:
        leftovers.note_clone(fz.pid, 0)     # no clone: close the window noted ahead
    _check_alive(fz.pid)
    if not allow_direct:
        raise UnsupportedTarget(f"no snapshot of process {fz.pid}: {reason}",
                                hint=diagnose.hint_seccomp(fz.pid, unreadable) if seccomp
                                else None)
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
    tid, insn, restore_rt, refusals = choose_thread(fz, allow_unreadable=allow_seccomp)
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
# timeout) ended, and reads once what choose_thread() reads while the target is stopped (the
# guard's gadgets, cached; the leader's seccomp state: its /proc entries are then cached; a
# first lookup cost 60-100 us).
def prepare(pid: int, timeout: float) -> None:
    leftovers.note_injection(pid, 2 * timeout + 1.0)
    try:
        if not any(key[0] == pid for key in _GUARDS):   # a repeated check: cached already
            find_guard(pid, procfs.read_maps(pid))  # 0.2-0.4 ms the pause no longer pays
        procfs.read_seccomp(pid, pid)
        seccomp.injected_calls(0)
        _read_target(pid, 0, 0)
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
    # (a target killed meanwhile fails the injection with ESRCH: _raise_inject names it)
    tid, insn, restore_rt, refusals = choose_thread(fz, tid, allow_unreadable=allow_seccomp,
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
            t0 = time.monotonic()
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
