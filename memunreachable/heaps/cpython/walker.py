"""Stage 4 (allocations, CPython): a memory map of the CPython runtime in a snapshot.

Input: a Memory reader, the mappings, the frozen threads, the pid (map_files only), and
optionally the layout table to use ({(major, minor): Layout}; tests fake versions with it). Output: CPythonMap, built to merge into the pipeline
next to glibc's HeapWalk (see CPythonMap's docstring for the contract):
    blocks/sizes   pymalloc's used blocks: allocations, like glibc chunks (kind "pymalloc")
    heap_ranges    pymalloc's arenas (3.12+) or pools (3.8-3.11): never roots; their free
                   blocks, virgin tails, empty and uncarved pools are not allocations either
    dead_ranges    memory outside pymalloc that must not be a root: each 3.11+ thread's data
                   stack beyond its live top, the free-list arrays and heads (3.10+)
    dead_blocks    allocation addresses holding free-listed (dead) objects (3.10+): not
                   allocations to scan or report
Steps: find _PyRuntime and the version (locate.py), pick the layout table, validate it by
walking interpreters and thread states, read the allocator choice, walk pymalloc
(obmalloc.py), then the data stacks and free lists. Anything unknown or inconsistent leaves
usable=False with a warning saying so, appended last: CPython's memory is then scanned whole
as roots and the check is incomplete (pipeline.py's blind), never a wrong answer.
References: cpython-memory.md.
"""
from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from memunreachable._errors import MemoryUnreadable
from memunreachable._types import Mapping, Range, ThreadState, merge_ranges
from memunreachable.heaps.cpython import layout as L
from memunreachable.heaps.cpython import locate, obmalloc
from memunreachable.heaps.cpython.locate import InterpreterInfo, LayoutMismatch, Runtime
from memunreachable.collect import procfs
from memunreachable.collect.memory import CopiedMemory

MAX_CHUNKS = 1 << 16
MAX_CHUNK_BYTES = 1 << 30
OPAQUE = ("its Python objects and pymalloc blocks cannot be checked (its memory is scanned "
          "whole as roots)")


@dataclass
class DataStackInfo:
    """One 3.11+ thread's frame data stack: live parts are roots, dead parts are not."""
    thread: int                       # PyThreadState *
    live: List[Range] = field(default_factory=list)
    dead: List[Range] = field(default_factory=list)


@dataclass
class CPythonMap:
    """What the snapshot says about CPython's memory.

    Contract for the pipeline (when usable is True): add blocks/sizes to the allocations
    (kind "pymalloc"; they never overlap glibc chunks: arenas are mmapped); add heap_ranges to
    the walker's heap ranges (cut from roots, not allocations); cut dead_ranges from the roots
    (those lying inside a glibc allocation, e.g. the 3.10 interpreter's free lists, must be
    masked inside that allocation instead); drop dead_blocks from the allocations (their objects
    are dead: neither scanned nor reported). regions are local copies covering every block.
    When usable is False, ignore everything but warnings (the last one says why) and
    no_interpreter.
    """
    found: bool                                   # a CPython runtime is in the process
    usable: bool = False                          # validated: the fields below may be trusted
    # no interpreter exists (before Py_Initialize, after Py_Finalize: a check at exit): there
    # are no Python objects to see; what the runtime left is scanned whole, not a blind spot
    no_interpreter: bool = False
    runtime: Optional[Runtime] = None
    layout: Optional[L.Layout] = None
    interpreters: List[InterpreterInfo] = field(default_factory=list)
    allocator: Optional[str] = None               # PyPreConfig.allocator name
    pymalloc: Optional[obmalloc.PymallocWalk] = None
    blocks: array = field(default_factory=lambda: array("Q"))
    sizes: array = field(default_factory=lambda: array("Q"))
    room: Optional[Tuple[object, object]] = None      # PymallocWalk.room
    heap_ranges: List[Range] = field(default_factory=list)
    dead_ranges: List[Range] = field(default_factory=list)
    dead_blocks: array = field(default_factory=lambda: array("Q"))
    datastacks: List[DataStackInfo] = field(default_factory=list)
    regions: List[Tuple[int, object]] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    kind = "pymalloc"                             # the allocation kind of blocks

    @property
    def version(self) -> Optional[Tuple[int, int]]:
        return self.runtime.version if self.runtime else None

    @property
    def root_cuts(self) -> List[Range]:
        """Everything to cut from the roots: heap_ranges + dead_ranges, merged (empty when
        not usable)."""
        if not self.usable:
            return []
        return merge_ranges(list(self.heap_ranges) + list(self.dead_ranges))


