"""bench_startup.py: wall time of the whole `memunreachable check PID` command on a small C
process (issue 10, fast start: at most 150 ms).

Starts fixtures/leak_one.c (one thread, 4 allocations, one leak), then runs
`python -m memunreachable check PID` RUNS times in fresh interpreters and prints the median,
min and max wall time (process start to exit), next to a bare `python -c pass` (the
interpreter's own start-up) and the number of modules the command imports. Every run must
exit 23 and print the same report (timings and addresses aside).

    python bench/bench_startup.py [--runs 10] [--compare OTHER_CHECKOUT]

--compare alternates with a second checkout (its C core built in place, as bench_pause.py
says), so before/after come from one run. Byte-compile both first (`python -m compileall -q memunreachable`): an
installed package has its .pyc files, and PYTHONDONTWRITEBYTECODE=1 environments never
write them.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import fixtures  # noqa: E402

VOLATILE = re.compile(r"\d+(\.\d+)? ms|pid \d+|[0-9a-f]{8,}")


def _run(cmd, env, cwd=None):
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=cwd)
    return (time.monotonic() - t0) * 1000.0, proc


def _modules(root, pid):
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "memunreachable", "check",
                           str(pid)], env=env, capture_output=True, text=True, cwd=root)
    return sum(1 for line in proc.stderr.splitlines() if line.startswith("import time:")) - 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--compare", help="another checkout of memunreachable (built in place)")
    args = ap.parse_args()
    roots = {"this": ROOT}
    if args.compare:
        roots["compare"] = os.path.abspath(args.compare)
    times = {name: [] for name in roots}
    bare = []
    reports = {}
    with fixtures.start("leak_one") as fx:
        for rnd in range(args.runs + 1):            # round 0 warms the page cache
            t, _ = _run([sys.executable, "-c", "pass"], dict(os.environ))
            if rnd:
                bare.append(t)
            order = list(roots) if rnd % 2 == 0 else list(reversed(roots))
            for name in order:
                env = dict(os.environ, PYTHONPATH=roots[name])
                # cwd too: `python -m` puts the working directory first on sys.path
                t, proc = _run([sys.executable, "-m", "memunreachable", "check", str(fx.pid)], env,
                               cwd=roots[name])
                if proc.returncode != 23:
                    raise SystemExit(f"{name}: exit {proc.returncode}: {proc.stderr}")
                report = VOLATILE.sub("#", proc.stdout)
                if reports.setdefault(name, report) != report:
                    raise SystemExit(f"{name}: the report changed between runs")
                if rnd:
                    times[name].append(t)
        mods = {name: _modules(root, fx.pid) for name, root in roots.items()}
    same = len(set(reports.values())) == 1
    print(f"`python -m memunreachable check PID` on leak_one, {args.runs} runs each; "
          f"`python -c pass`: median {statistics.median(bare):.0f} ms")
    for name, ts in times.items():
        print(f"{name:8s} median {statistics.median(ts):6.0f} ms  min {min(ts):5.0f}  "
              f"max {max(ts):5.0f}  modules imported {mods[name]}")
    if len(roots) > 1:
        print("reports identical (timings, pids and addresses aside):", same)


if __name__ == "__main__":
    main()
