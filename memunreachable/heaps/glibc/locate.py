"""Stage 4 (allocations): find main_arena and mp_ without symbols (glibc-heap.md section 5).

Input: the object holding glibc malloc (libc.so.6, or a static executable), its mappings, the
target's memory. Output: a Located record (addresses, layout families, version hint, method).
Method A reads the object's file image (through /proc/PID/map_files/<start>-<end>, which works
even when the file was replaced on disk) and finds the statically initialised main_arena and
mp_ in the RW PT_LOAD. Method B scans the object's writable memory for malloc_state's run of
bin slots (vmware/chap's method). References: glibc malloc/malloc.c, malloc/arena.c; elf(5).
"""
from __future__ import annotations

import mmap
import struct
from typing import Iterator, List, Optional, Tuple

from memunreachable.stacks import elf as E
from memunreachable._errors import MemoryUnreadable
from memunreachable.collect import procfs
from memunreachable._types import FrozenFields, Mapping, set_fields
from memunreachable.heaps.glibc import layout as L

R_X86_64_RELATIVE = 8


class Located(FrozenFields):
    __slots__ = ("main_arena", "mp", "layout", "version", "method", "object_path")

    def __init__(self, main_arena: int, mp: int, layout: L.Layout,
                 # "2.36" when libc carries the string (static builds do not)
                 version: Optional[str],
                 method: str,   # "file" or "memory"
                 object_path: str):
        set_fields(self, main_arena, mp, layout, version, method, object_path)


class _Image(FrozenFields):
    """What method A needs from the ELF file."""
    __slots__ = ("bias", "rw", "relative", "version")

    def __init__(self, bias: int,
                 rw: List[Tuple[int, bytes]],   # (p_vaddr, file bytes) of each writable PT_LOAD
                 # r_offset -> addend of R_X86_64_RELATIVE (RELA builds)
                 relative: dict, version: Optional[str]):
        set_fields(self, bias, rw, relative, version)


def _load_bias(first_load: Tuple[int, int], mappings: List[Mapping]) -> Optional[int]:
    """Runtime address minus link-time address, from the mapping of the first PT_LOAD
    (first_load: its page-aligned file offset and link-time address)."""
    page_off, page_vaddr = first_load
    for m in sorted(mappings, key=lambda m: m.begin):
        if m.offset == page_off:
            return m.begin - page_vaddr
    return None


class _FileFacts(FrozenFields):
    """What method A reads from the ELF file itself: independent of where it is mapped."""
    __slots__ = ("first_load", "rw", "relative", "version")

    def __init__(self, first_load: Tuple[int, int], rw: List[Tuple[int, bytes]], relative: dict,
                 version: Optional[str]):
        set_fields(self, first_load, rw, relative, version)


# file identity (st_dev, st_ino, st_size, st_mtime_ns) -> _FileFacts or None (not usable).
# Parsing libc's ELF took ~120 ms with pyelftools (a few ms with elf.py); a long-lived process (the in-process
# helper, a CLI watching a target) checks the same libc again and again.
_FACTS_CACHE: dict = {}
_FACTS_CACHE_MAX = 16


def _file_facts(f) -> Optional[_FileFacts]:
    def read(elf):
        first_load = elf.first_load() if elf.machine_name == "EM_X86_64" else None
        if first_load is None:
            return None
        rw = [(s.p_vaddr, elf.data(s.p_offset, s.p_filesz)) for s in elf.segments()
              if s.p_type == E.PT_LOAD and s.p_flags & 2]
        relative = elf.rela_relative()
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:     # the whole file
            version = L.find_version(mm)
        return _FileFacts(first_load, rw, relative, version)
    return E.cached_by_file(_FACTS_CACHE, f, read, most=_FACTS_CACHE_MAX)


def read_image(mappings: List[Mapping], pid: Optional[int]) -> Optional[_Image]:
    """Parse the object's file (program headers, RELA relatives, version string); None if unreadable."""
    try:
        f = procfs.open_mapped_file(mappings, pid)
    except OSError:
        return None
    with f:
        facts = _file_facts(f)
    if facts is None:
        return None
    bias = _load_bias(facts.first_load, mappings)
    if bias is None:
        return None
    return _Image(bias, facts.rw, facts.relative, facts.version)


def _words(vaddr: int, data: bytes) -> Tuple[int, memoryview]:
    """(address of words[0], 8-byte words) of a segment, 8-aligned."""
    skip = (-vaddr) % 8
    n = (len(data) - skip) // 8
    return vaddr + skip, memoryview(data)[skip:skip + 8 * n].cast("Q")


