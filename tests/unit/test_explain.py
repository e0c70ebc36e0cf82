"""explain.py: the referrer chain of a reachable block, on in-memory data."""
import pytest
from memunreachable.sweep.explain import explain
from memunreachable.sweep.mark import mark, scanned_blocks
from tests.unit.test_mark import BASE, ROOT, Heap, words_buffer


def test_chain_from_a_root_through_two_blocks():
    h = Heap([32, 32, 32])
    h.link(0, 1, 1)
    h.link(1, 3, 2, delta=8)                    # an interior pointer
    roots = [(ROOT, words_buffer(0, h.addrs[0]))]
    res = mark(h.image(), roots)
    lines = explain(h.addrs[2] + 4, h.image(), roots, res.marked, (),
                    scanned_blocks(h.image(), res.marked))
    assert lines[0] == (f"explain {h.addrs[2] + 4:#x}: not a block start: 4 bytes into allocation "
                        f"{h.addrs[2]:#x} (32 bytes) is reachable; the chain that keeps it:")
    assert (f"word {h.addrs[2] + 8:#x} at {h.addrs[1] + 24:#x} (offset 24) of {h.addrs[1]:#x}"
            in lines[1])
    assert f"word {h.addrs[1]:#x} at {h.addrs[0] + 8:#x} (offset 8) of {h.addrs[0]:#x}" in lines[2]
    assert lines[3].endswith(f"root words at {ROOT + 8:#x}")


def test_blocks_given_as_a_callable_are_read_only_for_a_reachable_block():
    h = Heap([32, 32])
    h.link(0, 1, 1)
    roots = [(ROOT, words_buffer(h.addrs[0]))]
    res = mark(h.image(), roots)
    calls = []

    def blocks():
        calls.append(1)
        return scanned_blocks(h.image(), res.marked)
    assert "not inside" in explain(BASE - 64, h.image(), roots, res.marked, (), blocks)[0]
    assert calls == []
    lines = explain(h.addrs[1], h.image(), roots, res.marked, (), blocks)
    assert calls == [1] and lines[-1].endswith(f"root words at {ROOT:#x}")
    assert lines[0] == (f"explain {h.addrs[1]:#x}: allocation {h.addrs[1]:#x} (32 bytes) is "
                        "reachable; the chain that keeps it:")


def test_unreachable_and_outside_blocks_say_so():
    h = Heap([32])
    res = mark(h.image(), [])
    assert explain(h.addrs[0], h.image(), [], res.marked, (), [])[0] == \
        f"explain {h.addrs[0]:#x}: allocation {h.addrs[0]:#x} (32 bytes) is unreachable (a leak)"
    assert explain(h.addrs[0] + 8, h.image(), [], res.marked, (), [])[0] == \
        (f"explain {h.addrs[0] + 8:#x}: not a block start: 8 bytes into allocation "
         f"{h.addrs[0]:#x} (32 bytes) is unreachable (a leak)")
    assert "not inside any allocation" in explain(BASE - 64, h.image(), [], res.marked, (), [])[0]


def test_scanned_blocks_follow_the_type_rules():
    from memunreachable._ffi import lib
    from memunreachable.sweep.mark import DeadWords
    from tests.unit.test_dead_words import INT_TYPE, SIZED
    h = Heap([80, 16])
    for slot, w in enumerate([0, 0, 1, INT_TYPE]):
        h.point(0, slot, w)
    h.link(0, 8, 1)
    dead = DeadWords(types=[(INT_TYPE, 16 | SIZED | 40 << 16)])    # object ends at 56
    blocks = scanned_blocks(h.image(), bytes([1, 1]), dead)
    assert [(b, len(v)) for b, v in blocks] == [(h.addrs[0], 56), (h.addrs[1], 16)]
    opaque = DeadWords(types=[(INT_TYPE, 16 | lib.MU_TYPE_OPAQUE << 8)])
    assert [b for b, _ in scanned_blocks(h.image(), bytes([1, 1]), opaque)] == [h.addrs[1]]


def test_a_root_word_on_a_stack_names_the_thread_and_its_distance_from_sp():
    from memunreachable._types import RSP_INDEX, ThreadState
    h = Heap([32])
    roots = [(ROOT, words_buffer(0, 0, h.addrs[0]))]
    res = mark(h.image(), roots)
    def thread(tid, sp):
        regs = [0] * 27
        regs[RSP_INDEX] = sp
        return ThreadState(tid, tuple(regs))
    threads = [thread(7, ROOT - 0x100),          # the word lies 0x110 above its SP
               thread(9, ROOT + 0x100)]          # above the word: not its stack
    lines = explain(h.addrs[0], h.image(), roots, res.marked, (), [], threads)
    assert lines[1].endswith(f"root words at {ROOT + 16:#x} (thread 7's stack, SP+0x110)")


