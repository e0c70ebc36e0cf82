"""Unit tests of stage 5 (classify): which mappings become roots."""
import struct

from memunreachable._types import Mapping, Range, ThreadState
from memunreachable.collect.procfs import guard_runs
from memunreachable.sweep.classify import (RED_ZONE, RootSet, classify, classify_mapping,
                                           register_words, stack_maps, unmanaged_memory)


def m(begin, end, perms, path="", inode=0, offset=0):
    return Mapping(begin, end, perms, offset, "00:00", inode, path)


def regs(sp, fs_base=0, rax=0, orig_rax=0xFFFFFFFFFFFFFFFF):
    """Registers of a thread stopped in user code (orig_rax -1), or in syscall orig_rax."""
    r = [0] * 27
    r[15] = orig_rax
    r[19] = sp
    r[21] = fs_base
    r[10] = rax
    return tuple(r)


LIB = "/usr/lib/x86_64-linux-gnu/libc.so.6"
MAPS = [
    m(0x1000, 0x2000, "r--p", "/bin/prog", 5),          # ELF header segment
    m(0x2000, 0x3000, "r-xp", "/bin/prog", 5),          # text
    m(0x3000, 0x4000, "rw-p", "/bin/prog", 5),          # .data
    m(0x4000, 0x6000, "rw-p", "", 0),                   # .bss tail
    m(0x10000, 0x30000, "rw-p", "[heap]"),
    m(0x40000, 0x41000, "r--p", "/data/file.bin", 9),   # a mapped data file
    m(0x50000, 0x51000, "r-xp", LIB, 7),
    m(0x51000, 0x53000, "rw-p", LIB, 7),               # libc .data (holds main_arena)
    m(0x60000, 0x61000, "---p", ""),                    # guard page
    m(0x61000, 0x70000, "rw-p", ""),                    # a thread stack
    m(0x80000, 0x81000, "rw-s", "/dev/shm/x", 3),
    m(0x90000, 0x91000, "r--p", "[vvar]"),
    m(0x91000, 0x92000, "r-xp", "[vdso]"),
    m(0xa0000, 0xc0000, "rw-p", "[stack]"),
]


def test_classify_mapping_table():
    objs = {"/bin/prog", LIB}
    kinds = [classify_mapping(x, objs) for x in MAPS]
    assert kinds == ["data", "skip", "data", "anon", "anon", "skip", "skip", "data", "skip",
                     "anon", "skip", "skip", "skip", "anon"]


def test_roots_cut_heap_metadata_and_dead_stack():
    threads = [ThreadState(1, regs(0xb0000)), ThreadState(2, regs(0x68000))]
    heap = [Range(0x10000, 0x30000)]
    meta = [Range(0x51100, 0x51900)]
    roots = classify(MAPS, threads, heap, meta)
    assert roots.ranges == [
        Range(0x1000, 0x2000), Range(0x3000, 0x4000), Range(0x4000, 0x6000),
        Range(0x51000, 0x51100), Range(0x51900, 0x53000),
        Range(0x68000 - RED_ZONE, 0x70000),
        Range(0xb0000 - RED_ZONE, 0xc0000),
    ]
    assert roots.kinds[Range(0x68000 - RED_ZONE, 0x70000)] == "stack"


def test_red_zone_only_for_a_thread_stopped_in_user_code():
    # thread 1 stopped in user code keeps SP-128; thread 2 blocked in read(2) is scanned from SP
    threads = [ThreadState(1, regs(0xb0000)), ThreadState(2, regs(0x68000, orig_rax=0))]
    roots = classify(MAPS, threads, [Range(0x10000, 0x30000)], [Range(0x51100, 0x51900)])
    assert Range(0x68000, 0x70000) in roots.ranges
    assert Range(0xb0000 - RED_ZONE, 0xc0000) in roots.ranges
    assert not any(r.contains(0x68000 - 8) for r in roots.ranges)


def test_stack_start_near_the_mapping_start_is_clamped():
    # SP 64 bytes above the mapping start: the red zone would reach below it
    threads = [ThreadState(1, regs(0x61040))]
    roots = classify(MAPS, threads, [], [])
    assert Range(0x61000, 0x70000) in roots.ranges


def test_static_binary_heap_prefix_is_root():
    # a static binary's TCB sits at the start of [heap], before sbrk_base
    maps = [m(0x10000, 0x30000, "rw-p", "[heap]")]
    roots = classify(maps, [], [Range(0x10400, 0x30000)], [])
    assert roots.ranges == [Range(0x10000, 0x10400)]


