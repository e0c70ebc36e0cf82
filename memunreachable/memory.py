"""memory.py: read the snapshot's (or the frozen target's) memory.

ProcessMemory wraps an open /proc/<pid>/mem fd. The checker opens it (the ptrace access
check happens at open), and the forked sweeper reads through the inherited fd.
Unreadable pages read as zeros and are counted.
"""
from __future__ import annotations

import os

from memunreachable._ffi import buffer_of, check, lib


class ProcessMemory:
    def __init__(self, pid: int, fd: int = None):
        self.pid = pid
        self.fd = fd if fd is not None else os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        self.unreadable_bytes = 0

    def read(self, addr: int, size: int) -> bytes:
        buf = bytearray(size)
        self.read_into(addr, buf)
        return bytes(buf)

    def read_into(self, addr: int, buf) -> int:
        n = memoryview(buf).nbytes
        if n == 0:
            return 0
        bad = check(lib.mu_read(self.fd, addr, buffer_of(buf), n), "read memory", pid=self.pid)
        self.unreadable_bytes += bad
        return bad

    def close(self) -> None:
        if self.fd is not None and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
