"""gclists.py: Stage 4 (CPython): the GC generation lists and the dead words of GC objects.

    gc_heads(mem, cp) -> [(head, _gc_next, _gc_prev)]   each generation list's head
    gc_head_spans(cp) -> [(begin, end)]                 the heads' words: never roots
    walk_gc_lists(image, heads) -> (head_word, nodes, types, problem)
                                    walks the lists in C (native/mu_gc.c): which allocations
                                    start with a PyGC_Head, and the object types seen
Then one native pass each over the GC objects of given types gives (begin, end) ranges that
hold no references (native/mu_cpython.c): list_slack, gc_dead_ranges (list slack, heap
types' docstrings, io buffers), gc_stale_parts (set smalltables, dict values, str buffers,
generator heads, type names, old frames), deque_dead_ranges, field_blocks, type_docs,
io_buffers; untracked_heap_types finds the heap types no GC list shows. Which types get which
rule is typerules.py's. IMAGE_ARGS caches the image's C arguments for one sweep (the
pipeline clears it).
"""
from __future__ import annotations

import errno
from array import array
from typing import List, Optional, Sequence, Tuple

from memunreachable._errors import MemoryUnreadable
from memunreachable._ffi import ffi, lib, region_array, u64_view
from memunreachable._types import HeapImage, Range, read_u64, u64_scratch
from memunreachable.heaps.cpython import layout as L
from memunreachable.heaps.cpython.walker import CPythonMap
from memunreachable.sweep.mark import FlatPairs


MAX_GC_NODES = 1 << 28
MAX_TYPES = 1 << 16
GC_ERRORS = {errno.ELOOP: "does not return to its head", errno.EFAULT: "leaves the allocations",
             errno.EPROTO: "has a back link that does not match"}


def _gc_state(cp: CPythonMap) -> Optional[L.GcState]:
    """The GC state layout: the layout's own (3.13+: built from _Py_DebugOffsets), else the
    version's table entry."""
    if cp.layout is not None and cp.layout.source != "table":
        return cp.layout.gc
    return L.GC_STATES.get(cp.version)


def _gc_states(cp: CPythonMap) -> Optional[List[int]]:
    st = _gc_state(cp)
    if st is None:
        return None
    if st.in_runtime:
        return [cp.runtime.runtime + st.offset]
    return [i.address + st.offset for i in cp.interpreters]


def gc_head_spans(cp: CPythonMap) -> List[Tuple[int, int]]:
    """[begin, end) of each GC state's list heads (3 generations and the permanent one), in
    whole words: from 3.13.5 the heads are only 4-aligned (their words then hold the ints next
    to them, GC state flags and counts, never references)."""
    st = _gc_state(cp)
    return [((s + st.generations) & ~7, (s + st.heads_end + 7) & ~7) for s in _gc_states(cp)]


# Returns [(head address, _gc_next, _gc_prev)] of every generation list, or None when the
# version has no known GC state. Unreadable heads: [] (the walk then finds nothing to skip).
def gc_heads(mem, cp: CPythonMap) -> Optional[List[Tuple[int, int, int]]]:
    states = _gc_states(cp)
    if states is None:
        return None
    st = _gc_state(cp)
    offs = [st.generations + k * st.generation_size for k in range(st.num_generations)]
    offs.append(st.permanent)
    out = []
    try:
        for s in states:
            for o in offs:
                out.append((s + o, read_u64(mem, s + o), read_u64(mem, s + o + 8)))
    except MemoryUnreadable:
        return []
    return out


# Returns [Range] of the stale slots of every list on the GC lists (mu_list_slack): words
# above ob_size in its item array, which are not references. as_pairs: (begin, end) tuples.
def list_slack(image: HeapImage, head_word, list_type: int, as_pairs: bool = False) -> list:
    return _gc_object_ranges(image, head_word, lambda args, out, cap: lib.mu_list_slack(
        *args, list_type, out, cap), as_pairs)


