"""inject.py: function calls injected into a thread of a frozen process (for `track PID`).

    tid, restore_rt, refusals, busy = choose_thread(fz)  # a thread that may make the call
    fz.release_others(tid)                           # the other threads run meanwhile
    call(fz, tid, func, restore_rt, args, data)      # func(args) in tid; tid restored
    symbols(pid, maps, path, names)                  # {name: run-time address} of an object
    find_dlopen(pid, maps)                           # dlopen's address in the target

The call (native/mu_ptrace.c mu_inject_call) runs on the chosen thread's own stack, below the
guard's sigreturn frame (sites.find_guard: glibc's rt_sigreturn stub), which is also the
function's return address: whether the checker lives or dies, the thread resumes as it
was frozen once the function returns (registers, FP/SIMD state, signal mask; an
interrupted sleep starts again whole). Only the chosen thread stays stopped during the
call: the others were released, so a lock one of them holds cannot block the call for
ever. The thread is never one stopped inside malloc/free (glibc's code), the dynamic
loader, an unwinder or the tracking library (busy_threads): the call allocates and loads,
and would deadlock on a lock that thread itself holds. A return value is lost (the stub loads rax): callees leave
their results in memory (mu_track_last_rc).
"""
from __future__ import annotations

import errno
import os
from typing import Dict, List, Optional, Sequence, Tuple

from memunreachable.sweep import detect
from memunreachable.collect import diagnose, procfs, seccomp, sites
from memunreachable.collect.memory import ProcessMemory
from memunreachable.heaps.glibc.walker import arena_addresses
from memunreachable.stacks import elf as E
from memunreachable._errors import (CollectionError, MemunreachableError, NoSuchProcess,
                                    UnsupportedTarget)
from memunreachable._ffi import ffi, lib
from memunreachable._types import Mapping
from memunreachable.collect.freeze import Frozen

CALL_TIMEOUT = 5.0              # seconds a call may take (dlopen of a library: milliseconds)
TRACK_LIBRARY = "_track.so"
STEP_NAMES = {lib.MU_STEP_START: "start", lib.MU_STEP_OPTIONS: "set options",
              lib.MU_STEP_SETREGS: "call started", lib.MU_STEP_ENTER: "call returned",
              lib.MU_STEP_EXIT: "thread state restored", lib.MU_STEP_RESTORED: "restore"}


class CallTimedOut(CollectionError):
    """The injected call had not returned in time: it goes on in the target, whose thread
    then resumes through the guard's frame (nothing is left stopped)."""


# Returns the syscalls loading a library makes (dlopen: open, map, protect, close; the
# routing: map, protect), as a seccomp filter sees them, plus the frame's rt_sigreturn at
# the stub restore_rt. Arguments a filter may look at are the usual ones.
def load_calls(restore_rt: int) -> List[seccomp.Call]:
    ip = restore_rt + 9
    at_fdcwd, o_cloexec = -100 & (2**64 - 1), 0o2000000
    prot_rx, prot_rw, prot_r = 5, 3, 1
    map_private, map_anon = 0x02, 0x20
    calls = [("openat", 257, (at_fdcwd, 0, o_cloexec, 0, 0, 0)),
             ("read", 0, (3, 0, 832, 0, 0, 0)),
             ("newfstatat", 262, (3, 0, 0, 0x1000, 0, 0)),
             ("mmap", 9, (0, 1 << 20, prot_rx, map_private, 3, 0)),
             ("mmap", 9, (0, 1 << 20, prot_rw, map_private | map_anon, 2**64 - 1, 0)),
             ("mprotect", 10, (0, 4096, prot_r, 0, 0, 0)),
             ("munmap", 11, (0, 4096, 0, 0, 0, 0)),
             ("close", 3, (3, 0, 0, 0, 0, 0)),
             ("rt_sigreturn", seccomp.SYS_RT_SIGRETURN, (0, 0, 0, 0, 0, 0))]
    return [seccomp.Call(name, nr, args, ip) for name, nr, args in calls]


# Returns the tids of fz's threads stopped where an injected call could deadlock on a lock
# they hold: inside malloc/free (threads_in_allocator: glibc's code, or a futex wait there on
# an arena's lock: fork waits for each arena's lock holding the ones before; any futex wait
# in glibc's code when the arenas cannot be read), the dynamic loader, the tracking library,
# or an unwinder (libgcc_s, libunwind: the tracking library's wrappers unwind, and a thread
# throwing an exception holds the unwinder's locks). A thread waiting on a condition
# variable, a join or another mutex is not busy: an idle thread pool waits only there.
def busy_threads(fz: Frozen) -> List[int]:
    busy = set(detect.threads_in_allocator(fz.threads, fz.maps, fz.pid, _arena_mutexes(fz)))
    code = [m.range for m in fz.maps if m.executable and _holds_locks_we_take(
        detect.strip_deleted(m.path))]
    busy.update(t.tid for t in fz.threads if any(r.contains(t.regs[16]) for r in code))
    return sorted(busy)


def _arena_mutexes(fz: Frozen) -> Optional[List[int]]:
    """The addresses of fz's arena locks; None when they cannot be read."""
    try:
        with ProcessMemory(fz.pid) as mem:
            return arena_addresses(mem, fz.maps, fz.pid)
    except (OSError, MemunreachableError):
        return None


def _holds_locks_we_take(path: str) -> bool:
    name = os.path.basename(path)
    return detect.is_loader(path) or name == TRACK_LIBRARY or \
        name.startswith(("libgcc_s.", "libunwind.", "libunwind-"))


