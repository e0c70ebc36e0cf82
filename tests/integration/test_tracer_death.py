"""The checker SIGKILLed at every step of an injection, into every kind of thread.

native/mu_ptrace.c's fault injection (mu_test_die_at) makes a forked checker kill itself when
the injected clone, or the wait4 that reaps it, reaches a step: registers set, syscall entry,
clone event (the child exists), syscall exit, child parked. With the guard (sigreturn frames on
the thread's stack, docs/how-it-works.md "Tracer death") the target must run on exactly as it was
frozen: ptr_regs' threads compare every general register, xmm/ymm and MXCSR after each syscall
(and without any syscall), ptr_busy's threads fail on an EINTR or a wrong wake-up. No copy of
the target may run: at most one zombie clone (exit_signal 0) is left, and the next check reaps
it and finds the exact leaks.
"""
from __future__ import annotations

import os
import signal

import pytest

import fixtures
from ptr_helpers import assert_running, children, moves, peek, wait_until
from test_leftovers_live import assert_clean, assert_exact
from memunreachable.collect import leftovers
from memunreachable._ffi import lib
from memunreachable.collect.freeze import frozen
from memunreachable.collect.sites import find_guard, stack_takes_frames
from memunreachable.collect.snapshot import prepare, take_snapshot
from memunreachable.unreachable import check

pytestmark = pytest.mark.ptrace

CLONE, WAIT4 = 56, 61
CLONE_STEPS = {"set registers": lib.MU_STEP_SETREGS, "syscall entry": lib.MU_STEP_ENTER,
               "clone event": lib.MU_STEP_EVENT, "syscall exit": lib.MU_STEP_EXIT,
               "child parked": lib.MU_STEP_PARKED}
WAIT4_STEPS = {"set registers": lib.MU_STEP_SETREGS, "syscall entry": lib.MU_STEP_ENTER,
               "syscall exit": lib.MU_STEP_EXIT}


