"""Stage 4 (allocations, CPython): CPython runtime and pymalloc layouts as data (x86_64, LP64).

One frozen record (_types.record) per CPython minor version, 3.8 through 3.13, default (GIL) builds. Every
offset mirrors a struct of that version's headers (Include/internal/pycore_runtime.h,
pycore_interp.h, Include/cpython/pystate.h, pycore_frame.h, pycore_obmalloc.h, pycore_freelist.h;
3.8-3.11 pymalloc structs are private to Objects/obmalloc.c) and was printed with offsetof()
against the installed headers of 3.8.18, 3.9.18, 3.10.13, 3.11.7, 3.12.1 and 3.13.0
(Debian's 3.11.2 headers gave the same values). See /work/shared/notes/cpython-memory.md.
A layout is only a claim: locate.py validates it against the target before anything is
trusted. No offset literal may appear outside this module (style.md rule 7): it is one module
of tables, one per version, however long they grow.
"""
from __future__ import annotations

import struct
from typing import Dict, Optional, Tuple

from memunreachable._types import record

WORD = 8

# --- pymalloc (Objects/obmalloc.c; 3.12+ Include/internal/pycore_obmalloc.h) ----------------
ALIGNMENT = 16                  # size-class step (ALIGNMENT, 64-bit)
NUM_SIZE_CLASSES = 32           # SMALL_REQUEST_THRESHOLD 512 / ALIGNMENT
POOL_OVERHEAD = 48              # sizeof(struct pool_header): first block offset


@record
class PoolHeader:
    """struct pool_header (all versions): 48 bytes."""
    count: int = 0              # ref.count (uint, union padded to 8)
    freeblock: int = 8
    nextpool: int = 16
    prevpool: int = 24
    arenaindex: int = 32
    szidx: int = 36
    nextoffset: int = 40
    maxnextoffset: int = 44
    sizeof: int = 48


@record
class ArenaObject:
    """struct arena_object (all versions): 48 bytes; address 0 = slot unused."""
    address: int = 0
    pool_address: int = 8
    nfreepools: int = 16        # uint
    ntotalpools: int = 20       # uint
    freepools: int = 24
    nextarena: int = 32
    prevarena: int = 40
    sizeof: int = 48


POOL = PoolHeader()
ARENA = ArenaObject()


@record
class ObmallocState:
    """struct _obmalloc_state (3.12+), reached from the interpreter: embedded at
    interp+interp_offset (3.12) or through the pointer there (3.13)."""
    interp_offset: int
    is_pointer: bool
    arenas: int                 # mgmt.arenas (struct arena_object *)
    maxarenas: int              # mgmt.maxarenas (uint)
    narenas_currently_allocated: int   # mgmt.narenas_currently_allocated (size_t)
    sizeof: int


@record
class Obmalloc:
    arena_size: int             # 256 KiB (3.8/3.9), 1 MiB with USE_LARGE_ARENAS (3.10+)
    pool_size: int              # 4 KiB (3.8/3.9), 16 KiB with USE_LARGE_POOLS (3.10+)
    state: Optional[ObmallocState]   # None: the arenas array is a static of obmalloc.c

    def block_size(self, szidx: int) -> int:
        return ALIGNMENT * (szidx + 1)


@record
class DataStack:
    """3.11+ per-thread frame data stack: PyThreadState.datastack_* and _PyStackChunk."""
    tstate_chunk: int
    tstate_top: int
    tstate_limit: int
    tstate_cached_chunk: Optional[int] = None   # 3.13.18+, 3.14+: a freed chunk kept for reuse
    chunk_previous: int = 0
    chunk_size: int = 8         # bytes, header included
    chunk_top: int = 16         # word index into data[], written when a newer chunk is pushed
    chunk_data: int = 24


@record
class FreeLists:
    """Per-interpreter free lists (3.10+; 3.8/3.9 keep them in unexported statics).

    Offsets are from the interpreter. Entries below numfree are dead objects; the arrays
    themselves (stale slots too) are never roots (cpython-memory.md section 6)."""
    float_head: int             # PyFloatObject *, chained through ob_type
    float_numfree: int          # int
    tuple_heads: int            # PyTupleObject *[20], each chained through ob_item[0]
    tuple_numfree: int          # int[20]
    tuple_first: int            # first index holding dead tuples (3.10: [0] is the live empty tuple)
    list_items: int             # PyListObject *[80]
    list_numfree: int
    dict_items: int             # PyDictObject *[80]
    dict_numfree: int
    keys_items: int             # PyDictKeysObject *[80]
    keys_numfree: int
    tuple_lists: int = 20       # PyTuple_MAXSAVESIZE / PyTuple_NFREELISTS
    array_len: int = 80         # PyList_MAXFREELIST, PyDict_MAXFREELIST
    float_max: int = 100        # PyFloat_MAXFREELIST
    tuple_max: int = 2000       # PyTuple_MAXFREELIST


# --- objects (Include/object.h, Include/cpython/objimpl.h): same in 3.8-3.13 -----------------
OB_REFCNT = 0
OB_TYPE = 8
GC_HEAD_SIZE = 16               # PyGC_Head precedes a GC object in its block
TUPLE_ITEM0 = 24                # PyTupleObject.ob_item[0]

# --- _Py_DebugOffsets (3.13+): the first member of _PyRuntime ----------------------------------
# The runtime publishes the offsets out-of-process tools need (Include/internal/
# pycore_runtime.h in 3.13, pycore_debug_offsets.h from 3.14): a cookie, PY_VERSION_HEX, a
# free_threaded flag, then groups of u64 values in this order. The struct changes between
# minor versions, never within one (the header says so; checked: 3.13.0, 3.13.5 and 3.13.18 give
# sizeof 584, 3.14.10 760, 3.15.2 888). From 3.13 on every offset it holds is taken from the
# target itself; the tables below (SUPPLEMENTS) hold only what it lacks.
DEBUG_COOKIE = b"xdebugpy"
DEBUG_HEAD = 24                 # cookie[8], version, free_threaded


