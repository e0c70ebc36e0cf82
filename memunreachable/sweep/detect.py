"""Stage 4 (allocations): which allocator manages this process's heap (glibc-heap.md section 13).

Input: the target's mappings (and its pid, for /proc/PID/exe). Output: an AllocatorScan naming
the object that contains glibc malloc (libc, or the executable when glibc is linked statically),
plus any other allocator mapped. Messages for refusals come from here, so the wording is
tested in one place. threads_in_allocator(threads, maps, pid, arena_mutexes): the threads
stopped inside that object's code (a chunk may be in flight: the sweep confirms, the retake
judges, an injected call avoids them).
"""
from __future__ import annotations

import os
import struct
from typing import List, Optional, Tuple

from memunreachable.collect import procfs
from memunreachable._types import Fields, Mapping

# Matched with str methods, not regexes: compiling these was 0.5 ms of every check (issue 10).
# Other allocators (or glibc's debug malloc) that take over malloc when loaded: basename
# prefixes followed, anywhere later, by ".so" (libjemalloc.so.2, libasan.so.8.0.0, ...).
FOREIGN_PREFIXES = ("libjemalloc", "libtcmalloc", "libmimalloc", "libhoard", "libscudo",
                    "libsnmalloc", "libasan", "libclang_rt.asan")
FOREIGN_NAMES = ("libc_malloc_debug.so",)       # or with a version: libc_malloc_debug.so.0
FOREIGN_EXACT = ("libmemusage.so",)


def _basename(path: str) -> Optional[str]:
    """The part after the last "/", None when there is no "/"."""
    head, sep, base = path.rpartition("/")
    return base if sep else None


def is_libc(path: str) -> bool:
    """.../libc.so.6 or .../libc-2.NN.so (before glibc 2.34 the file, libc.so.6 its symlink)."""
    base = _basename(path)
    return base is not None and (base == "libc.so.6" or (
        base.startswith("libc-2.") and base.endswith(".so") and base[7:-3].isdecimal()))


def is_musl(path: str) -> bool:
    """musl's dynamic loader is its libc: /lib/ld-musl-ARCH.so.1 (Alpine), which Debian's musl
    package makes a symlink to /usr/lib/ARCH-linux-musl/libc.so (maps show the resolved path)."""
    base = _basename(path)
    if base is None:
        return False
    for prefix in ("ld-musl-", "libc.musl-"):
        if base.startswith(prefix) and base.endswith(".so.1"):
            return True
    return base == "libc.so" and "-linux-musl" in (_basename(path[:-len("/libc.so")]) or "")


def foreign_allocator(path: str) -> Optional[str]:
    """The basename of path when it is another allocator's shared object, else None."""
    base = _basename(path)
    if base is None:
        return None
    if base in FOREIGN_EXACT or base.startswith(FOREIGN_NAMES):
        return base
    for prefix in FOREIGN_PREFIXES:
        if base.startswith(prefix) and ".so" in base[len(prefix):]:
            return base
    return None


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
    exe = procfs.read_exe(pid)
    if exe is not None:
        return strip_deleted(exe)
    for m in maps:
        if m.path.startswith("/") and not m.anonymous:
            return strip_deleted(m.path)
    return None


# scan_maps' last answer: ((executable, mapped paths), (malloc_object, static, foreign, musl)).
# A check calls it 3-4 times over the same maps (with the target's pid and its snapshot's),
# and consecutive checks of one process mostly see the same paths (a pytest process's 200
# mappings: 0.7 ms a call). The answer depends on the pid only through its executable.
_LAST_SCAN: Optional[tuple] = None


def scan_maps(maps: List[Mapping], pid: Optional[int] = None) -> AllocatorScan:
    """Classify the allocator from the mapped objects (no memory is read)."""
    global _LAST_SCAN
    key = (procfs.read_exe(pid), tuple([m.path for m in maps]))
    if _LAST_SCAN is not None and _LAST_SCAN[0] == key:
        libc_path, static, foreign, musl = _LAST_SCAN[1]
        deleted = None if libc_path is None else libc_path + " (deleted)"
        return AllocatorScan(libc_path, [m for m in maps if m.path == libc_path
                                         or m.path == deleted] if libc_path else [],
                             static, list(foreign), musl)
    scan = _scan_maps(maps, pid)
    _LAST_SCAN = (key, (scan.malloc_object, scan.static, tuple(scan.foreign), scan.musl))
    return scan


