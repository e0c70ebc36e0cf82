"""typerules.py: Stage 4 (CPython): which object types get which dead-word rule.

A rule tells the mark which words of an object of that type hold no references (native
mu_dead: DEAD_AT_ZERO, VALUE kinds, VARSIZED, GEN_FRAME, FRAME, ...). Each finder reads the
types from the snapshot through an ObjectReader and checks their shape (tp_basicsize,
tp_itemsize, tp_dealloc inside the right object) before giving a rule: a wrong rule would
hide a reference, so a type of another shape gets none.
    static_types / runtime_static_types / runtime_symbols   the runtime's static types
    loaded_static_types                     every loaded object's static types (tp_flags)
    cffi_types                              cffi's cdata and types (their slack)
    type_rules, value_types, object_types, varsized_type, generator_types, old_frame_rule,
    sized_types, class_types, regex_types, deque_types, stale_part_types, buffered_types,
    weakref_types,
    ctypes_types, frame_types, metatypes                    the rules, one finder each
    has_debug_hooks, dict_keys_rule, object_reader          facts of the runtime
Verdicts per type are remembered while the type's words are unchanged (_VERDICTS): a
long-lived checker checks one process again and again. cpython-memory.md section 6.
"""
from __future__ import annotations

import bisect
import re
import struct
from typing import Dict, List, Optional, Sequence, Tuple

from memunreachable._errors import MemoryUnreadable
from memunreachable._ffi import lib
from memunreachable._types import Mapping, read_u64
from memunreachable.collect import procfs
from memunreachable.heaps.cpython import layout as L
from memunreachable.heaps.cpython.obmalloc import words_equal
from memunreachable.heaps.cpython.walker import CPythonMap
from memunreachable.stacks import elf
from memunreachable.sweep.classify import loaded_objects


# Returns [(type address, object offset in its block)] ascending, for the GC objects' types
# that read as real types named in `names` (cpython/objects.py): an allocation with a zero
# ob_refcnt and one of these at that offset holds a dead object (cpython-memory.md section 6,
# refcount rule). Only the types whose dead objects hide in roots are listed: any other
# zero word followed by a type pointer is left alone (a wrong "dead" would hide references).
def object_reader(mem, cp: CPythonMap):
    """An ObjectReader for cp's objects (the debug hooks' 2-word prefix when they are on).
    One per (cp, mem): its type cache serves every stage of a sweep (the same ~100 types were
    read 4-5 times a check: sized_types, metatypes, object_types, the leaks' names)."""
    from memunreachable.heaps.cpython.objects import ObjectReader
    prefix = L.DEBUG_HOOK_PREFIX if has_debug_hooks(cp) else 0
    cached = cp.__dict__.get("_reader")
    if cached is not None and cached.mem is mem and cached.prefix == prefix:
        return cached
    reader = ObjectReader(mem, cp.version, prefix)
    cp.__dict__["_reader"] = reader
    return reader


def object_types(mem, cp: CPythonMap, types: Sequence[int], names) -> List[Tuple[int, int]]:
    reader = object_reader(mem, cp)
    out = []
    for t in types:
        ti = reader.type_info(t)
        if ti is None or (names is not None and ti[0] not in names):
            continue
        out.append((t, reader.object_offset(t) | lib.MU_TYPE_DEAD_AT_ZERO << 8))
    return out


# Returns [(type address, code)] for the builtin types whose objects hold values, not
# references (int, float, bytes: read for native blocks' handles; compact ASCII str: text),
# found by their exported symbols and checked to be the types they claim (layout.VALUE_TYPES).
def value_types(mem, cp: CPythonMap, statics: Dict[str, int]) -> List[Tuple[int, int]]:
    reader = object_reader(mem, cp)
    out = []
    for sym, (_name, kind) in type_rules(cp).items():
        t = statics.get(sym)
        if t is None:
            continue
        code = reader.object_offset(t) | getattr(lib, kind) << 8
        shape = L.VALUE_SHAPES.get(kind)
        if kind == "MU_TYPE_FRAME":
            fo = inline_frame_offset(reader, t, cp.layout.frame_localsplus)
            if fo is None:
                continue                    # another shape: no rule
            code |= fo << 16 | frame_flavour(cp) << 32
        elif shape is not None:
            w = reader.type_words(t)
            if w is None or (w[2], w[3]) != shape[:2]:
                code = code & 0xff | lib.MU_TYPE_OPAQUE << 8    # another shape: not read
            elif kind == "MU_TYPE_INT":     # 3.12+: lv_tag (PEP 683's era), before: ob_size
                code |= (lib.MU_INT_LV_TAG if cp.version >= (3, 12) else lib.MU_INT_OB_SIZE) << 16
            else:
                code |= shape[2] << 16
        out.append((t, code))
    return out


def type_rules(cp: CPythonMap) -> Dict[str, Tuple[str, str]]:
    """{symbol: (tp_name, mu_dead kind)} of the static types with a rule on this version."""
    rules = dict(L.VALUE_TYPES)
    # frame objects hold a copy of their frame data inline (MU_TYPE_FRAME)
    if frame_flavour(cp) is not None:
        rules["PyFrame_Type"] = ("frame", "MU_TYPE_FRAME")
    return rules


