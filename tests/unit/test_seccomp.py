"""Unit tests of seccomp.py: the classic-BPF interpreter, the combination of filters and the
per-thread verdict, on programs built in memory (the same macros as <linux/filter.h>)."""
import errno
import struct

import pytest

from memunreachable.collect import seccomp as sc
from memunreachable.collect.seccomp import (Insn, RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS,
                                            RET_KILL_THREAD, RET_LOG, RET_TRACE, RET_TRAP,
                                            RET_USER_NOTIF)

# <linux/filter.h> BPF_STMT / BPF_JUMP and the codes a seccomp filter uses
LD_W_ABS, LD_W_LEN, LDX_W_LEN, LD_IMM, LDX_IMM, LD_MEM, LDX_MEM = 0x20, 0x80, 0x81, 0x00, 0x01, 0x60, 0x61
ST, STX = 0x02, 0x03
RET_K, RET_A = 0x06, 0x16
JEQ_K, JGT_K, JGE_K, JSET_K, JA, JEQ_X = 0x15, 0x25, 0x35, 0x45, 0x05, 0x1D
ALU_ADD_K, ALU_SUB_K, ALU_MUL_K, ALU_AND_K, ALU_OR_K, ALU_XOR_K = 0x04, 0x14, 0x24, 0x54, 0x44, 0xA4
ALU_LSH_K, ALU_RSH_K, ALU_NEG, ALU_DIV_X, ALU_MOD_K, ALU_ADD_X = 0x64, 0x74, 0x84, 0x3C, 0x94, 0x0C
TAX, TXA = 0x07, 0x87
OFF_NR, OFF_ARCH, OFF_IP, OFF_ARGS = 0, 4, 8, 16


def stmt(code, k=0):
    return Insn(code, 0, 0, k)


def jump(code, k, jt, jf):
    return Insn(code, jt, jf, k)


def rules(clone_ret, wait4_ret):
    """fixtures/sec_filter.c's second filter."""
    return [
        stmt(LD_W_ABS, OFF_ARCH),
        jump(JEQ_K, sc.AUDIT_ARCH_X86_64, 1, 0),
        stmt(RET_K, RET_ALLOW),
        stmt(LD_W_ABS, OFF_NR),
        jump(JEQ_K, 56, 0, 1),
        stmt(RET_K, clone_ret),
        jump(JEQ_K, 61, 0, 1),
        stmt(RET_K, wait4_ret),
        stmt(RET_K, RET_ALLOW),
    ]


ALLOW_ALL = [stmt(RET_K, RET_ALLOW)]


def data(nr, args=(0,) * 6, ip=0x1000, arch=sc.AUDIT_ARCH_X86_64):
    return sc.seccomp_data(nr, args, ip, arch)


def test_seccomp_data_layout():
    d = sc.clone_call(0x7F0000001000).data()
    assert len(d) == 64
    assert d == struct.pack("<iIQ6Q", 56, 0xC000003E, 0x7F0000001002, 0, 0, 0, 0, 0, 0)
    w = sc.wait4_call(0x5000, 1234)
    assert (w.name, w.nr, w.args, w.ip) == ("wait4", 61, (1234, 0, 0x40000001, 0, 0, 0), 0x5002)
    # a negative int argument is seen as its 64-bit two's complement
    assert sc.seccomp_data(1, (-1, 0, 0, 0, 0, 0), 0)[16:24] == b"\xff" * 8
    calls = sc.injected_calls(0x5000)
    assert [(c.name, c.args[0]) for c in calls] == [("clone", 0), ("wait4", 1), ("wait4", 4194304)]
    assert [(c.name, c.args[0]) for c in sc.injected_calls(0x5000, child=77)] == \
        [("clone", 0), ("wait4", 77)]


def test_parse_program_round_trip():
    prog = rules(RET_ERRNO | errno.EPERM, RET_KILL_THREAD)
    raw = b"".join(struct.pack("<HBBI", i.code, i.jt, i.jf, i.k) for i in prog)
    assert sc.parse_program(raw) == prog
    for bad in (b"", b"\x06\x00\x00\x00\x00\x00\xff"):
        with pytest.raises(sc.FilterError):
            sc.parse_program(bad)


def test_rules_per_syscall_and_arch():
    prog = rules(RET_ERRNO | errno.EPERM, RET_KILL_THREAD)
    assert sc.run_filter(prog, data(56)) == RET_ERRNO | 1
    assert sc.run_filter(prog, data(61)) == RET_KILL_THREAD
    assert sc.run_filter(prog, data(0)) == RET_ALLOW
    assert sc.run_filter(prog, data(56, arch=0x40000003)) == RET_ALLOW     # i386: not ours


