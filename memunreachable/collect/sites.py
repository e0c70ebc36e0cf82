"""sites.py: Stage 3 helper: where an injected syscall runs (snapshot.py's clone and wait4,
inject.py's calls).

    find_guard(pid, maps) -> (gadget, restore_rt)   a `syscall; ret` pair and an rt_sigreturn
                                    stub of ld.so or libc: the sigreturn frames pushed on the
                                    thread's stack make the checker's death at any step harmless
    stack_takes_frames(fz, tid)     the thread's stack pointer is in its stack (frames fit)
    find_syscall_insn(pid, maps)    a `syscall` instruction in [vdso] or another executable
                                    mapping (the unguarded sequence)
    choose_thread(fz, ...) -> (tid, insn, restore_rt, refusals)
                                    the first thread at an interrupt stop whose seccomp rules
                                    allow every injected syscall at that address
Never a code write: only instructions already mapped in the target are used.
References: ptrace-snapshot.md sections 4-7, 10, 12; sigreturn(2); seccomp.py.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

from memunreachable.collect import seccomp
from memunreachable._ffi import ffi, lib
from memunreachable._types import FS_BASE_INDEX, RSP_INDEX
from memunreachable.collect.freeze import Frozen

SYSCALL_INSN = b"\x0f\x05"
SYSCALL_RET = b"\x0f\x05\xc3"                          # syscall; ret
RESTORE_RT = b"\x48\xc7\xc0\x0f\x00\x00\x00\x0f\x05"    # mov $15, %rax; syscall


def signed(word: int) -> int:
    return word - (1 << 64) if word >= 1 << 63 else word


def read_target(pid: int, addr: int, size: int) -> bytes:
    """Bytes of the (traced) target, b"" when unreadable."""
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        return os.pread(fd, size, addr)
    except OSError:
        return b""
    finally:
        os.close(fd)


def after_syscall_insn(pid: int, tid: int, rip: int) -> bool:
    """The two bytes before rip in stopped tracee tid are a `syscall` instruction. One
    PTRACE_PEEKDATA (a few us while the target is stopped), else /proc/PID/mem."""
    word = ffi.new("uint64_t *")
    if lib.mu_peek(tid, rip - 2, word) == 0:
        return word[0] & 0xFFFF == int.from_bytes(SYSCALL_INSN, "little")
    return read_target(pid, rip - 2, 2) == SYSCALL_INSN   # rip-2 near the end of a mapping


# Returns, for each needle, the address of its first occurrence in the code of mappings
# (searched in that order, at most limit bytes each), 0 where none is readable.
def _find_in_code(pid: int, mappings, needles: Tuple[bytes, ...], limit: int) -> List[int]:
    found = [0] * len(needles)
    for m in mappings:
        data = read_target(pid, m.begin, min(m.end - m.begin, limit))
        for i, needle in enumerate(needles):
            if not found[i] and (at := data.find(needle)) >= 0:
                found[i] = m.begin + at
        if all(found):
            break
    return found


# Returns the address of a `syscall` instruction in an executable mapping of pid ([vdso]
# first), or 0 when none is readable. Any 0f 05 pair works: execution starts at it, and the
# thread is stopped at the syscall exit before it could run the bytes that follow.
def find_syscall_insn(pid: int, maps) -> int:
    ranked = sorted((m for m in maps if m.executable and m.readable),
                    key=lambda m: (m.path != "[vdso]", m.begin))
    return _find_in_code(pid, ranked[:8], (SYSCALL_INSN,), 1 << 20)[0]


# Returns (gadget, restore_rt) for the guard of native/mu_ptrace.c: the address of a
# `syscall; ret` pair and of an rt_sigreturn stub (`mov $15, %rax; syscall`, glibc's
# __restore_rt) in ld.so's, else libc's (or a static executable's) code, read from the
# target; (0, 0) when one is missing, or when the target runs with a shadow stack
# (x86_Thread_features: shstk: a `ret` into the stub would fault). Cached per pid and
# mapping: a later check of the same process reads nothing (prepare() fills the cache before
# the freeze).
def find_guard(pid: int, maps) -> Tuple[int, int]:
    code = [m for m in maps if m.executable and m.readable and m.path.startswith("/")]
    ranked = sorted(code, key=lambda m: (not os.path.basename(m.path).startswith("ld-"),
                                         not os.path.basename(m.path).startswith("libc."),
                                         m.begin))[:3]
    key = (pid, tuple((m.begin, m.end, m.path) for m in ranked))
    found = GUARDS.get(key)
    if found is None:
        found = (0, 0) if _shadow_stack(pid) else _search_guard(pid, ranked)
        GUARDS.clear()             # one target at a time (the plugin: the same one)
        GUARDS[key] = found
    return found


GUARDS: Dict[tuple, Tuple[int, int]] = {}


def _shadow_stack(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            return shadow_stack_in(f.read())
    except OSError:
        return True                 # unknown: no guard rather than a fault


def shadow_stack_in(status: bytes) -> bool:
    """A /proc/PID/status text says the process runs with a user shadow stack (x86 CET:
    `x86_Thread_features: shstk ...`, Linux 6.6+)."""
    for line in status.splitlines():
        if line.startswith(b"x86_Thread_features:"):
            return b"shstk" in line.split()[1:]
    return False


def _search_guard(pid: int, mappings) -> Tuple[int, int]:
    gadget, restore_rt = _find_in_code(pid, mappings, (SYSCALL_RET, RESTORE_RT), 8 << 20)
    return (gadget, restore_rt) if gadget and restore_rt else (0, 0)


# True when tid's stack pointer lies in a stack that glibc or the kernel made: the main
# thread's [stack], or the mapping that holds the thread's own TCB (fs_base: glibc puts it at
# the top of each pthread stack, a user-supplied one included). Only there may the guard
# write below the red zone, as a signal would: a stack that a runtime carves out of its heap
# (Go's goroutines, coroutine libraries) may have another one right below it, and such
# runtimes take their signals on an alternate stack for that reason.
# maps: those to judge by (default fz.maps; a one-thread freeze reads none: the snapshot's).
def stack_takes_frames(fz: Frozen, tid: int, maps=None) -> bool:
    regs = fz.regs_at_freeze(tid)
    if regs == ffi.NULL:
        return False
    sp, fs_base = regs[RSP_INDEX], regs[FS_BASE_INDEX]
    for m in fz.maps if maps is None else maps:
        if m.begin <= sp < m.end:
            return m.path == "[stack]" or m.begin <= fs_base < m.end
    return False


# Returns the guard (gadget, restore_rt) that thread tid of fz may take: the pair given,
# when there is one and tid's stack takes its frames (stack_takes_frames, judged by maps);
# else (0, 0).
def guard_for(fz: Frozen, tid: int, gadget: int, restore_rt: int,
              maps=None) -> Tuple[int, int]:
    return (gadget, restore_rt) if restore_rt and stack_takes_frames(fz, tid, maps) else (0, 0)


# Returns (insn, restore_rt, None) of the first of tries, [(insn, restore_rt)] (insn 0:
# skipped), whose calls(insn, restore_rt) thread tid's seccomp rules allow, else (0, 0, the
# last refusal: a seccomp.Verdict, None when nothing was tried).
def first_allowed(pid: int, tid: int, tries, calls, allow_unreadable: bool) -> tuple:
    verdict = None
    for insn, rt in tries:
        if insn:
            verdict = seccomp.thread_verdict(pid, tid, calls(insn, rt), allow_unreadable)
            if verdict.ok:
                return insn, rt, None
    return 0, 0, verdict


# Returns (tid, syscall instruction address, restore_rt, refusals) for the injection: the
# first thread at an interrupt stop whose seccomp state allows every injected syscall
# (seccomp.py: clone, and the wait4 that reaps the child) at that address. Guarded first
# (restore_rt non-zero: find_guard's pair, with the guard's own syscalls allowed too), else
# preferring a thread stopped right after a `syscall` instruction (rip-2), else one found in
# [vdso] or another executable mapping. (0, 0, 0, refusals) when no thread qualifies:
# refusals holds the seccomp.Verdict of each thread that was considered and refused ([]
# when no thread sits at an interrupt stop: all in group-stop or signal-delivery-stop, leave
# them as found). A thread in seccomp strict mode, or whose filters would not ALLOW/LOG a
# call, is never chosen; one whose filters cannot be read only with allow_unreadable
# (--allow-seccomp-target).
# tid: only consider that thread (tests inject into each kind of waiting thread).
# guarded: False to take the legacy sequence (tests).
def choose_thread(fz: Frozen, tid: Optional[int] = None, allow_unreadable: bool = False,
                  guarded: bool = True) -> Tuple[int, int, int, List[seccomp.Verdict]]:
    gadget, restore_rt = find_guard(fz.pid, fz.maps) if guarded else (0, 0)
    refusals: List[seccomp.Verdict] = []

    def allowed(t: int, own: int) -> Tuple[int, int]:
        """(insn, restore_rt) that thread t may run, guarded first; (0, 0) and the refusal
        recorded when none."""
        insn, rt, refusal = first_allowed(
           fz.pid, t, (guard_for(fz, t, gadget, restore_rt), (own, 0)),
           lambda i, r: seccomp.injected_calls(i, restore_rt=r), allow_unreadable)
        if refusal is not None:
            refusals.append(refusal)
        return insn, rt

    first = fz.syscall_candidate() if tid is None else None
    if first is not None:
        # the first pass's first candidate, found by mu_freeze: most often the answer;
        # seccomp mode 0 (the leader's status is open since before the freeze: one pread)
        # is the verdict "ok" without building the calls
        t, own = first
        if t == fz.pid and fz.leader_seccomp_mode() == 0:
            guard = guard_for(fz, t, gadget, restore_rt)
            return (t, *guard, []) if guard[1] else (t, own, 0, [])
        insn, rt = allowed(t, own)
        if insn:
            return t, insn, rt, refusals
        refusals.clear()
    candidates = (c for c in fz.interrupt_stops() if tid is None or c[0] == tid)
    others = []
    for t, orig_rax, rip in candidates:     # first pass: threads right after a `syscall`
        if signed(orig_rax) >= 0 and after_syscall_insn(fz.pid, t, rip):
            insn, rt = allowed(t, rip - 2)
            if insn:
                return t, insn, rt, refusals
        else:
            others.append(t)
    own = find_syscall_insn(fz.pid, fz.maps) if others and not restore_rt else gadget
    for t in others if own else ():
        insn, rt = allowed(t, own)
        if insn:
            return t, insn, rt, refusals
    return 0, 0, 0, refusals