# _PyInterpreterFrame's slots offset (layout.frame_localsplus, from _Py_DebugOffsets on
# 3.13+) and stack top by flavour: 3.11-3.13 an int stacktop at 64, slots from 72; 3.14 and 3.15
# a stackpointer at 64, slots from 80 (3.15 renumbered the generators' frame states).
FRAME_FLAVOURS = {((3, 11), 72): "MU_FRAME_FLAVOUR_311", ((3, 12), 72): "MU_FRAME_FLAVOUR_311",
                  ((3, 13), 72): "MU_FRAME_FLAVOUR_311", ((3, 14), 80): "MU_FRAME_FLAVOUR_314",
                  ((3, 15), 80): "MU_FRAME_FLAVOUR_315"}


def frame_flavour(cp: CPythonMap) -> Optional[int]:
    """The native MU_FRAME_FLAVOUR_* of this runtime's frames; None: no frame rule."""
    name = FRAME_FLAVOURS.get((tuple(cp.version[:2]), cp.layout.frame_localsplus))
    return None if name is None else getattr(lib, name)


def has_debug_hooks(cp: CPythonMap) -> bool:
    """CPython's debug hooks are on (PYTHONMALLOC=debug, malloc_debug, pymalloc_debug): each
    block is a 16-byte prefix, the requested bytes, an 8-byte tail (mu_dead debug_hooks)."""
    return (cp.allocator or "").endswith("debug")


def dict_keys_rule(cp: CPythonMap) -> int:
    """The mu_dead dict-key-table rule of this version (tables at their block's start, or
    after the debug hooks' prefix, ending at the requested bytes). 3.11-3.15 share one layout
    (default builds: a free-threaded one adds dk_mutex; sid's 3.15 under malloc left a leaked
    block's address in the 8 bytes after a 18,448-byte table)."""
    if cp.version > (3, 15):
        return lib.MU_DICT_KEYS_NONE
    return lib.MU_DICT_KEYS_38 if cp.version <= (3, 10) else lib.MU_DICT_KEYS_311


TUPLE_SHAPE = (24, 8)       # PyTupleObject: {ob_refcnt, ob_type, ob_size} then ob_size items
MEMORYVIEW_SHAPE = (0, 8)   # PyMemoryViewObject: ob_size = 3 * ndim Py_ssize_t (shape, strides,
                            # suboffsets) after a header whose size changed across versions
GENERATOR_TYPES = {"PyGen_Type": "generator", "PyCoro_Type": "coroutine",
                   "PyAsyncGen_Type": "async_generator"}


BLOCKSTACK = 240            # 3.8-3.10 PyFrameObject.f_blockstack (native MU_BLOCKSTACK)


# Returns (frame type, try-block stack offset, stack mode) of gc_stale_parts' old-frame rule:
# 3.8-3.10's PyFrame_Type (tp_basicsize = offset of f_localsplus + one slot, tp_itemsize 8),
# the block stack right before f_localsplus; (0, 0, 0) for other versions or another shape.
def old_frame_rule(mem, cp: CPythonMap, statics: Dict[str, int]) -> Tuple[int, int, int]:
    t = statics.get("PyFrame_Type")
    if cp.version > (3, 10) or not t:
        return (0, 0, 0)
    w = object_reader(mem, cp).type_words(t)
    if w is None or w[3] != 8 or not 112 + BLOCKSTACK + 8 <= w[2] <= 1024:
        return (0, 0, 0)
    blocks = w[2] - 8 - BLOCKSTACK
    return (t, blocks, lib.MU_FRAME_310 if cp.version == (3, 10) else lib.MU_FRAME_39)


# Returns [(type address, code)] of MU_TYPE_GEN_FRAME rules for the generator types among
# statics (3.11+): tp_basicsize is the inline frame's offset plus its localsplus offset, and
# tp_itemsize one slot (genobject.c); a type of another shape gets no rule.
def generator_types(mem, cp: CPythonMap, statics: Dict[str, int]) -> List[Tuple[int, int]]:
    flavour = frame_flavour(cp)
    if flavour is None:
        return []
    reader = object_reader(mem, cp)
    out = []
    for sym in GENERATOR_TYPES:
        t = statics.get(sym)
        fo = inline_frame_offset(reader, t, cp.layout.frame_localsplus) if t else None
        off = reader.object_offset(t) if fo else None
        if fo is None or off is None or off > 48:
            continue
        out.append((t, off | lib.MU_TYPE_GEN_FRAME << 8 | fo << 16 | flavour << 32))
    return sorted(out)


# Returns the object offset of the frame data that objects of type t (a generator or frame
# type, 3.11+) hold inline: tp_basicsize is that offset plus the data's slots offset (slots),
# and tp_itemsize one slot (genobject.c, frameobject.c); None for a type of another shape.
def inline_frame_offset(reader, t: int, slots: int) -> Optional[int]:
    w = reader.type_words(t)
    if w is None or w[3] != 8 or not slots + 24 <= w[2] <= slots + 256:
        return None
    return w[2] - slots


# Returns the (type address, code) of a MU_TYPE_VARSIZED rule for type t (a static type of the
# runtime, found by its symbol) when its tp_basicsize and tp_itemsize are the expected shape
# (header bytes, item bytes); None when t is None or differs.
def varsized_type(mem, cp: CPythonMap, t: Optional[int], shape: Tuple[int, int]):
    if t is None:
        return None
    reader = object_reader(mem, cp)
    basic, item = struct.unpack("<QQ", mem.read(t + L.TP_BASICSIZE, 16))
    off = reader.object_offset(t)
    if (basic if shape[0] else 0, item) != shape or not 16 <= basic <= 1024 or off is None \
            or off > 48:
        return None
    return (t, off | lib.MU_TYPE_VARSIZED << 8 | basic << 16 | item << 48)


