"""Unit tests of preflight.py: decisions and hint wording on synthetic Facts."""
import errno
import sys

import pytest

from memunreachable.collect import diagnose, preflight
from memunreachable._errors import AccessDenied, NoSuchProcess, UnsupportedTarget, ZombieProcess
from memunreachable.collect.procfs import PF_KTHREAD, Stat, Status

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


NO_PROCESS_HINT = (f"No process has PID {PID} now: it may have exited. Find its current PID "
                   "with `pgrep NAME` or `pidof NAME` and check that one.")


def test_absent():
    with pytest.raises(NoSuchProcess) as ei:
        preflight.preflight(PID, diagnose.Facts(pid=PID, exists=False))
    assert (str(ei.value), ei.value.hint) == (f"no such process (pid={PID})", NO_PROCESS_HINT)
    assert ei.value.pid == PID


def test_zombie():
    with pytest.raises(ZombieProcess) as ei:
        preflight.preflight(PID, facts(status=status(state="Z", ppid=77)))
    assert str(ei.value) == f"process {PID} has exited (zombie) (pid={PID}, name='prog')"
    assert ei.value.hint == (f"Process {PID} has already exited; only its exit status is left "
                             "until its parent (PID 77) collects it (a zombie), so there is no "
                             "memory to check.")


def test_kernel_thread():
    f = facts(status=status(name="kworker/0:1"),
              stat=Stat(pid=PID, comm="kworker/0:1", state="I", ppid=2, flags=PF_KTHREAD | 0x40))
    with pytest.raises(UnsupportedTarget) as ei:
        preflight.preflight(PID, f)
    assert str(ei.value) == f"PID {PID} (kworker/0:1) is a kernel thread"
    assert ei.value.hint == f"PID {PID} is a kernel thread: it has no user memory and no heap to check."


SELF_HINT = (f"PID {PID} is memunreachable's own process (or one of its threads), and a "
             "process cannot ptrace itself. To check a program's own memory, call "
             "memunreachable.NoLeaks() inside it: it starts a separate tracer.")


def test_self_and_own_thread():
    with pytest.raises(UnsupportedTarget) as ei:
        preflight.preflight(PID, facts(our_pid=PID))
    assert (str(ei.value), ei.value.hint) == (f"PID {PID} is memunreachable's own process",
                                              SELF_HINT)
    own_thread = facts(status=status(tgid=77, pid=PID), our_pid=77)
    with pytest.raises(UnsupportedTarget) as ei:
        preflight.preflight(PID, own_thread)
    assert (str(ei.value), ei.value.hint) == \
        (f"PID {PID} is a thread of memunreachable's own process 77", SELF_HINT)


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
    assert ei.value.msg == f"process {PID} is already traced by PID 555 (gdb)"
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
    assert preflight.preflight(PID, f._replace(cap_sys_ptrace=True)).uid == 0


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
    assert isinstance(err, NoSuchProcess) and err.hint == NO_PROCESS_HINT
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
    with_cap = f"tracing process {PID} failed: EPERM although this process has CAP_SYS_PTRACE"
    err = diagnose.diagnose(PID, errno.EPERM, facts(cap_sys_ptrace=True, selinux_enforcing=True))
    assert (err.msg, err.hint) == (with_cap, diagnose.hint_selinux())
    assert "avc: denied { ptrace }" in err.hint
    err = diagnose.diagnose(PID, errno.EPERM, facts(cap_sys_ptrace=True, apparmor="docker-default"))
    assert (err.msg, err.hint) == (with_cap, diagnose.hint_apparmor("docker-default"))
    # the target's own AppArmor label counts too
    err = diagnose.diagnose(PID, errno.EPERM, facts(cap_sys_ptrace=True,
                                                     target_label="snap.x (enforce)"))
    assert err.hint == diagnose.hint_apparmor("snap.x (enforce)")
    err = diagnose.diagnose(PID, errno.EPERM, facts(yama_scope=1, target_label="p (enforce)"))
    assert "ptrace_scope = 1" in err.hint        # without the capability Yama comes first
    err = diagnose.diagnose(PID, errno.EPERM, facts())
    assert isinstance(err, AccessDenied) and "-vv" in err.hint
    assert str(err) == f"tracing process {PID} failed: EPERM (pid={PID}, name='prog')"


LSM_HINT = (f"This process has CAP_SYS_PTRACE, yet the kernel refuses it access to process "
            f"{PID}: a Linux security module or a sandbox around memunreachable forbids it "
            "(enabled here: lockdown, capability, landlock). A Landlock-sandboxed program may "
            "only trace processes inside its own sandbox: run memunreachable outside the "
            "sandbox, or start the target inside it. Look for 'ptrace' denials in the kernel "
            "or audit log.")


