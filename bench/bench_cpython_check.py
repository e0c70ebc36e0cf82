"""bench_cpython_check.py: `check` of a Python process holding N live objects, by allocator.

Starts a Python target holding N live GC-tracked objects (empty lists: one 64-byte pymalloc
block each, all on the GC generation lists) and N/4 ints and strs, then times
memunreachable.unreachable.check(pid) (median of RUNS), under the default allocator
(pymalloc) and PYTHONMALLOC=malloc. Prints the whole check, the sweep stages (walk = glibc +
CPython map, roots, mark, fold), allocations, GC nodes walked and leaks found (0 expected).

    python bench/bench_cpython_check.py [--objects 1000000] [--runs 3] [python ...]
"""
import argparse
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from interpreters import pyenv_pythons  # noqa: E402
from memunreachable.unreachable import check

PYTHONS = pyenv_pythons()          # {"3.N": pyenv's newest 3.N.x} (tests/interpreters.py)
DEFAULT = [PYTHONS[v] for v in ("3.12", "3.10") if v in PYTHONS] + ["/usr/bin/python3"]

TARGET = r"""
import os, sys
n = int(sys.argv[1])
lists = [[] for _ in range(n)]
ints = [10**6 + i for i in range(n // 4)]
strs = ["s%d" % i for i in range(n // 4)]
os.write(1, b"ready\n")
os.read(0, 1)
"""


def one(python, n, runs, allocator):
    env = dict(os.environ)
    env.pop("PYTHONMALLOC", None)
    if allocator == "malloc":
        env["PYTHONMALLOC"] = "malloc"
    p = subprocess.Popen([python, "-c", TARGET, str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         env=env)
    try:
        assert p.stdout.readline() == b"ready\n"
        infos = [check(p.pid, limit=None) for _ in range(runs)]
    finally:
        p.stdin.write(b"q")
        p.stdin.close()
        p.wait()
    ms = statistics.median(i.duration_ms for i in infos)
    last = infos[-1]
    sec = last.stats.get("seconds", {})
    cp = last.stats.get("cpython", {})
    stages = " ".join(f"{k} {1000 * v:.0f}" for k, v in sec.items())
    print(f"{python:40s} {allocator:8s} check {ms:7.0f} ms  [{stages}] ms  pause {last.pause_ms:.1f} ms  "
          f"allocations {last.num_allocations}  gc nodes {cp.get('gc_nodes')}  leaks {last.num_leaks}  "
          f"warnings {len(last.warnings)}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("python", nargs="*", default=DEFAULT)
    args = ap.parse_args()
    for py in args.python:
        for allocator in ("pymalloc", "malloc"):
            one(py, args.objects, args.runs, allocator)


if __name__ == "__main__":
    main()