# {type address: (its words but ob_refcnt, up to tp_alloc; {rule: verdict})}: the per-type
# verdicts of earlier checks (a long-lived checker checks one process again and again). A
# type whose words are unchanged has the same verdicts: it holds its name and its bases, so
# its tp_base chain is the same live types; a new or changed type is judged again.
_VERDICTS: Dict[int, Tuple[bytes, dict]] = {}
_TYPE_KEY = L.TP_ALLOC + 8
_UNJUDGED = object()


def _verdicts(reader, t: int) -> dict:
    """The remembered verdicts of type t (a dict to fill; one read of its words a check)."""
    k = reader.type_key(t, _TYPE_KEY)
    entry = _VERDICTS.get(t)
    if entry is None or entry[0] != k:
        if len(_VERDICTS) >= 1 << 16:
            _VERDICTS.clear()
        entry = _VERDICTS[t] = (k, {})
    return entry[1]


def _judged(reader, t: int, rule, judge):
    """judge(t), remembered for t while its words are unchanged (_verdicts)."""
    v = _verdicts(reader, t)
    out = v.get(rule, _UNJUDGED)
    if out is _UNJUDGED:
        out = v[rule] = judge(t)
    return out


# {the runtime's mappings' identity: its static type objects}: they never move
_STATIC_TYPES: dict = {}


# Returns the runtime's static type objects, ascending: the PyTypeObjects in the writable
# mappings of its ELF object (.data) whose ob_type is PyType_Type (by its symbol) and which read
# as types; [] without the symbol. One search of the mappings per process image (cached).
def runtime_static_types(mem, maps, pid, cp: CPythonMap) -> List[int]:
    return _static_types(mem, maps, pid, cp, [m for m in maps if m.path == cp.runtime.object_path])


# Returns the static type objects of every loaded ELF object (the runtime, its extension
# modules, libraries), ascending: as runtime_static_types, and those whose ob_type is one of the
# static metatypes found so (ctypes' PyCStructType's Structure); in their data and in the .bss
# after it (sys.flags' type, initialised at start-up). Their tp_flags are numbers.
def loaded_static_types(mem, maps, pid, cp: CPythonMap) -> List[int]:
    objects = loaded_objects(maps)
    return _static_types(mem, maps, pid, cp, owned_data(mem, maps, objects), rounds=2)


# {(path, inode, first mapping's address): the object's image span (elf.image_span) or None}
_SPANS: Dict[Tuple[str, int, int], Optional[int]] = {}


def owned_data(mem, maps, objects) -> List[Mapping]:
    """procfs.object_data of the objects (paths), the anonymous mapping after each .data cut
    at the end of the object's image (its .bss): pymalloc arenas and other anonymous memory
    that the kernel merged into that mapping (8 of the 11 MiB a small Python process had
    searched for types) are no part of it. A mapping is left whole when its object's headers do not read."""
    firsts: Dict[str, Mapping] = {}
    for m in maps:
        if m.path in objects and m.offset == 0 and (m.path not in firsts
                                                    or m.begin < firsts[m.path].begin):
            firsts[m.path] = m
    out, owner = [], None
    for m in procfs.object_data(maps, lambda m: m.path in objects):
        if m.path:
            owner = firsts.get(m.path)
            out.append(m)
            continue
        end = m.end
        if owner is not None:
            key = (owner.path, owner.inode, owner.begin)
            if key not in _SPANS:
                if len(_SPANS) >= 4096:
                    _SPANS.clear()
                try:
                    _SPANS[key] = elf.image_span(mem.read(owner.begin, elf.PAGE))
                except MemoryUnreadable:
                    _SPANS[key] = None
            span = _SPANS[key]
            if span is not None:
                end = min(end, (owner.begin + span + elf.PAGE - 1) & ~(elf.PAGE - 1))
        if end > m.begin:
            out.append(Mapping(m.begin, end, m.perms, m.offset, m.dev, m.inode, m.path))
    return out


def _static_types(mem, maps, pid, cp: CPythonMap, mappings, rounds: int = 1) -> List[int]:
    """The type objects in the writable mappings whose ob_type is PyType_Type (by its symbol)
    or, each further round, a metatype the round before found, and which read as types; []
    without the symbol. One search of the mappings per process image (cached)."""
    meta = runtime_symbols(maps, pid, cp).get("PyType_Type")
    key = (rounds,) + tuple([(m.begin, m.end, m.offset, m.dev, m.inode, m.path)
                             for m in mappings])
    if not meta:
        return []
    if key not in _STATIC_TYPES:
        reader = object_reader(mem, cp)
        datas = []
        for m in mappings:
            if "w" not in m.perms:
                continue
            try:
                datas.append((m.begin, mem.read(m.begin, m.end - m.begin)))
            except MemoryUnreadable:
                continue
        found, metas, metas_next = set(), {meta}, set()
        for _ in range(rounds):
            new = set()
            for base, data in datas:        # (mappings begin page-aligned: 8-aligned words)
                for w in words_equal(data, metas):
                    t, at = base + 8 * w - L.OB_TYPE, 8 * w - L.OB_TYPE + L.TP_FLAGS
                    if (t >= base and t not in found and at + 8 <= len(data)
                            and reader.type_info(t) is not None):
                        new.add(t)
                        if struct.unpack_from("<Q", data, at)[0] & L.TPFLAGS_TYPE_SUBCLASS:
                            metas_next.add(t)
            found |= new
            metas, metas_next = metas_next, set()
            if not metas:
                break
        if len(_STATIC_TYPES) >= 16:
            _STATIC_TYPES.clear()
        _STATIC_TYPES[key] = sorted(found)
    return _STATIC_TYPES[key]


