"""unreachable.py: the orchestrator of `check <pid>` (docs/how-it-works.md).

    1. preflight   the pid is a user process we may trace
    2. collect     freeze every thread, capture registers and maps
    3. snapshot    inject clone(0) -> a copy-on-write child; thaw the target at once
    4-8. sweep     in a forked sweeper: enumerate allocations, roots, mark, fold
    9. report      UnreachableMemoryInfo (sorted, limited); the CLI renders it

A hard heap inconsistency (a thread stopped inside malloc) retakes the snapshot, bounded.
"""
from __future__ import annotations

import bisect
import logging
import time
from itertools import compress
from typing import Optional

from memunreachable import detect
from memunreachable import leftovers
from memunreachable import preflight as preflight_stage
from memunreachable._errors import HeapWalkError
from memunreachable.classify import classify
from memunreachable.folding import fold
from memunreachable.freeze import frozen
from memunreachable.glibc.walker import HeapInconsistent, walk_heap
from memunreachable.mark import mark
from memunreachable.report import Leak, UnreachableMemoryInfo, sort_and_limit
from memunreachable.snapshot import take_snapshot
from memunreachable.sweeper import SweepEntry, SweepResult, run_sweeper

log = logging.getLogger("memunreachable")

MAX_RETRIES = 20
CONTENTS_BYTES = 32


@leftovers.guarded     # signals, per-target lock, no snapshot process left (leftovers.py)
def check(pid: int, *, limit: Optional[int] = 100, timeout: float = 2.0,
          sweep_timeout: float = 600.0, allow_direct: bool = True,
          allow_seccomp: bool = False) -> UnreachableMemoryInfo:
    """Find the unreachable allocations of process `pid`.

    limit: how many leak entries to keep (largest first); None keeps all.
    timeout: bound on the pause (freeze); sweep_timeout: bound on the sweep.
    Raises MemunreachableError subclasses when the check cannot be done.
    """
    started = time.monotonic()
    # 1. Preflight
    target = preflight_stage.preflight(pid)
    info = UnreachableMemoryInfo(pid=pid, comm=target.name)
    info.warnings.extend(target.warnings)
    opts = dict(timeout=timeout, sweep_timeout=sweep_timeout, allow_direct=allow_direct,
                allow_seccomp=allow_seccomp)
    # 2-8. Collect, snapshot, sweep
    result = _snapshot_and_sweep(pid, info, confirm=None, **opts)
    if result.meta.get("suspect_tids") or result.meta.get("soft_issues"):
        # A thread was inside the allocator: a block in flight in malloc/free can look
        # unreachable. Confirm with a second snapshot: only blocks unreachable in both count.
        first = set(result.leak_addresses)
        result = _snapshot_and_sweep(pid, info, confirm=first, **opts)
        dropped = len(first - set(result.leak_addresses)) + result.meta.get("unconfirmed", 0)
        info.confirmed = True
        if dropped:
            info.warnings.append(f"{dropped} block(s) unreachable in only one of two snapshots "
                                 "(in flight in malloc/free) were not reported")
    if info.retries:
        info.warnings.append(f"snapshot retaken {info.retries} time(s): a thread was inside malloc/free")
    # 9. Report
    _fill(info, result, limit)
    info.duration_ms = (time.monotonic() - started) * 1000.0
    log.info("check done in %.1f ms: %d bytes in %d unreachable allocations",
             info.duration_ms, info.leak_bytes, info.num_leaks)
    return info


