"""Unit tests of the command line (cli/): arguments, exit codes, output files, the demo flow.

The engine (memunreachable.unreachable.check) is replaced by a fake that records its
arguments and returns a hand-built UnreachableMemoryInfo or raises; nothing is ptraced.
"""
import json
import logging
import os
import signal
import subprocess
import sys
import types

import pytest

import memunreachable
from memunreachable import __version__, cli
from memunreachable.cli import check as cli_check
from memunreachable._errors import (AccessDenied, CollectionError, HeapWalkError,
                                    NoSuchProcess, SweepError, UnsupportedTarget,
                                    ZombieProcess)
from memunreachable.cli import demo as demo_mod
from memunreachable.reporters.report import Leak, UnreachableMemoryInfo
from memunreachable.reporters import format_text, render_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def leaky_info(pid=4242):
    return UnreachableMemoryInfo(
        pid=pid, comm="server", allocator_version="2.36", threads=2, pause_ms=1.5,
        duration_ms=30.0, snapshot_ms=10.0, num_allocations=10, allocation_bytes=1000,
        num_leaks=3, leak_bytes=96,
        leaks=[Leak(0x5000, 48, 1, 24, b"x" * 32), Leak(0x4000, 24, 0, 0, b"y" * 24)])


def clean_info(pid=4242):
    return UnreachableMemoryInfo(pid=pid, comm="server", allocator_version="2.36", threads=1,
                                 num_allocations=10, allocation_bytes=1000)


class FakeEngine:
    """Stands in for memunreachable.unreachable: check() returns `result` or raises it."""

    def __init__(self, result):
        self.result = result
        self.calls = []

    def check(self, pid, **kwargs):
        self.calls.append((pid, kwargs))
        if isinstance(self.result, BaseException):
            raise self.result
        if callable(self.result):
            return self.result(pid)
        return self.result


@pytest.fixture
def engine(monkeypatch):
    def install(result):
        fake = FakeEngine(result)
        module = types.ModuleType("memunreachable.unreachable")
        module.check = fake.check
        monkeypatch.setitem(sys.modules, "memunreachable.unreachable", module)
        monkeypatch.setattr(memunreachable, "unreachable", module, raising=False)
        return fake
    return install