def test_register_words_include_fp_state():
    fp = struct.pack("<4Q", 0, 0x1234, 0, 0x5678)
    t = ThreadState(1, regs(0x100, fs_base=0x777, rax=0x42), fp)
    words = register_words([t])
    assert 0x777 in words and 0x42 in words and 0x100 in words
    assert words[27:] == [0x1234, 0x5678]


def test_fp_state_of_a_thread_inside_a_system_call_is_no_root():
    # every vector register is caller-saved: inside read(2) (orig_rax 0) it holds only stale
    # copies; the general registers stay roots (a callee-saved one may hold a live pointer)
    fp = struct.pack("<4Q", 0, 0x1234, 0, 0x5678)
    t = ThreadState(1, regs(0x100, fs_base=0x777, rax=0x42, orig_rax=0), fp)
    assert register_words([t]) == list(t.regs)


def test_data_ranges_follow_new_maps_and_unwritten_ranges():
    # the answers are kept for the same inputs (the plugin's helper): a mapping added
    # (dlopen) or another unwritten set must give the new answer, not the kept one
    from memunreachable.sweep.classify import data_ranges, mapping_classes
    first = data_ranges(MAPS, [])
    assert first == [Range(0x1000, 0x2000), Range(0x3000, 0x4000), Range(0x51000, 0x53000)]
    assert data_ranges(MAPS, []) == first
    assert data_ranges(MAPS, [Range(0x51000, 0x52000)]) == first[:2] + [Range(0x52000, 0x53000)]
    more = MAPS + [m(0xd0000, 0xd1000, "r-xp", "/lib/new.so", 11),
                   m(0xd1000, 0xd2000, "rw-p", "/lib/new.so", 11)]
    assert data_ranges(more, []) == first + [Range(0xd1000, 0xd2000)]
    assert classify(more, [], [], []).ranges[-1] == Range(0xd1000, 0xd2000)
    assert [x for x, cls in mapping_classes(more)[0] if cls == "data"][-1] == more[-1]
    assert data_ranges(MAPS, []) == first


def test_a_thread_waiting_for_the_check_keeps_only_the_registers_a_call_preserves():
    from memunreachable._types import REG_NAMES
    from memunreachable.sweep.classify import waiting
    names = ("rbx", "rbp", "r12", "r13", "r14", "r15", "rax", "rcx", "rdx", "rsi", "rdi",
             "r8", "r9", "r10", "r11")
    def thread(tid, orig_rax):
        r = list(regs(0xb0000, fs_base=0x7000, orig_rax=orig_rax))
        for k, name in enumerate(names):
            r[REG_NAMES.index(name)] = 0x100000 + 0x1000 * k
        return ThreadState(tid, tuple(r), struct.pack("<4Q", 0, 0x200000, 0, 0x201000))
    in_wait, running, other = thread(1, 270), thread(2, 0xFFFFFFFFFFFFFFFF), thread(3, 270)
    out = waiting([in_wait, running, other], [1, 2])
    # the waiting thread: callee-saved, sp, fs_base, rip kept; caller-saved gone (and its
    # FP/SIMD state is no root, as for any thread in a syscall)
    kept = {REG_NAMES[k]: v for k, v in enumerate(out[0].regs) if v}
    assert kept == {"rbx": 0x100000, "rbp": 0x101000, "r12": 0x102000, "r13": 0x103000,
                    "r14": 0x104000, "r15": 0x105000, "rsp": 0xb0000, "fs_base": 0x7000,
                    "orig_rax": 270}
    assert 0x200000 not in register_words(out[:1])
    # stopped in user code (not in its wait), or not the requesting thread: whole
    assert out[1] is running and out[2] is other
    for t in (running, other):
        assert set(t.regs) <= set(register_words([t])) | {0}
    assert {0x200000, 0x201000} <= set(register_words(out[1:]))


def test_a_block_only_a_vector_register_holds_is_live_in_user_code_and_leaked_in_a_syscall():
    from memunreachable.sweep.mark import mark
    from tests.unit.test_mark import Heap
    h = Heap([32, 32])
    fp = struct.pack("<2Q", 0, h.addrs[1])
    for orig_rax, marked in ((0xFFFFFFFFFFFFFFFF, [1, 1]), (270, [1, 0])):
        r = list(regs(0xb0000, orig_rax=orig_rax))
        r[5] = h.addrs[0]                               # rbx: live across a call
        t = ThreadState(9, tuple(r), fp)                # in a syscall: zmm leftovers
        assert list(mark(h.image(), [], register_words([t])).marked) == marked


