"""freeze.py: Stage 2: stop every thread of a process, capture registers and maps, thaw.

Input: a pid. Output, inside `with frozen(pid, timeout=2.0) as fz:`
    fz.threads  [ThreadState] (27 general registers, FP/SIMD state, recorded signal), tid order
    fz.maps     [Mapping] read while stopped
    fz.thaw()   detach every thread, re-delivering recorded signals; idempotent; sets fz.pause_ms
Leaving the block thaws on every path (exception, KeyboardInterrupt). SIGINT/SIGTERM/SIGHUP
that arrive while the guard is active raise FreezeInterrupted(signum) (deferred while a ptrace
sequence runs), so the thaw in `finally` always runs; the caller re-raises the signal.

Signals (shared by the whole check, not only the freeze): `interruptible()` installs the
handlers for as long as its outermost block runs (leftovers.guard() wraps a whole check in
it; frozen() nests one), `critical()` defers them while a sequence that must not be cut
runs (a ptrace injection, a kill + reap, a fork). The first signal raises once; later ones
are only recorded, so the unwinding path (thaw, snapshot release, sweeper kill) is never
cut by a second exception. Signals set to SIG_IGN (nohup, background jobs) stay ignored.

Mechanics (ptrace-snapshot.md sections 2, 3, 9): PTRACE_SEIZE(TRACECLONE) + PTRACE_INTERRUPT
for every tid of /proc/PID/task, then collect the stops with waitpid(tid, __WALL|WNOHANG)
per tid (never waitpid(-1): the caller may have other children), re-listing until a pass
finds nothing new. The pause (issue 10): everything that reads /proc text, parses or
allocates runs before the first SEIZE (the leader's status, the maps, parsed, the C
buffers: _Prepared); then one C call, mu_freeze (native/mu_ptrace.c), seizes, interrupts,
collects, captures the registers, re-lists and reads the maps text again (parsed again,
after the thaw, only if it changed); mu_thaw detaches. ThreadStates are built from its records on first use. What mu_freeze
leaves to policy (a refused SEIZE, a thread slow to stop, more threads than records, the
on_attach hook raising) continues in the Python state machine below (_to_python), which
is the whole freeze of earlier versions. Every ptrace request comes from the thread that
entered `frozen()` (ptrace requests only work from the tracer thread); ptrace() below
calls the C core (python-ptrace's import cost 20 ms of start-up).
Deadline: a thread that does not stop within `timeout` (state D: I/O, vfork, a frozen
cgroup) fails the freeze with CollectionError naming it; every other thread is detached.
Such a thread can only be detached once it stops: it is kept in a registry that
release_pending() (called by every freeze) empties; the kernel releases it at our exit.
A zombie leader (pthread_exit in main) is never seized.
References: ptrace(2) "PTRACE_SEIZE", "group-stop", "signal-delivery-stop"; kernel
kernel/ptrace.c (ptrace_detach, __ptrace_unlink re-enters group-stop); proc(5).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from memunreachable.collect import diagnose, procfs
from memunreachable._errors import CollectionError, NoSuchProcess
from memunreachable._ffi import ffi, lib
from memunreachable._types import REG_NAMES, Fields, Mapping, ThreadState

log = logging.getLogger("memunreachable")

# <sys/ptrace.h>, <linux/elf.h>, <sys/wait.h> (x86_64)
PTRACE_GETREGS = 12
PTRACE_GETFPREGS = 14
PTRACE_DETACH = 17
PTRACE_SETOPTIONS = 0x4200
PTRACE_GETEVENTMSG = 0x4201
PTRACE_GETREGSET = 0x4204
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_O_TRACECLONE = 0x8
PTRACE_EVENT_CLONE = 3
PTRACE_EVENT_STOP = 128
NT_X86_XSTATE = 0x202
WALL = 0x40000000               # __WALL: threads are not ordinary children
XSTATE_MAX = 16384              # AMX tiles make the xsave area ~11 KiB
FXSAVE_SIZE = 512               # user_fpregs_struct
JOB_CONTROL_SIGNALS = (signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
SETTLE_GRACE = 0.5              # seconds a thaw waits for a stop that is still on its way
FAST_WAIT = 0.05                # seconds mu_freeze waits for stops before Python takes over
INTERRUPT_STATUS = PTRACE_EVENT_STOP << 8 | signal.SIGTRAP     # status >> 8 of an interrupt stop
ORIG_RAX, RIP = REG_NAMES.index("orig_rax"), REG_NAMES.index("rip")
MAPS_SLACK = 64 << 10           # room for maps that grew between the read and the freeze
_XSTATE_STRIDE = 0              # bytes per thread for the FP/SIMD area (CPUID), set on first use

STATE_WORDS = {"D": "uninterruptible sleep: I/O, vfork or a frozen cgroup",
               "T": "stopped by job control", "t": "traced", "Z": "zombie", "R": "running",
               "S": "sleeping"}


class PtraceError(OSError):
    """A ptrace request failed (.errno)."""


def ptrace(request: int, tid: int, addr: int = 0, data: int = 0) -> int:
    """ptrace(2) through the C core (python-ptrace costs ~20 ms of start-up: issue 10)."""
    rc = lib.mu_ptrace(request, tid, addr, data)
    if rc < 0:
        raise PtraceError(-rc, os.strerror(-rc), f"ptrace({request:#x}, {tid})")
    return rc


class FreezeInterrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived during a check (or a freeze); everything was released.

    The caller should re-raise `signum` (with its original disposition) once it cleaned up."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


CheckInterrupted = FreezeInterrupted    # the name used outside the freeze stage
INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# job control (Ctrl-Z, a background job's terminal I/O): stopping the checker while the target
# is frozen would keep the target stopped as long as the checker is; deferred until the thaw
STOP_SIGNALS = (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)


class _Signals:
    """Process-wide signal state of the running check (handlers run in the main thread)."""
    depth = 0           # nesting of interruptible(); handlers installed while > 0
    critical = 0        # nesting of critical(): a signal is only recorded
    pending = 0         # the first signal caught, 0 when none
    raised = False      # FreezeInterrupted was raised for it: never raise again
    old: Dict[int, object] = {}
    frozen = 0          # targets frozen by this process now (Frozen, until its thaw)
    stop_pending = 0    # a STOP_SIGNALS signal that arrived while one was frozen


def _on_signal(signum, frame):
    if not _Signals.pending:
        _Signals.pending = signum
    if _Signals.critical or _Signals.raised:
        return
    _Signals.raised = True
    raise FreezeInterrupted(_Signals.pending)


def _on_stop_signal(signum, frame):
    _Signals.stop_pending = signum
    _stop_if_pending()          # now, or at the thaw while a target is frozen


def _stop_if_pending() -> None:
    """Stop this process now (what the deferred job-control signal would have done), once no
    target is frozen by it any more."""
    if _Signals.stop_pending and not _Signals.frozen:
        _Signals.stop_pending = 0
        os.kill(os.getpid(), signal.SIGSTOP)


def raise_pending() -> None:
    """Raise FreezeInterrupted for a signal deferred by critical() (no-op inside one, or once
    it was raised already)."""
    if _Signals.pending and not _Signals.raised and not _Signals.critical and _Signals.depth:
        _Signals.raised = True
        raise FreezeInterrupted(_Signals.pending)


def interrupted() -> int:
    """The signal caught during the current check, or 0."""
    return _Signals.pending


# Installs the SIGINT/SIGTERM/SIGHUP handlers for the outermost block (main thread only; in
# another thread, or for a signal set to SIG_IGN or handled outside Python, nothing changes).
# Raises FreezeInterrupted(signum) at the first signal (after any critical() block ends);
# on leaving the outermost block the previous handlers come back and a signal still pending
# is raised.
@contextmanager
def interruptible() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer = _Signals.depth == 0
    if outer:
        _Signals.pending, _Signals.raised, _Signals.old = 0, False, {}
        for signum in INTERRUPT_SIGNALS:
            old = signal.getsignal(signum)
            if old is None or old is signal.SIG_IGN:
                continue
            _Signals.old[signum] = old
            signal.signal(signum, _on_signal)
        for signum in STOP_SIGNALS:         # only where they would stop us (SIG_DFL)
            if signal.getsignal(signum) is signal.SIG_DFL:
                _Signals.old[signum] = signal.SIG_DFL
                signal.signal(signum, _on_stop_signal)
    _Signals.depth += 1
    ok = False
    try:
        yield
        ok = True
    finally:
        _Signals.critical += 1      # first statement: nothing may raise while restoring
        _Signals.depth -= 1
        pending = _Signals.pending
        if outer:
            for signum, old in _Signals.old.items():
                signal.signal(signum, old)
            _Signals.old, _Signals.pending, _Signals.raised = {}, 0, False
        _Signals.critical -= 1
    if ok and outer and pending:
        raise FreezeInterrupted(pending)


@contextmanager
def critical() -> Iterator[None]:
    """Defer SIGINT/SIGTERM/SIGHUP while the body runs; raise FreezeInterrupted at its end."""
    _Signals.critical += 1
    ok = False
    try:
        yield
        ok = True
    finally:
        _Signals.critical -= 1
    if ok:
        raise_pending()


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _Tracee(Fields):
    __slots__ = ("tid", "state", "kind", "signal", "extra_signals")

    def __init__(self, tid: int,
                 # seizing -> interrupted -> stopped | gone
                 state: str = "seizing",
                 # interrupt | group | signal | clone | event
                 kind: str = "",
                 # re-delivered at detach (signal-delivery-stop)
                 signal: int = 0,
                 extra_signals: Optional[List[int]] = None):  # tgkill'ed after detach
        self.tid = tid
        self.state = state
        self.kind = kind
        self.signal = signal
        self.extra_signals = [] if extra_signals is None else extra_signals


def _kind_of(status: int) -> str:
    """interrupt | group | signal | clone | event: the kind of a ptrace-stop's wait status."""
    event, sig = status >> 16, os.WSTOPSIG(status)
    if event == PTRACE_EVENT_STOP:
        return "interrupt" if sig == signal.SIGTRAP else (
            "group" if sig in JOB_CONTROL_SIGNALS else "event")
    if event == PTRACE_EVENT_CLONE:
        return "clone"
    return "signal" if event == 0 else "event"


