"""cli/check.py: `memunreachable check PID`: run the pipeline on a running process, report.

Input: a pid (positional or -p/--pid, exactly one of them). Output: the text report
(reporters/text.py) or the JSON report (--json) on stdout or in -o FILE; the exit code is
23 when leaks were found, 0 when none. A check that could not see part of the process is an
error (exit 3, IncompleteCheck); with --partial it reports what could be checked, marked
incomplete, and exits 23 with leaks or 3 without: never 0. Errors are raised, never printed
here: cli.main() turns them into messages and exit codes.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Optional

from memunreachable._errors import CommandError
from memunreachable.cli import (EXIT_CANNOT_CHECK, EXIT_LEAKS, EXIT_OK, EXIT_USAGE, Command,
                                bounded_int)

if TYPE_CHECKING:
    from memunreachable.reporters.report import UnreachableMemoryInfo

log = logging.getLogger("memunreachable")

DEFAULT_LIMIT = 100


def pid_type(text: str) -> int:
    return bounded_int(text, "pid", "a positive integer", 1)


def limit_type(text: str) -> int:
    return bounded_int(text, "limit", "an integer >= 0", 0)


def timeout_type(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid timeout {text!r}: expected seconds > 0")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"invalid timeout {text!r}: expected seconds > 0")
    return value


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by check and demo: --limit, --contents, --timeout."""
    parser.add_argument("--limit", type=limit_type, default=DEFAULT_LIMIT, metavar="N",
                        help=f"show at most N leak entries, largest first (default "
                             f"{DEFAULT_LIMIT}; 0 = all)")
    parser.add_argument("--contents", action="store_true",
                        help="show a hexdump of the first 32 bytes of each leaked block "
                             "(JSON always carries them)")
    parser.add_argument("--timeout", type=timeout_type, default=None, metavar="SECONDS",
                        help="upper bound on how long the target may stay paused while its "
                             "threads are frozen (default: the engine's)")
    parser.add_argument("--partial", action="store_true",
                        help="when part of the process cannot be understood (an unsupported "
                             "CPython build, memory the snapshot lacked), report the leaks "
                             "found in the rest, marked incomplete (exit 23 with leaks, 3 "
                             "without; never 0), instead of failing with exit 3")


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """--no-symbolize and --suppressions FILE (issue 9)."""
    parser.add_argument("--no-symbolize", action="store_true",
                        help="do not name the frames of allocation stacks: show them as "
                             "module+0xoffset with the module's build-id (faster; symbolize "
                             "elsewhere with addr2line -e MODULE)")
    parser.add_argument("--suppressions", metavar="FILE",
                        help="LeakSanitizer suppressions file: 'leak:PATTERN' lines ('*' "
                             "wildcards, '^'/'$' anchors, '#' comments) matched against the "
                             "function, source file and module of every frame of a leak's "
                             "allocation stack; suppressed leaks are not reported and do not "
                             "count for the exit code")


def load_suppressions(args: argparse.Namespace) -> list:
    """The rules of --suppressions FILE ([] without it); a file that cannot be read or parsed
    is a usage error (exit 2), found before the target is touched."""
    path = getattr(args, "suppressions", None)
    if path is None:
        return []
    from memunreachable.stacks import suppressions
    from memunreachable._errors import SuppressionsError

    try:
        return suppressions.load(path)
    except SuppressionsError as exc:
        raise CommandError(str(exc), exc.hint, exit_code=EXIT_USAGE) from None


def run_engine(pid: int, args: argparse.Namespace) -> UnreachableMemoryInfo:
    """Call memunreachable.unreachable.check() with the options in args (imported lazily)."""
    from memunreachable import unreachable

    kwargs = {"limit": None if args.limit == 0 else args.limit}
    if getattr(args, "timeout", None) is not None:
        kwargs["timeout"] = args.timeout
    if getattr(args, "no_fallback", False):
        kwargs["allow_direct"] = False
    if getattr(args, "allow_seccomp_target", False):
        kwargs["allow_seccomp"] = True
    if getattr(args, "no_symbolize", False):
        kwargs["symbolize"] = False
    if getattr(args, "suppression_rules", None):
        kwargs["suppressions"] = args.suppression_rules
    if getattr(args, "partial", False):
        kwargs["partial"] = True
    info = unreachable.check(pid, **kwargs)
    if info.comm is None:
        info.comm = read_comm(pid)
    return info


