"""Stage 4 (allocations): glibc malloc struct layouts as data (x86_64, LP64).

One frozen class (_types.FrozenFields) per layout family; each cites the glibc releases and
the struct it mirrors (glibc malloc/malloc.c, malloc/arena.c; glibc-heap.md sections 3-10).
Families are selected by structural probes in locate.py / walker.py; the "release version"
string of libc is only a hint. No offset literal may appear outside this module (style.md rule 7).
"""
from __future__ import annotations

from typing import Optional, Tuple

from memunreachable._types import FrozenFields, set_fields

# --- chunk format: identical in glibc 2.26-2.43 on x86_64 (malloc.c "struct malloc_chunk");
# only mmapped chunks changed, in 2.43 (MmapChunk below) ---
SIZE_SZ = 8
CHUNK_HDR = 16                  # prev_size + size; user pointer = chunk + CHUNK_HDR
MINSIZE = 0x20
PREV_INUSE = 1
IS_MMAPPED = 2
NON_MAIN_ARENA = 4
SIZE_FLAGS = 7
ARENA_USABLE_DELTA = SIZE_SZ    # usable = chunksize - 8 for an arena chunk
FASTBIN_LINK_BIAS = CHUNK_HDR   # fastbin fd values are chunk pointers: node = value + 16
TCACHE_LINK_BIAS = 0            # tcache next values are user pointers
PAGE = 4096
HEAP_MAX_DEFAULT = 2 * 32 * 1024 * 1024   # 2 * DEFAULT_MMAP_THRESHOLD_MAX on LP64 (arena.c)
MAIN_ARENA_CANDIDATE_STEP = 8


def chunksize(size_word: int) -> int:
    return size_word & ~SIZE_FLAGS


class MallocState(FrozenFields):
    """struct malloc_state (glibc 2.27-2.42: `have_fastchunks` added in 2.27; 2.43: fastbins
    removed, `fastbins` None and `nfastbins` 0)."""
    __slots__ = ("name", "sizeof", "mutex", "flags", "fastbins", "nfastbins", "top",
                 "last_remainder", "bins", "nbins", "next", "next_free", "attached_threads",
                 "system_mem", "noncontiguous_bit")

    def __init__(self,
                 name: str, sizeof: int, mutex: int, flags: int, fastbins: Optional[int],
                 nfastbins: int,
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
    name="malloc_state 2.27-2.42", sizeof=0x898, mutex=0x0, flags=0x4, fastbins=0x10, nfastbins=10,
    top=0x60, last_remainder=0x68, bins=0x70, nbins=128, next=0x870, next_free=0x878,
    attached_threads=0x880, system_mem=0x888, noncontiguous_bit=2)
# 2.43 removed fastbins (glibc commit bb5a4f5295 "malloc: Remove fastbin infrastructure"):
# no have_fastchunks, no fastbinsY[10]; every later field 0x58 lower. Offsets from Debian
# 2.43-7's DWARF (libc6-dbg, `ptype /o struct malloc_state`): top 8, bins 24, next 2072,
# attached_threads 2088, system_mem 2096, sizeof 2112.
MALLOC_STATE_243 = MallocState(
    name="malloc_state 2.43+", sizeof=0x840, mutex=0x0, flags=0x4, fastbins=None, nfastbins=0,
    top=0x8, last_remainder=0x10, bins=0x18, nbins=128, next=0x818, next_free=0x820,
    attached_threads=0x828, system_mem=0x830, noncontiguous_bit=2)
MALLOC_STATES: Tuple[MallocState, ...] = (MALLOC_STATE_227, MALLOC_STATE_243)


