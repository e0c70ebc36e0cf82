"""elf.py: the few ELF facts the check reads from object files, parsed with struct.

Shared by detect, diagnose, glibc/locate and cpython/locate; not a stage itself. It replaces
pyelftools on the check's path (issue 10, fast start): importing pyelftools took 60-90 ms and
parsing libc's relocations with it ~100 ms per fresh process; these reads take a few ms.

    ElfFile(f)              f: a file open for reading (binary); raises ElfError when it is
                            not a little-endian ELF file
    .elfclass .e_type .e_machine .machine_name ("EM_X86_64") .shared (ET_DYN)
    .segments()             [Segment] (64-bit only; [] for 32-bit files)
    .sections()             [Section] with names (64-bit only)
    .section(name)          Section or None
    .data(offset, size)     bytes of the file
    .first_load()           (page-aligned p_offset, p_vaddr) of the lowest PT_LOAD, or None
    .dynsym_values(names)   {name: st_value} of the names defined in .dynsym
    .dynsym_symbols(names)  {name: (st_value, st_size)} of the same
    .defines_function(name) a defined STT_FUNC/STT_GNU_IFUNC in .dynsym
    .rela_relative()        {r_offset: r_addend} of every R_X86_64_RELATIVE in SHT_RELA sections
cached_by_file(cache, f, read, most)   read(ElfFile(f)), remembered by the file's identity
image_span(head)        bytes from a loaded object's first page to the end of its last PT_LOAD's
                        memory (.bss included), from its first page as mapped, or None
program_headers(raw, phentsize, phnum)  [Segment] of raw program headers (both read them)
References: the System V gABI "Object Files" chapter; elf(5); glibc elf/elf.h.
"""
from __future__ import annotations

import os
import struct
from typing import Dict, List, Optional, Sequence, Tuple

from memunreachable._types import FrozenFields, set_fields

PAGE = 4096
ELFCLASS32, ELFCLASS64 = 1, 2
ET_DYN = 3
PT_LOAD = 1
SHT_RELA = 4
SHN_UNDEF = 0
STT_FUNC, STT_GNU_IFUNC = 2, 10
R_X86_64_RELATIVE = 8
MACHINES = {3: "EM_386", 8: "EM_MIPS", 20: "EM_PPC", 21: "EM_PPC64", 40: "EM_ARM",
            62: "EM_X86_64", 183: "EM_AARCH64", 243: "EM_RISCV"}

EHDR64 = struct.Struct("<16sHHIQQQIHHHHHH")
PHDR64 = struct.Struct("<IIQQQQQQ")
SHDR64 = struct.Struct("<IIQQQQIIQQ")
SYM64 = struct.Struct("<IBBHQQ")
RELA64 = struct.Struct("<QQq")


class ElfError(ValueError):
    """Not an ELF file this reader understands (or a truncated one)."""


class Segment(FrozenFields):
    __slots__ = ("p_type", "p_flags", "p_offset", "p_vaddr", "p_filesz", "p_memsz")

    def __init__(self, p_type: int, p_flags: int, p_offset: int, p_vaddr: int, p_filesz: int,
                 p_memsz: int):
        set_fields(self, p_type, p_flags, p_offset, p_vaddr, p_filesz, p_memsz)


class Section(FrozenFields):
    __slots__ = ("name", "sh_type", "sh_addr", "sh_offset", "sh_size", "sh_link", "sh_entsize")

    def __init__(self, name: str, sh_type: int, sh_addr: int, sh_offset: int, sh_size: int,
                 sh_link: int, sh_entsize: int):
        set_fields(self, name, sh_type, sh_addr, sh_offset, sh_size, sh_link, sh_entsize)