# Returns [(type address, code)] of MU_TYPE_SIZED rules: the interpreter's own static types
# (inside the runtime's ELF object or one of its standard library's extension modules,
# stdlib_extensions) of fixed size (tp_itemsize 0): the pymalloc or malloc rounding slack
# after tp_basicsize holds stale words of the block's earlier users (3.8-3.11's static
# _ctypes.CField, 88 bytes with its GC header in a 96-byte pymalloc block: the last word held
# the address of a leaked 4 KiB block in an xdist worker, MEMUNREACHABLE_EXPLAIN). Types of
# other extensions and heap types are left whole: they may allocate past tp_basicsize.
# header_only: the types are var-sized but every reference lies in the fixed part (code
# objects: their bytecode and inline caches follow tp_basicsize, 3.11+).
def sized_types(mem, maps, cp: CPythonMap, types, header_only: bool = False) -> List[Tuple[int, int]]:
    reader = object_reader(mem, cp)
    paths = {cp.runtime.object_path} | (set() if header_only else stdlib_extensions(maps, cp))
    own = [(m.begin, m.end) for m in maps if m.path in paths]
    def judge(t: int) -> Optional[int]:
        if not any(b <= t < e for b, e in own) or reader.type_info(t) is None:
            return None
        basic, item = reader.type_words(t)[2:4]
        off = reader.object_offset(t)
        if (item and not header_only) or basic < 16 or basic > 1 << 16 or basic % 8 \
                or off is None or off > 48:
            return None
        return off | lib.MU_TYPE_SIZED << 8 | basic << 16
    rule = ("sized", header_only, reader.prefix)
    codes = [(t, _judged(reader, t, rule, judge)) for t in types]
    return [(t, code) for t, code in codes if code is not None]


# Returns [(type address, code)] of the rules for cffi's static types (its extension's), []
# when cffi is not loaded:
# - MU_TYPE_CDATA for its plain cdata (_cffi_backend._CDataBase, 40 bytes: refcount, type,
#   ctype, data, weakref list): the slack after such an object holds stale words (a pytest
#   process's own cdata held a leaked block's address at offset 40 of its 48-byte block); a
#   casted primitive keeps its value there, and its data pointer says so;
# - MU_TYPE_VARSIZED for its types (_cffi_backend.CType, cffi's CTypeDescrObject): a header of
#   tp_basicsize bytes, then the type's name inline, ob_size chars with its NUL (tp_itemsize
#   1); the slack after the name holds stale words (a pytest session's 128-byte CType block
#   kept a forgotten 4 KiB buffer's address at offset 120).
CDATA_TYPE = ("_cffi_backend._CDataBase", 40)
CTYPE_TYPE = "_cffi_backend.CType"


def cffi_types(mem, maps, pid, cp: CPythonMap) -> List[Tuple[int, int]]:
    reader = object_reader(mem, cp)
    out = []
    for t in loaded_static_types(mem, maps, pid, cp):
        info, words = reader.type_info(t), reader.type_words(t)
        if info is None or words is None or info[0] not in (CDATA_TYPE[0], CTYPE_TYPE):
            continue
        off = reader.object_offset(t)
        if off is None or off > 48:
            continue
        basic, item = words[2:4]
        if info[0] == CDATA_TYPE[0] and (basic, item) == (CDATA_TYPE[1], 0):
            out.append((t, off | lib.MU_TYPE_CDATA << 8 | basic << 16))
        elif info[0] == CTYPE_TYPE and item == 1 and 24 <= basic <= 1024:
            out.append((t, off | lib.MU_TYPE_VARSIZED << 8 | basic << 16 | item << 48))
    return out