class MmapChunk(FrozenFields):
    """How an mmapped chunk sits in its mapping (malloc.c sysmalloc_mmap, munmap_chunk).
    Mapping = [chunk - offset, chunk + size + tail); usable = size - usable_delta; prev_size
    holds the offset, ORed with the flag bits in prev_flags (2.43: MMAP_HP, a hugetlb mapping).
    mremap_overcount: the bytes each mremap_chunk (a realloc that changes an mmapped chunk's page
    count) adds to mp_.mmapped_mem beyond the mapping's real change, for good: munmap_chunk
    subtracts the real size, so mp_ counts Σ mappings + k * mremap_overcount for the k such
    reallocs in the process's life, live chunks or not."""
    __slots__ = ("name", "tail", "usable_delta", "prev_flags", "mremap_overcount")

    def __init__(self, name: str, tail: int, usable_delta: int, prev_flags: int,
                 mremap_overcount: int = 0):
        set_fields(self, name, tail, usable_delta, prev_flags, mremap_overcount)


# <= 2.42: size = the whole mapping less the offset; usable = size - 16 (no next header).
MMAP_CHUNK_227 = MmapChunk("mmapped chunk 2.26-2.42", tail=0, usable_delta=CHUNK_HDR, prev_flags=0)
# 2.43 (glibc commit 614cfd0f8a "malloc: Change mmap chunk layout"): a normal chunk's layout,
# CHUNK_HDR_SZ kept after it (size = mapping - offset - 16, usable = size - 8), so a freed
# mmapped chunk may sit in a large tcache bin; prev_size bit 0 (MMAP_HP) marks MAP_HUGETLB.
# That commit made the mapping offset + size + CHUNK_HDR_SZ (mmap_size) but left mremap_chunk's
# update `mp_.mmapped_mem += new_size - size - offset` as it was, which is the real change
# (new_size - mmap_size) + CHUNK_HDR_SZ; munmap_chunk subtracts mmap_size. Measured on Debian
# 2.43-7: malloc(1 MiB), realloc to 3 MiB, to 2 MiB, to 2 MiB - 100 (one page less), free:
# hblkhd 1052672, 3149840 (mapping 3149824), 2101280, 2097200, and 48 with no chunk left.
MMAP_CHUNK_243 = MmapChunk("mmapped chunk 2.43+", tail=CHUNK_HDR, usable_delta=SIZE_SZ,
                           prev_flags=1, mremap_overcount=CHUNK_HDR)


class MallocPar(FrozenFields):
    """struct malloc_par mp_ (int fields are 4 bytes, the rest 8), with what goes with each
    mp_ family: the heap_info size, how HEAP_MAX follows hp_pagesize, the mmapped chunk format,
    the tcache layouts, the malloc_state family, and the static initial values of the
    tcache fields (the file-image probe of locate.py)."""
    __slots__ = ("name", "sizeof", "trim_threshold", "top_pad", "mmap_threshold", "arena_test",
                 "arena_max", "hp_pagesize", "n_mmaps", "n_mmaps_max", "max_n_mmaps",
                 "mmapped_mem", "sbrk_base", "tcache_bins", "tcache_max_bytes", "tcache_count",
                 "heap_info", "thp_mode", "heap_max_from_hp", "mmap_chunk", "tcaches", "state",
                 "init_tcache_max_bytes", "init_tcache_count", "max_bytes_kind")

    def __init__(self,
                 name: str, sizeof: int, trim_threshold: int, top_pad: int, mmap_threshold: int,
                 arena_test: int, arena_max: int, hp_pagesize: Optional[int], n_mmaps: int,
                 n_mmaps_max: int, max_n_mmaps: int, mmapped_mem: int, sbrk_base: int,
                 # tcache_bins: `tcache_bins` (<= 2.41), `tcache_small_bins` (2.42+)
                 tcache_bins: int, tcache_max_bytes: int, tcache_count: int,
                 heap_info: "HeapInfo",
                 thp_mode: Optional[int],           # enum malloc_thp_mode_t (2.43+)
                 heap_max_from_hp: bool,            # 2.35-2.42: HEAP_MAX = 4 * hp_pagesize if set
                 mmap_chunk: MmapChunk,
                 tcaches: Tuple["Tcache", ...],     # struct layouts to look for
                 state: MallocState,
                 init_tcache_max_bytes: int,        # mp_'s static initial values (malloc.c)
                 init_tcache_count: int,
                 # what tcache_max_bytes counts: MAX_BYTES_USABLE (<= 2.41, a usable size),
                 # MAX_BYTES_CHUNK (2.42, a chunk size, exclusive), MAX_BYTES_CHUNK_1 (2.43+,
                 # the largest chunk size cached + 1)
                 max_bytes_kind: str):
        set_fields(self,
                   name, sizeof, trim_threshold, top_pad, mmap_threshold, arena_test, arena_max,
                   hp_pagesize, n_mmaps, n_mmaps_max, max_n_mmaps, mmapped_mem, sbrk_base,
                   tcache_bins, tcache_max_bytes, tcache_count, heap_info, thp_mode,
                   heap_max_from_hp, mmap_chunk, tcaches, state, init_tcache_max_bytes,
                   init_tcache_count, max_bytes_kind)

    def tcache_max_plausible(self, bins: int, max_bytes: int) -> bool:
        """tcache_max_bytes agrees with the small bins in use (defaults or a tcache_max tunable:
        do_set_tcache_max sets both)."""
        if not 0 < bins <= TCACHE_SMALL_BINS:
            return False
        top = MINSIZE + 2 * SIZE_SZ * (bins - 1)            # chunk size of the last small bin
        if self.max_bytes_kind == MAX_BYTES_USABLE:
            return max_bytes == top - SIZE_SZ
        nb = max_bytes - (self.max_bytes_kind == MAX_BYTES_CHUNK_1)   # request2size(value)
        if nb % (2 * SIZE_SZ):
            return False
        if nb <= TCACHE_SMALL_MAX_CHUNK:        # tcache_small_bins = csize2tidx(nb) + 1
            return nb == top
        return bins == TCACHE_SMALL_BINS and nb <= TCACHE_LARGE_MAX_CHUNK


