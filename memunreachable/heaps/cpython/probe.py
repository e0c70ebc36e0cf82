"""cpython/probe.py: may this process hold a CPython runtime? Cheap, without the layouts.

Input: the target's mappings and pid. Output: candidates(maps, pid) -> [(path, mappings)] of
the objects that may hold _PyRuntime, best first (libpython*.so, python3.X, the executable),
and may_hold_runtime(maps, pid) -> bool: one of them exports _PyRuntime or has a .PyRuntime
section (elf.py). When it is False, locate.find_runtime finds nothing either, so the check
loads the CPython stages (and their ~60 ms of imports) only when it is True (issue 10).
References: elf(5); cpython-memory.md section 1.
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

from memunreachable.collect import procfs
from memunreachable._types import Mapping
from memunreachable.stacks.elf import cached_by_file

LIBPYTHON = re.compile(r"^libpython(\d)\.(\d+)[a-z]*\.so")
EXECUTABLE = re.compile(r"^python(\d)\.(\d+)[a-z]*$")
ANY_PYTHON = re.compile(r"^(lib)?python")   # not extension modules (foo.cpython-311-...so)

# file identity (st_dev, st_ino, st_size, st_mtime_ns) -> holds a runtime
_HOLDS: Dict[tuple, bool] = {}


def candidates(maps: Sequence[Mapping], pid: Optional[int]) -> List[Tuple[str, List[Mapping]]]:
    """Objects that may hold _PyRuntime, best first: libpython*.so, python3.X, the executable."""
    by_path: Dict[str, List[Mapping]] = {}
    for m in maps:
        if m.path.startswith("/") and m.inode:
            by_path.setdefault(m.path, []).append(m)
    exe = procfs.read_exe(pid)

    def rank(path: str) -> int:
        base = os.path.basename(path)
        if LIBPYTHON.match(base):
            return 0
        if EXECUTABLE.match(base):
            return 1
        if path == exe or ANY_PYTHON.search(base):
            return 2
        return 9
    out = [(p, ms) for p, ms in by_path.items() if rank(p) < 9]
    out.sort(key=lambda pm: rank(pm[0]))
    return out


def _holds_runtime(f) -> bool:
    return cached_by_file(_HOLDS, f, lambda e: e.machine_name == "EM_X86_64" and bool(
        e.dynsym_values(["_PyRuntime"]) or e.section(".PyRuntime")), most=256, on_error=False)


# may_hold_runtime's last answer: ((executable, the file mappings' (path, dev, inode)),
# answer). A check asks 4-5 times over the same maps (with the target's pid and its
# snapshot's), each time opening the candidates' files; the pid matters only through its
# executable (candidates' ranking).
_LAST: Optional[tuple] = None


def may_hold_runtime(maps: Sequence[Mapping], pid: Optional[int]) -> bool:
    """True when an object of candidates() exports _PyRuntime or has a .PyRuntime section."""
    global _LAST
    key = (procfs.read_exe(pid), tuple([(m.path, m.dev, m.inode) for m in maps if m.inode]))
    if _LAST is not None and _LAST[0] == key:
        return _LAST[1]
    answer = _may_hold_runtime(maps, pid)
    _LAST = (key, answer)
    return answer


def _may_hold_runtime(maps: Sequence[Mapping], pid: Optional[int]) -> bool:
    for path, mappings in candidates(maps, pid):
        try:
            with procfs.open_mapped_file(mappings, pid, path) as f:
                if _holds_runtime(f):
                    return True
        except OSError:
            continue
    return False