# The native arguments describing one image (begins, sizes, n, regions, nregions) and what
# keeps them alive, for the passes over the same merged image (walk_gc_lists, list_slack,
# field_blocks): built once a sweep, not once a pass. prepare() clears it.
IMAGE_ARGS: dict = {}


def image_args(image: HeapImage) -> tuple:
    hit = IMAGE_ARGS.get(id(image))
    if hit is not None and hit[0] is image:
        return hit[1]
    begins, kb = u64_view(image.begins)
    sizes, ks = u64_view(image.sizes)
    regs, kr = region_array(image.regions)
    args = (begins, sizes, len(image.begins), regs, len(image.regions))
    IMAGE_ARGS.clear()
    IMAGE_ARGS[id(image)] = (image, args, (kb, ks, kr))
    return args


# Returns the words a native pass over the GC objects of image stores, `width` per item found:
# call(args, out, cap) with args as for _gc_object_ranges returns how many items there are
# (cap at most stored); a bigger buffer is tried when they did not fit. Empty on an error.
def _gc_object_words(image: HeapImage, head_word, call, width: int) -> array:
    if not len(image.begins):
        return array("Q")
    args = image_args(image) + (ffi.from_buffer("uint8_t[]", head_word),)
    cap = 4096
    while True:
        out = array("Q", bytes(8 * width * cap))
        rc = call(args, ffi.from_buffer("uint64_t[]", out), cap)
        if rc <= cap:
            break
        cap = rc
    if rc < 0:
        return array("Q")
    del out[width * rc:]
    return out


# Returns the [Range] pairs a native pass over the GC objects of image stores (mu_list_slack,
# mu_field_blocks): call(args, out, cap) with args = (begins, sizes, n, regions, nregions,
# head_word); [] on an error. as_pairs: FlatPairs (of (begin, end) tuples) instead of Ranges.
def _gc_object_ranges(image: HeapImage, head_word, call, as_pairs: bool = False) -> list:
    out = _gc_object_words(image, head_word, call, 2)
    return FlatPairs(out) if as_pairs else [Range(b, e) for b, e in zip(out[0::2], out[1::2])]


# Returns ((begin, end) pairs, (list slack, type docs, io buffers, type flags, set hashes in
# smalltables, set tables) counts) of list_slack, type_docs and io_buffers over the same GC
# objects, the tp_flags word of each type object (a type whose type is in metas), and the
# hashes of the tables of the sets (objects whose type is in sets, ascending), found in one
# native pass (mu_gc_dead_ranges); list_type 0: no list rule. live_end (4 * n zero bytes, or
# None): a list's slack to the end of its item array's allocation is set there (mu_dead's
# live_end) instead of given as a pair, and a set's own table marked (MU_LIVE_SET_TABLE).
# ([], (0, 0, 0, 0, 0, 0)) on an error.
def gc_dead_ranges(image: HeapImage, head_word, list_type: int, metas: Sequence[int],
                   buffered: Sequence[int], live_end=None, sets: Sequence[int] = ()):
    if not len(image.begins):
        return [], (0, 0, 0, 0, 0, 0)
    m, b, st = array("Q", metas), array("Q", buffered), array("Q", sets)
    args = image_args(image) + (ffi.from_buffer("uint8_t[]", head_word),)
    counts = ffi.new("uint64_t[6]")
    # room for a range per GC object (a list's slack when live_end is None), so that one
    # pass does
    cap = 4096 + len(head_word) - head_word.count(0)
    while True:
        out = u64_scratch(2 * cap)      # not zeroed: 4 M lists' room took 0.04 s to zero
        rc = lib.mu_gc_dead_ranges(*args, list_type, ffi.from_buffer("uint64_t[]", m), len(m),
                                   L.TP_DOC, L.TP_FLAGS, L.TPFLAGS_HEAPTYPE,
                                   ffi.from_buffer("uint64_t[]", b), len(b), L.BUFFERED_BUFFER,
                                   ffi.from_buffer("uint64_t[]", st), len(st),
                                   ffi.from_buffer("uint64_t[]", out), cap, counts,
                                   ffi.NULL if live_end is None
                                   else ffi.from_buffer("uint32_t[]", live_end))
        if rc <= cap:
            break
        cap = rc
    if rc < 0:
        return [], (0, 0, 0, 0, 0, 0)
    return FlatPairs(out[:2 * rc]), tuple(counts)


