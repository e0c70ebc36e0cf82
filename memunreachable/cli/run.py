"""cli/run.py: `memunreachable run [options] -- PROG [ARGS...]`: run PROG with allocation
tracking, so that `memunreachable check PID` shows where each leak was allocated.

PROG runs as a child with the tracking library (memunreachable/_track.so, native/mu_track.c)
first in LD_PRELOAD (an existing LD_PRELOAD is kept after it), the same stdin/stdout/stderr
and environment otherwise. `run` waits for it and:
- forwards the signals sent to `run` itself (HUP INT QUIT TERM USR1 USR2 ALRM WINCH CONT);
  a signal the terminal sent to the whole foreground group already reached PROG and is
  not sent twice;
- exits with PROG's exit status, or 128+N when a signal N killed it (as a shell reports it);
- with --check-at-exit, checks PROG when it exits: the library's last destructor writes
  to a pipe and blocks until `run` has checked it (PROG is then inside exit(), after its
  atexit handlers and the other libraries' destructors, like LSan's check). The report goes
  to stderr (or -o FILE); leaks -> exit --exitcode (23 by default), as LSan does.

Exit codes of `run` itself, before PROG started: 127 PROG not found, 126 PROG found but not
executable, or refused (statically linked, setuid/setgid or with file capabilities: the
dynamic loader would not preload the library; --allow-untracked runs it anyway, untracked),
2 usage error. Children are tracked too (forks keep the table; exec'd programs inherit
LD_PRELOAD) unless --no-follow-fork.

MEMUNREACHABLE_TRACK_LIB=PATH preloads PATH instead of the installed library: the path as
PROG will see it, for a PROG that enters another root before it starts (`run -- chroot ROOT
prog`, a container's entry point), where the installed path does not exist. PATH must be a
copy of this version's _track.so (the table layout is versioned: a mismatch is refused by
`check`); it is not checked here, because it need not exist outside PROG's root.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import stat
import struct
import sys
from typing import List, Optional, Tuple

from memunreachable._errors import CommandError, MemunreachableError
from memunreachable.cli import (EXIT_CANNOT_CHECK, EXIT_LEAKS, EXIT_USAGE, Command, bounded_int,
                                print_error)

log = logging.getLogger("memunreachable")

EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
FORWARDED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGALRM, signal.SIGWINCH, signal.SIGCONT)
SI_KERNEL = 0x80            # si_code of a signal the kernel (a terminal) generated
UNWINDERS = ("libunwind", "libgcc", "fp")


TRACK_LIB_ENV = "MEMUNREACHABLE_TRACK_LIB"


def library_path() -> str:
    """The tracking library shipped in the package."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_track.so")


def size_type(text: str) -> int:
    """Bytes with an optional k/m/g suffix (binary units): 64M, 1g, 4194304."""
    t = text.strip().lower()
    t = t[:-2] if t.endswith("ib") else t[:-1] if t.endswith("b") else t
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:], 1)
    try:
        value = int(t[:-1] if mult > 1 else t, 10) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected bytes, e.g. 64M")
    if value < 1 << 20:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: at least 1M")
    return value


def depth_type(text: str) -> int:
    return bounded_int(text, "depth", "1..32", 1, 32)


def exitcode_type(text: str) -> int:
    return bounded_int(text, "exit code", "0..255", 0, 255)


class ProgramError(CommandError):
    """PROG cannot be run (tracked): exit 127 (not found) or 126."""


def resolve_program(prog: str, path_env: Optional[str]) -> str:
    """The file execve() will run for `prog`, as a shell finds it; raises ProgramError
    (exit 127 not found, 126 found but not executable)."""
    if "/" in prog:
        if not os.path.exists(prog):
            raise ProgramError(f"{prog}: no such file", exit_code=EXIT_NOT_FOUND)
        candidate = prog
    else:
        found = shutil.which(prog, path=path_env if path_env is not None else os.defpath)
        if found is None:
            existing = [os.path.join(d, prog) for d in (path_env or os.defpath).split(os.pathsep)
                        if d and os.path.isfile(os.path.join(d, prog))]
            if existing:
                candidate = existing[0]
            else:
                raise ProgramError(f"{prog}: command not found", exit_code=EXIT_NOT_FOUND)
        else:
            candidate = found
    if os.path.isdir(candidate):
        raise ProgramError(f"{prog}: is a directory", exit_code=EXIT_NOT_EXECUTABLE)
    if not os.access(candidate, os.X_OK):
        raise ProgramError(f"{prog}: permission denied (not executable)",
                           hint=f"chmod +x {candidate}", exit_code=EXIT_NOT_EXECUTABLE)
    return candidate


