"""bench_check.py: end-to-end figures for `check <pid>` on a large heap.

Starts bench/bench_target.c (default: 8 threads, 5,000,000 live blocks, ~1 GiB of heap,
1,000 leaked blocks), runs the check RUNS times, each in a fresh Python process, and prints
per-run figures and medians: target pause (ms), whole check (s), mark throughput (GB/s of
bytes scanned per second of mark), and peak RSS of checker + sweeper against bytes scanned.
It also verifies every run found exactly the leaks the target reports.

    python bench/bench_check.py [--blocks 5000000] [--threads 8] [--leaks 1000] [--runs 5]
                                [--dense] [--compare OTHER_CHECKOUT] [--lsan] [--lsan-cc CC]

--dense fills every word of every block with a pointer into an earlier block (the start or
8/16 bytes inside it): about 26 references per block instead of 1, the worst case of the
low-memory sweep's reference candidates and of the mark.

--compare runs as many checks with a second checkout (its C core built in place, see
bench_pause.py), alternating with this one, against the same target: before/after from one
run. --lsan then builds the same target with -fsanitize=leak and times LeakSanitizer's
in-process check of its heap (__lsan_do_recoverable_leak_check(), RUNS times).
Aims (issue 2): pause < 15 ms, check < 3 s, peak RSS (checker + sweeper) < 1.5x bytes scanned.
Aim (issue 10): the whole check no slower than LeakSanitizer's; peak RSS (checker + sweeper)
at most 0.5x bytes scanned (the low-memory sweep, heaps of 64 MiB or more).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import fixtures  # noqa: E402

ONE_CHECK = r"""
import json, resource, sys, time
from memunreachable.unreachable import check
info = check(int(sys.argv[1]), limit=None)
from memunreachable.sweep.sweeper import join_reapers
join_reapers()      # the sweeper is reaped in the background: its peak RSS counts only then
self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
child_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
s = info.stats
print(json.dumps({
    "pause_ms": info.pause_ms, "duration_ms": info.duration_ms, "snapshot_ms": info.snapshot_ms,
    "num_allocations": info.num_allocations, "allocation_bytes": info.allocation_bytes,
    "num_leaks": info.num_leaks, "leak_bytes": info.leak_bytes, "entries": len(info.leaks),
    "bytes_scanned": info.bytes_scanned, "seconds": s.get("seconds", {}),
    "retries": info.retries, "checker_rss": self_kb * 1024, "sweeper_rss": child_kb * 1024,
    "mark_method": s.get("mark_method"), "mark_waves": s.get("mark_waves"),
    "mark_switch_reason": s.get("mark_switch_reason"),
}))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=5_000_000)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--leaks", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dense", action="store_true", help="every word of every block a pointer")
    ap.add_argument("--compare", help="another checkout of memunreachable (built in place)")
    ap.add_argument("--lsan", action="store_true", help="time LeakSanitizer's check too")
    ap.add_argument("--lsan-cc", default="cc", help="compiler of the LeakSanitizer build "
                    "(cc: gcc's liblsan; clang-14 needs libclang-rt-14-dev)")
    args = ap.parse_args()
    checkouts = {"this": ROOT}
    if args.compare:
        checkouts["compare"] = os.path.abspath(args.compare)

    fixtures.FIXTURE_DIR = HERE  # bench_target.c lives here
    fixtures.CFLAGS[0] = "-O2"
    fixtures.CFLAGS[-1] = os.path.join(ROOT, "fixtures")
    t0 = time.monotonic()
    fx = fixtures.start("bench_target", str(args.blocks), str(args.threads), str(args.leaks),
                        str(int(args.dense)), timeout=600)
    print(f"target pid {fx.pid}: {args.blocks} blocks in {args.threads} threads, "
          f"built in {time.monotonic() - t0:.1f} s; expects {fx.expect}")
    runs = {k: [] for k in checkouts}
    try:
        for i in range(args.runs):
            for name, root in checkouts.items():
                env = dict(os.environ, PYTHONPATH=root)
                out = subprocess.run([sys.executable, "-c", ONE_CHECK, str(fx.pid)], check=True,
                                     capture_output=True, text=True, cwd=root, env=env).stdout
                r = json.loads(out)
                runs[name].append(r)
                _print_run(f"{name} run {i + 1}" if args.compare else f"run {i + 1}", r, fx.expect)
    finally:
        fx.finish(timeout=120)
    for name, rows in runs.items():
        _print_medians(name if args.compare else "", rows)
    if args.lsan:
        _lsan(args)


