"""deferred.check_later / sweep_pending: a snapshot taken now, swept later or never (the
plugin's deferred baselines). The fixture's memory is changed between the two through
/proc/PID/mem, so the sweep must show the moment of the snapshot, not the present."""
from __future__ import annotations

import struct

import pytest

import fixtures
from memunreachable.collect import procfs
from memunreachable.deferred import check_later, sweep_pending
from memunreachable.unreachable import check
from ptr_helpers import wait_until
from test_check import assert_target_running, children_of

pytestmark = pytest.mark.ptrace


def _word_slot(pid: int, value: int) -> int:
    """The address of the one 8-aligned word equal to value in the writable mappings of the
    target's executable (live_data's g_data)."""
    exe = procfs.read_maps(pid)
    path = next(m.path for m in exe if m.path)
    slots = []
    with open(f"/proc/{pid}/mem", "rb") as mem:
        for m in exe:
            if m.path == path and "w" in m.perms:
                mem.seek(m.begin)
                data = mem.read(m.end - m.begin)
                slots += [m.begin + i for i in range(0, len(data) - 7, 8)
                          if struct.unpack_from("<Q", data, i)[0] == value]
    assert len(slots) == 1, f"g_data not found once: {slots}"
    return slots[0]


def _poke(pid: int, address: int, value: int) -> None:
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        mem.seek(address)
        mem.write(struct.pack("<Q", value))


def _deferred(pid: int, **kw):
    """check_later(pid) once the target's thread is back in its read: right after a check's
    thaw, a loaded machine may not have run it yet, and a thread stopped in libc outside a
    system call may be inside malloc, so check_later declines (None; 2 of 200 with every CPU
    busy), as it should. The plugin's helper waits the same way (_tracer.py)."""
    def in_read():
        with open(f"/proc/{pid}/syscall") as f:
            return f.read().split()[0] == "0"
    assert wait_until(in_read), "the fixture never got back to its read"
    return check_later(pid, **kw)


def test_a_snapshot_swept_later_shows_the_moment_it_was_taken():
    with fixtures.start("live_data") as fx:
        live = fx.blocks["live_data"].address
        slot = _word_slot(fx.pid, live)
        pending = check_later(fx.pid)
        assert pending is not None, "an idle single-threaded target is always deferrable"
        try:
            assert children_of(fx.pid) == [(pending.snap.pid, "t")]     # waiting, stopped
            _poke(fx.pid, slot, 0)          # the live block loses its only reference
            # a check meanwhile (nested in the waiting snapshot's lock) sees the present
            now = check(fx.pid, limit=None)
            assert {l.address for l in now.leaks} == fx.addresses("leak_") | {live}
            then = sweep_pending(pending, limit=None)
            assert {(l.address, l.size) for l in then.leaks} == {
                (b.address, b.size) for b in fx.block_list("leak_")}
            assert then.num_leaks == fx.expect["num_leaks"] and then.pause_ms > 0
        finally:
            pending.release()
            _poke(fx.pid, slot, live)
        assert_target_running(fx)       # no snapshot process left, no thread stopped
        assert check(fx.pid, limit=None).num_leaks == fx.expect["num_leaks"]


def test_a_snapshot_never_swept_is_released_whole():
    with fixtures.start("leak_five") as fx:
        for _ in range(3):              # the lock is dropped too: the next one can be taken
            pending = _deferred(fx.pid)
            assert pending is not None and children_of(fx.pid) == [(pending.snap.pid, "t")]
            pending.release()
            pending.release()           # idempotent
            assert_target_running(fx)
        info = check(fx.pid, limit=None)
        assert {l.address for l in info.leaks} == fx.addresses("leak")


def test_a_process_above_the_size_limit_is_not_deferred(monkeypatch):
    # each page the target writes while a snapshot waits is copied: past DEFER_MAX_RSS of
    # resident anonymous memory the caller sweeps at once (check_later says None)
    from memunreachable import deferred
    with fixtures.start("leak_five") as fx:
        rss = procfs.read_rss_anon(fx.pid)
        assert rss > 0
        monkeypatch.setattr(deferred, "DEFER_MAX_RSS", rss - 1)
        assert check_later(fx.pid) is None
        assert_target_running(fx)
        monkeypatch.setattr(deferred, "DEFER_MAX_RSS", rss + (64 << 20))
        pending = _deferred(fx.pid)
        assert pending is not None
        pending.release()
        assert_target_running(fx)


def test_a_snapshot_planned_later_is_swept_the_same_or_says_what_it_lacks():
    # plan_later: the smaps read that tells whether the snapshot lacks memory waits for
    # Pending.complete() (the helper's, once its reply is sent); a sweep calls it first
    from memunreachable._errors import CollectionError
    with fixtures.start("leak_five") as fx:
        pending = _deferred(fx.pid, plan_later=True)
        assert pending is not None and pending.plan is None
        info = sweep_pending(pending, limit=None)
        assert {l.address for l in info.leaks} == fx.addresses("leak")
        assert_target_running(fx)
    with fixtures.start("dontfork", "dontfork", "64") as fx:
        assert check_later(fx.pid) is None          # planned at once: checked at once
        pending = _deferred(fx.pid, plan_later=True)
        assert pending is not None
        try:
            assert not pending.complete() and "MADV_DONTFORK" in pending.lacking
            with pytest.raises(CollectionError, match="lacks memory .*MADV_DONTFORK"):
                sweep_pending(pending, limit=None)
        finally:
            pending.release()
        assert_target_running(fx)