def test_gc_link_words_are_not_referrers():
    # block 1 (from a root) links to block 0 from its PyGC_Head (word 1) and refers to it
    # from word 3: with head_word, the chain names word 3, not the link
    h = Heap([32, 32])
    h.link(1, 1, 0)
    h.link(1, 3, 0)
    roots = [(ROOT, words_buffer(h.addrs[1] + 16))]
    res = mark(h.image(), roots)
    blocks = scanned_blocks(h.image(), res.marked)
    lines = explain(h.addrs[0], h.image(), roots, res.marked, (), blocks)
    assert f" at {h.addrs[1] + 8:#x} (offset 8)" in lines[1]
    lines = explain(h.addrs[0], h.image(), roots, res.marked, (), blocks,
                    head_word=bytearray([0, 1]))
    assert f" at {h.addrs[1] + 24:#x} (offset 24)" in lines[1]



def test_a_word_into_a_pygc_head_is_no_referrer_as_in_mark():
    # block 0 is a GC object (its PyGC_Head at word 0): block 1's word 2 points at its head,
    # block 2's word 3 at the object after it. The chain names block 2's word; with only the
    # word into the head, mark leaves block 0 unreachable and explain says so
    from memunreachable.sweep.mark import DeadWords
    h = Heap([48, 32, 32])
    h.link(1, 2, 0)
    h.link(2, 3, 0, delta=16)
    roots = [(ROOT, words_buffer(h.addrs[1], h.addrs[2]))]
    dead = DeadWords(head_word=bytearray([1, 0, 0]))
    res = mark(h.image(), roots, dead=dead)
    assert res.marked[0]
    lines = explain(h.addrs[0], h.image(), roots, res.marked, (),
                    scanned_blocks(h.image(), res.marked, dead), head_word=dead.head_word)
    assert f" at {h.addrs[2] + 24:#x} (offset 24) of {h.addrs[2]:#x}" in lines[1], lines
    h.point(2, 3, 0)
    res = mark(h.image(), roots, dead=dead)
    assert not res.marked[0]
    lines = explain(h.addrs[0], h.image(), roots, res.marked, (),
                    scanned_blocks(h.image(), res.marked, dead), head_word=dead.head_word)
    assert lines == [f"explain {h.addrs[0]:#x}: allocation {h.addrs[0]:#x} (48 bytes) is "
                     "unreachable (a leak)"]
    # a root word into the head: no root either (a marked block's chain found elsewhere)
    roots2 = [(ROOT, words_buffer(h.addrs[0] + 8, h.addrs[2])),
              (ROOT + 64, words_buffer(h.addrs[0] + 16))]
    res = mark(h.image(), roots2, dead=dead)
    lines = explain(h.addrs[0], h.image(), roots2, res.marked, (),
                    scanned_blocks(h.image(), res.marked, dead), head_word=dead.head_word)
    assert lines[1].endswith(f"root words at {ROOT + 64:#x}"), lines

def test_a_root_word_in_a_file_mapping_names_the_file_and_offset():
    from memunreachable._types import Mapping
    h = Heap([32])
    roots = [(ROOT, words_buffer(0, h.addrs[0]))]
    res = mark(h.image(), roots)
    maps = [Mapping(begin=ROOT, end=ROOT + 0x1000, perms="rw-p", offset=0x3000, dev="08:01",
                    inode=7, path="/usr/lib/libx.so")]
    lines = explain(h.addrs[0], h.image(), roots, res.marked, (), [], maps=maps)
    assert lines[1].endswith(f"root words at {ROOT + 8:#x} (/usr/lib/libx.so+0x3008)")


def test_a_root_word_is_named_by_its_file_or_the_bss_after_it():
    from memunreachable._types import Mapping
    from memunreachable.sweep.explain import _in_file
    lib = "/usr/lib/libpython3.11.so.1.0"
    maps = [Mapping(0x1000, 0x3000, "r--p", 0, "08:01", 7, lib),
            Mapping(0x3000, 0x4000, "rw-p", 0x2000, "08:01", 7, lib),
            Mapping(0x4000, 0x6000, "rw-p", 0, "00:00", 0, ""),       # its .bss
            Mapping(0x7000, 0x8000, "rw-p", 0, "00:00", 0, ""),       # not adjacent: anonymous
            Mapping(0x9000, 0xa000, "rw-p", 0, "00:00", 0, "[stack]")]
    assert _in_file(0x3010, maps) == f" ({lib}+0x2010)"
    assert _in_file(0x4ca0, maps) == f" ({lib} .bss +0xca0)"
    assert _in_file(0x7010, maps) == ""
    assert _in_file(0x9010, maps) == ""
    assert _in_file(0xb000, maps) == ""