# Returns the (begin, end) pairs of mu_gc_stale_parts over the GC objects and its counts (set
# smalltables, dict values arrays, str buffers, generator heads, heap types' name copies);
# ([], (0, 0, 0, 0, 0)) on an error. Types as stale_part_types; gen_type: PyGen_Type (0:
# none), gen_dead: the object offset of its two unwritten words (its inline frame's offset -
# 16); metas: the metatypes (type and its subclasses, ascending); frame: old_frame_rule's.
def gc_stale_parts(image: HeapImage, head_word, version, sets, managed, values_field: int,
                   values_tag: int, inline, dicts, strs, gen_type: int = 0, gen_dead: int = 0,
                   metas=(), frame=(0, 0, 0)):
    if not len(image.begins) or not (sets or managed or dicts or strs or gen_type or metas
                                     or frame[0]):
        return [], (0, 0, 0, 0, 0, 0)
    mt = array("Q", metas)
    s, m, d, t = array("Q", sets), array("Q", managed), array("Q", dicts), array("Q", strs)
    i = array("Q", inline)
    utf8, data = L.str_buffer_fields(version)
    counts = ffi.new("uint64_t[6]")
    pairs = _gc_object_ranges(image, head_word, lambda args, out, cap: lib.mu_gc_stale_parts(
        *args, ffi.from_buffer("uint64_t[]", s), len(s), ffi.from_buffer("uint64_t[]", m), len(m),
        values_field, values_tag, ffi.from_buffer("uint64_t[]", i), len(i),
        ffi.from_buffer("uint64_t[]", d), len(d),
        ffi.from_buffer("uint64_t[]", t), len(t), utf8, data, gen_type, gen_dead,
        ffi.from_buffer("uint64_t[]", mt), len(mt), *frame, out, cap, counts), as_pairs=True)
    return pairs, tuple(counts[k] for k in range(6))


# Returns (the (begin, end) pairs of the deques' dead words (mu_deque_dead_ranges), how many
# deques gave them).
def deque_dead_ranges(image: HeapImage, head_word, deques: Sequence[int], free_off: int):
    if not deques or not len(image.begins):
        return [], 0
    arr = array("Q", deques)
    counts = ffi.new("uint64_t[1]")
    pairs = _gc_object_ranges(image, head_word, lambda args, out, cap: lib.mu_deque_dead_ranges(
        *args, ffi.from_buffer("uint64_t[]", arr), len(arr), free_off, out, cap, counts),
        as_pairs=True)
    return pairs, counts[0]


# Returns the heap types (GC objects of the metatypes metas) without Py_TPFLAGS_HAVE_GC, whose
# objects no GC list holds, ascending.
def untracked_heap_types(image: HeapImage, head_word, metas: Sequence[int]) -> List[int]:
    return gc_objects_of(image, head_word, metas, L.TP_FLAGS,
                         L.TPFLAGS_HEAPTYPE | L.TPFLAGS_HAVE_GC, L.TPFLAGS_HEAPTYPE)


# Returns the addresses of the GC objects of `types` (ascending) whose word at flag_off (16 or
# more: after the header) has (word & flag_mask) == flag_want (flag_mask 0: all of them that
# reach past flag_off), ascending.
def gc_objects_of(image: HeapImage, head_word, types: Sequence[int], flag_off: int = 16,
                  flag_mask: int = 0, flag_want: int = 0) -> List[int]:
    if not types:
        return []
    arr = array("Q", types)
    return list(_gc_object_words(image, head_word, lambda args, out, cap: lib.mu_gc_objects_of(
        *args, ffi.from_buffer("uint64_t[]", arr), len(arr), flag_off, flag_mask, flag_want,
        out, cap), 1))