def elf_facts(path: str) -> Optional[Tuple[bool, str]]:
    """(dynamically linked, interpreter) of an ELF file, or None when it is not ELF.
    Dynamically linked = has a PT_INTERP segment (static and static-pie programs have none)."""
    with open(path, "rb") as f:
        ident = f.read(64)
        if ident[:4] != b"\x7fELF" or len(ident) < 64:
            return None
        if ident[4] != 2:           # ELFCLASS64 only (the tracker is x86-64)
            return True, ""
        phoff, = struct.unpack_from("<Q", ident, 32)
        phentsize, phnum = struct.unpack_from("<HH", ident, 54)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    for i in range(phnum):
        p_type, = struct.unpack_from("<I", table, i * phentsize)
        if p_type == 3:             # PT_INTERP
            off, = struct.unpack_from("<Q", table, i * phentsize + 8)
            size, = struct.unpack_from("<Q", table, i * phentsize + 32)
            with open(path, "rb") as f:
                f.seek(off)
                return True, f.read(size).rstrip(b"\0").decode(errors="replace")
    return False, ""


def untrackable_reason(path: str, depth: int = 0) -> Optional[str]:
    """Why LD_PRELOAD cannot work for the program at path, or None when it can."""
    st = os.stat(path)
    if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
        return (f"{path} is setuid/setgid: the dynamic loader runs it in secure mode and "
                "ignores LD_PRELOAD")
    try:
        if os.getxattr(path, "security.capability"):
            return (f"{path} has file capabilities: the dynamic loader runs it in secure mode "
                    "and ignores LD_PRELOAD")
    except OSError:
        pass
    try:
        facts = elf_facts(path)
        if facts is None:
            with open(path, "rb") as f:
                first = f.readline(256)
            if first.startswith(b"#!") and depth < 4:
                interp = first[2:].strip().split()
                if interp:
                    return untrackable_reason(interp[0].decode(errors="replace"), depth + 1)
            return None
    except OSError as exc:
        return None if depth else f"{path} cannot be read ({exc.strerror})"
    if not facts[0]:
        return (f"{path} is statically linked: there is no dynamic loader to preload the "
                "tracking library")
    return None


