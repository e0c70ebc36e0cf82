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

Under --json every error is also a JSON object on stdout (reporters/json.py render_error:
{"schema_version", "tool_version", "pid", "error": {"kind", "message", "hint"}}, kind = the
exception class name, CommandError for usage errors), with the same exit code; the text
message stays on stderr. Usage errors name the subcommand's own usage (`check 1 2` is an
error of `memunreachable check`, not of the top-level parser).

A check interrupted by SIGINT/SIGTERM/SIGHUP (the engine raises an exception carrying .signum,
after releasing the target and killing its helper processes: leftovers.guard) ends by
re-raising that signal on ourselves with the default disposition, so the parent shell sees the
usual "killed by signal" status (or 128 + signum as a fallback). main() turns SIGTERM/SIGHUP
into that exception outside the check too (unless they were ignored, as under nohup).
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
from typing import List, Optional, Sequence, Tuple, Type

from memunreachable._errors import CommandError, MemunreachableError

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_CANNOT_CHECK = 3
EXIT_LEAKS = 23

PROG = "memunreachable"
INTERNAL_HINT = ("this is a bug in memunreachable; rerun with -vv for the full traceback and "
                 "report it with that output")
LOGGER = "memunreachable"

EXIT_CODES_HELP = """\
exit codes:
  0   no leaks found
  23  leaks found
  2   usage error
  3   could not check (no such process, permission, unsupported target or allocator)
  1   unexpected internal error (please report it)
"""


class UsageError(Exception):
    """argparse found a usage error; .parser is the (sub)parser whose usage applies."""

    def __init__(self, parser: argparse.ArgumentParser, message: str):
        super().__init__(message)
        self.parser = parser
        self.message = message


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing and exiting (main() reports it,
    also as JSON under --json). Subparsers inherit the class."""

    def error(self, message: str):
        raise UsageError(self, message)


def terminal_columns() -> int:
    """shutil.get_terminal_size().columns: $COLUMNS, else stdout's terminal, else 80."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


class _TerminalWidth:
    """argparse's default help width (terminal columns - 2), found without importing shutil:
    it imports bz2, lzma, zlib and fnmatch, and argparse makes a formatter for every
    add_argument (issue 10, fast start)."""

    def __init__(self, prog, indent_increment=2, max_help_position=24, width=None):
        if width is None:
            width = terminal_columns() - 2
        super().__init__(prog, indent_increment, max_help_position, width)


class HelpFormatter(_TerminalWidth, argparse.HelpFormatter):
    pass


class RawDescriptionHelpFormatter(_TerminalWidth, argparse.RawDescriptionHelpFormatter):
    pass


