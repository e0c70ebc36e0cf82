"""Stage 4 (allocations): glibc malloc struct layouts as data (x86_64, LP64).

One frozen class (_types.FrozenFields) per layout family; each cites the glibc releases and
the struct it mirrors (glibc malloc/malloc.c, malloc/arena.c; glibc-heap.md sections 3-10).
Families are selected by structural probes in locate.py / walker.py; the "release version"
string of libc is only a hint. No offset literal may appear outside this module (style.md rule 7).
"""
from __future__ import annotations

from typing import Optional, Tuple

from memunreachable._types import FrozenFields, set_fields

# --- chunk format: identical in glibc 2.26-2.42 on x86_64 (malloc.c "struct malloc_chunk") ---
SIZE_SZ = 8
CHUNK_HDR = 16                  # prev_size + size; user pointer = chunk + CHUNK_HDR
MINSIZE = 0x20
PREV_INUSE = 1
IS_MMAPPED = 2
NON_MAIN_ARENA = 4
SIZE_FLAGS = 7
ARENA_USABLE_DELTA = SIZE_SZ    # usable = chunksize - 8 for an arena chunk
MMAP_USABLE_DELTA = CHUNK_HDR   # usable = chunksize - 16 for an mmapped chunk
FASTBIN_LINK_BIAS = CHUNK_HDR   # fastbin fd values are chunk pointers: node = value + 16
TCACHE_LINK_BIAS = 0            # tcache next values are user pointers
PAGE = 4096
HEAP_MAX_DEFAULT = 2 * 32 * 1024 * 1024   # 2 * DEFAULT_MMAP_THRESHOLD_MAX on LP64 (arena.c)
MAIN_ARENA_CANDIDATE_STEP = 8


def chunksize(size_word: int) -> int:
    return size_word & ~SIZE_FLAGS


class MallocState(FrozenFields):
    """struct malloc_state (glibc 2.27-2.42; `have_fastchunks` added in 2.27)."""
    __slots__ = ("name", "sizeof", "mutex", "flags", "fastbins", "nfastbins", "top",
                 "last_remainder", "bins", "nbins", "next", "next_free", "attached_threads",
                 "system_mem", "noncontiguous_bit")

    def __init__(self,
                 name: str, sizeof: int, mutex: int, flags: int, fastbins: int, nfastbins: int,
                 top: int, last_remainder: int, bins: int,
                 # NBINS: bins 1..nbins-1 exist (1 unsorted, 2-63 small, 64-126 large)
                 nbins: int, next: int, next_free: int, attached_threads: int, system_mem: int,
                 noncontiguous_bit: int):  # flags & 2: NONCONTIGUOUS_BIT
        set_fields(self,
                   name, sizeof, mutex, flags, fastbins, nfastbins, top, last_remainder, bins,
                   nbins, next, next_free, attached_threads, system_mem, noncontiguous_bit)

    def bin_chunk(self, arena: int, i: int) -> int:
        """Address of bin i's fake chunk (bin_at(av, i)): its fd is at +16, bk at +24."""
        return arena + self.bins + 2 * SIZE_SZ * (i - 1) - CHUNK_HDR

    def initial_top(self, arena: int) -> int:
        """`top` of an arena that never obtained memory (initial_top(av) == unsorted_chunks(av))."""
        return self.bin_chunk(arena, 1)


MALLOC_STATE_227 = MallocState(
    name="malloc_state 2.27+", sizeof=0x898, mutex=0x0, flags=0x4, fastbins=0x10, nfastbins=10,
    top=0x60, last_remainder=0x68, bins=0x70, nbins=128, next=0x870, next_free=0x878,
    attached_threads=0x880, system_mem=0x888, noncontiguous_bit=2)


