"""preflight.py: Stage 1: is `pid` a user process we may trace?

Input: a pid. Output: a Target (pid, name, seccomp mode, warnings), or a typed error whose
.hint tells the user what to do (landscape.md section 5; wording in diagnose.py):
    NoSuchProcess / ZombieProcess    no process, or it already exited
    UnsupportedTarget                kernel thread, ourselves, a thread id, not x86_64
    AccessDenied                     already traced, another user, non-dumpable, Yama 2/3,
                                     or even read access refused although we hold
                                     CAP_SYS_PTRACE (a security module, a sandbox, an outer
                                     user namespace: diagnose._confinement)
Only /proc and /sys are read: a refused target is never touched.
"""
from __future__ import annotations

from typing import List, Optional

from memunreachable._errors import NoSuchProcess, UnsupportedTarget, ZombieProcess
from memunreachable._types import Fields
from memunreachable.collect.diagnose import (Facts, _definite_denial, _name, gather_facts,
                                             hint_kernel_thread, hint_no_process, hint_self, hint_zombie,
                                             hint_zombie_leader)


class Target(Fields):
    """A process that passed preflight."""
    __slots__ = ("pid", "name", "seccomp", "uid", "warnings")

    def __init__(self, pid: int, name: str, seccomp: int, uid: int,
                 warnings: Optional[List[str]] = None):
        self.pid = pid
        self.name = name
        self.seccomp = seccomp
        self.uid = uid
        self.warnings = [] if warnings is None else warnings


# Returns a Target when every check passes. Raises NoSuchProcess, ZombieProcess,
# UnsupportedTarget or AccessDenied (each with .hint). facts: injected by unit tests.
def preflight(pid: int, facts: Optional[Facts] = None) -> Target:
    f = facts if facts is not None else gather_facts(pid)
    if not f.exists:
        raise NoSuchProcess(pid, "no such process", hint=hint_no_process(pid))
    st, name = f.status, _name(f)
    if f.exited:
        raise ZombieProcess(pid, f"process {pid} has exited (zombie)",
                            hint=hint_zombie(pid, st.ppid), name=name)
    if st.state in ("Z", "X"):
        # the main thread called pthread_exit, other threads still run: its /proc/PID/maps
        # and /proc/PID/mem are empty, so there is nothing to walk through that pid
        raise UnsupportedTarget(
            f"the main thread of process {pid} has exited while {f.live_threads or 'other'} "
            "thread(s) still run", hint=hint_zombie_leader(pid))
    if f.stat is not None and f.stat.kernel_thread:
        raise UnsupportedTarget(f"PID {pid} ({name}) is a kernel thread", hint=hint_kernel_thread(pid))
    if pid == f.our_pid:
        raise UnsupportedTarget(f"PID {pid} is memunreachable's own process", hint=hint_self(pid))
    if st.tgid == f.our_pid:
        raise UnsupportedTarget(f"PID {pid} is a thread of memunreachable's own process "
                                f"{f.our_pid}", hint=hint_self(pid))
    if st.tgid and st.tgid != pid:
        raise UnsupportedTarget(f"PID {pid} is a thread of process {st.tgid}",
                                hint=f"Check the process instead: memunreachable check {st.tgid}")
    if f.machine != "x86_64":
        raise UnsupportedTarget(f"this machine is {f.machine}",
                                hint="memunreachable supports x86_64 Linux only.")
    if f.target_elf and f.target_elf != "EM_X86_64/64":
        raise UnsupportedTarget(f"process {pid} is not a 64-bit x86_64 program ({f.target_elf})",
                                hint="memunreachable supports 64-bit x86_64 programs only.")
    denial = _definite_denial(f)
    if denial is not None:
        raise denial
    # seccomp is decided per thread by the snapshot stage (seccomp.py), once the threads
    # are stopped and their filters can be read: no warning here
    return Target(pid=pid, name=name, seccomp=st.seccomp, uid=st.uids[1])