class Command:
    """Base class: subclasses set a docstring (the help) and implement add_arguments/run."""

    @classmethod
    def name(cls) -> str:
        """CamelCase class name -> kebab-case command name (Check -> check, NoLeaks -> no-leaks)."""
        return "".join(f"-{c}" if c.isupper() and i else c
                       for i, c in enumerate(cls.__name__)).lower()

    @classmethod
    def help(cls) -> str:
        doc = (cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""

    @classmethod
    def description(cls) -> str:
        return cleandoc(cls.__doc__ or "")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        pass

    def run(self, args: argparse.Namespace) -> int:
        raise NotImplementedError


def cleandoc(doc: str) -> str:
    """inspect.cleandoc(doc): without importing inspect (and ast, dis: issue 10, fast start)."""
    lines = doc.expandtabs().split("\n")
    margin = min((len(line) - len(line.lstrip()) for line in lines[1:] if line.lstrip()),
                 default=None)
    lines[0] = lines[0].lstrip()
    if margin is not None:
        lines[1:] = [line[margin:] for line in lines[1:]]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return "\n".join(lines)


# The registry, in --help order: command name -> (module, class). A command's module is
# imported only when it is listed or run (the command modules import this one).
COMMANDS = {"check": ("memunreachable.cli.check", "Check"),
            "demo": ("memunreachable.cli.demo", "Demo"),
            "run": ("memunreachable.cli.run", "Run"),
            "track": ("memunreachable.cli.track", "Track")}


def bounded_int(text: str, what: str, expected: str, lo: int, hi: Optional[int] = None) -> int:
    """An argparse value: the decimal integer text in [lo, hi], else ArgumentTypeError
    "invalid WHAT 'TEXT': expected EXPECTED"."""
    try:
        value = int(text, 10)
    except ValueError:
        value = None
    if value is None or value < lo or (hi is not None and value > hi):
        raise argparse.ArgumentTypeError(f"invalid {what} {text!r}: expected {expected}")
    return value


def get_command(name: str) -> Type[Command]:
    import importlib
    module, cls = COMMANDS[name]
    return getattr(importlib.import_module(module), cls)


def get_commands(names: Optional[Sequence[str]] = None) -> List[Type[Command]]:
    """The command classes (all, or those named), in --help order."""
    return [get_command(n) for n in COMMANDS if names is None or n in names]


def selected_command(argv: Sequence[str]) -> Optional[str]:
    """The command argv runs when its first argument names one (options of the top-level
    parser come first: -h, -V), else None (then the parser needs every command)."""
    for arg in argv:
        if arg in ("-h", "--help", "-V", "--version") or not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


def _common_parser() -> argparse.ArgumentParser:
    common = ArgumentParser(add_help=False, formatter_class=HelpFormatter)
    group = common.add_argument_group("output verbosity")
    group.add_argument("-v", "--verbose", action="count", default=0,
                       help="more log output on stderr (-v: INFO, -vv: DEBUG)")
    group.add_argument("-q", "--quiet", action="store_true",
                       help="log errors only")
    return common


# Returns the parser; with argv, only the subcommand argv selects is built (and its module
# imported): parsing argv gives the same result and the same messages (issue 10, fast start).
def build_parser(argv: Optional[Sequence[str]] = None) -> argparse.ArgumentParser:
    from memunreachable import __version__

    parser = ArgumentParser(
        prog=PROG,
        description="Find unreachable (leaked) heap memory in a running glibc Linux process, "
                    "without restarting it.",
        epilog=EXIT_CODES_HELP,
        formatter_class=RawDescriptionHelpFormatter)
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {__version__}")
    common = _common_parser()
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = selected_command(argv) if argv is not None else None
    for cls in get_commands([chosen] if chosen else None):
        command = cls()
        p = sub.add_parser(cls.name(), parents=[common], help=cls.help(),
                           description=cls.description(), epilog=EXIT_CODES_HELP,
                           formatter_class=RawDescriptionHelpFormatter)
        command.add_arguments(p)
        p.set_defaults(command_obj=command, command_parser=p)
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


# [True] while main() puts the old handlers back: a signal then is kept here, not raised (an
# exception raised there escaped main() as a traceback, exit 1: a SIGHUP at a check's very end
# in CI, delivered while signal.signal() ran), and is delivered again once they are back
_RESTORING = [False]
_ARRIVED: List[int] = []


def _raise_interrupted(signum, frame):
    if _RESTORING[0]:
        _ARRIVED.append(signum)
        return
    raise Interrupted(signum)


def _restore_signals(old: dict) -> None:
    """Put back the handlers _catch_signals replaced (the caller set _RESTORING[0] first); a
    signal that arrived meanwhile is sent again to this process, now to its old handler (the
    default: the process ends by it, as it would have a moment later)."""
    try:
        for signum, handler in old.items():
            signal.signal(signum, handler)
    finally:
        _RESTORING[0] = False
    if _ARRIVED:
        signum = _ARRIVED[0]
        del _ARRIVED[:]
        os.kill(os.getpid(), signum)


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
    import traceback
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in " \
            f"{frames[-1].name})" if frames else ""
    print_error(f"internal error: {type(exc).__name__}: {exc}{where}", INTERNAL_HINT)
    if verbose >= 2:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    return EXIT_INTERNAL


def wants_json(argv: Sequence[str]) -> bool:
    """--json among the options (before any "--"): errors are then reported as JSON too."""
    for arg in argv:
        if arg == "--":
            return False
        if arg == "--json":
            return True
    return False


def print_json_error(kind: str, message: str, hint: Optional[str] = None,
                     pid: Optional[int] = None) -> None:
    """The error as a JSON object on stdout (--json)."""
    from memunreachable.reporters.json import write_json_error

    try:
        write_json_error(sys.stdout, kind, message, hint, pid)
    except (BrokenPipeError, OSError):
        pass