class ElfFile:
    def __init__(self, f):
        self._fd = f.fileno()
        ident = os.pread(self._fd, 64, 0)
        if len(ident) < 20 or ident[:4] != b"\x7fELF":
            raise ElfError("not an ELF file")
        if ident[5] != 1:
            raise ElfError("not a little-endian ELF file")
        self.elfclass = 64 if ident[4] == ELFCLASS64 else 32 if ident[4] == ELFCLASS32 else 0
        if not self.elfclass:
            raise ElfError(f"unknown ELF class {ident[4]}")
        self.e_type, self.e_machine = struct.unpack_from("<HH", ident, 16)
        self._hdr = EHDR64.unpack(ident) if self.elfclass == 64 and len(ident) == 64 else None
        self._sections: Optional[List[Section]] = None

    @property
    def machine_name(self) -> str:
        return MACHINES.get(self.e_machine, f"EM_{self.e_machine}")

    @property
    def shared(self) -> bool:
        return self.e_type == ET_DYN

    def data(self, offset: int, size: int) -> bytes:
        out = os.pread(self._fd, size, offset)
        if len(out) != size:
            raise ElfError(f"truncated ELF file: {size} bytes at {offset:#x}")
        return out

    def segments(self) -> List[Segment]:
        if self._hdr is None:
            return []
        phoff, phentsize, phnum = self._hdr[5], self._hdr[9], self._hdr[10]
        if not phnum or phentsize < PHDR64.size:
            return []
        return program_headers(self.data(phoff, phentsize * phnum), phentsize, phnum)

    def sections(self) -> List[Section]:
        if self._sections is None:
            self._sections = self._read_sections()
        return self._sections

    def _read_sections(self) -> List[Section]:
        if self._hdr is None:
            return []
        shoff, shentsize, shnum, shstrndx = self._hdr[6], self._hdr[11], self._hdr[12], self._hdr[13]
        if not shoff or not shnum or shentsize < SHDR64.size:
            return []
        raw = self.data(shoff, shentsize * shnum)
        hdrs = [SHDR64.unpack_from(raw, i * shentsize) for i in range(shnum)]
        names = b""
        if shstrndx < shnum:
            s = hdrs[shstrndx]
            names = self.data(s[4], s[5])
        out = []
        for h in hdrs:
            end = names.find(b"\0", h[0])
            name = names[h[0]:end if end >= 0 else len(names)].decode(errors="replace")
            out.append(Section(name, h[1], h[3], h[4], h[5], h[6], h[9]))
        return out

    def section(self, name: str) -> Optional[Section]:
        return next((s for s in self.sections() if s.name == name), None)

    def section_data(self, s: Section) -> bytes:
        return self.data(s.sh_offset, s.sh_size)

    def first_load(self) -> Optional[Tuple[int, int]]:
        loads = [s for s in self.segments() if s.p_type == PT_LOAD]
        if not loads:
            return None
        first = min(loads, key=lambda s: s.p_vaddr)
        return first.p_offset & ~(PAGE - 1), first.p_vaddr & ~(PAGE - 1)

    def _dynsym(self):
        """(.dynsym bytes, its string table bytes), or None."""
        sym = self.section(".dynsym")
        secs = self.sections()
        if sym is None or sym.sh_entsize != SYM64.size or sym.sh_link >= len(secs):
            return None
        return self.section_data(sym), self.section_data(secs[sym.sh_link])

    def _iter_named(self, names: Sequence[str]):
        """(name, st_info, st_shndx, st_value, st_size) of .dynsym entries whose name is in
        names."""
        dyn = self._dynsym()
        if dyn is None:
            return
        syms, strtab = dyn
        wanted: Dict[int, str] = {}
        for name in names:
            key = name.encode() + b"\0"
            pos = strtab.find(key)
            while pos >= 0:         # also inside a longer name: tables share suffixes
                wanted[pos] = name
                pos = strtab.find(key, pos + 1)
        n = len(syms) // SYM64.size
        for st_name, info, _other, shndx, value, size in SYM64.iter_unpack(syms[:n * SYM64.size]):
            name = wanted.get(st_name)
            if name is not None:
                yield name, info, shndx, value, size

    def dynsym_values(self, names: Sequence[str]) -> Dict[str, int]:
        return {name: value for name, (value, _size) in self.dynsym_symbols(names).items()}

    def dynsym_symbols(self, names: Sequence[str]) -> Dict[str, Tuple[int, int]]:
        """{name: (st_value, st_size)} of the names defined in .dynsym."""
        out: Dict[str, Tuple[int, int]] = {}
        for name, _info, shndx, value, size in self._iter_named(names):
            if shndx != SHN_UNDEF and value and name not in out:
                out[name] = (value, size)
        return out

    def defines_function(self, name: str) -> bool:
        return any(shndx != SHN_UNDEF and info & 0xF in (STT_FUNC, STT_GNU_IFUNC)
                   for _n, info, shndx, _v, _s in self._iter_named([name]))

    def rela_relative(self) -> Dict[int, int]:
        out: Dict[int, int] = {}
        for s in self.sections():
            if s.sh_type != SHT_RELA or s.sh_entsize != RELA64.size:
                continue
            raw = self.section_data(s)
            n = len(raw) // RELA64.size
            for off, info, addend in RELA64.iter_unpack(raw[:n * RELA64.size]):
                if info & 0xFFFFFFFF == R_X86_64_RELATIVE:
                    out[off] = addend
        return out


# Returns how far a loaded ELF object's image reaches from the start of its first mapping:
# max(p_vaddr + p_memsz) over its PT_LOAD segments less the lowest one's page, read from `head`,
# the object's first page as mapped (its ELF header and program headers: the loader maps them
# with the first segment). None when head is no 64-bit little-endian ELF image or its program
# headers lie past it. The anonymous mapping after an object's .data holds the rest of its
# .bss up to there; the kernel merges any anonymous mapping made right after it into the same
# one (a pymalloc arena: 1 MiB more), so this bounds the .bss to what the object owns.
def image_span(head: bytes) -> Optional[int]:
    if len(head) < EHDR64.size or head[:4] != b"\x7fELF" or head[4] != ELFCLASS64 \
            or head[5] != 1:
        return None
    hdr = EHDR64.unpack_from(head)
    phoff, phentsize, phnum = hdr[5], hdr[9], hdr[10]
    if not phnum or phentsize < PHDR64.size or phoff + phentsize * phnum > len(head):
        return None
    loads = [s for s in program_headers(head[phoff:], phentsize, phnum) if s.p_type == PT_LOAD]
    if not loads:
        return None
    low = min(s.p_vaddr for s in loads) & ~(PAGE - 1)
    return max(s.p_vaddr + s.p_memsz for s in loads) - low


def program_headers(raw: bytes, phentsize: int, phnum: int) -> List[Segment]:
    """The phnum 64-bit program headers of phentsize bytes each at the start of raw."""
    return [Segment(p[0], p[1], p[2], p[3], p[5], p[6])
            for p in (PHDR64.unpack_from(raw, i * phentsize) for i in range(phnum))]


# Returns read(ElfFile(f)) for the open file f, remembered in cache by the file's identity
# (st_dev, st_ino, st_size, st_mtime_ns: a long-lived checker meets the same files at every
# check, and a file replaced on disk is read again); on_error when f is not a usable ELF file
# (malformed, truncated). A cache holding `most` entries is emptied before the next one.
def cached_by_file(cache: dict, f, read, most: int, on_error=None):
    st = os.fstat(f.fileno())
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in cache:
        try:
            facts = read(ElfFile(f))
        except (ElfError, OSError, ValueError, struct.error):    # malformed or truncated
            facts = on_error
        if len(cache) >= most:
            cache.clear()
        cache[key] = facts
    return cache[key]
