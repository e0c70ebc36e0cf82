"""signal_dump.py: log this process's unreachable memory when a signal arrives.

    enable_signal_dump()          # then: kill -USR2 <pid>
    disable_signal_dump()

The Python-level handler only starts a daemon thread; the check (and its logging) runs
there, so the interrupted code continues at once. A dump that is still running when the
signal comes again is not started twice.
"""
from __future__ import annotations

import logging
import signal
import threading
from typing import Optional

from memunreachable.noleaks import log_unreachable_memory

_state = {"signum": None, "previous": None, "busy": threading.Lock()}


def enable_signal_dump(signum: int = signal.SIGUSR2, log_contents: bool = False,
                       limit: Optional[int] = 100, logger: Optional[logging.Logger] = None) -> None:
    """Install the handler (main thread only, like every Python signal handler)."""
    disable_signal_dump()

    def handler(sig, frame):
        if not _state["busy"].acquire(blocking=False):
            return

        def run():
            try:
                log_unreachable_memory(log_contents=log_contents, limit=limit, logger=logger)
            finally:
                _state["busy"].release()
        threading.Thread(target=run, name="memunreachable-dump", daemon=True).start()

    _state["previous"] = signal.signal(signum, handler)
    _state["signum"] = signum


def disable_signal_dump() -> None:
    """Restore the handler that was there before enable_signal_dump()."""
    if _state["signum"] is not None:
        signal.signal(_state["signum"], _state["previous"] or signal.SIG_DFL)
        _state["signum"] = None
        _state["previous"] = None