def record_capacity(threads: int) -> int:
    """Records mu_freeze gets for a process that had `threads` threads just before: room for
    the threads created meanwhile (more continue in Python: MU_FREEZE_OVERFLOW)."""
    return max(64, 2 * threads + 32)


class _Prepared:
    """What mu_freeze needs, made before the stop: the records (the live threads, or the
    first one), the FP/SIMD areas, /proc/PID/task and /proc/PID/maps open, the maps text
    and its parse, the on_attach callback. Closes its descriptors when collected."""

    def __init__(self, pid: int, leader: procfs.Status, one_thread: bool,
                 on_attach: Optional[Callable[[int], None]]):
        global _XSTATE_STRIDE
        if not _XSTATE_STRIDE:
            _XSTATE_STRIDE = (lib.mu_xstate_size() + 63) // 64 * 64
        self.hook_error: Optional[BaseException] = None
        self.status_fd = -1
        self.maps: List[Mapping] = []
        self._fds: List[int] = []
        cap = record_capacity(leader.threads) if not one_thread else 1
        self.recs = ffi.new("mu_thread[]", cap)
        self.fp = ffi.new("uint8_t[]", cap * _XSTATE_STRIDE)
        a = self.args = ffi.new("mu_freeze_args *")
        a.pid, a.cap, a.wait_ms = pid, cap, int(FAST_WAIT * 1000)
        a.fp, a.fp_stride = self.fp, _XSTATE_STRIDE
        self.order = ffi.new("int32_t[]", cap)
        a.order = self.order
        a.task_fd = a.maps_fd = -1
        if one_thread:
            a.flags = lib.MU_FREEZE_NO_RELIST
            live = [t for t in procfs.list_tasks(pid)
                    if procfs.task_state(pid, t) not in ("Z", "X", "")][:1]
            for tid in live:
                self._add(tid, lib.MU_T_NEW)
        else:
            if leader.state == "Z":
                self._add(pid, lib.MU_T_SKIP)   # a zombie leader never stops: never seized
            a.task_fd = self._open(f"/proc/{pid}/task", os.O_DIRECTORY)
            # the leader's seccomp mode is read while stopped (Frozen.leader_seccomp_mode)
            self.status_fd = self._open(f"/proc/{pid}/task/{pid}/status")
            a.maps_fd = self._open(f"/proc/{pid}/maps")
            text = _read_all(a.maps_fd)
            self.maps = procfs.parse_maps(text.decode(errors="replace"))
            self._before = ffi.from_buffer(text)
            self._text = text
            a.maps_before, a.maps_before_len = self._before, len(text)
            a.maps_cap = len(text) + MAPS_SLACK
            self.maps_buf = ffi.new("uint8_t[]", a.maps_cap)
            a.maps_buf = self.maps_buf
        if on_attach is not None:
            def hook(tid):
                try:
                    on_attach(tid)
                    return 0
                except BaseException as exc:    # raised again once the records are Python's
                    self.hook_error = exc
                    return 1
            self._hook = ffi.callback("int(int)", hook)
            a.on_attach = self._hook

    def _add(self, tid: int, state: int) -> None:
        r = self.recs[self.args.n]
        r.tid, r.state = tid, state
        self.args.n += 1

    def _open(self, path: str, flags: int = 0) -> int:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
        except (FileNotFoundError, ProcessLookupError) as exc:
            raise NoSuchProcess(int(path.split("/")[2]), "process exited",
                                hint=diagnose.hint_no_process(int(path.split("/")[2]))) from exc
        self._fds.append(fd)
        return fd

    def fpregs(self, i: int, n: int) -> bytes:
        return ffi.buffer(self.fp + i * self.args.fp_stride, n)[:] if n > 0 else b""

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __del__(self):
        self.close()