def extras_message(args: argparse.Namespace, extras: Sequence[str]) -> str:
    """The usage error for arguments left over after parsing (`check 12 13`)."""
    if getattr(args, "command", None) == "check" and all(e.isdigit() for e in extras):
        pids = [str(p) for p in (getattr(args, "pid", None), getattr(args, "pid_option", None))
                if p is not None] + list(extras)
        return (f"one PID per check, got {len(pids)}: {' '.join(pids)} "
                "(run one check per process)")
    return f"unrecognized arguments: {' '.join(extras)}"


def _parse(parser: ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    args, extras = parser.parse_known_args(argv)
    if extras:
        sub = getattr(args, "command_parser", None) or parser
        sub.error(extras_message(args, extras))
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse argv (default sys.argv[1:]), run the command, return its exit code."""
    if argv is not None:
        return _main(list(argv))
    try:
        return _main(sys.argv[1:])
    finally:
        # The program (console script, python -m) exits next: what it leaves is freed with the
        # process, the GC need not walk it at interpreter exit (issue 10, fast start: 10-20 ms
        # of a check's wall time here). Not for a main(argv) called inside another program.
        gc.freeze()


def _main(argv: List[str]) -> int:
    as_json = wants_json(argv)
    parser = build_parser(argv)
    try:
        args = _parse(parser, argv)
    except UsageError as exc:
        exc.parser.print_usage(sys.stderr)
        hint = f"run '{exc.parser.prog} --help' to see the arguments"
        sys.stderr.write(f"{exc.parser.prog}: error: {exc.message}\n")
        if as_json:
            print_json_error("CommandError", exc.message, hint)
        return EXIT_USAGE
    except SystemExit as exc:          # argparse: --help/--version (0)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    command = getattr(args, "command_obj", None)
    if command is None:
        parser.print_usage(sys.stderr)
        msg, hint = "a command is required", (f"run '{PROG} --help' to list the commands, or "
                                              f"'{PROG} demo' to try it on a bundled leaky program")
        print_error(msg, hint)
        if as_json:
            print_json_error("CommandError", msg, hint)
        return EXIT_USAGE

    as_json = bool(getattr(args, "json", False))
    pid = getattr(args, "pid", None) or getattr(args, "pid_option", None)
    handler, old_level = _setup_logging(args)
    old_handlers = _catch_signals()
    try:
        return command.run(args)
    except BaseException as exc:       # the one place where exceptions become exit codes
        signum = getattr(exc, "signum", None)
        if isinstance(exc, KeyboardInterrupt) and signum is None:
            signum = signal.SIGINT
        kind = type(exc).__name__
        if isinstance(signum, int) and signum > 0:
            msg = f"interrupted by {_signal_name(signum)}; the target was released"
            sys.stderr.write(f"{PROG}: {msg}\n")
            if as_json:
                print_json_error(kind, msg, None, pid)
            return die_by_signal(signum)
        if isinstance(exc, SystemExit):
            return exc.code if isinstance(exc.code, int) else EXIT_INTERNAL
        if isinstance(exc, BrokenPipeError):   # `memunreachable check N | head`
            try:
                sys.stdout = open(os.devnull, "w")
            except OSError:
                pass
            return EXIT_INTERNAL
        if isinstance(exc, MemunreachableError):
            print_error(str(exc), exc.hint)
            if as_json:     # a usage error is not about the pid: "pid" is null then
                print_json_error(kind, str(exc), exc.hint, None if isinstance(exc, CommandError)
                                 else getattr(exc, "pid", None) or pid)
            return exc.exit_code if isinstance(exc, CommandError) else EXIT_CANNOT_CHECK
        code = _internal_error(exc, getattr(args, "verbose", 0))
        if as_json:
            print_json_error(kind, f"internal error: {kind}: {exc}", INTERNAL_HINT, pid)
        return code
    finally:
        _RESTORING[0] = True            # first: no call before it (a signal could raise there)
        _restore_signals(old_handlers)
        logging.getLogger(LOGGER).removeHandler(handler)
        logging.getLogger(LOGGER).setLevel(old_level)
