"""Shared helpers of the freeze/snapshot/preflight integration tests (not a test module)."""
import contextlib
import os
import subprocess
import sys
import time

from memunreachable.collect import procfs
from memunreachable._errors import NoSuchProcess


@contextlib.contextmanager
def busy_cpus():
    """A busy loop on every CPU while the block runs (the load under which clean-clone CI runs
    missed leaks); the loops are killed and reaped after."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def oom_score_adj(pid: int) -> int:
    with open(f"/proc/{pid}/oom_score_adj") as f:
        return int(f.read())


def peek(pid: int, addr: int) -> int:
    """One 8-byte word of pid's memory (we are root, or its tracer)."""
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:
        return int.from_bytes(os.pread(fd, 8, addr), "little")
    finally:
        os.close(fd)


def states(pid: int) -> dict:
    return {tid: procfs.task_state(pid, tid) for tid in procfs.list_tasks(pid)}


def assert_running(pid: int) -> None:
    """No thread left in a ptrace stop or job-control stop, and not traced."""
    st = {t: s for t, s in states(pid).items() if s}
    assert not [t for t, s in st.items() if s in ("t", "T")], st
    for tid in st:
        try:
            tracer = procfs.read_status(pid, tid).tracer_pid
        except NoSuchProcess:
            continue        # a short-lived thread ended meanwhile
        assert tracer == 0, (tid, tracer)


def children(pid: int) -> list:
    out = []
    for tid in procfs.list_tasks(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            continue        # a short-lived thread ended meanwhile
    return out


def wait_until(pred, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.002)
    return pred()


def moves(pid: int, addr: int, timeout: float = 5.0) -> bool:
    first = peek(pid, addr)
    return wait_until(lambda: peek(pid, addr) != first, timeout)
