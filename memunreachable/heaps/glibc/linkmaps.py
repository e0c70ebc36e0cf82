"""Stage 4d: words of ld.so's link maps that are addresses computed below an object, not
references (glibc elf/dl-lookup.c, elf/link.h).

For every loaded object with a GNU hash table, ld.so keeps l_gnu_chain_zero = the hash
table's chain array minus 4 bytes per symbol the table skips (symoffset: the undefined
imports at the head of .dynsym). For an object with many imports (a Python extension
module: hundreds of Py* symbols) that address lies below the object's first page, inside
whatever is mapped just under it, and that is very often a large malloc'd block: mmapped
chunks go below the lowest mapping, next to the library loaded last. A conservative scan
would count the word as a reference and never report a leak of that block.

The link maps are found without symbols: the executable's program headers (AT_PHDR) give
its dynamic section, whose DT_DEBUG entry ld.so set to &_r_debug; r_debug.r_map starts the
public chain (l_addr 0, l_ld 16, l_next 24). For each object the expected value is computed
from its own GNU hash header in memory, and only words of its link map equal to it are
returned. Static executables (no DT_DEBUG) have none.

The same walk gives the path strings ld.so keeps in blocks of their own: l_name (offset 8) and
l_origin, the object's directory, which _dl_new_object copies into a block of strlen(path) + 1
bytes. Past each string's NUL the block keeps whatever the chunk held before, stale words that
would keep a leak alive; the caller counts only strlen + 1 bytes of each (string_tails, clipped
to the block by the caller). l_origin's offset in struct link_map differs between glibc
releases and is found by value: the word of an object's link map that points at a copy of the
directory of its l_name.
"""
from __future__ import annotations

import struct
from typing import Dict, List, NamedTuple, Optional, Tuple

from memunreachable.collect import procfs
from memunreachable._errors import MemoryUnreadable, NoSuchProcess
from memunreachable._types import read_u64

AT_PHDR, AT_PHNUM = 3, 5
PT_DYNAMIC, PT_PHDR = 2, 6
DT_NULL, DT_DEBUG, DT_GNU_HASH = 0, 21, 0x6FFFFEF5
PHDR_SIZE = 56
LINK_MAP_BYTES = 2048       # struct link_map is 1,100-1,300 bytes in glibc 2.27-2.41
MAX_OBJECTS = 4096
MAX_DYN = 512
MAX_PATH = 4096
ORIGIN_SEARCH = (32, 1400)  # where l_origin may lie in struct link_map (byte offsets)


class Found(NamedTuple):
    words: List[int]                    # link-map words holding l_gnu_chain_zero, ascending
    string_tails: List[Tuple[int, int]] # (block, strlen + 1) of each l_name and l_origin


# Returns the address of r_debug from the executable's DT_DEBUG, or None (static, or ld.so
# did not set it).
def r_debug_address(mem, auxv: Dict[int, int]) -> Optional[int]:
    phdr, phnum = auxv.get(AT_PHDR), auxv.get(AT_PHNUM)
    if not phdr or not phnum or phnum > 256:
        return None
    table = mem.read(phdr, phnum * PHDR_SIZE)
    heads = [struct.unpack_from("<IIQQQ", table, k * PHDR_SIZE) for k in range(phnum)]
    bias = next((phdr - vaddr for ptype, _f, _o, vaddr, _p in heads if ptype == PT_PHDR), None)
    dyn = next((vaddr for ptype, _f, _o, vaddr, _p in heads if ptype == PT_DYNAMIC), None)
    if bias is None or dyn is None:
        return None
    for tag, value in _dynamic(mem, bias + dyn):
        if tag == DT_DEBUG:
            return value or None
    return None


