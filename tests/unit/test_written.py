"""written.py: the range arithmetic and fresh levels (pure), and a WriteTracker of this very
process (its own userfaultfd and pagemap: no ptrace, no child)."""
import mmap
import ctypes
import os

import pytest

from memunreachable.collect import procfs
from array import array

from memunreachable.sweep.written import (WriteTracker, fresh_levels, merged, open_fd, subtracted,
                                          trackable, unwritten_levels)

P = 4096


def R(*pages):
    """Flat pairs of page numbers: R(0, 10, 20, 30) is [0, 10) and [20, 30)."""
    return array("Q", [p * P for p in pages])


def test_unwritten_levels_give_each_piece_its_oldest_snapshot():
    # snapshot 1 tracked pages 0-10, snapshot 2 tracked 0-20; page 3 written between 1 and 2,
    # page 12 after 2
    got = unwritten_levels([R(0, 10), R(0, 20)], [R(3, 4), R(12, 13)])
    assert got == [(0, 3 * P, 1), (3 * P, 4 * P, 2), (4 * P, 10 * P, 1), (10 * P, 12 * P, 2),
                   (13 * P, 20 * P, 2)]


def test_unwritten_levels_one_snapshot_and_nothing_tracked():
    assert unwritten_levels([R(0, 4)], [R(0, 4)]) == []
    assert unwritten_levels([], []) == []


def test_fresh_levels_the_latest_snapshot_without_the_block_wins():
    begins = [10, 20, 30, 40]
    levels, n = fresh_levels(begins, [[10, 20], [10, 30]])
    # 10 in both; 20 absent from 2; 30 absent from 1 only; 40 absent from both
    assert list(levels) == [0, 2, 1, 2]
    assert n == 3


def test_fresh_levels_reject_unsorted_begins():
    with pytest.raises(ValueError):
        fresh_levels([20, 10], [[10]])


def test_pairs_arithmetic():
    assert list(subtracted(R(0, 10, 20, 30), R(2, 3, 5, 22))) == list(R(0, 2, 3, 5, 22, 30))
    assert list(subtracted(R(0, 10), R())) == list(R(0, 10))
    assert list(merged(R(0, 2), R(2, 5, 7, 8))) == list(R(0, 5, 7, 8))


def test_trackable_keeps_private_writable_mappings():
    maps = procfs.read_maps(os.getpid())
    got = trackable(maps)
    pairs = [(got[j], got[j + 1]) for j in range(0, len(got), 2)]
    assert pairs and pairs == sorted(pairs)
    lines = {(m.begin, m.end): m for m in maps}
    assert all(lines[p].writable and not lines[p].shared for p in pairs)


@pytest.fixture
def tracker():
    fd, why = open_fd()
    if fd < 0:
        pytest.fail(f"this kernel gives no write tracking ({why}); Linux 6.7+ is expected")
    t = WriteTracker(os.getpid(), fd)
    yield t
    t.close()


