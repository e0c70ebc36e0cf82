"""elf.py against pyelftools (the reference it replaces on the check's path) on the real
objects of this machine: libc, the dynamic loader, the Python executable, libpython, a
freshly compiled C program; and on malformed input."""
import glob
import os
import sys
import tempfile

import pytest
from elftools.elf.elffile import ELFFile
from elftools.elf.relocation import RelocationSection

from memunreachable.stacks import elf as E

CANDIDATES = ["/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2",
              os.path.realpath(sys.executable)] + sorted(
    glob.glob(os.path.join(sys.base_prefix, "lib", "libpython3*.so*")))[:1]
FILES = [p for p in CANDIDATES if os.path.exists(p)]
NAMES = ("_PyRuntime", "Py_Version", "PyLong_Type", "malloc", "free", "__libc_malloc")


@pytest.mark.parametrize("path", FILES)
def test_matches_pyelftools(path):
    with open(path, "rb") as f:
        ref, got = ELFFile(f), E.ElfFile(f)
        assert got.machine_name == ref["e_machine"] and got.elfclass == ref.elfclass
        assert got.shared == (ref["e_type"] == "ET_DYN")
        loads = [s for s in ref.iter_segments() if s["p_type"] == "PT_LOAD"]
        first = min(loads, key=lambda s: s["p_vaddr"])
        assert got.first_load() == (first["p_offset"] & ~4095, first["p_vaddr"] & ~4095)
        assert [(s.p_vaddr, got.data(s.p_offset, s.p_filesz)) for s in got.segments()
                if s.p_type == E.PT_LOAD and s.p_flags & 2] == \
            [(s["p_vaddr"], s.data()) for s in loads if s["p_flags"] & 2]
        rel = {r["r_offset"]: r["r_addend"] for sec in ref.iter_sections()
               if isinstance(sec, RelocationSection) and sec.is_RELA()
               for r in sec.iter_relocations() if r["r_info_type"] == E.R_X86_64_RELATIVE}
        assert got.rela_relative() == rel
        assert [s.name for s in got.sections()] == [s.name for s in ref.iter_sections()]
        dynsym = ref.get_section_by_name(".dynsym")
        want = {}
        for name in NAMES:
            syms = [s for s in dynsym.get_symbol_by_name(name) or []
                    if s["st_shndx"] != "SHN_UNDEF" and s["st_value"]] if dynsym else []
            if syms:
                want[name] = syms[0]["st_value"]
        assert got.dynsym_values(NAMES) == want
        defines = any(s["st_shndx"] != "SHN_UNDEF" and s["st_info"]["type"] in
                      ("STT_FUNC", "STT_GNU_IFUNC")
                      for s in (dynsym.get_symbol_by_name("malloc") or [] if dynsym else []))
        assert got.defines_function("malloc") == defines


def test_libc_defines_malloc_and_python_has_its_runtime():
    with open("/lib/x86_64-linux-gnu/libc.so.6", "rb") as f:
        assert E.ElfFile(f).defines_function("malloc")
    libpython = [p for p in FILES if "libpython" in p]
    exe = os.path.realpath(sys.executable)
    with open(libpython[0] if libpython else exe, "rb") as f:
        e = E.ElfFile(f)
        assert "_PyRuntime" in e.dynsym_values(["_PyRuntime"]) or e.section(".PyRuntime")


def test_not_elf_and_truncated():
    with tempfile.TemporaryFile() as f:
        f.write(b"#!/bin/sh\necho hi\n")
        f.flush()
        with pytest.raises(E.ElfError):
            E.ElfFile(f)
    with open("/lib/x86_64-linux-gnu/libc.so.6", "rb") as src, tempfile.TemporaryFile() as f:
        f.write(src.read(64))           # the header only: section headers are past the end
        f.flush()
        e = E.ElfFile(f)
        assert e.machine_name == "EM_X86_64" and e.elfclass == 64
        with pytest.raises(E.ElfError):
            e.sections()


def test_32_bit_header():
    hdr = bytearray(64)
    hdr[:4] = b"\x7fELF"
    hdr[4], hdr[5] = E.ELFCLASS32, 1
    hdr[16:20] = (2).to_bytes(2, "little") + (3).to_bytes(2, "little")     # ET_EXEC, EM_386
    with tempfile.TemporaryFile() as f:
        f.write(bytes(hdr))
        f.flush()
        e = E.ElfFile(f)
        assert (e.machine_name, e.elfclass) == ("EM_386", 32)
        assert e.segments() == [] and e.first_load() is None and e.sections() == []


def test_cached_by_file_reads_each_file_once_until_it_changes(tmp_path):
    """The facts of an open ELF file are remembered by the file's identity (device, inode,
    size, mtime): the same file is parsed once, a rewritten one again; a file that is not
    ELF gives on_error; a full cache starts over."""
    reads = []

    def read(elf):
        reads.append(elf.machine_name)
        return elf.first_load()

    cache = {}
    libc = "/lib/x86_64-linux-gnu/libc.so.6"
    with open(libc, "rb") as f:
        first = E.cached_by_file(cache, f, read, most=2)
        assert E.cached_by_file(cache, f, read, most=2) == first == E.ElfFile(f).first_load()
    assert reads == ["EM_X86_64"] and len(cache) == 1
    script = tmp_path / "script"
    script.write_bytes(b"#!/bin/sh\necho hi\n")
    with open(script, "rb") as f:
        assert E.cached_by_file(cache, f, read, most=2, on_error=False) is False
    assert reads == ["EM_X86_64"] and len(cache) == 2
    copy = tmp_path / "libc"
    copy.write_bytes(open(libc, "rb").read())
    with open(copy, "rb") as f:
        assert E.cached_by_file(cache, f, read, most=2) == first
    assert reads == ["EM_X86_64"] * 2 and len(cache) == 1     # full at 2: emptied first
    with open(copy, "r+b") as f:                                # rewritten: read again
        f.seek(0, os.SEEK_END)
        f.write(b"\0" * 8)
        f.flush()
        assert E.cached_by_file(cache, f, read, most=2) == first
    assert reads == ["EM_X86_64"] * 3


@pytest.mark.parametrize("path", FILES)
def test_image_span_reaches_the_end_of_the_last_segment_s_memory(path):
    # from the object's first page (its headers, as the loader maps them): the end of the
    # highest PT_LOAD's memory (.bss included) from the lowest one's page
    with open(path, "rb") as f:
        loads = [s for s in ELFFile(f).iter_segments() if s["p_type"] == "PT_LOAD"]
        f.seek(0)
        head = f.read(E.PAGE)
    low = min(s["p_vaddr"] for s in loads) & ~4095
    assert E.image_span(head) == max(s["p_vaddr"] + s["p_memsz"] for s in loads) - low
    assert E.image_span(head) > max(s["p_vaddr"] + s["p_filesz"] for s in loads) - low or \
        all(s["p_memsz"] == s["p_filesz"] for s in loads)


def test_image_span_of_what_is_no_image():
    head = open(FILES[0], "rb").read(E.PAGE)
    assert E.image_span(b"") is None and E.image_span(b"\0" * 4096) is None
    assert E.image_span(head[:64]) is None                  # program headers cut off
    assert E.image_span(head[:4] + b"\x01" + head[5:]) is None      # 32-bit class
