"""track_pid.py: `memunreachable track PID`: allocation stacks for a process already running.

    start(pid) -> Result    load the tracking library into pid and route its malloc family
    stop(pid) -> Result     put back every entry the routing changed (the library stays, inert)

start() does in the target what track_here.start() does in process: dlopen(_track.so,
RTLD_NOW|RTLD_LOCAL), then mu_track_route() (native/mu_track.c, "routing"), each as a
function call injected into one frozen thread (inject.py; the other threads run meanwhile).
From then on `check PID` shows the stack of each block allocated, as for `run`. Only the
malloc family is routed by the injected calls, as `run` does. With python_objects, CPython's
object domains (pymalloc) too: they need the GIL, which an injected call cannot take, so
mu_track_route_python_later asks the interpreter to route them itself at its next pending-call
check (Py_AddPendingCall), and Python objects get stacks from the moment it next runs Python
code (bench/bench_track_pid.py: a dict/str/list loop ran 1.6x slower, against 1.1x without). Refused by name, with a hint: static executables, no dynamic loader, musl, threads
whose seccomp rules forbid what loading needs. A target whose every thread sits inside
malloc/free or the loader is frozen again a little later (ATTEMPTS times).
"""
from __future__ import annotations

import errno
import os
import time
from typing import Optional, Sequence

from memunreachable.sweep import detect
from memunreachable.collect import diagnose, inject, leftovers, procfs
from memunreachable.stacks import tracking
from memunreachable import track_here
from memunreachable._errors import CollectionError, TrackingError, UnsupportedTarget
from memunreachable._types import Fields, Mapping
from memunreachable.collect.freeze import frozen
from memunreachable.collect.memory import ProcessMemory
from memunreachable.collect.preflight import preflight

ATTEMPTS = 20                   # freezes looking for a thread outside malloc and the loader
RETRY_WAIT = 0.02               # seconds between them
RTLD_NOW, RTLD_LOCAL = 2, 0
ROUTE_NAMES = ("mu_track_route", "mu_track_unroute", "mu_track_last_rc",
               "mu_track_route_python_later", "mu_track_unroute_python_later")


class Result(Fields):
    """What start() or stop() did."""
    __slots__ = ("pid", "name", "action", "started", "library", "tid", "pause_ms", "others_ms",
                 "python")

    def __init__(self, pid: int, name: str,
                 action: str,               # started | already | stopped | not_tracked
                 started: Optional[float] = None,   # when recording began (Unix time, s)
                 library: str = "",         # the tracking library's path in the target
                 tid: int = 0,              # the thread the calls ran in
                 pause_ms: float = 0.0,     # how long that thread was stopped for the calls
                 others_ms: float = 0.0,    # how long every thread was stopped before
                 python: bool = False):     # CPython's object domains asked to route too
        self.python = python
        self.pid = pid
        self.name = name
        self.action = action
        self.started = started
        self.library = library
        self.tid = tid
        self.pause_ms = pause_ms
        self.others_ms = others_ms


def loaded_library(maps: Sequence[Mapping]) -> str:
    """The path of the tracking library mapped in the target (ours, or a copy another
    memunreachable loaded), "" when none is."""
    paths = inject.mapped_paths(maps, lambda p: os.path.basename(p) == inject.TRACK_LIBRARY)
    return paths[0] if paths else ""


def library_path(pid: int) -> str:
    """The path the target is to open the tracking library by: ours, or, when it runs in
    another root (a chroot, a container's mount namespace), the same file through our
    /proc/PID/root, which the kernel resolves to our root (if the target may read our /proc
    entry)."""
    try:
        theirs, ours = os.stat(f"/proc/{pid}/root"), os.stat("/")
        same = (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)
    except OSError:
        same = True
    return track_here.LIBRARY if same else f"/proc/{os.getpid()}/root{track_here.LIBRARY}"


def table_of(pid: int, maps: Sequence[Mapping]) -> Optional[tracking.TrackingTable]:
    """The target's tracking table, read live, or None."""
    with ProcessMemory(pid) as mem:
        return tracking.find_table(mem, maps)