def _read_all(fd: int) -> bytes:
    """The whole text of a /proc file open at fd, from offset 0."""
    parts, off = [], 0
    while True:
        chunk = os.pread(fd, 65536, off)
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)
        off += len(chunk)


# Threads that were seized but had not stopped when their thaw gave up (a D-state thread):
# tid -> (pid, tracer thread ident). release_pending() detaches them once they stop.
_PENDING: Dict[int, tuple] = {}


def _errno_of(exc: BaseException) -> int:
    return getattr(exc, "errno", None) or 0


def _waitpid(tid: int) -> Optional[int]:
    """Status of tid if it changed, None if not; ECHILD (not ours / gone) reads as exited."""
    try:
        r, status = os.waitpid(tid, WALL | os.WNOHANG)
    except ChildProcessError:
        return 0            # WIFEXITED with code 0: nothing left to do for it
    return status if r == tid else None


# Returns the number of threads still pending (seized by this thread, not yet stopped).
# Detaches every pending thread (of this tracer thread) that has stopped by now.
def release_pending(timeout: float = 0.0) -> int:
    me = threading.get_ident()
    deadline = time.monotonic() + timeout
    while True:
        for tid, (pid, owner) in list(_PENDING.items()):
            if owner != me:
                continue
            status = _waitpid(tid)
            if status is None:
                continue
            if os.WIFSTOPPED(status):
                sig = os.WSTOPSIG(status) if status >> 16 == 0 else 0
                try:
                    ptrace(PTRACE_DETACH, tid, 0, sig)
                except PtraceError:
                    pass
            del _PENDING[tid]
        left = sum(1 for _, owner in _PENDING.values() if owner == me)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.001)