# Returns [(type address, code)] of MU_TYPE_SIZED rules for the heap types among `types` whose
# objects are exactly their pre-header and tp_basicsize bytes: tp_itemsize 0, tp_alloc the
# interpreter's PyType_GenericAlloc (which allocates just that), no 3.13 inline values after
# the object, and the first static type up their tp_base chain is the interpreter's own: the
# runtime's or one of its standard library's extension modules' (sized_types trusts the same;
# a Python class over object, dict, Exception, ctypes' _SimpleCData or CFuncPtr...; another
# extension's static base may allocate its objects its own way). The allocator's rounding
# slack after such an object holds stale words of the block's earlier users: a 3.11 instance
# (32-byte pre-header, 24 bytes) fills 56 bytes of a 64-byte pymalloc block, and the last word
# of one held the address of a leaked 34 MB block in an xdist worker (MEMUNREACHABLE_EXPLAIN: a
# dict's value, offset 56); a 3.11 ctypes function pointer's (CFUNCTYPE's class over the static
# _ctypes.CFuncPtr) the address of a leaked 4 KiB buffer in a pytest session.
def class_types(mem, maps, pid, cp: CPythonMap, types) -> List[Tuple[int, int]]:
    alloc = runtime_symbols(maps, pid, cp).get("PyType_GenericAlloc")
    if not alloc:
        return []
    reader = object_reader(mem, cp)
    paths = {cp.runtime.object_path} | stdlib_extensions(maps, cp)
    own = [(m.begin, m.end) for m in maps if m.path in paths]
    inline = L.TPFLAGS_INLINE_VALUES if cp.version >= (3, 13) else 0
    solid: Dict[int, bool] = {}         # a heap type -> its static base is the interpreter's own

    def judge(t: int) -> Optional[int]:
        w = reader.type_words(t)
        if w is None or not w[4] & L.TPFLAGS_HEAPTYPE or w[3] or w[4] & inline \
                or not 16 <= w[2] <= 1 << 16 or reader._u64(t + L.TP_ALLOC) != alloc:
            return None
        off = reader.object_offset(t)
        if off is None or off > 48 or not _static_base_in(reader, t, own, solid):
            return None
        return off | lib.MU_TYPE_SIZED << 8 | w[2] << 16
    rule = ("class", reader.prefix, alloc)
    codes = [(t, _judged(reader, t, rule, judge)) for t in types]
    return [(t, code) for t, code in codes if code is not None]


def _dealloc_in(reader, t: int, ranges) -> bool:
    """Whether type t's tp_dealloc lies in one of ranges (the runtime's own mappings: a type of
    the interpreter or of one of its built-in modules, not an extension's of the same name)."""
    dealloc = reader._u64(t + L.TP_DEALLOC) or 0
    return any(b <= dealloc < e for b, e in ranges)


# Returns the weak reference types, ascending: weakref.ref, its proxies and the heap types among
# `types` over them (weakref.KeyedRef, WeakMethod). Their objects' referent word (wr_object)
# keeps nothing alive: an object that only weak references reach (a WeakSet's, a
# WeakValueDictionary's, its base class's tp_subclasses) is unreachable, and its refcount says
# whether it leaked.
def weakref_types(mem, maps, pid, cp: CPythonMap, types) -> List[int]:
    wanted = {sym: names[cp.version >= (3, 10)] for sym, names in L.WEAKREF_TYPES.items()}
    weak = set(static_types(mem, maps, pid, cp, wanted).values())
    if not weak:
        return []
    reader = object_reader(mem, cp)
    memo: Dict[int, bool] = {}

    def judge(base):
        if base in weak:
            return True
        w = reader.type_words(base)
        return None if w is not None and w[4] & L.TPFLAGS_HEAPTYPE else False
    sub = [t for t in types if t not in weak and _base_verdict(reader, t, judge, memo)]
    return sorted(weak | set(sub))


# {tp_name: tp_itemsize} of the var-sized types of the interpreter's built-in _sre module whose
# items hold no references (a compiled pattern's code units, a match's group marks): only the
# header up to tp_basicsize (which includes the first item) holds references.
REGEX_TYPES = {"re.Pattern": 4, "re.Match": 8}


# Returns [(type address, code)] of header-only MU_TYPE_SIZED rules for the types among `types`
# that are _sre's compiled patterns and matches (static through 3.9, heap types since): their
# size is tp_basicsize plus the item count rounded up to 8 bytes, not the allocator's size
# class, and the bytes between the last item and that end are never written. The word past a
# 40-unit pattern's code (offset 264 of its 272-byte pymalloc block) held the address of a
# leaked 34 MB block in an xdist worker (MEMUNREACHABLE_EXPLAIN, 2 of 20 runs). A type is taken
# only with that name, that item size and its tp_dealloc in the runtime's object.
def regex_types(mem, maps, cp: CPythonMap, types) -> List[Tuple[int, int]]:
    reader = object_reader(mem, cp)
    own = [(m.begin, m.end) for m in maps if m.path == cp.runtime.object_path]
    out = []
    for t in types:             # one read each; the few of the right shape are then named
        w = reader.type_words(t)
        if w is None or w[3] not in (4, 8) or not 64 <= w[2] <= 256:
            continue
        ti = reader.type_info(t)
        if ti is None or REGEX_TYPES.get(ti[0]) != w[3] or not _dealloc_in(reader, t, own):
            continue
        off = reader.object_offset(t)
        if off is not None and off <= 48:
            out.append((t, off | lib.MU_TYPE_SIZED << 8 | w[2] << 16))
    return out


def _static_base_in(reader, t: int, own, memo: Dict[int, bool]) -> bool:
    """Whether the first non-heap type up t's tp_base chain lies in one of the ranges own."""
    def judge(base):
        w = reader.type_words(base)
        if w is None or not w[4] & L.TPFLAGS_HEAPTYPE:
            return w is not None and any(b <= base < e for b, e in own) \
                and reader.type_info(base) is not None
        return None
    return _base_verdict(reader, t, judge, memo)


def _base_verdict(reader, t: int, judge, memo: Dict[int, bool]) -> bool:
    """judge(base) of the first base up t's tp_base chain that it decides (True or False;
    None: on up); False where the chain ends or cannot be read. memo: type -> verdict."""
    seen = []
    ok = False
    for _ in range(64):
        if t in memo:
            ok = memo[t]
            break
        seen.append(t)
        t = reader._u64(t + L.TP_BASE) or 0
        verdict = judge(t) if t else False
        if verdict is not None:
            ok = verdict
            break
    for x in seen:
        memo[x] = ok
    return ok