def _iter_word(img: _Image, value: int) -> Iterator[Tuple[int, memoryview, bytes, int]]:
    """(address of words[0], words, their bytes, byte offset) of every 8-aligned word equal to
    value in the image's writable segments."""
    pat = struct.pack("<Q", value)
    for vaddr, data in img.rw:
        base, w = _words(vaddr, data)
        raw = w.tobytes()
        pos = raw.find(pat)
        while pos >= 0:
            if pos % 8 == 0:
                yield base, w, raw, pos
            pos = raw.find(pat, pos + 1)


def iter_main_arena_images(img: _Image, state: L.MallocState) -> Iterator[int]:
    """Link-time addresses a of a file-image main_arena: attached_threads == 1, next == a (in
    place, RELR builds, or as a RELATIVE addend), every other word zero."""
    nw = state.sizeof // 8
    i_next, i_att = state.next // 8, state.attached_threads // 8
    for base, w, _raw, pos in _iter_word(img, L.MAIN_ARENA_IMAGE_ATTACHED):
        j = pos // 8 - i_att
        a = base + 8 * j
        if j >= 0 and j + nw <= len(w):
            nxt = w[j + i_next]
            if nxt == a or (nxt == 0 and img.relative.get(a + state.next) == a):
                block = w[j:j + nw]
                if sum(1 for x in block if x) == (2 if nxt else 1):
                    yield a


def _i32(data, off: int) -> int:
    return struct.unpack_from("<i", data, off)[0]


def _u64(data, off: int) -> int:
    return struct.unpack_from("<Q", data, off)[0]


def iter_mp_images(img: _Image) -> Iterator[Tuple[int, L.MallocPar]]:
    """Link-time (address, family) of a file-image mp_: the static initialiser of malloc.c,
    whose tcache fields tell 2.35-2.41 (1032, 7) from 2.42 (0x410, 7) and 2.43 (0x411, 16)."""
    for base, _w, raw, pos in _iter_word(img, L.MP_INIT_THRESHOLD):
        for par in L.MALLOC_PARS:
            if pos + par.sizeof > len(raw):
                continue
            if (_u64(raw, pos + par.mmap_threshold) == L.MP_INIT_THRESHOLD and
                    _u64(raw, pos + par.arena_test) == L.MP_INIT_ARENA_TEST and
                    _i32(raw, pos + par.n_mmaps_max) == L.MP_INIT_N_MMAPS_MAX and
                    (par.thp_mode is None or
                     _i32(raw, pos + par.thp_mode) == L.MP_INIT_THP_MODE) and
                    _u64(raw, pos + par.tcache_bins) == L.MP_INIT_TCACHE_BINS and
                    _u64(raw, pos + par.tcache_max_bytes) == par.init_tcache_max_bytes and
                    _u64(raw, pos + par.tcache_count) == par.init_tcache_count):
                yield base + pos, par


def locate_in_file(mappings: List[Mapping], pid: Optional[int], path: str) -> Optional[Located]:
    """Method A. None when the image has no unique main_arena/mp_ pattern. A result found is
    kept for the same file mapped at the same addresses (the pattern search over libc's
    writable segments took ~1 ms a check of the pytest plugin's helper)."""
    key = (path, tuple([(m.begin, m.end, m.offset, m.dev, m.inode, m.path) for m in mappings]))
    hit = _LOCATED.get(key)
    if hit is not None:
        return hit
    loc = _locate_in_file(mappings, pid, path)
    if loc is not None:
        if len(_LOCATED) >= 64:
            _LOCATED.clear()
        _LOCATED[key] = loc
    return loc


_LOCATED: dict = {}     # locate_in_file's results by file identity and addresses


def _locate_in_file(mappings: List[Mapping], pid: Optional[int], path: str) -> Optional[Located]:
    img = read_image(mappings, pid)
    if img is None:
        return None
    # the malloc_state family is the one whose image pattern (next, attached_threads, zeros
    # elsewhere) occurs; mp_'s family must go with it (2.43: both changed)
    arenas = [(a, st) for st in L.MALLOC_STATES for a in iter_main_arena_images(img, st)]
    pars = [(mp, par) for mp, par in iter_mp_images(img)
            if arenas and par.state is arenas[0][1]]
    if len(arenas) != 1 or len(pars) != 1:
        return None
    (arena, state), (mp, par) = arenas[0], pars[0]
    return Located(img.bias + arena, img.bias + mp, L.Layout(state, par), img.version, "file", path)


