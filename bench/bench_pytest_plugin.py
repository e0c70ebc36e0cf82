"""Cost of the pytest plugin: 10 small tests, plain pytest vs `pytest --memunreachable`.

Prints the median wall time of N runs of each, and their ratio (issue 8: at most 3x), for 10
fixture-free tests (the default batches: a snapshot after each test, one sweep for the ten;
`--compare-env PYTEST_ADDOPTS=--memunreachable-batch=1` times a sweep after every test, the
check after one test being the next one's baseline) and, with --fixtures, for 10 tests that
use a fixture as well (each also gets a baseline snapshot of its own, swept only when a
check finds a new leak).
--compare PYTHON also runs `PYTHON -m pytest --memunreachable` (another install of
memunreachable: a venv of an older commit) in the same rounds, alternating with this one, so
both see the same load; its plain pytest is timed too.
--compare-env NAME=VALUE runs the compare side with that variable set (this interpreter when
--compare is not given): `--compare-env MEMUNREACHABLE_WRITE_TRACKING=0` times the cost of the
write tracking (docs/pytest.md).
--real runs the real-extension suite of tests/integration/test_plugin.py instead (REAL: a C
extension built -O2 without frame pointers; 2 of its 10 tests leak, so each of those takes a
second sweep, and the clean test after each failure a gc.collect()).
--stages also runs --runs sessions with a sweep after every test (--memunreachable-batch=1: a
batch sweeps once) that log each check the helper makes (a conftest.py wraps
noleaks._ask_helper) and prints the medians of the warm ones (each session's first check
left out): the whole check in the helper, the pause, and the sweep's stages (walk: the
allocators' and CPython's walks; roots; mark; fold), with the allocations and bytes scanned.
Usage: python bench/bench_pytest_plugin.py [runs] [--fixtures | --real] [--compare PYTHON]
       [--compare-env NAME=VALUE] [--stages]
"""
import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

TESTS = "\n".join(f"def test_{i}():\n    assert sum(range({i} * 1000)) >= 0\n" for i in range(10))
FIXTURE_TESTS = "import pytest\n\n@pytest.fixture\ndef n():\n    return 1000\n\n" + "\n".join(
    f"def test_{i}(n):\n    assert sum(range({i} * n)) >= 0\n" for i in range(10))


CPU = {}     # (python, args) -> [CPU seconds of the run: pytest and its helper, user + system]


ENV = None         # the real-extension suite's: PYTHONPATH to its extension


def run(python: str, cwd: str, *args: str, extra_env=None) -> float:
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    env = dict(ENV if ENV is not None else os.environ, **(extra_env or {}))
    done = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=cwd, stdout=subprocess.DEVNULL, env=env)
    if done.returncode not in ((0, 1) if ENV is not None else (0,)):   # REAL: 2 tests fail
        raise SystemExit(f"pytest {' '.join(args)} exited with {done.returncode}")
    t = time.monotonic() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    CPU.setdefault((python, args, bool(extra_env)), []).append(cpu)
    return t


def line(name: str, python: str, runs: int, plain: list, checked: list, env=None) -> str:
    p, c = statistics.median(plain), statistics.median(checked)
    pc = statistics.median(CPU[(python, (), bool(env))])
    cc = statistics.median(CPU[(python, ("--memunreachable",), bool(env))])
    return (f"{name}: 10 tests, median of {runs}: plain pytest {p:.2f} s, --memunreachable "
            f"{c:.2f} s ({c / p:.1f}x; {1000 * (c - p) / 10:.0f} ms per test); best {min(plain):.2f} s and "
            f"{min(checked):.2f} s ({min(checked) / min(plain):.1f}x); CPU time (pytest and "
            f"its helper) {pc:.2f} s and {cc:.2f} s ({cc / pc:.1f}x)")


# The conftest.py of --stages: one JSON line per check the helper answers.
STAGES_CONFTEST = """
import json, os
from memunreachable import noleaks
_ask = noleaks._ask_helper
def _logged(*args, **kwargs):
    info = _ask(*args, **kwargs)
    with open(os.environ["BENCH_STAGES_LOG"], "a") as f:
        f.write(json.dumps(dict(info.stats.get("seconds") or {}, check=info.duration_ms / 1000,
                                pause=info.pause_ms / 1000, allocations=info.num_allocations,
                                scanned=info.bytes_scanned)) + "\\n")
    return info
noleaks._ask_helper = _logged
"""


def stages(python: str, suite: str, runs: int) -> str:
    """Medians over `runs` sessions of the warm checks' figures (STAGES_CONFTEST)."""
    import json
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, text in (("test_small.py", suite), ("conftest.py", STAGES_CONFTEST)):
            with open(os.path.join(d, name), "w") as f:
                f.write(text)
        log = os.path.join(d, "stages.jsonl")
        for _ in range(runs):
            open(log, "w").close()
            run(python, d, "--memunreachable", "--memunreachable-batch=1",
                extra_env={"BENCH_STAGES_LOG": log})
            with open(log) as f:
                rows += [json.loads(line) for line in f][1:]
    if not rows:
        return "stages: no check was logged"
    med = {k: statistics.median(r[k] for r in rows if k in r) for k in rows[0]}
    ms = " ".join(f"{k} {1000 * med[k]:.1f} ms" for k in ("check", "pause", "walk", "roots",
                                                          "mark", "fold") if k in med)
    return (f"stages: median of {len(rows)} warm checks in {runs} sessions: {ms}; "
            f"{med['allocations']:.0f} allocations, {med['scanned'] / 1e6:.1f} MB scanned")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="?", type=int, default=5)
    ap.add_argument("--compare", metavar="PYTHON", help="another install's interpreter")
    ap.add_argument("--fixtures", action="store_true", help="tests that use a fixture")
    ap.add_argument("--real", action="store_true", help="the real-extension suite (test_plugin.py)")
    ap.add_argument("--compare-env", metavar="NAME=VALUE", action="append", default=[],
                    help="set for the compare side")
    ap.add_argument("--stages", action="store_true", help="the warm checks' stage medians")
    args = ap.parse_args()
    suite = FIXTURE_TESTS if args.fixtures else TESTS
    if args.real:
        global ENV
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path[:0] = [os.path.join(here, "..", "tests"), os.path.join(here, "..", "tests", "integration")]
        from inprocess_helpers import build_extension
        from test_plugin import REAL
        ext = build_extension("textparse", flags=("-O2", "-g", "-fomit-frame-pointer"))
        ENV = dict(os.environ, PYTHONPATH=ext)
        ENV.pop("PYTHONMALLOC", None)
        suite = REAL
    envs = dict(kv.split("=", 1) for kv in args.compare_env)
    pythons = [("this", sys.executable, None)]
    if args.compare or envs:
        label = "compare" + (" (" + " ".join(args.compare_env) + ")" if envs else "")
        pythons.append((label, args.compare or sys.executable, envs or None))
    times = {name: ([], []) for name, _, _ in pythons}
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "test_small.py"), "w") as f:
            f.write(suite)
        for k in range(args.runs):
            order = pythons if k % 2 == 0 else pythons[::-1]
            for name, python, env in order:
                times[name][0].append(run(python, d, extra_env=env))
                times[name][1].append(run(python, d, "--memunreachable", extra_env=env))
    for name, python, env in pythons:
        kind = " (with a fixture)" if args.fixtures else " (real extension)" if args.real else ""
        print(line(name + kind, python, args.runs, *times[name], env=env))
    if args.stages:
        print(stages(sys.executable, suite, args.runs))


if __name__ == "__main__":
    main()