# Returns the dead (begin, end) ranges of the PyMemberDef arrays that the types' tp_members
# point to at an allocation's start (debug hooks: after their prefix): the arrays a static
# struct sequence type (sys.flags, sys.asyncgen_hooks, os.stat_result's on 3.8-3.11) gets from
# PyMem_NEW; a heap type's lie inside the type. In each entry up to the NULL name, the words
# after the name and before the doc: an int's padding there kept the high half of an old
# pointer, which with the int (Py_T_OBJECT, 6) read as a pointer into a leaked block (sid's
# 3.15, sys.asyncgen_hooks' two members).
def member_arrays(mem, image, types, debug_hooks: bool = False) -> List[Tuple[int, int]]:
    begins, sizes = image.begins, image.sizes
    skip = L.DEBUG_HOOK_PREFIX if debug_hooks else 0
    lo, hi = L.MEMBER_DEF_NUMBERS
    out: List[Tuple[int, int]] = []
    for t in types:
        try:
            p = read_u64(mem, t + L.TP_MEMBERS)
        except MemoryUnreadable:
            continue
        k = bisect.bisect_right(begins, p - skip) - 1 if p else -1
        if k < 0 or begins[k] + skip != p:
            continue
        n = (sizes[k] - skip) // L.MEMBER_DEF_SIZE
        try:
            data = mem.read(p, n * L.MEMBER_DEF_SIZE)
        except MemoryUnreadable:
            continue
        count = member_entries(data)
        out.extend((p + e + lo, p + e + hi)
                   for e in range(0, L.MEMBER_DEF_SIZE * (count or 0), L.MEMBER_DEF_SIZE))
    return out


# Returns how many PyMemberDef entries data (a block's bytes) holds before its sentinel (a NULL
# name), or None when it does not read as such an array: an entry whose name or doc is no
# address, whose type is no member type code or whose flags are more than the low byte, or no
# sentinel. (Not the offset: the words the rule makes dead, it and the paddings, may hold
# anything.) A type's tp_members may dangle: scipy's import left one at a freed array whose
# block a code object took, and its co_localsplusnames and co_localspluskinds, read as member
# numbers, stopped counting (both reported leaked).
def member_entries(data) -> Optional[int]:
    for k, e in enumerate(range(0, len(data) - L.MEMBER_DEF_SIZE + 1, L.MEMBER_DEF_SIZE)):
        name, kind, _pad, _offset, flags, _pad2, doc = struct.unpack_from("<QiiqiiQ", data, e)
        if not name:
            return k
        if (not 1 << 12 <= name < 1 << 48 or not 0 <= kind < 32 or not 0 <= flags < 256
                or (doc and not 1 << 12 <= doc < 1 << 48)):
            return None
    return None


# Returns the rules dead_types with the MU_TYPE_SIZED rules sized: added for types without a
# rule; a type's dead-at-zero rule at the same offset becomes a var-sized rule of no items,
# which is both (one rule per type: 3.8-3.10 give every GC type the dead-at-zero rule).
def with_sizes(dead_types, sized) -> List[Tuple[int, int]]:
    rules = dict(dead_types)
    for t, code in sized:
        have = rules.get(t)
        if have is None:
            rules[t] = code
        elif (have >> 8) & 0xff == lib.MU_TYPE_DEAD_AT_ZERO and have & 0xff == code & 0xff:
            rules[t] = (code & 0xff) | lib.MU_TYPE_VARSIZED << 8 | (code >> 16 & 0xffffffff) << 16
    return sorted(rules.items())

# Returns dead_types with dict's MU_TYPE_SIZED rule (t: PyDict_Type) made MU_TYPE_DICT: its
# header's version tag is an integer that may equal a heap address (3.8-3.11 step it by 1 per
# dict change, 3.12/3.13 by 4096; Debian's and Ubuntu's non-PIE interpreters keep their brk
# heap, where C extensions' blocks lie, below 4 GiB). On 3.8-3.10 dict's rule is a var-sized
# one of no items (with_sizes: sized and dead at zero), which MU_TYPE_DICT also is.
def dict_headers(dead_types, t: Optional[int]):
    kind = 0xff << 8
    def is_sized(code: int) -> bool:
        return (code & kind == lib.MU_TYPE_SIZED << 8
                or (code & kind == lib.MU_TYPE_VARSIZED << 8 and not (code >> 48) & 0xff))
    return [(u, code & ~kind | lib.MU_TYPE_DICT << 8 if u == t and is_sized(code) else code)
            for u, code in dead_types]


# The file names of the standard library's extension modules of CPython X.Y: in a directory
# lib-dynload of a directory pythonX.Y, tagged cpython-XY (a free-threaded build: cpython-XYt).
# pyenv's and Debian's builds both install them so (_ctypes, _decimal, _json...).
def stdlib_extensions(maps, cp: CPythonMap) -> set:
    major, minor = cp.version[:2]
    name = re.compile(r"/python%d\.%dt?/lib-dynload/[^/]+\.cpython-%d%dt?-[^/]+\.so$"
                      % (major, minor, major, minor))
    return {m.path for m in maps if m.path and name.search(m.path)}