@record
class DebugOffsets:
    """Where the header fields sit inside _Py_DebugOffsets (every version)."""
    cookie: int = 0
    version: int = 8
    free_threaded: int = 16


DEBUG = DebugOffsets()

_DEBUG_313 = (
    ("runtime_state", "size finalizing interpreters_head"),
    ("interpreter_state", "size id next threads_head gc imports_modules sysdict builtins "
                          "ceval_gil gil_runtime_state gil_runtime_state_enabled "
                          "gil_runtime_state_locked gil_runtime_state_holder"),
    ("thread_state", "size prev next interp current_frame thread_id native_thread_id "
                     "datastack_chunk status"),
    ("interpreter_frame", "size previous executable instr_ptr localsplus owner"),
    ("code_object", "size filename name qualname linetable firstlineno argcount "
                    "localsplusnames localspluskinds co_code_adaptive"),
    ("pyobject", "size ob_type"),
    ("type_object", "size tp_name tp_repr tp_flags"),
    ("tuple_object", "size ob_item ob_size"),
    ("list_object", "size ob_item ob_size"),
    ("dict_object", "size ma_keys ma_values"),
    ("float_object", "size ob_fval"),
    ("long_object", "size lv_tag ob_digit"),
    ("bytes_object", "size ob_size ob_sval"),
    ("unicode_object", "size state length asciiobject_size"),
    ("gc", "size collecting"),
)
_DEBUG_314 = (
    ("runtime_state", "size finalizing interpreters_head"),
    ("interpreter_state", "size id next threads_head threads_main gc imports_modules sysdict "
                          "builtins ceval_gil gil_runtime_state gil_runtime_state_enabled "
                          "gil_runtime_state_locked gil_runtime_state_holder "
                          "code_object_generation tlbc_generation"),
    ("thread_state", "size prev next interp current_frame thread_id native_thread_id "
                     "datastack_chunk status"),
    ("interpreter_frame", "size previous executable instr_ptr localsplus owner stackpointer "
                          "tlbc_index"),
    ("code_object", "size filename name qualname linetable firstlineno argcount "
                    "localsplusnames localspluskinds co_code_adaptive co_tlbc"),
    ("pyobject", "size ob_type"),
    ("type_object", "size tp_name tp_repr tp_flags"),
    ("tuple_object", "size ob_item ob_size"),
    ("list_object", "size ob_item ob_size"),
    ("set_object", "size used table mask"),
    ("dict_object", "size ma_keys ma_values"),
    ("float_object", "size ob_fval"),
    ("long_object", "size lv_tag ob_digit"),
    ("bytes_object", "size ob_size ob_sval"),
    ("unicode_object", "size state length asciiobject_size"),
    ("gc", "size collecting"),
    ("gen_object", "size gi_name gi_iframe gi_frame_state"),
    ("llist_node", "next prev"),
    ("debugger_support", "eval_breaker remote_debugger_support remote_debugging_enabled "
                         "debugger_pending_call debugger_script_path debugger_script_path_size"),
)
_DEBUG_315 = (
    ("runtime_state", "size finalizing interpreters_head"),
    _DEBUG_314[1],
    ("thread_state", "size prev next interp current_frame base_frame last_profiled_frame "
                     "last_profiled_frame_seq thread_id native_thread_id datastack_chunk status "
                     "holds_gil gil_requested current_exception exc_state"),
    ("err_stackitem", "exc_value"),
    _DEBUG_314[3],
    _DEBUG_314[4],
    ("pyobject", "size ob_type"),
    ("type_object", "size tp_name tp_repr tp_flags tp_basicsize tp_dictoffset"),
    ("heap_type_object", "size ht_cached_keys"),
) + _DEBUG_314[7:14] + (
    ("unicode_object", "size state length asciiobject_size compactunicodeobject_size"),
    ("gc", "size collecting frame generation_stats_size generation_stats"),
) + _DEBUG_314[16:]

# (major, minor) -> the groups of _Py_DebugOffsets in order: include/python3.13/internal/
# pycore_runtime.h (identical in 3.13.0, 3.13.5 and 3.13.18 but for a _Py_NONSTRING on the
# cookie), python3.14 and python3.15 internal/pycore_debug_offsets.h (3.14.10, 3.15.2).
DEBUG_FIELDS: Dict[Tuple[int, int], Tuple[Tuple[str, str], ...]] = {
    (3, 13): _DEBUG_313, (3, 14): _DEBUG_314, (3, 15): _DEBUG_315}


def debug_offsets_size(version: Tuple[int, int]) -> Optional[int]:
    """sizeof(_Py_DebugOffsets) of this minor version (584, 760, 888), None when unknown."""
    groups = DEBUG_FIELDS.get(tuple(version[:2]))
    if groups is None:
        return None
    return DEBUG_HEAD + 8 * sum(len(names.split()) for _, names in groups)


# Returns {"group.field": value} of the _Py_DebugOffsets bytes `data` of this minor version
# (data may be longer); None when the version has no known struct or data is too short.
def parse_debug_offsets(data: bytes, version: Tuple[int, int]) -> Optional[Dict[str, int]]:
    groups = DEBUG_FIELDS.get(tuple(version[:2]))
    size = debug_offsets_size(version)
    if groups is None or len(data) < size:
        return None
    out: Dict[str, int] = {}
    off = DEBUG_HEAD
    for group, names in groups:
        for name in names.split():
            out[f"{group}.{name}"] = struct.unpack_from("<Q", data, off)[0]
            off += 8
    return out


