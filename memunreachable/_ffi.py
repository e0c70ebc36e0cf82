"""_ffi.py: the only importer of the compiled C core (memunreachable._native).

check(rc, op, ...) turns a -errno return into OSError naming the operation; u64_results(call,
op) collects what a native call writes into an array it may find too small; in_thread(fn, ...)
runs a native pass on another CPU meanwhile.
"""
from __future__ import annotations

import os
import sys
import threading
from array import array
from typing import Sequence, Tuple

try:
    from memunreachable._native import ffi, lib
except ImportError as exc:  # pragma: no cover - packaging problem
    if exc.name == "_cffi_backend":     # the C core is there, cffi is not (this Python's)
        raise ImportError(
            f"memunreachable's C core needs cffi, which {sys.executable} cannot import "
            "(pip install cffi)") from exc
    raise ImportError(
        "memunreachable's C core is not built; reinstall with `pip install .` "
        "(an editable install needs `pip install -e .` again after C changes)"
    ) from exc


def check(rc: int, op: str, pid: int = None, tid: int = None) -> int:
    """Return rc when >= 0, else raise OSError(-rc) naming op and pid/tid."""
    if rc >= 0:
        return rc
    err = -rc
    where = op
    if pid is not None:
        where += f" pid={pid}"
    if tid is not None:
        where += f" tid={tid}"
    raise OSError(err, os.strerror(err), where)


# entries from which a pass over big arrays takes a second thread (in_thread; the C core's own
# passes: TWO_WAYS_MIN): below, a thread's start costs more than it saves
TWO_THREADS_MIN = 1 << 20


def in_thread(fn, *args, name: str = "memunreachable-pass"):
    """Starts fn(*args) on a thread and returns a callable that waits for it and returns its
    result (or raises its exception). For native passes: cffi lets go of the GIL during a
    call, so the caller's next pass runs on another CPU meanwhile."""
    box: list = []

    def run():
        try:
            box.append((True, fn(*args)))
        except BaseException as exc:        # handed to the caller's thread
            box.append((False, exc))
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()

    def result():
        thread.join()
        ok, value = box[0]
        if not ok:
            raise value
        return value
    return result


def u64_results(call, what: str) -> array:
    """The uint64_t results that call(out) writes into an array('Q') `out` (a C function that
    returns how many there are, room or not, or -errno): grown once to the count when the
    first 1,024 entries were too few."""
    out = array("Q", bytes(8 * 1024))
    for _ in range(2):
        n = check(call(out), what)
        if n <= len(out):
            return out[:n]
        out = array("Q", bytes(8 * n))
    return out


def buffer_of(obj):
    """A C pointer to the bytes of a writable buffer (bytearray, mmap, array)."""
    return ffi.from_buffer(obj)


# Returns a uint64_t[] cdata over values (zero-copy for an array('Q') or other contiguous
# native 8-byte unsigned buffer), and the object to keep alive while it is in use.
def u64_view(values):
    if isinstance(values, array) and values.typecode in "QL" and values.itemsize == 8:
        return ffi.from_buffer("uint64_t[]", values), values
    try:
        mv = memoryview(values)
    except TypeError:
        mv = None
    if mv is not None and mv.format in ("Q", "L", "=Q", "<Q") and mv.itemsize == 8 and mv.c_contiguous:
        return ffi.from_buffer("uint64_t[]", values), values
    arr = array("Q", values)
    return ffi.from_buffer("uint64_t[]", arr), arr


# Returns a mu_region[] over (base, buffer) pairs and the objects to keep alive with it. A
# buffer with an uncopied_fd (glibc/copies.Uncopied) gives an uncopied region (mu_types.h).
def region_array(pairs: Sequence[Tuple[int, object]]):
    regions = ffi.new("mu_region[]", max(len(pairs), 1))
    keep = [regions]
    for k, (base, buf) in enumerate(pairs):
        fd = getattr(buf, "uncopied_fd", None)      # glibc/copies.Uncopied: read on demand
        if fd is not None:
            regions[k].base, regions[k].len = base, buf.nbytes
            regions[k].uncopied, regions[k].fd = 1, fd
            if getattr(buf, "cands", None) is not None:
                regions[k].cands = buf.cands
            continue
        nbytes = memoryview(buf).nbytes
        data = ffi.from_buffer("uint8_t[]", buf) if nbytes else ffi.NULL
        keep.append(data)
        regions[k].base = base
        regions[k].len = nbytes
        regions[k].data = data
    return regions, keep
