"""diagnose.py: why may we not trace a process? Probes, hints and the diagnosis.

Shared by the stages that touch the target (preflight, freeze, snapshot); not a stage itself.
gather_facts(pid) reads cheap /proc and /sys facts into Facts; the hint_* functions hold the
user-facing wording (landscape.md section 5); diagnose(pid, err) turns an errno from
PTRACE_SEIZE (or opening /proc/PID/mem) into the first explanation that applies, in the
order of landscape.md section 5. The decision functions are pure and unit-tested with
synthetic Facts. hinted() gives the NoSuchProcess that procfs raises its hint, around the
orchestrators (procfs cannot ask this module: this module reads /proc through it).
References: ptrace(2) "ptrace access mode checking"; kernel kernel/ptrace.c
(__ptrace_may_access), security/yama/yama_lsm.c; proc(5).
"""
from __future__ import annotations

import contextlib
import errno as errno_mod
import os
import pwd
import sys
from typing import Optional

from memunreachable.collect import procfs
from memunreachable._errors import AccessDenied, MemunreachableError, NoSuchProcess, ZombieProcess
from memunreachable._types import FrozenFields, set_fields

CONTAINER_CGROUP_WORDS = ("docker", "kubepods", "containerd", "libpod")


class Facts(FrozenFields):
    """Everything the checks look at; gather_facts() fills it from the live system."""
    __slots__ = ("pid", "exists", "status", "stat", "tracer_name", "our_pid", "our_uid",
                 "cap_sys_ptrace", "dumpable", "yama_scope", "container", "selinux_enforcing",
                 "apparmor", "machine", "target_elf", "access_errno", "target_label",
                 "nested_userns", "landlock_abi", "lsms", "live_threads")

    def __init__(self, pid: int, exists: bool, status: Optional[procfs.Status] = None,
                 stat: Optional[procfs.Stat] = None, tracer_name: str = "", our_pid: int = 0,
                 our_uid: int = 0, cap_sys_ptrace: bool = False,
                 dumpable: Optional[bool] = None,    # None: cannot tell (a root-owned target)
                 yama_scope: Optional[int] = None,   # None: Yama not built in
                 container: str = "",                # the marker that gave it away, "" when none
                 selinux_enforcing: bool = False,
                 # our confinement label, "" when unconfined/absent
                 apparmor: str = "", machine: str = "x86_64",
                 target_elf: str = "",               # e.g. "EM_X86_64/64"; "" when unreadable
                 access_errno: int = 0,              # opening /proc/PID/mem: 0, or EACCES when the
                                                     # kernel's attach-mode ptrace check refuses us
                 # the target's AppArmor/SELinux label, "" when none
                 target_label: str = "",
                 # we run in a user namespace (rootless container)
                 nested_userns: bool = False,
                 landlock_abi: int = 0,              # Landlock's ABI version when enabled, else 0
                 lsms: str = "",                     # /sys/kernel/security/lsm, "" when unreadable
                 # threads not yet exited, counted when the leader is a zombie (pthread_exit in
                 # main); None: not counted
                 live_threads: Optional[int] = None):
        set_fields(self,
                   pid, exists, status, stat, tracer_name, our_pid, our_uid, cap_sys_ptrace,
                   dumpable, yama_scope, container, selinux_enforcing, apparmor, machine,
                   target_elf, access_errno, target_label, nested_userns, landlock_abi, lsms,
                   live_threads)

    @property
    def exited(self) -> bool:
        """The whole process has exited (a zombie), not just its leader thread."""
        if self.status is None or self.status.state not in ("Z", "X"):
            return False
        if self.live_threads is not None:
            return self.live_threads == 0
        return self.status.threads <= 1