# PyPreConfig.allocator values (Include/cpython/pymem.h PyMemAllocatorName)
ALLOCATOR_NAMES = {0: "not set", 1: "default", 2: "debug", 3: "malloc", 4: "malloc_debug",
                   5: "pymalloc", 6: "pymalloc_debug", 7: "mimalloc", 8: "mimalloc_debug"}
ALLOCATORS_WITHOUT_PYMALLOC = (3, 4, 7, 8)
ALLOCATORS_WITH_DEBUG_HOOKS = (2, 4, 6, 8)
ALLOCATORS_MIMALLOC = (7, 8)    # 3.13+ PYTHONMALLOC=mimalloc: objects in mimalloc heaps
FREELIST_MAX = 2000             # the largest free list (3.14+ Py_tuple_MAXFREELIST)
# With debug hooks every allocation starts with 2 words (size, API id) before the object
# (Objects/obmalloc.c _PyMem_DebugRawAlloc: "p[0: S] size, p[S] API id, p[S+1: 2*S] pad").
DEBUG_HOOK_PREFIX = 16


@record
class Layout:
    """Everything read about one CPython minor version."""
    version: Tuple[int, int]
    runtime_size: int                   # sizeof(_PyRuntimeState)
    preconfig_allocator: int            # _PyRuntime.preconfig.allocator (int)
    interpreters_head: int              # _PyRuntime.interpreters.head
    interpreters_main: int              # _PyRuntime.interpreters.main
    interp_size: int                    # sizeof(PyInterpreterState)
    interp_next: int
    interp_threads_head: int            # tstate_head (3.8-3.10), threads.head (3.11+)
    tstate_size: int                    # sizeof(PyThreadState)
    tstate_next: int
    tstate_interp: int
    tstate_thread_id: int               # pthread_t (glibc: the thread's TCB = fs_base)
    tstate_native_thread_id: Optional[int]   # kernel TID (3.11+)
    obmalloc: Obmalloc
    datastack: Optional[DataStack]      # 3.11+
    freelists: Optional[FreeLists]      # 3.10+
    debug_offsets: bool = False         # 3.13+: _PyRuntime starts with _Py_DebugOffsets
    # 3.13+ layouts built from the target's _Py_DebugOffsets (from_debug_offsets) also carry:
    gc: Optional["GcState"] = None      # the GC state (else GC_STATES by version)
    freelist_heads: Optional["FreeListHeads"] = None   # 3.14+ struct _Py_freelists
    tuple_items: int = 24               # PyTupleObject.ob_item (3.14+: 32, after ob_hash)
    frame_localsplus: int = 72          # _PyInterpreterFrame.localsplus (3.11-3.13: 72; 3.14+: 80)
    # (object offset, bytes) of a code object's words no write reaches: 3.14+ without the
    # free-threaded co_tlbc, _co_unique_id (assigned by free-threaded builds only) and
    # _co_firsttraceable's padding, right before co_extra and co_code_adaptive
    code_unwritten: Optional[Tuple[int, int]] = None
    # 3.14+: interp->types.type_version_cache, TYPE_VERSION_CACHE_SIZE borrowed type pointers
    type_version_cache: Optional[int] = None
    source: str = "table"               # "table" or "_Py_DebugOffsets"

    @property
    def name(self) -> str:
        return f"CPython {self.version[0]}.{self.version[1]}"


_SMALL = Obmalloc(arena_size=256 << 10, pool_size=4 << 10, state=None)        # 3.8, 3.9
_LARGE = Obmalloc(arena_size=1 << 20, pool_size=16 << 10, state=None)         # 3.10, 3.11

