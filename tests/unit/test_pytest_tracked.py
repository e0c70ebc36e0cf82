"""pytest_tracked.py on plain data: epochs, the attribution of a sweep's new leaks to the
tests of its stretch, and the pacing of sweeps."""
from types import SimpleNamespace as NS

from memunreachable import pytest_tracked as pt


def leak(epoch, *held):
    return NS(epoch=epoch, indirect=[NS(epoch=e) for e in held])


def test_epochs_name_test_and_phase():
    assert pt.epoch(1, pt.SETUP) == 5 and pt.epoch(1, pt.CALL) == 6 and pt.epoch(7, pt.TEARDOWN) == 31
    assert pt.split(pt.epoch(12, pt.CALL)) == (12, pt.CALL)
    assert pt.split(None) == (0, pt.OUTSIDE) and pt.split(0) == (0, pt.OUTSIDE)
    assert pt.epoch(1 << 30, pt.OUTSIDE) == 0          # wraps past the table's u32, never 0 ...
    assert pt.epoch((1 << 30) + 1, pt.CALL) == 6       # ... except outside any test


def test_body_leaks_are_the_test_s_fixture_leaks_nobody_s_older_ones_orphans():
    body3, body4 = leak(pt.epoch(3, pt.CALL)), leak(pt.epoch(4, pt.CALL))
    fixture = leak(pt.epoch(4, pt.SETUP))
    older, untracked, between = leak(pt.epoch(1, pt.CALL)), leak(None), leak(0)
    got = pt.attribute([body3, fixture, older, body4, untracked, between], [3, 4, 5])
    assert got.by_test == {3: [body3], 4: [body4]}
    assert got.fixtures == {4: [fixture]}
    assert got.orphans == [older, untracked, between]


def test_a_reused_object_is_blamed_by_the_newest_block_it_holds():
    # a list from CPython's free list (allocated by test 1, or before tracking) whose item
    # array test 5's body allocated: test 5's
    reused = leak(pt.epoch(1, pt.CALL), pt.epoch(5, pt.CALL), None)
    untracked_head = leak(None, pt.epoch(5, pt.CALL))
    got = pt.attribute([reused, untracked_head], [5])
    assert got.by_test == {5: [reused, untracked_head]} and not got.orphans
    assert pt.newest_epoch(leak(None, None)) is None


def test_sweeps_are_paced_by_their_own_cost():
    due = pt.sweep_due
    assert not due(3, None, 0.79, 0.1, False, False)    # tests ran 7.9x a sweep's cost
    assert due(3, None, 0.80, 0.1, False, False)
    assert due(1, None, 0.0, 0.1, True, False)          # the session's last test
    assert due(1, None, 0.0, 0.1, False, True)          # a failure: -x stops at once
    assert due(10, 10, 0.0, 0.1, False, False) and not due(9, 10, 0.0, 0.1, False, False)


def test_summary_lines():
    assert pt.summary_lines([("where", "report\nline 2\n")]) == ["where", "report", "line 2", ""]
