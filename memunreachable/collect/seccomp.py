"""seccomp.py: may this thread make the syscalls the snapshot injects? (issue 7)

Shared by the snapshot stage; not a stage itself. seccomp is per thread: each thread has a
mode (/proc/PID/task/TID/status `Seccomp:` 0 off, 1 strict, 2 filter) and, in filter mode,
a stack of classic-BPF programs (`Seccomp_filters:` counts them). An injected syscall runs
under the filters of the thread it is injected into, so before injecting:
    strict mode    only read, write, exit and rt_sigreturn are allowed: never inject
    filter mode    read the programs (PTRACE_SECCOMP_GET_FILTER) and run every one of them
                   on the exact struct seccomp_data of each injected syscall; inject only
                   when the combined action is ALLOW or LOG
    unreadable     (no CAP_SYS_ADMIN, a kernel without CONFIG_CHECKPOINT_RESTORE, an eBPF
                   filter): no verdict; the caller decides (--allow-seccomp-target)

Pure parts (unit-tested on in-memory programs): parse_program, run_filter, run_filters,
seccomp_data, describe, permits. Live part: read_filters(tid) (tid must be in a
ptrace-stop of the calling thread) and thread_verdict(pid, tid, calls).
References: seccomp(2), ptrace(2) PTRACE_SECCOMP_GET_FILTER; kernel kernel/seccomp.c
(seccomp_run_filters: the action with the lowest signed value wins, ties keep the newest
filter's; seccomp_check_filter: the instructions a filter may use; populate_seccomp_data:
instruction_pointer is the address after the `syscall` instruction), net/core/filter.c.
"""
from __future__ import annotations

import ctypes
import errno
import struct
from typing import List, Optional, Sequence, Tuple

from memunreachable.collect import procfs
from memunreachable._errors import NoSuchProcess
from memunreachable._types import FrozenFields, set_fields

# include/uapi/linux/seccomp.h
RET_KILL_PROCESS = 0x80000000
RET_KILL_THREAD = 0x00000000
RET_TRAP = 0x00030000
RET_ERRNO = 0x00050000
RET_USER_NOTIF = 0x7FC00000
RET_TRACE = 0x7FF00000
RET_LOG = 0x7FFC0000
RET_ALLOW = 0x7FFF0000
ACTION_FULL = 0xFFFF0000
DATA = 0x0000FFFF
ACTION_NAMES = {RET_KILL_PROCESS: "KILL_PROCESS", RET_KILL_THREAD: "KILL_THREAD",
                RET_TRAP: "TRAP", RET_ERRNO: "ERRNO", RET_USER_NOTIF: "USER_NOTIF",
                RET_TRACE: "TRACE", RET_LOG: "LOG", RET_ALLOW: "ALLOW"}

AUDIT_ARCH_X86_64 = 0xC000003E
SYS_CLONE, SYS_WAIT4 = 56, 61
SYS_RT_SIGRETURN, SYS_EXIT_GROUP = 15, 231
WALL, WNOHANG = 0x40000000, 1
SECCOMP_DATA_SIZE = 64          # int nr; u32 arch; u64 instruction_pointer; u64 args[6]
PTRACE_SECCOMP_GET_FILTER = 0x420C
BPF_MAXINSNS = 4096
MODE_NAMES = {0: "disabled", 1: "strict", 2: "filter"}

# classic BPF (include/uapi/linux/filter.h, bpf_common.h)
LD, LDX, ST, STX, ALU, JMP, RET, MISC = 0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07
W, H, B = 0x00, 0x08, 0x10
IMM, ABS, IND, MEM, LEN, MSH = 0x00, 0x20, 0x40, 0x60, 0x80, 0xA0
ADD, SUB, MUL, DIV, OR, AND, LSH, RSH, NEG, MOD, XOR = (
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0)
JA, JEQ, JGT, JGE, JSET = 0x00, 0x10, 0x20, 0x30, 0x40
K, X = 0x00, 0x08
TAX, TXA = 0x00, 0x80
MASK32 = 0xFFFFFFFF


class FilterError(ValueError):
    """A program this interpreter refuses (the kernel would have refused it too)."""


class FiltersUnreadable(OSError):
    """PTRACE_SECCOMP_GET_FILTER failed; .errno says why (EACCES, EINVAL, EMEDIUMTYPE, EIO)."""


class Insn(FrozenFields):
    __slots__ = ("code", "jt", "jf", "k")

    def __init__(self, code: int, jt: int, jf: int, k: int):
        set_fields(self, code, jt, jf, k)