class MallocPar(FrozenFields):
    """struct malloc_par mp_ (int fields are 4 bytes, the rest 8)."""
    __slots__ = ("name", "sizeof", "trim_threshold", "top_pad", "mmap_threshold", "arena_test",
                 "arena_max", "hp_pagesize", "n_mmaps", "n_mmaps_max", "max_n_mmaps",
                 "mmapped_mem", "sbrk_base", "tcache_bins", "tcache_max_bytes", "tcache_count",
                 "heap_info")

    def __init__(self,
                 name: str, sizeof: int, trim_threshold: int, top_pad: int, mmap_threshold: int,
                 arena_test: int, arena_max: int, hp_pagesize: Optional[int], n_mmaps: int,
                 n_mmaps_max: int, max_n_mmaps: int, mmapped_mem: int, sbrk_base: int,
                 tcache_bins: int, tcache_max_bytes: int, tcache_count: int,
                 heap_info: "HeapInfo"):
        set_fields(self,
                   name, sizeof, trim_threshold, top_pad, mmap_threshold, arena_test, arena_max,
                   hp_pagesize, n_mmaps, n_mmaps_max, max_n_mmaps, mmapped_mem, sbrk_base,
                   tcache_bins, tcache_max_bytes, tcache_count, heap_info)


class HeapInfo(FrozenFields):
    """arena.c `heap_info`: 32 bytes up to 2.34, 48 from 2.35 (`pagesize` + padding)."""
    __slots__ = ("name", "sizeof", "ar_ptr", "prev", "size", "mprotect_size")

    def __init__(self,
                 name: str, sizeof: int, ar_ptr: int, prev: int, size: int, mprotect_size: int):
        set_fields(self, name, sizeof, ar_ptr, prev, size, mprotect_size)

    def first_chunk(self, heap: int, state: MallocState, first_heap: bool) -> int:
        """First chunk header of a heap: after heap_info (+ malloc_state in the first heap),
        moved so that the user pointer is 16-aligned."""
        start = heap + self.sizeof + (state.sizeof if first_heap else 0)
        return (start + CHUNK_HDR - 1) & ~(CHUNK_HDR - 1)


HEAP_INFO_32 = HeapInfo("heap_info 2.26-2.34", 32, ar_ptr=0x0, prev=0x8, size=0x10, mprotect_size=0x18)
HEAP_INFO_48 = HeapInfo("heap_info 2.35+", 48, ar_ptr=0x0, prev=0x8, size=0x10, mprotect_size=0x18)

MP_227 = MallocPar(
    name="malloc_par 2.26-2.34", sizeof=0x70, trim_threshold=0x0, top_pad=0x8, mmap_threshold=0x10,
    arena_test=0x18, arena_max=0x20, hp_pagesize=None, n_mmaps=0x28, n_mmaps_max=0x2c,
    max_n_mmaps=0x30, mmapped_mem=0x38, sbrk_base=0x48, tcache_bins=0x50, tcache_max_bytes=0x58,
    tcache_count=0x60, heap_info=HEAP_INFO_32)
MP_235 = MallocPar(
    name="malloc_par 2.35-2.41", sizeof=0x88, trim_threshold=0x0, top_pad=0x8, mmap_threshold=0x10,
    arena_test=0x18, arena_max=0x20, hp_pagesize=0x30, n_mmaps=0x3c, n_mmaps_max=0x40,
    max_n_mmaps=0x44, mmapped_mem=0x50, sbrk_base=0x60, tcache_bins=0x68, tcache_max_bytes=0x70,
    tcache_count=0x78, heap_info=HEAP_INFO_48)
MALLOC_PARS: Tuple[MallocPar, ...] = (MP_235, MP_227)

# Static initial values of mp_ (malloc.c), seen in the file image before tunables apply.
MP_INIT_THRESHOLD = 0x20000       # trim_threshold and mmap_threshold (DEFAULT_*_THRESHOLD)
MP_INIT_ARENA_TEST = 8            # NARENAS_FROM_NCORES(1) on LP64
MP_INIT_N_MMAPS_MAX = 65536       # DEFAULT_MMAP_MAX
MP_INIT_TCACHE_BINS = 64
MP_INIT_TCACHE_MAX_BYTES = 1032
MP_INIT_TCACHE_COUNT = 7
MP_MAX_MMAP_THRESHOLD = 32 * 1024 * 1024


