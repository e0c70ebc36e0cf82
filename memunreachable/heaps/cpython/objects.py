"""After folding (CPython): which unreachable blocks hold Python objects, and which are leaks.

Input: the snapshot (Memory), the CPython version and allocator, the HeapImage, the indices of
the unreachable allocations and the GC-link words (head_word). Output:
    objects_in(...)    {index: PyObjectInfo}: type name (ob_type->tp_name), reference count,
                       a short repr for str/bytes/int/float (cpython-memory.md section 3)
    split_garbage(...) the unreachable blocks that are cyclic garbage, not leaks (section 8):
                       the collector's own test (subtract_refs/move_unreachable) run over the
                       unreachable set: an object whose ob_refcnt exceeds the references found
                       inside the set was leaked by a missing Py_DECREF; so is everything it
                       reaches, and every non-object block that no object reaches or that
                       points at no unreachable object (a native leak, not an object's part).
                       The rest is garbage the cyclic GC will free (or refcount-0 dead objects).
    leak_heads(...)    which leak entries a leaked object should head instead of a block of
                       its cycle
An object is recognised only when its ob_type is a type whose type chain ends in `type`
(ob_type of ob_type ... is itself, named "type") and the object's offset in its block matches
the type's flags (GC head, 3.11+ pre-header, debug-hook prefix).
"""
from __future__ import annotations

import bisect
import math
import struct
from array import array
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set, Tuple

from memunreachable.heaps.cpython import layout as L

MAX_NAME = 120
MAX_REPR = 40
MAX_REFCNT = 1 << 40
MAX_OBJECTS = 1_000_000           # unreachable blocks examined at most (~8 us each, Python)
MAX_GARBAGE_BYTES = 64 << 20      # unreachable bytes examined for cycles at most
MAX_BLOCK_WORDS = 1 << 20         # bytes of one block examined at most (bigger: no words read;
                                  # what only they reference then reads as leaked, never as garbage)
_Q = struct.Struct("<Q")
_TYPE_WORDS = struct.Struct("<QQQ")          # tp_name, tp_basicsize, tp_itemsize
_TYPE_HEAD = L.TP_FLAGS + 8                 # a type object's bytes type_words reads


@dataclass(frozen=True)
class PyObjectInfo:
    address: int                  # the PyObject * inside the block
    type_name: str
    refcount: int
    immortal: bool = False        # 3.12+ immortal count: never judged by refcount
    repr: Optional[str] = None
    owned: Tuple[int, ...] = ()   # offsets of its fields that point at buffers it owns


