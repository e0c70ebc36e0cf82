"""bench_mark.py: time stages 6 and 7 (mark, fold) on a synthetic ~1 GiB heap.

Builds ~5,000,000 blocks laid out like glibc in-heap chunks (16-byte headers, usable size =
chunk size - 8) in one buffer, fills half of the words with non-pointer data, and gives every
block a few pointers (interior offsets included):
  live part (first 1 - leak_fraction of the blocks): 3 pointers each into the live part;
  leak part (the rest): 1-2 pointers each into the leak part only, so nothing live reaches it.
Roots: a buffer of pointers into the live part, plus a few register words.
Prints the figures: blocks, bytes, seconds, GB/s, entries, peak RSS. Not a test.

    python bench/bench_mark.py [--blocks 5000000] [--seed 1] [--leak-fraction 0.2]

--python-process instead marks the real heap of an idle Python process that imported pytest
(the pytest plugin's per-test check, issue 8): the first check of it runs with stage 6 wrapped
to keep its arguments (allocations, copies, roots, dead words), then mark() runs --repeat
times on them, alternating one thread and one thread per CPU (mark(parallel=True)), and the
median and best of each are printed, with the statistics (all runs must agree).

    python bench/bench_mark.py --python-process [--repeat 20]
"""
from __future__ import annotations

import argparse
import resource
import time
from array import array

import numpy as np

from memunreachable._types import HeapImage
from memunreachable.sweep.folding import fold
from memunreachable.sweep.mark import mark

BASE = 0x7F3A_0000_0000