def die_in_check(pid: int, nr: int, step: int, tid: int, guarded: bool = True,
                 pending: int = 0, reap_after_thaw: bool = False) -> tuple:
    """Fork a checker that runs the check's snapshot sequence on pid (record and lock,
    freeze, clone into tid, thaw, release) and SIGKILLs itself when the injection of syscall
    nr reaches step; the reaping wait4 runs into tid too (released before the thaw), or, with
    reap_after_thaw, as a check does it (its own one-thread freeze, the leader); pending:
    a signal sent to tid while it is frozen, so that it is delivered when tid resumes. Returns
    (its wait status, 1 when the guard's gadgets were there to use, else 0)."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        code = 3
        try:
            os.close(r)
            lib.mu_test_die_at(nr, step, 0)
            with leftovers.guard(pid):
                prepare(pid, 2.0)
                with frozen(pid) as fz:
                    os.write(w, b"1" if guarded and find_guard(pid, fz.maps)[1] else b"0")
                    if pending:
                        lib.mu_tgkill(pid, tid, pending)
                    snap = take_snapshot(fz, tid=tid, guarded=guarded)
                    if nr == WAIT4 and not reap_after_thaw:
                        snap.release()
                    fz.thaw()
                snap.release()
        except BaseException:
            code = 4
        os._exit(code)
    os.close(w)
    _, status = os.waitpid(child, 0)
    said = os.read(r, 1)
    os.close(r)
    return status, int(said)


def assert_survived(fx, status: int, counters=()) -> None:
    """The checker died by its own SIGKILL; the target runs on, with no copy of itself running;
    the next check reaps a zombie clone if one is left and is exact."""
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, \
        f"the checker did not die at that step: status {status:#x}"
    assert fx.alive(), f"{fx.name} died: exit {fx.proc.returncode}"
    assert_running(fx.pid)
    for addr in counters:       # the injected thread too is past its injected syscall
        assert moves(fx.pid, addr)
    # a clone that exists is a zombie at once (killed by EXITKILL, or its frame's exit_group)
    assert wait_until(lambda: all((leftovers.read_stat(c) is None
                                   or leftovers.read_stat(c).state == "Z") for c in children(fx.pid)), 2.0), \
        [leftovers.read_stat(c) for c in children(fx.pid)]
    left = children(fx.pid)
    assert len(left) <= 1 and all(leftovers.read_stat(c).exit_signal == 0 for c in left), left
    info = check(fx.pid, limit=None)
    assert_exact(fx, info)
    # the zombie is reaped by the check (a warning names it), or was by the resumed wait4
    reaped = [w for w in info.warnings if w.startswith("reaped 1 snapshot process(es)")]
    assert info.warnings == reaped and len(reaped) <= len(left), (info.warnings, left)
    assert all(f"(pid {c})" in w for w, c in zip(reaped, left))
    assert_clean(fx)


def regs_round(nr: int, step: int, who: str) -> None:
    with fixtures.start("ptr_regs") as fx:
        status, guarded = die_in_check(fx.pid, nr, step, fx.expect[f"{who}_tid"])
        assert guarded == 1, "no guard in ptr_regs"
        assert_survived(fx, status, (fx.expect["spins_addr"], fx.expect["sys_addr"]))
    # leaving the block: every register of both threads was intact to the end, read(0) resumed


@pytest.mark.parametrize("step", sorted(CLONE_STEPS), ids=str)
@pytest.mark.parametrize("who", ["spin", "sys"])
def test_checker_killed_during_the_clone(who, step):
    regs_round(CLONE, CLONE_STEPS[step], who)


@pytest.mark.parametrize("step", sorted(WAIT4_STEPS), ids=str)
@pytest.mark.parametrize("who", ["spin", "sys"])
def test_checker_killed_during_the_reap(who, step):
    regs_round(WAIT4, WAIT4_STEPS[step], who)


@pytest.mark.parametrize("step", sorted(WAIT4_STEPS), ids=str)
def test_checker_killed_during_the_reap_after_the_thaw(step):
    # the check's own order: thaw, then a one-thread freeze of the leader (read(0)) for the
    # wait4; that freeze reads no maps, and the guard once went missing there (a SIGKILL in
    # the wait4 crashed the target with SIGSEGV in a soak)
    with fixtures.start("ptr_regs") as fx:
        status, guarded = die_in_check(fx.pid, WAIT4, WAIT4_STEPS[step], fx.expect["spin_tid"],
                                       reap_after_thaw=True)
        assert guarded == 1
        assert_survived(fx, status, (fx.expect["spins_addr"], fx.expect["sys_addr"]))


# read (ERESTARTSYS), nanosleep (ERESTART_RESTARTBLOCK: issued again whole, never EINTR),
# futex, poll (ERESTARTNOHAND), pause
BUSY_THREADS = ["main", "sleeper", "waiter", "poller", "sigthread"]


@pytest.mark.parametrize("who", BUSY_THREADS)
def test_checker_killed_in_the_syscall_of_each_kind_of_waiting_thread(who):
    with fixtures.start("ptr_busy") as fx:
        tid = fx.pid if who == "main" else fx.expect[f"{who}_tid"]
        status, _ = die_in_check(fx.pid, CLONE, lib.MU_STEP_ENTER, tid)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        assert fx.alive()
        assert_running(fx.pid)
        assert moves(fx.pid, fx.expect["sleeps_addr"]) and moves(fx.pid, fx.expect["busy_addr"])
        os.kill(fx.pid, signal.SIGUSR1)
        assert wait_until(lambda: children(fx.pid) == [] or all(
            leftovers.read_stat(c) is None or leftovers.read_stat(c).state == "Z"
            for c in children(fx.pid)), 2.0)
    # leaving the block: read(0) resumed, poll/cond woke normally, no EINTR anywhere


@pytest.mark.parametrize("step", sorted(CLONE_STEPS), ids=str)
@pytest.mark.parametrize("who", BUSY_THREADS)
def test_checker_killed_at_each_step_in_each_kind_of_waiting_thread(who, step):
    with fixtures.start("ptr_busy") as fx:
        tid = fx.pid if who == "main" else fx.expect[f"{who}_tid"]
        status, _ = die_in_check(fx.pid, CLONE, CLONE_STEPS[step], tid)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        assert fx.alive()
        assert_running(fx.pid)
        assert moves(fx.pid, fx.expect["sleeps_addr"])


def exit_code(pid: int) -> int:
    """The wait status a zombie will give (field 52 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[49])