class ObjectReader:
    """Reads Python objects out of the snapshot; caches what it learns about types."""

    def __init__(self, mem, version: Tuple[int, int], prefix: int = 0):
        self.mem, self.version, self.prefix = mem, version, prefix
        self.pre = L.preheader_flags(version)
        self._types: Dict[int, Optional[Tuple[str, int]]] = {}
        self._words: Dict[int, Optional[Tuple[int, int, int, int, int]]] = {}
        self._names: Dict[int, Optional[str]] = {}
        self._keys: Dict[int, bytes] = {}
        self._view = getattr(mem, "view", None)     # memory.CopiedMemory: no copy made

    # Returns the bytes of the type object at t from ob_type up to offset end (all of it but
    # ob_refcnt: what stays the same while the type does), b"" when unreadable; one read each.
    def type_key(self, t: int, end: int) -> bytes:
        k = self._keys.get(t)
        if k is None:
            k = self._keys[t] = self._read(t + L.OB_TYPE, end - L.OB_TYPE) or b""
        return k

    # Returns (ob_type, tp_name, tp_basicsize, tp_itemsize, tp_flags) of the object at t read
    # as a type object (one read of its first TP_FLAGS + 8 bytes), or None when unreadable.
    def type_words(self, t: int) -> Optional[Tuple[int, int, int, int, int]]:
        if t in self._words:
            return self._words[t]
        out = None
        data = self._view(t, _TYPE_HEAD) if self._view is not None else None
        if data is None:
            data = self._read(t, _TYPE_HEAD)
        if data is not None:
            out = (_Q.unpack_from(data, L.OB_TYPE)[0],) + _TYPE_WORDS.unpack_from(
                data, L.TP_NAME) + (_Q.unpack_from(data, L.TP_FLAGS)[0],)
        self._words[t] = out
        return out

    def _read(self, addr: int, n: int) -> Optional[bytes]:
        try:
            data = self.mem.read(addr, n)
        except Exception:  # noqa: BLE001 - any unreadable address means "not an object"
            return None
        return data if len(data) == n else None

    def _u64(self, addr: int) -> Optional[int]:
        b = self._read(addr, 8)
        return None if b is None else _Q.unpack(b)[0]

    def _cstr(self, addr: int) -> Optional[str]:
        if not addr:
            return None
        raw = self._read(addr, MAX_NAME)
        if raw is None:
            raw = b""
            for n in (64, 32, 16):           # the name may end near the end of its mapping
                raw = self._read(addr, n) or b""
                if raw:
                    break
        end = raw.find(b"\0")
        if end <= 0:
            return None
        name = raw[:end]
        if any(c < 0x20 or c > 0x7E for c in name):
            return None
        return name.decode()

    # Returns (tp_name, tp_flags) when t is a type object, else None.
    def type_info(self, t: int) -> Optional[Tuple[str, int]]:
        if t in self._types:
            return self._types[t]
        out = None
        if t and t % 8 == 0:
            x, ok = t, False
            for _ in range(5):               # t -> its metatype -> ... -> type (its own type)
                w = self.type_words(x)
                mt = None if w is None else w[0]
                if mt is None or mt == 0 or mt % 8:
                    break
                if mt == x:
                    ok = self._name(w[1]) == "type"
                    break
                x = mt
            w = self.type_words(t) if ok else None
            meta = self.type_words(w[0]) if w is not None else None
            # t's own type is a metatype (type or a subclass of it): None's chain (None ->
            # NoneType -> type) ends in type too, and a list's item array starting with two
            # Nones read as an object of "type" None (its "name" what follows None in .data).
            # Its own flags say it is ready and are flags (below 2**32): an array of pointers
            # in an extension's .bss (scipy's), &PyType_Type its second, read as a type named
            # ")" whose "tp_flags", a tuple's address, then stopped counting (a false leak)
            if (meta is not None and meta[4] & L.TPFLAGS_TYPE_SUBCLASS
                    and w[4] & L.TPFLAGS_READY and not w[4] >> 32):
                name = self._name(w[1])
                if name:
                    out = (name, w[4])
        self._types[t] = out
        return out

    def _name(self, addr: int) -> Optional[str]:
        if addr not in self._names:
            self._names[addr] = self._cstr(addr)
        return self._names[addr]

    # Returns the offset of an object of type t in its block (GC head, pre-header, debug-hook
    # prefix), or None when t is not a type.
    def object_offset(self, t: int) -> Optional[int]:
        ti = self.type_info(t)
        if ti is None:
            return None
        flags = ti[1]
        return self.prefix + 16 * bool(flags & L.TPFLAGS_HAVE_GC) + 16 * bool(flags & self.pre)

    # Returns the PyObjectInfo of the object in block [begin, begin+size), or None.
    def object_in(self, begin: int, size: int, data: Optional[bytes] = None,
                  with_repr: bool = True) -> Optional[PyObjectInfo]:
        for off in (0, 16, 32):
            off += self.prefix
            if off + 16 > size:
                break
            head = data[off:off + 16] if data is not None and len(data) >= off + 16 \
                else self._read(begin + off, 16)
            if head is None:
                continue
            refcnt, tp = struct.unpack("<QQ", head)
            ti = self.type_info(tp)
            if ti is None:
                continue
            name, flags = ti
            want = self.prefix + 16 * bool(flags & L.TPFLAGS_HAVE_GC) + 16 * bool(flags & self.pre)
            if want != off:
                continue
            # 3.14+ (Include/object.h) splits the word into a uint32 ob_refcnt, ob_overflow and
            # ob_flags, which only immortal (static) objects set: a mortal object's whole word
            # is its count, as before (masking it would take a pointer's low half, a free-listed
            # object's link or a list item over stale int bytes, for a count)
            immortal = self.version >= (3, 12) and (refcnt & 0xFFFFFFFF) >= 0x80000000
            if not immortal and refcnt >= MAX_REFCNT:
                continue
            if refcnt == 0 and flags & L.TPFLAGS_HAVE_GC and not self._untracked_head(
                    begin + off - 16, data[off - 16:off] if data is not None and len(data) >= off
                    else None):
                continue        # a live item array's stale slack, not a dead object
            obj = begin + off
            return PyObjectInfo(obj, name, refcnt & 0xFFFFFFFF if immortal else refcnt, immortal,
                                self.short_repr(name, obj, begin + size) if with_repr else None,
                                L.owned_fields(name, flags, self.version))
        return None

    # A dead GC object's PyGC_Head is an untracked one: next 0, prev 0 or its finalized bit
    # (native mu_untracked_head). head: its 16 bytes when already read.
    def _untracked_head(self, at: int, head: Optional[bytes]) -> bool:
        head = head if head is not None and len(head) == 16 else self._read(at, 16)
        if head is None:
            return False
        nxt, prev = struct.unpack("<QQ", head)
        return nxt == 0 and prev & ~1 == 0

    def short_repr(self, name: str, obj: int, end: int) -> Optional[str]:
        try:
            if name == "float":
                b = self._read(obj + L.FLOAT_VALUE, 8)
                return None if b is None else _clip(repr(struct.unpack("<d", b)[0]))
            if name == "int":
                return self._int_repr(obj, end)
            if name == "bytes":
                n = self._u64(obj + L.OB_SIZE)
                if n is None or n > end - obj - L.BYTES_DATA:
                    return None
                return _clip(repr(self._read(obj + L.BYTES_DATA, min(n, MAX_REPR)) or b""),
                             n > MAX_REPR)
            if name == "str":
                return self._str_repr(obj, end)
            if name == "type":          # a class: its tp_name
                ti = self.type_info(obj)
                return None if ti is None else _clip(f"<class {ti[0]!r}>")
            if name == "module":        # its name: a str object of its own
                md_name = self._u64(obj + L.module_name_offset(self.version))
                ti = self.type_info(self._u64(md_name + 8) or 0) if md_name else None
                text = self._str_repr(md_name, md_name + 4096) if ti and ti[0] == "str" else None
                return None if text is None else f"<module {text}>"
        except (struct.error, ValueError, OverflowError):
            return None
        return None

    def _int_repr(self, obj: int, end: int) -> Optional[str]:
        if self.version >= (3, 12):
            tag = self._u64(obj + L.LONG_TAG)
            if tag is None:
                return None
            ndigits, sign = tag >> 3, 1 - (tag & 3)
        else:
            size = self._u64(obj + L.OB_SIZE)
            if size is None:
                return None
            size = size - (1 << 64) if size >= 1 << 63 else size
            ndigits, sign = abs(size), (size > 0) - (size < 0)
        if ndigits > 64 or obj + L.LONG_DIGITS + 4 * ndigits > end:
            return None
        raw = self._read(obj + L.LONG_DIGITS, 4 * ndigits) if ndigits else b""
        if raw is None:
            return None
        value = 0
        for k, (d,) in enumerate(struct.iter_unpack("<I", raw)):
            value |= (d & ((1 << 30) - 1)) << (30 * k)
        return _clip(str(sign * value))

    def _str_repr(self, obj: int, end: int) -> Optional[str]:
        length = self._u64(obj + L.STR_LENGTH)
        state = self._read(obj + L.STR_STATE, 4)
        if length is None or state is None:
            return None
        st = struct.unpack("<I", state)[0]
        kind, compact, ascii_ = (st >> 2) & 7, (st >> 5) & 1, (st >> 6) & 1
        if not compact or kind not in (1, 2, 4):
            return None
        ascii_size, compact_size = L.str_ascii_size(self.version)
        data = obj + (ascii_size if ascii_ else compact_size)
        if data + length * kind > end:
            return None
        n = min(length, MAX_REPR)
        raw = self._read(data, n * kind)
        if raw is None:
            return None
        text = raw.decode({1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind], "replace")
        return _clip(repr(text), length > MAX_REPR)