def _snapshot_and_sweep(pid: int, info: UnreachableMemoryInfo, confirm, *, timeout: float,
                        sweep_timeout: float, allow_direct: bool, allow_seccomp: bool):
    """Steps 2-8 with retries on a hard heap inconsistency; returns the SweepResult."""
    last_error = None
    for attempt in range(MAX_RETRIES + 1):
        # 2. Collect: freeze every thread, registers, maps
        log.info("collecting thread info for process %d", pid)
        result = None
        with frozen(pid, timeout=timeout) as fz:
            # 3. Snapshot: clone(0) injected into a stopped thread, then thaw at once
            snap = take_snapshot(fz, allow_direct=allow_direct, allow_seccomp=allow_seccomp)
            try:
                if snap.mode == "clone":
                    fz.thaw()
                elif not any(w.startswith("no snapshot") for w in info.warnings):
                    info.warnings.append(f"no snapshot ({snap.reason}): the target stayed "
                                         "stopped for the whole sweep")
                log.info("target paused %.2f ms (%d threads), snapshot %s",
                         fz.pause_ms, len(fz.threads), snap.mode)
                # 4-8. Sweep in a forked process
                try:
                    result = _sweep_snapshot(snap, fz, sweep_timeout, confirm)
                except HeapInconsistent as exc:
                    log.info("heap was mid-update (%s); retaking the snapshot", exc)
                    last_error = exc
            finally:
                snap.release()
            if snap.mode != "clone":
                fz.thaw()
        info.pause_ms += fz.pause_ms + snap.reap_pause_ms
        info.snapshot_ms += snap.lifetime_ms
        info.snapshot_mode = snap.mode
        info.threads = len(fz.threads)
        info.warnings.extend(w for w in snap.warnings if w not in info.warnings)
        if result is not None:
            return result
        info.retries += 1
        time.sleep(0.002 + 0.001 * min(attempt, 3))
    raise HeapWalkError(
        f"the heap stayed inconsistent in {MAX_RETRIES + 1} snapshots ({last_error})",
        hint="the target allocates very heavily; try again, or check a quieter moment")


# syscalls glibc malloc/free make while a chunk may be in flight (futex: see below)
_ALLOCATOR_SYSCALLS = {9, 10, 11, 12, 25, 28}   # mmap mprotect munmap brk mremap madvise
SYS_FUTEX = 202


def threads_in_allocator(threads, maps, pid: int, arena_mutexes) -> list:
    """tids that may hold a chunk in flight: stopped inside the code of the object that holds
    malloc (libc, or a static executable) while running user code, or in a syscall malloc
    makes, or waiting on an arena's mutex (futex on the arena's first word); [] when none.
    A thread parked in any other futex (condition variables, barriers) is not suspect."""
    scan = detect.scan_maps(maps, pid)
    text = [m.range for m in maps if m.executable and scan.malloc_object
            and detect.strip_deleted(m.path) == scan.malloc_object]
    mutexes = set(arena_mutexes)
    out = []
    for t in threads:
        rip, orig_rax, rdi = t.regs[16], t.regs[15], t.regs[14]
        if not any(r.contains(rip) for r in text):
            continue
        if (orig_rax == 0xFFFFFFFFFFFFFFFF or orig_rax in _ALLOCATOR_SYSCALLS
                or (orig_rax == SYS_FUTEX and rdi in mutexes)):
            out.append(t.tid)
    return out


def _sweep_snapshot(snap, fz, sweep_timeout: float, confirm) -> SweepResult:
    mem = snap.open_memory()
    try:
        return run_sweeper(lambda: sweep(mem, fz.maps, fz.threads, snap.pid, confirm),
                           sweep_timeout)
    finally:
        mem.close()


