"""bench_pause.py: how long `check <pid>` stops the target, against one fork() of it (issue 10).

Starts bench/bench_pause_target.c (default: 32 threads, 50 MiB of heap in 64..1024-byte
blocks), then for each round asks the target to time one fork() of itself (glibc fork() and
a raw clone(SIGCHLD), call to return, timed inside the target) and runs one check in a
long-lived worker process (imports warm, like a service checking repeatedly). Per check it
records the main pause (first PTRACE_SEIZE to last PTRACE_DETACH: freeze + clone injection +
thaw), its parts, and the later one-thread reap pause. Prints medians and pause / fork.

    python bench/bench_pause.py [--heap-mb 50] [--threads 32] [--runs 15]
                                [--compare OTHER_CHECKOUT]

--compare runs the same rounds with a second checkout as well (its C core built in place,
see below), alternating, so before/after come from one run against one target.
Aims (issue 10): pause <= 1.3x one fork() of the target, <= 3 ms at 32 threads / 50 MiB.

Building another checkout's C core in place: `git archive REV | tar -x -C OTHER`, then in an
empty directory `cp -r OTHER/native . && python native/ffi_build.py && cp
memunreachable/_native*.so OTHER/memunreachable/` (cffi's compile reads the pyproject.toml of
the directory it runs in, and this setuptools rejects its license table).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import fixtures  # noqa: E402

# One worker per checkout: reads a pid per line, runs one check, prints one JSON line.
WORKER = r"""
import json, sys, time
from memunreachable.collect import freeze
from memunreachable import unreachable
seen = {}
_thaw = freeze.Frozen.thaw
def thaw(self):
    first = not self.thawed
    t = _thaw(self)
    if first:
        seen.setdefault("freezes", []).append(self)
    return t
freeze.Frozen.thaw = thaw
_take = unreachable.take_snapshot
def take(fz, **kw):
    t0 = time.monotonic()
    snap = _take(fz, **kw)
    seen["take_ms"] = (time.monotonic() - t0) * 1000
    seen["snap"] = snap
    return snap
unreachable.take_snapshot = take
for line in sys.stdin:
    seen.clear()
    info = unreachable.check(int(line), limit=None)
    main = [f for f in seen["freezes"] if len(f.threads) > 1][0]
    prep = getattr(main, "_prep", None)
    stop_ms = None
    if prep is not None and prep.args.t_seize_ns and prep.args.t_stopped_ns:
        stop_ms = (prep.args.t_stopped_ns - prep.args.t_seize_ns) / 1e6
    print(json.dumps({"pause_ms": main.pause_ms, "threads": len(main.threads),
                      "stop_ms": stop_ms, "take_ms": seen["take_ms"],
                      "inject_ms": seen["snap"].inject_ms,
                      "reap_pause_ms": seen["snap"].reap_pause_ms,
                      "steps": getattr(seen["snap"], "inject_steps_ms", {}),
                      "num_leaks": info.num_leaks, "retries": info.retries}), flush=True)
"""


def _worker(root):
    env = dict(os.environ, PYTHONPATH=root)
    return subprocess.Popen([sys.executable, "-c", WORKER], cwd=root, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=1)


def _med(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heap-mb", type=int, default=50)
    ap.add_argument("--threads", type=int, default=32)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--compare", help="another checkout of memunreachable (built in place)")
    ap.add_argument("--json", action="store_true", help="print every row as JSON too")
    args = ap.parse_args()

    fixtures.FIXTURE_DIR = HERE
    fixtures.CFLAGS[0] = "-O2"
    fixtures.CFLAGS[-1] = os.path.join(ROOT, "fixtures")
    fx = fixtures.start("bench_pause_target", str(args.heap_mb), str(args.threads), timeout=120)
    workers = {"this": _worker(ROOT)}
    if args.compare:
        workers["compare"] = _worker(os.path.abspath(args.compare))
    rows = {name: [] for name in workers}
    forks = []
    try:
        for rnd in range(args.runs + 1):            # round 0 warms up, not counted
            fx.proc.stdin.write(b"fork\n")
            fx.proc.stdin.flush()
            line = fx.proc.stdout.readline().decode().split()
            assert line[0] == "fork_us", line
            order = list(workers) if rnd % 2 == 0 else list(reversed(workers))
            for name in order:
                w = workers[name]
                w.stdin.write(f"{fx.pid}\n")
                w.stdin.flush()
                out = w.stdout.readline()
                if not out:
                    raise SystemExit(f"worker {name} died")
                row = json.loads(out)
                if rnd:
                    rows[name].append(row)
                if row["threads"] != args.threads:
                    raise SystemExit(f"{name}: froze {row['threads']} threads, not {args.threads}")
            if rnd:
                forks.append((float(line[1]) / 1000, float(line[2]) / 1000))
    finally:
        for w in workers.values():
            w.stdin.close()
            w.wait()
        fx.finish()
    fork_ms = statistics.median(f[0] for f in forks)
    clone_ms = statistics.median(f[1] for f in forks)
    print(f"target: {args.threads} threads, {args.heap_mb} MiB heap; {args.runs} checks each; "
          f"fork() in the target: median {fork_ms:.2f} ms (raw clone {clone_ms:.2f} ms)")
    print(f"{'checkout':10s} {'pause':>8s} {'p90':>7s} {'xfork':>6s} {'stop':>7s} {'snapshot':>9s} "
          f"{'inject':>7s} {'reap':>7s}")
    for name, rs in rows.items():
        pauses = sorted(r["pause_ms"] for r in rs)
        p90 = pauses[min(len(pauses) - 1, int(0.9 * len(pauses)))]
        print(f"{name:10s} {_med(rs, 'pause_ms'):7.2f}ms {p90:6.2f}ms {_med(rs, 'pause_ms') / fork_ms:5.2f}x "
              f"{_med(rs, 'stop_ms'):6.2f}ms {_med(rs, 'take_ms'):8.2f}ms {_med(rs, 'inject_ms'):6.2f}ms "
              f"{_med(rs, 'reap_pause_ms'):6.2f}ms")
        steps = {k: statistics.median(r["steps"][k] for r in rs if k in r.get("steps", {}))
                 for k in (rs[0].get("steps") or {})}
        if steps:
            print("           inject steps (median ms): " +
                  ", ".join(f"{k} {v:.3f}" for k, v in steps.items()))
        if args.json:
            for r in rs:
                print(json.dumps(r))
    print("pause: first SEIZE to last DETACH; stop: first SEIZE to last stop collected (C); "
          "snapshot: take_snapshot() (reap leftovers, choose thread, inject); inject: the "
          "clone injection; reap: the later one-thread pause that reaps the clone")


if __name__ == "__main__":
    main()
