"""freeze.py: Stage 2: stop every thread of a process, capture registers and maps, thaw.

Input: a pid. Output, inside `with frozen(pid, timeout=2.0) as fz:`
    fz.threads  [ThreadState] (27 general registers, FP/SIMD state, recorded signal), tid order
    fz.maps     [Mapping] read while stopped
    fz.thaw()   detach every thread, re-delivering recorded signals; idempotent; sets fz.pause_ms
Leaving the block thaws on every path (exception, KeyboardInterrupt). SIGINT/SIGTERM/SIGHUP
that arrive while the guard is active raise FreezeInterrupted(signum) (deferred while a ptrace
sequence runs), so the thaw in `finally` always runs; the caller re-raises the signal.

Signals during a check: interrupts.py (interruptible(), critical()). The ptrace requests, the
buffers prepared before the pause and the registry of threads left seized: tracees.py.

Mechanics (ptrace-snapshot.md sections 2, 3, 9): PTRACE_SEIZE(TRACECLONE) + PTRACE_INTERRUPT
for every tid of /proc/PID/task, then collect the stops with waitpid(tid, __WALL|WNOHANG)
per tid (never waitpid(-1): the caller may have other children), re-listing until a pass
finds nothing new. The pause (issue 10): everything that reads /proc text, parses or
allocates runs before the first SEIZE (the leader's status, the maps, parsed, the C
buffers: Prepared); then one C call, mu_freeze (native/mu_ptrace.c), seizes, interrupts,
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

from memunreachable.collect import diagnose, interrupts, procfs
from memunreachable.collect.interrupts import critical, interruptible, raise_pending
from memunreachable.collect.tracees import (
    PENDING, PTRACE_DETACH, PTRACE_EVENT_STOP, PTRACE_GETEVENTMSG, PTRACE_GETREGS,
    PTRACE_INTERRUPT, PTRACE_O_TRACECLONE, PTRACE_SEIZE, Prepared, PtraceError, Tracee, errno_of,
    get_fpregs, kind_of, ptrace, release_pending, waitpid)
from memunreachable._errors import CollectionError, NoSuchProcess
from memunreachable._ffi import ffi, lib
from memunreachable._types import REG_NAMES, Mapping, ThreadState

log = logging.getLogger("memunreachable")

SETTLE_GRACE = 0.5              # seconds a thaw waits for a stop that is still on its way
INTERRUPT_STATUS = PTRACE_EVENT_STOP << 8 | signal.SIGTRAP     # status >> 8 of an interrupt stop
ORIG_RAX, RIP = REG_NAMES.index("orig_rax"), REG_NAMES.index("rip")
STATE_WORDS = {"D": "uninterruptible sleep: I/O, vfork or a frozen cgroup",
               "T": "stopped by job control", "t": "traced", "Z": "zombie", "R": "running",
               "S": "sleeping"}


class Frozen:
    """The frozen process: threads, maps, and the thaw. Built by frozen()."""

    def __init__(self, pid: int, timeout: float, on_attach: Optional[Callable[[int], None]] = None):
        self.pid = pid
        self.on_attach = on_attach
        self.timeout = timeout
        self._threads: Optional[List[ThreadState]] = None
        self._maps: Optional[List[Mapping]] = None
        self._fast = False              # mu_freeze completed: the records hold the state
        self._prep: Optional[Prepared] = None
        self._extra: Dict[int, List[int]] = {}     # fast path: signals to tgkill after detach
        self.after_thaw: List[Callable[[], None]] = []  # run once every thread was detached
        self.pause_ms = 0.0
        self.released_ms = 0.0          # release_others(): first seize -> others detached
        self.thawed = False
        self.passes = 0
        self.owner = threading.get_ident()
        self.tracer_tid = threading.get_native_id()
        self._tracees: Dict[int, Tracee] = {}
        self._started: Optional[float] = None
        interrupts.Signals.frozen += 1            # until the thaw: job-control stops wait for it

    # ---- signals: see interruptible()/critical() above

    def critical(self):
        """Defer SIGINT/SIGTERM/SIGHUP while the body runs; raise FreezeInterrupted at its end."""
        return critical()

    # ---- queries used by the snapshot stage

    def stop_kind(self, tid: int) -> str:
        """interrupt | group | signal | clone | event, or "" for a thread not stopped."""
        if self._fast:
            r = self._rec(tid)
            return kind_of(r.status) if r is not None and r.state == lib.MU_T_STOPPED else ""
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
        tr = self._tracees[tid] = Tracee(tid)
        try:
            ptrace(PTRACE_SEIZE, tid, 0, PTRACE_O_TRACECLONE)
            log.debug("PTRACE_SEIZE pid=%d tid=%d: ok", self.pid, tid)
        except PtraceError as exc:
            self._seize_failed(tr, errno_of(exc))
            return
        tr.state = "interrupted"
        if self.on_attach is not None:
            self.on_attach(tid)     # tests: kill a thread or send a signal between the two
        try:
            ptrace(PTRACE_INTERRUPT, tid)
        except PtraceError as exc:
            # it exited meanwhile: waitpid reports it
            log.debug("PTRACE_INTERRUPT tid=%d: %s", tid, errno.errorcode.get(errno_of(exc), exc))

    # PTRACE_SEIZE of tr answered err: gone (ESRCH, an exiting thread), already ours
    # (auto-attached by TRACECLONE: "interrupted"), or raises AccessDenied/CollectionError.
    def _seize_failed(self, tr: Tracee, err: int) -> None:
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

    def _capture(self, tr: Tracee) -> None:
        regs = (ctypes.c_uint64 * len(REG_NAMES))()
        ptrace(PTRACE_GETREGS, tr.tid, 0, ctypes.addressof(regs))
        self._regs[tr.tid] = tuple(regs)
        self._fpregs[tr.tid] = get_fpregs(tr.tid)

    def _on_status(self, tr: Tracee, status: int) -> None:
        if not os.WIFSTOPPED(status):
            tr.state = "gone"
            return
        tr.kind = kind_of(status)
        if tr.kind == "clone":
            msg = ctypes.c_ulong()
            ptrace(PTRACE_GETEVENTMSG, tr.tid, 0, ctypes.addressof(msg))
            if msg.value and msg.value not in self._tracees:
                # auto-attached by TRACECLONE; it reports its own PTRACE_EVENT_STOP
                self._tracees[msg.value] = Tracee(msg.value, state="interrupted")
        elif tr.kind == "signal":
            tr.signal = os.WSTOPSIG(status)
        tr.state = "stopped"
        try:
            self._capture(tr)
        except PtraceError as exc:
            if errno_of(exc) != errno.ESRCH:
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
                status = waitpid(tr.tid)
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
                        PENDING[tr.tid] = (self.pid, self.owner)
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
        if _ended(leader):
            raise diagnose.diagnose(self.pid, errno.ESRCH)
        prep = Prepared(self.pid, leader, one_thread, self.on_attach)
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
            tr = self._tracees[tid] = Tracee(tid)
            if state == lib.MU_T_SKIP:
                tr.state = "zombie"
            elif state == lib.MU_T_SEIZED:
                tr.state = "interrupted"
            elif state == lib.MU_T_GONE:
                tr.state = "gone"
            elif state == lib.MU_T_SEIZE_FAILED:
                failed.append((tr, r.err))
            elif state in (lib.MU_T_STOPPED, lib.MU_T_CAPTURE_FAILED):
                tr.state, tr.kind = "stopped", kind_of(r.status)
                tr.signal = r.sig
                if state == lib.MU_T_STOPPED:
                    self._regs[tid] = tuple(r.regs)
                    self._fpregs[tid] = prep.fpregs(i, r.fplen)
                else:
                    failed.append((tr, -1))
                if r.event_msg and r.event_msg not in self._tracees:
                    self._tracees.setdefault(r.event_msg, Tracee(r.event_msg, state="interrupted"))
        for tr, err in failed:
            if err == -1:
                try:
                    self._capture(tr)
                except PtraceError as exc:
                    if errno_of(exc) != errno.ESRCH:
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
                    self._tracees[tid] = Tracee(tid, state="zombie")
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

    def _settle(self, tr: Tracee, deadline: float) -> None:
        """tr may still be on its way to a stop: wait for it (until deadline), then detach."""
        while True:
            status = waitpid(tr.tid)
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
                PENDING[tr.tid] = (self.pid, self.owner)
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
        interrupts.Signals.critical += 1
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
            interrupts.Signals.frozen -= 1
        finally:
            interrupts.Signals.critical -= 1
        interrupts.stop_if_pending()
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
                tr = self._tracees[r.tid] = Tracee(r.tid, state="settling", signal=r.sig)
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


# Yields a Frozen with every thread of pid stopped (one_thread: only the first live thread,
# used to inject a short syscall). on_attach(tid) runs between each SEIZE and INTERRUPT
# (a test hook: deliver a signal or kill a thread there). Raises NoSuchProcess (gone or exited meanwhile),
# AccessDenied (from diagnose.diagnose, with a hint), CollectionError (a thread did not stop
# within timeout; every thread was released), FreezeInterrupted (SIGINT/SIGTERM/SIGHUP).
@contextmanager
def frozen(pid: int, timeout: float = 2.0, *, one_thread: bool = False,
           on_attach: Optional[Callable[[int], None]] = None) -> Iterator[Frozen]:
    with interruptible():
        deadline = time.monotonic() + timeout
        while True:
            fz = Frozen(pid, timeout, on_attach)
            try:
                fz._freeze(one_thread)
                break
            except NoSuchProcess:
                fz.thaw()
                # one thread: the one it chose ended meanwhile (a short-lived thread), not
                # the process; another is chosen
                if not one_thread or time.monotonic() >= deadline or not _lives(pid):
                    raise
            except BaseException:
                fz.thaw()
                raise
        try:
            yield fz
        finally:
            fz.thaw()


def _lives(pid: int) -> bool:
    """Neither ended nor dying (a SIGKILL on its way): another thread may be frozen."""
    try:
        st = procfs.read_status(pid)
    except (NoSuchProcess, OSError, ValueError):
        return False
    return not _ended(st) and not st.dying


def _ended(leader: procfs.Status) -> bool:
    """A process whose leader is a zombie lives on while another thread runs."""
    return leader.state in ("Z", "X") and leader.threads <= 1
