"""bench_inprocess.py: in-process check of a Python process with ~200 MB of heap.

Runs itself in a child interpreter with PYTHONMALLOC=malloc (Python objects are then glibc
heap blocks: the documented precise setting), builds ~200 MB of live objects, then calls
memunreachable.get_unreachable_memory(limit=0) RUNS times and prints the caller's pause
(all its threads stopped) and the whole call's time, per run and as medians.
Aims (issue 3): pause < 10 ms, total < 1 s.

    python bench/bench_inprocess.py [--mb 200] [--runs 5]
"""
import argparse
import os
import statistics
import subprocess
import sys
import time


def child(mb: int, runs: int) -> None:
    import memunreachable
    blocks = [bytes(180) + i.to_bytes(8, "little") for i in range(mb * 1024 * 1024 // 256)]
    links = {i: blocks[i] for i in range(0, len(blocks), 7)}        # pointer-heavy dict too
    pauses, totals = [], []
    for i in range(runs):
        t0 = time.monotonic()
        info = memunreachable.get_unreachable_memory(limit=0)
        total = time.monotonic() - t0
        pauses.append(info.pause_ms)
        totals.append(total)
        print(f"run {i + 1}: caller paused {info.pause_ms:.2f} ms, call took {total:.3f} s "
              f"(check {info.duration_ms / 1000:.3f} s), {info.num_allocations} allocations, "
              f"{info.allocation_bytes / 1e6:.0f} MB, {info.num_leaks} unreachable")
    print(f"\nmedians over {runs} runs: pause {statistics.median(pauses):.2f} ms (aim < 10 ms), "
          f"total {statistics.median(totals):.3f} s (aim < 1 s)")
    del links, blocks


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.mb, args.runs)
        return
    env = dict(os.environ, PYTHONMALLOC="malloc")
    sys.exit(subprocess.call([sys.executable, __file__, "--child", "--mb", str(args.mb),
                              "--runs", str(args.runs)], env=env))


if __name__ == "__main__":
    main()