class Call(FrozenFields):
    """One syscall as the filter sees it."""
    __slots__ = ("name", "nr", "args", "ip")

    def __init__(self, name: str, nr: int, args: Tuple[int, int, int, int, int, int],
                 ip: int):  # instruction_pointer: the address after the `syscall` instruction
        set_fields(self, name, nr, args, ip)

    def data(self) -> bytes:
        return seccomp_data(self.nr, self.args, self.ip)


def clone_call(syscall_insn: int) -> Call:
    """clone(0, 0, 0, 0, 0) as the snapshot injects it at syscall_insn."""
    return Call("clone", SYS_CLONE, (0, 0, 0, 0, 0, 0), syscall_insn + 2)


def wait4_call(syscall_insn: int, child: int) -> Call:
    """wait4(child, NULL, __WALL|WNOHANG, NULL) as the reap injects it at syscall_insn."""
    return Call("wait4", SYS_WAIT4, (child & (2**64 - 1), 0, WALL | WNOHANG, 0, 0, 0),
                syscall_insn + 2)


# The child's pid is unknown before the clone: a filter that looks at wait4's pid is run
# with both ends of the pid range (1 and PID_MAX_LIMIT), the stricter verdict counts; the
# reap checks again with the real pid.
WAIT4_PROBE_PIDS = (1, 4194304)


def guard_calls(syscall_insn: int, restore_rt: int) -> List[Call]:
    """What the guard (native/mu_ptrace.c) makes a thread run if the checker dies during an
    injection: rt_sigreturn at the stub restore_rt, and, in the clone's child, exit_group(0)
    at syscall_insn."""
    return [Call("rt_sigreturn", SYS_RT_SIGRETURN, (0, 0, 0, 0, 0, 0), restore_rt + 9),
            Call("exit_group", SYS_EXIT_GROUP, (0, 0, 0, 0, 0, 0), syscall_insn + 2)]


def reap_calls(syscall_insn: int, child: int, restore_rt: int = 0) -> List[Call]:
    """What the reap of child makes a thread run: its wait4, and with a guard its frames'."""
    return [wait4_call(syscall_insn, child)] + (
        guard_calls(syscall_insn, restore_rt) if restore_rt else [])


def injected_calls(syscall_insn: int, child: Optional[int] = None,
                   restore_rt: int = 0) -> List[Call]:
    """Every syscall a snapshot (clone, then the reaping wait4) makes the thread run, and
    with a guard (restore_rt) those its frames run."""
    pids = WAIT4_PROBE_PIDS if child is None else (child,)
    return ([clone_call(syscall_insn)] + [wait4_call(syscall_insn, p) for p in pids]
            + (guard_calls(syscall_insn, restore_rt) if restore_rt else []))


def seccomp_data(nr: int, args: Sequence[int], ip: int, arch: int = AUDIT_ARCH_X86_64) -> bytes:
    """struct seccomp_data, little-endian (x86_64)."""
    return struct.pack("<iIQ6Q", nr, arch, ip, *[a & (2**64 - 1) for a in args])


# Returns the instructions of a struct sock_filter array (8 bytes each: u16 code, u8 jt,
# u8 jf, u32 k). Raises FilterError on a length that is not a multiple of 8, or empty.
def parse_program(raw: bytes) -> List[Insn]:
    if not raw or len(raw) % 8:
        raise FilterError(f"a sock_filter program of {len(raw)} bytes")
    return [Insn(*struct.unpack_from("<HBBI", raw, off)) for off in range(0, len(raw), 8)]


def _alu(op: int, a: int, v: int) -> int:
    if op == ADD:
        return (a + v) & MASK32
    if op == SUB:
        return (a - v) & MASK32
    if op == MUL:
        return (a * v) & MASK32
    if op == DIV:
        return a // v if v else None
    if op == MOD:
        return a % v if v else None
    if op == OR:
        return a | v
    if op == AND:
        return a & v
    if op == XOR:
        return a ^ v
    if op == LSH:
        return (a << v) & MASK32 if v < 32 else 0
    if op == RSH:
        return a >> v if v < 32 else 0
    if op == NEG:
        return (-a) & MASK32
    raise FilterError(f"unknown ALU operation {op:#x}")