def read_comm(pid: int) -> Optional[str]:
    """/proc/PID/comm without the newline, or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().decode(errors="replace").rstrip("\n") or None
    except OSError:
        return None


def exit_code_for(info: UnreachableMemoryInfo) -> int:
    """23 when any allocation is unreachable (suppressed ones excepted: they are not in
    num_leaks); else 0, or 3 when the check was incomplete (--partial): what was not seen
    may hold leaks, so it is never a clean result."""
    if info.num_leaks > 0:
        return EXIT_LEAKS
    return EXIT_OK if info.complete else EXIT_CANNOT_CHECK


class OutputFile:
    """-o FILE: refuse an existing file without --force (checked before the target is touched),
    write the finished report in one go (atomically replacing the old file with --force)."""

    def __init__(self, path: str, force: bool):
        self.path = path
        self.force = force

    def validate(self) -> None:
        """Raise CommandError(exit 2) when the report could not be written to path."""
        if os.path.isdir(self.path):
            raise CommandError(f"output path {self.path!r} is a directory",
                               "give a file name to -o", exit_code=EXIT_USAGE)
        if os.path.lexists(self.path) and not self.force:
            raise CommandError(f"output file {self.path!r} already exists",
                               "use -f/--force to overwrite it, or choose another name",
                               exit_code=EXIT_USAGE)
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise CommandError(f"directory {parent!r} does not exist",
                               "create it first, or choose another output path",
                               exit_code=EXIT_USAGE)
        if not os.access(parent, os.W_OK | os.X_OK):
            raise CommandError(f"cannot write to directory {parent!r}",
                               "choose an output path you may write to", exit_code=EXIT_USAGE)

    def write(self, text: str) -> None:
        try:
            if not self.force:
                with open(self.path, "x") as f:
                    f.write(text)
                return
            import tempfile
            parent = os.path.dirname(os.path.abspath(self.path))
            fd, tmp = tempfile.mkstemp(prefix=".memunreachable-", dir=parent)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                os.chmod(tmp, 0o644)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except FileExistsError:
            raise CommandError(f"output file {self.path!r} already exists",
                               "use -f/--force to overwrite it", exit_code=EXIT_USAGE)
        except OSError as exc:
            raise CommandError(f"cannot write the report to {self.path!r}: {exc.strerror}",
                               exit_code=EXIT_USAGE)


# The text report of an untracked process with leaks ends with this line.
TRACK_HINT = ("hint: process {pid} records no allocation stacks: `memunreachable track {pid}` "
              "records them for what it allocates from now on")


def emit_report(info: UnreachableMemoryInfo, args: argparse.Namespace,
                output: Optional[OutputFile] = None) -> None:
    """Render info as text or JSON to stdout, or into the output file."""
    # the reporters load here, once the check is done (issue 10, fast start)
    if getattr(args, "json", False):
        from memunreachable.reporters.json import write_json
    else:
        from memunreachable.reporters.text import render_text
    if output is None:
        if getattr(args, "json", False):
            write_json(info, sys.stdout)
        else:
            render_text(info, sys.stdout, contents=args.contents)
        return
    import io
    buf = io.StringIO()
    if getattr(args, "json", False):
        write_json(info, buf)
    else:
        render_text(info, buf, contents=args.contents, color=False)
    output.write(buf.getvalue())
    log.info("report written to %s", output.path)


class Check(Command):
    """Find unreachable (leaked) heap blocks in a running process.

    Pauses the target for a few milliseconds (all threads frozen, a copy-on-write snapshot
    taken, threads released), then walks the glibc heap of the snapshot, marks everything
    reachable from the roots (globals, stacks, registers, TLS) and reports the rest, largest
    first. The target keeps running, and nothing it uses is modified.
    """

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("pid", nargs="?", type=pid_type, metavar="PID",
                            help="process to check")
        parser.add_argument("-p", "--pid", dest="pid_option", type=pid_type, metavar="PID",
                            help="process to check (instead of the positional PID)")
        parser.add_argument("--json", action="store_true",
                            help="print the JSON report (schema_version 1) instead of text; "
                                 "an error is then a JSON object too ({\"error\": {\"kind\", "
                                 "\"message\", \"hint\"}})")
        parser.add_argument("-o", "--output", metavar="FILE",
                            help="write the report to FILE instead of stdout")
        parser.add_argument("-f", "--force", action="store_true",
                            help="overwrite the -o FILE if it exists")
        add_engine_arguments(parser)
        parser.add_argument("--no-fallback", action="store_true",
                            help="fail (exit 3) instead of reading the stopped target directly "
                                 "when no snapshot can be taken: the clone is refused, no "
                                 "thread's seccomp rules allow the injected clone and wait4, or "
                                 "the target's memory cgroup has less room left than its "
                                 "private memory (keeps the pause short)")
        parser.add_argument("--allow-seccomp-target", action="store_true",
                            help="inject the snapshot's clone and wait4 even into a thread "
                                 "whose seccomp filters cannot be read (without CAP_SYS_ADMIN); "
                                 "filters that can be read are always obeyed, and a thread in "
                                 "seccomp strict mode is never used")

        add_report_arguments(parser)

    def get_pid(self, args: argparse.Namespace) -> int:
        if args.pid is not None and args.pid_option is not None:
            raise CommandError("give the pid either as PID or with -p/--pid, not both",
                               "example: memunreachable check 1234", exit_code=EXIT_USAGE)
        pid = args.pid if args.pid is not None else args.pid_option
        if pid is None:
            raise CommandError("no process given",
                               "example: memunreachable check 1234 (or: memunreachable demo)",
                               exit_code=EXIT_USAGE)
        return pid

    def run(self, args: argparse.Namespace) -> int:
        pid = self.get_pid(args)
        args.suppression_rules = load_suppressions(args)
        output = None
        if args.output is not None and args.output != "-":
            output = OutputFile(args.output, args.force)
            output.validate()
        elif args.force:
            log.warning("-f/--force has no effect without -o FILE")
        info = run_engine(pid, args)
        emit_report(info, args, output)
        if info.num_leaks and info.tracking is None and output is None and not args.json:
            print(TRACK_HINT.format(pid=pid), flush=True)
        return exit_code_for(info)