# {symbol: run-time address} of the runtime's object by its mappings' identity and addresses:
# the file is not opened again while the same file stays mapped at the same place
_RUNTIME_FACTS: dict = {}


# Returns {symbol: address} of the runtime's static type objects in `wanted` ({symbol:
# tp_name}) that its ELF file exports and whose tp_name in the snapshot matches; {} when the
# ELF file cannot be read. One ELF lookup for them all.
def static_types(mem, maps, pid, cp: CPythonMap, wanted: Dict[str, str]) -> Dict[str, int]:
    symbols = runtime_symbols(maps, pid, cp)
    reader = object_reader(mem, cp)     # type_info does not depend on the reader's prefix
    out = {}
    for sym, name in wanted.items():
        if sym in symbols:
            ti = reader.type_info(symbols[sym])
            if ti is not None and ti[0] == name:
                out[sym] = symbols[sym]
    return out


# Returns {symbol: run-time address} of locate.FACT_SYMBOLS that the runtime's ELF file
# exports; {} when it cannot be read.
def runtime_symbols(maps, pid, cp: CPythonMap) -> Dict[str, int]:
    from memunreachable.heaps.cpython import locate
    mappings = [m for m in maps if m.path == cp.runtime.object_path]
    key = tuple([(m.begin, m.end, m.offset, m.dev, m.inode, m.path) for m in mappings])
    known = _RUNTIME_FACTS.get(key)
    if known is None:
        try:
            with locate._open(cp.runtime.object_path, mappings, pid) as f:
                facts = locate.elf_facts(f)
        except OSError:
            return {}
        bias = locate.facts_bias(facts, mappings) if facts is not None else None
        if bias is None:
            return {}
        if len(_RUNTIME_FACTS) >= 16:
            _RUNTIME_FACTS.clear()
        _RUNTIME_FACTS[key] = known = {sym: bias + v for sym, v in facts.symbols.items()}
    return known


# (3.14.10, 3.15.2: tp_basicsize 216, numfreeblocks at 72 (5 after 5 blocks emptied) and
# freeblocks[0] at 80, measured with ctypes as on 3.13)
DEQUE_SIZES = {(3, 8): 80, (3, 9): 80, (3, 10): 80, (3, 11): 216, (3, 12): 216, (3, 13): 216,
               (3, 14): 216, (3, 15): 216}
DEQUE_FREE = 72             # 3.11+: dequeobject.numfreeblocks, then freeblocks[16]


# Returns (the deque types among `types`, ascending: collections.deque, its tp_basicsize the
# version's and its tp_dealloc in the runtime's object, and the types deriving from it; the
# object offset of its free-block cache, 0 before 3.11) for deque_dead_ranges.
def deque_types(mem, maps, cp: CPythonMap, types) -> Tuple[List[int], int]:
    reader = object_reader(mem, cp)
    want = DEQUE_SIZES.get(tuple(cp.version[:2]))
    own = [(m.begin, m.end) for m in maps if m.path == cp.runtime.object_path]
    roots = set()
    for t in types:
        w = reader.type_words(t)
        if w is None or w[2] != want or w[3]:
            continue
        ti = reader.type_info(t)
        if ti is not None and ti[0] == "collections.deque" and _dealloc_in(reader, t, own):
            roots.add(t)
    if not roots:
        return [], 0
    memo: Dict[int, bool] = {}
    rule = ("derives", tuple(sorted(roots)))
    out = sorted(t for t in types if t in roots or _judged(
        reader, t, rule, lambda t: _derives_from(reader, t, roots, memo)))
    return out, DEQUE_FREE if cp.version >= (3, 11) else 0


# Returns (sets, managed, values_field, values_tag, inline, dicts, strs) for gc_stale_parts,
# each list of types ascending: set, frozenset and the heap types that derive from them; on
# 3.11-3.13 the types with a managed dict (Py_TPFLAGS_MANAGED_DICT; 3.11/3.12: their values'
# word offset from the object and how it is tagged; 3.13: inline, the types with
# Py_TPFLAGS_INLINE_VALUES, whose values start at object offset 16) and the dict types
# (ma_values); the str subclasses
# (Py_TPFLAGS_UNICODE_SUBCLASS: a GC str is a subclass's instance). 3.8-3.10 keep values in
# plain arrays: no values rule there.
def stale_part_types(mem, cp: CPythonMap, types, statics: Dict[str, int]):
    reader = object_reader(mem, cp)
    roots = {statics[k] for k in ("PySet_Type", "PyFrozenSet_Type") if k in statics}
    values = (3, 11) <= cp.version <= (3, 15)
    inline_flag = L.TPFLAGS_INLINE_VALUES if cp.version >= (3, 13) else 0
    # 3.13: inline values at object offset 16 (sizeof(PyObject)); 3.14+ at tp_basicsize
    # (_PyObject_InlineValues, internal/pycore_object.h), which the native rule reads from each
    # object's type (values_field 0): a str subclass's instance keeps its values after its
    # 64 bytes, and their unused slots a block's earlier user's words (sid's 3.14)
    sets, managed, inline, dicts, strs = [], [], [], [], []
    derives: Dict[int, bool] = {}
    rule = ("derives", tuple(sorted(roots)))
    for t in types:
        w = reader.type_words(t)
        if w is None:
            continue
        if roots and (t in roots or w[4] & L.TPFLAGS_HEAPTYPE and _judged(
                reader, t, rule, lambda t: _derives_from(reader, t, roots, derives))):
            sets.append(t)
        if values and w[4] & L.TPFLAGS_MANAGED_DICT:
            managed.append(t)
            if w[4] & inline_flag:
                inline.append(t)
        if values and w[4] & L.TPFLAGS_DICT_SUBCLASS:
            dicts.append(t)
        if w[4] & L.TPFLAGS_UNICODE_SUBCLASS:
            strs.append(t)
    if not values:
        return sorted(sets), [], 0, 0, [], [], sorted(strs)
    field, tag = {(3, 11): (-32, lib.MU_VALUES_PLAIN), (3, 12): (-24, lib.MU_VALUES_TAGGED),
                  (3, 13): (16, lib.MU_VALUES_313)}.get(
        cp.version, (0, lib.MU_VALUES_313))     # 3.14+: inline at each type's tp_basicsize
    return sorted(sets), sorted(managed), field, tag, sorted(inline), sorted(dicts), sorted(strs)


