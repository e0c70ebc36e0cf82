"""Stage 1 against live processes: every preflight refusal, with its hint."""
import errno
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest

import fixtures
from memunreachable.collect import diagnose, preflight, procfs
from memunreachable._errors import AccessDenied, NoSuchProcess, UnsupportedTarget, ZombieProcess
from memunreachable.collect.freeze import frozen
from memunreachable.collect.snapshot import take_snapshot
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
    assert str(ei.value) == f"no such process (pid={proc.pid})"
    assert ei.value.hint == (f"No process has PID {proc.pid} now: it may have exited. Find its "
                             "current PID with `pgrep NAME` or `pidof NAME` and check that one.")
    with pytest.raises(NoSuchProcess):
        with frozen(proc.pid):
            pass


def test_zombie():
    proc = subprocess.Popen(["true"])
    try:
        assert wait_until(lambda: procfs.read_status(proc.pid).state == "Z")
        with pytest.raises(ZombieProcess) as ei:
            preflight.preflight(proc.pid)
        assert ei.value.hint == (f"Process {proc.pid} has already exited; only its exit status "
                                 f"is left until its parent (PID {os.getpid()}) collects it (a "
                                 "zombie), so there is no memory to check.")
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
    assert str(ei.value) == f"PID {os.getpid()} is memunreachable's own process"
    assert ei.value.hint == diagnose.hint_self(os.getpid())
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
        with pytest.raises(UnsupportedTarget) as ei:
            preflight.preflight(tids[0])
        assert str(ei.value) == (f"PID {tids[0]} is a thread of memunreachable's own process "
                                 f"{os.getpid()}")
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
            assert ei.value.msg == f"process {fx.pid} is already traced by PID {tracer.pid} ({comm})"
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


# ---- root with CAP_SYS_PTRACE, refused all the same (issue 7: pid 1 as root)

# Runs memunreachable's CLI inside a new Landlock domain (a ruleset that only restricts TCP
# bind): a Landlock-sandboxed process may not ptrace, nor read /proc/PID/maps of, a process
# outside its domain, although it is root with CAP_SYS_PTRACE.
LANDLOCKED_CHECK = """
import ctypes, json, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
attr = (ctypes.c_uint64 * 2)(0, 1)          # handled_access_fs 0, handled_access_net BIND_TCP
fd = libc.syscall(444, ctypes.byref(attr), 16, 0)
assert fd >= 0, ctypes.get_errno()
assert libc.prctl(38, 1, 0, 0, 0) == 0      # PR_SET_NO_NEW_PRIVS
assert libc.syscall(446, fd, 0) == 0, ctypes.get_errno()
from memunreachable import cli
sys.exit(cli.main(["check", sys.argv[1], "--json"]))
"""


