"""bench_shapes.py: `check <pid>` on heaps of different shapes, against LeakSanitizer (issue 25).

For each size and shape, a target builds its heap and parks; the check runs RUNS times, each in
a fresh Python process (bench_check.py's ONE_CHECK), and the heap's mappings are read once
(1 MiB preads of /proc/PID/mem into one buffer: the floor of any check that reads the heap).
Then LeakSanitizer's in-process check of the same heap is timed RUNS times inside a second
target built or run under LeakSanitizer. Prints per run and, per size, a table of medians:
whole check, walk, mark, pause, peak RSS of checker + sweeper (and against the bytes scanned),
the mark's method, the heap read once, LeakSanitizer's time, the check against both, and the
slowest shape's check against the fastest's.

    python bench/bench_shapes.py [--sizes 256,1024] [--huge] [--threads 8] [--runs 3]
                                 [--shapes list2,list1,...] [--old] [--no-lsan] [--lsan-cc CC]
                                 [--python PYTHON,...] [--compare OTHER_CHECKOUT]

--huge adds 4096 MiB (about 10 minutes a shape; the machine needs twice that in RAM).
C shapes (bench_target.c, one leaked noise block every 1,000 allocations, up to --leaks):
list2 (a doubly linked list per thread: next + previous pointer, only the head held), list1
(next only), tree (balanced binary trees), random2 (each block -> 2 random earlier ones, every
block held from a table), flat (pointer-free blocks held from the table), vectors (4 KiB
arrays of 500 pointers to small nodes), holes (random2 with every other block freed: half the
heap free chunks, in tcaches, fastbins and the unsorted bin). Their LeakSanitizer target is bench_target.c built
-fsanitize=leak (__lsan_do_recoverable_leak_check()).
Python shapes: a PYTHON process holding 1 M objects per 256 MiB of --size (each a list holding
one 150-byte bytes object: 3 blocks; no leak), under pymalloc (python) or PYTHONMALLOC=malloc
(python-malloc). Their LeakSanitizer run is the same script under PYTHONMALLOC=malloc with gcc's
liblsan preloaded (LeakSanitizer sees no pymalloc object: its arenas are mmapped, so pymalloc
cannot be compared; both Python rows are compared with the malloc heap's check). --python takes
several interpreters (comma-separated; each gets its rows, "python [SPEC]"): host paths, or
ROOT:python3.X for a Debian root's (tests/distros.py: trixie:python3.13, sid:python3.14), whose
LeakSanitizer run needs liblsan0 installed in the root (else its column is "-").
--old also runs each check with MEMUNREACHABLE_MARK=on-demand (the low-memory mark before
issue 25: a wave per level of the graph), alternating with the default (each first in turn).
--compare runs each check with another checkout as well (with its own .venv's interpreter
when it has one, `python3 -m venv .venv && .venv/bin/pip install -e .` there: this checkout's
editable install would give its Python code this C core; else its C core built in place, see
bench_pause.py), alternating the same way: before/after against the same targets.
Every check must find exactly the target's leaks. Heaps of 64 MiB and more take the
low-memory sweep (sweep/steps.py UNCOPIED_MIN_BYTES); a Python process is swept from copies.
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
import distros  # noqa: E402
import fixtures  # noqa: E402

SHAPES = ["list2", "list1", "tree", "random2", "flat", "vectors", "holes", "python",
          "python-malloc"]
LIBLSAN = "/usr/lib/x86_64-linux-gnu/liblsan.so.0"
PY_OBJECTS_PER_256M = 1_000_000

PY_TARGET = r"""
import os, sys
objs = [[b"%0150d" % i] for i in range(int(sys.argv[1]))]
runs = int(os.environ.get("LSAN_RUNS", "0"))
if runs:            # under LeakSanitizer (liblsan preloaded): time its check, then leave
    import ctypes, time
    check = ctypes.CDLL(None).__lsan_do_recoverable_leak_check
    for _ in range(runs):
        t = time.monotonic()
        found = check()
        print("lsan_seconds %.3f leaks_found %d" % (time.monotonic() - t, found), flush=True)
    os._exit(0)
