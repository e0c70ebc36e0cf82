"""bench_track_pid.py: what `memunreachable track PID` costs a running process.

Workloads, each started normally (no preload), measured in windows of WINDOW seconds:
  churn    fixtures/track_pid_churn.c (4 threads allocating, checking and freeing blocks
           without pause, built -O2): operations per second before `track`, while tracked,
           and after `track --stop`
  python3  a CPython loop building and dropping dicts, strs and lists (the default allocator),
           iterations per second in the same three phases; python3-objects: tracked with
           --python-objects (CPython's object allocator routed too)
  attach   `track` of an idle fixture with THREADS threads (fixtures/threads_many.c): the
           pause every thread sees and the calling thread's, from track's own line

Prints medians of RUNS windows per phase and the ratios against untracked.

    python bench/bench_track_pid.py [--window 1.0] [--runs 3]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIXTURES = os.path.join(ROOT, "fixtures")
TRACK = [sys.executable, "-m", "memunreachable", "track"]

PY_WORK = r"""
import os, select, sys
n = 0
print("pid", os.getpid(), flush=True)
print("ready", flush=True)
while True:
    for i in range(2000):
        d = {"i": i, "s": str(i) * 3, "l": [i, i + 1]}
    n += 1
    if select.select([sys.stdin], [], [], 0)[0]:
        line = sys.stdin.readline()
        if line.startswith("quit"):
            break
        print("expect ops", n, flush=True)
        print("ready", flush=True)
print("bye", flush=True)
"""


class Target:
    """A process speaking the fixtures' handshake (pid, expect ops N, ready)."""

    def __init__(self, argv):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.pid = int(self._until_ready().get("pid", self.proc.pid))

    def _until_ready(self) -> dict:
        got = {}
        for line in self.proc.stdout:
            parts = line.split()
            if parts[:1] == ["ready"]:
                return got
            if parts[:1] == ["pid"]:
                got["pid"] = parts[1]
            elif parts[:2] == ["expect", "ops"]:
                got["ops"] = int(parts[2])
        raise RuntimeError(f"{self.proc.args}: no ready line")

    def ops(self) -> int:
        self.proc.stdin.write("ops\n")
        self.proc.stdin.flush()
        return self._until_ready()["ops"]

    def rate(self, window: float) -> float:
        a, t0 = self.ops(), time.monotonic()
        time.sleep(window)
        b, t1 = self.ops(), time.monotonic()
        return (b - a) / (t1 - t0)

    def quit(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=30)


def track(pid: int, *opts: str) -> str:
    done = subprocess.run(TRACK + list(opts) + [str(pid)], capture_output=True, text=True,
                          timeout=60)
    if done.returncode:
        raise RuntimeError(f"track {' '.join(opts)} {pid}: {done.stderr.strip()}")
    return done.stdout


def phases(target: Target, window: float, runs: int, *opts: str) -> dict:
    out = {"untracked": [target.rate(window) for _ in range(runs)]}
    track(target.pid, *opts)
    out["tracked"] = [target.rate(window) for _ in range(runs)]
    track(target.pid, "--stop")
    out["after --stop"] = [target.rate(window) for _ in range(runs)]
    target.quit()
    return {k: statistics.median(v) for k, v in out.items()}


def build(name: str, out_dir: str) -> str:
    exe = os.path.join(out_dir, name)
    subprocess.run(["cc", "-O2", "-I", FIXTURES, "-o", exe, os.path.join(FIXTURES, name + ".c"),
                    "-pthread"], check=True)
    return exe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for name, argv, opts in (("churn", [build("track_pid_churn", d)], ()),
                                 ("python3", [sys.executable, "-c", PY_WORK], ()),
                                 ("python3-objects", [sys.executable, "-c", PY_WORK],
                                  ("--python-objects",))):
            rates = phases(Target(argv), a.window, a.runs, *opts)
            base = rates["untracked"]
            print(f"{name:15} " + "  ".join(f"{k} {v:,.0f}/s ({base / v:.2f}x)"
                                           for k, v in rates.items()), flush=True)
        idle = Target([build("threads_many", d)])
        line = track(idle.pid)
        every = re.search(r"every thread paused ([\d.]+) ms", line)
        calls = re.search(r"then thread \d+ ([\d.]+) ms", line)
        threads = len(os.listdir(f"/proc/{idle.pid}/task"))
        print(f"attach   {threads} threads: every thread paused {every.group(1)} ms, the "
              f"calling thread {calls.group(1)} ms")
        idle.proc.stdin.write("quit\n")
        idle.proc.stdin.flush()
        idle.proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