def test_root_with_cap_sys_ptrace_is_never_told_to_add_the_capability():
    # pid 1 on the machine: root, CapEff has SYS_PTRACE, /.dockerenv exists, and a
    # Landlock sandbox around the session refuses even /proc/1/maps
    pid1 = dict(cap_sys_ptrace=True, container="/.dockerenv", landlock_abi=7,
                lsms="lockdown,capability,landlock", status=status(uids=(0, 0, 0, 0)))
    with pytest.raises(AccessDenied) as ei:
        preflight.preflight(PID, facts(access_errno=errno.EACCES, **pid1))
    assert ei.value.msg == (f"the kernel refuses to let this process trace process {PID} "
                            f"(opening /proc/{PID}/mem: EACCES) although it has CAP_SYS_PTRACE")
    assert ei.value.hint == LSM_HINT
    # the same when only PTRACE_SEIZE fails
    err = diagnose.diagnose(PID, errno.EPERM, facts(**pid1))
    assert (err.msg, err.hint) == (f"tracing process {PID} failed: EPERM although this process "
                                   "has CAP_SYS_PTRACE", LSM_HINT)
    assert "SYS_PTRACE capability" not in err.hint
    # no Landlock, no LSM list: the generic wording
    err = diagnose.diagnose(PID, errno.EPERM, facts(cap_sys_ptrace=True, container="/.dockerenv"))
    assert err.hint == (f"This process has CAP_SYS_PTRACE, yet the kernel refuses it access to "
                        f"process {PID}: a Linux security module or a sandbox around "
                        "memunreachable forbids it. Look for 'ptrace' denials in the kernel or "
                        "audit log.")
    # a rootless container: the capability stops at the user namespace
    with pytest.raises(AccessDenied) as ei:
        preflight.preflight(PID, facts(access_errno=errno.EACCES, nested_userns=True, **pid1))
    assert ei.value.hint == (
        "memunreachable runs in a user namespace (a rootless or user-namespaced container): its "
        f"capabilities, CAP_SYS_PTRACE included, do not reach process {PID}, which belongs to "
        "an outer namespace. Run memunreachable in the same container as the process, or on "
        "the host.")
    # /proc/PID/mem opens: nothing to say before trying
    assert preflight.preflight(PID, facts(**pid1)).pid == PID


def test_refused_up_front_without_the_capability():
    what = (f"the kernel refuses to let this process trace process {PID} (opening "
            f"/proc/{PID}/mem: EACCES)")
    with pytest.raises(AccessDenied) as ei:
        preflight.preflight(PID, facts(access_errno=errno.EACCES, yama_scope=1))
    assert (ei.value.msg, ei.value.hint) == (what, diagnose.hint_yama(1))
    with pytest.raises(AccessDenied) as ei:
        preflight.preflight(PID, facts(access_errno=errno.EACCES, container="/.dockerenv"))
    assert (ei.value.msg, ei.value.hint) == (what, diagnose.hint_container())
    # another user's process: that reason first, whatever the probe says
    with pytest.raises(AccessDenied) as ei:
        preflight.preflight(PID, facts(access_errno=errno.EACCES, status=status(uids=(0, 0, 0, 0))))
    assert ei.value.msg == f"process {PID} belongs to user root"


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


def test_zombie_leader_is_not_an_exited_process():
    # main called pthread_exit: the leader is Z, Threads counts it, other threads still run
    with pytest.raises(UnsupportedTarget) as ei:
        preflight.preflight(PID, facts(status=status(state="Z", threads=3), live_threads=2))
    assert str(ei.value) == f"the main thread of process {PID} has exited while 2 thread(s) still run"
    assert ei.value.hint == (f"Process {PID}'s main thread called pthread_exit() (it is a zombie "
                             "while the other threads run). The kernel then shows no memory map "
                             "for the process's PID, and memunreachable cannot check such a "
                             "process yet.")
    with pytest.raises(ZombieProcess):
        preflight.preflight(PID, facts(status=status(state="Z", threads=3), live_threads=0))
    with pytest.raises(ZombieProcess):      # not counted: the Threads line decides
        preflight.preflight(PID, facts(status=status(state="Z", threads=1)))
    err = diagnose.diagnose(PID, errno.EPERM, facts(status=status(state="Z", threads=2),
                                                     live_threads=1, cap_sys_ptrace=True))
    assert not isinstance(err, ZombieProcess)


def test_a_process_gone_under_a_proc_read_gets_its_hint_from_the_check(monkeypatch):
    """procfs raises NoSuchProcess bare (it cannot ask diagnose, which reads /proc through it);
    the orchestrator that catches it adds the hint: check() of a process that vanishes
    between preflight and the freeze."""
    from memunreachable import unreachable
    from memunreachable.collect import procfs
    gone = 4194305                      # above the largest possible pid_max (2^22)
    with pytest.raises(NoSuchProcess) as ei:
        procfs.read_status(gone)
    assert ei.value.hint is None
    monkeypatch.setattr(unreachable.preflight_stage, "preflight",
                        lambda pid: preflight.Target(pid, "gone", 0, 0))
    with pytest.raises(NoSuchProcess) as ei:
        unreachable.check(gone)
    assert ei.value.hint == diagnose.hint_no_process(gone)
    # a hint already given, and a zombie's (preflight words its own), stay as they are
    with pytest.raises(NoSuchProcess) as ei, diagnose.hinted():
        raise NoSuchProcess(7, "gone", hint="mine")
    assert ei.value.hint == "mine"
    with pytest.raises(ZombieProcess) as ei, diagnose.hinted():
        raise ZombieProcess(7, "zombie")
    assert ei.value.hint is None