# Returns the 32-bit value the program returns for data (a seccomp_data). Implements the
# classic BPF a seccomp filter may contain: loads of 32-bit words at aligned offsets of
# seccomp_data, LEN, immediates and scratch memory M[0..15], ALU with K or X, the jumps,
# TAX/TXA, RET K/A. Division by zero returns 0, as the kernel's BPF does. Raises
# FilterError for anything the kernel's seccomp_check_filter() would have refused.
def run_filter(prog: Sequence[Insn], data: bytes) -> int:
    if not prog or len(prog) > BPF_MAXINSNS:
        raise FilterError(f"a program of {len(prog)} instructions")
    a = x = 0
    mem = [0] * 16
    pc = 0
    while pc < len(prog):
        ins = prog[pc]
        cls, code, k = ins.code & 0x07, ins.code, ins.k
        pc += 1
        if cls == LD or cls == LDX:
            mode = code & 0xE0
            if mode == IMM:
                v = k
            elif mode == LEN:
                v = len(data)
            elif mode == MEM:
                if k >= 16:
                    raise FilterError(f"scratch memory M[{k}]")
                v = mem[k]
            elif mode == ABS and cls == LD and code & 0x18 == W:
                if k % 4 or k + 4 > len(data):
                    raise FilterError(f"load at offset {k} of seccomp_data")
                v = struct.unpack_from("<I", data, k)[0]
            else:
                raise FilterError(f"instruction {code:#06x} is not allowed in a seccomp filter")
            if cls == LD:
                a = v
            else:
                x = v
        elif cls == ST or cls == STX:
            if k >= 16:
                raise FilterError(f"scratch memory M[{k}]")
            mem[k] = a if cls == ST else x
        elif cls == ALU:
            op = code & 0xF0
            v = x if code & 0x08 == X else k
            r = _alu(op, a, v)
            if r is None:
                return 0
            a = r
        elif cls == JMP:
            op = code & 0xF0
            if op == JA:
                pc += k
            else:
                v = x if code & 0x08 == X else k
                if op == JEQ:
                    taken = a == v
                elif op == JGT:
                    taken = a > v
                elif op == JGE:
                    taken = a >= v
                elif op == JSET:
                    taken = bool(a & v)
                else:
                    raise FilterError(f"unknown jump {code:#06x}")
                pc += ins.jt if taken else ins.jf
        elif cls == RET:
            src = code & 0x18
            if src == K:
                return k
            if src == 0x10:         # BPF_A
                return a
            raise FilterError(f"unknown return {code:#06x}")
        elif cls == MISC:
            if code & 0xF8 == TAX:
                x = a
            elif code & 0xF8 == TXA:
                a = x
            else:
                raise FilterError(f"unknown misc instruction {code:#06x}")
    raise FilterError("the program runs off its end without a return")


def _rank(ret: int) -> int:
    """The kernel's ACTION_ONLY(): the action as a signed 32-bit number (lower is stricter)."""
    action = ret & ACTION_FULL
    return action - 2**32 if action & 0x80000000 else action


# Returns the combined return value of every filter of a thread (programs newest first, as
# the kernel walks them): the one whose action is the most restrictive; on a tie, the
# newest filter's (its data, e.g. the errno, counts). An action the kernel does not know
# reads as KILL_PROCESS (kernel/seccomp.c __seccomp_filter's default case).
def run_filters(progs: Sequence[Sequence[Insn]], data: bytes) -> int:
    if not progs:
        return RET_ALLOW
    best = None
    for prog in progs:
        ret = run_filter(prog, data)
        if ret & ACTION_FULL not in ACTION_NAMES:
            ret = RET_KILL_PROCESS
        if best is None or _rank(ret) < _rank(best):
            best = ret
    return best


def permits(ret: int) -> bool:
    """True when the syscall runs normally: ALLOW or LOG."""
    return ret & ACTION_FULL in (RET_ALLOW, RET_LOG)


def describe(ret: int) -> str:
    """KILL_THREAD, ERRNO(EPERM), TRACE(7), ALLOW, ... (the data part where it matters)."""
    action = ret & ACTION_FULL
    name = ACTION_NAMES.get(action, f"{action:#x}")
    if action == RET_ERRNO:
        return f"ERRNO({errno.errorcode.get(ret & DATA, ret & DATA)})"
    if action in (RET_TRAP, RET_TRACE) and ret & DATA:
        return f"{name}({ret & DATA})"
    return name


# ---- live: read the programs of a stopped thread

class _Sockfilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