def sweep(mem, maps, threads, pid: int, confirm: Optional[set] = None) -> SweepResult:
    """Stages 4-8 over a memory image; runs inside the sweeper process.

    confirm: addresses found unreachable in an earlier snapshot; a block unreachable now but
    not then is in flight, and is treated as a root (as LSan treats suppressed blocks).
    When a thread may hold a chunk in flight (or the walk saw in-transit states), every
    unreachable address is returned too, for the confirming snapshot.
    """
    t0 = time.monotonic()
    # 4. Enumerate allocations
    log.info("searching process %d for allocations", pid)
    hw = walk_heap(mem, maps, threads, pid)
    suspect = threads_in_allocator(threads, maps, pid, hw.stats.get("arena_addresses", ()))
    t_walk = time.monotonic()
    # 5. Roots
    roots = classify(maps, threads, hw.heap_ranges, hw.metadata_ranges)
    root_buffers = []
    for r in roots.ranges:
        buf = bytearray(r.size)
        mem.read_into(r.begin, buf)
        root_buffers.append((r.begin, buf))
    t_roots = time.monotonic()
    # 6. Mark
    log.info("sweeping process %d for unreachable memory", pid)
    marked = mark(hw.image, root_buffers, roots.words, glibc_chunks=True)
    contents = _ContentsReader(hw.image)
    unconfirmed = 0
    if confirm is not None:
        extra = [i for i in _unmarked(marked.marked) if hw.image.begins[i] not in confirm]
        if extra:
            unconfirmed = len(extra)
            root_buffers += [(hw.image.begins[i], contents.view(hw.image.begins[i], hw.image.sizes[i]))
                             for i in extra]
            marked = mark(hw.image, root_buffers,
                          list(roots.words) + [hw.image.begins[i] for i in extra], glibc_chunks=True)
    t_mark = time.monotonic()
    del root_buffers
    # 7. Fold
    log.info("folding related leaks")
    folded = fold(hw.image, marked.marked, glibc_chunks=True)
    t_fold = time.monotonic()
    # 8. Result
    sizes = hw.image.sizes
    leaked_mask = bytes(marked.marked).translate(_INVERT)
    res = SweepResult(
        num_allocations=len(sizes),
        allocation_bytes=sum(sizes),
        num_leaks=sum(leaked_mask),
        leak_bytes=sum(compress(sizes, leaked_mask)),
        bytes_scanned=marked.root_bytes + marked.heap_bytes,
    )
    for f in folded:
        addr, size = hw.image.begins[f.index], sizes[f.index]
        res.entries.append(SweepEntry(addr, size, f.referenced_count, f.referenced_size,
                                      contents.read(addr, min(size, CONTENTS_BYTES))))
    res.meta = {
        "allocator": {"name": hw.allocator.name, "version": hw.allocator.version},
        "warnings": list(hw.soft_issues) + _unreadable_warning(mem),
        "stats": dict(hw.stats),
        "seconds": {"walk": t_walk - t0, "roots": t_roots - t_walk, "mark": t_mark - t_roots,
                    "fold": t_fold - t_mark},
        "root_bytes": marked.root_bytes,
        "heap_bytes": marked.heap_bytes,
        "soft_issues": list(hw.soft_issues),
        "unconfirmed": unconfirmed,
        "suspect_tids": suspect,
    }
    if suspect or hw.soft_issues or confirm is not None:
        res.leak_addresses = list(compress(hw.image.begins, leaked_mask))
    return res


def _unmarked(marked) -> list:
    """Indices of unmarked allocations."""
    out, i = [], marked.find(0)
    while i >= 0:
        out.append(i)
        i = marked.find(0, i + 1)
    return out


_INVERT = bytes([1] + [0] * 255)


def _unreadable_warning(mem) -> list:
    n = getattr(mem, "unreadable_bytes", 0)
    return [f"{n} bytes of memory could not be read and counted as zeros"] if n else []


class _ContentsReader:
    """First bytes of an allocation, from the walker's local copies of the heap."""

    def __init__(self, image):
        self.regions = sorted(image.regions, key=lambda r: r[0])
        self.bases = [r[0] for r in self.regions]

    def view(self, addr: int, n: int) -> memoryview:
        i = bisect.bisect_right(self.bases, addr) - 1
        if i < 0:
            return memoryview(b"")
        base, buf = self.regions[i]
        off = addr - base
        return memoryview(buf)[off:off + n]

    def read(self, addr: int, n: int) -> bytes:
        return bytes(self.view(addr, n))


def _fill(info: UnreachableMemoryInfo, res: SweepResult, limit: Optional[int]) -> None:
    info.allocator_name = res.meta.get("allocator", {}).get("name", "glibc")
    info.allocator_version = res.meta.get("allocator", {}).get("version")
    info.num_allocations = res.num_allocations
    info.allocation_bytes = res.allocation_bytes
    info.num_leaks = res.num_leaks
    info.leak_bytes = res.leak_bytes
    info.bytes_scanned = res.bytes_scanned
    info.warnings.extend(res.meta.get("warnings", []))
    info.stats = res.meta
    leaks = [Leak(e.address, e.size, e.referenced_count, e.referenced_size, e.contents)
             for e in res.entries]
    info.leaks, info.truncated = sort_and_limit(leaks, limit)