def _print_run(label, r, expect):
    mark_s = r["seconds"].get("mark", 0) or 1e-9
    rss = r["checker_rss"] + r["sweeper_rss"]
    ok = (r["num_leaks"], r["leak_bytes"]) == (expect["num_leaks"], expect["leak_bytes"])
    print(f"{label}: pause {r['pause_ms']:.2f} ms, check {r['duration_ms'] / 1000:.2f} s, "
          f"walk {r['seconds'].get('walk', 0):.2f} s, mark {mark_s:.2f} s "
          f"({r['bytes_scanned'] / mark_s / 1e9:.2f} GB/s), fold {r['seconds'].get('fold', 0):.2f} s, "
          f"allocations {r['num_allocations']}, heap {r['allocation_bytes'] / 2**20:.0f} MiB, "
          f"scanned {r['bytes_scanned'] / 2**20:.0f} MiB, peak RSS {rss / 2**20:.0f} MiB "
          f"(checker {r['checker_rss'] / 2**20:.0f} + sweeper {r['sweeper_rss'] / 2**20:.0f}) "
          f"({rss / r['bytes_scanned']:.2f}x scanned), leaks {r['num_leaks']} "
          f"{'== expected' if ok else '!= expected ' + str(expect)}, retries {r['retries']}")


def _print_medians(name, runs):
    def med(f):
        return statistics.median(f(r) for r in runs)

    print(f"\n{name + ': ' if name else ''}medians over {len(runs)} runs:")
    print(f"  pause            {med(lambda r: r['pause_ms']):8.2f} ms   (aim < 15 ms)")
    print(f"  whole check      {med(lambda r: r['duration_ms']) / 1000:8.2f} s    (aim < 3 s)")
    for stage in ("walk", "mark", "fold"):
        print(f"  {stage:16s} {med(lambda r: r['seconds'].get(stage, 0)):8.2f} s")
    print(f"  mark throughput  {med(lambda r: r['bytes_scanned'] / max(r['seconds'].get('mark', 0), 1e-9)) / 1e9:8.2f} GB/s")
    print(f"  peak RSS ratio   {med(lambda r: (r['checker_rss'] + r['sweeper_rss']) / r['bytes_scanned']):8.2f} x bytes scanned (aim < 1.5)")
    print(f"  snapshot lived   {med(lambda r: r['snapshot_ms']):8.1f} ms")


def lsan_seconds(cc, target_args, runs):
    """LeakSanitizer's in-process check of bench_target's heap (built -fsanitize=leak, timed
    inside the target: __lsan_do_recoverable_leak_check() `runs` times): the seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "bench_target_lsan")
        subprocess.run([cc, "-O2", "-g", "-fsanitize=leak", "-DBENCH_LSAN",
                        "-I", os.path.join(ROOT, "fixtures"), "-o", exe,
                        os.path.join(HERE, "bench_target.c"), "-lpthread"], check=True)
        env = dict(os.environ, LSAN_RUNS=str(runs))
        out = subprocess.run([exe, *target_args], env=env, capture_output=True, text=True).stdout
    return [float(line.split()[1]) for line in out.splitlines() if line.startswith("lsan_seconds")]


def _lsan(args):
    """LeakSanitizer's in-process check of the same heap (bench_target.c built -fsanitize=leak)."""
    secs = lsan_seconds(args.lsan_cc, [str(args.blocks), str(args.threads), str(args.leaks),
                                       str(int(args.dense))], args.runs)
    print(f"\nLeakSanitizer's check of the same heap ({args.lsan_cc}): "
          f"{', '.join(f'{s:.2f}' for s in secs)} s, "
          f"median {statistics.median(secs):.2f} s")

if __name__ == "__main__":
    main()
