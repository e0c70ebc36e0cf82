"""cli: the `memunreachable` command line: a registry of Command classes and main().

Each subcommand is a Command subclass in its own module (cli/check.py, cli/demo.py): its name
comes from the class name (Check -> "check"), its help text from its docstring, and it
provides add_arguments(parser) and run(args) -> int (style.md rule 8, memray's model).
main(argv=None) -> int is the ONLY place where exceptions become exit codes
(landscape.md section 3):

    0   no leaks
    23  leaks found
    2   usage error (bad arguments, pid given twice or not at all, -o FILE exists)
    3   could not check (no such process, permission, unsupported target, collection failed)
    1   unexpected internal error (a bug of ours)

A check interrupted by SIGINT/SIGTERM/SIGHUP (the engine raises an exception carrying .signum,
after releasing the target and killing its helper processes: leftovers.guard) ends by
re-raising that signal on ourselves with the default disposition, so the parent shell sees the
usual "killed by signal" status (or 128 + signum as a fallback). main() turns SIGTERM/SIGHUP
into that exception outside the check too (unless they were ignored, as under nohup).
"""
from __future__ import annotations

import argparse
import inspect
import logging
import os
import re
import signal
import sys
import threading
import traceback
from typing import List, Optional, Sequence, Tuple, Type

from memunreachable._errors import CommandError, MemunreachableError

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_CANNOT_CHECK = 3
EXIT_LEAKS = 23

PROG = "memunreachable"
LOGGER = "memunreachable"

EXIT_CODES_HELP = """\
exit codes:
  0   no leaks found
  23  leaks found
  2   usage error
  3   could not check (no such process, permission, unsupported target or allocator)
  1   unexpected internal error (please report it)
"""


class Command:
    """Base class: subclasses set a docstring (the help) and implement add_arguments/run."""

    @classmethod
    def name(cls) -> str:
        """CamelCase class name -> kebab-case command name (Check -> check, NoLeaks -> no-leaks)."""
        return re.sub(r"(?<!^)(?=[A-Z])", "-", cls.__name__).lower()

    @classmethod
    def help(cls) -> str:
        doc = (cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""

    @classmethod
    def description(cls) -> str:
        return inspect.cleandoc(cls.__doc__ or "")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        pass

    def run(self, args: argparse.Namespace) -> int:
        raise NotImplementedError


def get_commands() -> List[Type[Command]]:
    """The registry, in --help order. Imported lazily: the command modules import this one."""
    from memunreachable.cli.check import Check
    from memunreachable.cli.demo import Demo

    return [Check, Demo]


def _common_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("output verbosity")
    group.add_argument("-v", "--verbose", action="count", default=0,
                       help="more log output on stderr (-v: INFO, -vv: DEBUG)")
    group.add_argument("-q", "--quiet", action="store_true",
                       help="log errors only")
    return common


def build_parser() -> argparse.ArgumentParser:
    from memunreachable import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Find unreachable (leaked) heap memory in a running glibc Linux process, "
                    "without restarting it.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {__version__}")
    common = _common_parser()
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cls in get_commands():
        command = cls()
        p = sub.add_parser(cls.name(), parents=[common], help=cls.help(),
                           description=cls.description(), epilog=EXIT_CODES_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        command.add_arguments(p)
        p.set_defaults(command_obj=command)
    return parser


def _setup_logging(args: argparse.Namespace) -> Tuple[logging.Handler, int]:
    """Attach a stderr handler to the `memunreachable` logger; return it and the old level."""
    level = logging.WARNING
    if getattr(args, "quiet", False):
        level = logging.ERROR
    elif getattr(args, "verbose", 0) >= 2:
        level = logging.DEBUG
    elif getattr(args, "verbose", 0) == 1:
        level = logging.INFO
    logger = logging.getLogger(LOGGER)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler, old_level


def print_error(msg: str, hint: Optional[str] = None) -> None:
    """'memunreachable: error: <msg>' and 'hint: <hint>' on stderr."""
    sys.stderr.write(f"{PROG}: error: {msg}\n")
    if hint:
        sys.stderr.write(f"hint: {hint}\n")
    sys.stderr.flush()


def die_by_signal(signum: int) -> int:
    """Re-raise `signum` on ourselves with its default action; return 128 + signum if we survive."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    except (OSError, ValueError):
        pass
    return 128 + signum


class Interrupted(KeyboardInterrupt):
    """SIGTERM/SIGHUP outside a check (inside one the engine raises its own, with .signum)."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {_signal_name(signum)}")
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def _catch_signals() -> dict:
    """SIGTERM/SIGHUP -> Interrupted, unless ignored or handled outside Python; returns the
    old handlers (main thread only: signal.signal refuses other threads)."""
    old = {}
    if threading.current_thread() is not threading.main_thread():
        return old
    for signum in (signal.SIGTERM, signal.SIGHUP):
        prev = signal.getsignal(signum)
        if prev is signal.SIG_DFL:
            old[signum] = signal.signal(signum, _raise_interrupted)
    return old


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _internal_error(exc: BaseException, verbose: int) -> int:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in " \
            f"{frames[-1].name})" if frames else ""
    print_error(f"internal error: {type(exc).__name__}: {exc}{where}",
                "this is a bug in memunreachable; rerun with -vv for the full traceback and "
                "report it with that output")
    if verbose >= 2:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    return EXIT_INTERNAL


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse argv (default sys.argv[1:]), run the command, return its exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:          # argparse: --help/--version (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    command = getattr(args, "command_obj", None)
    if command is None:
        parser.print_usage(sys.stderr)
        print_error("a command is required", f"run '{PROG} --help' to list the commands, or "
                    f"'{PROG} demo' to try it on a bundled leaky program")
        return EXIT_USAGE

    handler, old_level = _setup_logging(args)
    old_handlers = _catch_signals()
    try:
        return command.run(args)
    except BaseException as exc:       # the one place where exceptions become exit codes
        signum = getattr(exc, "signum", None)
        if isinstance(exc, KeyboardInterrupt) and signum is None:
            signum = signal.SIGINT
        if isinstance(signum, int) and signum > 0:
            sys.stderr.write(f"{PROG}: interrupted by {_signal_name(signum)}; the target was "
                             "released\n")
            return die_by_signal(signum)
        if isinstance(exc, CommandError):
            print_error(str(exc), exc.hint)
            return exc.exit_code
        if isinstance(exc, MemunreachableError):
            print_error(str(exc), exc.hint)
            return EXIT_CANNOT_CHECK
        if isinstance(exc, SystemExit):
            return exc.code if isinstance(exc.code, int) else EXIT_INTERNAL
        if isinstance(exc, BrokenPipeError):   # `memunreachable check N | head`
            try:
                sys.stdout = open(os.devnull, "w")
            except OSError:
                pass
            return EXIT_INTERNAL
        return _internal_error(exc, getattr(args, "verbose", 0))
    finally:
        for signum, old in old_handlers.items():
            signal.signal(signum, old)
        logging.getLogger(LOGGER).removeHandler(handler)
        logging.getLogger(LOGGER).setLevel(old_level)