# Raises UnsupportedTarget when the mappings show a program that cannot load the library
# (musl, a static executable, no dynamic loader) or whose heap `check` cannot see (another
# allocator: jemalloc, tcmalloc, ...).
def refuse_unloadable(pid: int, maps: Sequence[Mapping]) -> None:
    scan = detect.scan_maps(list(maps), pid)
    where = ("`memunreachable check` still finds its leaks, without allocation stacks")
    if scan.musl:
        raise UnsupportedTarget(f"process {pid} runs on musl libc, not glibc: allocation "
                                "tracking needs glibc", hint=where)
    if scan.static:
        raise UnsupportedTarget(f"process {pid} is a static executable ({scan.malloc_object}):"
                                " no library can be loaded into it", hint=where)
    if scan.foreign:
        raise UnsupportedTarget(f"process {pid} allocates with {', '.join(scan.foreign)}, not "
                                "glibc malloc: `memunreachable check` cannot see that heap",
                                hint="allocation stacks need a program that uses glibc malloc")
    if not inject.mapped_paths(maps, detect.is_loader):
        raise UnsupportedTarget(f"process {pid} has no dynamic loader (ld-linux) mapped: no "
                                "library can be loaded into it", hint=where)


def _read_int(pid: int, addr: int) -> int:
    with ProcessMemory(pid) as mem:
        return int.from_bytes(mem.read(addr, 4), "little", signed=True)


def _route_error(rc: int, what: str) -> TrackingError:
    name = errno.errorcode.get(-rc, str(-rc))
    return TrackingError(f"{what} failed in the target: {os.strerror(-rc)} ({name}); nothing "
                         "stays routed", hint=track_here._HINTS.get(name), errno=-rc)


# Runs body(fz, tid, restore_rt) with pid frozen, every thread but tid released, tid a thread
# that may take the calls (inject.choose_thread); freezes again up to ATTEMPTS times while
# every thread is busy (inject.busy_threads: inside malloc, the loader, ...). Returns the body's
# result. Raises UnsupportedTarget (seccomp), CollectionError (always busy) and what the
# body raises.
def _with_thread(pid: int, timeout: float, body):
    for attempt in range(ATTEMPTS):
        with frozen(pid, timeout) as fz:
            tid, restore_rt, refusals, busy = inject.choose_thread(fz)
            if tid:
                fz.release_others(tid)
                result = body(fz, tid, restore_rt)
                result.others_ms = fz.released_ms
                return result
        if not refusals and not busy:
            raise CollectionError(
                f"no thread of process {pid} can take the call: none is at an interrupt stop "
                "on a stack of its own (is the process stopped by job control?)")
        if refusals and not busy:
            raise UnsupportedTarget(
                f"no thread of process {pid} may load a library under its seccomp rules ("
                + "; ".join(f"thread {v.tid}: {v.reason}" for v in refusals) + ")",
                hint="the program's seccomp filter forbids what dlopen needs (openat, mmap, "
                     "mprotect); start it under `memunreachable run` instead, before it "
                     "installs its filter")
        time.sleep(RETRY_WAIT)
    raise CollectionError(
        f"every thread of process {pid} was inside malloc/free, the dynamic loader, an "
        f"unwinder or the tracking library at each of {ATTEMPTS} tries (threads {busy} the "
        "last time)",
        hint="try again; a process that allocates without pause on every thread can be "
             "tracked from its start with `memunreachable run`")


