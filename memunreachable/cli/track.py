"""cli/track.py: `memunreachable track PID` and `memunreachable track --stop PID`.

Starts (or stops) recording allocation stacks in a running glibc process (track_pid.py):
afterwards `check PID` shows the stack of each leak allocated since. Prints one line saying
what was done; errors are raised, never printed here (cli.main(): exit 3 with a hint).
"""
from __future__ import annotations

import argparse
import time

from memunreachable.cli import EXIT_OK, Command
from memunreachable.cli.check import pid_type, timeout_type


def clock(started) -> str:
    """HH:MM:SS (local time) of a Unix time, "an unknown time" for None."""
    return time.strftime("%H:%M:%S", time.localtime(started)) if started else "an unknown time"


def describe(result) -> str:
    """The line `track` prints for a track_pid.Result."""
    who = f"process {result.pid}" + (f" ({result.name})" if result.name else "")
    paused = (f"every thread paused {result.others_ms:.1f} ms, then thread {result.tid} "
              f"{result.pause_ms:.1f} ms for the calls")
    if result.action == "started":
        python = ("; Python objects' too once the interpreter next runs Python code"
                  if result.python else "")
        return (f"tracking allocations of {who} since {clock(result.started)}: `memunreachable "
                f"check {result.pid}` shows the stack of each leak allocated from now on"
                f"{python}; `memunreachable track --stop {result.pid}` ends it ({paused})")
    if result.action == "already":
        return f"{who} is already tracked (since {clock(result.started)}): nothing changed"
    if result.action == "stopped":
        return (f"stopped tracking allocations of {who}: every routed entry was put back (the "
                f"library stays loaded, inert; {paused})")
    return f"{who} is not tracked: nothing to stop"


class Track(Command):
    """Start recording allocation stacks in a running process (no restart); --stop ends it.

    Loads memunreachable's tracking library into the process (an injected dlopen) and routes
    its malloc family through it: from then on `memunreachable check PID` shows the
    allocation stack of each leak allocated since. Blocks allocated before have none.
    `track --stop PID` puts every routed entry back; the library stays loaded, inert.
    Running it again on a tracked process changes nothing.
    """

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("pid", type=pid_type, metavar="PID",
                            help="the process (a running, dynamically linked glibc program)")
        parser.add_argument("--stop", action="store_true",
                            help="stop tracking: put back every entry `track` routed")
        parser.add_argument("--python-objects", action="store_true",
                            help="CPython targets: record the stacks of Python objects too "
                                 "(their object allocator is routed; costs more)")
        parser.add_argument("--timeout", type=timeout_type, default=2.0, metavar="SECONDS",
                            help="how long freezing the threads may take (default 2)")

    def run(self, args: argparse.Namespace) -> int:
        from memunreachable import track_pid

        if args.stop:
            result = track_pid.stop(args.pid, timeout=args.timeout)
        else:
            result = track_pid.start(args.pid, timeout=args.timeout,
                                     python_objects=args.python_objects)
        print(describe(result), flush=True)
        return EXIT_OK