def test_a_tracker_of_this_process_sees_the_pages_written_between_looks(tracker):
    m = mmap.mmap(-1, 16 * P, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    m[0] = 1                                    # mapped and touched before tracking
    tracker.register(procfs.read_maps(os.getpid()))
    t = tracker.tracked
    assert any(t[j] <= base and base + 16 * P <= t[j + 1] for j in range(0, len(t), 2))
    first = tracker.at_freeze()
    tracker.swept(first, [base + 16])
    m[5 * P] = 1
    m[9 * P + 100] = 2
    second = tracker.at_freeze()
    since = tracker.since(second)
    # (clipped to the mapping: it may have merged with a neighbour, below or above)
    mine = [(max(b, base), min(e, base + 16 * P), lv) for b, e, lv in since.unwritten
            if b < base + 16 * P and e > base]
    assert mine[0][0] == base and all(lv == 1 for *_, lv in mine)
    unwritten_pages = {(a - base) // P for b, e, _ in mine for a in range(b, e, P)}
    assert unwritten_pages == set(range(16)) - {5, 9}
    # the block at base + 16 was there; one at base + 32 is fresh
    levels, n = since.fresh([base + 16, base + 32])
    assert list(levels) == [0, 1] and n == 1
    del m


def test_a_mapping_replaced_under_a_tracked_range_counts_as_written(tracker):
    m = mmap.mmap(-1, 8 * P, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    tracker.register(procfs.read_maps(os.getpid()))
    t = tracker.tracked
    assert any(t[j] <= base and base + 8 * P <= t[j + 1] for j in range(0, len(t), 2))
    first = tracker.at_freeze()
    tracker.swept(first, [])
    # a new mapping at the same place (MAP_FIXED), never registered
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    got = libc.mmap(base, 8 * P, 3, 0x22 | 0x10, -1, 0)    # PROT_RW, PRIVATE|ANON|FIXED
    assert got == base
    second = tracker.at_freeze()
    since = tracker.since(second)
    assert not any(b < base + 8 * P and base < e for b, e, _ in since.unwritten)
    assert tracker.failures >= 1
    del m


def test_arming_alone_stores_nothing_and_counts_the_runs(tracker):
    from memunreachable._ffi import ffi, lib
    m = mmap.mmap(-1, 8 * P, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    assert lib.mu_wt_register(tracker.fd, base, 8 * P) == 0
    assert lib.mu_wt_scan(tracker.pagemap, base, base + 8 * P, ffi.NULL, 0) >= 1   # armed
    m[P] = 1
    m[3 * P] = 1
    assert lib.mu_wt_scan(tracker.pagemap, base, base + 8 * P, ffi.NULL, 0) == 2
    assert lib.mu_wt_scan(tracker.pagemap, base, base + 8 * P, ffi.NULL, 0) == 0
    del m


def test_mappings_another_userfaultfd_holds_cost_no_other(tracker):
    # another tracker of this process (an in-process check's helper of the test run itself)
    # registered every mapping first: they are refused (EBUSY), a new one is still tracked
    fd, _ = open_fd()
    other = WriteTracker(os.getpid(), fd)
    try:
        other.register(procfs.read_maps(os.getpid()))
        m = mmap.mmap(-1, 8 * P, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        tracker.register(procfs.read_maps(os.getpid()))
        t = tracker.tracked
        assert any(t[j] <= base and base + 8 * P <= t[j + 1] for j in range(0, len(t), 2))
        del m
    finally:
        other.close()


def test_no_earlier_swept_snapshot_no_rule(tracker):
    e = tracker.at_freeze()
    since = tracker.since(e)
    assert since.unwritten == [] and since.prevs == []
    assert tracker.since(e + 5) is None


def test_levels_reach_back_to_the_last_but_one_sweep_through_recorded_snapshots(tracker):
    # a batch of the pytest plugin records its waiting snapshots' allocations (full=False)
    # and sweeps once: the sweeps after it count their levels from the sweep before the last,
    # through every snapshot recorded since
    e = [tracker.at_freeze() for _ in range(7)]
    tracker.swept(e[0], [1 << 20])                      # a sweep
    tracker.swept(e[1], [2 << 20], full=False)          # recorded only
    tracker.swept(e[2], [3 << 20], full=False)
    tracker.swept(e[3], [4 << 20])                      # the batch's sweep
    assert [list(p) for p in tracker.since(e[4]).prevs] == [[1 << 20], [2 << 20], [3 << 20],
                                                             [4 << 20]]
    tracker.swept(e[4], [5 << 20])                      # its confirmation: from e[3] on
    assert [list(p) for p in tracker.since(e[5]).prevs] == [[4 << 20], [5 << 20]]
    tracker.swept(e[5], [6 << 20])      # what lies before the last but two sweeps is dropped
    assert sorted(tracker.swept_begins) == [e[3], e[4], e[5]]
    assert min(tracker.looks) == e[3]
