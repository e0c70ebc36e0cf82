"""cli/demo.py: `memunreachable demo`: check a bundled leaky program, in ten seconds.

Input: nothing (the program memunreachable/_demo/memunreachable-demo, compiled from
fixtures/demo.c by the package build). Steps: start it with pipes, read its handshake
(fixture.h: `block LABEL ADDR SIZE`, `expect KEY VALUE`, `ready`), check it like
`memunreachable check`, print the report, then say what the program leaked on purpose and
whether the check found exactly that; finally send "quit" and make sure it resumed and exited
normally. The program is killed on every error path. Exit code as for check (23: it leaks).
"""
from __future__ import annotations

import argparse
import logging
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from memunreachable._errors import CommandError
from memunreachable.cli import EXIT_CANNOT_CHECK, EXIT_INTERNAL, PROG, Command
from memunreachable.cli.check import DEFAULT_LIMIT, exit_code_for, run_engine, timeout_type
from memunreachable.reporters.report import UnreachableMemoryInfo
from memunreachable.reporters import render_text
from memunreachable.reporters.text import plural

log = logging.getLogger("memunreachable")

DEMO_NAME = "memunreachable-demo"
READY_TIMEOUT = 10.0
EXIT_TIMEOUT = 10.0

# What each leaked head in fixtures/demo.c stands for (labels printed by the program).
DESCRIPTIONS = {
    "leak_list": "a linked list of 3 requests that was dropped: one entry, referencing the other 2",
    "leak_ring": "a ring of 3 peers that nobody points to any more: one entry at its lowest "
                 "address, referencing the other 2",
    "leak_buffer": "a forgotten request buffer (see its contents: 'GET /index.html ...')",
}


@dataclass
class DemoBlock:
    label: str
    address: int
    size: int


@dataclass
class DemoExpectation:
    """What the demo program printed before `ready`."""
    blocks: List[DemoBlock] = field(default_factory=list)
    expect: Dict[str, int] = field(default_factory=dict)

    def feed(self, line: str) -> bool:
        """Parse one handshake line; return True when it was `ready`."""
        parts = line.split()
        if parts[:1] == ["ready"]:
            return True
        if parts[:1] == ["block"] and len(parts) == 4:
            self.blocks.append(DemoBlock(parts[1], int(parts[2], 16), int(parts[3])))
        elif parts[:1] == ["expect"] and len(parts) == 3:
            self.expect[parts[1]] = int(parts[2])
        return False


def find_demo_program() -> str:
    """Path of the bundled demo executable; CommandError(exit 3) when it is missing."""
    try:
        from importlib.resources import files
        path = str(files("memunreachable") / "_demo" / DEMO_NAME)
    except (ImportError, TypeError):
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "_demo", DEMO_NAME)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise CommandError(f"the bundled demo program is missing: {path}",
                           "it is compiled by the package build; reinstall with "
                           f"'{sys.executable} -m pip install --force-reinstall memunreachable' "
                           "(or 'pip install -e .' in a source checkout)",
                           exit_code=EXIT_CANNOT_CHECK)
    return path