def _derives_from(reader, t: int, roots, memo: Dict[int, bool]) -> bool:
    """Whether one of the types roots lies up t's tp_base chain."""
    return _base_verdict(reader, t, lambda base: True if base in roots else None, memo)


# Returns the metatypes among `types` (type objects whose tp_flags has
# Py_TPFLAGS_TYPE_SUBCLASS: type, ABCMeta, EnumType, ...), ascending.
def metatypes(mem, cp: CPythonMap, types) -> List[int]:
    reader = object_reader(mem, cp)
    out = []
    for t in types:             # one read each; the few candidates are then checked whole
        w = reader.type_words(t)
        if w is not None and w[4] & L.TPFLAGS_TYPE_SUBCLASS and reader.type_info(t) is not None:
            out.append(t)
    return sorted(out)


IO_BUFFERED = ("_io.BufferedReader", "_io.BufferedWriter", "_io.BufferedRandom")


# Returns the types of `types` (ascending) that are io's buffered classes of this layout:
# named as one of IO_BUFFERED and of tp_basicsize L.BUFFERED_SIZE.
def buffered_types(mem, cp: CPythonMap, types) -> List[int]:
    reader = object_reader(mem, cp)
    out = []
    for t in types:             # one read each; the few of the right size are then named
        w = reader.type_words(t)
        if w is None or w[2] != L.BUFFERED_SIZE:
            continue
        ti = reader.type_info(t)
        if ti is not None and ti[0] in IO_BUFFERED:
            out.append(t)
    return sorted(out)


# Returns (the types among `types`, ascending, whose GC objects hold ctypes' format and shape
# pointers; those fields' object offsets), for field_blocks: the blocks they point at are text
# and integers, never references. "X{}" and 4 stale bytes of a bin link (a libc address's high
# half) read as an address inside a leaked list in an xdist worker (MEMUNREACHABLE_EXPLAIN:
# a function pointer type's format, PYTHONMALLOC=malloc). 3.8-3.12: the type named StgDict of
# tp_basicsize L.STGDICT_SIZE, static in _ctypes; 3.13: ctypes' metatypes (by name, of their
# size, tp_base _ctypes.CType_Type), whose classes carry the StgInfo. ([], ()) when none is.
def ctypes_types(mem, maps, cp: CPythonMap, types) -> Tuple[List[int], Tuple[int, ...]]:
    own = [(m.begin, m.end) for m in maps if m.path == cp.runtime.object_path
           or (m.path or "").rpartition("/")[2].startswith("_ctypes.")]
    reader = object_reader(mem, cp)
    if cp.version < (3, 13):
        size, fields, names = L.STGDICT_SIZE, L.STGDICT_FIELDS, ("StgDict",)
    else:
        info_size, info_fields = L.stginfo(cp.version)
        size, fields, names = None, info_fields, L.CTYPES_METATYPES
    out = []
    # one read each; the few of the right size (3.13: the metatypes) are then named
    for t in types:
        w = reader.type_words(t)
        if w is None or ((w[2], w[3]) != (size, 0) if size is not None
                         else not w[4] & L.TPFLAGS_TYPE_SUBCLASS):
            continue
        ti = reader.type_info(t)
        if ti is None or ti[0] not in names:
            continue
        if size is None:        # 3.13: the type data follows PyType_Type's size, rounded to 16
            meta, base = reader.type_words(w[0]), reader.type_info(reader._u64(t + L.TP_BASE) or 0)
            if meta is None or (w[2], w[3]) != ((meta[2] + 15) // 16 * 16 + info_size, meta[3]) \
                    or base is None or base[0] != "_ctypes.CType_Type":
                continue
            fields = tuple((meta[2] + 15) // 16 * 16 + f for f in info_fields)
        elif not any(b <= t < e for b, e in own):
            continue
        out.append(t)
    return sorted(out), (tuple(fields) if out else ())


# Returns the ob_type of each thread's innermost frame (3.8-3.10: frames are heap objects,
# often untracked by the GC; zombie and free-listed frames keep stale pointers).
def frame_types(mem, cp: CPythonMap) -> List[int]:
    out = []
    for interp in cp.interpreters:
        for t in interp.threads:
            try:
                f = read_u64(mem, t.address + L.TSTATE_FRAME)
                if f:
                    out.append(read_u64(mem, f + L.OB_TYPE))
            except MemoryUnreadable:
                continue
    return out
