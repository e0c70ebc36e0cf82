"""Live: glibc 2.41's vDSO getrandom() state (issue 22) in the trixie root (tests/distros.py;
built when missing). A process that has called getrandom() has a MAP_DROPPABLE page (VmFlags
wf dd nr dp) that a fork snapshot sees zeroed: it holds no pointer, so the check takes one
snapshot, with no warning; an application's own MADV_WIPEONFORK page is still copied during a
second pause (fixtures/getrandom_state.c). The host's glibc (2.36) has no vDSO getrandom."""
from __future__ import annotations

import pytest

import fixtures
from memunreachable.collect import procfs
from memunreachable.collect.memory import is_getrandom_state
from memunreachable.deferred import check_later, sweep_pending
from memunreachable.unreachable import check
from test_check import assert_target_running

pytestmark = [pytest.mark.ptrace, pytest.mark.distro]
ROOT = "trixie"


def _states(pid: int) -> list:
    """The target's droppable wipe-on-fork mappings (the kernel's VmFlags, not the plan's
    rule), after checking that the plan's rule takes each for getrandom state."""
    rows = [(m, f) for m, f in procfs.read_smaps_flags(pid) if {"dp", "wf"} <= f]
    assert all(is_getrandom_state(m, f) for m, f in rows), rows
    return [m.range for m, _ in rows]


def _assert_exact(info, fx) -> None:
    assert {l.address for l in info.leaks} == fx.addresses("leak")
    assert info.num_leaks == fx.expect["num_leaks"] == 1
    assert info.leak_bytes == fx.expect["leak_bytes"]


@pytest.mark.parametrize("mode", ["none", "getrandom"])
def test_getrandom_state_takes_no_retake_and_no_warning(mode):
    with fixtures.start("getrandom_state", mode, root=ROOT) as fx:
        # the premise: glibc mapped the states (one page: 3 threads' states), or nothing
        assert len(_states(fx.pid)) == (mode == "getrandom")
        for _ in range(2):
            info = check(fx.pid, limit=None)
            assert info.snapshot_mode == "clone"
            assert info.retake_counts == {} and info.retries == 0
            assert info.warnings == [] and not info.incomplete
            _assert_exact(info, fx)
        assert_target_running(fx)


def test_own_wipeonfork_page_is_still_copied_during_the_snapshot_s_pause():
    # the program's own MADV_WIPEONFORK page is read from its smaps before the freeze and
    # copied during the one pause (issue 23: no retake); the getrandom page never is
    with fixtures.start("getrandom_state", "wipe", root=ROOT) as fx:
        states = _states(fx.pid)
        assert len(states) == 1
        region = next(int(line.split()[1], 16) for line in fx.lines if line.startswith("region"))
        info = check(fx.pid, limit=None)
        assert info.retake_counts == {} and info.snapshots == 1
        copied = [w for w in info.warnings if "copied from the stopped target" in w]
        # the program's page alone was copied, never the getrandom page
        assert len(copied) == 1 and copied[0].startswith("4096 bytes ")
        assert f"{region:#x}-{region + 4096:#x} is MADV_WIPEONFORK" in copied[0]
        assert f"{states[0].begin:#x}" not in " ".join(info.warnings)
        # live_wiped's only pointer is in the wiped page: reachable, not a leak
        _assert_exact(info, fx)
        assert fx.blocks["live_wiped"].address not in {l.address for l in info.leaks}
        assert_target_running(fx)


def test_a_waiting_snapshot_of_a_getrandom_process_lacks_nothing():
    # check_later (the pytest plugin's baselines): a snapshot that lacks memory cannot wait
    # for its sweep; one that lacks only getrandom state can
    with fixtures.start("getrandom_state", "getrandom", root=ROOT) as fx:
        pending = check_later(fx.pid)
        assert pending is not None and pending.complete()
        info = sweep_pending(pending, limit=None)
        assert info.warnings == []
        _assert_exact(info, fx)
        assert_target_running(fx)
    with fixtures.start("getrandom_state", "wipe", root=ROOT) as fx:
        assert check_later(fx.pid) is None          # its own page: checked at once
        assert_target_running(fx)
