"""bench_shapes.py: `check <pid>` on heaps of different shapes, against LeakSanitizer (issue 25).

For each shape, bench/bench_target.c builds a heap of --size MiB (usable bytes) in --threads
threads with one leaked noise block every 1,000 allocations (up to --leaks), then the check
runs RUNS times, each in a fresh Python process (bench_check.py's ONE_CHECK), and the same
target built with -fsanitize=leak times LeakSanitizer's in-process check of the same heap
(__lsan_do_recoverable_leak_check(), RUNS times, timed inside the target). Prints per run and,
per shape, the medians: whole check, walk, mark, pause, peak RSS of checker + sweeper (and
against the bytes scanned), the mark's method, LeakSanitizer's time and the ratio.

    python bench/bench_shapes.py [--size 256|1024|4096] [--threads 8] [--runs 3]
                                 [--shapes list2,list1,...] [--old] [--no-lsan] [--lsan-cc CC]

Shapes (bench_target.c): list2 (a doubly linked list per thread: next + previous pointer,
only the head held), list1 (next only), tree (balanced binary trees), random2 (each block ->
2 random earlier ones, every block held from a table), flat (pointer-free blocks held from
the table), vectors (4 KiB arrays of 500 pointers to small nodes).
--old also runs each check with MEMUNREACHABLE_MARK=on-demand (the low-memory mark before
issue 25: a wave per level of the graph), alternating with the default (each first in turn):
before/after in one run.
Every check must find exactly the target's leaks. Heaps of 256 MiB and more take the
low-memory sweep (sweep/steps.py UNCOPIED_MIN_BYTES).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench_check import HERE, ONE_CHECK, ROOT, lsan_seconds

sys.path.insert(0, os.path.join(ROOT, "tests"))
import fixtures  # noqa: E402

SHAPES = ["list2", "list1", "tree", "random2", "flat", "vectors"]


def one_check(pid, method):
    env = dict(os.environ, PYTHONPATH=ROOT)
    if method:
        env["MEMUNREACHABLE_MARK"] = method
    else:
        env.pop("MEMUNREACHABLE_MARK", None)
    out = subprocess.run([sys.executable, "-c", ONE_CHECK, str(pid)], check=True,
                         capture_output=True, text=True, cwd=ROOT, env=env).stdout
    return json.loads(out)


def row(r):
    s = r["seconds"]
    return {"check": r["duration_ms"] / 1000, "walk": s.get("walk", 0), "mark": s.get("mark", 0),
            "pause": r["pause_ms"], "rss": (r["checker_rss"] + r["sweeper_rss"]) / 2**20,
            "scanned": r["bytes_scanned"] / 2**20}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=256, help="heap MiB (256, 1024, 4096)")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--leaks", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--old", action="store_true",
                    help="also MEMUNREACHABLE_MARK=on-demand, alternating (before/after)")
    ap.add_argument("--no-lsan", action="store_true")
    ap.add_argument("--lsan-cc", default="cc")
    args = ap.parse_args()
    fixtures.FIXTURE_DIR = HERE  # bench_target.c lives here
    fixtures.CFLAGS[0] = "-O2"
    fixtures.CFLAGS[-1] = os.path.join(ROOT, "fixtures")
    methods = {"": None} if not args.old else {"": None, "on-demand": "on-demand"}
    table = []
    for shape in args.shapes.split(","):
        target = [f"{args.size}M", str(args.threads), str(args.leaks), "0", shape]
        t0 = time.monotonic()
        fx = fixtures.start("bench_target", *target, timeout=900)
        print(f"\n{shape}: pid {fx.pid}, {args.size} MiB in {args.threads} threads, built in "
              f"{time.monotonic() - t0:.1f} s; expects {fx.expect}", flush=True)
        runs = {m: [] for m in methods}
        try:
            for i in range(args.runs):
                order = list(methods.items())       # alternating which goes first
                for label, method in order[::-1] if i % 2 else order:
                    r = one_check(fx.pid, method)
                    ok = (r["num_leaks"], r["leak_bytes"]) == (fx.expect["num_leaks"],
                                                               fx.expect["leak_bytes"])
                    d = row(r)
                    print(f"  {label or 'default'} run {i + 1}: check {d['check']:.2f} s, walk "
                          f"{d['walk']:.2f}, mark {d['mark']:.2f}, pause {d['pause']:.1f} ms, "
                          f"peak {d['rss']:.0f} MiB ({d['rss'] / d['scanned']:.2f}x of "
                          f"{d['scanned']:.0f} scanned), {r['mark_method']} "
                          f"({r['mark_waves']} waves), leaks {r['num_leaks']} "
                          f"{'ok' if ok else '!= expected'}", flush=True)
                    if not ok:
                        raise SystemExit(f"{shape}: wrong leaks {r['num_leaks']} "
                                         f"{r['leak_bytes']}, expected {fx.expect}")
                    runs[label].append(dict(d, method=r["mark_method"]))
        finally:
            fx.finish(timeout=300)
        lsan = (statistics.median(lsan_seconds(args.lsan_cc, target, args.runs))
                if not args.no_lsan else None)
        if lsan is not None:
            print(f"  LeakSanitizer: {lsan:.2f} s (median of {args.runs})", flush=True)
        for label, rows in runs.items():
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "method"}
            table.append((shape + (f" ({label})" if label else ""), med,
                          "/".join(sorted({r["method"] for r in rows})), lsan))
    print(f"\nmedians of {args.runs}, {args.size} MiB, {args.threads} threads:\n")
    print("| shape | check | walk | mark | pause | peak RSS (/ scanned) | mark method "
          "| LeakSanitizer | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, m, method, lsan in table:
        ls = f"{lsan:.2f} s | {m['check'] / lsan:.2f}x" if lsan else "- | -"
        print(f"| {name} | {m['check']:.2f} s | {m['walk']:.2f} s | {m['mark']:.2f} s | "
              f"{m['pause']:.1f} ms | {m['rss']:.0f} MiB ({m['rss'] / m['scanned']:.2f}x) | "
              f"{method} | {ls} |")


if __name__ == "__main__":
    main()