# ---------------------------------------------------------------- method B: memory scan

def _slot_ok(mem, s: int, fd: int, bk: int) -> bool:
    """A bin slot at s (fd, bk) is empty, or a plausible list whose ends point back."""
    head = s - L.CHUNK_HDR
    if fd == head and bk == head:
        return True
    if not fd or not bk or fd % 16 or bk % 16:
        return False
    try:
        return _u64(mem.read(fd + 24, 8), 0) == head and _u64(mem.read(bk + 16, 8), 0) == head
    except (OSError, MemoryUnreadable):     # a probe: unreadable means "not a bin list"
        return False


def iter_arena_candidates(mem, regions: List[Tuple[int, bytes]], state: L.MallocState) -> Iterator[int]:
    """Addresses a where >= BIN_RUN_MIN consecutive bin slots start at a + state.bins."""
    for base, data in regions:
        _, w = _words(base, data)
        for parity in (0, 1):
            run = 0
            start = None
            for j in range(parity, len(w) - 1, 2):
                s = base + 8 * j
                if _slot_ok(mem, s, w[j], w[j + 1]):
                    if run == 0:
                        start = s
                    run += 1
                    continue
                if run >= L.BIN_RUN_MIN:
                    yield start - state.bins
                run = 0
            if run >= L.BIN_RUN_MIN:
                yield start - state.bins


def _mp_plausible(d: bytes, par: L.MallocPar, maps: List[Mapping]) -> bool:
    bins = _u64(d, par.tcache_bins)
    thr = _u64(d, par.mmap_threshold)
    n_mmaps = _i32(d, par.n_mmaps)
    max_n = _i32(d, par.max_n_mmaps)
    sbrk = _u64(d, par.sbrk_base)
    return (par.tcache_max_plausible(bins, _u64(d, par.tcache_max_bytes)) and
            L.MP_INIT_THRESHOLD <= thr <= L.MP_MAX_MMAP_THRESHOLD and 0 <= n_mmaps <= max_n and
            _u64(d, par.mmapped_mem) % L.PAGE == 0 and
            _u64(d, par.arena_test) > 0 and
            (par.thp_mode is None or 0 <= _i32(d, par.thp_mode) <= L.MP_INIT_THP_MODE) and
            (sbrk == 0 or any(m.begin <= sbrk < m.end for m in maps)))


def _ring_closes(mem, a: int, state: L.MallocState) -> bool:
    """The arena ring from a candidate main_arena a returns to a (glibc-heap.md section 5):
    tells the malloc_state families apart, whose bins start at different offsets."""
    try:
        nxt = _u64(mem.read(a + state.next, 8), 0)
        for _ in range(L.ARENA_RING_PROBE):
            if nxt == a:
                return True
            if not nxt or nxt % 16:
                return False
            nxt = _u64(mem.read(nxt + state.next, 8), 0)
    except (OSError, MemoryUnreadable):     # a probe: unreadable means "not an arena"
        return False
    return False


def locate_in_memory(mem, maps: List[Mapping], mappings: List[Mapping], path: str,
                     version: Optional[str]) -> Optional[Located]:
    """Method B over the object's rw mappings and the anonymous mapping right after them (.bss)."""
    objects = set(mappings)
    regions = [(m.begin, mem.read(m.begin, m.end - m.begin))
               for m in procfs.object_data(maps, objects.__contains__)]
    # one run of bin slots; each malloc_state family puts the arena at another offset before
    # it, and only the right one's `next` ring closes
    starts = list(dict.fromkeys(iter_arena_candidates(mem, regions, L.MALLOC_STATE_227)))
    found_arenas = []
    for st in L.MALLOC_STATES:
        shift = st.bins - L.MALLOC_STATE_227.bins
        found_arenas += [(a - shift, st) for a in starts if _ring_closes(mem, a - shift, st)]
    if len(found_arenas) != 1:
        return None
    arena, state = found_arenas[0]
    found = []
    hint = L.par_hint(version)
    pars = [par for par in L.MALLOC_PARS if par.state is state]
    for base, data in regions:
        for off in range(0, len(data) - 8, 8):
            for par in pars:
                if off + par.sizeof <= len(data) and _mp_plausible(data[off:off + par.sizeof], par, maps):
                    found.append((base + off, par))
    if hint is not None and len(found) > 1:
        found = [f for f in found if f[1] is hint]
    if len(found) != 1:
        return None
    mp, par = found[0]
    return Located(arena, mp, L.Layout(state, par), version, "memory", path)