# Returns (tid, restore_rt, refusals, busy): the first thread at an interrupt stop that is
# not busy (busy_threads), whose stack takes the guard's frames (sites.stack_takes_frames)
# and whose seccomp rules allow calls(restore_rt); tid 0 when none (refusals: the
# seccomp.Verdicts of the threads refused for their rules). Raises UnsupportedTarget when
# the guard cannot be used (no rt_sigreturn stub readable, or a shadow stack).
def choose_thread(fz: Frozen, calls=load_calls, allow_unreadable: bool = False
                  ) -> Tuple[int, int, List[seccomp.Verdict], List[int]]:
    restore_rt = sites.find_guard(fz.pid, fz.maps)[1]
    if not restore_rt:
        raise UnsupportedTarget(
            f"no call can be injected safely into process {fz.pid}: it runs with a shadow "
            "stack, or glibc's rt_sigreturn stub was not found in its loader or libc",
            hint="allocation stacks need the program started under `memunreachable run`")
    busy = busy_threads(fz)
    refusals: List[seccomp.Verdict] = []
    for tid, _, _ in list(fz.interrupt_stops()):
        if tid in busy or not sites.stack_takes_frames(fz, tid):
            continue
        verdict = seccomp.thread_verdict(fz.pid, tid, calls(restore_rt), allow_unreadable)
        if verdict.ok:
            return tid, restore_rt, [], busy
        refusals.append(verdict)
    return 0, restore_rt, refusals, busy


# Calls func(*args) in thread tid of fz (stopped; the others may run), with data (bytes,
# e.g. a NUL-terminated path) copied onto tid's stack and passed as the first argument
# instead when given. Returns the call's time in ms. tid is restored exactly. Raises
# NoSuchProcess (the target exited), CallTimedOut (the call goes on in the target),
# CollectionError (a ptrace step failed, or the function crashed: SIGSEGV & co. suppressed,
# the call abandoned through the guard's frame).
def call(fz: Frozen, tid: int, func: int, restore_rt: int, args: Sequence[int] = (),
         data: bytes = b"", timeout: float = CALL_TIMEOUT) -> float:
    words = ffi.new("uint64_t[6]", [a & (2**64 - 1) for a in args] + [0] * (6 - len(args)))
    buf = ffi.from_buffer("uint8_t[]", data) if data else ffi.NULL
    out = ffi.new("mu_inject *")
    with fz.critical():
        rc = lib.mu_inject_call(tid, func, restore_rt, fz.regs_at_freeze(tid), words, buf,
                                len(data), int(timeout * 1000), out)
        fz.record_signals(tid, list(out.signals)[:out.nsignals])
    if rc == -errno.ETIMEDOUT:
        raise CallTimedOut(
            f"the call injected into thread {tid} of process {fz.pid} did not return within "
            f"{timeout:g} s; it goes on there, and the thread resumes as it was once it returns",
            hint="the target may be blocked; run the command again later to see its state")
    if rc < 0:
        err = -rc
        if err == errno.ESRCH and procfs.task_state(fz.pid, tid) in ("", "Z", "X"):
            raise NoSuchProcess(fz.pid, f"process {fz.pid} exited during the call",
                                hint=diagnose.hint_no_process(fz.pid))
        what = "the function crashed (the call was abandoned)" if err == errno.EFAULT \
            and out.step >= lib.MU_STEP_SETREGS else os.strerror(err)
        raise CollectionError(
            f"injecting a call into thread {tid} of process {fz.pid} failed at step "
            f"'{STEP_NAMES.get(out.step, out.step)}': {what}"
            + ("" if out.restored else " (its registers could not be restored)"))
    return (out.t_ns[lib.MU_STEP_RESTORED] - out.t_ns[lib.MU_STEP_START]) / 1e6


# Returns {name: run-time address} of the names the object at path (mapped in pid: maps)
# defines in its .dynsym; {} when it is not mapped or not readable.
def symbols(pid: int, maps: Sequence[Mapping], path: str, names: Sequence[str]) -> Dict[str, int]:
    mappings = sorted((m for m in maps if detect.strip_deleted(m.path) == path),
                      key=lambda m: m.begin)
    if not mappings:
        return {}
    try:
        with procfs.open_mapped_file(mappings, pid, path) as f:
            obj = E.ElfFile(f)
            first, values = obj.first_load(), obj.dynsym_values(names)
    except (OSError, E.ElfError):
        return {}
    start = next((m.begin for m in mappings if first and m.offset == first[0]), None)
    if start is None:
        return {}
    return {name: start - first[1] + value for name, value in values.items()}


def mapped_paths(maps: Sequence[Mapping], test) -> List[str]:
    """The paths of the file mappings for which test(path) holds, in address order, once."""
    out: List[str] = []
    for m in maps:
        path = detect.strip_deleted(m.path)
        if path.startswith("/") and path not in out and test(path):
            out.append(path)
    return out


# Returns (address, name) of the function that loads a library in pid: dlopen in libc
# (glibc 2.34+), else in libdl when the program loaded it, else libc's
# __libc_dlopen_mode (same arguments); (0, "") when none is found.
def find_dlopen(pid: int, maps: Sequence[Mapping]) -> Tuple[int, str]:
    libc = mapped_paths(maps, detect.is_libc)
    libdl = mapped_paths(maps, lambda p: os.path.basename(p).startswith("libdl."))
    for paths, name in ((libc, "dlopen"), (libdl, "dlopen"), (libc, "__libc_dlopen_mode")):
        for path in paths:
            addr = symbols(pid, maps, path, [name]).get(name)
            if addr:
                return addr, name
    return 0, ""