def _ptrace(req: int, tid: int, addr: int, data: int) -> int:
    from memunreachable.collect.tracees import PtraceError, ptrace
    try:
        return ptrace(req, tid, addr, data)
    except PtraceError as exc:
        err = getattr(exc, "errno", None) or errno.EIO
        raise FiltersUnreadable(err, f"PTRACE_SECCOMP_GET_FILTER on thread {tid}: "
                                     f"{errno.errorcode.get(err, err)}") from None


# Returns the programs of thread tid, newest first (the order the kernel runs them).
# index 0 of PTRACE_SECCOMP_GET_FILTER is the oldest filter. tid must be in a ptrace-stop
# of the calling thread. Raises FiltersUnreadable (EACCES: no CAP_SYS_ADMIN or we run under
# seccomp ourselves; EINVAL: not in filter mode; EMEDIUMTYPE: an eBPF filter; EIO: the
# kernel lacks the request), FilterError on a malformed program.
def read_filters(tid: int, count: Optional[int] = None) -> List[List[Insn]]:
    progs = []
    index = 0
    while count is None or index < count:
        try:
            n = _ptrace(PTRACE_SECCOMP_GET_FILTER, tid, index, 0)
        except FiltersUnreadable as exc:
            if exc.errno == errno.ENOENT and count is None and index:
                break           # past the last filter
            raise
        if not 0 < n <= BPF_MAXINSNS:
            raise FilterError(f"filter {index} of thread {tid} has {n} instructions")
        buf = (_Sockfilter * n)()
        got = _ptrace(PTRACE_SECCOMP_GET_FILTER, tid, index, ctypes.addressof(buf))
        if got != n:
            raise FilterError(f"filter {index} of thread {tid} changed size while read")
        progs.append(parse_program(bytes(buf)))
        index += 1
    progs.reverse()
    return progs


class Verdict(FrozenFields):
    """Whether the calls may be injected into a thread, and why not."""
    __slots__ = ("tid", "mode", "ok", "reason", "unreadable")

    def __init__(self, tid: int,
                 mode: int,             # 0 disabled, 1 strict, 2 filter
                 ok: bool,
                 # "" when ok, else why not, e.g. "its seccomp filter returns KILL_THREAD for
                 # clone"
                 reason: str = "",
                 unreadable: int = 0):  # errno when the filters could not be read (mode 2)
        set_fields(self, tid, mode, ok, reason, unreadable)


# Returns the Verdict for injecting calls into thread tid of pid (tid stopped by the
# calling thread). Mode 0: ok. Mode 1: never ok. Mode 2: ok only when every call runs to
# ALLOW or LOG under all of the thread's filters; unreadable filters (or a program this
# interpreter cannot run) give ok=allow_unreadable with .unreadable set.
def thread_verdict(pid: int, tid: int, calls: Sequence[Call],
                   allow_unreadable: bool = False) -> Verdict:
    try:
        mode, count = procfs.read_seccomp(pid, tid)
    except (NoSuchProcess, OSError):
        return Verdict(tid, -1, False, "it is gone")
    return verdict_for(tid, mode, calls, lambda: read_filters(tid, count or None),
                       allow_unreadable)


# The decision of thread_verdict() with the filter reader passed in (unit tests).
def verdict_for(tid: int, mode: int, calls: Sequence[Call], reader,
                allow_unreadable: bool = False) -> Verdict:
    if mode == 0:
        return Verdict(tid, 0, True)
    if mode == 1:
        return Verdict(tid, 1, False, "it runs in seccomp strict mode (only read, write, exit "
                                      "and sigreturn are allowed)")
    if mode != 2:
        return Verdict(tid, mode, False, f"it runs in an unknown seccomp mode {mode}")
    try:
        progs = reader()
        for call in calls:
            ret = run_filters(progs, call.data())
            if not permits(ret):
                return Verdict(tid, 2, False,
                               f"its seccomp filter returns {describe(ret)} for {call.name}")
    except FiltersUnreadable as exc:
        err = exc.errno or errno.EIO
        why = f"its seccomp filters cannot be read ({errno.errorcode.get(err, err)})"
        return Verdict(tid, 2, allow_unreadable, "" if allow_unreadable else why, unreadable=err)
    except FilterError as exc:
        why = f"its seccomp filter cannot be evaluated ({exc})"
        return Verdict(tid, 2, allow_unreadable, "" if allow_unreadable else why,
                       unreadable=errno.EINVAL)
    return Verdict(tid, 2, True)