LAYOUTS: Dict[Tuple[int, int], Layout] = {
    # 3.8.18: Include/internal/pycore_pystate.h, Include/cpython/pystate.h
    (3, 8): Layout((3, 8), runtime_size=1464, preconfig_allocator=1436, interpreters_head=32,
                   interpreters_main=40, interp_size=2720, interp_next=0, interp_threads_head=8,
                   tstate_size=264, tstate_next=8, tstate_interp=16, tstate_thread_id=176,
                   tstate_native_thread_id=None, obmalloc=_SMALL, datastack=None, freelists=None),
    # 3.9.18: Include/internal/pycore_runtime.h, pycore_interp.h
    (3, 9): Layout((3, 9), runtime_size=656, preconfig_allocator=628, interpreters_head=32,
                   interpreters_main=40, interp_size=5656, interp_next=0, interp_threads_head=8,
                   tstate_size=264, tstate_next=8, tstate_interp=16, tstate_thread_id=176,
                   tstate_native_thread_id=None, obmalloc=_SMALL, datastack=None, freelists=None),
    # 3.10.13: free lists in PyInterpreterState (float_state, tuple, list, dict_state)
    (3, 10): Layout((3, 10), runtime_size=672, preconfig_allocator=628, interpreters_head=32,
                    interpreters_main=40, interp_size=113528, interp_next=0, interp_threads_head=8,
                    tstate_size=280, tstate_next=8, tstate_interp=16, tstate_thread_id=176,
                    tstate_native_thread_id=None, obmalloc=_LARGE, datastack=None,
                    freelists=FreeLists(float_head=9784, float_numfree=9776, tuple_heads=9800,
                                        tuple_numfree=9960, tuple_first=1, list_items=10040,
                                        list_numfree=10680, dict_items=10688, dict_numfree=11328,
                                        keys_items=11336, keys_numfree=11976)),
    # 3.11.7 (and Debian 3.11.2): main interpreter embedded in _PyRuntime; data stack chunks
    (3, 11): Layout((3, 11), runtime_size=166688, preconfig_allocator=636, interpreters_head=40,
                    interpreters_main=48, interp_size=107752, interp_next=0, interp_threads_head=16,
                    tstate_size=360, tstate_next=8, tstate_interp=16, tstate_thread_id=152,
                    tstate_native_thread_id=160, obmalloc=_LARGE,
                    datastack=DataStack(tstate_chunk=296, tstate_top=304, tstate_limit=312),
                    freelists=FreeLists(float_head=3616, float_numfree=3608, tuple_heads=3632,
                                        tuple_numfree=3792, tuple_first=0, list_items=3872,
                                        list_numfree=4512, dict_items=4520, dict_numfree=5160,
                                        keys_items=5168, keys_numfree=5808)),
    # 3.12.1: obmalloc state embedded in the interpreter (pycore_obmalloc.h)
    (3, 12): Layout((3, 12), runtime_size=459944, preconfig_allocator=3036, interpreters_head=40,
                    interpreters_main=48, interp_size=383552, interp_next=0, interp_threads_head=72,
                    tstate_size=288, tstate_next=8, tstate_interp=16, tstate_thread_id=136,
                    tstate_native_thread_id=144,
                    obmalloc=Obmalloc(arena_size=1 << 20, pool_size=16 << 10, state=ObmallocState(
                        interp_offset=3960, is_pointer=False, arenas=512, maxarenas=520,
                        narenas_currently_allocated=1064, sizeof=263248)),
                    datastack=DataStack(tstate_chunk=232, tstate_top=240, tstate_limit=248),
                    freelists=FreeLists(float_head=267416, float_numfree=267408, tuple_heads=269832,
                                        tuple_numfree=269992, tuple_first=0, list_items=270072,
                                        list_numfree=270712, dict_items=270736, dict_numfree=272016,
                                        keys_items=271376, keys_numfree=272020)),
    # 3.13.0: interp->obmalloc points to obmalloc_state_main; free lists in
    # interp->object_state.freelists (pycore_freelist.h); _Py_DebugOffsets at _PyRuntime+0
    (3, 13): Layout((3, 13), runtime_size=283320, preconfig_allocator=10396, interpreters_head=632,
                    interpreters_main=640, interp_size=194968, interp_next=7264,
                    interp_threads_head=7344, tstate_size=304, tstate_next=8, tstate_interp=16,
                    tstate_thread_id=152, tstate_native_thread_id=160,
                    obmalloc=Obmalloc(arena_size=1 << 20, pool_size=16 << 10, state=ObmallocState(
                        interp_offset=10800, is_pointer=True, arenas=512, maxarenas=520,
                        narenas_currently_allocated=1064, sizeof=263248)),
                    datastack=DataStack(tstate_chunk=232, tstate_top=240, tstate_limit=248),
                    freelists=FreeLists(float_head=10960, float_numfree=10952, tuple_heads=10968,
                                        tuple_numfree=11128, tuple_first=0, list_items=11208,
                                        list_numfree=11848, dict_items=11856, dict_numfree=12496,
                                        keys_items=12504, keys_numfree=13144),
                    debug_offsets=True),
}


def get_layout(version: Optional[Tuple[int, int]], table: Optional[Dict] = None) -> Optional[Layout]:
    """The entry of `table` (default LAYOUTS) for (major, minor); None when unknown."""
    if version is None:
        return None
    return (LAYOUTS if table is None else table).get((version[0], version[1]))


# --- GC generation lists (Include/internal/pycore_gc.h; 3.8 pycore_pymem.h) -----------------
@record
class GcState:
    """struct _gc_runtime_state (240 bytes, same fields in 3.8-3.13): in _PyRuntime (3.8) or in
    each interpreter (3.9+). Its list heads are PyGC_Heads whose links are not references."""
    in_runtime: bool            # True: _PyRuntime + offset; False: interp + offset
    offset: int
    generations: int = 24       # struct gc_generation generations[3] {PyGC_Head head; int threshold, count}
    generation_size: int = 24
    num_generations: int = 3
    permanent: int = 104        # permanent_generation.head
    heads_end: int = 120        # end of the permanent generation's head
    # 3.13: the offset of `PyGC_Head *generation0`, which points at generations[0].head: where
    # the generations start is read from it (24 in 3.13.0; 20 from 3.13.5, whose PyGC_Head is
    # declared Py_ALIGNED(4): see SUPPLEMENTS)
    generation0: Optional[int] = None
    generations_choices: Tuple[int, ...] = ()


GC_STATES: Dict[Tuple[int, int], GcState] = {
    (3, 8): GcState(in_runtime=True, offset=344),
    (3, 9): GcState(in_runtime=False, offset=616),
    (3, 10): GcState(in_runtime=False, offset=616),
    (3, 11): GcState(in_runtime=False, offset=648),
    (3, 12): GcState(in_runtime=False, offset=112),
    (3, 13): GcState(in_runtime=False, offset=7400),
}

# --- 3.13+: what _Py_DebugOffsets lacks, per minor version ---------------------------------
# Every offset below was printed with offsetof()/sizeof() by a probe compiled against that
# version's installed headers with -DPy_BUILD_CORE (include/python3.X and internal/): pyenv
# 3.13.0 on the host; Debian trixie's python3.13-dev 3.13.5; sid's python3.13-dev 3.13.18,
# python3.14-dev 3.14.10 and python3.15-dev 3.15.2 (`chroot ROOT gcc -I/usr/include/python3.X
# ...`, /var/cache/memunreachable/roots). Nothing here is trusted on its own: the walk checks
# what it reads (the interpreter ring, tstate->interp, a thread state per frozen thread, every
# pool header and the arena count, the GC rings, the free-list chains and their counts).


