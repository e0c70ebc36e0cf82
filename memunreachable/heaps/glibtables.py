"""glibtables.py: Stage 6b: references kept as 32-bit numbers. GLib's hash tables (2.64+,
glib/ghash.c) keep their keys and their values as arrays of guint, 4 bytes an entry, as long
as every one fits in 32 bits, and as pointers once one does not. In a heap below 4 GiB (a
non-PIE program's brk heap: Debian's python3) a table of heap pointers is so an array of
32-bit numbers, which the mark (8-aligned 8-byte words, as LeakSanitizer reads memory) does not
read as references: `import gi` under Debian's python3 reported PyGObject's log-handler
domains ("GLib", "GThread", "GLib-GObject"), held only from such a table, as leaked.

    wanted(maps) -> bool             whether the process has GLib and heap memory below 4 GiB:
                                     its heap is walked with copies then (find reads them)
    find(image, maps) -> [Table]     the hash tables in the copied heap of a process with GLib
                                     whose heap lies partly below 4 GiB
    references(tables, image, marked, mem) -> [int]   the 32-bit keys and values of the
                                     tables the mark reached: more roots, marked again

A header is taken for a table (mu_glib_tables: size a power of 2, its mask, counts within it,
the arrays' pointers, a hash function) only when its hashes array and its keys (and its values,
unless they are the keys: a set) begin allocations big enough for size entries and its hash
function lies in an executable mapping. An entry counts when its hash is real (2 or more: 0 is
an unused slot, 1 a removed one). The native loop is native/mu_libs.c.
"""
from __future__ import annotations

import bisect
from array import array
from typing import List, Sequence

from memunreachable._errors import MemoryUnreadable
from memunreachable._ffi import ffi, lib, u64_results
from memunreachable._types import Fields
from memunreachable.heaps.glibc.copies import is_uncopied

LOW = 1 << 32
# struct _GHashTable's fields (x86-64)
HAVE_BIG = 24                   # guint: have_big_keys (bit 0), have_big_values (bit 1)
KEYS, HASHES, VALUES, HASH_FUNC = 32, 40, 48, 56
HEADER = 64                     # read through hash_func


class Table(Fields):
    """A GLib hash table found in the heap: its arrays and their entry widths."""
    __slots__ = ("address", "size", "keys", "hashes", "values", "big_keys", "big_values")

    def __init__(self, address: int, size: int, keys: int, hashes: int, values: int,
                 big_keys: bool, big_values: bool):
        self.address = address
        self.size = size
        self.keys = keys
        self.hashes = hashes
        self.values = values
        self.big_keys = big_keys
        self.big_values = big_values


def wanted(maps) -> bool:
    """Whether tables of 32-bit entries may hold references here: GLib is loaded and some of
    the process's heap memory (its brk heap, private anonymous memory) begins below 4 GiB.
    The sweep keeps its copies of such a process's heap whatever its size (find() reads
    them)."""
    return (any("libglib-2.0.so" in m.path for m in maps)
            and any(m.begin < LOW and m.writable and not m.shared
                    and (m.path == "[heap]" or (m.inode == 0 and not m.path.startswith("[")))
                    for m in maps))


def find(image, maps) -> List[Table]:
    """The hash tables of a process with GLib loaded whose heap lies partly below 4 GiB, found
    in the image's copied regions; [] otherwise (and for regions walked without a copy)."""
    if not any("libglib-2.0.so" in m.path for m in maps):
        return []
    copied = sorted(((b, buf) for b, buf in image.regions if not is_uncopied(buf)),
                    key=lambda r: r[0])
    if not any(b < LOW for b, _ in copied):
        return []
    code = sorted((m.begin, m.end) for m in maps if "x" in m.perms)
    out: List[Table] = []
    for base, buf in copied:
        view = memoryview(buf).cast("B")
        for at in _headers(view, base):
            head = view[at - base:at - base + HEADER]
            size = int.from_bytes(head[0:8], "little")
            big = head[HAVE_BIG]
            keys, hashes, values, fn = (int.from_bytes(head[o:o + 8], "little")
                                        for o in (KEYS, HASHES, VALUES, HASH_FUNC))
            t = Table(at, size, keys, hashes, values, bool(big & 1), bool(big & 2))
            if (_inside(code, fn) and _block(image, hashes, 4 * size)
                    and _block(image, keys, (8 if t.big_keys else 4) * size)
                    and (values == keys or _block(image, values,
                                                  (8 if t.big_values else 4) * size))
                    and not (t.big_keys and (t.big_values or values == keys))):
                out.append(t)
    return out


def references(tables: Sequence[Table], image, marked, mem) -> List[int]:
    """The addresses the 32-bit keys and values of the reachable tables (their hashes and
    keys arrays marked) hold, for the entries in use, ascending; the tables whose arrays cannot
    be read give none."""
    begins = image.begins
    out = set()
    for t in tables:
        if not (_marked(begins, marked, t.hashes) and _marked(begins, marked, t.keys)):
            continue
        try:
            hashes = array("I", mem.read(t.hashes, 4 * t.size))
            arrays = [] if t.big_keys else [t.keys]
            if t.values != t.keys and not t.big_values:
                arrays.append(t.values)
            for a in arrays:
                entries = array("I", mem.read(a, 4 * t.size))
                out.update(e for h, e in zip(hashes, entries) if h >= 2 and e)
        except MemoryUnreadable:
            continue
    return sorted(out)


def _headers(view, base: int) -> array:
    """mu_glib_tables over one copied region: the addresses of table-like headers."""
    data = ffi.from_buffer("uint8_t[]", view)
    return u64_results(lambda out: lib.mu_glib_tables(
        data, base, len(view), ffi.from_buffer("uint64_t[]", out), len(out)),
        "find GLib hash tables")


def _index(begins, addr: int) -> int:
    """The index of the allocation that begins at addr, or -1."""
    i = bisect.bisect_left(begins, addr)
    return i if i < len(begins) and begins[i] == addr else -1


def _block(image, addr: int, need: int) -> bool:
    """Whether an allocation of at least `need` bytes begins at addr."""
    i = _index(image.begins, addr)
    return i >= 0 and image.sizes[i] >= need


def _marked(begins, marked, addr: int) -> bool:
    i = _index(begins, addr)
    return i >= 0 and bool(marked[i])


def _inside(spans, addr: int) -> bool:
    i = bisect.bisect_right(spans, (addr, float("inf"))) - 1
    return i >= 0 and spans[i][0] <= addr < spans[i][1]
