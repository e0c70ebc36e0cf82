"""Stage 3 against live fixtures: clone snapshot, thaw, release; the target never notices."""
import os
import signal
import time

import pytest

import fixtures
from memunreachable.collect import procfs
from memunreachable._errors import UnsupportedTarget
from memunreachable.collect.freeze import frozen
from memunreachable.collect import leftovers
from memunreachable.collect.snapshot import kill_unseen_clones, take_snapshot
from ptr_helpers import (assert_running, children, moves, oom_score_adj, peek, states,
                         wait_until)

pytestmark = pytest.mark.ptrace


def assert_no_child_left(pid: int, child: int) -> None:
    assert children(pid) == []
    assert not os.path.exists(f"/proc/{child}"), procfs.read_status(child)


def test_clone_snapshot_cycle():
    with fixtures.start("ptr_busy") as fx:
        busy, magic, heap = fx.expect["busy_addr"], fx.expect["magic_addr"], fx.blocks["heap"]
        with frozen(fx.pid) as fz:
            at_freeze = peek(fx.pid, busy)
            snap = take_snapshot(fz)
            assert snap.mode == "clone" and snap.reason == ""
            assert snap.pid != fx.pid and snap.target_pid == fx.pid
            assert 0 < snap.inject_ms < 1000
            fz.thaw()
        with snap:
            assert_running(fx.pid)
            child = procfs.read_status(snap.pid)
            assert (child.state, child.ppid, child.threads) == ("t", fx.pid, 1)
            assert child.tracer_pid == os.getpid()      # pytest's main thread did the tracing
            assert children(fx.pid) == [snap.pid]
            with snap.open_memory() as mem:
                assert int.from_bytes(mem.read(busy, 8), "little") == at_freeze
                assert int.from_bytes(mem.read(magic, 8), "little") == 0x1122334455667788
                assert mem.read(heap.address, 64) == b"\x5a" * 64
                assert moves(fx.pid, busy)              # the target runs on...
                time.sleep(0.02)                        # ...the snapshot does not
                assert int.from_bytes(mem.read(busy, 8), "little") == at_freeze
        assert snap.released and not snap.zombie_left and snap.warnings == []
        assert 0 < snap.reap_pause_ms < 1000 and snap.lifetime_ms > 20
        assert_no_child_left(fx.pid, snap.pid)
        assert_running(fx.pid)
        assert moves(fx.pid, busy) and moves(fx.pid, fx.expect["sleeps_addr"])
        snap.release()          # idempotent
        assert snap.reap_pause_ms > 0


@pytest.mark.parametrize("who", ["main", "sleeper", "waiter", "poller", "busy", "sigthread"])
def test_inject_into_each_kind_of_thread(who):
    # read (ERESTARTSYS), nanosleep (ERESTART_RESTARTBLOCK), futex, poll (ERESTARTNOHAND),
    # a busy loop (no syscall: the [vdso] instruction), pause
    with fixtures.start("ptr_busy") as fx:
        tid = fx.pid if who == "main" else fx.expect[f"{who}_tid"]
        sleeps = fx.expect["sleeps_addr"]
        with frozen(fx.pid) as fz:
            snap = take_snapshot(fz, tid=tid)
            assert snap.mode == "clone" and snap.inject_tid == tid
            fz.thaw()
        with snap:
            assert int.from_bytes(snap.open_memory().read(fx.expect["magic_addr"], 8),
                                  "little") == 0x1122334455667788
        assert_no_child_left(fx.pid, snap.pid)
        assert_running(fx.pid)
        assert moves(fx.pid, sleeps) and moves(fx.pid, fx.expect["busy_addr"])
        os.kill(fx.pid, signal.SIGUSR1)
        assert wait_until(lambda: peek(fx.pid, fx.expect["usr1_addr"]) == 1)
    # leaving the block: read(0) resumed, poll/cond woke normally, no EINTR anywhere


def test_the_snapshot_is_the_oom_killers_first_choice_not_the_target():
    # the snapshot counts the pages it shares with the target as its own: under memory
    # pressure the OOM killer would as soon pick the target
    with fixtures.start("ptr_busy") as fx:
        before = oom_score_adj(fx.pid)
        with frozen(fx.pid) as fz:
            snap = take_snapshot(fz)
            fz.thaw()
        with snap:
            assert snap.mode == "clone"
            assert oom_score_adj(snap.pid) == procfs.OOM_FIRST == 1000
            assert oom_score_adj(fx.pid) == before != 1000
        assert_running(fx.pid)


def test_repeated_snapshots_leave_no_zombies():
    with fixtures.start("ptr_busy", "2", "1") as fx:
        pids = set()
        for _ in range(25):
            with frozen(fx.pid) as fz:
                snap = take_snapshot(fz)
                fz.thaw()
            with snap:
                pids.add(snap.pid)
            assert children(fx.pid) == []
        assert len(pids) == 25
        assert not [p for p in pids if os.path.exists(f"/proc/{p}")]
        assert_running(fx.pid)