@record
class FreeListHeads:
    """3.14+ struct _Py_freelists (internal/pycore_freelist_state.h) at interp + offset: one
    struct _Py_freelist {void *freelist; Py_ssize_t size} per kind, in this order (tuples: one
    per size). Entries are linked through their first word (an object's ob_refcnt), the last
    one's is NULL; size -1: the list is disabled. kinds: (name, how many lists, holds objects);
    the other entries are raw PyMem blocks (dict key tables, object stack chunks, writers)."""
    offset: int
    kinds: Tuple[Tuple[str, int, bool], ...]
    entry_size: int = 16

    @property
    def sizeof(self) -> int:
        return self.entry_size * sum(n for _, n, _ in self.kinds)

    def lists(self):
        """(name, offset of its struct _Py_freelist from the interpreter, holds objects)."""
        off = self.offset
        for name, n, objects in self.kinds:
            for k in range(n):
                yield (f"{name}[{k}]" if n > 1 else name), off, objects
                off += self.entry_size


def _freelist_kinds(names: str) -> Tuple[Tuple[str, int, bool], ...]:
    raw = ("dictkeys", "object_stack_chunks", "unicode_writers", "bytes_writers")
    return tuple((n, 20 if n == "tuples" else 1, n not in raw) for n in names.split())


@record
class Supplement:
    """What one minor version's _Py_DebugOffsets lacks (3.13+)."""
    interpreters_main: int          # _PyRuntime.interpreters.main minus .head (struct pyinterpreters)
    # _PyRuntime.preconfig.allocator of each known build, by runtime size (the runtime_state.size
    # _Py_DebugOffsets gives): the field moves within a minor version. Another size: the known
    # offsets are tried, and exactly one must hold a plausible PyPreConfig (preconfig_plausible)
    preconfig_allocator: Tuple[Tuple[int, int], ...]
    obmalloc: Obmalloc              # interp->obmalloc (a pointer) and struct _obmalloc_state
    datastack_top: int              # PyThreadState.datastack_top minus .datastack_chunk
    datastack_limit: int            # PyThreadState.datastack_limit minus .datastack_chunk
    # PyThreadState.datastack_cached_chunk by sizeof(PyThreadState) (thread_state.size): added at
    # the struct's end in 3.13.18 (3.13.0 and 3.13.5 have none)
    cached_chunk: Tuple[Tuple[int, int], ...]
    gc: GcState                     # offset 0: _Py_DebugOffsets gives interpreter_state.gc
    freelists: Optional[FreeLists] = None          # 3.13
    freelist_heads: Optional[FreeListHeads] = None  # 3.14+
    # 3.14+: interp->types.type_version_cache (pycore_interp_structs.h): "borrowed references to
    # type objects whose tp_version_tag % TYPE_VERSION_CACHE_SIZE once was equal to the index",
    # by sizeof(PyInterpreterState) (interpreter_state.size): a build of another size has none
    type_version_cache: Tuple[Tuple[int, int], ...] = ()


# TYPE_VERSION_CACHE_SIZE (3.14, 3.15): the entries of interp->types.type_version_cache; an
# entry's index was its type's tp_version_tag (unsigned int) modulo the size once
TYPE_VERSION_CACHE_SIZE = 1 << 12
TP_VERSION_TAG = 384


_OBMALLOC_STATE = dict(is_pointer=True, arenas=512, maxarenas=520, narenas_currently_allocated=1064,
                       sizeof=263248)   # struct _obmalloc_state: same in 3.13.0-3.15.2