def _dynamic(mem, addr: int):
    for first in range(0, MAX_DYN, 32):                  # 32 entries a read
        block = _read_up_to(mem, addr + 16 * first, 512)  # the section may end its mapping
        for tag, value in struct.iter_unpack("<QQ", block[:len(block) // 16 * 16]):
            if tag == DT_NULL:
                return
            yield tag, value
        if len(block) < 512:
            return


def _read_up_to(mem, addr: int, n: int) -> bytes:
    """[addr, addr+n), or the readable part of it before the first unreadable byte."""
    try:
        return mem.read(addr, n)
    except MemoryUnreadable as exc:
        have = (exc.address - addr) & ~7
        return mem.read(addr, have) if 0 < have < n else b""


# Returns l_gnu_chain_zero as ld.so computes it for the object whose load bias is l_addr and
# dynamic section is at l_ld, or None when it has no GNU hash table.
def chain_zero(mem, l_addr: int, l_ld: int) -> Optional[int]:
    table = next((v for tag, v in _dynamic(mem, l_ld) if tag == DT_GNU_HASH), None)
    if not table:
        return None
    if table < l_addr:                  # not relocated in place (read-only dynamic section)
        table += l_addr
    nbuckets, symoffset, bloom_size, _shift = struct.unpack("<IIII", mem.read(table, 16))
    return table + 16 + 8 * bloom_size + 4 * nbuckets - 4 * symoffset


class Memo:
    """What computed_words learns from the mapped files alone, kept while they stay the same
    (the pytest plugin's helper checks one process after every test): r_debug's address and
    each object's l_gnu_chain_zero by (l_addr, l_ld). Both come from the executable's and the
    objects' own dynamic sections and GNU hash headers, which do not change while the same
    files are mapped at the same addresses. The link maps themselves are read every time."""

    def __init__(self, key=None):
        self.key = key
        self.r_debug: Optional[int] = None
        self.have_r_debug = False
        self.chain_zero: Dict[Tuple[int, int], Optional[int]] = {}
        # the last answer's words and their values: when each word still holds its value, the
        # chain is not walked again (a word of ld.so's link maps that comes to hold such a
        # value later, in a map not walked, would count as a reference: as before this stage)
        self.words: Optional[List[Tuple[int, int]]] = None
        self.found = Found([], [])
        self.origin_offset: Optional[int] = None        # l_origin's offset in struct link_map


_MEMO = Memo()


def files_key(maps) -> tuple:
    """The identity of a process's mapped files (path, device, inode, address and offset of
    each file mapping): another key after any dlopen, dlclose or exec. Not the pid: each
    check sweeps a new snapshot process of the same target; what the Memo holds follows from
    the files and their addresses alone."""
    return tuple([(m.path, m.dev, m.inode, m.begin, m.offset) for m in maps if m.inode])


def of_process(mem, pid: int, maps=None) -> Found:
    """computed_words of process pid (its auxiliary vector read from /proc). With its maps,
    what depends on the mapped files alone is kept for the next call (Memo)."""
    global _MEMO
    memo = None
    if maps is not None:
        key = files_key(maps)
        if _MEMO.key != key:
            _MEMO = Memo(key)
        memo = _MEMO
    if memo is not None and memo.have_r_debug:
        return computed_words(mem, {}, memo)
    try:
        auxv = procfs.read_auxv(pid)
    except (OSError, NoSuchProcess):
        return Found([], [])
    return computed_words(mem, auxv, memo)


# Returns the addresses of the link-map words that hold their object's l_gnu_chain_zero,
# ascending, and the path strings' tails; nothing when the link maps cannot be found or read
# (the words then count as before). memo: a Memo of the same mapped files (auxv is not read
# when it knows r_debug).
def computed_words(mem, auxv: Dict[int, int], memo: Optional[Memo] = None) -> Found:
    if memo is not None and memo.words is not None and _still_hold(mem, memo.words):
        return memo.found
    try:
        if memo is not None and memo.have_r_debug:
            start = memo.r_debug
        else:
            start = r_debug_address(mem, auxv)
            if memo is not None:
                memo.r_debug, memo.have_r_debug = start, True
        if start is None:
            return Found([], [])
        lm = read_u64(mem, start + 8)                       # r_debug.r_map
    except (MemoryUnreadable, struct.error):
        return Found([], [])
    out, seen, maps = [], set(), []
    while lm and lm % 8 == 0 and lm not in seen and len(seen) < MAX_OBJECTS:
        seen.add(lm)
        try:
            l_addr, _name, l_ld, l_next = struct.unpack("<QQQQ", mem.read(lm, 32))
        except (MemoryUnreadable, struct.error):
            break                                       # the chain cannot be followed
        words = _read_up_to(mem, lm, LINK_MAP_BYTES)
        maps.append((lm, words))
        if memo is not None and (l_addr, l_ld) in memo.chain_zero:
            value = memo.chain_zero[(l_addr, l_ld)]
        else:
            try:
                value = chain_zero(mem, l_addr, l_ld) if l_ld else None
                if memo is not None:
                    memo.chain_zero[(l_addr, l_ld)] = value
            except (MemoryUnreadable, struct.error):
                value = None                            # this object only (the vdso, say)
        if value is not None:
            out += [(a, value) for a in _aligned_hits(words, value.to_bytes(8, "little"), lm)]
        lm = l_next
    out.sort()
    strings, tails = _path_strings(mem, maps, memo)
    if memo is not None:
        memo.words = out + strings
        memo.found = Found([addr for addr, _ in out], tails)
    return Found([addr for addr, _ in out], tails)


# Returns ((word address, string address) of each path pointer used, (string, strlen + 1) of
# each path string) for the link maps [(address, first bytes)]: l_name at offset 8 and
# l_origin at the offset _origin_offset finds (kept in memo).
def _path_strings(mem, maps, memo: Optional[Memo]):
    names = {}
    for lm, words in maps:
        name = struct.unpack_from("<Q", words, 8)[0] if len(words) >= 16 else 0
        names[lm] = (name, _c_string(mem, name) if _user_address(name) else None)
    offset = memo.origin_offset if memo is not None else None
    if offset is None:
        offset = next((k for lm, words in maps
                       for k in [_origin_offset(mem, lm, words, *names[lm])] if k), None)
        if memo is not None:
            memo.origin_offset = offset
    pointers, tails = [], []
    for lm, words in maps:
        name, text = names[lm]
        if text is not None:
            pointers.append((lm + 8, name))
            tails.append((name, len(text) + 1))
        if offset is not None and offset + 8 <= len(words):
            origin = struct.unpack_from("<Q", words, offset)[0]
            text = _c_string(mem, origin) if _user_address(origin) and origin % 8 == 0 else None
            if text is not None and text.startswith(b"/") and _printable(text):
                pointers.append((lm + offset, origin))
                tails.append((origin, len(text) + 1))
    return pointers, tails


# Returns the offset of l_origin in the link map at lm (its first bytes: words) whose l_name
# string is text at name, or None: the first word, other than l_name and pointers into the link
# map itself, that points at a block (16-aligned) holding the directory of text.
def _origin_offset(mem, lm: int, words: bytes, name: int, text: Optional[bytes]):
    if not text or not text.startswith(b"/"):
        return None
    directory = text[:text.rindex(b"/")] or b"/"
    for k in range(ORIGIN_SEARCH[0], min(ORIGIN_SEARCH[1], len(words) - 7), 8):
        v = struct.unpack_from("<Q", words, k)[0]
        if not _user_address(v) or v % 16 or v == name or lm <= v < lm + LINK_MAP_BYTES:
            continue
        try:
            if mem.read(v, len(directory) + 1) == directory + b"\0":
                return k
        except MemoryUnreadable:
            continue
    return None


def _c_string(mem, addr: int) -> Optional[bytes]:
    """The NUL-terminated string at addr (without its NUL), or None: unreadable, or no NUL in
    MAX_PATH bytes."""
    data = b""
    while len(data) < MAX_PATH:
        try:
            chunk = _read_up_to(mem, addr + len(data), 256)
        except MemoryUnreadable:
            return None
        end = chunk.find(b"\0")
        if end >= 0:
            return data + chunk[:end]
        if len(chunk) < 256:
            return None
        data += chunk
    return None


def _user_address(v: int) -> bool:
    """v could be a user-space address (a word of any value is not read: /proc/PID/mem
    refuses offsets from 2**63 with EINVAL, not as unreadable memory)."""
    return 4096 <= v < 1 << 57


def _printable(text: bytes) -> bool:
    return all(0x20 <= c < 0x7F for c in text)


def _still_hold(mem, words: List[Tuple[int, int]]) -> bool:
    """Every (address, value) of words reads as that value in mem."""
    try:
        return all(read_u64(mem, addr) == value for addr, value in words)
    except (MemoryUnreadable, struct.error):
        return False


# Returns base + k for every 8-aligned offset k of data where the 8 bytes are needle
# (bytes.find: the 36 link maps of a pytest process are searched in 0.1 ms, not 6 ms).
def _aligned_hits(data: bytes, needle: bytes, base: int) -> List[int]:
    out, k = [], data.find(needle)
    while k >= 0:
        if k % 8 == 0:
            out.append(base + k)
        k = data.find(needle, k + 1)
    return out
