"""Stages 4-5 (CPython): merge the CPython memory map into the sweep's allocations and roots.

Input: the snapshot (Memory), mappings, threads, pid and glibc's HeapWalk. Output: CPythonSweep:
    image       glibc's HeapImage plus pymalloc's used blocks (ascending merge), minus the
                blocks of free-listed (dead) objects
    root_cuts   pymalloc's arenas/pools, the dead data stack, free-list arrays and GC list
                heads: never roots (classify's extra_cuts)
    dead        DeadWords for mark/fold: every GC-tracked object's PyGC_Head (found by walking
                the generation lists from their heads in C), the list heads, dead ranges
                lying inside an allocation (3.9/3.10: the interpreter is a glibc chunk), and
                the first words of pymalloc blocks that are short strings over a free link
    warnings    soft issues (a part left to the old treatment)
    blind       what could not be seen, one reason each (a runtime whose map is unusable, GC
                links that had to count as references, pools left unwalked): leaks there can
                hide, so the orchestrator gives no "no leaks" verdict (issue 22)
When CPython is absent or its map is unusable, image is glibc's and nothing is cut: CPython's
memory is scanned whole as roots, and blind says why. See cpython-memory.md, style.md 2b.
The parts, by stage: merge.py (pymalloc's blocks into glibc's image), gclists.py (the GC
lists and the native passes over GC objects), typerules.py (which types get which rule).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from memunreachable._ffi import in_thread, lib
from memunreachable._types import HeapImage, Range, local_buffer, merge_ranges
from memunreachable.heaps.cpython import gclists, layout as L
from memunreachable.heaps.cpython.gclists import (deque_dead_ranges, field_blocks, gc_dead_ranges,
                                                  gc_head_spans, gc_heads, gc_stale_parts,
                                                  untracked_heap_types, walk_gc_lists,
                                                  weak_referents)
from memunreachable.heaps.cpython.merge import drop_overlapping, merge_dropping
from memunreachable.heaps.cpython.typerules import (
    GENERATOR_TYPES, MEMORYVIEW_SHAPE, TUPLE_SHAPE, buffered_types, cffi_types, class_types,
    ctypes_types, deque_types, dict_keys_rule, frame_types, generator_types, has_debug_hooks,
    loaded_static_types, member_arrays, metatypes, object_types, old_frame_rule, regex_types,
    runtime_static_types, sized_types, stale_part_types, static_types, type_rules, value_types,
    varsized_type, weakref_types, with_sizes, dict_headers)
from memunreachable.heaps.cpython.walker import CPythonMap, walk_cpython
from memunreachable.heaps.glibc.validate import HeapInconsistent
from memunreachable.sweep.classify import in_syscall
from memunreachable.sweep.mark import DeadWords, merge_pairs


@dataclass
class CPythonSweep:
    cpython: Optional[CPythonMap]
    image: HeapImage
    root_cuts: List[Range] = field(default_factory=list)
    dead: Optional[DeadWords] = None
    warnings: List[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    blind: List[str] = field(default_factory=list)

    @property
    def usable(self) -> bool:
        return bool(self.cpython and self.cpython.usable)

    def cannot_see(self, reason: str) -> None:
        """A part of CPython's memory that could not be understood: a warning and a blind spot."""
        self.warnings.append(reason)
        self.blind.append(reason)


# Returns the CPythonSweep of the snapshot; never raises for CPython's sake (a problem leaves
# the glibc image and a warning).
def prepare(mem, maps, threads, pid: Optional[int], image: HeapImage) -> CPythonSweep:
    try:
        return _prepare(mem, maps, threads, pid, image)
    finally:
        gclists.IMAGE_ARGS.clear()


# Raises HeapInconsistent (the snapshot is retaken, as a glibc heap caught mid-update) when a
# thread was stopped in user code: it may have been linking an object into a GC list or out
# of it (a Python thread that has the GIL while the one that asked for an in-process check
# waits). With every thread inside a system call nothing was in flight: the list is broken.
def retake_if_moving(problem: str, threads) -> None:
    moving = [t.tid for t in threads if not in_syscall(t)]
    if moving:
        exc = HeapInconsistent(problem)
        exc.suspect_tids = moving
        raise exc


