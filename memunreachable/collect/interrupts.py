"""interrupts.py: Stages 1-8 guard: SIGINT, SIGTERM and SIGHUP during a check.

Signals (shared by the whole check, not only the freeze): `interruptible()` installs the
handlers for as long as its outermost block runs (leftovers.guard() wraps a whole check in
it; frozen() nests one), `critical()` defers them while a sequence that must not be cut
runs (a ptrace injection, a kill + reap, a fork). The first signal raises once; later ones
are only recorded, so the unwinding path (thaw, snapshot release, sweeper kill) is never
cut by a second exception. Signals set to SIG_IGN (nohup, background jobs) stay ignored.
Job-control stops (Ctrl-Z) wait while a target is frozen (Signals.frozen, counted by
freeze.Frozen) and stop this process at the thaw (stop_if_pending).
"""
from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Dict, Iterator


class FreezeInterrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived during a check (or a freeze); everything was released.

    The caller should re-raise `signum` (with its original disposition) once it cleaned up."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


CheckInterrupted = FreezeInterrupted    # the name used outside the freeze stage
INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# job control (Ctrl-Z, a background job's terminal I/O): stopping the checker while the target
# is frozen would keep the target stopped as long as the checker is; deferred until the thaw
STOP_SIGNALS = (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)


class Signals:
    """Process-wide signal state of the running check (handlers run in the main thread)."""
    depth = 0           # nesting of interruptible(); handlers installed while > 0
    critical = 0        # nesting of critical(): a signal is only recorded
    pending = 0         # the first signal caught, 0 when none
    raised = False      # FreezeInterrupted was raised for it: never raise again
    old: Dict[int, object] = {}
    frozen = 0          # targets frozen by this process now (Frozen, until its thaw)
    stop_pending = 0    # a STOP_SIGNALS signal that arrived while one was frozen


def _on_signal(signum, frame):
    if not Signals.pending:
        Signals.pending = signum
    if Signals.critical or Signals.raised:
        return
    Signals.raised = True
    raise FreezeInterrupted(Signals.pending)


def _on_stop_signal(signum, frame):
    Signals.stop_pending = signum
    stop_if_pending()          # now, or at the thaw while a target is frozen


def stop_if_pending() -> None:
    """Stop this process now (what the deferred job-control signal would have done), once no
    target is frozen by it any more."""
    if Signals.stop_pending and not Signals.frozen:
        Signals.stop_pending = 0
        os.kill(os.getpid(), signal.SIGSTOP)


def raise_pending() -> None:
    """Raise FreezeInterrupted for a signal deferred by critical() (no-op inside one, or once
    it was raised already)."""
    if Signals.pending and not Signals.raised and not Signals.critical and Signals.depth:
        Signals.raised = True
        raise FreezeInterrupted(Signals.pending)


def interrupted() -> int:
    """The signal caught during the current check, or 0."""
    return Signals.pending


# Installs the SIGINT/SIGTERM/SIGHUP handlers for the outermost block (main thread only; in
# another thread, or for a signal set to SIG_IGN or handled outside Python, nothing changes).
# Raises FreezeInterrupted(signum) at the first signal (after any critical() block ends);
# on leaving the outermost block the previous handlers come back and a signal still pending
# is raised.
@contextmanager
def interruptible() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer = Signals.depth == 0
    if outer:
        Signals.pending, Signals.raised, Signals.old = 0, False, {}
        for signum in INTERRUPT_SIGNALS:
            old = signal.getsignal(signum)
            if old is None or old is signal.SIG_IGN:
                continue
            Signals.old[signum] = old
            signal.signal(signum, _on_signal)
        for signum in STOP_SIGNALS:         # only where they would stop us (SIG_DFL)
            if signal.getsignal(signum) is signal.SIG_DFL:
                Signals.old[signum] = signal.SIG_DFL
                signal.signal(signum, _on_stop_signal)
    Signals.depth += 1
    ok = False
    try:
        yield
        ok = True
    finally:
        Signals.critical += 1      # first statement: nothing may raise while restoring
        Signals.depth -= 1
        pending = Signals.pending
        if outer:
            for signum, old in Signals.old.items():
                signal.signal(signum, old)
            Signals.old, Signals.pending, Signals.raised = {}, 0, False
        Signals.critical -= 1
    if ok and outer and pending:
        raise FreezeInterrupted(pending)


@contextmanager
def critical() -> Iterator[None]:
    """Defer SIGINT/SIGTERM/SIGHUP while the body runs; raise FreezeInterrupted at its end."""
    Signals.critical += 1
    ok = False
    try:
        yield
        ok = True
    finally:
        Signals.critical -= 1
    if ok:
        raise_pending()
