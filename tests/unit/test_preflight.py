"""Unit tests of preflight.py: decisions and hint wording on synthetic Facts."""
import errno
import sys
from dataclasses import replace

import pytest

from memunreachable import diagnose, preflight
from memunreachable._errors import AccessDenied, NoSuchProcess, UnsupportedTarget, ZombieProcess
from memunreachable.procfs import PF_KTHREAD, Stat, Status

PID = 4321


def status(**kw):
    base = dict(name="prog", state="S", tgid=PID, pid=PID, ppid=1, tracer_pid=0,
                uids=(1000, 1000, 1000, 1000), gids=(1000, 1000, 1000, 1000), seccomp=0,
                cap_eff=0, threads=1)
    base.update(kw)
    return Status(**base)


def facts(**kw):
    st = kw.pop("status", status())
    base = dict(pid=PID, exists=True, status=st,
                stat=Stat(pid=PID, comm=st.name, state=st.state, ppid=1, flags=0x400000),
                our_pid=99, our_uid=1000, cap_sys_ptrace=False, dumpable=True, yama_scope=None,
                container="", machine="x86_64", target_elf="EM_X86_64/64")
    base.update(kw)
    return diagnose.Facts(**base)


def test_ok_target():
    t = preflight.preflight(PID, facts())
    assert (t.pid, t.name, t.seccomp, t.uid, t.warnings) == (PID, "prog", 0, 1000, [])


def test_seccomp_target_passes_without_warning():
    # the snapshot stage decides per thread (seccomp.py); preflight only records the mode
    for mode in (1, 2):
        t = preflight.preflight(PID, facts(status=status(seccomp=mode)))
        assert (t.seccomp, t.warnings) == (mode, [])


def test_seccomp_hint_wording():
    assert diagnose.hint_seccomp(PID) == (
        f"The seccomp rules of process {PID} would refuse or punish the syscalls a snapshot "
        "makes it run (clone, then wait4), in every thread that could run them. Without "
        "--no-fallback, memunreachable reads the stopped process directly instead (it stays "
        "paused for the whole scan).")
    assert diagnose.hint_seccomp(PID, unreadable=True) == diagnose.hint_seccomp(PID) + (
        " Its seccomp filters could not be read (that needs CAP_SYS_ADMIN); if you know they "
        "allow clone and wait4, --allow-seccomp-target takes the snapshot anyway.")


def test_absent():
    with pytest.raises(NoSuchProcess) as ei:
        preflight.preflight(PID, diagnose.Facts(pid=PID, exists=False))
    assert ei.value.hint == f"There is no process with PID {PID}."
    assert ei.value.pid == PID


def test_zombie():
    with pytest.raises(ZombieProcess) as ei:
        preflight.preflight(PID, facts(status=status(state="Z")))
    assert ei.value.hint == (f"Process {PID} has already exited (zombie); there is nothing "
                             "left to check.")


def test_kernel_thread():
    f = facts(stat=Stat(pid=PID, comm="kworker/0:1", state="I", ppid=2, flags=PF_KTHREAD | 0x40))
    with pytest.raises(UnsupportedTarget) as ei:
        preflight.preflight(PID, f)
    assert "kernel thread" in str(ei.value) and str(PID) in ei.value.hint


def test_self_and_own_thread():
    with pytest.raises(UnsupportedTarget) as ei:
        preflight.preflight(PID, facts(our_pid=PID))
    assert "NoLeaks()" in ei.value.hint
    own_thread = facts(status=status(tgid=77, pid=PID), our_pid=77)
    with pytest.raises(UnsupportedTarget):
        preflight.preflight(PID, own_thread)


def test_thread_id_of_another_process():
    with pytest.raises(UnsupportedTarget) as ei:
        preflight.preflight(PID, facts(status=status(tgid=4000, pid=PID)))
    assert ei.value.hint == "Check the process instead: memunreachable check 4000"


def test_not_x86_64():
    with pytest.raises(UnsupportedTarget):
        preflight.preflight(PID, facts(machine="aarch64"))
    with pytest.raises(UnsupportedTarget) as ei:
        preflight.preflight(PID, facts(target_elf="EM_386/32"))
    assert "EM_386/32" in str(ei.value)


def test_already_traced_names_tracer():
    f = facts(status=status(tracer_pid=555), tracer_name="gdb", cap_sys_ptrace=True)
    with pytest.raises(AccessDenied) as ei:
        preflight.preflight(PID, f)
    assert ei.value.hint == (f"Process {PID} is being traced by PID 555 (gdb). A process can "
                             "have only one tracer; detach gdb/strace/py-spy, or wait for the "
                             "other check to finish.")