def test_a_block_held_by_a_register_names_the_register_or_the_fp_state_offset():
    import struct
    from memunreachable._types import REG_NAMES, ThreadState
    h = Heap([32, 32])
    regs = [0] * 27
    regs[REG_NAMES.index("orig_rax")] = 0xFFFFFFFFFFFFFFFF     # in user code
    regs[REG_NAMES.index("rbx")] = h.addrs[0] + 8
    fp = bytes(0x40) + struct.pack("<Q", h.addrs[1]) + bytes(8)
    t = ThreadState(5, tuple(regs), fp)
    words = [h.addrs[0] + 8, h.addrs[1]]
    res = mark(h.image(), [], words)
    assert list(res.marked) == [1, 1]
    assert explain(h.addrs[0], h.image(), [], res.marked, (), [], [t])[1].endswith(
        "<- register rbx of thread 5")
    assert explain(h.addrs[1], h.image(), [], res.marked, (), [], [t])[1].endswith(
        "<- FP/SIMD state +0x40 of thread 5")


@pytest.mark.parametrize("into, listed", [(0, True), (16, True), (24, False), (40, False)])
def test_scanned_blocks_list_an_ints_value_only_where_the_mark_takes_it_as_a_handle(into, listed):
    # an int's value is a handle at most MU_HANDLE_SLACK bytes into a block, as in mu_mark
    import struct
    from memunreachable.sweep.mark import DeadWords
    from tests.unit.test_dead_words import INT_CODE, INT_TYPE, int_heap
    h = int_heap(lambda h: h.addrs[1] + into, "lv_tag")
    dead = DeadWords(types=[(INT_TYPE, INT_CODE["lv_tag"])])
    blocks = scanned_blocks(h.image(), bytes([1, 1]), dead)
    values = [struct.unpack("<Q", v)[0] for b, v in blocks if b != h.addrs[1]]
    assert values == ([h.addrs[1] + into] if listed else [])
    assert list(mark(h.image(), [], [h.addrs[0]], dead=dead).marked) == [1, int(listed)]


def test_a_stack_root_word_names_the_nearest_return_address_above_it():
    # the nearest word above the root word that points into a file's code: a return address
    import struct
    import memunreachable._native as native
    from memunreachable._types import RSP_INDEX, BufferMemory, Mapping, ThreadState
    from memunreachable.stacks.symbolize import read_function_symbols
    so = native.__file__
    vaddr = next(a for a, names in read_function_symbols(so).items() if "mu_scrub_stack" in names)
    code = 0x7E00_0000_0000
    stack = bytearray(8192)
    h = Heap([32])
    struct.pack_into("<Q", stack, 16, h.addrs[0])          # the root word, at ROOT + 16
    struct.pack_into("<Q", stack, 16 + 0x30, code + vaddr + 5)   # a return address above it
    roots = [(ROOT, bytes(stack[:24]))]
    res = mark(h.image(), roots)
    regs = [0] * 27
    regs[RSP_INDEX] = ROOT
    maps = [Mapping(code, code + 0x100000, "r-xp", 0, "08:01", 1, so),
            Mapping(ROOT, ROOT + len(stack), "rw-p", 0, "00:00", 0, "[stack]")]
    lines = explain(h.addrs[0], h.image(), roots, res.marked, (), [],
                    [ThreadState(7, tuple(regs))], maps=maps,
                    mem=BufferMemory({ROOT: bytes(stack)}))
    assert lines[1].endswith(f"root words at {ROOT + 16:#x} (thread 7's stack, SP+0x10, "
                             "0x30 below a return address into mu_scrub_stack)")
    # without the memory to read: the thread and distance only
    lines = explain(h.addrs[0], h.image(), roots, res.marked, (), [],
                    [ThreadState(7, tuple(regs))], maps=maps)
    assert lines[1].endswith("(thread 7's stack, SP+0x10)")


def test_an_int32_pair_past_a_4_gib_boundary_is_no_referrer_as_in_mark():
    from tests.unit.test_mark import SPAN
    h = Heap([0x2000], base=SPAN - 0x1000)
    roots = [(ROOT, words_buffer(SPAN | 6, SPAN - 0x1000 + 8))]
    res = mark(h.image(), roots)
    lines = explain(h.addrs[0], h.image(), roots, res.marked, (),
                    scanned_blocks(h.image(), res.marked))
    assert lines[-1].endswith(f"root words at {ROOT + 8:#x}")     # not ROOT's pair word


def test_an_8_aligned_text_tail_needs_two_words_of_text_before_it_as_in_mark():
    from memunreachable.sweep.explain import text_tail
    from tests.unit.test_mark import TEXT
    tail = 0x7F9E_9400_2970             # "p)", a NUL, an old pointer's high bytes: 8-aligned
    assert text_tail(TEXT, tail, TEXT)
    assert not text_tail(TEXT, tail, None) and not text_tail(TEXT, tail, 0x7F9E_9400_1000)
    assert text_tail(TEXT, tail + 1) and not text_tail(0x1234, tail + 1)