SUPPLEMENTS: Dict[Tuple[int, int], Supplement] = {
    # 3.13: pycore_runtime.h, pycore_interp.h, pycore_freelist.h, pycore_obmalloc.h, pycore_gc.h,
    # cpython/pystate.h. Probe output 3.13.0 / 3.13.5 / 3.13.18: sizeof(_PyRuntimeState) 283320 /
    # 283376 / 283408; preconfig.allocator 10396 / 10396 / 10420; interpreters.head, .main 632,
    # 640 (all); interp->obmalloc 10800, object_state.freelists 10952 (all); sizeof(PyThreadState)
    # 304 / 304 / 312, datastack_chunk, _top, _limit 232, 240, 248 (all), datastack_cached_chunk
    # 304 (3.13.18); _gc_runtime_state.generations 24 / 20 / 20 (3.13.5 declared PyGC_Head
    # Py_ALIGNED(1 << _PyObject_ALIGNMENT_SHIFT), an alignment of 4), generation0 96,
    # permanent_generation 104, sizeof 240 (all)
    (3, 13): Supplement(
        interpreters_main=8,
        preconfig_allocator=((283320, 10396), (283376, 10396), (283408, 10420)),
        obmalloc=Obmalloc(arena_size=1 << 20, pool_size=16 << 10,
                          state=ObmallocState(interp_offset=10800, **_OBMALLOC_STATE)),
        datastack_top=8, datastack_limit=16, cached_chunk=((312, 304),),
        gc=GcState(in_runtime=False, offset=0, permanent=104, heads_end=120, generation0=96,
                   generations_choices=(24, 20)),
        freelists=LAYOUTS[(3, 13)].freelists),
    # 3.14.10: internal/pycore_runtime_structs.h, pycore_interp_structs.h,
    # pycore_freelist_state.h, cpython/pystate.h. Probe output: sizeof(_PyRuntimeState) 316616,
    # preconfig.allocator 10612, interpreters.head 808 / .main 816; interp->obmalloc 10904,
    # object_state.freelists 11120 (sizeof 624: floats, ints, tuples[20] at 11152, lists 11472,
    # ... pymethodobjects 11728); datastack_chunk 232, _top 240, _limit 248,
    # datastack_cached_chunk 824 (sizeof(PyThreadState) 832); _gc_runtime_state.generations 24,
    # permanent_generation 96 (sizeof(gc_generation) 24; the incremental GC's young/old lists
    # are the free-threaded build's only); PyTupleObject.ob_item 32 (ob_hash at 24),
    # _PyInterpreterFrame.localsplus 80 (both also in _Py_DebugOffsets);
    # types.type_version_cache 190344 (sizeof(PyInterpreterState) 225864)
    (3, 14): Supplement(
        interpreters_main=8, preconfig_allocator=((316616, 10612),),
        obmalloc=Obmalloc(arena_size=1 << 20, pool_size=16 << 10,
                          state=ObmallocState(interp_offset=10904, **_OBMALLOC_STATE)),
        datastack_top=8, datastack_limit=16, cached_chunk=((832, 824),),
        gc=GcState(in_runtime=False, offset=0, generations=24, permanent=96, heads_end=112),
        freelist_heads=FreeListHeads(11120, _freelist_kinds(
            "floats ints tuples lists list_iters tuple_iters dicts dictkeys slices ranges "
            "range_iters contexts async_gens async_gen_asends futureiters object_stack_chunks "
            "unicode_writers pycfunctionobject pycmethodobject pymethodobjects")),
        type_version_cache=((225864, 190344),)),
    # 3.15.2: as 3.14. Probe output: sizeof(_PyRuntimeState) 346560, preconfig.allocator 10732,
    # interpreters.head 936 / .main 944; interp->obmalloc 10880, object_state.freelists 11096
    # (sizeof 656: complexes 11112 after floats, bytes_writers 11688 after unicode_writers);
    # datastack_chunk, _top, _limit 256, 264, 272, datastack_cached_chunk 280 (sizeof 888);
    # _gc_runtime_state.generations 8, permanent_generation 80 (trash_delete_later and its
    # nesting count went); types.type_version_cache 190512 (sizeof(PyInterpreterState) 226232
    # compiled against its headers, 226240 in Debian's build's _Py_DebugOffsets: a field the
    # build configures lies after it; the cache's entries found at 190512 in a running 3.15.2)
    (3, 15): Supplement(
        interpreters_main=8, preconfig_allocator=((346560, 10732),),
        obmalloc=Obmalloc(arena_size=1 << 20, pool_size=16 << 10,
                          state=ObmallocState(interp_offset=10880, **_OBMALLOC_STATE)),
        datastack_top=8, datastack_limit=16, cached_chunk=((888, 280),),
        gc=GcState(in_runtime=False, offset=0, generations=8, permanent=80, heads_end=96),
        freelist_heads=FreeListHeads(11096, _freelist_kinds(
            "floats complexes ints tuples lists list_iters tuple_iters dicts dictkeys slices "
            "ranges range_iters contexts async_gens async_gen_asends futureiters "
            "object_stack_chunks unicode_writers bytes_writers pycfunctionobject "
            "pycmethodobject pymethodobjects")),
        type_version_cache=((226240, 190512), (226232, 190512))),
}

# PyPreConfig (Include/cpython/initconfig.h, 3.8+): ten ints, allocator the last
PRECONFIG_INTS = 10
PRECONFIG_ALLOCATOR = 36


def preconfig_plausible(ints: Tuple[int, ...]) -> bool:
    """Whether ten ints read as an initialised PyPreConfig: _config_init 1-3 (compat, python,
    isolated), parse_argv, isolated, use_environment, configure_locale 0/1, coerce_c_locale
    0-2, coerce_c_locale_warn 0/1, utf8_mode and dev_mode -1..1, allocator 0-8."""
    if len(ints) != PRECONFIG_INTS:
        return False
    init, argv, iso, env, loc, coerce, warn, utf8, dev, alloc = ints
    return (1 <= init <= 3 and all(v in (0, 1) for v in (argv, iso, env, loc, warn))
            and 0 <= coerce <= 2 and -1 <= utf8 <= 1 and -1 <= dev <= 1
            and alloc in ALLOCATOR_NAMES)


class DebugOffsetsError(Exception):
    """_Py_DebugOffsets does not describe a layout we can use (a sentence saying why)."""


# Returns the Layout of a 3.13+ runtime from its parsed _Py_DebugOffsets (parse_debug_offsets)
# and the version's Supplement. preconfig_allocator: the offset chosen (resolve_preconfig).
# Raises DebugOffsetsError when the version has no Supplement.
def from_debug_offsets(version: Tuple[int, int], d: Dict[str, int],
                       preconfig_allocator: int) -> Layout:
    sup = SUPPLEMENTS.get(tuple(version[:2]))
    if sup is None:
        raise DebugOffsetsError("no table of what its _Py_DebugOffsets lacks")
    chunk = d["thread_state.datastack_chunk"]
    cached = dict(sup.cached_chunk).get(d["thread_state.size"])
    head = d["runtime_state.interpreters_head"]
    return Layout(
        tuple(version[:2]), runtime_size=d["runtime_state.size"],
        preconfig_allocator=preconfig_allocator, interpreters_head=head,
        interpreters_main=head + sup.interpreters_main, interp_size=d["interpreter_state.size"],
        interp_next=d["interpreter_state.next"],
        interp_threads_head=d["interpreter_state.threads_head"],
        tstate_size=d["thread_state.size"], tstate_next=d["thread_state.next"],
        tstate_interp=d["thread_state.interp"], tstate_thread_id=d["thread_state.thread_id"],
        tstate_native_thread_id=d["thread_state.native_thread_id"], obmalloc=sup.obmalloc,
        datastack=DataStack(tstate_chunk=chunk, tstate_top=chunk + sup.datastack_top,
                            tstate_limit=chunk + sup.datastack_limit, tstate_cached_chunk=cached),
        freelists=sup.freelists, debug_offsets=True,
        gc=sup.gc._replace(offset=d["interpreter_state.gc"]), freelist_heads=sup.freelist_heads,
        tuple_items=d["tuple_object.ob_item"], frame_localsplus=d["interpreter_frame.localsplus"],
        code_unwritten=((d["code_object.co_code_adaptive"] - 24, 16)
                        if version[:2] >= (3, 14) and not d.get("code_object.co_tlbc") else None),
        type_version_cache=dict(sup.type_version_cache).get(d["interpreter_state.size"]),
        source="_Py_DebugOffsets")