def _scan_maps(maps: List[Mapping], pid: Optional[int]) -> AllocatorScan:
    scan = AllocatorScan()
    libc_path = None
    for m in maps:
        path = strip_deleted(m.path)
        if libc_path is None and is_libc(path):
            libc_path = path
        if is_musl(path):
            scan.musl = True
        foreign = foreign_allocator(path)
        if foreign and foreign not in scan.foreign:
            scan.foreign.append(foreign)
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


def is_loader(path: str) -> bool:
    """.../ld-linux*.so* (glibc's dynamic loader)."""
    base = _basename(path)
    return base is not None and base.startswith("ld-linux") and ".so" in base[len("ld-linux"):]


def malloc_interposers(maps: List[Mapping], scan: AllocatorScan, pid: Optional[int]) -> List[str]:
    """Loaded objects, other than glibc's own, whose dynamic symbol table defines `malloc`.

    Such an object (an unnamed allocator preloaded or linked into the program) takes every
    malloc call away from glibc's arenas. Looked up in each object's .dynsym (elf.py), so
    this costs a few ms even for a process with many libraries.
    """
    from memunreachable.stacks.elf import ElfError, ElfFile

    found: List[str] = []
    seen = set()
    for m in maps:
        path = strip_deleted(m.path)
        if (not path.startswith("/") or path in seen or path == scan.malloc_object
                or is_loader(path) or m.offset != 0 or m.anonymous):
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


GLIBC_BUILD_HINT = ("only glibc's malloc heap can be checked: check a build of the program "
                    "that uses glibc and its malloc (not musl, no other allocator linked in)")


def glibc_range_hint(version: Tuple[int, int], low: int, high: int) -> str:
    """What to do about a glibc release whose heap layout this version does not know."""
    if version[1] > high:
        return (f"glibc 2.{version[1]} is newer than this memunreachable knows: a newer "
                "memunreachable may read its heap (each release's layout is checked before it "
                "is accepted)")
    return f"glibc releases before 2.{low} (2018) are not supported"


def allocator_hint(names: List[str], pid: Optional[int]) -> str:
    """What a user can do when another allocator (names: its objects' paths or basenames)
    holds the heap: start the program without it when LD_PRELOAD brought it in, else check a
    build that uses glibc's malloc, or use that allocator's own leak reports."""
    preload = procfs.read_environ_var(pid, "LD_PRELOAD") if pid is not None else None
    words = (preload or "").replace(":", " ").split()
    preloaded = [n for n in names
                 if any(w == n or os.path.basename(w) == os.path.basename(n) for w in words)]
    if preloaded:
        return (f"LD_PRELOAD loads {', '.join(os.path.basename(n) for n in preloaded)}: "
                "start the program without it, and its allocations go to glibc's malloc, "
                "which this check reads")
    return ("only glibc's malloc heap can be checked: check a build of the program that "
            "allocates with glibc's malloc (Redis: make MALLOC=libc), or use the other "
            "allocator's own leak reports")


def interposer_message(paths: List[str]) -> str:
    names = ", ".join(os.path.basename(p) for p in paths)
    return (f"unsupported allocator: malloc is provided by {names}, not by glibc (glibc's arenas are "
            f"unused); leaks in that allocator's heap cannot be found: nothing was checked")


def unused_arenas_message() -> str:
    return ("unsupported allocator: glibc's malloc was initialised but its arenas hold no memory; "
            "the process probably uses another allocator (linked in statically?): nothing was checked")


# syscalls glibc malloc/free make while a chunk may be in flight (futex: see below)
_ALLOCATOR_SYSCALLS = {9, 10, 11, 12, 25, 28}   # mmap mprotect munmap brk mremap madvise
SYS_FUTEX = 202


def threads_in_allocator(threads, maps, pid: int, arena_mutexes) -> list:
    """tids that may hold a chunk in flight: stopped inside the code of the object that holds
    malloc (libc, or a static executable) while running user code, or in a syscall malloc
    makes, or waiting on an arena's mutex (futex on the arena's first word); [] when none.
    A thread parked in any other futex (condition variables, barriers) is not suspect;
    arena_mutexes None (not known yet): any futex in that code counts."""
    scan = scan_maps(maps, pid)
    text = [m.range for m in maps if m.executable and scan.malloc_object
            and strip_deleted(m.path) == scan.malloc_object]
    mutexes = set(arena_mutexes or ())
    out = []
    for t in threads:
        rip, orig_rax, rdi = t.regs[16], t.regs[15], t.regs[14]
        if not any(r.contains(rip) for r in text):
            continue
        if (orig_rax == 0xFFFFFFFFFFFFFFFF or orig_rax in _ALLOCATOR_SYSCALLS
                or (orig_rax == SYS_FUTEX and (arena_mutexes is None or rdi in mutexes))):
            out.append(t.tid)
    return out
