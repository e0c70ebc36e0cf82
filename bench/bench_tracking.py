"""bench_tracking.py: the cost of `memunreachable run` (allocation tracking) against no
tracking and against heaptrack, on the same workloads in one run.

Workloads:
  churn    bench/bench_tracking.c built -O2 -fomit-frame-pointer: THREADS threads x ITERS
           malloc/free pairs (16-255 bytes, 64-slot window), each malloc at call depth 5-12
  python3  /usr/bin/python3 building ~300k objects (100k dicts + 100k str + 100k lists) and
           dropping them, ROUNDS times (default allocator: pymalloc, as people run it)
  python3-malloc  the same under PYTHONMALLOC=malloc (every object through malloc)
  hold     N live 32-byte blocks: table memory per live block (RSS tracked - untracked)

Configurations: untracked; tracked with each unwinder (libunwind = the default, libgcc,
fp); heaptrack (Debian package `heaptrack`; installed with apt-get if missing, and the
bench says so when it cannot be run). Each is run RUNS times; the table shows the fastest
wall time and the least CPU time (user+sys, descendants included: heaptrack_interpret)
(least disturbed on a shared machine), the slowdowns against untracked and max RSS.

    python bench/bench_tracking.py [--threads 4] [--iters 500000] [--rounds 3] [--runs 3]

Goal (issue 9): cheaper than heaptrack on both workloads, at most 1.5x untracked on python3.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LIB = os.path.join(ROOT, "memunreachable", "_track.so")
PY_WORK = """
import sys
for r in range(int(sys.argv[1])):
    objs = [{"i": i, "s": str(i) * 3, "l": [i, i + 1]} for i in range(100000)]
    del objs
"""


def build(tmp: str) -> str:
    exe = os.path.join(tmp, "bench_tracking")
    subprocess.check_call(["cc", "-O2", "-g", "-fomit-frame-pointer", "-o", exe,
                           os.path.join(HERE, "bench_tracking.c"), "-pthread"])
    return exe


def heaptrack_path() -> str:
    path = shutil.which("heaptrack")
    if path:
        return path
    print("heaptrack is not installed: trying apt-get install -y heaptrack")
    try:
        subprocess.run(["apt-get", "install", "-y", "heaptrack"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"HEAPTRACK COULD NOT BE INSTALLED ({exc}): its column is left empty")
        return ""
    return shutil.which("heaptrack") or ""


def timed(cmd, env) -> tuple:
    """(wall seconds, max RSS bytes of the biggest process, CPU seconds user+sys of the
    process and its reaped descendants) of one run."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cmd} failed ({status}): {err[-2000:]}")
    return wall, ru.ru_maxrss * 1024, ru.ru_utime + ru.ru_stime


def configs(heaptrack: str, tmp: str):
    base = dict(os.environ)
    base.pop("LD_PRELOAD", None)
    out = [("untracked", [], base)]
    for unw in ("libunwind", "libgcc", "fp"):
        env = dict(base, LD_PRELOAD=LIB, MEMUNREACHABLE_UNWINDER=unw)
        out.append((f"tracked ({unw})", [], env))
    if heaptrack:
        out.append(("heaptrack", [heaptrack, "-o", os.path.join(tmp, "ht")], base))
    return out


def hold_memory(exe: str, n: int) -> tuple:
    """(RSS untracked, RSS tracked) of a process holding n live blocks, in bytes."""
    res = []
    for env_extra in ({}, {"LD_PRELOAD": LIB}):
        env = dict(os.environ)
        env.pop("LD_PRELOAD", None)
        env.update(env_extra)
        proc = subprocess.Popen([exe, "hold", str(n)], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)
        assert proc.stdout.readline().strip() == b"held"
        with open(f"/proc/{proc.pid}/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
        proc.stdin.close()
        proc.wait()
        res.append(rss)
    return tuple(res)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--iters", type=int, default=500_000, help="malloc/free pairs per thread")
    ap.add_argument("--rounds", type=int, default=3, help="python3: build/drop rounds")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--hold", type=int, default=1_000_000)
    ap.add_argument("--no-heaptrack", action="store_true")
    args = ap.parse_args()
    if not os.path.exists(LIB):
        sys.exit(f"{LIB} is missing: pip install -e . first")
    tmp = tempfile.mkdtemp(prefix="mu-bench-tracking-")
    exe = build(tmp)
    heaptrack = "" if args.no_heaptrack else heaptrack_path()
    if not heaptrack:
        print("NOTE: no heaptrack figures in this run")
    py = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    script = os.path.join(tmp, "objects.py")
    with open(script, "w") as f:
        f.write(PY_WORK)
    workloads = [
        (f"churn: {args.threads} threads x {args.iters} malloc/free, depth 5-12",
         [exe, "churn", str(args.threads), str(args.iters)], {}),
        (f"python3: 3 x 100k objects built and dropped, x{args.rounds}",
         [py, script, str(args.rounds)], {}),
        (f"python3 PYTHONMALLOC=malloc: same", [py, script, str(args.rounds)],
         {"PYTHONMALLOC": "malloc"}),
    ]
    print(f"{os.cpu_count()} cpus; {py}; heaptrack: {heaptrack or 'none'}; best of {args.runs}")
    for title, cmd, extra in workloads:
        print(f"\n{title}")
        print(f"  {'configuration':22} {'wall s':>8} {'x untracked':>12} {'CPU s':>7} "
              f"{'x untracked':>12} {'max RSS MB':>11}")
        ref = ref_cpu = None
        for name, prefix, env in configs(heaptrack, tmp):
            env = dict(env, **extra)
            runs = [timed(prefix + cmd, env) for _ in range(args.runs)]
            wall = min(r[0] for r in runs)
            cpu = min(r[2] for r in runs)
            rss = max(r[1] for r in runs)
            ref, ref_cpu = ref or wall, ref_cpu or cpu
            print(f"  {name:22} {wall:8.3f} {wall / ref:12.2f} {cpu:7.3f} {cpu / ref_cpu:12.2f} "
                  f"{rss / 1e6:11.1f}")
    plain, tracked = hold_memory(exe, args.hold)
    print(f"\nhold: {args.hold} live 32-byte blocks, one stack: RSS untracked {plain / 1e6:.1f} MB,"
          f" tracked {tracked / 1e6:.1f} MB: {(tracked - plain) / args.hold:.1f} bytes of table per"
          f" live block")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