# --- object layouts read to name a leaked object (Include/object.h, cpython/*object.h) -------
# 3.8-3.10: dead objects that roots still reach (zombie and free-listed frames, the 3.8/3.9
# static free lists of tuples, lists and dicts: cpython-memory.md sections 5-6, and stale
# refcount-0 headers of any GC type); 3.10+ free lists are read by the walker (dead_blocks),
# 3.11+ frames live in the data stack. On 3.11 the rule over every GC type made a live bound
# method look unreachable (PYTHONMALLOC=malloc): a zero word followed by a type pointer is not
# proof enough there, so 3.11+ do without it.
DEAD_OBJECTS_UNTIL = (3, 10)
DEAD_OBJECT_TYPES = None       # every GC type: stale refcount-0 objects abound there

# exported builtin types whose objects hold a value, no references: symbol -> (tp_name, mu_dead
# kind). An int's value, a float's 8 bytes and a short bytes object's data words may still be
# a native block's handle (ctypes' c_void_p results, cffi's int(ffi.cast("uintptr_t", p)),
# struct.pack("P", p)): their kinds look those up (mu_types.h); a compact ASCII str is text.
VALUE_TYPES = {"PyLong_Type": ("int", "MU_TYPE_INT"), "PyFloat_Type": ("float", "MU_TYPE_FLOAT"),
               "PyBytes_Type": ("bytes", "MU_TYPE_BYTES"), "PyUnicode_Type": ("str", "MU_TYPE_STR")}
# kind -> (tp_basicsize, tp_itemsize) its type must have for the rule, and the rule's parameter
# (int: 30-bit digits in uint32 at 24, 3.8-3.15 and the native MU_INT_DIGITS, the parameter by
# version; float: ob_fval at 16, MU_FLOAT_VALUE; bytes: ob_sval at 32, its NUL counted in
# tp_basicsize); a type of another shape gets MU_TYPE_OPAQUE: never read
VALUE_SHAPES = {"MU_TYPE_INT": (24, 4, None), "MU_TYPE_FLOAT": (24, 0, 0),
                "MU_TYPE_BYTES": (33, 1, 32)}
TSTATE_FRAME = 24              # 3.8-3.10 PyThreadState.frame (PyFrameObject *, innermost)
TP_NAME = 24                    # PyTypeObject.tp_name (const char *)
TP_BASICSIZE = 32               # PyTypeObject.tp_basicsize, then tp_itemsize (Py_ssize_t)
TP_DEALLOC = 48                 # PyTypeObject.tp_dealloc (destructor)
TP_FLAGS = 168                  # PyTypeObject.tp_flags (unsigned long)
TP_DOC = 176                    # PyTypeObject.tp_doc (const char *; a heap type's is malloc'd)
TP_MEMBERS = 240                # PyTypeObject.tp_members (PyMemberDef *)
TP_BASE = 256                   # PyTypeObject.tp_base (PyTypeObject *)
# PyMemberDef (every version): const char *name; int type; Py_ssize_t offset; int flags;
# const char *doc. Its words at 8-32 (type and its padding, offset, flags and its padding)
# never hold a reference
MEMBER_DEF_SIZE = 40
MEMBER_DEF_NUMBERS = (8, 32)
TP_ALLOC = 304                  # PyTypeObject.tp_alloc (allocfunc; checked with ctypes, 3.8-3.13)
TPFLAGS_HEAPTYPE = 1 << 9
TPFLAGS_READY = 1 << 12         # set by PyType_Ready (3.8-3.15): every type in use has it
TPFLAGS_INLINE_VALUES = 1 << 2  # 3.13+: a managed dict's values follow the object inline
# Modules/_io/bufferedio.c `buffered` (3.8-3.13, measured with ctypes on each): tp_basicsize,
# and the object offset of `char *buffer` (after raw, four ints, finalizing, abs_pos)
BUFFERED_SIZE = 152
BUFFERED_BUFFER = 56
# Modules/_ctypes/ctypes.h (measured with ctypes on 3.8-3.13): the object offsets of
# `char *format` (a PEP 3118 format string: text) and `Py_ssize_t *shape` (ndim integers), two
# PyMem_Malloc'd blocks that never hold a reference. 3.8-3.12: in StgDict, the dict subclass
# (tp_basicsize 192) that is each ctypes type's tp_dict; 3.13: in StgInfo, the type data of
# ctypes' metatypes (160 bytes after PyType_Type's tp_basicsize rounded up to 16).
# 3.14.10 and 3.15.2 (measured the same way: "X{}" of a CFUNCTYPE's format and the shape of
# c_int * 3 found in the type data): StgInfo grew to 176 bytes, format at 144, shape at 160.
STGDICT_SIZE, STGDICT_FIELDS = 192, (168, 184)
STGINFO_SIZE, STGINFO_FIELDS = 160, (136, 152)
STGINFO_314 = (176, (144, 160))


def stginfo(version: Tuple[int, int]) -> Tuple[int, Tuple[int, int]]:
    """(sizeof(StgInfo), object offsets of format and shape in it) of a 3.13+ version."""
    return STGINFO_314 if version >= (3, 14) else (STGINFO_SIZE, STGINFO_FIELDS)