def test_keyboard_interrupt_between_snapshot_and_release():
    with fixtures.start("ptr_busy") as fx:
        with pytest.raises(KeyboardInterrupt):
            with frozen(fx.pid) as fz:
                with take_snapshot(fz) as snap:
                    fz.thaw()
                    raise KeyboardInterrupt
        assert snap.released and not snap.zombie_left
        assert_no_child_left(fx.pid, snap.pid)
        assert_running(fx.pid)


def test_release_before_thaw_reaps_through_the_frozen_thread():
    # an error path between the snapshot and the thaw: the zombie is reaped by a second
    # injection into the (still stopped) injected thread
    with fixtures.start("ptr_busy") as fx:
        with pytest.raises(RuntimeError):
            with frozen(fx.pid) as fz:
                with take_snapshot(fz) as snap:
                    raise RuntimeError("sweep failed")
        assert snap.released and not snap.zombie_left and snap.reap_pause_ms == 0
        assert_no_child_left(fx.pid, snap.pid)
        assert_running(fx.pid)


def test_a_clone_whose_birth_was_never_reported_is_found_and_killed():
    """A target killed between clone()'s child and its clone event leaves a child whose pid
    the injection never learnt: traced by this thread, exit_signal 0. kill_unseen_clones finds
    it by those facts alone (here a real clone, treated as unseen) and leaves everything else
    (the target, a clone born before the window) alone."""
    with fixtures.start("ptr_busy") as fx:
        with frozen(fx.pid) as fz:
            old = take_snapshot(fz)
            born_after = leftovers.read_stat(old.pid).start + 1
            while leftovers.now_ticks() <= born_after:
                time.sleep(0.005)
            snap = take_snapshot(fz)
            fz.thaw()
        try:
            assert kill_unseen_clones(fx.pid, born_after, 2.0) == [snap.pid]
            st = leftovers.read_stat(snap.pid)
            assert st is not None and st.state == "Z" and st.ppid == fx.pid   # the target reaps it
            assert leftovers.read_stat(old.pid).state == "t"                  # born before
            assert_running(fx.pid)
        finally:
            snap.release()
            old.release()
        assert_no_child_left(fx.pid, snap.pid)
        assert_running(fx.pid)


@pytest.mark.slow       # ~12 s: the killed target's clone takes that long to go
def test_target_killed_after_thaw_release_is_clean():
    fx = fixtures.start("ptr_busy")
    try:
        with frozen(fx.pid) as fz:
            snap = take_snapshot(fz)
        os.kill(fx.pid, signal.SIGKILL)
        fx.kill()
        snap.release()
        assert snap.released
        assert wait_until(lambda: not os.path.exists(f"/proc/{snap.pid}"))
    finally:
        fx.kill()


def test_seccomp_target_falls_back_to_direct():
    # the filter answers ERRNO(EPERM) for clone: known before injecting (seccomp.py), so no
    # thread is made to call it, even with --allow-seccomp-target (tests/integration/test_seccomp.py)
    with fixtures.start("ptr_seccomp") as fx:
        magic = fx.expect["magic_addr"]
        assert procfs.read_status(fx.pid).seccomp == 2
        with frozen(fx.pid) as fz:
            snap = take_snapshot(fz)
            assert snap.mode == "direct" and snap.pid == fx.pid
            assert snap.reason == ("no thread can run the injected clone and wait4 under its "
                                   f"seccomp rules (thread {fx.pid}: its seccomp filter "
                                   "returns ERRNO(EPERM) for clone)")
            with pytest.raises(UnsupportedTarget) as ei:
                take_snapshot(fz, allow_direct=False)
            assert "--no-fallback" in ei.value.hint
            snap2 = take_snapshot(fz, allow_seccomp=True)
            assert snap2.mode == "direct" and snap2.reason == snap.reason
            with snap2.open_memory() as mem:
                assert int.from_bytes(mem.read(magic, 8), "little") == 0x5eccc0de5eccc0de
            snap2.release()
            assert set(states(fx.pid).values()) == {"t"}      # direct: still frozen
        assert children(fx.pid) == []
        assert_running(fx.pid)


def test_non_dumpable_target_as_root():
    with fixtures.start("ptr_nodump") as fx:
        with frozen(fx.pid) as fz:
            snap = take_snapshot(fz)
            fz.thaw()
        with snap:
            with snap.open_memory() as mem:
                assert int.from_bytes(mem.read(fx.expect["magic_addr"], 8), "little") == \
                    0xbadc0ffee0ddf00d
        assert_no_child_left(fx.pid, snap.pid)
        assert_running(fx.pid)


def test_snapshot_needs_a_frozen_process():
    with fixtures.start("ptr_busy") as fx:
        with frozen(fx.pid) as fz:
            pass
        from memunreachable._errors import CollectionError
        with pytest.raises(CollectionError):
            take_snapshot(fz)
