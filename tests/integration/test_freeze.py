"""Stage 2 against live fixtures: freeze every thread, capture, thaw; nothing left behind."""
import os
import signal
import time

import pytest

import fixtures
from memunreachable.collect import procfs, tracees
from memunreachable._errors import CollectionError, NoSuchProcess
from memunreachable.collect.freeze import frozen
from memunreachable.collect.interrupts import FreezeInterrupted
from memunreachable.collect.snapshot import take_snapshot
from ptr_helpers import assert_running, moves, peek, states, wait_until

pytestmark = pytest.mark.ptrace


@pytest.fixture
def default_sigint():
    """SIGINT handled as in an interactive Python: a suite started as a background job (nohup,
    `cmd &` in a script, some CI runners) begins with it ignored, which freeze respects."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_freeze_captures_and_thaws(default_sigint):
    with fixtures.start("ptr_busy") as fx:
        busy = fx.expect["busy_addr"]
        with frozen(fx.pid) as fz:
            assert len(fz.threads) == fx.expect["threads"] == 6
            assert [t.tid for t in fz.threads] == procfs.list_tasks(fx.pid)
            assert set(states(fx.pid).values()) == {"t"}
            assert {fz.stop_kind(t.tid) for t in fz.threads} == {"interrupt"}
            for t in fz.threads:
                assert len(t.regs) == 27 and t.stop_signal == 0
                assert len(t.fpregs) >= 512
                # the stack pointer lies in a readable, writable mapping
                assert any(m.begin <= t.sp < m.end and m.writable for m in fz.maps)
                # glibc's TCB points to itself at fs_base+16 (tcbhead_t.self)
                assert peek(fx.pid, t.fs_base + 16) == t.fs_base
            assert any(m.path == "[heap]" for m in fz.maps)
            v = peek(fx.pid, busy)
            time.sleep(0.03)
            assert peek(fx.pid, busy) == v, "a frozen thread kept running"
        assert fz.thawed and fz.pause_ms > 0
        assert fz.thaw() == fz.pause_ms      # idempotent
        assert_running(fx.pid)
        assert moves(fx.pid, busy) and moves(fx.pid, fx.expect["sleeps_addr"])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_64_threads():
    with fixtures.start("ptr_busy", "58") as fx:
        assert fx.expect["threads"] == 64
        with frozen(fx.pid) as fz:
            assert len(fz.threads) == 64
            assert set(states(fx.pid).values()) == {"t"}
        assert_running(fx.pid)
        assert moves(fx.pid, fx.expect["busy_addr"])


def test_threads_created_during_freeze():
    # a churning thread creates and joins threads all the time: each freeze must catch
    # every thread that exists while frozen (TRACECLONE + re-listing)
    with fixtures.start("ptr_busy", "2", "1") as fx:
        churned = fx.expect["churned_addr"]
        for _ in range(20):
            with frozen(fx.pid) as fz:
                live = procfs.list_tasks(fx.pid)
                assert [t.tid for t in fz.threads] == live
                assert set(states(fx.pid).values()) == {"t"}
                c = peek(fx.pid, churned)
            assert_running(fx.pid)
            assert wait_until(lambda: peek(fx.pid, churned) > c)


def test_signal_arriving_between_seize_and_interrupt_is_redelivered():
    with fixtures.start("ptr_busy") as fx:
        usr1, sigtid = fx.expect["usr1_addr"], fx.expect["sigthread_tid"]

        def on_attach(tid):
            if tid == sigtid:
                os.kill(fx.pid, signal.SIGUSR1)   # only sigthread has SIGUSR1 unblocked
                # let it reach its signal-delivery-stop before the INTERRUPT
                assert wait_until(lambda: procfs.task_state(fx.pid, tid) == "t", 2.0)

        with frozen(fx.pid, on_attach=on_attach) as fz:
            stops = {t.tid: t.stop_signal for t in fz.threads}
            assert fz.stop_kind(sigtid) == "signal"
            assert stops[sigtid] == signal.SIGUSR1
            assert sum(1 for s in stops.values() if s) == 1
            assert peek(fx.pid, usr1) == 0
        assert wait_until(lambda: peek(fx.pid, usr1) == 1)
        time.sleep(0.05)
        assert peek(fx.pid, usr1) == 1
        assert_running(fx.pid)


def test_signal_sent_while_frozen_is_delivered_after_thaw():
    with fixtures.start("ptr_busy") as fx:
        usr1 = fx.expect["usr1_addr"]
        with frozen(fx.pid):
            os.kill(fx.pid, signal.SIGUSR1)
            time.sleep(0.02)
            assert peek(fx.pid, usr1) == 0
        assert wait_until(lambda: peek(fx.pid, usr1) == 1)
        assert_running(fx.pid)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_sigint_sigterm_in_body_thaw_and_restore_handlers(signum, default_sigint):
    before = signal.getsignal(signum)
    with fixtures.start("ptr_busy") as fx:
        with pytest.raises(FreezeInterrupted) as ei:
            with frozen(fx.pid):
                os.kill(os.getpid(), signum)
                time.sleep(1.0)     # the handler raises long before this ends
        assert ei.value.signum == signum
        assert isinstance(ei.value, KeyboardInterrupt)
        assert signal.getsignal(signum) is before
        assert_running(fx.pid)


def test_sigterm_during_the_freeze_itself_is_deferred_then_raised():
    with fixtures.start("ptr_busy") as fx:
        sent = []

        def on_attach(tid):
            if not sent:
                sent.append(tid)
                os.kill(os.getpid(), signal.SIGTERM)

        with pytest.raises(FreezeInterrupted) as ei:
            with frozen(fx.pid, on_attach=on_attach):
                pytest.fail("the body must not run after a SIGTERM during the freeze")
        assert ei.value.signum == signal.SIGTERM and sent == [fx.pid]
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert_running(fx.pid)


def test_exception_in_body_thaws():
    with fixtures.start("ptr_busy") as fx:
        with pytest.raises(ZeroDivisionError):
            with frozen(fx.pid):
                1 / 0
        assert_running(fx.pid)
        assert moves(fx.pid, fx.expect["busy_addr"])


def test_thread_in_vfork_times_out_and_is_released_later():
    with fixtures.start("ptr_vfork", "2500") as fx:
        forker = fx.expect["forker_tid"]
        t0 = time.monotonic()
        with pytest.raises(CollectionError) as ei:
            with frozen(fx.pid, timeout=0.3):
                pytest.fail("froze a thread in vfork")
        assert time.monotonic() - t0 < 2.0
        assert f"thread {forker} " in str(ei.value) and "state D" in str(ei.value)
        assert procfs.task_state(fx.pid, fx.pid) == "S"       # the main thread runs again
        assert procfs.read_status(fx.pid, fx.pid).tracer_pid == 0
        # the forker stops once its vfork child exits; release_pending() lets it go
        assert tracees.release_pending(timeout=10.0) == 0
        assert_running(fx.pid)


def test_job_control_stopped_process_stays_stopped():
    with fixtures.start("ptr_busy") as fx:
        os.kill(fx.pid, signal.SIGSTOP)
        assert wait_until(lambda: set(states(fx.pid).values()) == {"T"})
        with frozen(fx.pid) as fz:
            assert {fz.stop_kind(t.tid) for t in fz.threads} == {"group"}
            snap = take_snapshot(fz)
            assert snap.mode == "direct" and "interrupt stop" in snap.reason
        assert wait_until(lambda: set(states(fx.pid).values()) == {"T"})
        for tid in procfs.list_tasks(fx.pid):
            assert procfs.read_status(fx.pid, tid).tracer_pid == 0
        os.kill(fx.pid, signal.SIGCONT)
        assert_running(fx.pid)


def test_target_killed_during_freeze():
    fx = fixtures.start("ptr_busy")
    try:
        with pytest.raises(NoSuchProcess):
            with frozen(fx.pid, on_attach=lambda tid: os.kill(fx.pid, signal.SIGKILL)):
                pytest.fail("froze a killed process")
        assert wait_until(lambda: not os.path.exists(f"/proc/{fx.pid}/status")
                          or procfs.read_status(fx.pid).state in ("Z", "X"))
    finally:
        fx.kill()


def test_target_killed_while_frozen_thaws_cleanly():
    fx = fixtures.start("ptr_busy")
    try:
        with pytest.raises(NoSuchProcess):
            with frozen(fx.pid) as fz:
                os.kill(fx.pid, signal.SIGKILL)
                take_snapshot(fz)
        assert fz.thawed
    finally:
        fx.kill()


def test_thaw_from_another_thread_is_refused():
    import threading
    with fixtures.start("ptr_busy") as fx:
        with frozen(fx.pid) as fz:
            errors = []
            th = threading.Thread(target=lambda: errors.append(_try(fz.thaw)))
            th.start()
            th.join()
            assert isinstance(errors[0], CollectionError)
            assert not fz.thawed
        assert_running(fx.pid)


def _try(fn):
    try:
        fn()
    except Exception as exc:
        return exc
