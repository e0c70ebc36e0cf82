"""_ffi.py: the only importer of the compiled C core (memunreachable._native).

check(rc, op, ...) turns a -errno return into OSError naming the operation.
"""
from __future__ import annotations

import os

try:
    from memunreachable._native import ffi, lib
except ImportError as exc:  # pragma: no cover - packaging problem
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


def u64_array(values):
    """A C uint64_t[] holding values (a sequence of ints or an array('Q'))."""
    return ffi.new("uint64_t[]", values)


def buffer_of(obj):
    """A C pointer to the bytes of a writable buffer (bytearray, mmap, array)."""
    return ffi.from_buffer(obj)