class Run(Command):
    """Run a program with allocation tracking: `check PID` then shows where leaks came from.

    memunreachable run [options] -- PROG [ARGS...]

    PROG runs with the tracking library preloaded: same stdin/stdout/stderr, signals
    forwarded, exit status passed through (128+N when signal N killed it). Every live
    block's allocation stack (native return addresses, and the Python lines when PROG is
    CPython) is kept in PROG's own memory, so `memunreachable check PID` of PROG or of any
    of its children shows it. --check-at-exit checks PROG when it exits, as LeakSanitizer
    does (exit 23 when it leaked). Exit 127: PROG not found; 126: not executable, or
    statically linked / setuid (a preload cannot work there; --allow-untracked runs it anyway).
    """

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--check-at-exit", action="store_true",
                            help="check PROG for leaks when it exits; leaks -> exit --exitcode")
        parser.add_argument("--exitcode", type=exitcode_type, default=EXIT_LEAKS, metavar="N",
                            help=f"exit code when --check-at-exit finds leaks (default {EXIT_LEAKS})")
        parser.add_argument("--no-follow-fork", action="store_true",
                            help="do not track PROG's children (forked or exec'd)")
        parser.add_argument("--allow-untracked", action="store_true",
                            help="run a PROG that cannot be tracked (static, setuid) untracked "
                                 "instead of refusing it")
        parser.add_argument("--stack-depth", type=depth_type, default=None, metavar="N",
                            help="native frames kept per allocation (1..32, default 32; "
                                 "MEMUNREACHABLE_STACK_DEPTH)")
        parser.add_argument("--budget", type=size_type, default=None, metavar="SIZE",
                            help="memory of the tracking table in PROG (default 64M; "
                                 "MEMUNREACHABLE_TRACK_BUDGET); when full, new blocks get the "
                                 "stack \"[stack table full]\", counted in the report")
        parser.add_argument("--unwinder", choices=UNWINDERS, default=None,
                            help="how stacks are taken (default libunwind when installed, else "
                                 "libgcc; fp is fast but only right for code built with frame "
                                 "pointers)")
        parser.add_argument("--json", action="store_true",
                            help="--check-at-exit: the report as JSON (on stderr, or -o FILE)")
        parser.add_argument("-o", "--output", metavar="FILE",
                            help="--check-at-exit: write the report to FILE instead of stderr")
        from memunreachable.cli.check import limit_type
        parser.add_argument("--limit", type=limit_type, default=100, metavar="N",
                            help="--check-at-exit: show at most N leak entries (0 = all)")
        parser.add_argument("--contents", action="store_true",
                            help="--check-at-exit: hexdump the first bytes of each leak")
        parser.add_argument("program", nargs=argparse.REMAINDER, metavar="-- PROG [ARGS...]",
                            help="the program to run and its arguments")

    def run(self, args: argparse.Namespace) -> int:
        argv = list(args.program)
        if argv[:1] == ["--"]:
            argv = argv[1:]
        if not argv:
            raise CommandError("no program given",
                               "example: memunreachable run -- ./myprog arg1",
                               exit_code=EXIT_USAGE)
        env = dict(os.environ)
        try:
            path = resolve_program(argv[0], env.get("PATH"))
        except ProgramError as exc:
            print_error(str(exc), exc.hint)
            return exc.exit_code
        reason = untrackable_reason(path)
        tracked = reason is None
        if reason is not None:
            if not args.allow_untracked:
                print_error(f"cannot track {argv[0]}: {reason}",
                            "run a dynamically linked, non-setuid build of it, or add "
                            "--allow-untracked to run it without allocation stacks")
                return EXIT_NOT_EXECUTABLE
            log.warning("running %s untracked: %s", argv[0], reason)
            if args.check_at_exit:
                log.warning("--check-at-exit needs the tracking library: %s will not be "
                            "checked at exit", argv[0])
        lib = env.get(TRACK_LIB_ENV) or library_path()
        if tracked and not env.get(TRACK_LIB_ENV) and not os.path.exists(lib):
            raise CommandError(f"the tracking library {lib} is missing",
                               "reinstall memunreachable (pip install --force-reinstall)")
        if tracked:
            env.update(tracking_env(lib, env.get("LD_PRELOAD"), args))
        output = None
        if args.output is not None and args.output != "-":
            from memunreachable.cli.check import OutputFile
            output = OutputFile(args.output, True)
            output.validate()
        return Supervisor(path, argv, env, args, output,
                          check_at_exit=args.check_at_exit and tracked).run()


def tracking_env(lib: str, preload: Optional[str], args: argparse.Namespace) -> dict:
    """The environment entries that turn tracking on (an existing LD_PRELOAD kept after ours)."""
    env = {"LD_PRELOAD": lib + (":" + preload if preload else "")}
    if args.stack_depth is not None:
        env["MEMUNREACHABLE_STACK_DEPTH"] = str(args.stack_depth)
    if args.budget is not None:
        env["MEMUNREACHABLE_TRACK_BUDGET"] = str(args.budget)
    if args.unwinder is not None:
        env["MEMUNREACHABLE_UNWINDER"] = args.unwinder
    if args.no_follow_fork:
        env["MEMUNREACHABLE_NO_FOLLOW_FORK"] = "1"
    return env