_Q, _I = struct.Struct("<Q"), struct.Struct("<i")


def _u64(mem, addr: int) -> int:
    view = mem.view(addr, 8) if isinstance(mem, CopiedMemory) else None    # no bytes copy
    return _Q.unpack_from(view if view is not None else mem.read(addr, 8))[0]


def _u32(mem, addr: int) -> int:
    return _i32(mem, addr) & 0xFFFFFFFF


def _i32(mem, addr: int) -> int:
    view = mem.view(addr, 4) if isinstance(mem, CopiedMemory) else None
    return _I.unpack_from(view if view is not None else mem.read(addr, 4))[0]


# Returns the data stack of thread state ts: live [data, datastack_top) of the current chunk
# and [data, data + 8*top) of each older chunk; the rest of every chunk is dead. Raises
# LayoutMismatch when the chunk chain does not add up.
def read_datastack(mem, lay: L.Layout, ts: int) -> DataStackInfo:
    ds = lay.datastack
    info = DataStackInfo(ts)
    chunk = _u64(mem, ts + ds.tstate_chunk)
    if chunk == 0:
        return info
    top, limit = _u64(mem, ts + ds.tstate_top), _u64(mem, ts + ds.tstate_limit)
    size = _u64(mem, chunk + ds.chunk_size)
    if limit != chunk + size or not (chunk + ds.chunk_data <= top <= limit) or top % 8:
        raise LayoutMismatch(f"thread state {ts:#x}: data stack chunk {chunk:#x} size {size} "
                             f"top {top:#x} limit {limit:#x} do not fit")
    info.live.append(Range(chunk + ds.chunk_data, top))
    info.dead.append(Range(top, limit))
    if ds.tstate_cached_chunk is not None:      # a freed chunk kept for reuse: all dead
        cached = _u64(mem, ts + ds.tstate_cached_chunk)
        if cached:
            size = _u64(mem, cached + ds.chunk_size)
            if cached % 8 or not ds.chunk_data <= size <= MAX_CHUNK_BYTES:
                raise LayoutMismatch(f"thread state {ts:#x}: cached data stack chunk "
                                     f"{cached:#x} of size {size} does not fit")
            info.dead.append(Range(cached, cached + size))
    prev, n = _u64(mem, chunk + ds.chunk_previous), 0
    while prev:
        n += 1
        if n > MAX_CHUNKS:
            raise LayoutMismatch(f"thread state {ts:#x}: the data stack chunk list does not end")
        size = _u64(mem, prev + ds.chunk_size)
        end = prev + ds.chunk_data + 8 * _u64(mem, prev + ds.chunk_top)
        if size < ds.chunk_data or end > prev + size:
            raise LayoutMismatch(f"thread state {ts:#x}: older data stack chunk {prev:#x} "
                                 "does not fit")
        info.live.append(Range(prev + ds.chunk_data, end))
        info.dead.append(Range(end, prev + size))
        prev = _u64(mem, prev + ds.chunk_previous)
    return info


# How many of a type version cache's entries version_cache_dead checks for a type each.
VERSION_CACHE_CHECKS = 64