MAX_BYTES_USABLE = "usable"
MAX_BYTES_CHUNK = "chunk"
MAX_BYTES_CHUNK_1 = "chunk+1"
TCACHE_SMALL_BINS = 64                       # TCACHE_SMALL_BINS (TCACHE_MAX_BINS <= 2.41)
TCACHE_SMALL_MAX_CHUNK = MINSIZE + 2 * SIZE_SZ * (TCACHE_SMALL_BINS - 1)     # 0x410
TCACHE_LARGE_MAX_CHUNK = (4 << 20) - 2 * SIZE_SZ     # 2.42+: large bin 75 holds < 4 MiB


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



class Tcache(FrozenFields):
    """tcache_perthread_struct and tcache_entry (malloc.c)."""
    __slots__ = ("name", "count_width", "entries", "nbins", "chunk_size", "key", "small_bins",
                 "remaining")

    def __init__(self, name: str,
                 count_width: int,     # bytes per counts[] element
                 entries: int,         # offset of entries[]
                 nbins: int,           # TCACHE_MAX_BINS
                 chunk_size: int,      # chunk size of the struct's allocation
                 key: Optional[int],   # offset of tcache_entry.key (2.29+), None before
                 # bins of one chunk size each; the others (2.42+: 12 large bins) hold a
                 # range of sizes, their chains sorted by ascending size
                 small_bins: int,
                 # the counts are num_slots (2.42+): the room left, tcache_count - entries
                 remaining: bool):
        set_fields(self, name, count_width, entries, nbins, chunk_size, key, small_bins, remaining)

    def bin_chunk_size(self, i: int) -> int:
        """The (smallest) chunk size bin i holds."""
        return self.bin_size_range(i)[0]

    def bin_size_range(self, i: int) -> Tuple[int, int]:
        """(smallest, largest) chunk size bin i holds. 2.42+ large bin i (64-75) holds the
        chunks with large_csize2tidx(size) == i, i.e. 64 + clz32(0x410) - clz32(size): sizes
        [2^(i-54), 2^(i-53)), the first from 0x420."""
        if i < self.small_bins:
            size = MINSIZE + 2 * SIZE_SZ * i
            return size, size
        bit = i - self.small_bins + (TCACHE_SMALL_MAX_CHUNK.bit_length() - 1)
        lo = max(1 << bit, TCACHE_SMALL_MAX_CHUNK + 2 * SIZE_SZ)
        return lo, (1 << (bit + 1)) - 2 * SIZE_SZ

    def entry_count(self, stored: int, max_count: int) -> Optional[int]:
        """Chunks bin holds from its counts[] value (None: impossible, num_slots above max)."""
        if not self.remaining:
            return stored
        return max_count - stored if stored <= max_count else None