def _prepare(mem, maps, threads, pid: Optional[int], image: HeapImage) -> CPythonSweep:
    cp = walk_cpython(mem, maps, threads, pid)
    out = CPythonSweep(cp, image, warnings=list(cp.warnings))
    if not cp.usable:
        if cp.no_interpreter:       # nothing Python to see: not a blind spot
            return out
        # the walker's last warning says why (walker.py: each unusable outcome appends one)
        out.blind.append(cp.warnings[-1] if cp.warnings else
                         "the CPython runtime could not be mapped: its memory is scanned whole "
                         "as roots")
        return out
    merged, ndead, nblocks, kept_cuts, dropped = _allocations(cp, image)
    if dropped:
        out.cannot_see(
            f"{dropped} pymalloc pool(s) overlap glibc allocations ({cp.runtime.object_path}):"
            " their blocks are not allocations and their memory is scanned as before")
    out.image = merged
    cuts = list(kept_cuts) + list(cp.dead_ranges)
    dead_pairs = [[(r.begin, r.end) for r in cp.dead_ranges]]     # sources for merge_pairs
    # a short string over a free block's link, at a block's start (mu_pymalloc_text_heads)
    dead_pairs.append([(a, a + 8) for a in cp.pymalloc.text_heads])
    head_word = live_end = None
    wanted = {sym: name for sym, (name, _kind) in type_rules(cp).items()}
    statics = static_types(mem, maps, pid, cp, dict(wanted, PyList_Type="list", PyCode_Type="code",
                                                    PyTuple_Type="tuple", PySet_Type="set",
                                                    PyFrozenSet_Type="frozenset",
                                                    PyMemoryView_Type="memoryview",
                                                    PyFrame_Type="frame", PyDict_Type="dict",
                                                    **GENERATOR_TYPES))
    heads = gc_heads(mem, cp)
    if heads is None:
        out.cannot_see(f"CPython {cp.version[0]}.{cp.version[1]}: no GC state layout: "
                            "GC links count as references (leaked Python objects are missed)")
    else:
        head_word, nodes, types, problem = walk_gc_lists(merged, heads)
        if problem:
            retake_if_moving(f"CPython's GC generation list {problem}", threads)
            out.cannot_see(f"CPython's GC generation list {problem}: GC links count as "
                                "references (leaked Python objects are missed)")
            head_word = None
        else:
            spans = gc_head_spans(cp)
            cuts += [Range(b, e) for b, e in spans]
            dead_pairs.append(spans)
            out.stats["gc_nodes"] = nodes
            # list slack, heap types' docstrings, io buffers: one native pass
            metas = metatypes(mem, cp, types)
            # the heap types whose objects are not GC objects (functools' LRU-list links...):
            # no GC list shows them, yet class_types' rule applies to them too
            types = types + untracked_heap_types(merged, head_word, metas)
            # (the lists' slack as their item arrays' live ends: no pair to sort or search)
            # (zero pages until written, not a 4-byte-a-block memset: 192 MB at 48 M blocks)
            live_end = local_buffer(4 * len(merged.begins))
            stale_types = stale_part_types(mem, cp, types, statics)
            # on a second thread: its native pass (0.1 s over 4 M GC objects) overlaps the
            # stale parts' and the deques' passes below; with the sets' tables' hashes (a set
            # of id()s held every object whose address it holds)
            dead_ranges = _in_background(gc_dead_ranges, merged, head_word,
                                         statics.get("PyList_Type", 0), metas,
                                         buffered_types(mem, cp, types), live_end,
                                         stale_types[0])
            # weak references' referents (a weak reference keeps nothing alive): a pass over
            # the GC objects too (0.09 s of 4 M), on a third thread
            weak_referents_of = _in_background(weak_referents, merged, head_word,
                                               weakref_types(mem, maps, pid, cp, types))
            # sets' smalltables after a resize, dict values arrays' prefixes and unused slots
            gen = dict(generator_types(mem, cp, statics)).get(statics.get("PyGen_Type"))
            pairs, (nsets, nvalues, nstrs, ngens, nnames, nframes) = gc_stale_parts(
                merged, head_word, cp.version, *stale_types,
                gen_type=statics["PyGen_Type"] if gen else 0,
                gen_dead=(gen >> 16 & 0xffff) - 16 if gen else 0, metas=metas,
                frame=old_frame_rule(mem, cp, statics))
            dead_pairs.append(pairs)
            pairs, ndeques = deque_dead_ranges(merged, head_word, *deque_types(mem, maps, cp,
                                                                                types))
            dead_pairs.append(pairs)
            out.stats["deques"] = ndeques
            # ctypes' format strings and shape arrays: text and integers
            ctypes, fields = ctypes_types(mem, maps, cp, types)
            strings = [field_blocks(merged, head_word, ctypes, f, as_pairs=True) for f in fields]
            dead_pairs += strings
            out.stats["ctypes_strings"] = sum(len(p) for p in strings)
            weak = weak_referents_of()
            dead_pairs.append(weak)
            out.stats["weak_referents"] = len(weak)
            pairs, (nslack, ndocs, nbuffers, nflags, nhashes, ntables) = dead_ranges()
            dead_pairs.append(pairs)
            if "PyList_Type" in statics:
                out.stats["list_slack_ranges"] = nslack
            out.stats["type_docs"] = ndocs
            out.stats["io_buffers"] = nbuffers
            out.stats["heap_type_flags"] = nflags
            out.stats.update(set_smalltables=nsets, set_hashes=nhashes, set_tables=ntables,
                             dict_values=nvalues, str_buffers=nstrs, generator_heads=ngens,
                             type_names=nnames, old_frames=nframes)
    dead_types = []
    if head_word is not None and cp.version <= L.DEAD_OBJECTS_UNTIL:
        types = sorted(set(types) | set(frame_types(mem, cp)))
        dead_types = object_types(mem, cp, types, L.DEAD_OBJECT_TYPES)
    dead_types += value_types(mem, cp, statics)
    if head_word is not None:
        # the runtime's static types, GC or not (3.8/3.9's compiled patterns are no GC
        # objects: no GC list shows their type)
        statics_all = runtime_static_types(mem, maps, pid, cp)
        known = sorted(set(types) | set(statics_all))
        # every known type's tp_flags, and every extension module's static types' (ctypes'
        # metatypes, 0x80xxxxxx, kept a block): a number, 1 << 24 and up for the subclasses
        # of int, list, dict, str, BaseException, type; under a non-PIE interpreter (Debian's)
        # the heap lies there (str's flags, 0x1004xxxx, kept a leaked block that straddled
        # them). Heap types without instances: gc_dead_ranges
        flagged = sorted(set(known) | set(loaded_static_types(mem, maps, pid, cp)))
        dead_pairs.append([(t + L.TP_FLAGS, t + L.TP_FLAGS + 8) for t in flagged])
        out.stats["type_flags"] = len(flagged)
        # their members' descriptions on the heap: numbers and padding (typerules)
        members = member_arrays(mem, merged, flagged, has_debug_hooks(cp))
        dead_pairs.append(members)
        out.stats["member_entries"] = len(members)
        sized = sized_types(mem, maps, cp, known) + class_types(mem, maps, pid, cp, types) \
            + regex_types(mem, maps, cp, known)
        dead_types = dict_headers(with_sizes(dead_types, sized), statics.get("PyDict_Type"))
        out.stats["sized_types"] = len(sized)
    # code objects (every version): the bytecode after the header holds no references, and
    # a stale pointer's high bytes in the rounding slack after it (glued to the last code
    # unit) read as a pointer into a leaked block (seen in an xdist worker)
    # 3.14+: and the two header words no default build writes (layout.code_unwritten: a stale
    # copy of a leaked block's address at offset 184, _co_unique_id, hid it on sid's 3.14)
    if "PyCode_Type" in statics and statics["PyCode_Type"] not in {t for t, _ in dead_types}:
        code = sized_types(mem, maps, cp, [statics["PyCode_Type"]], header_only=True)
        unwritten = cp.layout.code_unwritten
        if unwritten and code and unwritten[0] % 8 == 0 and sum(unwritten) <= code[0][1] >> 16:
            code = [(code[0][0], code[0][1] | unwritten[0] // 8 << 48 | unwritten[1] // 8 << 56)]
        dead_types += code
    # tuples (every version): the slack after the last item (an odd item count in a 16-byte
    # size class) held the address of a leaked block in an xdist worker's co_consts; the rule
    # replaces 3.8-3.10's dead-at-zero rule of the type, which it includes
    # memoryviews (every version): their unwritten suboffsets and the slack after their shape
    # arrays (an io read's buffer view kept a leaked block's address there, 3.12 and 3.13)
    tuple_shape = (cp.layout.tuple_items, TUPLE_SHAPE[1])     # 3.14+: ob_hash before the items
    for sym, shape in (("PyTuple_Type", tuple_shape), ("PyMemoryView_Type", MEMORYVIEW_SHAPE)):
        rule = varsized_type(mem, cp, statics.get(sym), shape)
        if rule and sym == "PyMemoryView_Type":
            rule = (rule[0], rule[1] & ~(0xff << 8 | 0xff << 48) | lib.MU_TYPE_MEMORYVIEW << 8)
        if rule:
            dead_types = [x for x in dead_types if x[0] != rule[0]] + [rule]
    # cffi's plain cdata objects (not a casted primitive's value) and types (after the name):
    # the slack after them
    if head_word is not None:
        cffi = cffi_types(mem, maps, pid, cp)
        replaced = {t for t, _ in cffi}
        dead_types = [x for x in dead_types if x[0] not in replaced] + cffi
    # generators, coroutines, async generators (3.11+): their inline frame's dead slots
    gens = generator_types(mem, cp, statics)
    replaced = {t for t, _ in gens}
    dead_types = [x for x in dead_types if x[0] not in replaced] + gens
    dead_types = sorted(dead_types)
    out.stats["gc_types"] = len(dead_types)
    out.root_cuts = merge_ranges(cuts)
    out.dead = DeadWords(ranges=merge_pairs(*dead_pairs),
                         head_word=head_word, live_end=live_end, types=dead_types,
                         dict_keys=dict_keys_rule(cp), debug_hooks=has_debug_hooks(cp))
    out.stats.update(cp.stats, pymalloc_blocks=nblocks, dead_blocks_dropped=ndead,
                     text_heads=len(cp.pymalloc.text_heads),
                     version="%d.%d" % cp.version, allocator=cp.allocator)
    return out


# Starts fn(image, *args) on a thread (_ffi.in_thread: a native pass over the image, while the
# next passes run on another CPU) and returns the callable that waits for its result; the
# image's native arguments are made here first (gclists' cache of them is not for two threads
# to fill) and held by the thread (prepare() clears the cache, even while an exception leaves
# it running).
def _in_background(fn, image: HeapImage, *args):
    gclists.image_args(image)
    return in_thread(_holding, gclists.IMAGE_ARGS[id(image)], fn, image, *args,
                     name="memunreachable-pipeline")


def _holding(_args, fn, image: HeapImage, *args):
    return fn(image, *args)


# Returns (glibc's image with pymalloc's used blocks merged in and its dead blocks dropped,
# how many were dropped, how many pymalloc blocks there were, the cuts of the pools kept, how
# many pools were dropped for overlapping glibc allocations). cp's blocks and sizes may be
# used for the merge (then set to None).
def _allocations(cp: CPythonMap, image: HeapImage):
    blocks, sizes, kept_cuts, dropped = drop_overlapping(cp, image, cp.layout.obmalloc.pool_size)
    # pymalloc's own outputs (no pool dropped): merged in place, they hold the merge after it
    room = cp.room if blocks is cp.blocks else None
    merged, ndead = merge_dropping(image, HeapImage(blocks, sizes, list(cp.regions)),
                                   cp.dead_blocks, room=room)
    if room is not None:
        cp.blocks = cp.sizes = cp.room = None       # overwritten
        if cp.pymalloc is not None:
            cp.pymalloc.blocks = cp.pymalloc.sizes = cp.pymalloc.room = None
    return merged, ndead, len(blocks), kept_cuts, dropped


def allocations(mem, maps, threads, pid: Optional[int], image: HeapImage) -> HeapImage:
    """The allocations a sweep's image holds (prepare's), and the dead objects of the free
    lists too (a record of where blocks began may hold more, never fewer: mark's fresh rule
    then spares more words), without the rest of its work: image (glibc's) when the CPython
    map is not usable."""
    try:
        cp = walk_cpython(mem, maps, threads, pid, blocks_only=True)
        return _allocations(cp, image)[0] if cp.usable else image
    finally:
        gclists.IMAGE_ARGS.clear()

