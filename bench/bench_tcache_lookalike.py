"""bench_tcache_lookalike.py: cost of telling real tcaches from look-alike blocks (issue 7).

Starts fixtures/lookalike_tcache.c with N extra application blocks shaped like glibc's
tcache_perthread_struct (640 bytes: uint16 counts + list heads, each with one node of the
bin's size), freezes it, and times walk_heap RUNS times (median). The walk must not get a
per-block cliff: 20,000 look-alikes used to cost 14.6 s (0.7 ms each).

    python bench/bench_tcache_lookalike.py [--blocks 20000] [--runs 3]
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import fixtures  # noqa: E402
from memunreachable.collect.freeze import frozen  # noqa: E402
from memunreachable.heaps.glibc.walker import walk_heap  # noqa: E402
from memunreachable.collect.memory import ProcessMemory  # noqa: E402


def time_walk(blocks: int, runs: int):
    with fixtures.start("lookalike_tcache", str(blocks), "free", timeout=120) as fx:
        times, cpu = [], []
        for _ in range(runs):
            with frozen(fx.pid) as fz, ProcessMemory(fx.pid) as mem:
                t, c = time.perf_counter(), time.process_time()
                hw = walk_heap(mem, fz.maps, fz.threads, fx.pid)
                times.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
        assert fx.blocks["live_cache"].address not in hw.stats["tcaches"]
        assert len(hw.stats["tcaches"]) == 1
        return (statistics.median(times), statistics.median(cpu), len(hw.image.begins),
                hw.stats.get("tcache_candidates"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    for n in (0, a.blocks):
        dt, cpu, allocs, cands = time_walk(n, a.runs)
        print(f"look-alikes {n:6d}: walk {dt * 1000:8.1f} ms wall, {cpu * 1000:8.1f} ms CPU "
              f"(medians of {a.runs}), {allocs} allocations, {cands} tcache candidates")


if __name__ == "__main__":
    main()