CTYPES_METATYPES = ("_ctypes.PyCSimpleType", "_ctypes.PyCPointerType", "_ctypes.PyCArrayType",
                    "_ctypes.PyCFuncPtrType", "_ctypes.PyCStructType", "_ctypes.UnionType")
TPFLAGS_HAVE_GC = 1 << 14
TPFLAGS_MANAGED_DICT = 1 << 4   # 3.11+
TPFLAGS_PREHEADER = (1 << 4) | (1 << 3)   # MANAGED_DICT | MANAGED_WEAKREF, 3.12+
OB_SIZE = 16                    # PyVarObject.ob_size
WR_OBJECT = 16                  # PyWeakReference.wr_object (3.8-3.15)
# the weak reference types: the runtime's symbols, their tp_name on 3.8-3.9 and on 3.10+
WEAKREF_TYPES = {"_PyWeakref_RefType": ("weakref", "weakref.ReferenceType"),
                 "_PyWeakref_ProxyType": ("weakproxy", "weakref.ProxyType"),
                 "_PyWeakref_CallableProxyType": ("weakcallableproxy",
                                                  "weakref.CallableProxyType")}
FLOAT_VALUE = 16                # PyFloatObject.ob_fval
LONG_DIGITS = 24                # PyLongObject digits (30-bit, uint32 each)
LONG_TAG = 16                   # 3.12+ _PyLongValue.lv_tag: ndigits << 3 | sign (0 +, 1 zero, 2 -)
BYTES_DATA = 32                 # PyBytesObject.ob_sval
STR_LENGTH = 16                 # PyASCIIObject.length
STR_STATE = 32                  # PyASCIIObject.state bit field (interned:2 kind:3 compact:1 ascii:1)


TPFLAGS_LIST_SUBCLASS = 1 << 25
TPFLAGS_TYPE_SUBCLASS = 1 << 31
TPFLAGS_DICT_SUBCLASS = 1 << 29
TPFLAGS_UNICODE_SUBCLASS = 1 << 28


def str_buffer_fields(version: Tuple[int, int]) -> Tuple[int, int]:
    """Object offsets of a non-compact str's utf8 and data pointers (PyCompactUnicodeObject.utf8,
    PyUnicodeObject.data): 56 and 72 through 3.11, 48 and 56 once the wstr fields went (3.12)."""
    return (48, 56) if version >= (3, 12) else (56, 72)
# Fields through which an object owns a separate buffer (3.8-3.13 alike): PyDictObject
# ma_keys, ma_values; PyListObject ob_item; PySetObject table; PyByteArrayObject ob_bytes
DICT_KEYS, DICT_VALUES, LIST_ITEMS, SET_TABLE, BYTEARRAY_BYTES = 32, 40, 24, 40, 32


# A heap type's own malloc'd buffers besides tp_doc's copy: PyHeapTypeObject.ht_cached_keys
# (its instances' shared dict keys) and, 3.11+, _ht_tpname (PyType_FromSpec's copy of the
# name): offsetof against each version's headers (pyenv's 3.8.18-3.13.0, Debian sid's
# 3.13-3.15, trixie's 3.13). A class that is cyclic garbage (ssl's enum classes that
# _simple_enum replaced) frees them with it: its empty shared keys and docstring are no leaks.
HEAP_TYPE_BUFFERS: Dict[Tuple[int, int], Tuple[int, ...]] = {
    (3, 8): (872,), (3, 9): (864,), (3, 10): (872,), (3, 11): (872, 888), (3, 12): (880, 896),
    (3, 13): (880, 896), (3, 14): (880, 896), (3, 15): (888, 904)}


def owned_fields(name: str, flags: int, version: Tuple[int, int]) -> Tuple[int, ...]:
    """Offsets from an object of this type of the words that point at buffers it owns. A
    managed dict's values (3.11: obj - 32; 3.12: obj - 24, tagged values - 1) too. A type
    object on the heap (its type is type or a metatype) is a heap type: tp_doc and
    HEAP_TYPE_BUFFERS."""
    out: Tuple[int, ...] = ()
    if flags & TPFLAGS_TYPE_SUBCLASS:
        out += (TP_DOC,) + HEAP_TYPE_BUFFERS.get(version[:2], ())
    if flags & TPFLAGS_DICT_SUBCLASS:
        out += (DICT_KEYS, DICT_VALUES)
    if flags & TPFLAGS_LIST_SUBCLASS:
        out += (LIST_ITEMS,)
    if name in ("set", "frozenset"):
        out += (SET_TABLE,)
    if name == "bytearray":
        out += (BYTEARRAY_BYTES,)
    if flags & TPFLAGS_MANAGED_DICT and version in ((3, 11), (3, 12)):
        out += (-32 if version == (3, 11) else -24,)
    return out


def preheader_flags(version: Tuple[int, int]) -> int:
    """tp_flags bits that put 16 bytes before the GC head (cpython-memory.md section 3)."""
    if version >= (3, 12):
        return TPFLAGS_PREHEADER
    if version >= (3, 11):
        return TPFLAGS_MANAGED_DICT
    return 0


def str_ascii_size(version: Tuple[int, int]) -> Tuple[int, int]:
    """(sizeof(PyASCIIObject), sizeof(PyCompactUnicodeObject)): the wstr fields went in 3.12."""
    return (40, 56) if version >= (3, 12) else (48, 72)


def module_name_offset(version: Tuple[int, int]) -> int:
    """PyModuleObject.md_name's offset: after md_dict, md_def, md_state and md_weaklist; 3.15
    dropped md_def (moduleobject.c, pycore_moduleobject.h)."""
    return 40 if version >= (3, 15) else 48