def _clip(text: str, more: bool = False) -> str:
    if len(text) > MAX_REPR:
        return text[:MAX_REPR] + "..."
    return text + "..." if more else text


# Returns {index: PyObjectInfo} for the allocations at `indices` that hold a Python object,
# without their repr (with_repr: see with_repr()). contents(addr, n) returns the block's bytes
# from the sweeper's copies.
def objects_in(reader: ObjectReader, begins, sizes, indices: Sequence[int],
               contents) -> Dict[int, PyObjectInfo]:
    out = {}
    for i in indices:
        b, s = begins[i], sizes[i]
        info = reader.object_in(b, s, contents(b, min(s, 64)), with_repr=False)
        if info is not None:
            out[i] = info
    return out


def with_repr(reader: ObjectReader, info: PyObjectInfo, end: int) -> PyObjectInfo:
    """info with its short repr filled in (end: the end of its block)."""
    r = reader.short_repr(info.type_name, info.address, end)
    return PyObjectInfo(info.address, info.type_name, info.refcount, info.immortal, r, info.owned)


# Returns (garbage indices, internal reference count per object index, edges: {index: the
# unreachable blocks its words point into}), or (None, {}, {}) when the unreachable set is too
# large to examine (everything then stays a leak).
# words(i) -> array('Q') of block i's words with its GC-link words zeroed.
def split_garbage(begins, sizes, indices: Sequence[int], objects: Dict[int, PyObjectInfo],
                  words) -> Tuple[Optional[Set[int]], Dict[int, int], Dict[int, List[int]]]:
    if not objects:
        return set(), {}, {}
    if sum(min(sizes[i], MAX_BLOCK_WORDS) for i in indices) > MAX_GARBAGE_BYTES:
        return None, {}, {}
    order = sorted(indices)
    ub = [begins[i] for i in order]
    ue = [begins[i] + max(sizes[i], 1) for i in order]
    by_obj = {info.address: i for i, info in objects.items()}
    internal = dict.fromkeys(objects, 0)
    edges: Dict[int, List[int]] = {}
    holds_objects = set()         # blocks holding an exact pointer to an unreachable object
    owned = set()                 # blocks an unreachable object owns through a typed field
    for i in order:
        out = set()
        ws = words(i) if sizes[i] <= MAX_BLOCK_WORDS else ()
        if i in objects and ws:
            owned.update(_owned_blocks(objects[i], begins[i], ws, ub, ue, order))
        for v in ws:
            if v < ub[0] or v >= ue[-1]:
                continue
            t = by_obj.get(v)
            if t is not None:
                holds_objects.add(i)
                if not (objects[i].refcount == 0 if i in objects else False):
                    internal[t] += 1
            k = bisect.bisect_right(ub, v) - 1
            if k >= 0 and v < ue[k] and order[k] != i:
                out.add(order[k])
        edges[i] = list(out)

    def reach(starts) -> Set[int]:
        seen, stack = set(starts), list(starts)
        while stack:
            for t in edges.get(stack.pop(), ()):
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return seen

    # a dead object (refcount 0: free-listed, a zombie frame) holds stale words: no edges
    for i, info in objects.items():
        if info.refcount == 0 and not info.immortal:
            edges[i] = []
    from_objects = reach([i for i, info in objects.items() if info.refcount or info.immortal])
    roots = [i for i, info in objects.items()
             if not info.immortal and info.refcount > internal[i]]
    # a non-object block is an object's part when an unreachable object owns it through a
    # typed field (a dict's key table, a list's item array: holding no unreachable object, an
    # empty dict's keys or a list of small ints, they are still parts), or when an unreachable
    # object reaches it and it points at unreachable objects itself; any other (a native block
    # a stale word of an object happens to point into) is a leak
    roots += [i for i in order if i not in objects and i not in owned
              and (i not in from_objects or i not in holds_objects)]
    leaked = reach(roots)
    return {i for i in order if i not in leaked}, internal, edges


