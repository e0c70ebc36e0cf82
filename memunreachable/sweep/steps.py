"""steps.py: Stages 4-8 of a check over a snapshot's memory, run in the forked sweeper
(docs/how-it-works.md, steps 4-8).

    sweep_snapshot(snap, fz, st, ...) -> SweepResult   open the snapshot's memory, run sweep()
                                                       in a forked sweeper (or here), close
    sweep(mem, maps, threads, pid, ...) -> SweepResult  4 allocations (glibc, CPython, ld.so's
                                                       and libraries' dead words, the tracking
                                                       table), 5 roots, 6 mark, 7 fold, 8 the
                                                       result with stacks from the table
    warm_caches(maps, pid)          parse ELF files and import the CPython stages in the
                                    checker, so every forked sweeper inherits them
The judgement of a snapshot that cannot give a valid result is retake.py's; the orchestrator
(unreachable.py) calls both. sweep() is one function on purpose: it reads like the numbered
steps, each under its comment, and its locals are the data passed from step to step.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import logging
import os
import signal
import struct
import time
from array import array
from itertools import compress
from typing import List, Optional, Sequence, Tuple

from memunreachable.collect import diagnose, procfs
from memunreachable.heaps import glibtables, libstate
from memunreachable.heaps.cpython import probe
from memunreachable.heaps.glibc import linkmaps, locate
from memunreachable.heaps.glibc.copies import is_uncopied
from memunreachable.heaps.glibc.walker import HeapInconsistent, walk_heap
from memunreachable.stacks import tracking
from memunreachable.sweep import detect, retake
from memunreachable._errors import CollectionError, MemoryUnreadable, NoSuchProcess
from memunreachable._types import Fields, HeapImage, Range
from memunreachable.sweep.classify import (classify, data_ranges, stack_maps, unmanaged_memory,
                                           waiting)
from memunreachable.sweep.folding import FoldedLeak, flagged_sizes, fold
from memunreachable.sweep.mark import DeadWords, mark, with_dead_ranges
from memunreachable.collect.memory import (CopiedMemory, ProcessMemory, SnapshotPlan, read_copies,
                                           unwritten_file_pages)
from memunreachable.sweep.sweeper import SweepEntry, SweepResult, retain_list, run_here, run_sweeper

log = logging.getLogger("memunreachable")

CONTENTS_BYTES = 32
# The low-memory sweep (docs/internals/performance-record.md, issue 10): heaps of at least this
# many bytes are walked without keeping copies, and the mark reads the blocks it reaches from
# the snapshot (mark.py, heaps/glibc/walker.py walk_heap(uncopied_from=...)). Not for a CPython
# runtime (its stages read object headers from the copies), nor a GLib process with heap below
# 4 GiB (glibtables.wanted), nor under MEMUNREACHABLE_EXPLAIN. From 64 MiB: at 64 and 128 MiB
# the bench's shapes were checked as fast or faster than with copies, in a third to a half of
# the memory (list1 at 128 MiB 0.20 -> 0.15 s, 188 -> 62 MiB); below, as fast, their peaks
# mostly the checker's own
UNCOPIED_MIN_BYTES = 64 << 20
# At most this many marks again for GLib's 32-bit table entries (a table held only by another's)
GLIB_ROUNDS = 4


def sweep_snapshot(snap, fz, st: retake.Attempts, sweep_timeout: float, confirm, overlays,
                   plan: SnapshotPlan, unseen: List[Range], here: bool = False,
                   dead_ranges: Sequence[Tuple[int, int]] = (),
                   waiting_tids: Sequence[int] = (), since=None) -> SweepResult:
    if snap.released:
        raise CollectionError(f"snapshot of process {snap.target_pid} was already released")
    try:
        mem = ProcessMemory(snap.pid, overlays=overlays, tolerated=plan.tolerated,
                            guarded=plan.guarded)
    except (FileNotFoundError, ProcessLookupError) as exc:
        if snap.mode == "clone":
            retake.snapshot_died(fz.pid, st, f"its memory could not be opened: {exc}")
        raise NoSuchProcess(fz.pid, f"process {fz.pid} exited during the check",
                            hint=diagnose.hint_no_process(fz.pid)) from None
    warm_caches(fz.maps, fz.pid)
    maps = fz.maps
    if unseen:          # memory the sweep cannot see is neither read nor a root
        maps = [m for m in maps if not any(m.range.overlaps(u) for u in unseen)]
    def work():
        return sweep(mem, maps, waiting(fz.threads, waiting_tids), snap.pid, confirm,
                     all_uncertain=bool(unseen),
                     unwritten=plan.unwritten, retain=retain_list(),
                     release_snapshot=_early_release(snap), dead_ranges=dead_ranges,
                     since=since if here else None)
    try:
        res = run_here(work) if here else run_sweeper(work, sweep_timeout)
    finally:
        mem.close()
    if unseen:          # no verdict: a block only referenced from there would look leaked
        res.meta.setdefault("incomplete", []).append(retake.unseen_reason(plan, unseen))
    return res


def _early_release(snap):
    """For the sweeper: kill the snapshot process as soon as the sweep has copied all it reads
    (sweep(release_snapshot=...)). Only a clone: a direct sweep reads the target itself. The
    checker still collects and reaps it (Snapshot.release: a SIGKILL to a dead child is a
    no-op); until then its pid, a traced child not yet reaped, cannot be reused."""
    if snap.mode != "clone":
        return None
    pid = snap.pid

    def release():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return release


def block_tails(image: HeapImage, tails: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """The 8-aligned (begin, end) ranges past `used` bytes of each allocation that starts at
    `address`, for (address, used) in tails; an address that starts no allocation gives none."""
    out = []
    begins, sizes = image.begins, image.sizes
    for address, used in tails:
        i = bisect.bisect_left(begins, address)
        if i < len(begins) and begins[i] == address:
            b, e = (address + used + 7) & ~7, (address + sizes[i]) & ~7
            if b < e:
                out.append((b, e))
    return out


def _explain_addresses() -> List[int]:
    """MEMUNREACHABLE_EXPLAIN: hex addresses (separated by spaces or commas), or @FILE holding
    them, one per line (read at each sweep)."""
    v = os.environ["MEMUNREACHABLE_EXPLAIN"]
    if v.startswith("@"):
        try:
            with open(v[1:]) as f:
                v = f.read()
        except OSError:
            return []
    return [int(w, 16) for w in v.replace(",", " ").split()]


def warm_caches(maps, pid: int) -> None:
    """Parse the malloc object's and the Python runtime's ELF files and import the CPython
    stages here, in the long-lived checker, so that every forked sweeper inherits them
    (elf.py: a few ms per file; the CPython imports ~60 ms, only for a Python target).
    Once per set of mapped files of a pid: the caches it fills stay (the in-process checks'
    helper checks one process again and again)."""
    global _WARMED
    key = (pid, tuple([(m.path, m.dev, m.inode, m.begin) for m in maps if m.inode]))
    if key == _WARMED:
        return
    scan = detect.scan_maps(maps, pid)
    if scan.object_mappings:
        locate.read_image(scan.object_mappings, pid)
    libstate.warm(maps, pid)
    if probe.may_hold_runtime(maps, pid):   # else the CPython stages are never loaded
        from memunreachable.heaps.cpython import (locate as cpython_locate, pipeline,  # noqa: F401
                                                  objects)
        cpython_locate.warm(maps, pid)
    _WARMED = key


_WARMED: Optional[tuple] = None


def sweep(mem, maps, threads, pid: int, confirm: Optional[set] = None,
          all_uncertain: bool = False, unwritten: Sequence[Range] = (),
          retain: Optional[list] = None, release_snapshot=None,
          dead_ranges: Sequence[Tuple[int, int]] = (), since=None) -> SweepResult:
    """Stages 4-8 over a memory image; runs inside the sweeper process.

    confirm: addresses found unreachable in an earlier snapshot; a block unreachable now but
    not then is in flight, and is treated as a root (as LSan treats suppressed blocks).
    When a thread may hold a chunk in flight (or the walk saw in-transit states), every
    unreachable address is returned too, for the confirming snapshot.
    Uncertain blocks (unreachable, but of a size a broken free list may hold; or every
    unreachable block when all_uncertain, because memory that may reference them was not
    seen) are returned apart and treated as roots, so nothing they point to is a leak.
    unwritten: file mappings the process never wrote (SnapshotPlan.unwritten): not roots.
    retain: a list that keeps the copies of the snapshot's memory past the return (the
    sweeper process, which exits right after sending the result, never frees them itself).
    release_snapshot: called once nothing more is read from the snapshot (after the roots,
    when no CPython stage and no tracking table read it later): the snapshot process can be
    killed then, its teardown overlapping the mark, and the target's copy-on-write costs end.
    dead_ranges: 8-aligned (begin, end) ranges of the target that hold no references (an
    in-process check's own alternate signal stack, idle while it waits).
    since: written.Since of this snapshot, or None: a word of memory not written since an
    earlier swept snapshot is no reference to an allocation that began after it; this sweep's
    allocations are recorded for the next.
    """
    t0 = time.monotonic()
    # 4. Enumerate allocations
    log.info("searching process %d for allocations", pid)
    uncopied_from = None
    if not (probe.may_hold_runtime(maps, pid) or os.environ.get("MEMUNREACHABLE_EXPLAIN")
            or glibtables.wanted(maps)):
        uncopied_from = UNCOPIED_MIN_BYTES
    snapshot_mem = mem
    try:
        hw = walk_heap(mem, maps, threads, pid, uncopied_from=uncopied_from)
    except HeapInconsistent as exc:
        exc.suspect_tids = detect.threads_in_allocator(threads, maps, pid, ())
        raise
    suspect = detect.threads_in_allocator(threads, maps, pid, hw.stats.get("arena_addresses", ()))
    # 4b. CPython: pymalloc blocks are allocations, its arenas and dead memory are not roots,
    # GC links are not references (cpython/pipeline.py)
    # what the walk copied is not read again; the data mappings are read once, here
    uncopied = bool(hw.stats.get("uncopied_bytes"))     # the low-memory sweep
    mem = CopiedMemory(mem, [r for r in hw.image.regions if not is_uncopied(r[1])] + hw.spare
                       + read_copies(mem, data_ranges(maps, unwritten), skip_unreadable=True),
                       unwritten_file_pages(maps, unwritten))
    cps = _see_through_cpython(mem, maps, threads, pid, hw.image)
    image, dead = cps.image, cps.dead
    # 4c. ld.so's l_gnu_chain_zero words: addresses computed below an object, not references;
    # its path strings' stale slack past their NUL
    found = linkmaps.of_process(mem, pid, maps)
    chain_words = [(w, w + 8) for w in found.words]
    # 4e. readline's keymap padding, its line buffer, terminfo's tables, the environment's
    # strings: stale bytes, text
    libs = libstate.of_process(mem, maps, pid)
    dead = with_dead_ranges(dead, chain_words + libs.ranges
                            + block_tails(image, libs.tails + found.string_tails)
                            + list(dead_ranges))
    t_walk = time.monotonic()
    # 4d. Tracking table (memunreachable run): never a root, it points at every block
    table = tracking.find_table(mem, maps)
    # 5. Roots
    roots = classify(maps, threads, hw.heap_ranges, hw.metadata_ranges,
                     list(cps.root_cuts) + list(unwritten) + list(hw.holes)
                     + (table.cuts if table is not None else []),
                     procfs.read_guard_runs(pid, stack_maps(maps, threads)))
    root_buffers = []
    for r in roots.ranges:
        buf = mem.view(r.begin, r.size)
        if buf is None:
            buf = bytearray(r.size)
            mem.read_into(r.begin, buf)
        root_buffers.append((r.begin, buf))
    if release_snapshot is not None and not cps.usable and table is None and not uncopied:
        release_snapshot()          # every byte the sweep needs is copied now
    # 5b. Written pages (in-process checks): stale words are no references to fresh blocks
    nfresh = 0
    if since is not None and since.unwritten:
        levels, nfresh = since.fresh(image.begins)
        if nfresh:
            dead = dataclasses.replace(dead or DeadWords(), fresh=levels,
                                       unwritten=since.unwritten)
    t_roots = time.monotonic()
    # 6. Mark
    log.info("sweeping process %d for unreachable memory", pid)
    marked = mark(image, root_buffers, roots.words, dead=dead)
    # 6a. GLib's hash tables' 32-bit keys and values in a heap below 4 GiB: roots once their
    # table is reached, marked again (a table only such an entry holds: another round)
    words = list(roots.words)
    tables = glibtables.find(image, maps)
    for _ in range(GLIB_ROUNDS if tables else 0):
        have = set(words)
        held = [w for w in glibtables.references(tables, image, marked.marked, mem)
                if w not in have]
        if not held:
            break
        words += held
        marked = mark(image, root_buffers, words, dead=dead)
    begins, sizes = image.begins, image.sizes
    leaks = None
    if uncopied:
        # the unreachable blocks' bytes, read now (the fold, the contents, uncertain roots)
        leaks = _LeakImage(snapshot_mem, image, marked.marked)
        contents = _ContentsReader(leaks.image)
    else:
        contents = _ContentsReader(image)
    unsure_sizes = hw.uncertain_sizes
    unmarked = _unmarked(marked.marked) if (confirm is not None or unsure_sizes or
                                            all_uncertain) else []
    uncertain = [i for i in unmarked if all_uncertain or sizes[i] in unsure_sizes]
    unconfirmed = 0
    extra = []
    if confirm is not None:
        unsure = set(uncertain)
        extra = [i for i in unmarked if begins[i] not in confirm and i not in unsure]
        unconfirmed = len(extra)
    if uncertain or extra:
        # treat them as roots: what they point to is not reported either
        more = uncertain + extra
        root_buffers += [(begins[i], contents.view(begins[i], sizes[i])) for i in more]
        marked = mark(image, root_buffers, words + [begins[i] for i in more], dead=dead)
    if uncopied and release_snapshot is not None and table is None:
        release_snapshot()          # the mark has read all it needs; the leaks are copied
    if since is not None:
        since.swept(image.begins)
    t_mark = time.monotonic()
    explained = _explain_addresses() if os.environ.get("MEMUNREACHABLE_EXPLAIN") else []
    if explained:                       # diagnostic: explain.py (no address yet: no cost)
        from memunreachable.sweep.explain import explain
        from memunreachable.sweep.mark import scanned_blocks
        blocks = functools.lru_cache(1)(lambda: scanned_blocks(image, marked.marked, dead))
        lines = [line for addr in explained
                 for line in explain(addr, image, root_buffers, marked.marked,
                                     dead.ranges if dead else (), blocks, threads,
                                     dead.head_word if dead else None, maps, mem)]
        for line in lines:
            log.warning("%s", line)
        if os.environ.get("MEMUNREACHABLE_EXPLAIN_LOG"):   # where no capture hides them
            with open(os.environ["MEMUNREACHABLE_EXPLAIN_LOG"], "a") as f:
                f.write("".join(line + "\n" for line in lines))
    del root_buffers
    # 6b. CPython: unreachable Python objects, and which of them are cyclic garbage
    py = _python_objects(mem, cps, image, marked.marked, contents) if cps.usable else None
    leak_flags = marked.marked if py is None else py.leak_flags
    # 7. Fold
    log.info("folding related leaks")
    if leaks is not None:
        folded = leaks.fold(leak_flags, dead=dead)
    else:
        folded = fold(image, leak_flags, dead=dead)
    if py is not None and py.heads is not None and folded:
        folded = _reheaded(folded, py.heads([(f.index, f.blocks) for f in folded]), sizes)
    garbage = (fold(image, py.garbage_flags, dead=dead)
               if py is not None and py.garbage else [])
    t_fold = time.monotonic()
    # 8. Result
    mark_method, mark_reason = marked.method(uncopied)
    num_leaks, leak_bytes = flagged_sizes(sizes, leak_flags, zero=True)
    all_bytes = marked.size_total
    unmanaged = unmanaged_memory(roots, all_bytes)
    res = SweepResult(
        num_allocations=len(sizes),
        allocation_bytes=all_bytes,
        num_leaks=num_leaks,
        leak_bytes=leak_bytes,
        bytes_scanned=marked.root_bytes + marked.heap_bytes,
    )
    objects = py.objects if py is not None else {}
    if py is not None:      # a short repr only for the objects that head an entry
        from memunreachable.heaps.cpython.objects import with_repr
        for f in list(folded) + list(garbage):
            if f.index in objects:
                objects[f.index] = with_repr(py.reader, objects[f.index],
                                             begins[f.index] + sizes[f.index])
    for f in folded:
        res.entries.append(_entry(f, begins, sizes, contents, objects))
    for f in garbage:
        res.cyclic_garbage.append(_entry(f, begins, sizes, contents, objects))
    # 8b. Allocation stacks and requested sizes of the leaks, from the tracking table
    if table is not None:
        # under CPython's debug hooks a block starts with their 16-byte prefix: the tracker
        # recorded the pointer the hooks hand out (the domains are routed around them)
        debug = False
        if cps.cpython is not None and cps.cpython.found:
            from memunreachable.heaps.cpython.typerules import has_debug_hooks
            from memunreachable.heaps.cpython.layout import DEBUG_HOOK_PREFIX
            debug = has_debug_hooks(cps.cpython)
        for e in res.entries + res.cyclic_garbage:
            for b in [e] + e.indirect:
                a = table.annotate(b.address, b.size)
                if debug and a.status == "untracked":
                    a = table.annotate(b.address + DEBUG_HOOK_PREFIX, b.size - DEBUG_HOOK_PREFIX)
                b.stack, b.python_stack, b.stack_status = a.stack, a.python_stack, a.status
                b.requested_size, b.epoch = a.requested, a.epoch
    for i in uncertain:
        res.uncertain.append(SweepEntry(begins[i], sizes[i], 0, 0,
                                        contents.read(begins[i], min(sizes[i], CONTENTS_BYTES))))
    res.meta = {
        "allocator": {"name": hw.allocator.name, "version": hw.allocator.version},
        "warnings": list(hw.soft_issues) + _tolerated_warning(mem) + cps.warnings
                    + (py.warnings if py is not None else []) + unmanaged,
        # what could not be seen: no "no leaks" verdict then (check's verdict())
        "incomplete": list(cps.blind),
        "stats": dict(hw.stats),
        "seconds": {"walk": t_walk - t0, "roots": t_roots - t_walk, "mark": t_mark - t_roots,
                    "fold": t_fold - t_mark},
        "root_bytes": marked.root_bytes,
        "heap_bytes": marked.heap_bytes,
        "soft_issues": list(hw.soft_issues),
        "unconfirmed": unconfirmed,
        "suspect_tids": suspect,
        "fresh_blocks": nfresh,
        "stale_words": marked.stale,
        # which way the mark read the heap and why (issue 25; mark.MarkResult.method)
        "mark_method": mark_method,
        "mark_switch_reason": mark_reason,
        "mark_waves": marked.waves,
        "mark_reads": marked.reads,
    }
    if table is not None:
        res.meta["tracking"] = table.summary()
    if cps.cpython is not None and cps.cpython.found:
        res.meta["cpython"] = dict(cps.stats, usable=cps.usable,
                                   garbage_blocks=len(py.garbage) if py is not None else 0,
                                   dead_objects=py.dead if py is not None else 0)
    if suspect or hw.soft_issues or confirm is not None:
        res.leak_addresses = list(compress(begins, leak_flags.translate(_INVERT)))
    if retain is not None:
        retain.append((hw, cps, mem, image, marked))
    return res


# Indirect leaks sent per entry (each with its stack); the entry's counts cover all of them.
INDIRECT_LIMIT = 1000


def _reheaded(folded, heads: dict, sizes) -> list:
    """folded (FoldedLeak, by index) with the heads in `heads` ({head: another block of its
    entry, in its cycle}) swapped with those blocks, again by index."""
    if not heads:
        return folded
    out = []
    for f in folded:
        new = heads.get(f.index)
        if new is not None:     # the same cycle: the same blocks referenced, but the head's
            f = FoldedLeak(new, f.referenced_count,
                           f.referenced_size + sizes[f.index] - sizes[new],
                           sorted([b for b in f.blocks if b != new] + [f.index]))
        out.append(f)
    return sorted(out, key=lambda f: f.index)


def _entry(f, begins, sizes, contents, objects) -> SweepEntry:
    addr, size = begins[f.index], sizes[f.index]
    e = SweepEntry(addr, size, f.referenced_count, f.referenced_size,
                   contents.read(addr, min(size, CONTENTS_BYTES)),
                   num_indirect=len(f.blocks), indirect_size=sum(sizes[b] for b in f.blocks),
                   indirect=[SweepEntry(begins[b], sizes[b], 0, 0, b"")
                             for b in f.blocks[:INDIRECT_LIMIT]])
    info = objects.get(f.index)
    if info is not None:
        e.python_type, e.refcount, e.repr = info.type_name, info.refcount, info.repr
    return e


def _see_through_cpython(mem, maps, threads, pid, image):
    """cpython.pipeline.prepare, or glibc's image alone with a warning if it fails: a bug in
    the CPython map must never turn into a wrong answer."""
    if not probe.may_hold_runtime(maps, pid):
        return _NoCPython(image)    # what pipeline.prepare gives, without loading it
    from memunreachable.heaps.cpython import pipeline
    try:
        return pipeline.prepare(mem, maps, threads, pid, image)
    except (OSError, ValueError, MemoryUnreadable, struct.error) as exc:
        log.warning("CPython map failed: %s", exc)
        out = pipeline.CPythonSweep(None, image)
        out.cannot_see(f"CPython's memory could not be mapped ({exc}): it is scanned whole as "
                       "roots")
        return out


class _NoCPython(Fields):
    """pipeline.CPythonSweep of a process without a CPython runtime (cpython/probe.py)."""
    __slots__ = ("image", "cpython", "root_cuts", "dead", "warnings", "stats", "usable")
    blind: tuple = ()

    def __init__(self, image: object, cpython: None = None, root_cuts: Optional[list] = None,
                 dead: None = None, warnings: Optional[list] = None, stats: Optional[dict] = None,
                 usable: bool = False):
        self.image = image
        self.cpython = cpython
        self.root_cuts = [] if root_cuts is None else root_cuts
        self.dead = dead
        self.warnings = [] if warnings is None else warnings
        self.stats = {} if stats is None else stats
        self.usable = usable


class _PythonLeaks(Fields):
    __slots__ = ("objects", "garbage", "leak_flags", "garbage_flags", "warnings", "dead", "reader",
                 "heads")

    def __init__(self,
                 objects: dict,           # allocation index -> PyObjectInfo
                 garbage: set,            # indices of cyclic garbage (not leaks)
                 # marked flags with the garbage marked too: fold the leaks
                 leak_flags: bytearray,
                 # marked flags with the leaks marked too: fold the garbage (None: no garbage)
                 garbage_flags: Optional[bytearray], warnings: list,
                 dead: int = 0,           # unreachable refcount-0 (dead) objects, not reported
                 reader: object = None,   # the ObjectReader (reprs of the entries' heads)
                 # [(head, blocks)] -> {head: the leaked object to head its entry instead}
                 heads=None):
        self.objects = objects
        self.garbage = garbage
        self.leak_flags = leak_flags
        self.garbage_flags = garbage_flags
        self.warnings = warnings
        self.dead = dead
        self.reader = reader
        self.heads = heads


def _python_objects(mem, cps, image, marked, contents) -> _PythonLeaks:
    """Name the unreachable Python objects and split off the cyclic garbage
    (cpython/objects.py)."""
    from memunreachable.heaps.cpython import objects as O
    from memunreachable.heaps.cpython.typerules import object_reader
    reader = object_reader(mem, cps.cpython)
    begins, sizes = image.begins, image.sizes
    unmarked = _unmarked(marked)
    warnings = []
    if len(unmarked) > O.MAX_OBJECTS:
        warnings.append(f"{len(unmarked)} unreachable blocks are too many to name Python "
                        "objects and tell cyclic garbage from leaks: all are reported as leaks")
        return _PythonLeaks({}, set(), marked, None, warnings, 0, reader)
    objects = O.objects_in(reader, begins, sizes, unmarked, contents.read)
    head_word = cps.dead.head_word if cps.dead is not None else None
    def words(i):
        return O.block_words(contents.view(begins[i], sizes[i]), head_word, i)
    garbage, _, edges = O.split_garbage(begins, sizes, unmarked, objects, words)
    if garbage is None:
        warnings.append(f"{len(unmarked)} unreachable blocks are too many to tell cyclic "
                        "garbage from leaks: all are reported as leaks")
        garbage = set()
    # refcount-0 objects are dead (free-listed, zombie frames): neither leak nor garbage
    dead = {i for i in garbage if i in objects and objects[i].refcount == 0
            and not objects[i].immortal}
    garbage -= dead
    # copies of the marks only where they differ (n bytes each: 48 MB for 48 M blocks)
    leak_flags, garbage_flags = marked, None
    if garbage or dead:
        leak_flags = bytearray(marked)
        for i in garbage | dead:
            leak_flags[i] = 1
    if garbage:
        garbage_flags = bytearray(marked)
        for i in unmarked:
            if i not in garbage:
                garbage_flags[i] = 1
    heads = functools.partial(O.leak_heads, objects=objects, edges=edges,
                              words=lambda i: words(i) if sizes[i] <= O.MAX_BLOCK_WORDS else ())
    return _PythonLeaks(objects, garbage, leak_flags, garbage_flags, warnings, len(dead), reader,
                        heads)


def _unmarked(marked) -> list:
    """Indices of unmarked allocations."""
    out, i = [], marked.find(0)
    while i >= 0:
        out.append(i)
        i = marked.find(0, i + 1)
    return out


_INVERT = bytes([1] + [0] * 255)


def _tolerated_warning(mem) -> list:
    n = getattr(mem, "tolerated_bytes", 0)
    return [f"{n} bytes of file pages past the end of their file (or device memory) could "
            "not be read; they cannot hold pointers"] if n else []


# Unreachable blocks closer than this share one read (_LeakImage).
LEAK_READ_GAP = 4096


class _LeakImage:
    """The unreachable blocks of a low-memory sweep's image, copied from the snapshot once
    the mark is done: image (a HeapImage of them alone, each inside a copy of its run of
    neighbours closer than LEAK_READ_GAP) serves the fold and the reported contents."""

    def __init__(self, mem, image, marked):
        self.index = _unmarked(marked)
        begins, sizes = image.begins, image.sizes
        lb, ls = array("Q", (begins[i] for i in self.index)), array("Q", (sizes[i] for i in self.index))
        runs: List[Range] = []
        for b, n in zip(lb, ls):
            e = b + max(n, 1)
            if runs and b <= runs[-1].end + LEAK_READ_GAP:
                runs[-1] = Range(runs[-1].begin, max(runs[-1].end, e))
            else:
                runs.append(Range(b, e))
        self.image = HeapImage(lb, ls, read_copies(mem, runs, packed=True))

    # fold() over the whole image with these flags, computed over the unreachable blocks
    # alone (the fold follows edges between unreachable blocks only): indices are the image's.
    def fold(self, flags, dead) -> list:
        sub = bytearray(flags[i] for i in self.index)
        ix = self.index
        return [FoldedLeak(ix[f.index], f.referenced_count, f.referenced_size,
                           [ix[b] for b in f.blocks])
                for f in fold(self.image, sub, dead=dead)]


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