def _read_small(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(65536).decode("utf-8", "replace")
    except OSError:
        return ""


def detect_container() -> str:
    """One detector (landscape.md section 5.7): a marker file or a cgroup word; "" when none."""
    for marker in ("/.dockerenv", "/run/.containerenv"):
        if os.path.exists(marker):
            return marker
    cgroup = _read_small("/proc/1/cgroup")
    for word in CONTAINER_CGROUP_WORDS:
        if word in cgroup:
            return f"{word} in /proc/1/cgroup"
    return ""


def _yama_scope() -> Optional[int]:
    text = _read_small("/proc/sys/kernel/yama/ptrace_scope").strip()
    return int(text) if text.isdigit() else None


def _target_elf(pid: int) -> str:
    try:
        from memunreachable.stacks.elf import ElfFile
        with open(f"/proc/{pid}/exe", "rb") as f:
            elf = ElfFile(f)
            return f"{elf.machine_name}/{elf.elfclass}"
    except Exception:       # unreadable (permissions), not ELF, gone: no verdict
        return ""


def _dumpable(pid: int, status: procfs.Status) -> Optional[bool]:
    # A non-dumpable process's /proc/PID/mem is root-owned while its euid is not
    # (kernel fs/proc/base.c task_dump_owner; ptrace-snapshot.md section 15).
    if status.uids[1] == 0:
        return None
    try:
        owner = os.stat(f"/proc/{pid}/mem").st_uid
    except OSError:
        return None
    return owner == status.uids[1]


def landlock_abi() -> int:
    """Landlock's ABI version (landlock_create_ruleset(NULL, 0, VERSION)), 0 when off."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        abi = libc.syscall(444, None, 0, 1)      # SYS_landlock_create_ruleset, _VERSION
        return abi if abi > 0 else 0
    except (OSError, AttributeError):
        return 0


# Returns the Facts about pid as seen from this process; never raises for a missing pid.
# Only reads /proc and /sys: the target is never touched.
def gather_facts(pid: int) -> Facts:
    ours = procfs.read_status(os.getpid())
    base = Facts(
        pid=pid, exists=False, our_pid=os.getpid(), our_uid=os.getuid(),
        cap_sys_ptrace=ours.has_cap(procfs.CAP_SYS_PTRACE), yama_scope=_yama_scope(),
        container=detect_container(),
        selinux_enforcing=_read_small("/sys/fs/selinux/enforce").strip() == "1",
        apparmor=procfs.read_lsm_label("self"), machine=os.uname().machine,
        nested_userns=not procfs.in_initial_user_ns(), landlock_abi=landlock_abi(),
        lsms=_read_small("/sys/kernel/security/lsm").strip())
    if pid <= 0 or not os.path.isdir(f"/proc/{pid}"):
        return base
    try:
        status = procfs.read_status(pid)
        stat = procfs.read_stat(pid)
    except (NoSuchProcess, ValueError):
        return base
    live = None
    if status.state in ("Z", "X"):
        try:
            live = sum(1 for t in procfs.list_tasks(pid)
                       if procfs.task_state(pid, t) not in ("Z", "X", ""))
        except NoSuchProcess:
            live = 0
    return base._replace(
        exists=True, status=status, stat=stat, live_threads=live,
        tracer_name=procfs.read_comm(status.tracer_pid) if status.tracer_pid else "",
        dumpable=_dumpable(pid, status), target_elf=_target_elf(pid),
        access_errno=procfs.attach_access_errno(pid), target_label=procfs.read_lsm_label(pid))


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


# ---- hint texts (landscape.md section 5; keep the wording in sync with docs/permissions.md)

def hint_no_process(pid: int) -> str:
    return (f"No process has PID {pid} now: it may have exited. Find its current PID with "
            "`pgrep NAME` or `pidof NAME` and check that one.")


@contextlib.contextmanager
def hinted():
    """Around a check (usable as a decorator): a NoSuchProcess raised without a hint (procfs:
    the process vanished under a /proc read) leaves with hint_no_process."""
    try:
        yield
    except NoSuchProcess as exc:
        if exc.hint is None and not isinstance(exc, ZombieProcess):
            exc.hint = hint_no_process(exc.pid)
        raise


def hint_other_namespace(pid: int) -> str:
    return (f"PID {pid} is visible here but cannot be traced from this PID namespace; run "
            "memunreachable inside the same container, or check whether /proc is mounted "
            "with hidepid.")


def hint_zombie(pid: int, ppid: int = 0) -> str:
    parent = f" (PID {ppid})" if ppid else ""
    return (f"Process {pid} has already exited; only its exit status is left until its parent"
            f"{parent} collects it (a zombie), so there is no memory to check.")


def hint_zombie_leader(pid: int) -> str:
    return (f"Process {pid}'s main thread called pthread_exit() (it is a zombie while the "
            "other threads run). The kernel then shows no memory map for the process's PID, "
            "and memunreachable cannot check such a process yet.")


def hint_traced(pid: int, tracer: int, tracer_name: str) -> str:
    return (f"Process {pid} is being traced by PID {tracer} ({tracer_name or '?'}). A process "
            "can have only one tracer; detach gdb/strace/py-spy, or wait for the other check "
            "to finish.")


def hint_other_user(pid: int, user: str) -> str:
    return (f"Process {pid} belongs to user {user}. Tracing another user's process needs root "
            f"or CAP_SYS_PTRACE; try: sudo {sys.executable} -m memunreachable check {pid}")


def hint_not_dumpable(pid: int) -> str:
    return (f"Process {pid} is marked non-dumpable (a set-uid/set-gid or file-capability "
            "program, or it called prctl(PR_SET_DUMPABLE, 0)). Only root or CAP_SYS_PTRACE "
            "can trace it.")


def hint_yama(scope: int) -> str:
    if scope == 1:
        return ("The kernel only lets processes trace their own descendants "
                "(kernel.yama.ptrace_scope = 1). Either run as root, or start the program "
                "through `memunreachable run -- <cmd>`, or let the program allow it with "
                "prctl(PR_SET_PTRACER, …). Setting `sudo sysctl kernel.yama.ptrace_scope=0` "
                "also works, but it weakens protection for every process until reboot.")
    if scope == 2:
        return ("Only processes with CAP_SYS_PTRACE may trace (ptrace_scope = 2); run as root.")
    return ("ptrace is disabled on this machine until the next reboot (ptrace_scope = 3); "
            "memunreachable cannot work here.")


def hint_container() -> str:
    return ("This looks like a container without the SYS_PTRACE capability. Docker: "
            "`--cap-add=SYS_PTRACE`; compose: `cap_add: [SYS_PTRACE]`; Kubernetes: add "
            "`SYS_PTRACE` under `securityContext.capabilities`, or use `kubectl debug "
            "--profile=general --target=<container>` (each of these widens what the container "
            "may do). On kernels older than 4.8, Docker's default seccomp profile blocks ptrace "
            "altogether. gVisor and WSL1 lack ptrace features memunreachable needs "
            "(microsoft/WSL#3053).")


def hint_user_namespace(pid: int) -> str:
    return (f"memunreachable runs in a user namespace (a rootless or user-namespaced "
            f"container): its capabilities, CAP_SYS_PTRACE included, do not reach process "
            f"{pid}, which belongs to an outer namespace. Run memunreachable in the same "
            "container as the process, or on the host.")


def hint_lsm(pid: int, landlock: int, lsms: str) -> str:
    enabled = [m for m in lsms.split(",") if m] if lsms else []
    if landlock and "landlock" not in enabled:
        enabled.append("landlock")
    where = f" (enabled here: {', '.join(enabled)})" if enabled else ""
    text = (f"This process has CAP_SYS_PTRACE, yet the kernel refuses it access to process "
            f"{pid}: a Linux security module or a sandbox around memunreachable forbids "
            f"it{where}.")
    if landlock:
        text += (" A Landlock-sandboxed program may only trace processes inside its own "
                 "sandbox: run memunreachable outside the sandbox, or start the target "
                 "inside it.")
    return text + " Look for 'ptrace' denials in the kernel or audit log."


def hint_selinux() -> str:
    return ("SELinux policy may forbid tracing this process; look for 'avc: denied { ptrace }' "
            "in the audit log. Relaxing the policy weakens protection for that domain.")


def hint_apparmor(label: str) -> str:
    return (f"The AppArmor profile {label!r} may forbid tracing this process; look for "
            "'apparmor=\"DENIED\" operation=\"ptrace\"' in the kernel log. Relaxing the "
            "profile weakens protection for the programs it confines.")


def hint_seccomp(pid: int, unreadable: bool = False) -> str:
    text = (f"The seccomp rules of process {pid} would refuse or punish the syscalls a "
            "snapshot makes it run (clone, then wait4), in every thread that could run them. "
            "Without --no-fallback, memunreachable reads the stopped process directly instead "
            "(it stays paused for the whole scan).")
    if unreadable:
        text += (" Its seccomp filters could not be read (that needs CAP_SYS_ADMIN); if you "
                 "know they allow clone and wait4, --allow-seccomp-target takes the snapshot "
                 "anyway.")
    return text


def hint_kernel_thread(pid: int) -> str:
    return f"PID {pid} is a kernel thread: it has no user memory and no heap to check."


def hint_self(pid: int) -> str:
    return (f"PID {pid} is memunreachable's own process (or one of its threads), and a "
            "process cannot ptrace itself. To check a program's own memory, call "
            "memunreachable.NoLeaks() inside it: it starts a separate tracer.")


# ---- decisions

def _name(f: Facts) -> Optional[str]:
    return f.status.name if f.status else None


def _definite_denial(f: Facts) -> Optional[AccessDenied]:
    """Denials certain before trying (landscape.md 5.3-5.6); None when tracing may work."""
    st = f.status
    pid, name = f.pid, _name(f)
    if st.tracer_pid:
        tracer = f"PID {st.tracer_pid}" + (f" ({f.tracer_name})" if f.tracer_name else "")
        return AccessDenied(pid, f"process {pid} is already traced by {tracer}",
                            hint=hint_traced(pid, st.tracer_pid, f.tracer_name), name=name)
    if not f.cap_sys_ptrace:
        if any(u != f.our_uid for u in st.uids[:3]):
            user = _user_name(st.uids[1])
            return AccessDenied(pid, f"process {pid} belongs to user {user}",
                                hint=hint_other_user(pid, user), name=name)
        if f.dumpable is False:
            return AccessDenied(pid, f"process {pid} is not dumpable",
                                hint=hint_not_dumpable(pid), name=name)
        if f.yama_scope == 2:
            return AccessDenied(pid, "ptrace needs CAP_SYS_PTRACE (Yama ptrace_scope 2)",
                                hint=hint_yama(2), name=name)
    if f.yama_scope == 3:
        return AccessDenied(pid, "ptrace is disabled (Yama ptrace_scope 3)",
                            hint=hint_yama(3), name=name)
    if f.access_errno == errno_mod.EACCES:
        # the kernel's attach-mode check (opening /proc/PID/mem) already refuses: say why
        # without touching the target
        what = f"the kernel refuses to let this process trace process {pid} (opening " \
               f"/proc/{pid}/mem: EACCES)"
        if f.cap_sys_ptrace:
            return _confinement(f, what + " although it has CAP_SYS_PTRACE")
        return _uncapped(f, what)
    return None


def _uncapped(f: Facts, what: str) -> AccessDenied:
    """Why a process without CAP_SYS_PTRACE is refused (same uid, dumpable): Yama, a
    security module, a container, or a reason we cannot name."""
    pid, name = f.pid, _name(f)
    if f.yama_scope in (1, 2):
        return AccessDenied(pid, what, hint=hint_yama(f.yama_scope), name=name)
    if f.selinux_enforcing:
        return AccessDenied(pid, what, hint=hint_selinux(), name=name)
    if f.apparmor or f.target_label:
        return AccessDenied(pid, what, hint=hint_apparmor(f.apparmor or f.target_label),
                            name=name)
    if f.container:
        return AccessDenied(pid, what, hint=hint_container(), name=name)
    return AccessDenied(pid, what, hint=(
        "The kernel refused ptrace for a reason memunreachable could not identify; "
        "run with -vv to see every ptrace request and its errno."), name=name)


def _confinement(f: Facts, what: str) -> AccessDenied:
    """Why a process holding CAP_SYS_PTRACE is refused: the first confinement that applies."""
    pid, name = f.pid, _name(f)
    if f.nested_userns:
        return AccessDenied(pid, what, hint=hint_user_namespace(pid), name=name)
    if f.selinux_enforcing:
        return AccessDenied(pid, what, hint=hint_selinux(), name=name)
    if f.apparmor or f.target_label:
        return AccessDenied(pid, what, hint=hint_apparmor(f.apparmor or f.target_label),
                            name=name)
    return AccessDenied(pid, what, hint=hint_lsm(pid, f.landlock_abi, f.lsms), name=name)


# Returns the error (not raised) that explains why tracing pid failed with err (an errno
# from PTRACE_SEIZE, or from opening /proc/PID/mem): the first of landscape.md section 5
# that applies. With CAP_SYS_PTRACE in CapEff, neither Yama 1 nor a container's missing
# capability is the cause: a security module, a sandbox or a user namespace is.
# facts: injected by unit tests.
def diagnose(pid: int, err: int, facts: Optional[Facts] = None) -> MemunreachableError:
    f = facts if facts is not None else gather_facts(pid)
    if not f.exists:
        return NoSuchProcess(pid, "no such process", hint=hint_no_process(pid))
    name = _name(f)
    if f.exited:
        return ZombieProcess(pid, f"process {pid} has exited (zombie)",
                             hint=hint_zombie(pid, f.status.ppid), name=name)
    if err == errno_mod.ESRCH:
        return NoSuchProcess(pid, f"process {pid} cannot be traced from here (ESRCH)",
                             hint=hint_other_namespace(pid), name=name)
    denial = _definite_denial(f)
    if denial is not None:
        return denial
    what = f"tracing process {pid} failed: {errno_mod.errorcode.get(err, err)}"
    if f.cap_sys_ptrace:
        return _confinement(f, what + " although this process has CAP_SYS_PTRACE")
    return _uncapped(f, what)