def test_a_signal_handled_before_the_injected_clone_leaves_the_childs_frame_whole():
    """The checker dies with the injected registers set and a signal pending for the thread:
    the thread first runs its handler (ptr_regs' fills 6 KiB of its stack) below the new rsp,
    then the clone. The child's frame sits above that rsp, so the child still exits cleanly
    (exit status 0, not a crash of a copy of the target), and the thread runs on intact."""
    with fixtures.start("ptr_regs") as fx:
        status, guarded = die_in_check(fx.pid, CLONE, lib.MU_STEP_SETREGS, fx.expect["spin_tid"],
                                       pending=signal.SIGUSR1)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL and guarded
        assert wait_until(lambda: peek(fx.pid, fx.expect["usr1_addr"]) == 1)
        assert wait_until(lambda: len(children(fx.pid)) == 1 and
                          leftovers.read_stat(children(fx.pid)[0]).state == "Z")
        child = children(fx.pid)[0]
        assert exit_code(child) == 0 and leftovers.read_stat(child).exit_signal == 0
        assert_survived(fx, status, (fx.expect["spins_addr"], fx.expect["sys_addr"]))
    # leaving the block: every register of the spinning thread intact after its handler


def test_unguarded_twin_shows_what_the_guard_prevents():
    """The legacy sequence (no sigreturn frames): a checker killed between the injected
    registers and the syscall entry kills the target (EXITKILL) rather than let the clone run
    from corrupted registers. The guard above is what makes the same moment harmless."""
    fx = fixtures.start("ptr_regs")
    try:
        status, guarded = die_in_check(fx.pid, CLONE, lib.MU_STEP_ENTER, fx.expect["spin_tid"],
                                       guarded=False)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        assert guarded == 0
        assert wait_until(lambda: not fx.alive(), 2.0)
        assert fx.proc.returncode == -signal.SIGKILL
    finally:
        fx.kill()


@pytest.mark.parametrize("who,own_stack,guarded", [
    ("spin", True, True), ("sys", True, True),
    ("carved", False, False),       # a stack carved out of an mmap: not glibc's, no guard
    ("edge", True, False),          # glibc's, but no room for the frames: the write fails
])
def test_the_guard_is_used_where_its_frames_fit(who, own_stack, guarded):
    """The guard writes only below the SP of a stack glibc or the kernel made, and only
    where its frames fit; elsewhere the legacy sequence serves, and the snapshot works."""
    with fixtures.start("ptr_regs") as fx:
        tid = fx.expect[f"{who}_tid"]
        with frozen(fx.pid) as fz:
            assert stack_takes_frames(fz, tid) == own_stack
            snap = take_snapshot(fz, tid=tid)
            assert snap.mode == "clone" and snap.inject_tid == tid
            assert bool(snap._inject_out.guarded) == guarded and bool(snap.restore_rt) == guarded
            fz.thaw()
        with snap:
            leak_b = fx.blocks["leak_b"].address
            assert int.from_bytes(snap.open_memory().read(fx.blocks["leak_a"].address, 8),
                                  "little") == leak_b
        assert children(fx.pid) == []
        for key in ("spins_addr", "sys_addr", "carved_addr", "edge_addr"):
            assert moves(fx.pid, fx.expect[key])
    # leaving the block: every register intact, no sleep ended early, read(0) resumed