def test_other_user_without_cap():
    f = facts(status=status(uids=(0, 0, 0, 0)))
    with pytest.raises(AccessDenied) as ei:
        preflight.preflight(PID, f)
    assert ei.value.hint == (f"Process {PID} belongs to user root. Tracing another user's "
                             "process needs root or CAP_SYS_PTRACE; try: sudo "
                             f"{sys.executable} -m memunreachable check {PID}")
    # a set-uid program: saved uid differs
    with pytest.raises(AccessDenied):
        preflight.preflight(PID, facts(status=status(uids=(1000, 1000, 0, 1000))))
    # with CAP_SYS_PTRACE it is fine
    assert preflight.preflight(PID, replace(f, cap_sys_ptrace=True)).uid == 0


def test_not_dumpable():
    with pytest.raises(AccessDenied) as ei:
        preflight.preflight(PID, facts(dumpable=False))
    assert ei.value.hint == (f"Process {PID} is marked non-dumpable (a set-uid/set-gid or "
                             "file-capability program, or it called prctl(PR_SET_DUMPABLE, 0)). "
                             "Only root or CAP_SYS_PTRACE can trace it.")
    assert preflight.preflight(PID, facts(dumpable=False, cap_sys_ptrace=True)).pid == PID


def test_yama_2_and_3_refused_up_front_yama_1_not():
    with pytest.raises(AccessDenied) as ei:
        preflight.preflight(PID, facts(yama_scope=2))
    assert ei.value.hint == ("Only processes with CAP_SYS_PTRACE may trace (ptrace_scope = 2); "
                             "run as root.")
    assert preflight.preflight(PID, facts(yama_scope=2, cap_sys_ptrace=True)).pid == PID
    with pytest.raises(AccessDenied) as ei:
        preflight.preflight(PID, facts(yama_scope=3, cap_sys_ptrace=True))
    assert ei.value.hint == ("ptrace is disabled on this machine until the next reboot "
                             "(ptrace_scope = 3); memunreachable cannot work here.")
    assert preflight.preflight(PID, facts(yama_scope=1)).pid == PID


# ---- diagnose(pid, errno) after PTRACE_SEIZE failed

def test_diagnose_order_no_process_then_namespace():
    err = diagnose.diagnose(PID, errno.ESRCH, diagnose.Facts(pid=PID, exists=False))
    assert isinstance(err, NoSuchProcess) and err.hint == f"There is no process with PID {PID}."
    err = diagnose.diagnose(PID, errno.ESRCH, facts())
    assert isinstance(err, NoSuchProcess)
    assert err.hint.startswith(f"PID {PID} is visible here but cannot be traced from this PID "
                               "namespace")


def test_diagnose_zombie_before_tracer():
    err = diagnose.diagnose(PID, errno.EPERM, facts(status=status(state="Z", tracer_pid=5)))
    assert isinstance(err, ZombieProcess)


def test_diagnose_yama_1():
    err = diagnose.diagnose(PID, errno.EPERM, facts(yama_scope=1))
    assert isinstance(err, AccessDenied)
    assert "kernel.yama.ptrace_scope = 1" in err.hint
    assert "`memunreachable run -- <cmd>`" in err.hint
    assert "weakens protection for every process until reboot" in err.hint
    # with the capability, Yama 1 is not the reason
    err = diagnose.diagnose(PID, errno.EPERM, facts(yama_scope=1, cap_sys_ptrace=True))
    assert "ptrace_scope" not in err.hint


def test_diagnose_container_selinux_apparmor_fallback():
    err = diagnose.diagnose(PID, errno.EPERM, facts(container="/.dockerenv"))
    assert err.hint == diagnose.hint_container()
    assert "--cap-add=SYS_PTRACE" in err.hint and "kubectl debug" in err.hint
    assert "WSL#3053" in err.hint
    err = diagnose.diagnose(PID, errno.EPERM, facts(cap_sys_ptrace=True, selinux_enforcing=True))
    assert "avc: denied { ptrace }" in err.hint
    err = diagnose.diagnose(PID, errno.EPERM, facts(cap_sys_ptrace=True, apparmor="docker-default"))
    assert "'docker-default'" in err.hint
    err = diagnose.diagnose(PID, errno.EPERM, facts(cap_sys_ptrace=True))
    assert isinstance(err, AccessDenied) and "-vv" in err.hint
    assert "EPERM" in str(err)


def test_diagnose_traced_and_other_user_first():
    err = diagnose.diagnose(PID, errno.EPERM, facts(status=status(tracer_pid=12), tracer_name="strace",
                                                     yama_scope=1))
    assert "traced by PID 12 (strace)" in err.hint
    err = diagnose.diagnose(PID, errno.EPERM, facts(status=status(uids=(0, 0, 0, 0)), yama_scope=1))
    assert "belongs to user root" in err.hint


def test_errors_pickle():
    import pickle
    err = diagnose.diagnose(PID, errno.EPERM, facts(yama_scope=1))
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is AccessDenied and back.hint == err.hint and back.pid == PID


def test_container_detector_runs():
    assert isinstance(diagnose.detect_container(), str)
