"""Stage 4 (allocations): which allocator manages this process's heap (glibc-heap.md section 13).

Input: the target's mappings (and its pid, for /proc/PID/exe). Output: an AllocatorScan naming
the object that contains glibc malloc (libc, or the executable when glibc is linked statically),
plus any other allocator mapped. Messages for refusals come from here, so the wording is
tested in one place.
"""
from __future__ import annotations

import os
import re
import struct
from typing import List, Optional

from memunreachable._types import Fields, Mapping

LIBC_RE = re.compile(r"/libc(?:\.so\.6|-2\.\d+\.so)$")
# musl's dynamic loader is its libc: /lib/ld-musl-ARCH.so.1 (Alpine), which Debian's musl
# package makes a symlink to /usr/lib/ARCH-linux-musl/libc.so (maps show the resolved path).
MUSL_RE = re.compile(r"/(?:ld-musl-[^/]*\.so\.1|libc\.musl-[^/]*\.so\.1|[^/]*-linux-musl[^/]*/libc\.so)$")
# Other allocators (or glibc's debug malloc) that take over malloc when loaded.
FOREIGN_RE = re.compile(
    r"/(libjemalloc[^/]*\.so[^/]*|libtcmalloc[^/]*\.so[^/]*|libmimalloc[^/]*\.so[^/]*|"
    r"libhoard[^/]*\.so[^/]*|libscudo[^/]*\.so[^/]*|libsnmalloc[^/]*\.so[^/]*|"
    r"libasan[^/]*\.so[^/]*|libclang_rt\.asan[^/]*\.so[^/]*|libc_malloc_debug\.so[^/]*|"
    r"libmemusage\.so)$")


class AllocatorScan(Fields):
    """What the mappings say about the allocator."""
    __slots__ = ("malloc_object", "object_mappings", "static", "foreign", "musl")

    def __init__(self,
                 malloc_object: Optional[str] = None,   # path of libc or of the static executable
                 object_mappings: Optional[List[Mapping]] = None,
                 static: bool = False,                    # no libc mapped: try the executable
                 foreign: Optional[List[str]] = None,     # basenames of other allocators
                 musl: bool = False):     # musl's libc/loader is mapped (dynamically linked)
        self.malloc_object = malloc_object
        self.object_mappings = [] if object_mappings is None else object_mappings
        self.static = static
        self.foreign = [] if foreign is None else foreign
        self.musl = musl


def strip_deleted(path: str) -> str:
    return path[:-len(" (deleted)")] if path.endswith(" (deleted)") else path


def executable_path(maps: List[Mapping], pid: Optional[int]) -> Optional[str]:
    """Path of the main executable: /proc/PID/exe, else the first file-backed mapping."""
    if pid is not None:
        try:
            return strip_deleted(os.readlink(f"/proc/{pid}/exe"))
        except OSError:
            pass
    for m in maps:
        if m.path.startswith("/") and not m.anonymous:
            return strip_deleted(m.path)
    return None


def scan_maps(maps: List[Mapping], pid: Optional[int] = None) -> AllocatorScan:
    """Classify the allocator from the mapped objects (no memory is read)."""
    scan = AllocatorScan()
    libc_path = None
    for m in maps:
        path = strip_deleted(m.path)
        if LIBC_RE.search(path) and libc_path is None:
            libc_path = path
        if MUSL_RE.search(path):
            scan.musl = True
        f = FOREIGN_RE.search(path)
        if f and f.group(1) not in scan.foreign:
            scan.foreign.append(f.group(1))
    if libc_path is None:
        libc_path = executable_path(maps, pid)
        scan.static = True
    scan.malloc_object = libc_path
    scan.object_mappings = [m for m in maps if strip_deleted(m.path) == libc_path] if libc_path else []
    return scan


def foreign_message(scan: AllocatorScan) -> str:
    names = ", ".join(scan.foreign)
    return (f"the heap is managed by {names}, not by glibc malloc (glibc's arenas are unused); "
            f"leaks in that allocator's heap cannot be found: nothing was checked")


def not_glibc_message(scan: AllocatorScan, what: str) -> str:
    if scan.musl:
        kind = "musl libc (dynamically linked)"
    elif scan.static:
        kind = f"a static executable without glibc malloc ({scan.malloc_object})"
    else:
        kind = f"an unknown allocator ({scan.malloc_object})"
    return f"unsupported allocator: looks like {kind}; {what}; nothing was checked"


LOADER_RE = re.compile(r"/ld-linux[^/]*\.so[^/]*$")


def malloc_interposers(maps: List[Mapping], scan: AllocatorScan, pid: Optional[int]) -> List[str]:
    """Loaded objects, other than glibc's own, whose dynamic symbol table defines `malloc`.

    Such an object (an unnamed allocator preloaded or linked into the program) takes every
    malloc call away from glibc's arenas. Looked up in each object's .dynsym (elf.py), so
    this costs a few ms even for a process with many libraries.
    """
    from memunreachable.elf import ElfError, ElfFile

    found: List[str] = []
    seen = set()
    for m in maps:
        path = strip_deleted(m.path)
        if (not path.startswith("/") or path in seen or path == scan.malloc_object
                or LOADER_RE.search(path) or m.offset != 0 or m.anonymous):
            continue
        seen.add(path)
        src = f"/proc/{pid}/map_files/{m.begin:x}-{m.end:x}" if pid is not None else path
        try:
            with open(src if os.path.exists(src) else path, "rb") as f:
                if ElfFile(f).defines_function("malloc"):
                    found.append(path)
        except (OSError, ElfError, ValueError, struct.error):
            continue
    return found


def interposer_message(paths: List[str]) -> str:
    names = ", ".join(os.path.basename(p) for p in paths)
    return (f"unsupported allocator: malloc is provided by {names}, not by glibc (glibc's arenas are "
            f"unused); leaks in that allocator's heap cannot be found: nothing was checked")


def unused_arenas_message() -> str:
    return ("unsupported allocator: glibc's malloc was initialised but its arenas hold no memory; "
            "the process probably uses another allocator (linked in statically?): nothing was checked")