# Returns {entry head: new head} for the leak entries (head index, the indices of its other
# blocks) whose head should be another block of theirs: the Python object whose reference
# leaked (the missing Py_DECREF's object: its ob_refcnt exceeds the references the head's
# cycle holds to it), when the head is no such object; the lowest-index one of several.
# Folding's lowest-address member is arbitrary in a cycle. An idle CPython 3.8 leaks its first
# _warnings module: it, its dict, the dict's key table and the module's functions (each
# holding the module) form one cycle, which the key table (in the brk heap, below the pymalloc
# arenas) headed as a 584-byte native block, the module nowhere named. Only the cycle's own
# words count (words(i): block i's words), so a head stays the same from check to check
# whatever other unreachable blocks come and go (a baseline compares heads: a moved head
# would read as a new leak).
def leak_heads(entries, objects: Dict[int, PyObjectInfo], edges: Dict[int, List[int]],
               words, max_members: int = 1 << 16) -> Dict[int, int]:
    out = {}
    for head, blocks in entries:
        if len(blocks) >= max_members:
            continue
        members = set(blocks)
        members.add(head)
        if not any(i in objects and not objects[i].immortal for i in members):
            continue
        back: Dict[int, List[int]] = {}
        for i in members:
            for t in edges.get(i, ()):
                if t in members:
                    back.setdefault(t, []).append(i)
        cycle, stack = {head}, [head]           # the members that reach the head
        while stack:
            for s in back.get(stack.pop(), ()):
                if s not in cycle:
                    cycle.add(s)
                    stack.append(s)
        held = {objects[i].address: 0 for i in cycle
                if i in objects and not objects[i].immortal}
        if not held:
            continue
        for i in cycle:
            for w in words(i):
                if w in held:
                    held[w] += 1
        leaked = sorted(i for i in cycle if i in objects and not objects[i].immortal
                        and objects[i].refcount > held[objects[i].address])
        if leaked and head not in leaked:
            out[head] = leaked[0]
    return out


def _owned_blocks(info: PyObjectInfo, begin: int, ws, ub, ue, order) -> List[int]:
    """Indices (in the block order) of the unreachable blocks info's typed fields point into."""
    out = []
    for off in info.owned:
        w = (info.address - begin + off) // 8
        if not 0 <= w < len(ws):
            continue
        v = ws[w] + (ws[w] & 1)               # 3.12's tagged values pointer: values - 1
        k = bisect.bisect_right(ub, v) - 1
        if k >= 0 and v < ue[k] and ub[k] != begin:
            out.append(order[k])
    return out


def block_words(view, head_word, i: int) -> array:
    """The 8-byte words of a block (a memoryview of its bytes), GC-link words zeroed."""
    n = len(view) // 8 * 8
    arr = array("Q")
    arr.frombytes(bytes(view[:n]))
    hw = head_word[i] if head_word is not None else 0
    if hw:
        k = hw - 1
        for j in (k, k + 1):
            if j < len(arr):
                arr[j] = 0
    return arr
