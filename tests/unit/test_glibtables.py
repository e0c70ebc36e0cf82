"""Unit tests of heaps/glibtables.py (GLib hash tables' 32-bit keys and values) and its native
scan (native/mu_libs.c mu_glib_tables), on in-memory images."""
import errno
import struct
from array import array

from memunreachable._ffi import ffi, lib
from memunreachable._types import BufferMemory, HeapImage, Mapping
from memunreachable.heaps import glibtables as G

HEAP = 0x0200_0000                  # a non-PIE brk heap: below 4 GiB
CODE = 0x7F00_0000_0000             # libglib's text


def header(size=16, mask=None, nnodes=3, nocc=4, big=0, keys=HEAP + 0x1000,
           hashes=HEAP + 0x2000, values=None, fn=CODE + 0x40):
    """struct _GHashTable's first 64 bytes (GLib 2.64+)."""
    return struct.pack("<QiIiiIIQQQQ", size, 13, size - 1 if mask is None else mask, nnodes,
                       nocc, big, 0, keys, hashes, keys if values is None else values, fn)


def scan(data, base=HEAP):
    out = array("Q", bytes(8 * 16))
    n = lib.mu_glib_tables(ffi.from_buffer("uint8_t[]", data), base, len(data),
                           ffi.from_buffer("uint64_t[]", out), len(out))
    return n if n < 0 else [a - base for a in out[:n]]


def test_the_scan_finds_table_headers_at_8_aligned_offsets():
    data = bytes(24) + header() + bytes(8) + header(size=8, big=3) + bytes(16)
    assert scan(data) == [24, 96]
    assert scan(header()[:63]) == []                    # a header cut short
    assert scan(header(big=0xfffffffc)) == [0]          # stale bits beside the two flags
    for bad in (header(size=12, mask=11), header(size=4), header(size=1 << 29),
                header(mask=14), header(nnodes=5, nocc=4), header(nocc=17),
                header(nnodes=-1), header(keys=0), header(hashes=HEAP + 4),
                header(values=HEAP + 0x3001), header(fn=0)):
        assert scan(bytes(8) + bad) == [], bad
    assert lib.mu_glib_tables(ffi.NULL, HEAP, 8, ffi.NULL, 0) == -errno.EINVAL
    assert lib.mu_glib_tables(ffi.from_buffer("uint8_t[]", header()), HEAP + 4, 64,
                              ffi.NULL, 0) == -errno.EINVAL


def _process(table_at, hdr, blocks, glib=True):
    """(image, maps, mem) of a heap holding the table header and the given blocks
    ({address: bytes}), each an allocation."""
    heap = bytearray(0x8000)
    heap[table_at - HEAP:table_at - HEAP + len(hdr)] = hdr
    for a, b in blocks.items():
        heap[a - HEAP:a - HEAP + len(b)] = b
    allocs = sorted([(table_at, 96)] + [(a, len(b)) for a, b in blocks.items()])
    image = HeapImage(array("Q", [a for a, _ in allocs]), array("Q", [n for _, n in allocs]),
                      [(HEAP, heap)])
    maps = [Mapping(HEAP, HEAP + len(heap), "rw-p", 0, "00:00", 0, "[heap]"),
            Mapping(CODE, CODE + 0x1000, "r-xp", 0, "fe:00", 7,
                    "/usr/lib/x86_64-linux-gnu/libglib-2.0.so.0.7400.6" if glib else "/x.so")]
    return image, maps, BufferMemory({HEAP: bytes(heap)})


