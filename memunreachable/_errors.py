"""_errors.py: the exception hierarchy (style.md section 3.5).

Every error pickles (errors travel over the sweeper pipe) and carries an actionable hint.
"""
from __future__ import annotations

from typing import Optional


class MemunreachableError(Exception):
    """Base of every error memunreachable raises on purpose."""

    def __init__(self, msg: str = "", hint: Optional[str] = None):
        super().__init__(msg, hint)
        self.msg = msg
        self.hint = hint

    def __str__(self) -> str:
        return self.msg

    def __reduce__(self):
        return (_rebuild, (type(self), self.__dict__))


def _rebuild(cls, state):
    obj = cls.__new__(cls)
    Exception.__init__(obj, state.get("msg", ""), state.get("hint"))
    obj.__dict__.update(state)
    return obj


class ProcessError(MemunreachableError):
    """Something about the target process stops the check."""

    def __init__(self, pid: int, msg: str = "", hint: Optional[str] = None, name: Optional[str] = None):
        super().__init__(msg, hint)
        self.pid = pid
        self.name = name

    def __str__(self) -> str:
        who = f"pid={self.pid}" + (f", name={self.name!r}" if self.name else "")
        return f"{self.msg} ({who})"


class NoSuchProcess(ProcessError):
    pass


class ZombieProcess(NoSuchProcess):
    pass


class AccessDenied(ProcessError):
    pass


class UnsupportedTarget(MemunreachableError):
    """Not something we can check correctly: another allocator, unknown layout, kernel thread, ..."""


class IncompleteCheck(UnsupportedTarget):
    """Part of the process could not be understood (a CPython layout that does not fit, a
    free-threaded CPython, memory the snapshot lacked, GC lists that could not be walked):
    leaks there could hide, so no verdict is given (issue 22: never a silent "no leaks").

    reasons: one sentence per part not seen. info: the UnreachableMemoryInfo of what could be
    checked (complete False), for a caller that asked for it (check --partial, partial=True)."""

    def __init__(self, msg: str = "", hint: Optional[str] = None, reasons=(), info=None):
        super().__init__(msg, hint)
        self.reasons = list(reasons)
        self.info = info


class CollectionError(MemunreachableError):
    """Freezing or snapshotting failed or timed out (everything was released)."""


class MemoryUnreadable(CollectionError):
    """Memory the sweep needed could not be read from the snapshot (never counted as zeros).

    address: the first unreadable byte; the orchestrator decides the cause (the snapshot
    process died, a mapping missing from the snapshot) and whether a retry can help."""

    def __init__(self, msg: str = "", hint: Optional[str] = None, address: int = 0):
        super().__init__(msg, hint)
        self.address = address


class HeapWalkError(MemunreachableError):
    """The heap stayed inconsistent after every retry."""


class HeapCorrupt(HeapWalkError):
    """The heap is inconsistent in the same way in two snapshots with no thread in malloc."""


class SweepError(MemunreachableError):
    """The sweeper process crashed, timed out or sent garbage."""


class OutOfMemory(SweepError):
    """The kernel's OOM killer took the process that swept (the forked sweeper, or the helper
    of in-process checks) before it sent a result."""

    def __init__(self, what: str):
        super().__init__(
            f"{what} was killed (SIGKILL) while the kernel's OOM killer ran (/proc/vmstat "
            "oom_kill): out of memory before it sent a result; nothing was reported",
            hint="the sweep holds copies of the target's heap (a Python process's: about "
                 "1.3-1.5 times its heap); free memory, or check when the process is smaller. "
                 "The target is not harmed: the sweeper and the snapshot are the OOM killer's "
                 "first choice")


class SuppressionsError(MemunreachableError):
    """A suppressions file could not be read or parsed (suppressions.py); path and line (1-based,
    0 when the file could not be read) say where."""

    def __init__(self, msg: str = "", hint: Optional[str] = None, path: str = "", line: int = 0):
        super().__init__(msg, hint)
        self.path = path
        self.line = line


class TrackingError(MemunreachableError):
    """Allocation tracking could not be started in this process (track_here.py): the
    tracking library did not load, or routing the malloc family through it failed (errno:
    the library's -errno, 0 when it did not load). Nothing stays routed then."""

    def __init__(self, msg: str = "", hint: Optional[str] = None, errno: int = 0):
        super().__init__(msg, hint)
        self.errno = errno


class CommandError(MemunreachableError):
    """CLI-only: a usage problem found after parsing."""

    def __init__(self, msg: str = "", hint: Optional[str] = None, exit_code: int = 2):
        super().__init__(msg, hint)
        self.exit_code = exit_code


class LeaksDetected(AssertionError):
    """Raised by assert_no_leaks(): carries the UnreachableMemoryInfo and its report."""

    def __init__(self, info, report: str = ""):
        super().__init__(report or f"{info.num_leaks} unreachable allocations")
        self.info = info
        self.report = report