@pytest.fixture(autouse=True)
def plain_output(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.delenv("CLICOLOR_FORCE", raising=False)


# ---- check: results and options ------------------------------------------------------------

def test_check_leaks_exit_23_and_text_report(engine, capsys):
    fake = engine(leaky_info())
    assert cli.main(["check", "4242"]) == 23
    out, err = capsys.readouterr()
    # an untracked process's report ends with a line saying how to get allocation stacks
    assert out == format_text(leaky_info()) + (
        "hint: process 4242 records no allocation stacks: `memunreachable track 4242` records "
        "them for what it allocates from now on\n")
    assert out.splitlines()[-2] == \
        "SUMMARY: memunreachable: 96 bytes leaked in 3 allocations, 2 report entries"
    assert err == ""
    assert fake.calls == [(4242, {"limit": 100})]


def test_check_clean_exit_0(engine, capsys):
    engine(clean_info())
    assert cli.main(["check", "-p", "4242"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == \
        "SUMMARY: memunreachable: 0 bytes leaked in 0 allocations, 0 report entries"


def test_check_contents_flag(engine, capsys):
    engine(leaky_info())
    assert cli.main(["check", "4242", "--contents"]) == 23
    out = capsys.readouterr().out
    assert out == format_text(leaky_info(), contents=True) + cli_check.TRACK_HINT.format(
        pid=4242) + "\n"


def test_check_json(engine, capsys):
    engine(leaky_info())
    assert cli.main(["check", "4242", "--json"]) == 23
    out = capsys.readouterr().out
    assert json.loads(out) == render_json(leaky_info())
    assert json.loads(out)["leaks"][0] == {
        "address": 0x5000, "size": 48, "referenced_count": 1, "referenced_size": 24,
        "total_size": 72, "contents": "78" * 32, "backtrace": [],
        "stack_status": "untracked", "requested_size": None, "num_indirect": None,
        "indirect_size": None, "indirect": []}


@pytest.mark.parametrize("argv, kwargs", [
    (["--limit", "0"], {"limit": None}),
    (["--limit", "5"], {"limit": 5}),
    (["--timeout", "1.5"], {"limit": 100, "timeout": 1.5}),
    (["--no-fallback"], {"limit": 100, "allow_direct": False}),
    (["--allow-seccomp-target"], {"limit": 100, "allow_seccomp": True}),
])
def test_check_engine_options(engine, capsys, argv, kwargs):
    fake = engine(clean_info(pid=77))
    assert cli.main(["check", "77", *argv]) == 0
    assert fake.calls == [(77, kwargs)]


def test_check_fills_comm_from_proc(engine, capsys):
    info = clean_info(pid=os.getpid())
    info.comm = None
    engine(info)
    assert cli.main(["check", str(os.getpid())]) == 0
    with open("/proc/self/comm") as f:
        comm = f.read().strip()
    assert capsys.readouterr().out.splitlines()[0] == \
        f"memunreachable {__version__}: pid {os.getpid()} ({comm}), 1 thread, glibc 2.36"


# ---- usage errors (exit 2) -----------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["check"], "memunreachable: error: no process given"),
    (["check", "12", "-p", "13"],
     "memunreachable: error: give the pid either as PID or with -p/--pid, not both"),
    (["check", "abc"], "memunreachable check: error: argument PID: invalid pid 'abc': "
                       "expected a positive integer"),
    (["check", "0"], "memunreachable check: error: argument PID: invalid pid '0': "
                     "expected a positive integer"),
    (["check", "12", "--limit", "-1"], "memunreachable check: error: argument --limit: "
                                       "invalid limit '-1': expected an integer >= 0"),
    (["check", "12", "--timeout", "0"], "memunreachable check: error: argument --timeout: "
                                        "invalid timeout '0': expected seconds > 0"),
    (["check", "12", "--bogus"], "memunreachable check: error: unrecognized arguments: --bogus"),
    (["check", "12", "13"], "memunreachable check: error: one PID per check, got 2: 12 13 "
                            "(run one check per process)"),
    (["check", "-p", "12", "13", "14"], "memunreachable check: error: one PID per check, got "
                                        "3: 13 12 14 (run one check per process)"),
    ([], "memunreachable: error: a command is required"),
    (["frobnicate"], "memunreachable: error: argument COMMAND: invalid choice: 'frobnicate' "
                     "(choose from 'check', 'demo', 'run', 'track')"),
])
def test_usage_errors_exit_2(engine, capsys, argv, message):
    fake = engine(leaky_info())
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err.splitlines()
    assert fake.calls == []


def test_version_and_help(capsys):
    assert cli.main(["-V"]) == 0
    assert capsys.readouterr().out == f"memunreachable {__version__}\n"
    assert cli.main(["check", "--help"]) == 0
    out = capsys.readouterr().out
    assert "  23  leaks found" in out.splitlines()
    assert "  3   could not check (no such process, permission, unsupported target or " \
           "allocator)" in out.splitlines()


# ---- -o FILE ---------------------------------------------------------------------------------

def test_output_file_written(engine, capsys, tmp_path):
    engine(leaky_info())
    path = tmp_path / "report.txt"
    assert cli.main(["check", "4242", "-o", str(path)]) == 23
    assert capsys.readouterr().out == ""
    assert path.read_text() == format_text(leaky_info())


def test_output_file_exists_refused_without_force(engine, capsys, tmp_path):
    fake = engine(leaky_info())
    path = tmp_path / "report.json"
    path.write_text("old\n")
    assert cli.main(["check", "4242", "--json", "-o", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"memunreachable: error: output file {str(path)!r} already exists",
                   "hint: use -f/--force to overwrite it, or choose another name"]
    assert path.read_text() == "old\n"
    assert fake.calls == []          # refused before the target was touched


def test_output_file_overwritten_with_force(engine, capsys, tmp_path):
    engine(leaky_info())
    path = tmp_path / "report.json"
    path.write_text("old\n")
    assert cli.main(["check", "4242", "--json", "-o", str(path), "-f"]) == 23
    assert json.loads(path.read_text()) == render_json(leaky_info())
    assert sorted(os.listdir(tmp_path)) == ["report.json"]


def test_output_file_missing_directory(engine, capsys, tmp_path):
    fake = engine(leaky_info())
    assert cli.main(["check", "4242", "-o", str(tmp_path / "nodir" / "r.txt")]) == 2
    assert capsys.readouterr().err.splitlines()[0] == \
        f"memunreachable: error: directory {str(tmp_path / 'nodir')!r} does not exist"
    assert fake.calls == []


# ---- could not check (exit 3) and internal errors (exit 1) ---------------------------------

@pytest.mark.parametrize("exc, first_line", [
    (NoSuchProcess(4242, "no such process", "check the pid"),
     "memunreachable: error: no such process (pid=4242)"),
    (ZombieProcess(4242, "process has already exited (zombie)", "nothing left to check",
                   name="srv"),
     "memunreachable: error: process has already exited (zombie) (pid=4242, name='srv')"),
    (AccessDenied(4242, "cannot trace", "run as root"),
     "memunreachable: error: cannot trace (pid=4242)"),
    (UnsupportedTarget("unsupported allocator: jemalloc", "only glibc malloc is supported"),
     "memunreachable: error: unsupported allocator: jemalloc"),
    (CollectionError("thread 12 did not stop", "it is in D state"),
     "memunreachable: error: thread 12 did not stop"),
    (HeapWalkError("heap inconsistent after 20 retries", "try again"),
     "memunreachable: error: heap inconsistent after 20 retries"),
    (SweepError("sweeper crashed (SIGSEGV)", "please report it"),
     "memunreachable: error: sweeper crashed (SIGSEGV)"),
])
def test_could_not_check_exit_3(engine, capsys, exc, first_line):
    engine(exc)
    assert cli.main(["check", "4242"]) == 3
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [first_line, f"hint: {exc.hint}"]


def test_internal_error_exit_1(engine, capsys):
    engine(RuntimeError("boom"))
    assert cli.main(["check", "4242"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("memunreachable: error: internal error: RuntimeError: boom (at ")
    assert err[1] == ("hint: this is a bug in memunreachable; rerun with -vv for the full "
                      "traceback and report it with that output")
    assert len(err) == 2


def test_internal_error_traceback_with_vv(engine, capsys):
    engine(RuntimeError("boom"))
    assert cli.main(["check", "4242", "-vv"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert "Traceback (most recent call last):" in err
    assert err[-1] == "RuntimeError: boom"


# ---- signals -------------------------------------------------------------------------------

class Interrupted(Exception):
    def __init__(self, signum):
        super().__init__("interrupted")
        self.signum = signum


@pytest.mark.parametrize("exc, signum", [
    (Interrupted(signal.SIGTERM), signal.SIGTERM),
    (CollectionError("interrupted"), None),
    (KeyboardInterrupt(), signal.SIGINT),
])
def test_interrupt_reraises_signal(engine, capsys, monkeypatch, exc, signum):
    raised = []
    monkeypatch.setattr(cli, "die_by_signal", lambda s: raised.append(s) or 128 + s)
    engine(exc)
    rc = cli.main(["check", "4242"])
    if signum is None:
        assert (rc, raised) == (3, [])
    else:
        assert (rc, raised) == (128 + signum, [signum])
        assert capsys.readouterr().err == \
            f"memunreachable: interrupted by {signum.name}; the target was released\n"


def test_interrupt_kills_process_with_signal():
    code = (
        "import sys, types, signal, memunreachable\n"
        "class E(Exception):\n"
        "    signum = signal.SIGTERM\n"
        "def check(pid, **kw):\n"
        "    raise E('stop')\n"
        "m = types.ModuleType('memunreachable.unreachable'); m.check = check\n"
        "sys.modules['memunreachable.unreachable'] = m; memunreachable.unreachable = m\n"
        "from memunreachable.cli import main\n"
        "sys.exit(main(['check', '4242']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == -signal.SIGTERM
    assert proc.stderr == "memunreachable: interrupted by SIGTERM; the target was released\n"


# ---- logging -------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, shown", [
    ([], ["memunreachable: WARNING: w"]),
    (["-v"], ["memunreachable: INFO: i", "memunreachable: WARNING: w"]),
    (["-vv"], ["memunreachable: DEBUG: d", "memunreachable: INFO: i",
               "memunreachable: WARNING: w"]),
    (["-q"], []),
])
def test_verbosity(engine, capsys, flags, shown):
    def run(pid):
        log = logging.getLogger("memunreachable")
        log.debug("d")
        log.info("i")
        log.warning("w")
        return clean_info(pid)
    engine(run)
    assert cli.main(["check", "4242", *flags]) == 0
    assert capsys.readouterr().err.splitlines() == shown
    assert logging.getLogger("memunreachable").handlers == []
    assert logging.getLogger("memunreachable").level == logging.NOTSET


def test_python_dash_m():
    proc = subprocess.run([sys.executable, "-m", "memunreachable", "--version"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, f"memunreachable {__version__}\n")


def test_command_registry():
    assert [(c.name(), c.help()) for c in cli.get_commands()] == [
        ("check", "Find unreachable (leaked) heap blocks in a running process."),
        ("demo", "Check a bundled leaky example program and show the report."),
        ("run", "Run a program with allocation tracking: `check PID` then shows where leaks came from."),
        ("track", "Start recording allocation stacks in a running process (no restart); --stop ends it."),
    ]

    class NoLeaksNow(cli.Command):
        """Doc line."""
    assert (NoLeaksNow.name(), NoLeaksNow.help()) == ("no-leaks-now", "Doc line.")


# ---- demo ----------------------------------------------------------------------------------
# The bundled program runs for real (it is built by `pip install -e .`); only the engine is fake.

DEMO_SIZES = {"leak_list": 56, "leak_ring": 72, "leak_buffer": 200}


@pytest.fixture
def demo_seen(monkeypatch):
    """Record what the demo program printed (the fake engine builds its answer from it)."""
    seen = {}
    original = demo_mod._read_until_ready

    def spy(proc, timeout):
        exp = original(proc, timeout)
        seen["exp"], seen["proc"] = exp, proc
        return exp
    monkeypatch.setattr(demo_mod, "_read_until_ready", spy)
    return seen


def exact_answer(seen):
    def answer(pid):
        exp = seen["exp"]
        assert pid == seen["proc"].pid
        refs = {"leak_list": (2, 112), "leak_ring": (2, 144), "leak_buffer": (0, 0)}
        # what demo.c wrote into its buffer (the real engine reads it from the snapshot)
        contents = {"leak_buffer": b"GET /index.html HTTP/1.1\r\nHost: "}
        leaks = [Leak(b.address, b.size, *refs[b.label], contents.get(b.label, b""))
                 for b in exp.blocks]
        leaks.sort(key=lambda l: (-l.total_size, l.address))
        return UnreachableMemoryInfo(pid=pid, threads=2, num_allocations=20,
                                     allocation_bytes=8000, num_leaks=exp.expect["num_leaks"],
                                     leak_bytes=exp.expect["leak_bytes"], leaks=leaks)
    return answer


def test_demo_program_handshake_and_exact_match(engine, demo_seen, capsys):
    engine(exact_answer(demo_seen))
    assert cli.main(["demo"]) == 23
    exp, proc = demo_seen["exp"], demo_seen["proc"]
    assert {b.label: b.size for b in exp.blocks} == DEMO_SIZES
    assert exp.expect == {"num_leaks": 7, "leak_bytes": 584, "entries": 3}
    assert proc.returncode == 0          # it said bye and exited normally after "quit"
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"Started the demo program (pid {proc.pid}); checking it the way "
                      f"'memunreachable check {proc.pid}' would.")
    assert "SUMMARY: memunreachable: 584 bytes leaked in 7 allocations, 3 report entries" in out
    assert "  in total 584 bytes in 7 allocations, 3 report entries" in out
    assert ("Result: memunreachable found exactly these leaks, and nothing the program still "
            "uses.") in out
    buf = [b for b in exp.blocks if b.label == "leak_buffer"][0]
    i = out.index(f"  200 bytes unreachable at {buf.address:x}")
    assert out[i:i + 5] == [f"  200 bytes unreachable at {buf.address:x}",
                            "   first 32 bytes of contents:",
                            f"   {buf.address:x}: 47 45 54 20 2f 69 6e 64 65 78 2e 68 74 6d "
                            f"6c 20 GET /index.html ",
                            f"   {buf.address + 16:x}: 48 54 54 50 2f 31 2e 31 0d 0a 48 6f 73 74 "
                            f"3a 20 HTTP/1.1..Host: ",
                            ""]
    assert out[-1] == f"  memunreachable check PID     (or: sudo {sys.executable} -m " \
                      f"memunreachable check PID)"


def test_demo_reports_mismatch(engine, demo_seen, capsys):
    engine(lambda pid: clean_info(pid))
    assert cli.main(["demo", "--no-contents"]) == 0
    exp = demo_seen["exp"]
    out = capsys.readouterr().out.splitlines()
    i = out.index("Result: the check did NOT find exactly these leaks:")
    addr = {b.label: b.address for b in exp.blocks}
    assert out[i + 1:i + 7] == [
        "  - num_leaks: expected 7, found 0",
        "  - leak_bytes: expected 584, found 0",
        "  - entries: expected 3, found 0",
        f"  - {exp.blocks[0].label} at {exp.blocks[0].address:x} was not reported",
        f"  - {exp.blocks[1].label} at {exp.blocks[1].address:x} was not reported",
        f"  - {exp.blocks[2].label} at {exp.blocks[2].address:x} was not reported",
    ]
    assert [b.label for b in exp.blocks] == ["leak_buffer", "leak_ring", "leak_list"]
    assert len(addr) == 3
    assert demo_seen["proc"].returncode == 0


def test_demo_killed_on_error(engine, demo_seen, capsys):
    engine(AccessDenied(1, "cannot trace", "run as root"))
    assert cli.main(["demo"]) == 3
    proc = demo_seen["proc"]
    assert proc.returncode == -signal.SIGKILL
    assert capsys.readouterr().err.splitlines()[-2:] == [
        "memunreachable: error: cannot trace (pid=1)", "hint: run as root"]


def test_demo_missing_program(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(demo_mod, "DEMO_NAME", "no-such-demo")
    assert cli.main(["demo"]) == 3
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("memunreachable: error: the bundled demo program is missing: ")
    assert err[0].endswith(os.path.join("memunreachable", "_demo", "no-such-demo"))


# ---- errors as data (--json) ---------------------------------------------------------------

def json_error(kind, message, hint, pid=None):
    return {"schema_version": 1, "tool_version": __version__, "pid": pid,
            "error": {"kind": kind, "message": message, "hint": hint}}


@pytest.mark.parametrize("exc, kind", [
    (NoSuchProcess(4242, "no such process", "find it with pgrep"), "NoSuchProcess"),
    (ZombieProcess(4242, "process 4242 has exited (zombie)", "nothing", name="srv"),
     "ZombieProcess"),
    (AccessDenied(4242, "cannot trace", "run as root"), "AccessDenied"),
    (UnsupportedTarget("unsupported allocator: jemalloc", "only glibc"), "UnsupportedTarget"),
    (CollectionError("thread 12 did not stop", None), "CollectionError"),
    (HeapWalkError("heap inconsistent", "try again"), "HeapWalkError"),
    (SweepError("sweeper crashed", "report it"), "SweepError"),
])
def test_json_error_on_stdout_exit_3(engine, capsys, exc, kind):
    engine(exc)
    assert cli.main(["check", "4242", "--json"]) == 3
    out, err = capsys.readouterr()
    assert json.loads(out) == json_error(kind, str(exc), exc.hint, 4242)
    assert err.splitlines()[0] == f"memunreachable: error: {exc}"     # text stays on stderr


def test_json_error_without_json_flag_is_text_only(engine, capsys):
    engine(NoSuchProcess(4242, "no such process", "find it"))
    assert cli.main(["check", "4242"]) == 3
    assert capsys.readouterr().out == ""


def test_json_internal_error_exit_1(engine, capsys):
    engine(RuntimeError("boom"))
    assert cli.main(["check", "4242", "--json"]) == 1
    assert json.loads(capsys.readouterr().out) == json_error(
        "RuntimeError", "internal error: RuntimeError: boom", cli.INTERNAL_HINT, 4242)


@pytest.mark.parametrize("argv, message, hint_prog", [
    (["check", "12", "13", "--json"],
     "one PID per check, got 2: 12 13 (run one check per process)", "memunreachable check"),
    (["check", "abc", "--json"],
     "argument PID: invalid pid 'abc': expected a positive integer", "memunreachable check"),
    (["check", "12", "--json", "--limit", "x"],
     "argument --limit: invalid limit 'x': expected an integer >= 0", "memunreachable check"),
    (["--json"], "unrecognized arguments: --json", "memunreachable"),
])
def test_json_usage_errors_exit_2(engine, capsys, argv, message, hint_prog):
    fake = engine(leaky_info())
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert json.loads(out) == json_error("CommandError", message,
                                         f"run '{hint_prog} --help' to see the arguments")
    assert err.splitlines()[0].startswith(f"usage: {hint_prog} ")
    assert err.splitlines()[-1] == f"{hint_prog}: error: {message}"
    assert fake.calls == []


def test_json_command_error_exit_2(engine, capsys, tmp_path):
    engine(leaky_info())
    path = tmp_path / "r.json"
    path.write_text("old\n")
    assert cli.main(["check", "4242", "--json", "-o", str(path)]) == 2
    assert json.loads(capsys.readouterr().out) == json_error(
        "CommandError", f"output file {str(path)!r} already exists",
        "use -f/--force to overwrite it, or choose another name")


def test_two_pids_is_a_check_usage_error(engine, capsys):
    fake = engine(leaky_info())
    assert cli.main(["check", "12", "13"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("usage: memunreachable check [-h]")
    assert err[-1] == ("memunreachable check: error: one PID per check, got 2: 12 13 (run one "
                       "check per process)")
    assert fake.calls == []


def test_wants_json_stops_at_double_dash():
    assert cli.wants_json(["check", "1", "--json"])
    assert not cli.wants_json(["check", "1", "--", "--json"])
    assert not cli.wants_json(["check", "1", "--jsonx"])


# ---- stats: one flat object ------------------------------------------------------------------

def test_stats_flattened_without_repeats():
    from memunreachable.reporters.json import flatten_stats
    meta = {"allocator": {"name": "glibc", "version": "2.36"}, "warnings": ["w"],
            "stats": {"arenas": 1, "chunks": 8, "method": "file", "seconds": "walker's"},
            "seconds": {"walk": 0.5}, "root_bytes": 100, "suspect_tids": []}
    flat = flatten_stats(meta)
    assert flat == {"arenas": 1, "chunks": 8, "method": "file", "seconds": "walker's",
                    "sweep_seconds": {"walk": 0.5}, "root_bytes": 100, "suspect_tids": []}
    assert flatten_stats(flat) == flat
    info = leaky_info()
    info.stats = meta
    info.warnings = ["w"]
    doc = render_json(info)
    assert doc["stats"] == flat
    assert doc["allocator"] == {"name": "glibc", "version": "2.36"} and doc["warnings"] == ["w"]
    assert "stats" not in doc["stats"] and "allocator" not in doc["stats"]


def test_a_signal_while_the_handlers_are_restored_ends_the_process_by_it():
    # CI: a SIGHUP at a check's very end arrived while main() put the old handlers back; its
    # Interrupted escaped main() as a traceback (exit 1). Now it is kept and delivered again to
    # the old (default) handler once they are back: the process ends by the signal, silently.
    import subprocess
    import sys
    code = ("import os, signal\n"
            "from memunreachable import cli\n"
            "for s in (signal.SIGTERM, signal.SIGHUP):\n"     # as from a terminal (not nohup)
            "    signal.signal(s, signal.SIG_DFL)\n"
            "old = cli._catch_signals()\n"
            "assert set(old) == {signal.SIGTERM, signal.SIGHUP}\n"
            "cli._RESTORING[0] = True\n"
            "os.kill(os.getpid(), signal.SIGHUP)\n"
            "print('kept', cli._ARRIVED, flush=True)\n"
            "cli._restore_signals(old)\n"
            "print('not reached', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -1, (proc.returncode, proc.stderr)
    assert proc.stdout == "kept [1]\n" and proc.stderr == ""