def test_stacks_merged_in_one_mapping_keep_each_block_whole_but_the_dead_stack_below_each_sp():
    # glibc 2.42+: guard pages inside rw-p mappings (MADV_GUARD_INSTALL), so adjacent thread
    # stacks merge: [guard|stack..TCB] blocks of 0x10000 at 0x100000 (a thread running on
    # another stack: its SP is elsewhere, its TCB at fs_base 0x10f700), 0x110000 (no thread:
    # a cached stack) and 0x120000, 0x130000 (two threads with their SPs inside)
    maps = [m(0x100000, 0x140000, "rw-p", ""), m(0x200000, 0x202000, "rw-p", "")]
    threads = [ThreadState(1, regs(0x201000, fs_base=0x10f700)),
               ThreadState(2, regs(0x128000, fs_base=0x12f700)),
               ThreadState(3, regs(0x13c000, fs_base=0x13f700, orig_rax=0))]
    roots = classify(maps, threads, [], [])
    assert roots.ranges == [Range(0x100000, 0x110000),                 # carved: whole block
                            Range(0x128000 - RED_ZONE, 0x130000),      # cached block cut
                            Range(0x13c000, 0x140000),
                            Range(0x201000 - RED_ZONE, 0x202000)]
    assert [roots.kinds[r] for r in roots.ranges] == ["anon", "stack", "stack", "stack"]


def test_guard_pages_bound_each_dead_stack_and_keep_a_cached_block_between_live_ones():
    # the same mapping with the kernel's guard positions (a page at each block's start): the
    # cached block at 0x110000 lies below thread 2's SP; its TCB holds the DTV it still owns
    maps = [m(0x100000, 0x140000, "rw-p", ""), m(0x200000, 0x202000, "rw-p", "")]
    threads = [ThreadState(1, regs(0x201000, fs_base=0x10f700)),
               ThreadState(2, regs(0x128000, fs_base=0x12f700)),
               ThreadState(3, regs(0x13c000, fs_base=0x13f700, orig_rax=0))]
    assert stack_maps(maps, threads) == [(0x100000, 0x140000), (0x200000, 0x202000)]
    guards = {(0x100000, 0x140000): [(b, b + 0x1000) for b in range(0x100000, 0x140000, 0x10000)]}
    roots = classify(maps, threads, [], [], guards=guards)
    assert roots.ranges == [Range(0x100000, 0x121000),                 # carved and cached whole
                            Range(0x128000 - RED_ZONE, 0x131000),      # to the next guard's end
                            Range(0x13c000, 0x140000),
                            Range(0x201000 - RED_ZONE, 0x202000)]
    assert [roots.kinds[r] for r in roots.ranges] == ["anon", "stack", "stack", "stack"]


def test_pagemap_guard_bits_give_the_guard_runs():
    entries = b"".join(struct.pack("<Q", v) for v in
                       [1 << 58, 1 << 58 | 0, 1 << 63, 0, 1 << 58 | 1 << 63, 1 << 62])
    assert guard_runs(entries, 0x10000) == [(0x10000, 0x12000), (0x14000, 0x15000)]


def test_a_lone_thread_stack_is_cut_below_its_sp_as_before():
    maps = [m(0x100000, 0x110000, "rw-p", "")]
    roots = classify(maps, [ThreadState(1, regs(0x108000, fs_base=0x10f700))], [], [])
    assert roots.ranges == [Range(0x108000 - RED_ZONE, 0x110000)]


def test_unmanaged_memory_is_said_from_64_mib_of_anonymous_roots_above_the_heap():
    mib = 1 << 20
    anon, stack, data = Range(0x10000000, 0x10000000 + 80 * mib), Range(0x7000, 0x9000), \
        Range(0x400000, 0x400000 + 200 * mib)
    roots = RootSet(ranges=[stack, data, anon], kinds={anon: "anon", stack: "stack", data: "data"})
    said = unmanaged_memory(roots, 5 * mib)
    assert len(said) == 1 and said[0].startswith(
        "80.0 MiB of anonymous memory outside the heaps this check knows (more than the 5.0 MiB "
        "of allocations it found) was read as roots, never checked as allocations")
    assert "more than the 2.0 KiB of allocations" in unmanaged_memory(roots, 2048)[0]
    assert unmanaged_memory(roots, 80 * mib) == []          # no more than the heap
    small = RootSet(ranges=[Range(0, 63 * mib)], kinds={Range(0, 63 * mib): "anon"})
    assert unmanaged_memory(small, 0) == []                  # under 64 MiB
    assert unmanaged_memory(RootSet(ranges=[data], kinds={data: "data"}), 0) == []  # .data