# Returns (begin, end) pairs of the weak references' referent words (wr_object, object offset
# 16 in every version): a weak reference is no reference (typerules.weakref_types).
def weak_referents(image: HeapImage, head_word, weak: Sequence[int]) -> List[Tuple[int, int]]:
    return [(a + L.WR_OBJECT, a + L.WR_OBJECT + 8) for a in gc_objects_of(image, head_word, weak)]


# Returns [Range] of the blocks that field `field` of the GC objects of `types` (ascending)
# points at, when the object's word at flag_off has a bit of flag_mask (0: always).
def field_blocks(image: HeapImage, head_word, types: Sequence[int], field: int,
                 flag_off: int = 0, flag_mask: int = 0, as_pairs: bool = False) -> list:
    if not types:
        return []
    arr = array("Q", types)
    return _gc_object_ranges(image, head_word, lambda args, out, cap: lib.mu_field_blocks(
        *args, ffi.from_buffer("uint64_t[]", arr), len(arr), field, flag_off, flag_mask, out,
        cap), as_pairs)


# Returns [Range] of the heap types' docstring copies: text, not references. A stale
# pointer's high bytes in the allocator's slack after the text's NUL read as a pointer into
# a leaked block (MEMUNREACHABLE_EXPLAIN: a pytest class's 1,112-byte docstring).
def type_docs(image: HeapImage, head_word, metas: Sequence[int], as_pairs: bool = False) -> list:
    return field_blocks(image, head_word, metas, L.TP_DOC, L.TP_FLAGS, L.TPFLAGS_HEAPTYPE,
                        as_pairs=as_pairs)


# Returns [Range] of the buffers of io's buffered objects (a file's or pipe's bytes, never a
# reference): a BufferedWriter's 4-8 KiB buffer keeps the stale bytes of its block's earlier
# users past what was written (MEMUNREACHABLE_EXPLAIN: a leaked list and a forgotten 4 KiB
# block, each hidden by an address in a pytest process's pipe and capture-file buffers).
def io_buffers(image: HeapImage, head_word, buffered: Sequence[int],
               as_pairs: bool = False) -> list:
    return field_blocks(image, head_word, buffered, L.BUFFERED_BUFFER, as_pairs=as_pairs)


_TYPES_OUT = array("Q", bytes(8 * MAX_TYPES))      # walk_gc_lists' output, reused


# Returns (head_word bytearray, node count, distinct object types, problem or ""): walks the
# generation lists in C (native/mu_gc.c) over the image's allocations.
def walk_gc_lists(image: HeapImage, heads: Sequence[Tuple[int, int, int]]):
    n = len(image.begins)
    head_word = bytearray(n)
    if not heads:
        return head_word, 0, [], "heads could not be read"
    begins, sizes, _n, regs, nregs = image_args(image)
    flat = array("Q", [w for t in heads for w in t])
    st = ffi.new("mu_gc_walk_stats *")
    types = _TYPES_OUT
    rc = lib.mu_gc_walk(begins, sizes, n, regs, nregs,
                        ffi.from_buffer("uint64_t[]", flat), len(heads), MAX_GC_NODES,
                        ffi.from_buffer("uint8_t[]", head_word) if n else ffi.NULL,
                        ffi.from_buffer("uint64_t[]", types), MAX_TYPES, st)
    if rc < 0:
        why = GC_ERRORS.get(-rc, f"could not be walked (error {-rc})")
        return head_word, 0, [], (f"at {heads[st.bad_list][0]:#x} {why} "
                                  f"(node {st.bad_node:#x}, {st.nodes} nodes in)")
    ntypes = st.ntypes if st.ntypes <= MAX_TYPES else 0     # too many: no dead-object rule
    return head_word, rc, list(types[:ntypes]), ""
