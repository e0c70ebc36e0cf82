"""The snapshot's share of the pause (issue 10): the check record is written before the
freeze (the injection window) and names the clone after the thaw; the record stays exact
on every path."""
import pytest

import fixtures
from memunreachable.collect import leftovers
from memunreachable.collect.freeze import frozen
from memunreachable.collect.snapshot import prepare, take_snapshot
from ptr_helpers import assert_running, children

pytestmark = pytest.mark.ptrace


def _record(sess):
    with open(sess.path, "rb") as f:
        return leftovers.decode_record(f.read())


def test_clone_is_named_in_the_record_after_the_thaw():
    with fixtures.start("ptr_busy") as fx:
        with leftovers.guard(fx.pid) as sess:
            prepare(fx.pid, 2.0)
            window = _record(sess).windows
            assert len(window) == 1
            with frozen(fx.pid) as fz:
                snap = take_snapshot(fz)
                assert snap.mode == "clone" and snap.pid in children(fx.pid)
                # while frozen the record still holds only the window, which covers the clone
                rec = _record(sess)
                assert rec.windows == window and rec.clones == []
                born = leftovers.read_stat(snap.pid).start
                assert window[0][0] <= born <= window[0][1]
            rec = _record(sess)
            assert [c.pid for c in rec.clones] == [snap.pid] and rec.windows == []
            assert [c.pid for c in sess.own] == [snap.pid]
            snap.release()
            assert _record(sess).clones == [] and not snap.zombie_left
            assert snap.pid not in children(fx.pid)
        assert_running(fx.pid)


def test_released_before_the_thaw_still_names_then_forgets_the_clone():
    with fixtures.start("ptr_busy") as fx:
        with leftovers.guard(fx.pid) as sess:
            prepare(fx.pid, 2.0)
            with frozen(fx.pid) as fz:
                snap = take_snapshot(fz)
                snap.release()                  # an error path: released while frozen
                assert sess.injecting is None and sess.own == []
            assert sess.own == [] and _record(sess).clones == []
            assert snap.pid not in children(fx.pid)
        assert_running(fx.pid)


def test_direct_mode_closes_the_window_noted_ahead():
    import os
    import signal
    from ptr_helpers import states, wait_until
    with fixtures.start("ptr_busy") as fx:
        os.kill(fx.pid, signal.SIGSTOP)
        assert wait_until(lambda: set(states(fx.pid).values()) == {"T"})
        with leftovers.guard(fx.pid) as sess:
            prepare(fx.pid, 2.0)
            with frozen(fx.pid) as fz:
                snap = take_snapshot(fz)
                assert snap.mode == "direct"
            assert sess.injecting is None and _record(sess).windows == []
        os.kill(fx.pid, signal.SIGCONT)
        assert_running(fx.pid)


def test_syscall_instruction_check_by_peek_matches_proc_mem():
    from memunreachable.collect.sites import SYSCALL_INSN, after_syscall_insn, read_target
    with fixtures.start("ptr_busy") as fx:
        with frozen(fx.pid) as fz:
            seen = {}
            for tid, _orig_rax, rip in fz.interrupt_stops():
                seen[tid] = after_syscall_insn(fx.pid, tid, rip)
                assert seen[tid] == (read_target(fx.pid, rip - 2, 2) == SYSCALL_INSN)
            assert seen[fx.pid]                                 # main: in read(0)
            assert not seen[fx.expect["busy_tid"]]              # busy: never in a syscall
        assert_running(fx.pid)


def test_the_candidate_mu_freeze_found_is_the_first_the_search_would_take():
    from memunreachable.collect.sites import (RESTORE_RT, SYSCALL_INSN, SYSCALL_RET, choose_thread,
                                              read_target, signed)
    with fixtures.start("ptr_busy", "4") as fx:
        for _ in range(5):
            with frozen(fx.pid) as fz:
                want = next((t, rip - 2) for t, orig_rax, rip in fz.interrupt_stops()
                            if signed(orig_rax) >= 0
                            and read_target(fx.pid, rip - 2, 2) == SYSCALL_INSN)
                assert fz.syscall_candidate() == want
                assert choose_thread(fz, guarded=False) == (want[0], want[1], 0, [])
                # guarded: the same thread, at ld.so's `syscall; ret` with its rt_sigreturn
                tid, gadget, restore_rt, refusals = choose_thread(fz)
                assert (tid, refusals) == (want[0], [])
                assert read_target(fx.pid, gadget, 3) == SYSCALL_RET
                assert read_target(fx.pid, restore_rt, 9) == RESTORE_RT
                assert any(m.begin <= gadget < m.end and "/ld-linux" in m.path for m in fz.maps)
            assert_running(fx.pid)


@pytest.mark.parametrize("clone_action,scope,want_tid", [
    ("allow", "all", "main"),               # mode 2, but the filters allow: the candidate
    ("errno", "main", "other"),             # the main thread's filter refuses clone
])
def test_candidate_under_seccomp_filters(clone_action, scope, want_tid):
    from memunreachable.collect import procfs
    from memunreachable.collect.sites import choose_thread
    with fixtures.start("sec_filter", clone_action, "allow", scope) as fx:
        other = fx.expect["other_tid"]
        with frozen(fx.pid) as fz:
            assert fz.leader_seccomp_mode() == procfs.read_seccomp(fx.pid, fx.pid)[0] == 2
            tid, insn, restore_rt, refusals = choose_thread(fz)
            assert tid == (fx.pid if want_tid == "main" else other) and restore_rt
            assert [v.tid for v in refusals] == ([] if want_tid == "main" else [fx.pid])
        assert fz.leader_seccomp_mode() == -1           # thawed: unknown
        assert_running(fx.pid)