class Frozen:
    """The frozen process: threads, maps, and the thaw. Built by frozen()."""

    def __init__(self, pid: int, timeout: float, on_attach: Optional[Callable[[int], None]] = None):
        self.pid = pid
        self.on_attach = on_attach
        self.timeout = timeout
        self._threads: Optional[List[ThreadState]] = None
        self._maps: Optional[List[Mapping]] = None
        self._fast = False              # mu_freeze completed: the records hold the state
        self._prep: Optional[_Prepared] = None
        self._extra: Dict[int, List[int]] = {}     # fast path: signals to tgkill after detach
        self.after_thaw: List[Callable[[], None]] = []  # run once every thread was detached
        self.pause_ms = 0.0
        self.released_ms = 0.0          # release_others(): first seize -> others detached
        self.thawed = False
        self.passes = 0
        self.owner = threading.get_ident()
        self.tracer_tid = threading.get_native_id()
        self._tracees: Dict[int, _Tracee] = {}
        self._started: Optional[float] = None
        _Signals.frozen += 1            # until the thaw: job-control stops wait for it

    # ---- signals: see interruptible()/critical() above

    def critical(self):
        """Defer SIGINT/SIGTERM/SIGHUP while the body runs; raise FreezeInterrupted at its end."""
        return critical()

    # ---- queries used by the snapshot stage

    def stop_kind(self, tid: int) -> str:
        """interrupt | group | signal | clone | event, or "" for a thread not stopped."""
        if self._fast:
            r = self._rec(tid)
            return _kind_of(r.status) if r is not None and r.state == lib.MU_T_STOPPED else ""
        tr = self._tracees.get(tid)
        return tr.kind if tr is not None and tr.state == "stopped" else ""

    def record_signals(self, tid: int, signals) -> None:
        """Signals met (and suppressed) while driving tid; re-delivered at the thaw."""
        if self._fast:
            if not any(signals):
                return
            r = self._rec(tid)
            for sig in signals:
                if sig and not r.sig and r.status >> 16 != 0:
                    r.sig = sig
                elif sig:
                    self._extra.setdefault(tid, []).append(sig)
            return
        tr = self._tracees[tid]
        for sig in signals:
            if sig and not tr.signal and tr.kind != "signal":
                tr.signal = sig
            elif sig:
                tr.extra_signals.append(sig)

    def check_owner(self) -> None:
        if threading.get_ident() != self.owner:
            raise CollectionError(
                f"process {self.pid} was frozen by another thread of this process; ptrace "
                "requests only work from the tracer thread")

    # ---- freeze

    def _seize(self, tid: int) -> None:
        tr = self._tracees[tid] = _Tracee(tid)
        try:
            ptrace(PTRACE_SEIZE, tid, 0, PTRACE_O_TRACECLONE)
            log.debug("PTRACE_SEIZE pid=%d tid=%d: ok", self.pid, tid)
        except PtraceError as exc:
            self._seize_failed(tr, _errno_of(exc))
            return
        tr.state = "interrupted"
        if self.on_attach is not None:
            self.on_attach(tid)     # tests: kill a thread or send a signal between the two
        try:
            ptrace(PTRACE_INTERRUPT, tid)
        except PtraceError as exc:
            # it exited meanwhile: waitpid reports it
            log.debug("PTRACE_INTERRUPT tid=%d: %s", tid, errno.errorcode.get(_errno_of(exc), exc))

    # PTRACE_SEIZE of tr answered err: gone (ESRCH, an exiting thread), already ours
    # (auto-attached by TRACECLONE: "interrupted"), or raises AccessDenied/CollectionError.
    def _seize_failed(self, tr: _Tracee, err: int) -> None:
        tid = tr.tid
        log.debug("PTRACE_SEIZE pid=%d tid=%d: %s", self.pid, tid, errno.errorcode.get(err, err))
        if err == errno.ESRCH:
            tr.state = "gone"
            return
        if err == errno.EPERM and tid != self.pid:
            # an exiting non-leader thread answers EPERM (ptrace-snapshot.md section 2.5);
            # a thread we already trace (auto-attached by TRACECLONE) does too
            st = self._thread_status(tid)
            if st is None or st.state in ("Z", "X"):
                tr.state = "gone"
                return
            if st.tracer_pid == self.tracer_tid:
                tr.state = "interrupted"
                return
        if err in (errno.EPERM, errno.EACCES, errno.ESRCH):
            tr.state = "gone"
            raise diagnose.diagnose(self.pid, err) from None
        raise CollectionError(f"PTRACE_SEIZE tid {tid} of process {self.pid}: "
                              f"{os.strerror(err)}")

    def _thread_status(self, tid: int) -> Optional[procfs.Status]:
        try:
            return procfs.read_status(self.pid, tid)
        except (NoSuchProcess, OSError, ValueError):
            return None

    def _capture(self, tr: _Tracee) -> None:
        regs = (ctypes.c_uint64 * len(REG_NAMES))()
        ptrace(PTRACE_GETREGS, tr.tid, 0, ctypes.addressof(regs))
        self._regs[tr.tid] = tuple(regs)
        self._fpregs[tr.tid] = _get_fpregs(tr.tid)

    def _on_status(self, tr: _Tracee, status: int) -> None:
        if not os.WIFSTOPPED(status):
            tr.state = "gone"
            return
        tr.kind = _kind_of(status)
        if tr.kind == "clone":
            msg = ctypes.c_ulong()
            ptrace(PTRACE_GETEVENTMSG, tr.tid, 0, ctypes.addressof(msg))
            if msg.value and msg.value not in self._tracees:
                # auto-attached by TRACECLONE; it reports its own PTRACE_EVENT_STOP
                self._tracees[msg.value] = _Tracee(msg.value, state="interrupted")
        elif tr.kind == "signal":
            tr.signal = os.WSTOPSIG(status)
        tr.state = "stopped"
        try:
            self._capture(tr)
        except PtraceError as exc:
            if _errno_of(exc) != errno.ESRCH:
                raise
            tr.state = "gone"       # killed while stopped (SIGKILL ends any stop)

    def _collect(self, deadline: float) -> None:
        rounds = 0
        while True:
            pending = [tr for tr in self._tracees.values() if tr.state == "interrupted"]
            if not pending:
                return
            progressed = False
            for tr in pending:
                status = _waitpid(tr.tid)
                if status is not None:
                    self._on_status(tr, status)
                    progressed = True
            if progressed:
                continue
            rounds += 1
            if rounds % 64 == 0:
                # a leader that called pthread_exit is a zombie and never stops
                for tr in pending:
                    if tr.tid == self.pid and procfs.task_state(self.pid, tr.tid) == "Z":
                        tr.state = "pending"    # traced but never stopping: release_pending()
                        _PENDING[tr.tid] = (self.pid, self.owner)
                pending = [tr for tr in pending if tr.state == "interrupted"]
                if not pending:
                    continue
            if time.monotonic() >= deadline:
                tr = pending[0]
                state = procfs.task_state(self.pid, tr.tid) or "?"
                raise CollectionError(
                    f"thread {tr.tid} of process {self.pid} did not stop within "
                    f"{self.timeout:g} s (state {state}: {STATE_WORDS.get(state, 'unknown')}); "
                    "the other threads were released (this one is released once it stops, "
                    "at the latest when this process exits)",
                    hint="A thread in state D (uninterruptible I/O, vfork, a frozen cgroup) "
                         "cannot be stopped; try again later or raise --timeout.")
            if rounds < 200:
                os.sched_yield()
            else:
                time.sleep(0.0002)

    # Stops every thread (one_thread: the first live one) and captures it. Everything that
    # reads /proc text, parses or allocates runs before the first SEIZE (the leader's status,
    # the maps, the C buffers); mu_freeze (native/mu_ptrace.c) then seizes, interrupts,
    # collects, captures and re-lists in one call and re-reads the maps text, which is
    # parsed again only if it changed. Whatever mu_freeze leaves to policy (a SEIZE refused,
    # a thread that did not stop within FAST_WAIT, a thread past the record capacity, the
    # on_attach hook raising) continues in the Python state machine below, as before.
    def _freeze(self, one_thread: bool) -> None:
        self._regs: Dict[int, tuple] = {}
        self._fpregs: Dict[int, bytes] = {}
        release_pending()
        deadline = time.monotonic() + self.timeout
        # before the stop: the target still runs
        leader = procfs.read_status(self.pid)
        if leader.state in ("Z", "X") and leader.threads <= 1:
            raise diagnose.diagnose(self.pid, errno.ESRCH)
        prep = _Prepared(self.pid, leader, one_thread, self.on_attach)
        self._prep = prep
        with self.critical():
            self._started = time.monotonic()
            n = lib.mu_freeze(prep.recs, prep.args)
            if prep.args.t_seize_ns:
                self._started = prep.args.t_seize_ns / 1e9
            self.passes = prep.args.passes + 1
            if n < 0 or prep.args.result != lib.MU_FREEZE_DONE:
                self._to_python(prep.args.n if n >= 0 else 0)
                self._freeze_python(one_thread, deadline)
            else:
                self._fast = True
                a = prep.args
                if a.maps_fd >= 0 and not 0 <= a.maps_len < a.maps_cap:
                    self.maps = procfs.read_maps(self.pid)  # unreadable, or too long: now
            if not self._fast:
                self.threads = [ThreadState(tid=t, regs=self._regs[t], fpregs=self._fpregs[t],
                                            stop_signal=tr.signal)
                                for t, tr in sorted(self._tracees.items())
                                if tr.state == "stopped"]
                if not self.threads:
                    raise self._exited()
                if not one_thread:
                    self.maps = procfs.read_maps(self.pid)
            elif not prep.args.stopped:
                raise self._exited()

    def _exited(self) -> NoSuchProcess:
        return NoSuchProcess(self.pid, f"process {self.pid} exited while being frozen",
                             hint=diagnose.hint_no_process(self.pid))

    # Hands the records of an incomplete mu_freeze (n of them, or n < 0: none) to the Python
    # state machine (_tracees), then applies the policy mu_freeze left open: a refused SEIZE
    # (_seize_failed), a capture that failed (_capture again raises as before), the hook's
    # exception.
    def _to_python(self, n: int) -> None:
        prep = self._prep
        failed = []
        for i in range(max(n, 0)):
            r = prep.recs[i]
            tid, state = r.tid, r.state
            if state == lib.MU_T_NEW:
                continue                # never seized: the next listing finds it
            tr = self._tracees[tid] = _Tracee(tid)
            if state == lib.MU_T_SKIP:
                tr.state = "zombie"
            elif state == lib.MU_T_SEIZED:
                tr.state = "interrupted"
            elif state == lib.MU_T_GONE:
                tr.state = "gone"
            elif state == lib.MU_T_SEIZE_FAILED:
                failed.append((tr, r.err))
            elif state in (lib.MU_T_STOPPED, lib.MU_T_CAPTURE_FAILED):
                tr.state, tr.kind = "stopped", _kind_of(r.status)
                tr.signal = r.sig
                if state == lib.MU_T_STOPPED:
                    self._regs[tid] = tuple(r.regs)
                    self._fpregs[tid] = prep.fpregs(i, r.fplen)
                else:
                    failed.append((tr, -1))
                if r.event_msg and r.event_msg not in self._tracees:
                    self._tracees.setdefault(r.event_msg, _Tracee(r.event_msg, state="interrupted"))
        for tr, err in failed:
            if err == -1:
                try:
                    self._capture(tr)
                except PtraceError as exc:
                    if _errno_of(exc) != errno.ESRCH:
                        raise
                    tr.state = "gone"
            else:
                self._seize_failed(tr, err)
        if prep.hook_error is not None:
            raise prep.hook_error

    def _freeze_python(self, one_thread: bool, deadline: float) -> None:
        """The Python state machine: collect, re-list, seize until a listing finds no thread."""
        while True:
            self._collect(deadline)
            if one_thread:
                return
            self.passes += 1
            tids = procfs.list_tasks(self.pid)
            new = [t for t in tids if t not in self._tracees]
            for tid in new:
                if tid == self.pid and procfs.task_state(self.pid, tid) == "Z":
                    self._tracees[tid] = _Tracee(tid, state="zombie")
                    continue
                self._seize(tid)
            if not new:
                return

    # ---- the records of a complete mu_freeze (the fast path): read lazily, after the thaw
    # when the caller can wait

    @property
    def threads(self) -> List[ThreadState]:
        if self._threads is None and self._fast:
            prep = self._prep
            out = []
            for i in range(prep.args.n):
                r = prep.recs[i]
                if r.state in (lib.MU_T_STOPPED, lib.MU_T_DETACHED, lib.MU_T_DETACH_FAILED) \
                        and r.status:
                    out.append(ThreadState(tid=r.tid, regs=tuple(r.regs),
                                           fpregs=prep.fpregs(i, r.fplen), stop_signal=r.sig))
            out.sort(key=lambda t: t.tid)
            self._threads = out
        return self._threads if self._threads is not None else []

    @threads.setter
    def threads(self, value: List[ThreadState]) -> None:
        self._threads = value

    @property
    def maps(self) -> List[Mapping]:
        if self._maps is None and self._fast:
            prep = self._prep
            if prep.args.maps_fd < 0:
                self._maps = []
            elif prep.args.maps_changed:
                # the text read while stopped differs from the one parsed before: parse it
                text = ffi.buffer(prep.maps_buf, prep.args.maps_len)[:].decode(errors="replace")
                self._maps = procfs.parse_maps(text)
                log.debug("maps of process %d changed before the freeze: parsed again", self.pid)
            else:
                self._maps = prep.maps
        return self._maps if self._maps is not None else []

    @maps.setter
    def maps(self, value: List[Mapping]) -> None:
        self._maps = value

    # Yields (tid, orig_rax, rip) of the threads at an interrupt stop, in tid order, read
    # straight from the records (no ThreadState built while the target is stopped).
    def interrupt_stops(self) -> Iterator[Tuple[int, int, int]]:
        if not self._fast:
            yield from ((t.tid, t.regs[ORIG_RAX], t.regs[RIP]) for t in self.threads
                        if self.stop_kind(t.tid) == "interrupt")
            return
        prep = self._prep
        recs, order = prep.recs, prep.order
        for k in range(prep.args.norder):         # mu_freeze sorted them by tid
            r = recs[order[k]]
            if r.state == lib.MU_T_STOPPED and r.status >> 8 == INTERRUPT_STATUS:
                regs = r.regs
                yield r.tid, regs[ORIG_RAX], regs[RIP]

    # Returns (tid, address of its `syscall` instruction) of the first thread, in tid order,
    # at an interrupt stop right after a `syscall` instruction (mu_freeze found it: one
    # PTRACE_PEEKDATA), or None (not the fast path, or no such thread).
    def syscall_candidate(self) -> Optional[Tuple[int, int]]:
        if not self._fast or self._prep.args.candidate < 0:
            return None
        r = self._prep.recs[self._prep.args.candidate]
        if r.state != lib.MU_T_STOPPED:
            return None
        return r.tid, r.regs[RIP] - 2

    def leader_seccomp_mode(self) -> int:
        """The leader's seccomp mode now (procfs.parse_seccomp of its status, open since
        before the freeze: one pread while stopped), -1 when unknown (not the fast path,
        thawed, unreadable)."""
        fd = self._prep.status_fd if self._fast and not self.thawed else -1
        if fd < 0:
            return -1
        try:
            return procfs.parse_seccomp(os.pread(fd, 16384, 0))[0]
        except OSError:
            return -1

    def regs_at_freeze(self, tid: int):
        """tid's 27 registers as the freeze captured them, for native/mu_ptrace.c's
        injections (a cdata uint64_t array), or ffi.NULL when it has none."""
        if self._fast:
            r = self._rec(tid)
            return r.regs if r is not None and r.state == lib.MU_T_STOPPED else ffi.NULL
        t = next((t for t in self.threads if t.tid == tid), None)
        return ffi.new("uint64_t[]", list(t.regs)) if t is not None else ffi.NULL

    def _rec(self, tid: int):
        recs = self._prep.recs
        for i in range(self._prep.args.n):
            if recs[i].tid == tid:
                return recs[i]
        return None

    # ---- thaw

    def _settle(self, tr: _Tracee, deadline: float) -> None:
        """tr may still be on its way to a stop: wait for it (until deadline), then detach."""
        while True:
            status = _waitpid(tr.tid)
            if status is not None:
                if not os.WIFSTOPPED(status):
                    tr.state = "gone"
                    return
                sig = tr.signal or (os.WSTOPSIG(status) if status >> 16 == 0 else 0)
                try:
                    ptrace(PTRACE_DETACH, tr.tid, 0, sig)
                    tr.state = "detached"
                    return
                except PtraceError:
                    continue
            if time.monotonic() >= deadline:
                _PENDING[tr.tid] = (self.pid, self.owner)
                tr.state = "pending"
                return
            time.sleep(0.0002)

    # Returns the pause in ms (first seize to last detach). Idempotent. Detaches every
    # thread, re-delivering recorded signals (detach signal for a signal-delivery-stop,
    # tgkill for signals met during an injection). Raises FreezeInterrupted afterwards if
    # SIGINT/SIGTERM arrived during the freeze.
    def thaw(self) -> float:
        if self.thawed:
            return self.pause_ms
        self.check_owner()
        _Signals.critical += 1
        try:
            grace = time.monotonic() + SETTLE_GRACE
            if self._fast:
                self._thaw_fast(grace)
            for tr in list(self._tracees.values()):
                if tr.state == "stopped":
                    try:
                        ptrace(PTRACE_DETACH, tr.tid, 0, tr.signal)
                        tr.state = "detached"
                    except PtraceError:
                        self._settle(tr, grace)     # ESRCH: not in a stop (killed, or exiting)
                elif tr.state in ("seizing", "interrupted"):
                    try:    # again: an exception may have come between SEIZE and INTERRUPT
                        ptrace(PTRACE_INTERRUPT, tr.tid)
                    except PtraceError:
                        pass
                    self._settle(tr, grace)
                elif tr.state == "zombie":
                    pass    # never seized
            for tr in self._tracees.values():
                for sig in tr.extra_signals:
                    lib.mu_tgkill(self.pid, tr.tid, sig)
            for tid, sigs in self._extra.items():
                for sig in sigs:
                    lib.mu_tgkill(self.pid, tid, sig)
            if self._prep is not None:
                self._prep.close()
            for fn in self.after_thaw:
                try:
                    fn()
                except Exception as exc:    # noqa: BLE001 - the thaw itself succeeded
                    log.warning("after the thaw of process %d: %s", self.pid, exc)
            self.after_thaw = []
            if self._started is not None and (not self._fast or self._tracees):
                self.pause_ms = (time.monotonic() - self._started) * 1000.0
            self.thawed = True
            _Signals.frozen -= 1
        finally:
            _Signals.critical -= 1
        _stop_if_pending()
        raise_pending()
        return self.pause_ms

    def _thaw_fast(self, grace: float) -> None:
        """Detach every stopped record in one C call; a thread that left its stop meanwhile
        (killed, exiting) is settled like in the Python path."""
        prep = self._prep
        lib.mu_thaw(prep.recs, prep.args.n)
        if self._started is not None:
            self.pause_ms = (time.monotonic() - self._started) * 1000.0
        for i in range(prep.args.n):
            r = prep.recs[i]
            if r.state == lib.MU_T_DETACH_FAILED:
                tr = self._tracees[r.tid] = _Tracee(r.tid, state="settling", signal=r.sig)
                self._settle(tr, grace)

    # Detaches every stopped thread but tid (a signal-delivery-stop's signal re-delivered), so
    # that they run while a function call injected into tid runs (inject.py: a lock another
    # thread holds is released, and the call never waits on a frozen thread). A thread whose
    # detach fails is left to the thaw, which detaches tid too.
    def release_others(self, tid: int) -> None:
        self.check_owner()
        with critical():
            if self._fast:
                prep = self._prep
                for i in range(prep.args.n):
                    r = prep.recs[i]
                    if r.state == lib.MU_T_STOPPED and r.tid != tid and \
                            lib.mu_ptrace(PTRACE_DETACH, r.tid, 0, r.sig) == 0:
                        r.state = lib.MU_T_DETACHED
            for tr in self._tracees.values():
                if tr.state == "stopped" and tr.tid != tid and \
                        lib.mu_ptrace(PTRACE_DETACH, tr.tid, 0, tr.signal) == 0:
                    tr.state = "detached"
            if self._started is not None:
                self.released_ms = (time.monotonic() - self._started) * 1000.0

    def pending_tids(self) -> List[int]:
        """Threads the thaw could not detach (they had not stopped); see release_pending()."""
        return [t for t, tr in self._tracees.items() if tr.state == "pending"]