def test_most_restrictive_action_wins():
    order = [RET_KILL_PROCESS, RET_KILL_THREAD, RET_TRAP, RET_ERRNO | 5, RET_USER_NOTIF,
             RET_TRACE | 3, RET_LOG, RET_ALLOW]
    for i, strict in enumerate(order):
        for loose in order[i:]:
            progs = [[stmt(RET_K, loose)], [stmt(RET_K, strict)]]
            assert sc.run_filters(progs, data(56)) == strict
            assert sc.run_filters(progs[::-1], data(56)) == strict
    assert sc.run_filters([], data(56)) == RET_ALLOW
    # equal actions: the newest filter (first in the list) gives the data
    assert sc.run_filters([[stmt(RET_K, RET_ERRNO | 13)], [stmt(RET_K, RET_ERRNO | 1)]],
                          data(56)) == RET_ERRNO | 13
    # an action the kernel does not know kills the process
    assert sc.run_filters([[stmt(RET_K, 0x7FFE0000)], ALLOW_ALL], data(56)) == RET_KILL_PROCESS
    assert sc.run_filters([ALLOW_ALL, rules(RET_ALLOW, RET_KILL_THREAD)], data(61)) == \
        RET_KILL_THREAD


def test_permits_and_describe():
    assert [sc.permits(r) for r in (RET_ALLOW, RET_LOG, RET_TRACE, RET_USER_NOTIF,
                                    RET_ERRNO, RET_TRAP, RET_KILL_THREAD, RET_KILL_PROCESS)] == \
        [True, True, False, False, False, False, False, False]
    assert [sc.describe(r) for r in (RET_ALLOW, RET_LOG, RET_ERRNO | errno.EPERM,
                                     RET_ERRNO | 4095, RET_TRAP, RET_TRACE | 7,
                                     RET_USER_NOTIF, RET_KILL_THREAD, RET_KILL_PROCESS)] == \
        ["ALLOW", "LOG", "ERRNO(EPERM)", "ERRNO(4095)", "TRAP", "TRACE(7)", "USER_NOTIF",
         "KILL_THREAD", "KILL_PROCESS"]


def test_64_bit_argument_checks_like_libseccomp():
    # kill wait4 unless options (args[2]) has WNOHANG and its high half is 0
    prog = [
        stmt(LD_W_ABS, OFF_NR), jump(JEQ_K, 61, 0, 5),
        stmt(LD_W_ABS, OFF_ARGS + 2 * 8 + 4), jump(JEQ_K, 0, 0, 2),
        stmt(LD_W_ABS, OFF_ARGS + 2 * 8), jump(JSET_K, 1, 1, 0),
        stmt(RET_K, RET_KILL_PROCESS),
        stmt(RET_K, RET_ALLOW),
    ]
    assert sc.run_filter(prog, sc.wait4_call(0x1000, 5).data()) == RET_ALLOW
    assert sc.run_filter(prog, data(61, (5, 0, 0x40000000, 0, 0, 0))) == RET_KILL_PROCESS
    assert sc.run_filter(prog, data(61, (5, 0, 1 | 1 << 32, 0, 0, 0))) == RET_KILL_PROCESS
    # the instruction pointer is visible too
    ip_prog = [stmt(LD_W_ABS, OFF_IP), jump(JGE_K, 0x2000, 0, 1), stmt(RET_K, RET_TRAP),
               stmt(RET_K, RET_ALLOW)]
    assert sc.run_filter(ip_prog, sc.clone_call(0x1FFE).data()) == RET_TRAP     # ip 0x2000
    assert sc.run_filter(ip_prog, sc.clone_call(0x1FFD).data()) == RET_ALLOW


def test_alu_registers_memory_and_jumps():
    prog = [
        stmt(LD_W_ABS, OFF_NR),             # A = nr (56)
        stmt(ALU_ADD_K, 4),                 # 60
        stmt(ALU_MUL_K, 3),                 # 180
        stmt(ALU_SUB_K, 20),                # 160
        stmt(ST, 3),                        # M[3] = 160
        stmt(LDX_W_LEN),                    # X = 64
        stmt(ALU_DIV_X),                    # 160 / 64 = 2
        stmt(ALU_LSH_K, 4),                 # 32
        stmt(ALU_OR_K, 1),                  # 33
        stmt(ALU_XOR_K, 0xFF),              # 222
        stmt(ALU_AND_K, 0xF0),              # 208
        stmt(ALU_RSH_K, 3),                 # 26
        stmt(ALU_MOD_K, 7),                 # 5
        stmt(TAX),                          # X = 5
        stmt(LD_MEM, 3),                    # A = 160
        stmt(ALU_ADD_X),                    # 165
        stmt(STX, 0), stmt(LDX_MEM, 0),     # X = 5
        jump(JEQ_X, 0, 0, 1),               # A != X: over the next
        stmt(RET_K, RET_KILL_THREAD),
        stmt(JA, 1),
        stmt(RET_K, RET_KILL_THREAD),       # jumped over
        jump(JGT_K, 164, 0, 3),             # 165 > 164
        stmt(ALU_NEG),                      # -165
        stmt(ALU_ADD_K, 165 + 0x7FFF0000),  # 0x7fff0000 = ALLOW
        stmt(RET_A),
        stmt(RET_K, RET_TRAP),
    ]
    assert sc.run_filter(prog, data(56)) == RET_ALLOW
    assert sc.run_filter([stmt(LD_W_LEN), stmt(TXA), stmt(RET_A)], data(0)) == 0
    assert sc.run_filter([stmt(LD_IMM, 7), stmt(LDX_IMM, 9), stmt(TXA), stmt(RET_A)], data(0)) == 9
    # division by a zero X ends the program with 0: KILL_THREAD
    assert sc.run_filter([stmt(LD_IMM, 7), stmt(LDX_IMM, 0), stmt(ALU_DIV_X),
                          stmt(RET_K, RET_ALLOW)], data(0)) == RET_KILL_THREAD
    assert sc.run_filter([stmt(LD_IMM, 1), stmt(ALU_LSH_K, 40), stmt(RET_A)], data(0)) == 0


