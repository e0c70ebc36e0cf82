"""Stage 4 (allocations, CPython): find the Python runtime in a process and check its layout.

Input: the target's mappings, a Memory reader, optionally its pid (for map_files) and frozen
threads. Output: a Runtime record (&_PyRuntime, version, layout) and, after validation, the
interpreters and their thread states.
Where (cpython-memory.md section 1): a libpython3.X*.so mapping (pyenv, --enable-shared), else
an executable exporting _PyRuntime (Debian's python3.11: non-PIE, libpython linked in). The
address comes from the ELF dynamic symbols (elf.py), else from the `.PyRuntime` section
(3.10+), plus the load bias. Version: `Py_Version` (3.11+), the `xdebugpy` _Py_DebugOffsets
header (3.13+), else the library or executable file name. References: elf(5); CPython
Include/internal/pycore_runtime.h, pycore_interp.h, Include/cpython/pystate.h.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from memunreachable.stacks import elf as E
from memunreachable.collect import procfs
from memunreachable._errors import MemoryUnreadable
from memunreachable._types import Mapping, ThreadState, read_u64
from memunreachable.heaps.cpython import layout as L
from memunreachable.heaps.cpython import probe
from memunreachable.heaps.cpython.probe import ANY_PYTHON, EXECUTABLE, LIBPYTHON  # noqa: F401

PAGE = 4096
MAX_INTERPRETERS = 256
MAX_THREADS = 1 << 16


@dataclass(frozen=True)
class Runtime:
    object_path: str
    runtime: int                         # &_PyRuntime in the target
    version: Optional[Tuple[int, int]]   # (3, 11); None when it could not be told
    version_hex: Optional[int]           # PY_VERSION_HEX when the target says it
    version_source: str                  # "Py_Version", "_Py_DebugOffsets", "file name", "none"
    shared: bool                         # True: libpython*.so (DYN); False: the executable
    symbol_source: str                   # "dynsym" or ".PyRuntime section"


@dataclass
class ThreadInfo:
    address: int                         # PyThreadState *
    thread_id: int                       # pthread_t
    native_thread_id: Optional[int]      # TID (3.11+)


@dataclass
class InterpreterInfo:
    address: int                         # PyInterpreterState *
    threads: List[ThreadInfo] = field(default_factory=list)


def _u32(mem, addr: int) -> int:
    return struct.unpack("<I", mem.read(addr, 4))[0]


def _i32(mem, addr: int) -> int:
    return struct.unpack("<i", mem.read(addr, 4))[0]


_candidates = probe.candidates


def _version_from_name(path: str) -> Optional[Tuple[int, int]]:
    base = os.path.basename(path)
    for rx in (LIBPYTHON, EXECUTABLE):
        m = rx.match(base)
        if m:
            return int(m.group(1)), int(m.group(2))
    return None


def _open(path: str, mappings: List[Mapping], pid: Optional[int]):
    return procfs.open_mapped_file(mappings, pid, path)


def _load_bias(elf, mappings: List[Mapping]) -> Optional[int]:
    """Runtime address minus link-time address (0 for a non-PIE executable)."""
    loads = [s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
    if not loads:
        return None
    first = min(loads, key=lambda s: s["p_vaddr"])
    page_off = first["p_offset"] & ~(PAGE - 1)
    for m in sorted(mappings, key=lambda m: m.begin):
        if m.offset == page_off:
            return m.begin - (first["p_vaddr"] & ~(PAGE - 1))
    return None


@dataclass(frozen=True)
class ElfFacts:
    """What the CPython stages read from an object's ELF file: independent of where it is
    mapped, so cached by file identity (a long-lived checker sees the same libpython again
    and again; parsing takes a few ms)."""
    machine_x64: bool
    first_load: Tuple[int, int]         # page-aligned p_offset, p_vaddr of the first PT_LOAD
    symbols: Dict[str, int]             # .dynsym values of the names asked for
    pyruntime_section: int              # .PyRuntime sh_addr, 0 when absent
    shared: bool                        # ET_DYN


_FACTS: Dict[tuple, Optional[ElfFacts]] = {}
FACT_SYMBOLS = ("_PyRuntime", "Py_Version", "PyList_Type", "PyFrame_Type", "PyCode_Type",
                "PyTuple_Type", "PyType_GenericAlloc", "PySet_Type", "PyFrozenSet_Type",
                "PyGen_Type", "PyCoro_Type", "PyAsyncGen_Type", "PyMemoryView_Type",
                "PyType_Type", "PyDict_Type") \
    + tuple(L.VALUE_TYPES) + tuple(L.WEAKREF_TYPES)


# Returns the ElfFacts of the open file f (FACT_SYMBOLS looked up), or None when it is not a
# usable ELF file (malformed, no PT_LOAD).
def elf_facts(f) -> Optional[ElfFacts]:
    return E.cached_by_file(_FACTS, f, _read_facts, most=256)


def _read_facts(elf: E.ElfFile) -> Optional[ElfFacts]:
    first = elf.first_load()
    if first is None:
        return None
    sec = elf.section(".PyRuntime")
    return ElfFacts(elf.machine_name == "EM_X86_64", first, elf.dynsym_values(FACT_SYMBOLS),
                    sec.sh_addr if sec is not None else 0, elf.shared)


def facts_bias(facts: ElfFacts, mappings: List[Mapping]) -> Optional[int]:
    """Runtime address minus link-time address (0 for a non-PIE executable)."""
    page_off, page_vaddr = facts.first_load
    for m in sorted(mappings, key=lambda m: m.begin):
        if m.offset == page_off:
            return m.begin - page_vaddr
    return None


def warm(maps: Sequence[Mapping], pid: Optional[int]) -> None:
    """Parse the candidate objects' ELF files now (in the long-lived checker, before the
    sweeper forks), so every sweeper finds them cached."""
    for path, mappings in _candidates(maps, pid):
        try:
            with _open(path, mappings, pid) as f:
                facts = elf_facts(f)
        except OSError:
            continue
        if facts is not None and ("_PyRuntime" in facts.symbols or facts.pyruntime_section):
            return              # find_runtime stops at this one too


# Returns the Runtime of the first candidate object that exports (or has a section for)
# _PyRuntime, or None when the process holds no CPython runtime.
def find_runtime(mem, maps: Sequence[Mapping], pid: Optional[int] = None) -> Optional[Runtime]:
    for path, mappings in _candidates(maps, pid):
        try:
            f = _open(path, mappings, pid)
        except OSError:
            continue
        with f:
            facts = elf_facts(f)
        if facts is None or not facts.machine_x64:
            continue
        bias = facts_bias(facts, mappings)
        if bias is None:
            continue
        syms = {k: v for k, v in facts.symbols.items() if k in ("_PyRuntime", "Py_Version")}
        source = "dynsym"
        if "_PyRuntime" not in syms:
            if not facts.pyruntime_section:
                continue
            syms["_PyRuntime"] = facts.pyruntime_section
            source = ".PyRuntime section"
        shared = facts.shared
        runtime = bias + syms["_PyRuntime"]
        version, vhex, vsource = _version_from_name(path), None, "file name"
        try:
            if "Py_Version" in syms:
                vhex = _u32(mem, bias + syms["Py_Version"])
                version, vsource = (vhex >> 24, (vhex >> 16) & 0xFF), "Py_Version"
            elif mem.read(runtime + L.DEBUG.cookie, 8) == L.DEBUG_COOKIE:
                vhex = read_u64(mem, runtime + L.DEBUG.version)
                version, vsource = (vhex >> 24, (vhex >> 16) & 0xFF), "_Py_DebugOffsets"
        except MemoryUnreadable:
            pass
        if version is None:
            vsource = "none"
        return Runtime(path, runtime, version, vhex, vsource, shared, source)
    return None


class LayoutMismatch(Exception):
    """The layout table does not describe the target (a sentence saying what disagreed)."""


class NoInterpreter(LayoutMismatch):
    """The runtime has no interpreter: not initialised yet, or finalised (a check at exit)."""


def _check_debug_offsets(mem, rt: Runtime, lay: L.Layout) -> None:
    """A table's layout (3.13+, tests give one) must agree with the target's _Py_DebugOffsets
    in every offset it gives (not in struct sizes: patch releases grow structs at their end)."""
    d = read_debug_offsets(mem, rt, lay.version)
    pairs = [("interpreters.head", "runtime_state.interpreters_head", lay.interpreters_head),
             ("interp->next", "interpreter_state.next", lay.interp_next),
             ("interp->threads.head", "interpreter_state.threads_head", lay.interp_threads_head),
             ("tstate->next", "thread_state.next", lay.tstate_next),
             ("tstate->interp", "thread_state.interp", lay.tstate_interp),
             ("tstate->thread_id", "thread_state.thread_id", lay.tstate_thread_id),
             ("tstate->native_thread_id", "thread_state.native_thread_id",
              lay.tstate_native_thread_id)]
    if lay.datastack is not None:
        pairs.append(("tstate->datastack_chunk", "thread_state.datastack_chunk",
                      lay.datastack.tstate_chunk))
    for what, key, want in pairs:
        if d[key] != want:
            raise LayoutMismatch(f"_Py_DebugOffsets gives {what} = {d[key]}, the table {want}")


class FreeThreaded(Exception):
    """The runtime is a free-threaded build (_Py_DebugOffsets.free_threaded): no pymalloc."""


# Returns the parsed _Py_DebugOffsets at the start of the runtime (layout.parse_debug_offsets)
# for `version`. Raises LayoutMismatch when the cookie is missing, the version it gives is
# another one, or the version's struct is unknown; FreeThreaded for a free-threaded build.
def read_debug_offsets(mem, rt: Runtime, version: Tuple[int, int]) -> Dict[str, int]:
    base = rt.runtime
    try:
        head = mem.read(base, L.DEBUG_HEAD)
        if head[L.DEBUG.cookie:L.DEBUG.cookie + 8] != L.DEBUG_COOKIE:
            raise LayoutMismatch("no _Py_DebugOffsets cookie at _PyRuntime")
        vhex, ft = struct.unpack_from("<QQ", head, L.DEBUG.version)
        if (vhex >> 24, (vhex >> 16) & 0xFF) != tuple(version[:2]):
            raise LayoutMismatch(f"_Py_DebugOffsets says version {vhex:#x}")
        if ft:
            raise FreeThreaded(vhex)
        size = L.debug_offsets_size(version)
        if size is None:
            raise LayoutMismatch("its _Py_DebugOffsets struct is unknown")
        d = L.parse_debug_offsets(mem.read(base, size), version)
    except MemoryUnreadable as exc:
        raise LayoutMismatch(f"unreadable memory at {exc.address:#x}") from None
    if d is None:
        raise LayoutMismatch("its _Py_DebugOffsets struct is unknown")
    return d


# Returns the offset of _PyRuntime.preconfig.allocator: the known build's of this runtime size,
# else the one offset among the version's known ones that holds a plausible PyPreConfig.
# Raises LayoutMismatch when none (or more than one) does.
def resolve_preconfig(mem, rt: Runtime, sup: L.Supplement, runtime_size: int) -> int:
    known = dict(sup.preconfig_allocator)
    if runtime_size in known:
        return known[runtime_size]
    good = []
    for off in sorted(set(known.values())):
        try:
            raw = mem.read(rt.runtime + off - L.PRECONFIG_ALLOCATOR, 4 * L.PRECONFIG_INTS)
        except MemoryUnreadable:
            continue
        if L.preconfig_plausible(struct.unpack(f"<{L.PRECONFIG_INTS}i", raw)):
            good.append(off)
    if len(good) != 1:
        raise LayoutMismatch(f"runtime size {runtime_size} is a build of unknown layout, and "
                             f"{len(good)} of the known PyPreConfig places "
                             f"{sorted(set(known.values()))} hold one")
    return good[0]


# Returns the layout of a 3.13+ runtime built from its own _Py_DebugOffsets plus the version's
# table of what that lacks (layout.SUPPLEMENTS). Raises LayoutMismatch (FreeThreaded) as
# read_debug_offsets, or when the version has no table.
def debug_layout(mem, rt: Runtime) -> L.Layout:
    version = tuple(rt.version[:2])
    sup = L.SUPPLEMENTS.get(version)
    d = read_debug_offsets(mem, rt, version)
    if sup is None:
        raise LayoutMismatch("no table of what its _Py_DebugOffsets lacks")
    return L.from_debug_offsets(version, d, resolve_preconfig(mem, rt, sup,
                                                              d["runtime_state.size"]))


# Returns the layout with its GC generations' offset read from the runtime (3.13: the
# generation0 pointer of each interpreter's GC state points at generations[0].head; its
# offset is one of the known ones). Unchanged when the layout has no such pointer. Raises
# LayoutMismatch when a pointer says otherwise.
def resolve_gc(mem, lay: L.Layout, interps: Sequence["InterpreterInfo"]) -> L.Layout:
    gc = lay.gc
    if gc is None or gc.generation0 is None:
        return lay
    found = set()
    try:
        for i in interps:
            state = i.address + gc.offset
            found.add(read_u64(mem, state + gc.generation0) - state)
    except MemoryUnreadable as exc:
        raise LayoutMismatch(f"GC state unreadable at {exc.address:#x}") from None
    if len(found) != 1 or not found <= set(gc.generations_choices):
        raise LayoutMismatch(f"the GC states' generation0 pointers give generations at "
                             f"{sorted(found)}, none of {list(gc.generations_choices)}")
    return lay._replace(gc=gc._replace(generations=found.pop(), generation0=None))


def _mapped(maps: Sequence[Mapping], addr: int, size: int) -> bool:
    return any(m.begin <= addr and addr + size <= m.end and m.readable for m in maps)


# Returns the interpreters (main last, as CPython links them) with their thread states.
# Raises LayoutMismatch when the layout does not describe the target: a pointer outside
# readable memory, a chain that does not end, tstate->interp != interp, the main interpreter
# absent from the list, or (given threads) no thread state matching a frozen thread.
def walk_interpreters(mem, maps: Sequence[Mapping], rt: Runtime, lay: L.Layout,
                      threads: Sequence[ThreadState] = ()) -> List[InterpreterInfo]:
    try:
        if lay.debug_offsets and lay.source == "table":
            _check_debug_offsets(mem, rt, lay)
        if not _mapped(maps, rt.runtime, lay.runtime_size):
            raise LayoutMismatch(f"_PyRuntime at {rt.runtime:#x} + {lay.runtime_size} is not mapped")
        head = read_u64(mem, rt.runtime + lay.interpreters_head)
        main = read_u64(mem, rt.runtime + lay.interpreters_main)
        out: List[InterpreterInfo] = []
        seen = set()
        interp = head
        while interp:
            if interp in seen or len(out) >= MAX_INTERPRETERS:
                raise LayoutMismatch("the interpreter list does not end")
            if interp % 8 or not _mapped(maps, interp, lay.interp_size):
                raise LayoutMismatch(f"interpreter {interp:#x} is not in readable memory")
            seen.add(interp)
            info = InterpreterInfo(interp)
            ts = read_u64(mem, interp + lay.interp_threads_head)
            tseen = set()
            while ts:
                if ts in tseen or len(tseen) >= MAX_THREADS:
                    raise LayoutMismatch(f"the thread list of interpreter {interp:#x} does not end")
                if ts % 8 or not _mapped(maps, ts, lay.tstate_size):
                    raise LayoutMismatch(f"thread state {ts:#x} is not in readable memory")
                if read_u64(mem, ts + lay.tstate_interp) != interp:
                    raise LayoutMismatch(f"thread state {ts:#x} does not point back to "
                                         f"interpreter {interp:#x}")
                tseen.add(ts)
                native = (read_u64(mem, ts + lay.tstate_native_thread_id)
                          if lay.tstate_native_thread_id is not None else None)
                info.threads.append(ThreadInfo(ts, read_u64(mem, ts + lay.tstate_thread_id), native))
                ts = read_u64(mem, ts + lay.tstate_next)
            out.append(info)
            interp = read_u64(mem, interp + lay.interp_next)
    except MemoryUnreadable as exc:
        raise LayoutMismatch(f"unreadable memory at {exc.address:#x}") from None
    if not out:
        raise NoInterpreter("no interpreter (the runtime is not initialised or finalised)")
    if main not in seen:
        raise LayoutMismatch(f"interpreters.main {main:#x} is not in the interpreter list")
    if threads:
        tids = {t.tid for t in threads}
        bases = {t.fs_base for t in threads}
        known = [ti for i in out for ti in i.threads]
        if known and not any((ti.native_thread_id in tids) if ti.native_thread_id is not None
                             else (ti.thread_id in bases) for ti in known):
            raise LayoutMismatch("no thread state belongs to a thread of the process")
    return out


def read_allocator(mem, rt: Runtime, lay: L.Layout) -> int:
    """_PyRuntime.preconfig.allocator (PyMemAllocatorName; layout.ALLOCATOR_NAMES)."""
    return _i32(mem, rt.runtime + lay.preconfig_allocator)
