"""Fast start (issue 10): `memunreachable check PID` imports only what the check needs, and
its output does not depend on what was imported."""
import json
import os
import subprocess
import sys

import pytest

import fixtures

pytestmark = pytest.mark.ptrace

# Runs cli.main(argv) in a fresh interpreter; prints on stderr's last line (JSON) the module
# names afterwards and the @dataclass classes those of memunreachable define; exits with
# main's code.
RUN = ("import json, sys\n"
       "from memunreachable.cli import main\n"
       "rc = main(sys.argv[1:])\n"
       "sys.stdout.flush()\n"
       "dcs = sorted(f'{m}.{k}' for m, mod in list(sys.modules.items())\n"
       "             if m.startswith('memunreachable') and mod is not None\n"
       "             for k, v in vars(mod).items() if isinstance(v, type)\n"
       "             and v.__module__ == m and '__dataclass_fields__' in vars(v))\n"
       "print(json.dumps([sorted(sys.modules), dcs]), file=sys.stderr)\n"
       "sys.exit(rc)\n")
NOT_FOR_A_C_TARGET = (
    "rich", "elftools", "ptrace", "pytest", "_pytest", "symbolic",
    "memunreachable.noleaks", "memunreachable.signal_dump", "memunreachable.cli.demo",
    "memunreachable.cli.run", "memunreachable.reporters.json",
    "memunreachable.heaps.cpython.layout", "memunreachable.heaps.cpython.locate",
    "memunreachable.heaps.cpython.pipeline", "memunreachable.heaps.cpython.merge",
    "memunreachable.heaps.cpython.gclists", "memunreachable.heaps.cpython.typerules",
    "memunreachable.heaps.cpython.walker", "memunreachable.heaps.cpython.objects",
    "memunreachable.heaps.cpython.obmalloc", "memunreachable.sweep.explain",
    # issue 10, fast start: no stack to name, no suppressions file
    "memunreachable.stacks.symbolize", "memunreachable.stacks.demangle",
    "memunreachable.stacks.suppressions",
    "ctypes.util", "subprocess",
    # nor argparse's shutil (cli.HelpFormatter), nor pickle (the sweeper's errors only)
    "shutil", "bz2", "lzma", "pickle")
# The @dataclass classes a check may create at import (each costs ~1 ms: the others are
# _types.Fields classes): report.py's public ones, and the sweep's (mark.py, memory.py).
DATACLASSES_OF_A_CHECK = {
    "memunreachable.reporters.report.Leak", "memunreachable.reporters.report.LeakGroup",
    "memunreachable.reporters.report.UnreachableMemoryInfo", "memunreachable.sweep.mark.DeadWords",
    "memunreachable.sweep.mark.MarkResult", "memunreachable.collect.memory.SnapshotPlan"}


def _check(*argv):
    proc = subprocess.run([sys.executable, "-c", RUN, *argv], capture_output=True, text=True,
                          timeout=120)
    modules, dataclasses = json.loads(proc.stderr.strip().splitlines()[-1])
    proc.dataclasses = set(dataclasses)
    return proc, set(modules)


def test_check_of_a_c_process_imports_only_the_check():
    with fixtures.start("leak_one") as fx:
        proc, modules = _check("check", str(fx.pid))
        assert proc.returncode == 23, proc.stderr
        leak = fx.block_list("leak")[0]
        assert f"{leak.size} bytes unreachable at {leak.address:x}" in proc.stdout
        loaded = sorted(m for m in modules if m.split(".")[0] in ("rich", "elftools", "ptrace",
                                                                   "pytest", "_pytest", "symbolic")
                        or m in NOT_FOR_A_C_TARGET)
        assert loaded == []
        assert {"memunreachable.unreachable", "memunreachable.reporters.text",
                "memunreachable.heaps.cpython.probe", "memunreachable.stacks.elf"} <= modules
        assert proc.dataclasses <= DATACLASSES_OF_A_CHECK
        assert "memunreachable.reporters.report.UnreachableMemoryInfo" in proc.dataclasses


def test_suppressions_load_only_with_a_file(tmp_path):
    rules = tmp_path / "lsan.supp"
    rules.write_text("leak:no_such_function\n")
    with fixtures.start("leak_one") as fx:
        proc, modules = _check("check", "--suppressions", str(rules), str(fx.pid))
        assert proc.returncode == 23, proc.stderr
        leak = fx.block_list("leak")[0]
        assert f"{leak.size} bytes unreachable at {leak.address:x}" in proc.stdout
        assert "memunreachable.stacks.suppressions" in modules


def test_json_report_loads_only_the_json_reporter():
    with fixtures.start("leak_one") as fx:
        proc, modules = _check("check", "--json", str(fx.pid))
        assert proc.returncode == 23, proc.stderr
        report = json.loads(proc.stdout)
        assert report["num_leaks"] == 1
        assert "memunreachable.reporters.json" in modules
        assert "memunreachable.reporters.text" not in modules


def test_a_python_target_still_loads_the_cpython_stages():
    code = "import sys; print('ready', flush=True); sys.stdin.read()"
    env = dict(os.environ, PYTHONMALLOC="malloc")
    target = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert target.stdout.readline().strip() == "ready"
        proc, modules = _check("check", "--json", str(target.pid))
        assert proc.returncode in (0, 23), proc.stderr
        assert {"memunreachable.heaps.cpython.pipeline",
                "memunreachable.heaps.cpython.locate"} <= modules
        assert json.loads(proc.stdout)["pid"] == target.pid
    finally:
        target.kill()
        target.wait()


def test_usage_errors_and_help_are_unchanged():
    # the parser builds only the selected command's subparser: messages stay the same
    proc = subprocess.run([sys.executable, "-m", "memunreachable", "chek", "1"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "invalid choice: 'chek' (choose from 'check', 'demo', 'run', 'track')" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "memunreachable", "--help"],
                          capture_output=True, text=True)
    assert proc.returncode == 0
    assert "check" in proc.stdout and "demo" in proc.stdout
    assert "Find unreachable (leaked) heap blocks in a running process." in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "memunreachable", "check", "1", "2"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "one PID per check, got 2: 1 2" in proc.stderr