class Supervisor:
    """Start PROG, forward signals, answer the exit-check request, return PROG's status."""

    def __init__(self, path: str, argv: List[str], env: dict, args, output, check_at_exit: bool):
        self.path, self.argv, self.env, self.args = path, argv, env, args
        self.output, self.check_at_exit = output, check_at_exit
        self.pid = 0
        self.checked = False
        self.leaks = 0
        self.check_failed = False

    def run(self) -> int:
        req = ack = None
        if self.check_at_exit:
            req, ack = os.pipe(), os.pipe()        # child -> run, run -> child
            self.env["MEMUNREACHABLE_EXIT_FDS"] = f"{req[1]},{ack[0]}"
            self.env["MEMUNREACHABLE_EXIT_PARENT"] = str(os.getpid())
        watched = set(FORWARDED) | {signal.SIGCHLD}
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
        try:
            self.pid = os.fork()
            if self.pid == 0:
                self._child(old_mask, req, ack)             # never returns
            if req is not None:
                os.close(req[1])
                os.close(ack[0])
            return self._wait(watched, old_mask, req[0] if req else -1, ack[1] if ack else -1)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            for fd in ((req[0], ack[1]) if req is not None else ()):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _child(self, old_mask, req, ack) -> None:
        code = EXIT_NOT_EXECUTABLE
        try:
            for signum in FORWARDED:
                if signal.getsignal(signum) not in (signal.SIG_IGN,):
                    signal.signal(signum, signal.SIG_DFL)
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            if req is not None:
                os.close(req[0])
                os.close(ack[1])
                os.set_inheritable(req[1], True)
                os.set_inheritable(ack[0], True)
            os.execve(self.path, self.argv, self.env)
        except OSError as exc:
            code = EXIT_NOT_FOUND if exc.errno == 2 else EXIT_NOT_EXECUTABLE
            try:
                os.write(2, f"memunreachable: error: {self.argv[0]}: {exc.strerror}\n".encode())
            except OSError:
                pass
        finally:
            os._exit(code)

    def _wait(self, watched, old_mask, req_fd: int, ack_fd: int) -> int:
        import select
        while True:
            if req_fd >= 0:
                ready, _, _ = select.select([req_fd], [], [], 0)
                if ready:
                    got = os.read(req_fd, EXIT_REQUEST.size)
                    if got:
                        self._exit_check(old_mask, got)
                        os.write(ack_fd, b"K")
                    os.close(req_fd)
                    req_fd = -1
            info = signal.sigtimedwait(watched, 0.02 if req_fd >= 0 else 1.0)
            if info is not None and info.si_signo != signal.SIGCHLD:
                self._forward(info)
            status = self._reap()
            if status is not None:
                return self._exit_status(status)

    def _forward(self, info) -> None:
        """Send a signal run received on to PROG, unless a terminal sent it to the whole
        process group (PROG got it already)."""
        if info.si_code == SI_KERNEL and os.getpgid(0) == _pgid(self.pid):
            return
        try:
            os.kill(self.pid, info.si_signo)
        except ProcessLookupError:
            pass

    def _reap(self) -> Optional[int]:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return 0
        return status if pid == self.pid else None

    def _exit_status(self, status: int) -> int:
        if os.WIFSIGNALED(status):
            code = 128 + os.WTERMSIG(status)
        else:
            code = os.WEXITSTATUS(status)
        if self.check_at_exit and not self.checked:
            print_error(f"{self.argv[0]} ended without the exit check (killed by a signal, "
                        "_exit(), or it closed the check's pipe): nothing was checked")
            return code if code else EXIT_CANNOT_CHECK
        if self.leaks:
            return self.args.exitcode
        if self.check_failed and code == 0:
            return EXIT_CANNOT_CHECK
        return code

    def _exit_check(self, old_mask, request: bytes) -> None:
        """Check PROG now (it waits in its last destructor) and report. request: what the
        library wrote (exit_path)."""
        from memunreachable import unreachable
        from memunreachable.cli.check import emit_report, read_comm
        self.checked = True
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)    # the check's own handling
        try:
            tid, frames = exit_path(request)
            info = unreachable.check(self.pid, limit=None if self.args.limit == 0 else self.args.limit,
                                     dead_ranges=frames, waiting_tids=(tid,) if tid else ())
            if info.comm is None:
                info.comm = read_comm(self.pid)
        except MemunreachableError as exc:
            self.check_failed = True
            print_error(f"the exit check of {self.argv[0]} (pid {self.pid}) failed: {exc}", exc.hint)
            return
        finally:
            signal.pthread_sigmask(signal.SIG_BLOCK, set(FORWARDED) | {signal.SIGCHLD})
        self.leaks = info.num_leaks
        stdout = sys.stdout
        try:
            sys.stdout = sys.stderr          # the report goes to stderr, as LSan's does
            emit_report(info, self.args, self.output)
        finally:
            sys.stdout = stdout
        sys.stderr.flush()


# The exit-check request of native/mu_track.c's last destructor: "X", then the thread that
# runs exit() and the stack range [low, high) of exit()'s frames and those it called (all 0
# when exit() was not found on the stack). An older library writes "X" alone.
EXIT_REQUEST = struct.Struct("<cQQQ")


def exit_path(request: bytes) -> Tuple[int, Tuple[Tuple[int, int], ...]]:
    """(tid, dead ranges) of an exit-check request: the exiting thread waits in read() (only
    the registers a call preserves are roots) and its exit path's frames are no roots: what
    their unwritten slots hold was left by main's callees (issue 23). (0, ()) when unknown."""
    if len(request) != EXIT_REQUEST.size:
        return 0, ()
    _, tid, low, high = EXIT_REQUEST.unpack(request)
    return (tid, ((low, high),)) if tid and low < high else (0, ())


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return -1