# Returns [the range of interpreter interp's type version cache] (3.14+:
# Layout.type_version_cache): borrowed pointers, cleared when their type is freed, so no
# references (a class used, then leaked by a missing Py_DECREF, stayed reachable through its
# entry on 3.14 and 3.15); [] when the layout has none. Raises LayoutMismatch when the array
# does not read as one: an entry not 0 and not 8-aligned, or, of up to VERSION_CACHE_CHECKS
# entries (evenly spread), one whose ob_type's tp_flags lack Py_TPFLAGS_TYPE_SUBCLASS or fewer
# than 3 in 4 whose tp_version_tag is their index modulo the size (a type given a new tag
# keeps its old entry too; a window 8 bytes off matches none).
def version_cache_dead(mem, lay: L.Layout, interp: int) -> List[Range]:
    if lay.type_version_cache is None:
        return []
    at, size = interp + lay.type_version_cache, L.TYPE_VERSION_CACHE_SIZE
    words = array("Q")
    words.frombytes(bytes(mem.read(at, 8 * size)))
    used = [(k, w) for k, w in enumerate(words) if w]
    if any(w % 8 for _, w in used):
        raise LayoutMismatch(f"type version cache at {at:#x}: an entry is no address")
    checked = used[::max(1, len(used) // VERSION_CACHE_CHECKS)]
    matched = 0
    for k, t in checked:
        if not _u64(mem, _u64(mem, t + 8) + L.TP_FLAGS) & L.TPFLAGS_TYPE_SUBCLASS:
            raise LayoutMismatch(f"type version cache at {at:#x}: entry {t:#x} is no type")
        matched += _u32(mem, t + L.TP_VERSION_TAG) % size == k
    if 4 * matched < 3 * len(checked):
        raise LayoutMismatch(f"type version cache at {at:#x}: {len(checked) - matched} of "
                             f"{len(checked)} entries are not at their type's version tag")
    return [Range(at, at + 8 * size)]


class _FreeListError(Exception):
    pass


# Returns (dead object allocation addresses, free-list array ranges) of one interpreter
# (3.10+). Every listed object must have ob_refcnt 0 (cpython-memory.md section 6).
# prefix: bytes before the object's memory in its allocation (debug hooks: DEBUG_HOOK_PREFIX).
def read_freelists(mem, lay: L.Layout, interp: int,
                   prefix: int = 0) -> Tuple[List[int], List[Range]]:
    fl = lay.freelists
    dead: List[int] = []
    regions = _copy_regions(mem)

    def take(obj: int, gc: bool, what: str) -> None:
        if obj % 8 or _u64(mem, obj + L.OB_REFCNT) != 0:
            raise _FreeListError(f"{what} entry {obj:#x} is not a dead object")
        dead.append(obj - prefix - (L.GC_HEAD_SIZE if gc else 0))

    def numfree(off: int, limit: int, what: str) -> int:
        n = _i32(mem, interp + off)
        if not 0 <= n <= limit:
            raise _FreeListError(f"{what} numfree {n} out of range")
        return n

    def chain(obj: int, n: int, link: int, gc: bool, what: str) -> None:
        # natively through the copies (thousands of tuples in a test process: 5 ms in Python)
        objs = _follow_chain(mem, regions, obj, n, link)
        for o in objs:
            dead.append(o - prefix - (L.GC_HEAD_SIZE if gc else 0))
        obj = objs.next
        for _ in range(n - len(objs)):
            if obj == 0:
                raise _FreeListError(f"{what} free list shorter than numfree")
            take(obj, gc, what)
            obj = _u64(mem, obj + link)

    # floats: chained through ob_type
    n = numfree(fl.float_numfree, fl.float_max, "float")
    chain(_u64(mem, interp + fl.float_head), n, L.OB_TYPE, False, "float")
    # tuples: one chain per size, through ob_item[0]
    for i in range(fl.tuple_first, fl.tuple_lists):
        n = numfree(fl.tuple_numfree + 4 * i, fl.tuple_max, "tuple")
        chain(_u64(mem, interp + fl.tuple_heads + 8 * i), n, L.TUPLE_ITEM0, True, "tuple")
    # lists, dicts (GC objects) and dict keys (plain blocks): arrays below numfree
    for items, nf, gc, what in ((fl.list_items, fl.list_numfree, True, "list"),
                                (fl.dict_items, fl.dict_numfree, True, "dict")):
        n = numfree(nf, fl.array_len, what)
        for k in range(n):
            take(_u64(mem, interp + items + 8 * k), gc, what)
    n = numfree(fl.keys_numfree, fl.array_len, "dict keys")
    for k in range(n):
        dead.append(_u64(mem, interp + fl.keys_items + 8 * k) - prefix)
    ranges = [Range(interp + fl.float_head, interp + fl.float_head + 8),
              Range(interp + fl.tuple_heads, interp + fl.tuple_heads + 8 * fl.tuple_lists),
              Range(interp + fl.list_items, interp + fl.list_items + 8 * fl.array_len),
              Range(interp + fl.dict_items, interp + fl.dict_items + 8 * fl.array_len),
              Range(interp + fl.keys_items, interp + fl.keys_items + 8 * fl.array_len)]
    return dead, ranges


# Returns (dead allocation addresses, the free-list heads' range) of one interpreter's 3.14+
# free lists (layout.FreeListHeads): each list's `size` entries, linked through their first
# word, the last one's NULL. An object entry's block starts before it by its GC head (and
# pre-header) as its type says (its ob_type is intact); a raw entry (a dict key table, a
# writer) is its block. prefix: as read_freelists'.
def read_freelist_heads(mem, lay: L.Layout, interp: int,
                        prefix: int = 0) -> Tuple[List[int], List[Range]]:
    fh = lay.freelist_heads
    dead: List[int] = []
    regions = _copy_regions(mem)
    offsets = {}                        # type -> its objects' offset in their blocks
    pre = L.preheader_flags(lay.version)
    for name, off, objects in fh.lists():
        head = _u64(mem, interp + off)
        n = _Q.unpack(mem.read(interp + off + 8, 8))[0]
        if n >= 1 << 63:                # -1: disabled (finalizing)
            continue
        if n > L.FREELIST_MAX:
            raise _FreeListError(f"{name} size {n} out of range")
        objs = _follow_chain(mem, regions, head, n, 0, check=False)
        entries = list(objs)
        obj = objs.next
        for _ in range(n - len(objs)):
            if obj == 0 or obj % 8:
                raise _FreeListError(f"{name} free list shorter than its size {n}")
            entries.append(obj)
            obj = _u64(mem, obj)
        if obj != 0:
            raise _FreeListError(f"{name} free list longer than its size {n}")
        for e in entries:
            if not objects:
                dead.append(e - prefix)
                continue
            t = _u64(mem, e + L.OB_TYPE)
            where = offsets.get(t)
            if where is None:
                flags = _type_flags(mem, t)
                if flags is None:
                    raise _FreeListError(f"{name} entry {e:#x} has no type")
                where = offsets[t] = (L.GC_HEAD_SIZE * bool(flags & L.TPFLAGS_HAVE_GC)
                                      + 16 * bool(flags & pre))
            dead.append(e - prefix - where)
    return dead, [Range(interp + fh.offset, interp + fh.offset + fh.sizeof)]


def _type_flags(mem, t: int) -> Optional[int]:
    """tp_flags of t when it reads as a type object (its type's type is its own type, as
    PyType_Type's is), else None."""
    if not t or t % 8:
        return None
    try:
        meta = _u64(mem, t + L.OB_TYPE)
        if not meta or meta % 8 or _u64(mem, meta + L.OB_TYPE) != _u64(
                mem, _u64(mem, meta + L.OB_TYPE) + L.OB_TYPE):
            return None
        return _u64(mem, t + L.TP_FLAGS)
    except MemoryUnreadable:
        return None


# Returns (mu_region array, what keeps it alive, how many) of mem's copies
# (memory.CopiedMemory), or None for another reader.
def _copy_regions(mem):
    copies = getattr(mem, "copies", None)
    if not copies:
        return None
    from memunreachable._ffi import region_array
    return region_array(copies) + (len(copies),)


class _Chain(list):
    """The objects of a chain that mu_follow_chain checked; .next: the object after them."""
    next = 0


# Returns the first objects of the chain of n objects from obj (link: the offset of the next
# object's address) that mu_follow_chain could check in mem's copies (regions: _copy_regions;
# ob_refcnt 0), with .next the object after them: all n of them when the chain lies in the
# copies and is sound; fewer when it leaves them or goes wrong, and the caller checks the rest
# one by one (same errors).
def _follow_chain(mem, regions, obj: int, n: int, link: int, check: bool = True) -> _Chain:
    out = _Chain()
    out.next = obj
    if not n or regions is None:
        return out
    from memunreachable._ffi import ffi, lib
    buf = array("Q", bytes(8 * n))
    done = ffi.new("uint64_t *")
    lib.mu_follow_chain(regions[0], regions[2], obj, n, link,
                        L.OB_REFCNT if check else lib.MU_CHAIN_NO_CHECK,
                        ffi.from_buffer("uint64_t[]", buf), done)
    k = done[0]
    out.extend(buf[:k])
    if k:
        out.next = _u64(mem, buf[k - 1] + link)
    return out


def _obmalloc_state(mem, lay: L.Layout, interp: int) -> int:
    st = lay.obmalloc.state
    if st.is_pointer:
        return _u64(mem, interp + st.interp_offset)
    return interp + st.interp_offset


# Returns the CPython memory map of the snapshot. Never raises for an unknown or inconsistent
# runtime: usable stays False and warnings say why (the caller keeps today's treatment).
# blocks_only: pymalloc's blocks and little else (no text heads, no free lists: their dead
# objects stay among the blocks), for a record of the allocations (pipeline.allocations).
def walk_cpython(mem, maps: Sequence[Mapping], threads: Sequence[ThreadState] = (),
                 pid: Optional[int] = None, layouts=None, blocks_only: bool = False) -> CPythonMap:
    # 1. the runtime and its version
    rt = locate.find_runtime(mem, maps, pid)
    if rt is None:
        return CPythonMap(found=False)
    out = CPythonMap(found=True, runtime=rt)
    where = f"CPython runtime at {rt.runtime:#x} in {rt.object_path}"
    ver = "of unknown version" if rt.version is None else "%d.%d" % rt.version
    if layouts is None and rt.version is not None and rt.version >= (3, 13):
        # 3.13+: the runtime's own _Py_DebugOffsets, plus the version's table of what it lacks
        try:
            lay = locate.debug_layout(mem, rt)
        except locate.FreeThreaded:
            out.warnings.append(f"{where}: free-threaded CPython {ver}t is not supported: its "
                                f"objects live in mimalloc heaps, not pymalloc: {OPAQUE}")
            return out
        except LayoutMismatch as exc:
            known = rt.version[:2] in L.SUPPLEMENTS
            out.warnings.append(f"{where}: the CPython {ver} layout does not fit ({exc}): {OPAQUE}"
                                if known else f"{where} is {ver}, which has no known memory "
                                f"layout ({exc}): {OPAQUE}")
            return out
    else:
        lay = L.get_layout(rt.version, L.LAYOUTS if layouts is None else layouts)
    if lay is None:
        out.warnings.append(f"{where} is {ver}, which has no known memory layout: {OPAQUE}")
        return out
    out.layout = lay
    # 2. validate the layout: interpreters and their thread states
    try:
        out.interpreters = locate.walk_interpreters(mem, maps, rt, lay, threads)
        lay = out.layout = locate.resolve_gc(mem, lay, out.interpreters)
        allocator = locate.read_allocator(mem, rt, lay)
    except locate.NoInterpreter:
        out.no_interpreter = True
        out.warnings.append(f"{where} has no interpreter (not initialised yet, or finalised): "
                            "no Python objects exist; its remaining memory is scanned as roots")
        return out
    except (LayoutMismatch, MemoryUnreadable) as exc:
        out.warnings.append(f"{where}: the {lay.name} layout does not fit ({exc}): {OPAQUE}")
        return out
    out.allocator = L.ALLOCATOR_NAMES.get(allocator)
    if out.allocator is None:
        out.warnings.append(f"{where}: unknown allocator setting {allocator}: {OPAQUE}")
        return out
    if allocator in L.ALLOCATORS_MIMALLOC:
        out.warnings.append(f"{where}: the {out.allocator} allocator (PYTHONMALLOC) is not "
                            f"supported: its objects live in mimalloc heaps: {OPAQUE}")
        return out
    # 3. pymalloc
    if allocator in L.ALLOCATORS_WITHOUT_PYMALLOC:
        out.pymalloc = obmalloc.PymallocWalk(False, "none")
    elif lay.obmalloc.state is not None:
        try:      # each interpreter's state; shared ones are empty (3.12) or the same (3.13)
            states = list(dict.fromkeys(_obmalloc_state(mem, lay, i.address)
                                        for i in out.interpreters))
        except MemoryUnreadable as exc:
            out.warnings.append(f"{where}: obmalloc state unreadable ({exc}): {OPAQUE}")
            return out
        out.pymalloc = obmalloc.walk_arenas(mem, lay, states, text_heads=not blocks_only)
    else:
        out.pymalloc = obmalloc.scan_pools(mem, maps, lay, text_heads=not blocks_only)
        if out.pymalloc.in_use and not out.pymalloc.problems:
            out.pymalloc.dead = obmalloc.scanned_arena_dead(
                mem, _runtime_spans(maps, rt.object_path), _anonymous(maps), lay.obmalloc,
                out.pymalloc.heap_ranges)
    pm = out.pymalloc
    out.warnings.extend(pm.warnings)
    if pm.problems:
        out.warnings.append(f"{where}: pymalloc does not add up ({'; '.join(pm.problems[:3])}): "
                            f"{OPAQUE}")
        return out
    if allocator not in L.ALLOCATORS_WITHOUT_PYMALLOC and not pm.in_use:
        out.warnings.append(f"{where}: the {out.allocator} allocator is set but no pymalloc pool "
                            f"was found: {OPAQUE}")
        return out
    # 4. data stacks (3.11+) and free lists (3.10+)
    dead_ranges: List[Range] = list(pm.dead)
    dead_blocks: List[int] = []
    try:
        if lay.datastack is not None:
            for interp in out.interpreters:
                for t in interp.threads:
                    ds = read_datastack(mem, lay, t.address)
                    out.datastacks.append(ds)
                    dead_ranges.extend(ds.dead)
    except (LayoutMismatch, MemoryUnreadable) as exc:
        out.warnings.append(f"{where}: data stack does not fit ({exc}): {OPAQUE}")
        return out
    if not blocks_only:
        for interp in out.interpreters:
            try:
                dead_ranges.extend(version_cache_dead(mem, lay, interp.address))
            except (LayoutMismatch, MemoryUnreadable) as exc:
                out.warnings.append(f"{where}: {exc}: its entries count as references (a "
                                    "class leaked after use may be missed)")
    prefix = L.DEBUG_HOOK_PREFIX if allocator in L.ALLOCATORS_WITH_DEBUG_HOOKS else 0
    if (lay.freelists is not None or lay.freelist_heads is not None) and not blocks_only:
        for interp in out.interpreters:
            try:
                dead, ranges = (read_freelists(mem, lay, interp.address, prefix)
                                if lay.freelist_heads is None
                                else read_freelist_heads(mem, lay, interp.address, prefix))
            except (_FreeListError, MemoryUnreadable) as exc:
                out.warnings.append(f"{where}: free lists of interpreter {interp.address:#x} "
                                    f"not used ({exc}); they are scanned as before")
                continue
            dead_blocks.extend(dead)
            dead_ranges.extend(ranges)
    out.blocks, out.sizes, out.room = pm.blocks, pm.sizes, pm.room
    out.heap_ranges = list(pm.heap_ranges)
    out.regions = pm.regions
    out.dead_ranges = merge_ranges(dead_ranges)
    out.dead_blocks = array("Q", sorted(set(dead_blocks)))
    out.stats = dict(pm.stats, method=pm.method, interpreters=len(out.interpreters),
                     threads=sum(len(i.threads) for i in out.interpreters),
                     dead_blocks=len(out.dead_blocks))
    out.usable = True
    return out


def _runtime_spans(maps, path: str) -> list:
    """(begin, end) of the writable mappings of the runtime's ELF object and of the anonymous
    mapping right after them (the rest of its .bss)."""
    return [(m.begin, m.end) for m in procfs.object_data(maps, lambda m: m.path == path)]


def _anonymous(maps) -> List[Range]:
    """The private anonymous writable mappings (malloc's heap and its mmapped chunks)."""
    return [m.range for m in maps if m.readable and m.writable and not m.shared
            and m.inode == 0 and (m.path in ("", "[heap]") or m.path.startswith("[anon:"))]