def start_demo(path: str, timeout: float = READY_TIMEOUT):
    """Start the demo program; return (Popen, DemoExpectation) once it printed `ready`.

    The program runs in its own session, so a Ctrl-C at the terminal reaches only us (we then
    kill it). It is killed if it does not become ready in `timeout` seconds.
    """
    proc = subprocess.Popen([path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        return proc, _read_until_ready(proc, timeout)
    except BaseException:
        stop_demo(proc)
        raise


def _read_until_ready(proc: subprocess.Popen, timeout: float) -> DemoExpectation:
    exp = DemoExpectation()
    deadline = time.monotonic() + timeout
    buf = b""
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if exp.feed(line.decode(errors="replace")):
                return exp
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommandError(f"the demo program (pid {proc.pid}) did not get ready within "
                               f"{timeout:.0f} s", exit_code=EXIT_CANNOT_CHECK)
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                proc.wait()
                raise CommandError(f"the demo program exited before it was ready "
                                   f"(status {proc.returncode})", exit_code=EXIT_CANNOT_CHECK)
            buf += chunk


def stop_demo(proc: subprocess.Popen) -> None:
    """Kill (if still running) and reap the demo program."""
    if proc.poll() is None:
        proc.kill()
    try:
        proc.communicate(timeout=EXIT_TIMEOUT)
    except (subprocess.TimeoutExpired, OSError, ValueError):
        pass


def finish_demo(proc: subprocess.Popen) -> Optional[str]:
    """Send "quit"; return None if the program said bye and exited 0, else what went wrong."""
    try:
        out, err = proc.communicate(b"quit\n", timeout=EXIT_TIMEOUT)
    except subprocess.TimeoutExpired:
        stop_demo(proc)
        return f"it did not exit within {EXIT_TIMEOUT:.0f} s of being asked to"
    if proc.returncode != 0 or "bye" not in out.decode(errors="replace").split():
        return (f"it exited with status {proc.returncode}: "
                f"{err.decode(errors='replace').strip() or 'no message'}")
    return None


def compare(exp: DemoExpectation, info: UnreachableMemoryInfo) -> List[str]:
    """Differences between what the demo leaked and what the check found ([] = exact match)."""
    problems = []
    for key, found in (("num_leaks", info.num_leaks), ("leak_bytes", info.leak_bytes),
                       ("entries", len(info.leaks) + info.truncated)):
        if key in exp.expect and exp.expect[key] != found:
            problems.append(f"{key}: expected {exp.expect[key]}, found {found}")
    reported = {leak.address for leak in info.leaks}
    for block in exp.blocks:
        if block.address not in reported and not info.truncated:
            problems.append(f"{block.label} at {block.address:x} was not reported")
    expected = {block.address for block in exp.blocks}
    for leak in info.leaks:
        if expected and leak.address not in expected:
            problems.append(f"unexpected entry at {leak.address:x} ({leak.size} bytes)")
    return problems


def explain(exp: DemoExpectation, info: UnreachableMemoryInfo, out) -> bool:
    """Tell the user what the demo leaked and whether the check found exactly that."""
    out.write("What the demo program leaked on purpose (it printed this itself):\n")
    width = max([len(b.label) for b in exp.blocks] + [0])
    for block in exp.blocks:
        out.write(f"  {block.label:<{width}}  {block.size} bytes at {block.address:x}: "
                  f"{DESCRIPTIONS.get(block.label, 'leaked block')}\n")
    if "num_leaks" in exp.expect and "leak_bytes" in exp.expect:
        out.write(f"  in total {plural(exp.expect['leak_bytes'], 'byte')} in "
                  f"{plural(exp.expect['num_leaks'], 'allocation')}, "
                  f"{exp.expect.get('entries', len(exp.blocks))} report entries\n")
    problems = compare(exp, info)
    if problems:
        out.write("Result: the check did NOT find exactly these leaks:\n")
        for p in problems:
            out.write(f"  - {p}\n")
    else:
        out.write("Result: memunreachable found exactly these leaks, and nothing the program "
                  "still uses.\n")
    out.flush()
    return not problems


class Demo(Command):
    """Check a bundled leaky example program and show the report.

    Starts a small program that leaks a linked list, a ring and a buffer on purpose (and keeps
    other data alive in globals, on its stacks and in a second thread), checks it exactly as
    'memunreachable check PID' would, explains the result and stops the program.
    """

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--no-contents", dest="contents", action="store_false",
                            help="do not show the hexdump of each leaked block")
        parser.add_argument("--timeout", type=timeout_type, default=None, metavar="SECONDS",
                            help="upper bound on how long the demo program may stay paused")
        parser.set_defaults(limit=DEFAULT_LIMIT)

    def run(self, args: argparse.Namespace) -> int:
        path = find_demo_program()
        proc, exp = start_demo(path)
        try:
            out = sys.stdout
            out.write(f"Started the demo program (pid {proc.pid}); checking it the way "
                      f"'{PROG} check {proc.pid}' would.\n\n")
            out.flush()
            info = run_engine(proc.pid, args)
            render_text(info, out, contents=args.contents)
            out.write("\n")
            explain(exp, info, out)
            problem = finish_demo(proc)
        finally:
            stop_demo(proc)
        if problem is not None:
            raise CommandError(f"the demo program did not resume normally after the check: "
                               f"{problem}", "this is a bug in memunreachable; please report it",
                               exit_code=EXIT_INTERNAL)
        out.write(f"The demo program resumed and exited normally. Now try your own process:\n"
                  f"  {PROG} check PID     (or: sudo {sys.executable} -m memunreachable check PID)\n")
        out.flush()
        return exit_code_for(info)