# What tcache_entry.key holds in a free tcache chunk (glibc-heap.md 10.1), and since when.
KEY_NONE = "none"               # 2.26-2.28: no key field
KEY_SELF = "self"               # 2.29-2.33: the owning tcache_perthread_struct's address
KEY_GLOBAL = "tcache_key"       # 2.34+: one random word per process, in libc's .bss
SAFE_LINKING_FROM = (2, 32)     # tcache next / fastbin fd mangled with (field address >> 12)
U16_COUNTS_FROM = (2, 30)
TCACHE_76_FROM = (2, 42)
# A tcache struct taken whole from a free chunk 16 bytes larger (the rest below MINSIZE):
# 0x310 for 2.42+'s 0x300, seen in a static 2.43 program (its tcache comes at the first free)
TCACHE_STRUCT_SLACK = MINSIZE - CHUNK_HDR
TLS_TCACHE_WINDOW = 0x10000     # bytes below fs_base searched for a thread's `tcache` pointer


def tcache_key_kind(version: Tuple[int, int]) -> str:
    if version >= (2, 34):
        return KEY_GLOBAL
    return KEY_SELF if version >= (2, 29) else KEY_NONE


TCACHE_U8 = Tcache("tcache 2.26-2.29 (uint8 counts)", 1, 0x40, 64, 0x250, key=8, small_bins=64,
                   remaining=False)
TCACHE_U16 = Tcache("tcache 2.30-2.41 (uint16 counts)", 2, 0x80, 64, 0x290, key=8, small_bins=64,
                    remaining=False)
# 2.42 (glibc commits 7e10e30e64 "Count tcache entries downwards", cbfd798810 "add tcache
# support for large chunk caching"): uint16_t num_slots[76] (room left: tcache_init sets each
# to mp_.tcache_count, tcache_put decrements), entries[76] at 152; struct 760 bytes (chunk 0x300).
# Checked in Debian 2.43-7's DWARF (`ptype /o struct tcache_perthread_struct`).
TCACHE_76 = Tcache("tcache 2.42+ (uint16 num_slots, 76 bins)", 2, 0x98, 76, 0x300, key=8,
                   small_bins=64, remaining=True)
TCACHES: Tuple[Tcache, ...] = (TCACHE_U16, TCACHE_U8)

# Static initial values of mp_ (malloc.c), seen in the file image before tunables apply.
MP_INIT_THRESHOLD = 0x20000       # trim_threshold and mmap_threshold (DEFAULT_*_THRESHOLD)
MP_INIT_ARENA_TEST = 8            # NARENAS_FROM_NCORES(1) on LP64
MP_INIT_N_MMAPS_MAX = 65536       # DEFAULT_MMAP_MAX
MP_INIT_TCACHE_BINS = 64
MP_INIT_THP_MODE = 3              # malloc_thp_mode_not_supported (2.43+)
MP_INIT_TCACHE_COUNT_243 = 16     # TCACHE_FILL_COUNT from 2.43 (7 before)
MP_MAX_MMAP_THRESHOLD = 32 * 1024 * 1024

MP_227 = MallocPar(
    name="malloc_par 2.26-2.34", sizeof=0x70, trim_threshold=0x0, top_pad=0x8, mmap_threshold=0x10,
    arena_test=0x18, arena_max=0x20, hp_pagesize=None, n_mmaps=0x28, n_mmaps_max=0x2c,
    max_n_mmaps=0x30, mmapped_mem=0x38, sbrk_base=0x48, tcache_bins=0x50, tcache_max_bytes=0x58,
    tcache_count=0x60, heap_info=HEAP_INFO_32, thp_mode=None, heap_max_from_hp=False,
    mmap_chunk=MMAP_CHUNK_227, tcaches=TCACHES, state=MALLOC_STATE_227,
    init_tcache_max_bytes=1032, init_tcache_count=7, max_bytes_kind=MAX_BYTES_USABLE)