@pytest.mark.parametrize("prog", [
    [stmt(LD_W_ABS, 2), stmt(RET_A)],               # unaligned
    [stmt(LD_W_ABS, 64), stmt(RET_A)],              # past seccomp_data
    [stmt(0x28, 0), stmt(RET_A)],                   # BPF_LD|BPF_H|BPF_ABS
    [stmt(LD_MEM, 16), stmt(RET_A)],
    [stmt(ST, 16), stmt(RET_A)],
    [stmt(LD_IMM, 1)],                              # runs off the end
    [stmt(JA, 5), stmt(RET_A)],                     # jumps off the end
    [],
])
def test_programs_the_kernel_would_refuse(prog):
    with pytest.raises(sc.FilterError):
        sc.run_filter(prog, data(0))


def reader(progs):
    return lambda: progs


def unreadable(err):
    def read():
        raise sc.FiltersUnreadable(err, "no")
    return read


def test_verdicts():
    calls = sc.injected_calls(0x1000)
    assert sc.verdict_for(5, 0, calls, unreadable(errno.EIO)) == sc.Verdict(5, 0, True)
    v = sc.verdict_for(5, 1, calls, reader([ALLOW_ALL]), allow_unreadable=True)
    assert (v.ok, v.reason) == (False, "it runs in seccomp strict mode (only read, write, "
                                       "exit and sigreturn are allowed)")
    assert sc.verdict_for(5, 2, calls, reader([ALLOW_ALL, rules(RET_LOG, RET_ALLOW)])) == \
        sc.Verdict(5, 2, True)
    v = sc.verdict_for(5, 2, calls, reader([ALLOW_ALL, rules(RET_ALLOW, RET_KILL_THREAD)]))
    assert (v.ok, v.reason) == (False, "its seccomp filter returns KILL_THREAD for wait4")
    v = sc.verdict_for(5, 2, calls, reader([rules(RET_ERRNO | errno.EPERM, RET_TRAP)]))
    assert (v.ok, v.reason) == (False, "its seccomp filter returns ERRNO(EPERM) for clone")
    # a filter that only kills wait4 of large pids: caught by the probe pids before the clone
    big = [stmt(LD_W_ABS, OFF_NR), jump(JEQ_K, 61, 0, 3), stmt(LD_W_ABS, OFF_ARGS),
           jump(JGT_K, 100000, 0, 1), stmt(RET_K, RET_KILL_PROCESS), stmt(RET_K, RET_ALLOW)]
    assert sc.verdict_for(5, 2, calls, reader([big])).reason == \
        "its seccomp filter returns KILL_PROCESS for wait4"
    assert sc.verdict_for(5, 2, sc.injected_calls(0x1000, child=400), reader([big])).ok
    for err, name in ((errno.EACCES, "EACCES"), (errno.EINVAL, "EINVAL"),
                      (errno.EMEDIUMTYPE, "EMEDIUMTYPE"), (errno.EIO, "EIO")):
        v = sc.verdict_for(5, 2, calls, unreadable(err))
        assert v == sc.Verdict(5, 2, False, f"its seccomp filters cannot be read ({name})", err)
        assert sc.verdict_for(5, 2, calls, unreadable(err), allow_unreadable=True) == \
            sc.Verdict(5, 2, True, "", err)
    v = sc.verdict_for(5, 2, calls, reader([[stmt(LD_W_ABS, 3), stmt(RET_A)]]))
    assert (v.ok, v.reason) == (False, "its seccomp filter cannot be evaluated (load at "
                                       "offset 3 of seccomp_data)")
    assert sc.verdict_for(5, 3, calls, reader([])).reason == "it runs in an unknown seccomp mode 3"
