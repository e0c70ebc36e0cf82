"""Unit tests of memory.py: complete reads or MemoryUnreadable; tolerated ranges; overlays;
the snapshot read plan. Reads go through /proc/self/mem (no ptrace, no child)."""
import ctypes
import mmap
import os

import pytest

from memunreachable._errors import MemoryUnreadable
from memunreachable._types import Mapping, Range
from memunreachable.collect.memory import (PAGE, ProcessMemory, SnapshotPlan, lacking_in_fork,
                                           plan_snapshot)

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long)
libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
PROT_READ, PROT_WRITE, MAP_PRIVATE, MAP_ANONYMOUS = 1, 2, 2, 0x20


def m(begin, end, perms="rw-p", path="", offset=0):
    return Mapping(begin, end, perms, offset, "00:00", 0, path)


def addr_of(buf) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


@pytest.fixture
def three_pages_middle_unreadable():
    """3 anonymous pages whose middle one is unmapped (a hole); yields (base, None).
    (A PROT_NONE page would not do: /proc/PID/mem reads it, as a debugger would.)"""
    base = libc.mmap(None, 3 * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    assert base not in (None, ctypes.c_void_p(-1).value)
    ctypes.memset(base, 0x11, PAGE)
    ctypes.memset(base + 2 * PAGE, 0x33, PAGE)
    assert libc.munmap(base + PAGE, PAGE) == 0
    yield base, None
    libc.munmap(base, PAGE)
    libc.munmap(base + 2 * PAGE, PAGE)


def test_readable_memory_reads_exactly():
    data = bytearray(b"memunreachable" * 1000)
    with ProcessMemory(os.getpid()) as mem:
        assert mem.read(addr_of(data), len(data)) == bytes(data)
        assert mem.tolerated_bytes == 0


def test_an_unreadable_page_is_an_error_naming_its_address(three_pages_middle_unreadable):
    base, _ = three_pages_middle_unreadable
    with ProcessMemory(os.getpid()) as mem:
        with pytest.raises(MemoryUnreadable) as ei:
            mem.read(base, 3 * PAGE)
        assert ei.value.address == base + PAGE
        assert f"{base + PAGE:#x}" in str(ei.value)


def test_a_tolerated_page_reads_as_zeros_and_is_counted(three_pages_middle_unreadable):
    base, _ = three_pages_middle_unreadable
    with ProcessMemory(os.getpid(), tolerated=[Range(base + PAGE, base + 2 * PAGE)]) as mem:
        got = mem.read(base, 3 * PAGE)
    assert got == b"\x11" * PAGE + bytes(PAGE) + b"\x33" * PAGE
    assert mem.tolerated_bytes == PAGE


def test_a_tolerated_page_reads_as_zeros_into_a_used_buffer(three_pages_middle_unreadable):
    # use_heap_buffers: the buffer is malloc's memory as it is, holding an earlier sweep's
    # bytes; the tolerated page must not keep them (stale words there could hide a leak)
    base, _ = three_pages_middle_unreadable
    buf = bytearray(b"\xee" * 3 * PAGE)
    with ProcessMemory(os.getpid(), tolerated=[Range(base + PAGE, base + 2 * PAGE)]) as mem:
        mem.read_into(base, buf)
    assert bytes(buf) == b"\x11" * PAGE + bytes(PAGE) + b"\x33" * PAGE


def test_overlays_supply_memory_the_process_cannot_show(three_pages_middle_unreadable):
    base, _ = three_pages_middle_unreadable
    copy = bytearray(b"\x44" * PAGE)
    with ProcessMemory(os.getpid(), overlays=[(base + PAGE, copy)]) as mem:
        got = mem.read(base + PAGE - 16, PAGE + 32)
    assert got == b"\x11" * 16 + b"\x44" * PAGE + b"\x33" * 16


def test_file_pages_past_eof_fail_and_plan_tolerates_them(tmp_path):
    # a 1-page file mapped 3 pages long: pages 2 and 3 are past EOF (SIGBUS for the process)
    path = tmp_path / "short.bin"
    path.write_bytes(b"\x55" * PAGE)
    fd = os.open(path, os.O_RDONLY)
    try:
        base = libc.mmap(None, 3 * PAGE, PROT_READ, MAP_PRIVATE, fd, 0)
    finally:
        os.close(fd)
    lo, hi = base, base + 3 * PAGE
    target = [m(lo, hi, "r--p", str(path))]
    plan = plan_snapshot(target, [(target[0], frozenset())], lambda mp_: os.stat(path).st_size)
    assert plan.tolerated == [Range(base + PAGE, hi)] and plan.missing == []
    with ProcessMemory(os.getpid()) as mem:
        with pytest.raises(MemoryUnreadable) as ei:
            mem.read(base, 3 * PAGE)
        assert ei.value.address == base + PAGE
    with ProcessMemory(os.getpid(), tolerated=plan.tolerated) as mem:
        assert mem.read(base, 3 * PAGE) == b"\x55" * PAGE + bytes(2 * PAGE)
        assert mem.tolerated_bytes == 2 * PAGE
    libc.munmap(base, 3 * PAGE)


def test_plan_finds_dontfork_and_wipeonfork_ranges():
    target = [m(0x10000, 0x20000, path="[heap]"), m(0x30000, 0x40000), m(0x50000, 0x58000),
              m(0x60000, 0x61000, "r--p", "[vvar]"), m(0x70000, 0x71000, "---p")]
    snap = [(target[0], frozenset({"rd", "wr"})),
            (target[2], frozenset({"rd", "wr", "wf"})),
            (target[3], frozenset({"rd", "pf", "io"})),
            (target[4], frozenset())]
    plan = plan_snapshot(target, snap)
    # 0x30000 is absent from the snapshot (MADV_DONTFORK); 0x50000 is wiped (MADV_WIPEONFORK)
    assert plan.missing == [Range(0x30000, 0x40000), Range(0x50000, 0x58000)]
    assert plan.missing_bytes == 0x18000
    assert plan.tolerated == [Range(0x60000, 0x61000)]
    assert any("MADV_DONTFORK" in n for n in plan.notes)
    assert any("MADV_WIPEONFORK" in n for n in plan.notes)


def test_what_a_fork_will_lack_is_read_from_the_targets_own_flags():
    target = [(m(0x10000, 0x20000, path="[heap]"), frozenset({"rd", "wr"})),
              (m(0x30000, 0x40000), frozenset({"rd", "wr", "dc"})),
              (m(0x40000, 0x48000), frozenset({"rd", "wr", "dc"})),      # adjacent: merged
              (m(0x50000, 0x58000), frozenset({"rd", "wr", "wf"})),
              (m(0x60000, 0x61000), frozenset({"rd", "wr", "wf", "dd", "nr", "dp"})),  # getrandom
              (m(0x70000, 0x71000, "---p"), frozenset({"dc"})),          # unreadable
              (m(0x80000, 0x81000, "r--p", "[vvar]"), frozenset({"rd", "dc", "pf", "io"})),
              (m(0x90000, 0x91000, "rw-s", "/dev/zero"), frozenset({"rd", "wr", "sh", "wf"}))]
    ranges, notes = lacking_in_fork(target)
    assert ranges == [Range(0x30000, 0x48000), Range(0x50000, 0x58000)]
    assert notes == ["0x30000-0x40000 (anonymous) is not in the snapshot (MADV_DONTFORK)",
                     "0x40000-0x48000 (anonymous) is not in the snapshot (MADV_DONTFORK)",
                     "0x50000-0x58000 is MADV_WIPEONFORK"]


def test_the_reason_for_missing_memory_counts_the_ranges_it_does_not_name():
    notes = [f"range {i}" for i in range(28)]
    assert SnapshotPlan(notes=notes).why_missing() == "range 0; range 1; range 2; and 25 more"
    assert SnapshotPlan(notes=notes[:3]).why_missing() == "range 0; range 1; range 2"
    assert SnapshotPlan().why_missing() == ""


def test_plan_of_a_complete_snapshot_is_empty():
    target = [m(0x10000, 0x20000, path="[heap]"), m(0x20000, 0x30000)]
    # the snapshot shows the same memory with mappings merged differently
    snap = [(m(0x10000, 0x30000), frozenset({"rd", "wr"}))]
    plan = plan_snapshot(target, snap)
    assert plan.missing == [] and plan.tolerated == []


SMAPS = """\
7f0000000000-7f0000002000 r--p 00000000 fe:00 42   /usr/lib/libx.so
Size:                  8 kB
Anonymous:             0 kB
Swap:                  0 kB
SwapPss:               0 kB
VmFlags: rd mr mw me
7f0000002000-7f0000003000 r--p 00002000 fe:00 42   /usr/lib/libx.so
Anonymous:             4 kB
Swap:                  0 kB
VmFlags: rd mr mw me ac
7f0000003000-7f0000004000 rw-p 00003000 fe:00 42   /usr/lib/libx.so
Anonymous:             0 kB
Swap:                  4 kB
VmFlags: rd wr mr mw me ac
7f0000004000-7f0000005000 rw-s 00000000 fe:00 43   /dev/shm/seg
Anonymous:             0 kB
VmFlags: rd wr sh mr mw me ms
7f0000005000-7f0000006000 rw-p 00000000 00:00 0
Anonymous:             0 kB
VmFlags: rd wr mr mw me ac wf
"""


def test_smaps_flags_mark_mappings_with_anonymous_or_swapped_pages_written():
    from memunreachable.collect.procfs import parse_smaps_flags
    rows = parse_smaps_flags(SMAPS)
    assert [(mp.begin, "written" in f) for mp, f in rows] == [
        (0x7f0000000000, False), (0x7f0000002000, True), (0x7f0000003000, True),
        (0x7f0000004000, False), (0x7f0000005000, False)]
    assert "wf" in rows[4][1] and "ac" in rows[1][1]


def test_plan_cuts_only_private_file_mappings_never_written():
    from memunreachable.collect.procfs import parse_smaps_flags
    rows = parse_smaps_flags(SMAPS)
    plan = plan_snapshot([mp for mp, _ in rows], rows)
    # the untouched r--p piece only: written (resident or swapped) pieces, shared file
    # mappings (written through the file) and anonymous memory stay roots
    assert plan.unwritten == [Range(0x7f0000000000, 0x7f0000002000)]


def test_copied_memory_serves_reads_inside_one_copy_and_delegates_the_rest():
    from memunreachable._types import BufferMemory
    from memunreachable.collect.memory import CopiedMemory
    backing = BufferMemory({0x1000: bytes(range(256)) * 32})
    copy = bytearray(b"\xaa" * 0x100)          # differs from the backing: shows which served
    mem = CopiedMemory(backing, [(0x1400, copy)])
    assert mem.read(0x1410, 4) == b"\xaa" * 4
    assert mem.view(0x1400, 0x100).tobytes() == bytes(copy)
    assert mem.view(0x14f0, 0x20) is None                  # runs past the copy
    assert mem.read(0x14f0, 0x20) == (bytes(range(256)) * 32)[0x4f0:0x510]
    buf = bytearray(8)
    mem.read_into(0x1000, buf)
    assert bytes(buf) == bytes(range(8))


def test_copied_memory_serves_each_address_from_the_last_copy_at_or_below_it():
    # view() tries the copy of its last hit first; the copy it uses must stay the one a
    # search gives (the last one beginning at or below the address), whatever came before
    from memunreachable._types import BufferMemory
    from memunreachable.collect.memory import CopiedMemory
    backing = BufferMemory({0x1000: bytes(0x1000)})
    a, b, c = bytearray(b"a" * 0x200), bytearray(b"b" * 0x40), bytearray(b"c" * 0x40)
    mem = CopiedMemory(backing, [(0x1100, b), (0x1000, a), (0x1100, c)])    # c after b
    for addr, want in [(0x1000, b"a"), (0x1100, b"c"), (0x1010, b"a"), (0x1130, b"c"),
                       (0x1140, None), (0x10f8, b"a"), (0x1108, b"c"), (0x1000, b"a")]:
        v = mem.view(addr, 8)
        assert (v.tobytes() == want * 8) if want else v is None, hex(addr)
    assert mem.view(0x10f8, 16).tobytes() == b"a" * 16      # a holds all of it
    assert mem.view(0x1108, 0x40) is None                   # past c's end: no copy at all
    assert mem.read(0x1108, 8) == b"c" * 8


def test_local_copy_views_a_held_copy_and_reads_the_rest():
    from memunreachable._types import BufferMemory
    from memunreachable.collect.memory import CopiedMemory, local_copy
    backing = BufferMemory({0x1000: bytes(range(256)) * 32})
    copy = bytearray(b"\xaa" * 0x100)
    mem = CopiedMemory(backing, [(0x1400, copy)])
    v = local_copy(mem, 0x1410, 0x20)
    assert isinstance(v, memoryview) and bytes(v) == b"\xaa" * 0x20
    copy[0x10] = 0xbb                                  # a view, not a copy
    assert v[0] == 0xbb
    # across the copy's start: a new buffer, the copy's part from the copy
    part = local_copy(mem, 0x13f0, 0x20)
    assert not isinstance(part, memoryview)
    assert bytes(part) == (bytes(range(256)) * 32)[0x3f0:0x400] + b"\xaa" * 0x10
    assert bytes(local_copy(backing, 0x1000, 4)) == bytes(range(4))


def test_read_copies_skips_unreadable_ranges_only_when_asked(three_pages_middle_unreadable):
    from memunreachable.collect.memory import read_copies
    base, _ = three_pages_middle_unreadable
    # 64 bytes each: local buffers below a page are bytearrays, so no mmap of ours can land
    # in the hole
    ranges = [Range(base, base + 64), Range(base + PAGE, base + PAGE + 64),
              Range(base + 2 * PAGE, base + 2 * PAGE + 64)]
    with ProcessMemory(os.getpid()) as mem:
        got = read_copies(mem, ranges, skip_unreadable=True)
        assert [(b, bytes(buf)[:1]) for b, buf in got] == [(base, b"\x11"), (base + 2 * PAGE, b"\x33")]
        with pytest.raises(MemoryUnreadable):
            read_copies(mem, ranges)


def test_read_many_fills_every_buffer_and_names_each_unreadable_one(three_pages_middle_unreadable):
    from memunreachable._types import local_buffer
    from memunreachable.collect.memory import read_many
    base, _ = three_pages_middle_unreadable
    # 5 MiB of known bytes (more than one 1 MiB piece, read on several threads), a small
    # range, and one range over the hole
    big = bytearray(os.urandom(5 << 20))
    small = bytearray(b"pytest" * 50)
    pairs = [(addr_of(big) + 8, local_buffer(len(big) - 16)),
             (base + PAGE - 64, bytearray(128)),
             (addr_of(small), bytearray(len(small)))]
    with ProcessMemory(os.getpid()) as mem:
        errors = read_many(mem, pairs)
    assert bytes(pairs[0][1]) == bytes(big[8:-8])
    assert bytes(pairs[2][1]) == bytes(small)
    assert errors[0] is None and errors[2] is None
    assert isinstance(errors[1], MemoryUnreadable) and errors[1].address == base + PAGE
    assert bytes(pairs[1][1][:64]) == b"\x11" * 64


def test_read_many_reads_tolerated_ranges_as_read_into_does(three_pages_middle_unreadable):
    from memunreachable.collect.memory import read_many
    base, _ = three_pages_middle_unreadable
    pairs = [(base, bytearray(3 * PAGE)), (base + 2 * PAGE, bytearray(PAGE))]
    with ProcessMemory(os.getpid(), tolerated=[Range(base + PAGE, base + 2 * PAGE)]) as mem:
        assert read_many(mem, pairs) == [None, None]
        assert mem.tolerated_bytes == PAGE
    assert bytes(pairs[0][1]) == b"\x11" * PAGE + bytes(PAGE) + b"\x33" * PAGE
    assert bytes(pairs[1][1]) == b"\x33" * PAGE


def test_heap_buffers_are_zeroed_bytearrays_once_asked(monkeypatch):
    from memunreachable import _types
    monkeypatch.setattr(_types, "_HEAP_BUFFERS", False)
    assert isinstance(_types.local_buffer(1 << 20), mmap.mmap)
    _types.use_heap_buffers()
    buf = _types.local_buffer(1 << 20)
    assert isinstance(buf, bytearray) and len(buf) == 1 << 20 and buf.count(0) == 1 << 20


def test_uncleared_heap_buffers_are_filled_whole_by_reads(monkeypatch):
    from memunreachable import _types
    from memunreachable.collect.memory import read_copies
    monkeypatch.setattr(_types, "_HEAP_BUFFERS", True)
    data = bytearray(os.urandom(3 << 20))
    with ProcessMemory(os.getpid()) as mem:
        got = read_copies(mem, [Range(addr_of(data), addr_of(data) + len(data))])
    [(base, buf)] = got
    assert base == addr_of(data) and len(buf) == len(data) and bytes(buf) == bytes(data)
    assert memoryview(buf).nbytes == len(data) and not memoryview(buf).readonly
    assert not isinstance(buf, (bytearray, mmap.mmap))      # malloc's memory, not zeroed first


def test_copied_memory_small_reads_outside_copies_come_from_cached_pages(
        three_pages_middle_unreadable):
    from memunreachable.collect.memory import CopiedMemory
    base, _ = three_pages_middle_unreadable
    with ProcessMemory(os.getpid()) as pm:
        mem = CopiedMemory(pm, [])
        assert mem.read(base + 100, 16) == b"\x11" * 16
        ctypes.memset(base + 100, 0x22, 16)         # a cached page: the sweep's memory is frozen
        assert mem.read(base + 100, 16) == b"\x11" * 16
        assert list(mem._pages) == [base]
        with pytest.raises(MemoryUnreadable) as ei:    # into the hole: as mem.read says
            mem.read(base + PAGE - 8, 16)
        assert ei.value.address == base + PAGE and mem._pages[base + PAGE] is None
    with ProcessMemory(os.getpid(), tolerated=[Range(base + PAGE, base + 2 * PAGE)]) as pm:
        mem = CopiedMemory(pm, [])
        assert mem.read(base + PAGE - 8, 16) == b"\x11" * 8 + bytes(8)   # not cached: counted
        assert pm.tolerated_bytes == 8 and mem._pages[base + PAGE] is None


def test_unwritten_file_pages_are_the_unwritten_parts_of_file_mappings():
    from memunreachable.collect.memory import unwritten_file_pages
    text = Mapping(0xf000, 0x10000, "r-xp", 0x1000, "08:01", 77, "/lib/x.so")
    lib = Mapping(0x10000, 0x14000, "r--p", 0x2000, "08:01", 77, "/lib/x.so")
    data = Mapping(0x14000, 0x16000, "rw-p", 0x6000, "08:01", 77, "/lib/x.so")
    anon = m(0x16000, 0x18000)
    shared = Mapping(0x18000, 0x19000, "rw-s", 0, "08:01", 78, "/tmp/shm")
    locale = Mapping(0x20000, 0x21000, "r--p", 0, "08:01", 79, "/usr/lib/locale/archive")
    unwritten = [Range(0x11000, 0x15000), Range(0x18000, 0x19000), Range(0x20000, 0x21000)]
    assert unwritten_file_pages([text, lib, data, anon, shared, locale], unwritten) == [
        (Range(0x11000, 0x14000), ("08:01", 77, 0x3000)),
        (Range(0x14000, 0x15000), ("08:01", 77, 0x6000))]


def test_copied_memory_keeps_file_pages_between_sweeps_by_file_identity():
    # the same file page at another address (another process, another sweep) is served from
    # the first read; a page of another file, or outside file_pages, is read from memory
    from memunreachable._types import BufferMemory
    from memunreachable.collect import memory as M

    class Plain(BufferMemory):          # read from the fd alone, as a ProcessMemory says
        __slots__ = ()

        def plain(self, addr, size):
            return True
    M._FILE_PAGES.clear()
    one = M.CopiedMemory(Plain({0x10000: b"n" * 0x2000}), [],
                         [(Range(0x10000, 0x12000), ("08:01", 5, 0x4000))])
    assert one.read(0x11008, 4) == b"nnnn"
    other = Plain({0x30000: b"m" * 0x2000})            # would read "m": the memo answers
    two = M.CopiedMemory(other, [], [(Range(0x30000, 0x32000), ("08:01", 5, 0x4000))])
    assert two.read(0x31008, 4) == b"nnnn"
    assert two.read(0x30008, 4) == b"mmmm"             # file offset 0x4000: not read before
    three = M.CopiedMemory(other, [], [(Range(0x30000, 0x32000), ("08:01", 6, 0x4000))])
    assert three.read(0x31008, 4) == b"mmmm"           # another inode
    assert M.CopiedMemory(other, []).read(0x31008, 4) == b"mmmm"
    M._FILE_PAGES.clear()


def resident_pages(buf) -> list:
    """mincore(2) of an mmap object: 1 per resident page."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    vec = ctypes.create_string_buffer(len(buf) // PAGE)
    assert libc.mincore(addr_of(buf), len(buf), vec) == 0
    return [b & 1 for b in vec.raw]


def test_sparse_reads_release_the_pages_read_as_zeros():
    from memunreachable.collect.memory import read_many
    from memunreachable._types import local_buffer
    src = mmap.mmap(-1, 64 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for page in (0, 7, 8, 63):
        src[page * PAGE + 100] = 0x5A
    src2 = bytearray(b"\x01" * PAGE)
    with ProcessMemory(os.getpid()) as mem:
        for sparse in (False, True):
            dst, dst2 = local_buffer(len(src), zeroed=False), local_buffer(PAGE, zeroed=False)
            assert read_many(mem, [(addr_of(src), dst), (addr_of(src2), dst2)],
                             sparse=sparse) == [None, None]
            want = [int(not sparse or p in (0, 7, 8, 63)) for p in range(64)]
            assert resident_pages(dst) == want      # (before a read maps the zero page there)
            assert dst[:] == src[:] and dst2[:] == src2


def test_plan_of_the_same_inputs_is_kept_and_other_inputs_plan_again():
    from memunreachable.collect.procfs import parse_smaps_flags
    rows = parse_smaps_flags(SMAPS)
    target = [mp for mp, _ in rows]
    size = {0x7f0000000000: 0x10000}
    files = lambda mp_: size.get(mp_.begin, 0x10000)       # noqa: E731
    first = plan_snapshot(target, rows, files)
    again = plan_snapshot(target, rows, files)
    assert again == first and again.unwritten is not first.unwritten      # new lists
    # the untouched mapping written since (an anonymous page): a root again
    written = parse_smaps_flags(SMAPS.replace("Anonymous:             0 kB", "Anonymous: 4 kB", 1))
    assert plan_snapshot(target, written, files).unwritten == []
    # a file shorter now: its pages past the end are tolerated
    size[0x7f0000000000] = 0x1000
    assert Range(0x7f0000001000, 0x7f0000002000) in plan_snapshot(target, rows, files).tolerated
    assert Range(0x7f0000001000, 0x7f0000002000) not in first.tolerated


def test_copied_memory_reads_only_what_no_copy_holds():
    # a range that copies hold in part (the pool scan's window over a whole mapping whose
    # untouched end pages the walk did not copy): the copies' parts come from them, and only
    # the gaps are read from the snapshot
    from memunreachable._types import BufferMemory
    from memunreachable.collect.memory import CopiedMemory
    data = bytes(range(256)) * 32
    reads = []

    class Counting(BufferMemory):
        def read_into(self, addr, buf):
            reads.append((addr, len(memoryview(buf))))
            return super().read_into(addr, buf)

    a, b = bytearray(b"a" * 0x300), bytearray(b"b" * 0x200)    # b overlaps a's end
    mem = CopiedMemory(Counting({0x1000: data}), [(0x1100, a), (0x1300, b), (0x1600, b"c" * 0x10)])
    buf = bytearray(0x800)
    assert mem.read_into(0x1000, buf) == 0
    want = bytearray(data[:0x800])
    want[0x100:0x400] = a
    want[0x400:0x500] = b"b" * 0x100   # b past a's end
    want[0x600:0x610] = b"c" * 0x10
    assert bytes(buf) == bytes(want)
    assert reads == [(0x1000, 0x100), (0x1500, 0x100), (0x1610, 0x1f0)]
    reads.clear()
    buf = bytearray(0x80)              # inside one copy: no read at all
    mem.read_into(0x1180, buf)
    assert bytes(buf) == b"a" * 0x80 and reads == []


# glibc 2.41's getrandom() state page on Linux 6.18 (trixie root), then, for contrast, an
# application's own MADV_WIPEONFORK page (wf only) and its MADV_DONTFORK page (dc: absent from
# the snapshot below)
GETRANDOM_SMAPS = """\
7f60a3cf8000-7f60a3d06000 rw-p 00000000 00:00 0
Anonymous:            12 kB
VmFlags: rd wr mr mw me ac
7f60a3d06000-7f60a3d07000 rw-p 00000000 00:00 0
Size:                  4 kB
Rss:                   4 kB
Anonymous:             4 kB
Swap:                  0 kB
VmFlags: rd wr mr mw me nr wf dd dp
7f60a3e00000-7f60a3e01000 rw-p 00000000 00:00 0
Anonymous:             4 kB
VmFlags: rd wr mr mw me ac wf
7f60a3f00000-7f60a3f10000 rw-p 00000000 00:00 0
Anonymous:            64 kB
VmFlags: rd wr mr mw me ac dc
"""
GETRANDOM_PAGE = Range(0x7f60a3d06000, 0x7f60a3d07000)


def _target_and_snapshot(text: str):
    """(the target's maps, the snapshot's smaps rows) for smaps text: the snapshot lacks the
    mappings marked dc, as a fork does."""
    from memunreachable.collect.procfs import parse_smaps_flags
    rows = parse_smaps_flags(text)
    return [mp for mp, _ in rows], [(mp, f) for mp, f in rows if "dc" not in f]


def test_getrandom_state_is_neither_missing_nor_a_root_nor_a_note():
    target, snap = _target_and_snapshot(GETRANDOM_SMAPS)
    plan = plan_snapshot(target, snap)
    assert plan.no_pointers == [GETRANDOM_PAGE]
    assert GETRANDOM_PAGE in plan.unwritten          # cut from the roots (sweep's unwritten)
    assert not any(r.overlaps(GETRANDOM_PAGE) for r in plan.missing + plan.tolerated)
    assert not any("7f60a3d06000" in n for n in plan.notes)
    # the application's own wipe-on-fork and don't-fork pages: missing (copied during a
    # retake, as before), and roots
    assert plan.missing == [Range(0x7f60a3e00000, 0x7f60a3e01000),
                            Range(0x7f60a3f00000, 0x7f60a3f10000)]
    assert not any(r.overlaps(Range(0x7f60a3e00000, 0x7f60a3f10000)) for r in plan.unwritten)
    assert len(plan.notes) == 2


def test_a_snapshot_that_lacks_only_getrandom_state_lacks_nothing():
    target, snap = _target_and_snapshot(GETRANDOM_SMAPS.split("7f60a3e00000")[0])
    plan = plan_snapshot(target, snap)
    assert plan.missing == [] and plan.missing_bytes == 0 and plan.notes == []
    assert plan.no_pointers == [GETRANDOM_PAGE]


GR_FLAGS = frozenset("rd wr mr mw me nr wf dd dp".split())


@pytest.mark.parametrize("mapping, flags, state", [
    (m(0x1000, 0x2000), GR_FLAGS, True),
    (m(0x1000, 0x2000, path="[anon: glibc: getrandom]"), GR_FLAGS, True),   # decorate_maps
    (m(0x1000, 0x1000 + (16 << 20)), GR_FLAGS, True),                       # merged pages
    (m(0x1000, 0x1000 + (16 << 20) + PAGE), GR_FLAGS, False),               # too big
    (m(0x1000, 0x2000), GR_FLAGS | {"written", "sd"}, True),               # other flags too
    (m(0x1000, 0x2000), GR_FLAGS - {"dp"}, False),      # madvise(WIPEONFORK|DONTDUMP), NORESERVE
    (m(0x1000, 0x2000), GR_FLAGS - {"wf"}, False),      # MADV_KEEPONFORK since: not wiped
    (m(0x1000, 0x2000), GR_FLAGS - {"dd"}, False),
    (m(0x1000, 0x2000), GR_FLAGS - {"nr"}, False),
    (m(0x1000, 0x2000), frozenset("rd wr mr mw me ac wf".split()), False),   # an app's wf page
    (m(0x1000, 0x2000, "rw-s"), GR_FLAGS, False),
    (m(0x1000, 0x2000, "rwxp"), GR_FLAGS, False),
    (m(0x1000, 0x2000, "r--p"), GR_FLAGS, False),
    (m(0x1000, 0x2000, path="[anon: my cache]"), GR_FLAGS, False),
    (Mapping(0x1000, 0x2000, "rw-p", 0, "fe:00", 42, "/tmp/f"), GR_FLAGS, False),
])
def test_is_getrandom_state(mapping, flags, state):
    from memunreachable.collect.memory import is_getrandom_state
    assert is_getrandom_state(mapping, frozenset(flags)) is state


@pytest.mark.parametrize("flags", [GR_FLAGS - {"dp"}, frozenset("rd wr mr mw me ac wf".split())])
def test_other_wipeonfork_memory_is_still_missing(flags):
    page = m(0x7f0000000000, 0x7f0000001000)
    plan = plan_snapshot([page], [(page, flags)])
    assert plan.missing == [page.range] and plan.no_pointers == []
    assert page.range not in plan.unwritten
    assert any("MADV_WIPEONFORK" in n for n in plan.notes)


def test_getrandom_state_is_cut_from_the_roots():
    # the plan's unwritten ranges are what sweep() cuts from the roots (classify's cuts)
    from memunreachable.sweep.classify import classify
    target, snap = _target_and_snapshot(GETRANDOM_SMAPS.split("7f60a3e00000")[0])
    plan = plan_snapshot(target, snap)
    roots = classify(target, [], [], [], plan.unwritten)
    assert roots.ranges and not any(r.overlaps(GETRANDOM_PAGE) for r in roots.ranges)
    assert Range(0x7f60a3cf8000, 0x7f60a3d06000) in roots.ranges


def test_a_reserved_output_is_address_space_until_written(monkeypatch):
    """u64_reserve: 1 TiB of outputs is reserved (no commit charge), written where needed;
    under strict overcommit (where it would be charged in full) and in the in-process helper's
    mode (malloc's buffers) it declines, so the caller falls back."""
    import resource
    from memunreachable import _types
    monkeypatch.setattr(_types, "_STRICT", [False])     # (this machine's mode aside)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = _types.u64_reserve(1 << 37)
    assert out is not None and len(out) == 1 << 37
    out[0], out[(1 << 37) - 1] = 7, 9
    assert (out[0], out[1], out[(1 << 37) - 1]) == (7, 0, 9)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 64 << 10    # KiB
    out.release()
    monkeypatch.setattr(_types, "_STRICT", [True])      # vm.overcommit_memory 2
    assert _types.u64_reserve(1 << 20) is None
    monkeypatch.setattr(_types, "_HEAP_BUFFERS", True)
    assert _types.u64_reserve(1 << 20) is None