def test_a_reachable_table_s_32_bit_keys_and_values_are_references():
    keys, hashes, values = HEAP + 0x1000, HEAP + 0x2000, HEAP + 0x3000
    strings = [HEAP + 0x4000 + 0x40 * k for k in range(5)]
    # slots: 0 unused, 1 a removed entry (hash 1), 2-4 in use; 16 slots
    hs = [0, 1, 0x1234, 2, 0xffffffff] + [0] * 11
    ks = [0, strings[0], strings[1], strings[2], strings[3]] + [0] * 11
    vs = [0, 0, strings[4], 0, strings[4]] + [0] * 11
    blocks = {keys: struct.pack("<16I", *ks), hashes: struct.pack("<16I", *hs),
              values: struct.pack("<16I", *vs)}
    blocks.update({s: b"text\0".ljust(24, b"\0") for s in strings})
    image, maps, mem = _process(HEAP + 0x100, header(keys=keys, hashes=hashes, values=values),
                                blocks)
    (t,) = G.find(image, maps)
    assert (t.address, t.size, t.keys, t.hashes, t.values, t.big_keys, t.big_values) == \
        (HEAP + 0x100, 16, keys, hashes, values, False, False)
    idx = {a: i for i, a in enumerate(image.begins)}
    marked = bytearray(len(image.begins))
    assert G.references([t], image, marked, mem) == []           # not reached: nothing
    marked[idx[keys]] = marked[idx[hashes]] = 1
    # keys of slots 2-4 and their values (slot 3's value 0: none); slot 1 removed (strings[0]
    # only there)
    assert G.references([t], image, marked, mem) == [strings[1], strings[2], strings[3],
                                                      strings[4]]
    # big values (pointers): only the keys' 32-bit entries
    big_v = header(keys=keys, hashes=hashes, values=values, big=2)
    image, maps, mem = _process(HEAP + 0x100, big_v, {**blocks, values: bytes(128)})
    (t,) = G.find(image, maps)
    assert G.references([t], image, marked, mem) == [strings[1], strings[2], strings[3]]


def test_what_is_no_table():
    keys, hashes = HEAP + 0x1000, HEAP + 0x2000
    blocks = {keys: bytes(64), hashes: bytes(64)}
    hdr = header(keys=keys, hashes=hashes)
    assert G.find(*_process(HEAP + 0x100, hdr, blocks)[:2])
    # no GLib loaded; the hash function outside code; arrays too small for size entries or not
    # at an allocation's start; both arrays big (nothing to read); the heap above 4 GiB
    assert G.find(*_process(HEAP + 0x100, hdr, blocks, glib=False)[:2]) == []
    assert G.find(*_process(HEAP + 0x100, header(keys=keys, hashes=hashes, fn=HEAP),
                            blocks)[:2]) == []
    assert G.find(*_process(HEAP + 0x100, hdr, {keys: bytes(60), hashes: bytes(64)})[:2]) == []
    assert G.find(*_process(HEAP + 0x100, header(keys=keys + 8, hashes=hashes),
                            blocks)[:2]) == []
    assert G.find(*_process(HEAP + 0x100, header(keys=keys, hashes=hashes, big=1),
                            {keys: bytes(128), hashes: bytes(64)})[:2]) == []
    image, maps, _ = _process(HEAP + 0x100, hdr, blocks)
    high = HeapImage(array("Q", [b + (1 << 40) for b in image.begins]), image.sizes,
                     [(HEAP + (1 << 40), image.regions[0][1])])
    assert G.find(high, maps) == []


def _map(begin, end, perms="rw-p", inode=0, path=""):
    return Mapping(begin, end, perms, 0, "00:00", inode, path)


def test_a_glib_process_with_heap_below_4_gib_keeps_its_copies():
    # wanted(): the sweep walks such a heap with copies whatever its size (find reads them)
    glib = _map(CODE, CODE + 0x1000, "r-xp", 42, "/usr/lib/x86_64-linux-gnu/libglib-2.0.so.0.8400.0")
    high_heap = _map(0x5555_5555_0000, 0x5555_5600_0000, path="[heap]")
    assert G.wanted([glib, _map(HEAP, HEAP + 0x10000, path="[heap]")])      # non-PIE brk heap
    assert G.wanted([glib, high_heap, _map(0x4000_0000, 0x4010_0000)])      # anonymous, low
    assert not G.wanted([glib, high_heap])                                  # PIE: all above
    assert not G.wanted([_map(HEAP, HEAP + 0x10000, path="[heap]")])        # no GLib
    for other in (_map(0x40_0000, 0x41_0000, "rw-p", 7, "/usr/bin/prog"),   # a file's data
                  _map(0x4000_0000, 0x4010_0000, "rw-s"),                   # shared
                  _map(0x4000_0000, 0x4010_0000, "r--p"),                   # not writable
                  _map(0x4000_0000, 0x4010_0000, path="[stack]")):
        assert not G.wanted([glib, high_heap, other]), other.perms + other.path
