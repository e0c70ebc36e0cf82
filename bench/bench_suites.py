"""Cost of the pytest plugin on real test suites: plain pytest vs `--memunreachable` vs
`--memray` (pytest-memray), each suite built from its pinned sdist (its C extension compiled
here, -O2 as pip builds it, no frame pointers) into a venv of its own.

For each suite and mode: the median wall time of --runs sessions, the tests that passed and
failed (a leak check's failure shows as a failed test), the ratio to plain pytest's median;
then the median ratio over the suites. The venvs live in --cache (default
~/.cache/memunreachable/bench-suites) and are reused; this checkout is installed in each one
(editable), so a change of the plugin needs no rebuild of the suites.
Needs PyPI (pip download) and, for pyyaml's C extension, libyaml-dev (apt-get).
--workers N runs every mode with pytest-xdist's `-n N` (installed in the suites' venvs).
Usage: python bench/bench_suites.py [--runs N] [--suites msgpack,ujson,...]
       [--modes plain,memunreachable,memray] [--extra-args '...'] [--workers N] [--cache DIR]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Suite:
    requirement: str            # the pinned sdist
    tests: str                  # a folder of the sdist, copied out; or "pyargs:PACKAGE"
    deps: Tuple[str, ...] = ()  # what its tests import besides pytest
    ignore: Tuple[str, ...] = ()    # test files left out (they need what the suite does not ship)


SUITES = {
    "msgpack": Suite("msgpack==1.2.4", "test"),
    "markupsafe": Suite("markupsafe==3.0.4", "tests"),
    "simplejson": Suite("simplejson==4.3.0", "pyargs:simplejson.tests"),
    "ujson": Suite("ujson==6.1.0", "tests", deps=("pytz",)),
    "bitarray": Suite("bitarray==3.12.3", "pyargs:bitarray", ignore=("test_free_threading.py",)),
    "pyyaml": Suite("pyyaml==6.0.4", "tests"),
    "rapidjson": Suite("python-rapidjson==1.25", "tests", deps=("pytz",),
                       ignore=("test_memory_leaks.py",)),
}
MODES = {"plain": [], "memunreachable": ["--memunreachable"], "memray": ["--memray"]}


def sh(argv: List[str]) -> None:
    res = subprocess.run(argv, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}):\n{res.stderr[-2000:]}")


def prepare(name: str, suite: Suite, cache: str) -> Tuple[str, str]:
    """(python, test folder or pyargs) of the suite's venv, built when missing."""
    home = os.path.join(cache, suite.requirement.replace("==", "-"))
    python = os.path.join(home, "venv", "bin", "python")
    tests = os.path.join(home, "tests")
    stamp = os.path.join(home, ".ready")
    if not os.path.exists(stamp):
        shutil.rmtree(home, ignore_errors=True)
        os.makedirs(home)
        print(f"# building {suite.requirement} from its sdist in {home}", file=sys.stderr)
        sh([sys.executable, "-m", "venv", os.path.join(home, "venv")])
        sh([python, "-m", "pip", "install", "-q", "pytest", "pytest-memray", *suite.deps])
        sh([python, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
            "-d", home, suite.requirement])
        sdist = next(f for f in os.listdir(home) if f.endswith(".tar.gz"))
        with tarfile.open(os.path.join(home, sdist)) as tar:
            tar.extractall(home, filter="data")
        src = os.path.join(home, sdist[:-len(".tar.gz")])
        sh([python, "-m", "pip", "install", "-q", "--no-binary", ":all:", src])
        if not suite.tests.startswith("pyargs:"):   # outside the source tree: the built
            shutil.copytree(os.path.join(src, suite.tests), tests)   # module is imported
        sh([python, "-m", "pip", "install", "-q", "-e", CHECKOUT])
        open(stamp, "w").close()
    where = suite.tests if suite.tests.startswith("pyargs:") else tests
    return python, where


def session(python: str, where: str, suite: Suite, mode_args: List[str],
            extra: List[str]) -> Tuple[float, int, int]:
    """(wall seconds, passed, failed) of one pytest session."""
    args = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    args += [f"--ignore-glob=*{f}" for f in suite.ignore]
    if where.startswith("pyargs:"):
        package = where[len("pyargs:"):]
        home = subprocess.run([python, "-c", f"import os, {package} as m; "
                               "print(os.path.dirname(m.__file__))"],
                              capture_output=True, text=True, check=True).stdout.strip()
        args += [f"--ignore={os.path.join(home, f)}" for f in suite.ignore]  # not globbed there
        args += ["--pyargs", package]
        cwd = os.path.dirname(python)
    else:
        args += [where]
        cwd = where
    t0 = time.monotonic()
    res = subprocess.run(args + mode_args + extra, cwd=cwd, capture_output=True, text=True)
    wall = time.monotonic() - t0
    tail = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr[-300:]
    count = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|error)", tail)}
    if not count:
        raise RuntimeError(f"no pytest summary: {tail}")
    return wall, count.get("passed", 0), count.get("failed", 0) + count.get("error", 0)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--suites", default=",".join(SUITES))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--extra-args", default="", help="added to every --memunreachable session")
    ap.add_argument("--workers", type=int, default=0, help="pytest-xdist workers in every mode")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/memunreachable/bench-suites"))
    a = ap.parse_args(argv)
    every = ["-n", str(a.workers)] if a.workers else []
    modes = a.modes.split(",")
    ratios = {m: [] for m in modes if m != "plain"}
    print(f"{'suite':<12} {'mode':<15} {'median s':>9} {'ratio':>7} {'passed':>7} {'failed':>7}")
    for name in a.suites.split(","):
        suite = SUITES[name]
        python, where = prepare(name, suite, a.cache)
        if a.workers:
            sh([python, "-m", "pip", "install", "-q", "pytest-xdist"])
        walls = {m: [] for m in modes}
        outcome = {}
        for _ in range(a.runs):                 # modes alternate: they see the same load
            for m in modes:
                extra = every + (a.extra_args.split() if m == "memunreachable" else [])
                wall, passed, failed = session(python, where, suite, MODES[m], extra)
                walls[m].append(wall)
                outcome[m] = (passed, failed)
        base = statistics.median(walls["plain"]) if "plain" in walls else None
        for m in modes:
            med = statistics.median(walls[m])
            ratio = med / base if base else float("nan")
            if m != "plain" and base:
                ratios[m].append(ratio)
            print(f"{name:<12} {m:<15} {med:9.2f} {ratio:6.1f}x {outcome[m][0]:7d} "
                  f"{outcome[m][1]:7d}", flush=True)
    for m, rs in ratios.items():
        if rs:
            print(f"median ratio {m}: {statistics.median(rs):.2f}x (max {max(rs):.2f}x, "
                  f"{len(rs)} suites)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