print("ready", flush=True)
sys.stdin.readline()
"""


class PyTarget:
    """A Python process holding n objects (PY_TARGET), parked until finish(); python is an
    interpreter spec (distros.python_argv: a path or ROOT:python3.X)."""

    def __init__(self, python, n, malloc):
        env = dict(os.environ)
        env.pop("PYTHONMALLOC", None)
        if malloc:
            env["PYTHONMALLOC"] = "malloc"
        self.proc = subprocess.Popen(distros.python_argv(python) + ["-c", PY_TARGET, str(n)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        if self.proc.stdout.readline() != b"ready\n":
            raise SystemExit(f"{python}: the Python target did not start")
        self.pid = self.proc.pid
        self.expect = {"num_leaks": 0, "leak_bytes": 0}

    def finish(self, timeout):
        self.proc.communicate(b"\n", timeout=timeout)


def py_lsan_seconds(python, n, runs):
    """LeakSanitizer's check of PY_TARGET's heap (PYTHONMALLOC=malloc, liblsan preloaded), or
    None for a root's interpreter when the root lacks liblsan."""
    root, name = distros.spec_root(python)
    if not os.path.exists((root or "") + LIBLSAN):
        if root is None:
            raise SystemExit(f"{LIBLSAN} is missing: apt-get install liblsan0 (or use --no-lsan)")
        print(f"  LeakSanitizer: {LIBLSAN} is missing in the {name} root "
              f"(chroot {root} apt-get install liblsan0)", flush=True)
        return None
    env = dict(os.environ, PYTHONMALLOC="malloc", LD_PRELOAD=LIBLSAN, LSAN_RUNS=str(runs))
    out = subprocess.run(distros.python_argv(python) + ["-c", PY_TARGET, str(n)], env=env,
                         capture_output=True, text=True).stdout
    return [float(line.split()[1]) for line in out.splitlines() if line.startswith("lsan_seconds")]


def read_once(pid):
    """(seconds, bytes) to read the process's heap mappings (writable private anonymous ones
    and [heap]) once, 1 MiB preads into one buffer."""
    ranges = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            name = parts[5] if len(parts) > 5 else ""
            if parts[1].startswith("rw") and parts[1][3] == "p" and name in ("", "[heap]"):
                b, e = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((b, e))
    buf = bytearray(1 << 20)
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    total = 0
    t0 = time.monotonic()
    try:
        for b, e in ranges:
            for a in range(b, e, len(buf)):
                n = min(len(buf), e - a)
                try:
                    total += os.preadv(fd, [memoryview(buf)[:n]], a)
                except OSError:
                    pass            # a guard page
    finally:
        os.close(fd)
    return time.monotonic() - t0, total


def one_check(pid, method, root=ROOT):
    env = dict(os.environ, PYTHONPATH=root)
    if method:
        env["MEMUNREACHABLE_MARK"] = method
    else:
        env.pop("MEMUNREACHABLE_MARK", None)
    # another checkout's own .venv when it has one: under this one's editable install, its
    # Python code would load this checkout's C core
    python = os.path.join(root, ".venv", "bin", "python")
    if root == ROOT or not os.path.exists(python):
        python = sys.executable
    out = subprocess.run([python, "-c", ONE_CHECK, str(pid)], check=True,
                         capture_output=True, text=True, cwd=root, env=env).stdout
    return json.loads(out)


def row(r):
    s = r["seconds"]
    return {"check": r["duration_ms"] / 1000, "walk": s.get("walk", 0), "mark": s.get("mark", 0),
            "pause": r["pause_ms"], "rss": (r["checker_rss"] + r["sweeper_rss"]) / 2**20,
            "scanned": r["bytes_scanned"] / 2**20}


def start(shape, size, args, python=None):
    """(target, LeakSanitizer's seconds-getter) for a shape of size MiB (a Python shape's under
    the interpreter spec python)."""
    if shape.startswith("python"):
        n = PY_OBJECTS_PER_256M * size // 256
        return (PyTarget(python, n, shape == "python-malloc"),
                lambda: py_lsan_seconds(python, n, args.runs))
    target = [f"{size}M", str(args.threads), str(args.leaks), "0", shape]
    return (fixtures.start("bench_target", *target, timeout=1800),
            lambda: lsan_seconds(args.lsan_cc, target, args.runs))