def _get_fpregs(tid: int) -> bytes:
    """The xsave area (NT_X86_XSTATE: xmm + upper ymm/zmm halves), else the 512-byte fxsave."""
    buf = ctypes.create_string_buffer(XSTATE_MAX)
    iov = _IOVec(ctypes.cast(buf, ctypes.c_void_p), XSTATE_MAX)
    try:
        ptrace(PTRACE_GETREGSET, tid, NT_X86_XSTATE, ctypes.addressof(iov))
        return buf.raw[:iov.len]
    except PtraceError as exc:
        if _errno_of(exc) == errno.ESRCH:
            raise
    fx = ctypes.create_string_buffer(FXSAVE_SIZE)
    ptrace(PTRACE_GETFPREGS, tid, 0, ctypes.addressof(fx))
    return fx.raw


# Yields a Frozen with every thread of pid stopped (one_thread: only the first live thread,
# used to inject a short syscall). on_attach(tid) runs between each SEIZE and INTERRUPT
# (a test hook: deliver a signal or kill a thread there). Raises NoSuchProcess (gone or exited meanwhile),
# AccessDenied (from diagnose.diagnose, with a hint), CollectionError (a thread did not stop
# within timeout; every thread was released), FreezeInterrupted (SIGINT/SIGTERM/SIGHUP).
@contextmanager
def frozen(pid: int, timeout: float = 2.0, *, one_thread: bool = False,
           on_attach: Optional[Callable[[int], None]] = None) -> Iterator[Frozen]:
    with interruptible():
        fz = Frozen(pid, timeout, on_attach)
        try:
            fz._freeze(one_thread)
            yield fz
        finally:
            fz.thaw()