class Tcache(FrozenFields):
    """tcache_perthread_struct and tcache_entry (malloc.c)."""
    __slots__ = ("name", "count_width", "entries", "nbins", "chunk_size", "key")

    def __init__(self, name: str,
                 count_width: int,     # bytes per counts[] element
                 entries: int,         # offset of entries[]
                 nbins: int,           # TCACHE_MAX_BINS
                 chunk_size: int,      # chunk size of the struct's allocation
                 key: Optional[int]):  # offset of tcache_entry.key (2.29+), None before
        set_fields(self, name, count_width, entries, nbins, chunk_size, key)

    def bin_chunk_size(self, i: int) -> int:
        return MINSIZE + 2 * SIZE_SZ * i


# What tcache_entry.key holds in a free tcache chunk (glibc-heap.md 10.1), and since when.
KEY_NONE = "none"               # 2.26-2.28: no key field
KEY_SELF = "self"               # 2.29-2.33: the owning tcache_perthread_struct's address
KEY_GLOBAL = "tcache_key"       # 2.34+: one random word per process, in libc's .bss
SAFE_LINKING_FROM = (2, 32)     # tcache next / fastbin fd mangled with (field address >> 12)
U16_COUNTS_FROM = (2, 30)
TLS_TCACHE_WINDOW = 0x10000     # bytes below fs_base searched for a thread's `tcache` pointer


def tcache_key_kind(version: Tuple[int, int]) -> str:
    if version >= (2, 34):
        return KEY_GLOBAL
    return KEY_SELF if version >= (2, 29) else KEY_NONE


TCACHE_U8 = Tcache("tcache 2.26-2.29 (uint8 counts)", 1, 0x40, 64, 0x250, key=8)
TCACHE_U16 = Tcache("tcache 2.30-2.41 (uint16 counts)", 2, 0x80, 64, 0x290, key=8)
TCACHES: Tuple[Tcache, ...] = (TCACHE_U16, TCACHE_U8)

# main_arena's file image: only `next` (== &main_arena) and attached_threads (== 1) are non-zero.
MAIN_ARENA_IMAGE_ATTACHED = 1
# Method B (memory scan): this many consecutive plausible bin slots identify malloc_state.bins.
BIN_RUN_MIN = 120

VERSION_KEY = b"release version 2."
MIN_MINOR = 27
MAX_MINOR = 41


class Layout(FrozenFields):
    """The families that describe one target."""
    __slots__ = ("state", "par")

    def __init__(self, state: MallocState, par: MallocPar):
        set_fields(self, state, par)

    @property
    def heap_info(self) -> HeapInfo:
        return self.par.heap_info


def version_tuple(version: Optional[str]) -> Optional[Tuple[int, int]]:
    if not version:
        return None
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def find_version(data: bytes) -> Optional[str]:
    """The "release version 2.NN" string of a libc image, as "2.NN" (a hint only)."""
    # bytes.find, not a regex: 0.3 ms instead of 1.1 ms over libc's 2 MB, no compile (issue 10)
    pos = data.find(VERSION_KEY)
    while pos >= 0:
        start = end = pos + len(VERSION_KEY)
        while end < len(data) and 0x30 <= data[end] <= 0x39:       # ASCII digits
            end += 1
        if end > start:
            return f"2.{int(data[start:end])}"
        pos = data.find(VERSION_KEY, pos + 1)
    return None


def par_hint(version: Optional[str]) -> Optional[MallocPar]:
    """mp_ family the version suggests (the structural probe decides)."""
    v = version_tuple(version)
    if v is None:
        return None
    return MP_235 if v >= (2, 35) else MP_227