def bench_shape(shape, size, args, methods, python=None, named=False):
    """Runs one shape: [(label, medians, methods, lsan)]. python: a Python shape's interpreter
    spec, named in its label (shape [python]) when named."""
    t0 = time.monotonic()
    fx, lsan_of = start(shape, size, args, python)
    if named and python:
        shape = f"{shape} [{python}]"
    print(f"\n{shape}: pid {fx.pid}, {size} MiB, built in {time.monotonic() - t0:.1f} s; "
          f"expects {fx.expect}", flush=True)
    runs = {m: [] for m in methods}
    try:
        reads = [read_once(fx.pid) for _ in range(args.runs)]
        read_s = statistics.median(s for s, _ in reads)
        print(f"  heap read once: {read_s:.2f} s ({reads[0][1] / 2**20:.0f} MiB)", flush=True)
        for i in range(args.runs):
            order = list(methods.items())       # alternating which goes first
            for label, (method, root) in order[::-1] if i % 2 else order:
                r = one_check(fx.pid, method, root)
                ok = (r["num_leaks"], r["leak_bytes"]) == (fx.expect["num_leaks"],
                                                           fx.expect["leak_bytes"])
                d = row(r)
                print(f"  {label or 'default'} run {i + 1}: check {d['check']:.2f} s, walk "
                      f"{d['walk']:.2f}, mark {d['mark']:.2f}, pause {d['pause']:.1f} ms, "
                      f"peak {d['rss']:.0f} MiB ({d['rss'] / d['scanned']:.2f}x of "
                      f"{d['scanned']:.0f} scanned), {r['mark_method']} "
                      f"({r.get('mark_waves')} waves), leaks {r['num_leaks']} "
                      f"{'ok' if ok else '!= expected'}", flush=True)
                if not ok:
                    raise SystemExit(f"{shape}: wrong leaks {r['num_leaks']} "
                                     f"{r['leak_bytes']}, expected {fx.expect}")
                runs[label].append(dict(d, method=r["mark_method"]))
    finally:
        fx.finish(timeout=600)
    lsan = None
    if not args.no_lsan:
        times = lsan_of()
        if times is not None:
            lsan = statistics.median(times)
            print(f"  LeakSanitizer: {lsan:.2f} s (median of {args.runs})", flush=True)
    out = []
    for label, rows in runs.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "method"}
        med["read"] = read_s
        out.append((shape + (f" ({label})" if label else ""), med,
                    "/".join(sorted({r["method"] for r in rows})), lsan))
    return out


def print_table(size, table, args):
    print(f"\nmedians of {args.runs}, {size} MiB, {args.threads} threads in the C shapes:\n")
    print("| shape | check | walk | mark | pause | peak RSS (/ scanned) | mark method "
          "| heap read once | check / read | LeakSanitizer | check / LSan |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, m, method, lsan in table:
        ls = f"{lsan:.2f} s | {m['check'] / lsan:.2f}x" if lsan else "- | -"
        print(f"| {name} | {m['check']:.2f} s | {m['walk']:.2f} s | {m['mark']:.2f} s | "
              f"{m['pause']:.1f} ms | {m['rss']:.0f} MiB ({m['rss'] / m['scanned']:.2f}x) | "
              f"{method} | {m['read']:.2f} s | {m['check'] / m['read']:.2f}x | {ls} |")
    checks = [m["check"] for name, m, _, _ in table if "(" not in name]
    if len(checks) > 1:
        print(f"\nslowest / fastest shape at {size} MiB: {max(checks) / min(checks):.2f}x "
              f"({max(checks):.2f} s / {min(checks):.2f} s)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,1024", help="heap MiB, comma-separated")
    ap.add_argument("--huge", action="store_true", help="add 4096 MiB (long)")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--leaks", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--old", action="store_true",
                    help="also MEMUNREACHABLE_MARK=on-demand, alternating (before/after)")
    ap.add_argument("--no-lsan", action="store_true")
    ap.add_argument("--lsan-cc", default="cc")
    ap.add_argument("--python", default="/usr/bin/python3",
                    help="the Python shapes' interpreters, comma-separated: paths or ROOT:python3.X")
    ap.add_argument("--compare", help="another checkout of memunreachable (built in place)")
    args = ap.parse_args()
    fixtures.FIXTURE_DIR = HERE  # bench_target.c lives here
    fixtures.CFLAGS[0] = "-O2"
    fixtures.CFLAGS[-1] = os.path.join(ROOT, "fixtures")
    methods = {"": (None, ROOT)}
    if args.old:
        methods["on-demand"] = ("on-demand", ROOT)
    if args.compare:
        methods["compare"] = (None, os.path.abspath(args.compare))
    sizes = [int(s) for s in args.sizes.split(",")] + ([4096] if args.huge else [])
    tables = {}
    pythons = args.python.split(",")
    for size in sizes:
        tables[size] = [r for shape in args.shapes.split(",")
                        for python in (pythons if shape.startswith("python") else [None])
                        for r in bench_shape(shape, size, args, methods, python,
                                             len(pythons) > 1)]
    for size in sizes:
        print_table(size, tables[size], args)


if __name__ == "__main__":
    main()
