"""Stage 1 against live processes: every preflight refusal, with its hint."""
import os
import subprocess
import sys
import threading

import pytest

import fixtures
from memunreachable import diagnose, preflight, procfs
from memunreachable._errors import AccessDenied, NoSuchProcess, UnsupportedTarget, ZombieProcess
from memunreachable.freeze import frozen
from memunreachable.snapshot import take_snapshot
from ptr_helpers import assert_running, wait_until

pytestmark = pytest.mark.ptrace

TRACER = """
import sys
from ptrace.binding.func import ptrace
ptrace(0x4206, int(sys.argv[1]), 0, 0)      # PTRACE_SEIZE, no stop
print("seized", flush=True)
sys.stdin.read()
"""


def test_fixture_passes():
    with fixtures.start("ptr_busy") as fx:
        t = preflight.preflight(fx.pid)
        assert (t.pid, t.name, t.seccomp, t.uid, t.warnings) == (fx.pid, "ptr_busy", 0, 0, [])


def test_absent_pid():
    proc = subprocess.Popen(["true"])
    proc.wait()
    with pytest.raises(NoSuchProcess) as ei:
        preflight.preflight(proc.pid)
    assert ei.value.hint == f"There is no process with PID {proc.pid}."
    with pytest.raises(NoSuchProcess):
        with frozen(proc.pid):
            pass


def test_zombie():
    proc = subprocess.Popen(["true"])
    try:
        assert wait_until(lambda: procfs.read_status(proc.pid).state == "Z")
        with pytest.raises(ZombieProcess) as ei:
            preflight.preflight(proc.pid)
        assert ei.value.hint == (f"Process {proc.pid} has already exited (zombie); there is "
                                 "nothing left to check.")
        with pytest.raises(ZombieProcess):
            with frozen(proc.pid):
                pass
    finally:
        proc.wait()


def _a_kernel_thread() -> int:
    if os.path.exists("/proc/2") and procfs.read_status(2).name == "kthreadd":
        return 2
    for name in sorted(os.listdir("/proc")):
        if name.isdigit():
            try:
                if procfs.read_stat(int(name)).kernel_thread:
                    return int(name)
            except (NoSuchProcess, OSError, ValueError):
                continue
    raise AssertionError("no kernel thread visible in /proc")


def test_kernel_thread():
    pid = _a_kernel_thread()
    with pytest.raises(UnsupportedTarget) as ei:
        preflight.preflight(pid)
    assert ei.value.hint == f"PID {pid} is a kernel thread: it has no user memory and no heap to check."


def test_own_pid_and_own_thread():
    with pytest.raises(UnsupportedTarget) as ei:
        preflight.preflight(os.getpid())
    assert "NoLeaks()" in ei.value.hint
    ready, done = threading.Event(), threading.Event()
    tids = []

    def run():
        tids.append(threading.get_native_id())
        ready.set()
        done.wait()

    th = threading.Thread(target=run)
    th.start()
    try:
        ready.wait()
        with pytest.raises(UnsupportedTarget):
            preflight.preflight(tids[0])
    finally:
        done.set()
        th.join()


def test_thread_id_of_a_fixture():
    with fixtures.start("ptr_busy") as fx:
        tid = fx.expect["busy_tid"]
        with pytest.raises(UnsupportedTarget) as ei:
            preflight.preflight(tid)
        assert ei.value.hint == f"Check the process instead: memunreachable check {fx.pid}"


def test_already_traced_names_the_tracer():
    with fixtures.start("ptr_busy") as fx:
        tracer = subprocess.Popen([sys.executable, "-c", TRACER, str(fx.pid)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert tracer.stdout.readline() == b"seized\n"
            comm = procfs.read_comm(tracer.pid)
            with pytest.raises(AccessDenied) as ei:
                preflight.preflight(fx.pid)
            assert ei.value.hint.startswith(
                f"Process {fx.pid} is being traced by PID {tracer.pid} ({comm}). A process can "
                "have only one tracer")
            # the SEIZE itself fails with EPERM and diagnose() says the same
            with pytest.raises(AccessDenied) as ei:
                with frozen(fx.pid):
                    pass
            assert f"traced by PID {tracer.pid} ({comm})" in ei.value.hint
        finally:
            tracer.stdin.close()
            tracer.wait()
        assert wait_until(lambda: procfs.read_status(fx.pid).tracer_pid == 0)
        with frozen(fx.pid) as fz:
            assert len(fz.threads) == 6
        assert_running(fx.pid)


def test_non_dumpable_fixture_as_root():
    with fixtures.start("ptr_nodump") as fx:
        facts = diagnose.gather_facts(fx.pid)
        assert facts.cap_sys_ptrace and facts.status.uids[1] == 0
        assert facts.dumpable is None           # root-owned either way: cannot tell
        assert preflight.preflight(fx.pid).pid == fx.pid
        with frozen(fx.pid) as fz:
            snap = take_snapshot(fz)
            fz.thaw()
        with snap:
            assert snap.mode == "clone"
        assert_running(fx.pid)


def test_seccomp_fixture_passes_without_warning():
    # seccomp is decided per thread once the threads are stopped (snapshot.py, seccomp.py)
    with fixtures.start("ptr_seccomp") as fx:
        t = preflight.preflight(fx.pid)
        assert (t.seccomp, t.warnings) == (2, [])