def build(n: int, seed: int, leak_fraction: float, live_ptrs: int = 3):
    rng = np.random.default_rng(seed)
    chunk_sizes = 16 * rng.integers(2, 26, n, dtype=np.uint64)        # 32 .. 400 bytes
    chunks = np.empty(n, dtype=np.uint64)
    chunks[0] = BASE
    np.cumsum(chunk_sizes[:-1], out=chunks[1:])
    chunks[1:] += np.uint64(BASE)
    begins = chunks + np.uint64(16)
    sizes = chunk_sizes - np.uint64(8)
    total = int(chunks[-1] - BASE + chunk_sizes[-1] + 16)
    heap = np.zeros(total // 8, dtype=np.uint64)

    # half the words: non-pointer data (random 64-bit values and small integers)
    nw = heap.size
    sel = rng.random(nw) < 0.5
    k = int(sel.sum())
    noise = rng.integers(0, 1 << 63, k, dtype=np.uint64)
    small = rng.random(k) < 0.5
    noise[small] &= np.uint64(0xFFFFF)
    heap[sel] = noise
    del sel, noise, small

    live = int(n * (1 - leak_fraction))
    word_of = ((begins - np.uint64(BASE)) // np.uint64(8)).astype(np.int64)

    def add_pointers(src, lo, hi, slot):
        tgt = rng.integers(lo, hi, src.size)
        off = (rng.random(src.size) * sizes[tgt]).astype(np.uint64)
        heap[word_of[src] + slot] = begins[tgt] + off

    src_live = np.arange(0, live)
    for slot in range(live_ptrs):                                     # usable >= 24: 3 words
        add_pointers(src_live, 0, live, slot)
    src_leak = np.arange(live, n)
    add_pointers(src_leak, live, n, 0)
    second = src_leak[rng.random(src_leak.size) < 0.5]
    add_pointers(second, live, n, 1)

    root_targets = rng.integers(0, live, 100_000)
    roots = [(0x5555_0000_0000, (begins[root_targets]).tobytes())]
    words = [int(begins[0]), 0, 1, 0xFFFF_FFFF_FFFF_FFFF]
    image = HeapImage(begins, sizes, [(BASE, heap)])
    return image, roots, words


PYTHON_TARGET = ("import sys, time, pytest, _pytest.python, _pytest.runner, json, decimal, "
                 "email, http.client, unittest\n"
                 "sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(600)\n")


def python_process(repeat: int) -> int:
    """Times mark() over the heap of an idle Python process that imported pytest."""
    import statistics
    import subprocess
    import sys

    from memunreachable import unreachable
    from memunreachable.sweep import steps
    kept = []
    real = steps.mark

    def keep(image, roots, words=(), dead=None):
        if not kept:            # copies: the check releases its buffers when it returns
            copy = HeapImage(array("Q", image.begins), array("Q", image.sizes),
                             [(b, bytearray(buf)) for b, buf in image.regions])
            kept.append((copy, [(b, bytearray(buf)) for b, buf in roots], list(words), dead))
        return real(image, roots, words, dead=dead)

    target = subprocess.Popen([sys.executable, "-c", PYTHON_TARGET], stdout=subprocess.PIPE,
                              text=True)
    try:
        target.stdout.readline()
        steps.mark = keep
        unreachable.check(target.pid, sweep_here=True)
    finally:
        steps.mark = real
        target.kill()
        target.wait()
    image, roots, words, dead = kept[0]
    print(f"{len(image.begins):,} allocations in {len(image.regions)} regions, "
          f"{sum(len(b) for _, b in roots) / 1e6:.1f} MB of roots")
    times = {False: [], True: []}
    stats = set()
    for _ in range(repeat):
        for parallel in (False, True):
            res = mark(image, roots, words, dead=dead, parallel=parallel)
            times[parallel].append(res.seconds)
            stats.add((bytes(res.marked), res.root_bytes, res.heap_bytes, res.words))
    assert len(stats) == 1, "one thread and several disagree"
    _, root_bytes, heap_bytes, nwords = stats.pop()
    print(f"marked {res.num_marked:,}; root_bytes {root_bytes:,}, heap_bytes {heap_bytes:,}, "
          f"words {nwords:,}")
    for parallel, label in ((False, "one thread"), (True, "one per CPU")):
        t = times[parallel]
        print(f"mark, {label}: median {statistics.median(t) * 1e3:.2f} ms, "
              f"best {min(t) * 1e3:.2f} ms ({repeat} runs)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=5_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--leak-fraction", type=float, default=0.2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--python-process", action="store_true",
                    help="mark the heap of an idle Python process that imported pytest")
    args = ap.parse_args(argv)
    if args.python_process:
        return python_process(max(args.repeat, 1))

    t0 = time.perf_counter()
    image, roots, words = build(args.blocks, args.seed, args.leak_fraction)
    heap_len = image.regions[0][1].nbytes
    print(f"built {args.blocks:,} blocks in {heap_len / 2**30:.2f} GiB "
          f"({int(image.sizes.sum()) / 2**30:.2f} GiB usable) in {time.perf_counter() - t0:.1f} s")

    best = None
    for _ in range(args.repeat):
        res = mark(image, roots, words)
        best = res if best is None or res.seconds < best.seconds else best
    res = best
    scanned = res.root_bytes + res.heap_bytes
    leaks = args.blocks - res.num_marked
    print(f"mark: {res.seconds:.3f} s  marked {res.num_marked:,} / {args.blocks:,} blocks  "
          f"scanned {scanned / 2**30:.2f} GiB ({res.words:,} words)  "
          f"{scanned / res.seconds / 1e9:.2f} GB/s  "
          f"{res.num_marked / res.seconds / 1e6:.1f} M blocks/s")

    fold_best = None
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        entries = fold(image, res.marked)
        dt = time.perf_counter() - t0
        fold_best = dt if fold_best is None else min(fold_best, dt)
    leak_bytes = int(image.sizes[np.frombuffer(res.marked, dtype=np.uint8) == 0].sum())
    print(f"fold: {fold_best:.3f} s  {leaks:,} leaks ({leak_bytes / 2**20:.1f} MiB) "
          f"-> {len(entries):,} entries; largest referenced_count "
          f"{max((e.referenced_count for e in entries), default=0):,}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"peak RSS {peak / 2**30:.2f} GiB ({peak / heap_len:.2f}x the heap buffer)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