MP_235 = MallocPar(
    name="malloc_par 2.35-2.41", sizeof=0x88, trim_threshold=0x0, top_pad=0x8, mmap_threshold=0x10,
    arena_test=0x18, arena_max=0x20, hp_pagesize=0x30, n_mmaps=0x3c, n_mmaps_max=0x40,
    max_n_mmaps=0x44, mmapped_mem=0x50, sbrk_base=0x60, tcache_bins=0x68, tcache_max_bytes=0x70,
    tcache_count=0x78, heap_info=HEAP_INFO_48, thp_mode=None, heap_max_from_hp=True,
    mmap_chunk=MMAP_CHUNK_227, tcaches=(TCACHE_U16,), state=MALLOC_STATE_227,
    init_tcache_max_bytes=1032, init_tcache_count=7, max_bytes_kind=MAX_BYTES_USABLE)
# 2.42: the 2.35 offsets (`tcache_bins` renamed `tcache_small_bins`); tcache_max_bytes is a
# chunk size now, MAX_TCACHE_SMALL_SIZE = 0x410 (malloc.c of glibc-2.42); the 76-bin tcache.
MP_242 = MP_235._replace(name="malloc_par 2.42", tcaches=(TCACHE_76,),
                         init_tcache_max_bytes=0x410, max_bytes_kind=MAX_BYTES_CHUNK)
# 2.43: `enum malloc_thp_mode_t thp_mode` (4 bytes + hole) after arena_max moves every later
# field 8 up; sizeof 144 (Debian 2.43-7's DWARF, `ptype /o struct malloc_par`). Its file
# image (checked): thp_mode 3, n_mmaps_max 65536 at 0x48, tcache_small_bins 64 at 0x70,
# tcache_max_bytes 0x411 (MAX_TCACHE_SMALL_SIZE + 1) at 0x78, tcache_count 16 at 0x80 (glibc
# commit 0b9210bd76 "set default tcache fill count to 16"). HEAP_MAX no longer follows
# hp_pagesize (arena.c heap_max_size() == HEAP_MAX_SIZE); no fastbins; mmapped chunks 2.43.
MP_243 = MallocPar(
    name="malloc_par 2.43+", sizeof=0x90, trim_threshold=0x0, top_pad=0x8, mmap_threshold=0x10,
    arena_test=0x18, arena_max=0x20, hp_pagesize=0x38, n_mmaps=0x44, n_mmaps_max=0x48,
    max_n_mmaps=0x4c, mmapped_mem=0x58, sbrk_base=0x68, tcache_bins=0x70, tcache_max_bytes=0x78,
    tcache_count=0x80, heap_info=HEAP_INFO_48, thp_mode=0x28, heap_max_from_hp=False,
    mmap_chunk=MMAP_CHUNK_243, tcaches=(TCACHE_76,), state=MALLOC_STATE_243,
    init_tcache_max_bytes=0x411, init_tcache_count=MP_INIT_TCACHE_COUNT_243,
    max_bytes_kind=MAX_BYTES_CHUNK_1)
MALLOC_PARS: Tuple[MallocPar, ...] = (MP_243, MP_242, MP_235, MP_227)

# main_arena's file image: only `next` (== &main_arena) and attached_threads (== 1) are non-zero.
MAIN_ARENA_IMAGE_ATTACHED = 1
# Method B (memory scan): this many consecutive plausible bin slots identify malloc_state.bins.
BIN_RUN_MIN = 120
ARENA_RING_PROBE = 4096         # arenas followed from a candidate before giving up on its ring

VERSION_KEY = b"release version 2."
MIN_MINOR = 27
MAX_MINOR = 43


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
    for since, par in (((2, 43), MP_243), ((2, 42), MP_242), ((2, 35), MP_235)):
        if v >= since:
            return par
    return MP_227
