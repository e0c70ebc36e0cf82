"""Stage 4 (allocations, CPython): CPython runtime and pymalloc layouts as data (x86_64, LP64).

One frozen record (_types.record) per CPython minor version, 3.8 through 3.13, default (GIL) builds. Every
offset mirrors a struct of that version's headers (Include/internal/pycore_runtime.h,
pycore_interp.h, Include/cpython/pystate.h, pycore_frame.h, pycore_obmalloc.h, pycore_freelist.h;
3.8-3.11 pymalloc structs are private to Objects/obmalloc.c) and was printed with offsetof()
against the installed headers of 3.8.18, 3.9.18, 3.10.13, 3.11.7, 3.12.1 and 3.13.0
(Debian's 3.11.2 headers gave the same values). See /work/shared/notes/cpython-memory.md.
A layout is only a claim: locate.py validates it against the target before anything is
trusted. No offset literal may appear outside this module (style.md rule 7).
"""
from __future__ import annotations

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

# --- 3.13 _Py_DebugOffsets (Include/internal/pycore_runtime.h): _PyRuntime.debug_offsets -------
DEBUG_COOKIE = b"xdebugpy"


@record
class DebugOffsets:
    """Where the fields we cross-check sit inside _Py_DebugOffsets (3.13.0)."""
    cookie: int = 0
    version: int = 8
    free_threaded: int = 16
    runtime_size: int = 24
    runtime_interpreters_head: int = 40
    interp_size: int = 48
    interp_next: int = 64
    interp_threads_head: int = 72
    tstate_size: int = 152
    tstate_next: int = 168
    tstate_interp: int = 176
    tstate_thread_id: int = 192
    tstate_native_thread_id: int = 200
    tstate_datastack_chunk: int = 208


DEBUG = DebugOffsets()

# PyPreConfig.allocator values (Include/cpython/pymem.h PyMemAllocatorName)
ALLOCATOR_NAMES = {0: "not set", 1: "default", 2: "debug", 3: "malloc", 4: "malloc_debug",
                   5: "pymalloc", 6: "pymalloc_debug", 7: "mimalloc", 8: "mimalloc_debug"}
ALLOCATORS_WITHOUT_PYMALLOC = (3, 4, 7, 8)
ALLOCATORS_WITH_DEBUG_HOOKS = (2, 4, 6, 8)
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


GC_STATES: Dict[Tuple[int, int], GcState] = {
    (3, 8): GcState(in_runtime=True, offset=344),
    (3, 9): GcState(in_runtime=False, offset=616),
    (3, 10): GcState(in_runtime=False, offset=616),
    (3, 11): GcState(in_runtime=False, offset=648),
    (3, 12): GcState(in_runtime=False, offset=112),
    (3, 13): GcState(in_runtime=False, offset=7400),
}

# --- object layouts read to name a leaked object (Include/object.h, cpython/*object.h) -------
# 3.8-3.10: dead objects that roots still reach (zombie and free-listed frames, the 3.8/3.9
# static free lists of tuples, lists and dicts: cpython-memory.md sections 5-6, and stale
# refcount-0 headers of any GC type); 3.10+ free lists are read by the walker (dead_blocks),
# 3.11+ frames live in the data stack. On 3.11 the rule over every GC type made a live bound
# method look unreachable (PYTHONMALLOC=malloc): a zero word followed by a type pointer is not
# proof enough there, so 3.11+ do without it.
DEAD_OBJECTS_UNTIL = (3, 10)
DEAD_OBJECT_TYPES = None       # every GC type: stale refcount-0 objects abound there

# exported builtin types whose objects hold no references: symbol -> (tp_name, mu_dead kind)
OPAQUE_TYPES = {"PyLong_Type": ("int", "MU_TYPE_OPAQUE"), "PyFloat_Type": ("float", "MU_TYPE_OPAQUE"),
                "PyBytes_Type": ("bytes", "MU_TYPE_OPAQUE"), "PyUnicode_Type": ("str", "MU_TYPE_STR")}
TSTATE_FRAME = 24              # 3.8-3.10 PyThreadState.frame (PyFrameObject *, innermost)
TP_NAME = 24                    # PyTypeObject.tp_name (const char *)
TP_BASICSIZE = 32               # PyTypeObject.tp_basicsize, then tp_itemsize (Py_ssize_t)
TP_DEALLOC = 48                 # PyTypeObject.tp_dealloc (destructor)
TP_FLAGS = 168                  # PyTypeObject.tp_flags (unsigned long)
TP_DOC = 176                    # PyTypeObject.tp_doc (const char *; a heap type's is malloc'd)
TP_BASE = 256                   # PyTypeObject.tp_base (PyTypeObject *)
TP_ALLOC = 304                  # PyTypeObject.tp_alloc (allocfunc; checked with ctypes, 3.8-3.13)
TPFLAGS_HEAPTYPE = 1 << 9
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
STGDICT_SIZE, STGDICT_FIELDS = 192, (168, 184)
STGINFO_SIZE, STGINFO_FIELDS = 160, (136, 152)
CTYPES_METATYPES = ("_ctypes.PyCSimpleType", "_ctypes.PyCPointerType", "_ctypes.PyCArrayType",
                    "_ctypes.PyCFuncPtrType", "_ctypes.PyCStructType", "_ctypes.UnionType")
TPFLAGS_HAVE_GC = 1 << 14
TPFLAGS_MANAGED_DICT = 1 << 4   # 3.11+
TPFLAGS_PREHEADER = (1 << 4) | (1 << 3)   # MANAGED_DICT | MANAGED_WEAKREF, 3.12+
OB_SIZE = 16                    # PyVarObject.ob_size
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


def owned_fields(name: str, flags: int, version: Tuple[int, int]) -> Tuple[int, ...]:
    """Offsets from an object of this type of the words that point at buffers it owns. A
    managed dict's values (3.11: obj - 32; 3.12: obj - 24, tagged values - 1) too."""
    out: Tuple[int, ...] = ()
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
