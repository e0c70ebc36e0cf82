"""bench_cpython_map.py: how long reading CPython's memory map takes on a big Python heap.

Starts a Python target holding N live small objects (default 1,000,000 bytes objects of
1-3 distinct size classes, plus 1,000 tuples), freezes it, and times walk_cpython() through
/proc/PID/mem (the frozen target, as the snapshot would be read). Prints per interpreter:
used blocks found, pools, pymalloc bytes copied, the walk time (median of RUNS) and, for
3.12+, the pool-scan alternative (the method 3.8-3.11 use) on the same heap.

    python bench/bench_cpython_map.py [--objects 1000000] [--runs 3] [python ...]
"""
import argparse
import os
import statistics
import subprocess
import sys
import time


sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from interpreters import pyenv_pythons  # noqa: E402
from memunreachable.heaps.cpython import obmalloc
from memunreachable.heaps.cpython.walker import walk_cpython
from memunreachable.collect.freeze import frozen
from memunreachable.collect.memory import ProcessMemory

PYTHONS = pyenv_pythons()          # {"3.N": pyenv's newest 3.N.x} (tests/interpreters.py)
DEFAULT = [PYTHONS[v] for v in sorted(PYTHONS, key=lambda v: int(v.split(".")[1]))
           if int(v.split(".")[1]) >= 8] + ["/usr/bin/python3"]

TARGET = r"""
import os, sys
n = int(sys.argv[1])
keep = [b"%d" % i for i in range(n)]
tuples = [(i, i + 1) for i in range(1000)]
os.write(1, b"ready\n")
os.read(0, 1)
"""


def one(python, n, runs):
    p = subprocess.Popen([python, "-c", TARGET, str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"ready\n"
        times, scan_times = [], []
        for _ in range(runs):
            with frozen(p.pid) as fz, ProcessMemory(p.pid) as mem:
                t0 = time.perf_counter()
                cm = walk_cpython(mem, fz.maps, fz.threads, p.pid)
                times.append(time.perf_counter() - t0)
                if cm.usable and cm.pymalloc.method == "arenas":
                    t0 = time.perf_counter()
                    scan = obmalloc.scan_pools(mem, fz.maps, cm.layout)
                    scan_times.append(time.perf_counter() - t0)
                    assert list(scan.blocks) == list(cm.blocks)
        copied = sum(len(b) for _, b in cm.regions)
        line = (f"{os.path.basename(python):12s} {'%d.%d' % cm.version if cm.version else '?':5s} "
                f"usable={cm.usable!s:5s} method={cm.stats.get('method', '-'):9s} "
                f"blocks={len(cm.blocks):>9,d} pools={cm.stats.get('pools', 0):>6,d} "
                f"copied={copied / 2**20:7.1f} MiB walk={statistics.median(times) * 1000:7.1f} ms")
        if scan_times:
            line += f" (pool scan: {statistics.median(scan_times) * 1000:.1f} ms)"
        print(line, flush=True)
        for w in cm.warnings:
            print("   warning:", w)
    finally:
        p.stdin.close()
        p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("pythons", nargs="*", default=DEFAULT)
    a = ap.parse_args()
    print(f"{a.objects:,d} live small objects per target, median of {a.runs} runs")
    for py in a.pythons:
        one(py, a.objects, a.runs)


if __name__ == "__main__":
    main()