def test_landlocked_root_gets_the_sandbox_diagnosis():
    abi = diagnose.landlock_abi()
    assert abi >= 4, "this test needs Landlock with network rules (kernel 6.7+)"
    assert diagnose.gather_facts(os.getpid()).cap_sys_ptrace
    with fixtures.start("ptr_busy") as fx:
        proc = subprocess.run([sys.executable, "-c", LANDLOCKED_CHECK, str(fx.pid)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 3, proc.stderr
        lsms = diagnose.gather_facts(fx.pid).lsms
        message = (f"the kernel refuses to let this process trace process {fx.pid} (opening "
                   f"/proc/{fx.pid}/mem: EACCES) although it has CAP_SYS_PTRACE")
        hint = diagnose.hint_lsm(fx.pid, abi, lsms)
        assert json.loads(proc.stdout)["error"] == {
            "kind": "AccessDenied", "message": f"{message} (pid={fx.pid}, name='ptr_busy')",
            "hint": hint}
        assert "SYS_PTRACE capability" not in hint and "Landlock-sandboxed" in hint
        assert proc.stderr.splitlines() == [
            f"memunreachable: error: {message} (pid={fx.pid}, name='ptr_busy')", f"hint: {hint}"]
        assert procfs.read_status(fx.pid).tracer_pid == 0
        assert_running(fx.pid)


def test_pid_1_as_root():
    # preflight only reads /proc: it never touches pid 1. Where pid 1 may be traced (a plain
    # host or container) it passes; where opening /proc/1/mem is refused (this machine: the
    # session runs in a sandbox), the diagnosis names the confinement, never the container
    f = diagnose.gather_facts(1)
    assert f.exists and f.cap_sys_ptrace and f.status.uids[1] == 0
    if f.access_errno == 0:
        assert preflight.preflight(1).pid == 1
        return
    assert f.access_errno == errno.EACCES
    with pytest.raises(AccessDenied) as ei:
        preflight.preflight(1)
    assert ei.value.msg == ("the kernel refuses to let this process trace process 1 (opening "
                            "/proc/1/mem: EACCES) although it has CAP_SYS_PTRACE")
    assert ei.value.hint == diagnose._confinement(f, ei.value.msg).hint
    assert ei.value.hint != diagnose.hint_container()


def test_attach_access_errno():
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert procfs.attach_access_errno(child.pid) == 0          # root, our child
    finally:
        child.kill()
        child.wait()
    assert procfs.attach_access_errno(child.pid) == errno.ENOENT    # reaped: gone
    assert procfs.read_lsm_label(child.pid) == ""


# ---- missing permissions, seen by an unprivileged user (uid 65534, no capabilities)

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
          "--bounding-set=-all"]
NOBODY_CHECK = """
import sys
from memunreachable import cli
sys.exit(cli.main(["check", sys.argv[1], "--json"]))
"""
# what the unprivileged side imports besides the standard library (memunreachable/_native's
# cffi backend, symbolize's ELF reader)
NOBODY_MODULES = ("memunreachable", "_cffi_backend", "elftools")


@pytest.fixture(scope="module")
def nobody_python():
    """(command, env, python, dir): the command runs Python as uid 65534 in dir, a fresh
    directory under /tmp that everyone may enter, importing memunreachable from a copy there:
    a checkout (and its venv) under a 0700 home is out of that user's reach. The interpreter is
    this one when uid 65534 can run it, else the system's of the same version."""
    import importlib.util
    import tempfile
    root = tempfile.mkdtemp(prefix="mu-nobody-")
    lib = os.path.join(root, "lib")
    os.mkdir(lib)
    for name in NOBODY_MODULES:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin, f"{name} is not importable"
        if spec.submodule_search_locations:
            shutil.copytree(list(spec.submodule_search_locations)[0], os.path.join(lib, name),
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(spec.origin, lib)
    for d, _, files in os.walk(root):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o755)
    env = dict(os.environ, PYTHONPATH=lib)
    version = "%d.%d" % sys.version_info[:2]
    probe = "import sys, memunreachable.cli; print(sys.executable, memunreachable.__file__)"
    tried = []
    try:
        for python in dict.fromkeys([sys.executable, os.path.realpath(sys.executable),
                                     f"/usr/bin/python{version}",
                                     f"/usr/local/bin/python{version}"]):
            proc = subprocess.run(NOBODY + [python, "-s", "-c", probe], env=env, cwd=root,
                                  capture_output=True, text=True, timeout=60)
            out = proc.stdout.split()
            if proc.returncode == 0 and out[1].startswith(lib + "/"):
                yield NOBODY + [python, "-s"], env, out[0], root
                return
            tried.append(f"{python}: " + (proc.stderr.strip().splitlines()
                                          or [f"exit {proc.returncode}, {proc.stdout!r}"])[-1])
        pytest.fail(f"no Python {version} that uid 65534 can run with memunreachable copied to "
                    f"{lib} ({'; '.join(tried)}): install python{version} system-wide")
    finally:
        shutil.rmtree(root)


def check_as_nobody(nobody_python, pid: int):
    cmd, env, _, root = nobody_python
    proc = subprocess.run(cmd + ["-c", NOBODY_CHECK, str(pid)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)["error"], proc.stderr


def test_another_users_process(nobody_python):
    with fixtures.start("ptr_busy") as fx:
        rc, error, stderr = check_as_nobody(nobody_python, fx.pid)
        hint = (f"Process {fx.pid} belongs to user root. Tracing another user's process needs "
                f"root or CAP_SYS_PTRACE; try: sudo {nobody_python[2]} -m memunreachable check "
                f"{fx.pid}")
        assert (rc, error) == (3, {"kind": "AccessDenied", "hint": hint,
                                   "message": f"process {fx.pid} belongs to user root "
                                              f"(pid={fx.pid}, name='ptr_busy')"})
        assert stderr.splitlines()[-1] == f"hint: {hint}"
        assert_running(fx.pid)


def test_non_dumpable_process_of_the_same_user(nobody_python):
    exe = os.path.join(nobody_python[3], "ptr_nodump")   # a directory uid 65534 may enter
    shutil.copy(fixtures.build("ptr_nodump"), exe)
    proc = subprocess.Popen(NOBODY + [exe], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert b"ready\n" in [proc.stdout.readline() for _ in range(2)]
        st = procfs.read_status(proc.pid)
        assert st.uids == (65534,) * 4
        assert os.stat(f"/proc/{proc.pid}/mem").st_uid == 0        # the non-dumpable sign
        rc, error, _ = check_as_nobody(nobody_python, proc.pid)
        assert (rc, error) == (3, {
            "kind": "AccessDenied", "hint": diagnose.hint_not_dumpable(proc.pid),
            "message": f"process {proc.pid} is not dumpable (pid={proc.pid}, name='ptr_nodump')"})
        out, err = proc.communicate(b"quit\n", timeout=10)
        assert (proc.returncode, out) == (0, b"bye\n"), err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_zombie_leader_with_running_threads_is_not_called_exited():
    with fixtures.start("zombie_leader") as fx:
        assert wait_until(lambda: procfs.task_state(fx.pid, fx.pid) == "Z")
        with pytest.raises(UnsupportedTarget) as ei:
            preflight.preflight(fx.pid)
        assert str(ei.value) == (f"the main thread of process {fx.pid} has exited while 1 "
                                 "thread(s) still run")
        assert ei.value.hint == diagnose.hint_zombie_leader(fx.pid)
        assert wait_until(lambda: procfs.task_state(fx.pid, fx.expect["thread_tid"]) == "S")
