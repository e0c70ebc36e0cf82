"""tracees.py: Stage 2 below the Frozen class (freeze.py): ptrace requests, what the freeze
prepares before the pause, the kind of each stop, and the threads a thaw left seized.

    ptrace(request, tid, addr, data)    ptrace(2) through the C core; PtraceError on failure
    Prepared(pid, leader, one_thread, on_attach)
                                        mu_freeze's records, FP/SIMD areas, open /proc files
                                        and the maps text, all made before the first SEIZE
    kind_of(status)                     interrupt | group | signal | clone | event
    get_fpregs(tid)                     the xsave area (else fxsave) of a stopped thread
    release_pending(timeout)            detach the threads seized by this tracer thread that
                                        had not stopped when their thaw gave up (PENDING)
References: ptrace(2); <sys/ptrace.h>, <linux/elf.h>, <sys/wait.h> (x86_64).
"""
from __future__ import annotations

import ctypes
import errno
import os
import signal
import threading
import time
from typing import Callable, Dict, List, Optional

from memunreachable.collect import diagnose, procfs
from memunreachable._errors import NoSuchProcess
from memunreachable._ffi import ffi, lib
from memunreachable._types import Fields, Mapping

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
FAST_WAIT = 0.05                # seconds mu_freeze waits for stops before Python takes over
MAPS_SLACK = 64 << 10           # room for maps that grew between the read and the freeze
_XSTATE_STRIDE = 0              # bytes per thread for the FP/SIMD area (CPUID), set on first use


class PtraceError(OSError):
    """A ptrace request failed (.errno)."""


def ptrace(request: int, tid: int, addr: int = 0, data: int = 0) -> int:
    """ptrace(2) through the C core (python-ptrace costs ~20 ms of start-up: issue 10)."""
    rc = lib.mu_ptrace(request, tid, addr, data)
    if rc < 0:
        raise PtraceError(-rc, os.strerror(-rc), f"ptrace({request:#x}, {tid})")
    return rc


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class Tracee(Fields):
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


def kind_of(status: int) -> str:
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


class Prepared:
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
            # the leader first: a short-lived thread may end before its stop (frozen retries)
            live = [t for t in sorted(procfs.list_tasks(pid), key=lambda t: t != pid)
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
PENDING: Dict[int, tuple] = {}


def errno_of(exc: BaseException) -> int:
    return getattr(exc, "errno", None) or 0


def waitpid(tid: int) -> Optional[int]:
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
        for tid, (pid, owner) in list(PENDING.items()):
            if owner != me:
                continue
            status = waitpid(tid)
            if status is None:
                continue
            if os.WIFSTOPPED(status):
                sig = os.WSTOPSIG(status) if status >> 16 == 0 else 0
                try:
                    ptrace(PTRACE_DETACH, tid, 0, sig)
                except PtraceError:
                    pass
            del PENDING[tid]
        left = sum(1 for _, owner in PENDING.values() if owner == me)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.001)


def get_fpregs(tid: int) -> bytes:
    """The xsave area (NT_X86_XSTATE: xmm + upper ymm/zmm halves), else the 512-byte fxsave."""
    buf = ctypes.create_string_buffer(XSTATE_MAX)
    iov = _IOVec(ctypes.cast(buf, ctypes.c_void_p), XSTATE_MAX)
    try:
        ptrace(PTRACE_GETREGSET, tid, NT_X86_XSTATE, ctypes.addressof(iov))
        return buf.raw[:iov.len]
    except PtraceError as exc:
        if errno_of(exc) == errno.ESRCH:
            raise
    fx = ctypes.create_string_buffer(FXSAVE_SIZE)
    ptrace(PTRACE_GETFPREGS, tid, 0, ctypes.addressof(fx))
    return fx.raw