# Starts tracking in pid (see the module's text). Idempotent: a process already tracked
# (routed, or started under `run`) is left as it is (action "already"). Raises what
# preflight raises, UnsupportedTarget (see refuse_unloadable, seccomp), TrackingError (the
# library did not load, or routing failed: nothing stays routed), CollectionError.
@diagnose.hinted()
def start(pid: int, timeout: float = 2.0, python_objects: bool = False) -> Result:
    target = preflight(pid)
    with leftovers.guard(pid):
        maps = procfs.read_maps(pid)
        table = table_of(pid, maps)
        path = loaded_library(maps)
        if table is not None and table.enabled:
            return Result(pid, target.name, "already", table.summary()["started"], path)
        refuse_unloadable(pid, maps)
        dlopen = (0, "") if path else inject.find_dlopen(pid, maps)
        if not path and not dlopen[0]:
            raise UnsupportedTarget(f"no dlopen found in the libc of process {pid}",
                                    hint="is it a glibc program? `memunreachable check` "
                                         "still finds its leaks, without stacks")

        def load_and_route(fz, tid, restore_rt) -> Result:
            ms = 0.0
            if not path:
                ms += inject.call(fz, tid, dlopen[0], restore_rt, (0, RTLD_NOW | RTLD_LOCAL),
                                  data=os.fsencode(library_path(pid)) + b"\0")
            now = procfs.read_maps(pid)
            lib_path = loaded_library(now)      # as the target's maps name it
            syms = inject.symbols(pid, now, lib_path, ROUTE_NAMES) if lib_path else {}
            if path and len(syms) != len(ROUTE_NAMES):
                raise TrackingError(f"the tracking library loaded in process {pid} ({path}) "
                                    "is from another version of memunreachable",
                                    hint="stop tracking with that version's `track --stop`")
            if len(syms) != len(ROUTE_NAMES):
                raise TrackingError(
                    f"{dlopen[1]}({library_path(pid)}) failed in process {pid}: the library "
                    "is not mapped there",
                    hint="the target must be able to open that path (in another root or "
                         "mount namespace: read memunreachable's /proc entry; no noexec "
                         "mount); 'static TLS' errors: the library is loaded too late in "
                         "this process")
            ms += inject.call(fz, tid, syms["mu_track_route"], restore_rt)
            rc = _read_int(pid, syms["mu_track_last_rc"])
            if rc != 0:     # undone already by the library; once more, to be sure
                inject.call(fz, tid, syms["mu_track_unroute"], restore_rt)
                raise _route_error(rc, "routing the malloc family (mu_track_route)") if rc < 0 \
                    else TrackingError(f"mu_track_route did not run in process {pid}")
            python = False
            if python_objects:      # -ENOENT: no CPython there
                ms += inject.call(fz, tid, syms["mu_track_route_python_later"], restore_rt)
                python = _read_int(pid, syms["mu_track_last_rc"]) == 0
            table = table_of(pid, procfs.read_maps(pid))     # the table is new
            return Result(pid, target.name, "started",
                          table.summary()["started"] if table is not None else time.time(),
                          lib_path, tid, ms, python=python)

        return _with_thread(pid, timeout, load_and_route)


# Stops tracking in pid: mu_track_unroute() injected like start()'s calls. A process that
# is not tracked is left alone (action "not_tracked"). Raises like start(); TrackingError
# for a process started under `run` (the preloaded library cannot be taken out).
@diagnose.hinted()
def stop(pid: int, timeout: float = 2.0) -> Result:
    target = preflight(pid)
    with leftovers.guard(pid):
        maps = procfs.read_maps(pid)
        path = loaded_library(maps)
        table = table_of(pid, maps)
        if not path or table is None or not table.enabled:
            return Result(pid, target.name, "not_tracked", library=path)
        syms = inject.symbols(pid, maps, path, ["mu_track_unroute",
                                                "mu_track_unroute_python_later"])
        if "mu_track_unroute" not in syms:
            raise TrackingError(f"mu_track_unroute not found in {path} in process {pid}")

        def unroute(fz, tid, restore_rt) -> Result:
            ms = inject.call(fz, tid, syms["mu_track_unroute"], restore_rt)
            if "mu_track_unroute_python_later" in syms:     # pymalloc's domains, with the GIL
                ms += inject.call(fz, tid, syms["mu_track_unroute_python_later"], restore_rt)
            return Result(pid, target.name, "stopped", library=path, tid=tid, pause_ms=ms)

        result = _with_thread(pid, timeout, unroute)
        table = table_of(pid, maps)
        if table is not None and table.enabled:
            raise TrackingError(f"process {pid} was started under `memunreachable run`: its "
                                "preloaded tracking library cannot be taken out",
                                hint="restart it without `run` to run it untracked")
        return result
