"""track_here.py: allocation stacks for this process, started while it runs (no restart,
no LD_PRELOAD).

    track_here.start()      # route this process's malloc family through the tracking library
    track_here.start(python=True)   # and CPython's object allocator (pymalloc) too
    track_here.set_epoch(n) # the epoch recorded with each block from now on (Leak.epoch)
    track_here.active()     # -> True while routed
    track_here.stop()       # put every routed entry back; recording stops

start() loads memunreachable/_track.so (native/mu_track.c, the library `run` preloads) with
dlopen RTLD_LOCAL and calls mu_track_route: every loaded object's GOT entries of malloc,
free, calloc, realloc, posix_memalign, aligned_alloc, memalign, valloc, pvalloc,
reallocarray, malloc_usable_size, dlopen, dlclose and dlsym then lead to the library, and
objects dlopen'ed later are routed as they load. From then on each block allocated has its
stack (C and Python frames) in the tracking table, which `check` reads as for `run`; blocks
allocated before start() have none. stop() calls mu_track_unroute. The library stays loaded
(a function pointer taken while routed keeps working). docs/how-it-works.md, "Allocation
stacks".
"""
from __future__ import annotations

import ctypes
import errno
import os
from typing import Optional

from memunreachable._errors import TrackingError

LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_track.so")

_lib: Optional[ctypes.CDLL] = None
_py: Optional[ctypes.PyDLL] = None      # the same library, called with the GIL held
_active = False

_HINTS = {
    "ENOENT": "the malloc family was not found in the global scope: is this a glibc process?",
    "ELOOP": "the tracking library is in the global scope ahead of libc (loaded RTLD_GLOBAL "
             "or preloaded under another name): load it only through track_here",
    "ENOMEM": "no memory for the tracking table: lower MEMUNREACHABLE_TRACK_BUDGET",
    "ENOSPC": "more routed entries than the library keeps (65,536): too many loaded objects",
    "EACCES": "a read-only GOT page could not be made writable (an SELinux or similar "
              "policy forbids mprotect here)",
}


def start(python: bool = False) -> None:
    """Route this process's malloc family through the tracking library; idempotent.
    python: also CPython's MEM and OBJ domains (PyMem_SetAllocator: pymalloc's objects never
    reach malloc), so that Python objects get stacks under the default allocator.
    Raises TrackingError (with a hint) when the library cannot load or routing fails."""
    global _lib, _py, _active
    if _lib is None:
        try:
            lib = ctypes.CDLL(LIBRARY, mode=os.RTLD_LOCAL)
        except OSError as exc:
            raise TrackingError(f"cannot load the tracking library: {exc}",
                                hint="reinstall memunreachable (the wheel ships _track.so); "
                                     "'cannot allocate memory in static TLS block': load it "
                                     "earlier, before many libraries are loaded") from exc
        lib.mu_track_route.restype = ctypes.c_int
        lib.mu_track_unroute.restype = ctypes.c_int
        _lib = lib
        _py = ctypes.PyDLL(LIBRARY, mode=os.RTLD_LOCAL)
        _py.mu_track_set_epoch.argtypes = [ctypes.c_uint32]
    _check(_lib.mu_track_route(), "the malloc family")
    _active = True
    if python:
        _check(_py.mu_track_route_python(), "CPython's object allocator")


def _check(rc: int, what: str) -> None:
    if rc < 0:
        name = errno.errorcode.get(-rc, str(-rc))
        raise TrackingError(f"cannot route {what} through the tracking library: "
                            f"{os.strerror(-rc)} ({name})", hint=_HINTS.get(name), errno=-rc)


def set_epoch(epoch: int) -> None:
    """Record `epoch` (0..2**32-1) with every block allocated from now on (no-op when not
    started)."""
    if _py is not None:
        _py.mu_track_set_epoch(epoch)


def stop() -> None:
    """Put back every entry start() routed (an entry changed since by someone else stays);
    recording stops. Nothing to do when not started."""
    global _active
    if _lib is not None and _active:
        _py.mu_track_unroute_python()
        _lib.mu_track_unroute()
    _active = False


def active() -> bool:
    """Whether this process's malloc family is routed through the tracking library."""
    return _active

