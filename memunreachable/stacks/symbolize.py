"""symbolize.py: Stage 10: allocation stacks -> frames (function, file:line, inline frames).

Input: return addresses (innermost first, as the tracking table records them) and the target's
executable file mappings `modules = [(begin, end, file offset, path)]` (info.modules). Output:
Frame records, one per pc, or several when the pc lies in inlined code (innermost first, the
inlined ones flagged `inlined=True`). Runs in the checker only, after the snapshot is gone;
nothing here reads the target's memory.

Where the names come from, in GDB's order (allocation-tracking.md section 6):
 1. the mapped file itself when it has .debug_info;
 2. DEBUG_DIR/.build-id/xx/yyyy.debug from its NT_GNU_BUILD_ID note (Debian's *-dbg, -dbgsym);
 3. its .gnu_debuglink (name + CRC32) in the file's directory, its .debug/ subdirectory, then
    DEBUG_DIR/<file's directory>/;
 4. otherwise its ELF symbol tables (.symtab, or .dynsym of a stripped file): function only.
A pc that none of these names is shown as module+0xoffset with the module's build-id, so it can
be symbolized elsewhere (`addr2line -e MODULE -f -i 0xOFFSET`).

Library: Sentry's `symbolic` (a Rust wheel) builds a lookup table (SymCache) from DWARF with
inline frames: 0.32 s for Debian's libc debug file (2.3 MB .debug_info), 0.5 s for libpython
3.11 (9.2 MB), 26-38 k lookups/s. pyelftools needs 13.8 s just to decode libc's line programs
and another 18 s to walk its DIEs for names and inline ranges (allocation-tracking.md
section 6; re-measured in the commit that added this module). pyelftools still reads the ELF
headers here (build-id, PT_LOAD, .gnu_debuglink): that is cheap. symbolic does not demangle:
demangle.py does (C++, Rust legacy and v0, GCC clone suffixes dropped).

Caches: SymbolCache keeps ELF facts per file identity (device, inode, size, mtime), one
SymCache per build-id (LRU, MAX_SYMCACHES) and every looked-up (build-id, address). SymCaches
are also kept on disk by build-id and debug source (default_disk_dir(), at most
DISK_CACHE_BYTES): building libc's takes 0.42 s and libpython 3.11's 0.61 s, opening the saved
file (mmap) 0.3-0.4 ms, so a `check` from a fresh CLI process does not pay it again (4 MB and
6.6 MB on disk). One
process-wide cache (DEFAULT_CACHE) serves every check of a long-lived checker (the in-process
API's helper, a pytest run, signal dumps).

References: ELF gABI (PT_LOAD, SHT_NOTE), GDB manual "Separate Debug Files", Itanium C++ ABI
section 5.1 (mangling), Rust RFC 2603 (v0 mangling), compiler-rt GetPreviousInstructionPc.
"""
from __future__ import annotations

import bisect
import logging
import os
import threading
import zlib
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from memunreachable._types import FrozenFields, set_fields
from memunreachable.stacks.demangle import CLONE_SUFFIX, demangle

log = logging.getLogger("memunreachable")

Module = Tuple[int, int, int, str]          # (begin, end, file offset, path) of an executable mapping
PythonFrame = Tuple[str, str, int]          # (function, file, line)

DEFAULT_DEBUG_DIRS = ("/usr/lib/debug",)
DISK_CACHE_BYTES = 256 << 20                # on-disk SymCaches kept, at most (LRU by mtime)
MAX_SYMCACHES = 32                          # SymCaches kept (each ~1-20 MB of Rust memory)
UNKNOWN_MODULE = "<unknown module>"         # LSan's name for a pc outside every module
# native frames that run Python code: py-spy --native replaces these by Python frames
# (src/native_stack_trace.rs); the _PyEval_EvalFrame/PyEval_EvalFrame wrappers only call them
EVAL_FUNCTIONS = frozenset({"_PyEval_EvalFrameDefault", "PyEval_EvalFrameEx"})


class Frame(FrozenFields):
    """One frame of an allocation stack.

    pc: the return address as recorded (0 for Python frames); module: path of the mapped file
    (None when the pc is in no file mapping); build_id: hex GNU build-id of the module (None
    when it has none or it could not be read); offset: the module's ELF virtual address of the
    call instruction looked up (pc - 1), ready for `addr2line -e MODULE`; function (demangled),
    file, line: None when unknown; inlined: this frame was inlined into the next frame (same
    pc); python: a Python frame from the interpreter (function, file, line only).
    """
    __slots__ = ("pc", "module", "build_id", "offset", "function", "file", "line", "inlined",
                 "python")

    def __init__(self, pc: int, module: Optional[str] = None, build_id: Optional[str] = None,
                 offset: int = 0, function: Optional[str] = None, file: Optional[str] = None,
                 line: Optional[int] = None, inlined: bool = False, python: bool = False):
        set_fields(self, pc, module, build_id, offset, function, file, line, inlined, python)

    def to_dict(self) -> dict:
        """The JSON form (docs/json.md): every field; "python" only on Python frames."""
        d = dict(zip(self._fields, self._astuple()))
        if not self.python:
            del d["python"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Frame":
        return cls(pc=int(d.get("pc", 0)), module=d.get("module"), build_id=d.get("build_id"),
                   offset=int(d.get("offset", 0)), function=d.get("function"),
                   file=d.get("file"), line=d.get("line"), inlined=bool(d.get("inlined")),
                   python=bool(d.get("python")))


# ---- ELF facts (pyelftools: headers and notes only, never DWARF) ---------------------------

class ElfFacts(FrozenFields):
    __slots__ = ("build_id", "segments", "load_base", "debuglink", "has_dwarf")

    def __init__(self, build_id: Optional[str],
                 # PT_LOAD (p_offset, p_filesz, p_vaddr)
                 segments: Tuple[Tuple[int, int, int], ...],
                 load_base: int,                         # lowest PT_LOAD p_vaddr (0 for PIE/DSO)
                 debuglink: Optional[Tuple[str, int]],   # (.gnu_debuglink file name, CRC32)
                 has_dwarf: bool):                       # .debug_info with contents
        set_fields(self, build_id, segments, load_base, debuglink, has_dwarf)

    def vaddr(self, file_offset: int) -> Optional[int]:
        """ELF virtual address of a file offset (None when no PT_LOAD maps it)."""
        for off, size, vaddr in self.segments:
            if off <= file_offset < off + size:
                return file_offset - off + vaddr
        return None


# Returns ElfFacts of an open ELF file; raises ValueError/OSError when it is not a readable ELF.
def read_elf_facts(f) -> ElfFacts:
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile
    try:
        elf = ELFFile(f)
        segs = tuple((s["p_offset"], s["p_filesz"], s["p_vaddr"]) for s in elf.iter_segments()
                     if s["p_type"] == "PT_LOAD")
        build_id = None
        for sec in elf.iter_sections():
            if sec["sh_type"] == "SHT_NOTE":
                for note in sec.iter_notes():
                    if note["n_type"] == "NT_GNU_BUILD_ID":
                        build_id = note["n_desc"]
                        break
            if build_id:
                break
        debuglink = None
        sec = elf.get_section_by_name(".gnu_debuglink")
        if sec is not None and sec["sh_type"] != "SHT_NOBITS":
            data = sec.data()
            name, _, rest = data.partition(b"\0")
            pad = (4 - (len(name) + 1) % 4) % 4
            crc = int.from_bytes(rest[pad:pad + 4], "little") if len(rest) >= pad + 4 else 0
            debuglink = (name.decode(errors="replace"), crc)
        info = elf.get_section_by_name(".debug_info")
        has_dwarf = info is not None and info["sh_type"] != "SHT_NOBITS" and info["sh_size"] > 0
    except ELFError as exc:
        raise ValueError(str(exc)) from None
    base = min((v for _, _, v in segs), default=0)
    return ElfFacts(build_id if isinstance(build_id, str) else None, segs, base, debuglink,
                    has_dwarf)


# Returns {st_value: [names]} of the sized STT_FUNC symbols of .symtab and .dynsym, the name to
# show first: global and weak names before local ones, clone pieces (.cold, .part.0) last, then
# fewer leading underscores (strdup before __strdup); {} when the file has none. Read with
# struct, not pyelftools' symbol iterator (1.8 s for libpython's 6 861 functions; this: ms).
def read_function_symbols(path: str) -> Dict[int, List[str]]:
    import struct
    from elftools.elf.elffile import ELFFile
    out: Dict[int, List[Tuple[int, str]]] = {}
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            if elf.elfclass != 64 or not elf.little_endian:
                return {}
            for name in (".symtab", ".dynsym"):
                sec = elf.get_section_by_name(name)
                if sec is None or sec["sh_type"] == "SHT_NOBITS":
                    continue
                strsec = elf.get_section(sec["sh_link"])
                f.seek(strsec["sh_offset"])
                strtab = f.read(strsec["sh_size"])
                f.seek(sec["sh_offset"])
                data = f.read(sec["sh_size"] - sec["sh_size"] % 24)
                for st_name, st_info, _o, shndx, value, size in struct.iter_unpack("<IBBHQQ", data):
                    if st_info & 0xf != 2 or size == 0 or shndx == 0:      # STT_FUNC, defined
                        continue
                    end = strtab.find(b"\0", st_name)
                    sym = strtab[st_name:end].decode(errors="replace").split("@")[0]   # foo@@GLIBC_2.34
                    rank = ((0 if st_info >> 4 in (1, 2) else 1) + (2 if CLONE_SUFFIX.search(sym) else 0),
                            len(sym) - len(sym.lstrip("_")))
                    names = out.setdefault(value, [])
                    if all(n != sym for _, n in names):
                        names.append((rank, sym))
    except (OSError, ValueError, struct.error) as exc:
        log.debug("symbolize: cannot read the symbol tables of %s: %s", path, exc)
        return {}
    except Exception as exc:  # noqa: BLE001 - pyelftools' ELFError family
        log.debug("symbolize: cannot read the symbol tables of %s: %s", path, exc)
        return {}
    return {k: [n for _, n in sorted(v)] for k, v in out.items()}


def _crc32_of(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                return crc
            crc = zlib.crc32(chunk, crc)


# ---- the cache -----------------------------------------------------------------------------

class _Symbols:
    """A SymCache of one module, the file it was built from, and the ELF function symbols by
    address (symbolic 13.9 can attach the wrong symbol-table name to a function whose .cold
    part lies below it: libpython's _PyEval_EvalFrameDefault came back as "ast2obj_expr.cold";
    the address it gives, sym_addr, is right, so the name is checked against these)."""

    def __init__(self, symcache, source: str, how: str, functions: Dict[int, List[str]]):
        self.symcache, self.source, self.how = symcache, source, how
        self.functions = functions

    def name_at(self, sym_addr: int, name: str) -> str:
        """The preferred ELF symbol name at sym_addr (its aliases ranked: the public name of
        an aliased function, e.g. __libc_start_main rather than __libc_start_main_alias_2);
        `name` when no sized function symbol starts there."""
        names = self.functions.get(sym_addr)
        return names[0] if names else name


def _import_symbolic():
    """symbolic's modules, imported once; None when it is not installed. symbolic sets
    RUST_BACKTRACE=1 in os.environ on import: undone, so child processes are not affected."""
    before = os.environ.get("RUST_BACKTRACE")
    try:
        from symbolic.debuginfo import Archive
        from symbolic.symcache import SymCache
    except ImportError:
        return None
    finally:
        if before is None:
            os.environ.pop("RUST_BACKTRACE", None)
        else:
            os.environ["RUST_BACKTRACE"] = before
    return Archive, SymCache


def default_disk_dir() -> Optional[str]:
    """MEMUNREACHABLE_SYMCACHE_DIR (empty: no disk cache), else
    $XDG_CACHE_HOME/memunreachable/symcache (~/.cache/... by default)."""
    env = os.environ.get("MEMUNREACHABLE_SYMCACHE_DIR")
    if env is not None:
        return env or None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "memunreachable", "symcache")


class SymbolCache:
    """ELF facts per file, one symbol table per build-id, every looked-up address.

    debug_dirs: roots searched for separate debug files (GDB's debug-file-directory).
    Thread-safe; grows by at most MAX_SYMCACHES symbol tables (least recently used dropped).
    """

    def __init__(self, debug_dirs: Sequence[str] = DEFAULT_DEBUG_DIRS,
                 max_symcaches: int = MAX_SYMCACHES, disk_dir: Optional[str] = "default"):
        self.debug_dirs = tuple(debug_dirs)
        self.disk_dir = default_disk_dir() if disk_dir == "default" else disk_dir
        self.max_symcaches = max_symcaches
        self._facts: Dict[tuple, Optional[ElfFacts]] = {}
        self._symbols: "OrderedDict[str, Optional[_Symbols]]" = OrderedDict()
        self._lookups: Dict[Tuple[str, int], Tuple[Tuple[str, Optional[str], Optional[int]], ...]] = {}
        self._lock = threading.RLock()
        self._symbolic = False          # not imported yet
        self.stats = {"symcaches_built": 0, "symcache_seconds": 0.0, "lookups": 0,
                      "disk_hits": 0}

    # Returns (ElfFacts or None, the path opened) for the module file; None facts when the file
    # cannot be read or is not ELF. `candidates` are tried in order (map_files first, then the
    # path: the file may have been replaced on disk since it was mapped).
    def facts(self, candidates: Sequence[str]) -> Tuple[Optional[ElfFacts], Optional[str]]:
        for path in candidates:
            try:
                st = os.stat(path)
            except OSError:
                continue
            key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            with self._lock:
                if key not in self._facts:
                    try:
                        with open(path, "rb") as f:
                            self._facts[key] = read_elf_facts(f)
                    except (OSError, ValueError) as exc:
                        log.debug("symbolize: %s is not a readable ELF file: %s", path, exc)
                        self._facts[key] = None
                return self._facts[key], path
        return None, None

    def debug_file(self, facts: ElfFacts, opened: str, module_path: str) -> Tuple[str, str]:
        """(path of the file holding the best debug info, how it was found): the module itself
        (how="self" with DWARF, "symtab" without), "build-id" or "debuglink"."""
        if facts.has_dwarf:
            return opened, "self"
        if facts.build_id and len(facts.build_id) > 2:
            for d in self.debug_dirs:
                p = os.path.join(d, ".build-id", facts.build_id[:2], facts.build_id[2:] + ".debug")
                if os.path.isfile(p):
                    return p, "build-id"
        if facts.debuglink:
            name, crc = facts.debuglink
            here = os.path.dirname(os.path.realpath(module_path)) if os.path.exists(module_path) \
                else os.path.dirname(module_path)
            places = [os.path.join(here, name), os.path.join(here, ".debug", name)]
            places += [os.path.join(d, here.lstrip("/"), name) for d in self.debug_dirs]
            for p in places:
                if os.path.isfile(p) and os.path.realpath(p) != os.path.realpath(opened):
                    try:
                        if _crc32_of(p) == crc:
                            return p, "debuglink"
                        log.debug("symbolize: %s: CRC32 does not match %s's debuglink", p,
                                  module_path)
                    except OSError:
                        continue
        return opened, "symtab"

    def symbols(self, facts: ElfFacts, opened: str, module_path: str) -> Optional[_Symbols]:
        """The module's SymCache (built once per build-id, or per file without one)."""
        key = facts.build_id or f"file:{opened}"
        with self._lock:
            if key in self._symbols:
                self._symbols.move_to_end(key)
                return self._symbols[key]
            if self._symbolic is False:
                self._symbolic = _import_symbolic()
                if self._symbolic is None:
                    log.warning("symbolize: the 'symbolic' package is not installed: frames "
                                "are shown as module+offset (pip install symbolic)")
            sym = None
            if self._symbolic is not None:
                sym = self._build(facts, opened, module_path)
            self._symbols[key] = sym
            while len(self._symbols) > self.max_symcaches:
                self._symbols.popitem(last=False)
            return sym

    def _build(self, facts: ElfFacts, opened: str, module_path: str) -> Optional[_Symbols]:
        import time
        Archive, SymCache = self._symbolic
        source, how = self.debug_file(facts, opened, module_path)
        t0 = time.monotonic()
        disk = self._disk_path(facts, how)
        if disk is not None and os.path.isfile(disk):
            try:
                sc = SymCache.open(disk)
                self.stats["disk_hits"] += 1
                os.utime(disk)                  # most recently used: evicted last
                return _Symbols(sc, source, how, self._functions(source, opened))
            except Exception as exc:  # noqa: BLE001 - a damaged cache file: rebuild it
                log.debug("symbolize: cached %s unusable (%s): rebuilding", disk, exc)
        for path, kind in ((source, how), (opened, "symtab")):
            try:
                obj = Archive.open(path).get_object(arch="x86_64")
                sc = SymCache.from_object(obj)
            except Exception as exc:  # noqa: BLE001 - symbolic raises its own hierarchy
                log.debug("symbolize: cannot read symbols of %s: %s", path, exc)
                if path == opened:
                    return None
                continue
            self.stats["symcaches_built"] += 1
            self.stats["symcache_seconds"] += time.monotonic() - t0
            log.debug("symbolize: %s: symbols from %s (%s) in %.3f s", module_path, path, kind,
                      time.monotonic() - t0)
            if kind == how:
                self._save(sc, disk)
            return _Symbols(sc, path, kind, self._functions(path, opened))
        return None

    @staticmethod
    def _functions(source: str, opened: str) -> Dict[int, List[str]]:
        funcs = read_function_symbols(source)
        if source != opened:                    # .dynsym of the module itself, too
            for addr, names in read_function_symbols(opened).items():
                have = funcs.setdefault(addr, [])
                have.extend(n for n in names if n not in have)
        return funcs

    def _disk_path(self, facts: ElfFacts, how: str) -> Optional[str]:
        """The on-disk SymCache of a build-id and debug source (None: no disk cache, or the
        module has no build-id to key it by)."""
        if not self.disk_dir or not facts.build_id:
            return None
        from symbolic.symcache import SYMCACHE_LATEST_VERSION
        return os.path.join(self.disk_dir,
                            f"{facts.build_id}.{how}.v{SYMCACHE_LATEST_VERSION}.symcache")

    def _save(self, sc, disk: Optional[str]) -> None:
        """Write sc to disk atomically, then keep the directory under DISK_CACHE_BYTES (least
        recently used files dropped). Failures only cost the next check the rebuild."""
        if disk is None:
            return
        try:
            os.makedirs(self.disk_dir, exist_ok=True)
            tmp = f"{disk}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                sc.dump_into(f)
            os.replace(tmp, disk)
            files = []
            for name in os.listdir(self.disk_dir):
                if name.endswith(".symcache"):
                    st = os.stat(os.path.join(self.disk_dir, name))
                    files.append((st.st_mtime, st.st_size, name))
            total = sum(f[1] for f in files)
            for _, size, name in sorted(files):
                if total <= DISK_CACHE_BYTES:
                    break
                os.unlink(os.path.join(self.disk_dir, name))
                total -= size
        except OSError as exc:
            log.debug("symbolize: cannot write the symbol cache %s: %s", disk, exc)

    # Returns the frames at one ELF address of a module, innermost first, as
    # ((function, file, line), ...); () when nothing names it.
    def lookup(self, facts: ElfFacts, opened: str, module_path: str, vaddr: int) -> tuple:
        key = (facts.build_id or f"file:{opened}", vaddr)
        with self._lock:
            hit = self._lookups.get(key)
        if hit is not None:
            return hit
        sym = self.symbols(facts, opened, module_path)
        out: tuple = ()
        if sym is not None:
            self.stats["lookups"] += 1
            try:
                locs = sym.symcache.lookup(vaddr - facts.load_base)
            except Exception as exc:  # noqa: BLE001
                log.debug("symbolize: lookup %#x in %s failed: %s", vaddr, module_path, exc)
                locs = []
            out = tuple((demangle(self._checked_name(sym, l)) if l.symbol else None,
                         l.full_path or None, l.line or None) for l in locs)
        with self._lock:
            self._lookups[key] = out
        return out


    @staticmethod
    def _checked_name(sym: _Symbols, loc) -> str:
        """The location's symbol, checked against the ELF symbols at its function's address
        (sym_addr is 0xffffffff for inlined frames: their DWARF name stands)."""
        if loc.sym_addr in (0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF):
            return loc.symbol
        return sym.name_at(loc.sym_addr, loc.symbol)


DEFAULT_CACHE = SymbolCache()


# ---- the stage -----------------------------------------------------------------------------

def _strip_deleted(path: str) -> str:
    return path[:-len(" (deleted)")] if path.endswith(" (deleted)") else path


def modules_from_maps(maps) -> List[Module]:
    """[(begin, end, offset, path)] of the executable file mappings among procfs Mappings (what
    info.modules holds: symbolization needs nothing else from the target)."""
    return [(m.begin, m.end, m.offset, m.path) for m in maps
            if m.perms[2:3] == "x" and m.path.startswith("/")]


class _ModuleIndex:
    def __init__(self, modules: Iterable[Module]):
        self.modules = sorted(modules)
        self.begins = [m[0] for m in self.modules]

    def find(self, pc: int) -> Optional[Module]:
        i = bisect.bisect_right(self.begins, pc) - 1
        if i >= 0 and pc < self.modules[i][1]:
            return self.modules[i]
        return None


# Returns one or more Frames per pc (innermost first; inlined frames before the frame they were
# inlined into, all with the same pc). resolve=False: module/offset/build_id only (no symbol
# tables are read). pid: when given, /proc/PID/map_files is tried before the path (the file
# as mapped, even if replaced or deleted on disk since; needs CAP_SYS_ADMIN).
def symbolize(pcs: Sequence[int], modules: Sequence[Module], *,
              cache: Optional[SymbolCache] = None, resolve: bool = True,
              pid: Optional[int] = None) -> List[Frame]:
    cache = DEFAULT_CACHE if cache is None else cache
    index = modules if isinstance(modules, _ModuleIndex) else _ModuleIndex(modules)
    out: List[Frame] = []
    for pc in pcs:
        look = pc - 1 if pc > 0 else pc         # a return address: the call is just before
        mod = index.find(look)
        if mod is None:
            out.append(Frame(pc=pc, module=None, offset=look))
            continue
        begin, end, file_off, raw_path = mod
        path = _strip_deleted(raw_path)
        candidates = ([f"/proc/{pid}/map_files/{begin:x}-{end:x}"] if pid else []) + [path]
        facts, opened = cache.facts(candidates)
        offset_in_file = look - begin + file_off
        if facts is None:
            out.append(Frame(pc=pc, module=path, offset=offset_in_file))
            continue
        vaddr = facts.vaddr(offset_in_file)
        if vaddr is None:
            vaddr = offset_in_file
        names = cache.lookup(facts, opened, path, vaddr) if resolve else ()
        if not names:
            out.append(Frame(pc=pc, module=path, build_id=facts.build_id, offset=vaddr))
            continue
        for k, (fn, src, line) in enumerate(names):
            out.append(Frame(pc=pc, module=path, build_id=facts.build_id, offset=vaddr,
                             function=fn, file=src, line=line, inlined=k < len(names) - 1))
    return out


def python_frames(python_stack: Sequence[PythonFrame]) -> List[Frame]:
    """Frames for the interpreter's Python frames (innermost first)."""
    return [Frame(pc=0, module="", function=fn, file=fname, line=line, python=True)
            for fn, fname, line in python_stack]


# Returns the native frames with the Python frames where the interpreter ran them, as
# py-spy --native does: every native eval-loop frame (_PyEval_EvalFrameDefault) is replaced
# by the Python frames it ran. Exactly one eval frame: all Python frames go there (3.11+ runs
# nested Python calls in one C-level eval call); as many eval frames as Python frames: one
# each. Otherwise (3.11+ runs several Python calls per eval frame, and the native stack stops
# at its depth limit) they go where the first eval frame is, and of the native frames below
# it only those outside the interpreter's module stay (an embedding program's own). Without
# any eval frame: the Python frames first (innermost first), then the native frames.
def merge_python(native: Sequence[Frame], python_stack: Sequence[PythonFrame]) -> List[Frame]:
    py = python_frames(python_stack)
    if not py:
        return list(native)
    evals = [i for i, f in enumerate(native) if f.function in EVAL_FUNCTIONS]
    if len(evals) == 1:
        i = evals[0]
        return list(native[:i]) + py + list(native[i + 1:])
    if evals and len(evals) == len(py):
        out, k = [], 0
        for i, f in enumerate(native):
            if k < len(evals) and i == evals[k]:
                out.append(py[k])
                k += 1
            else:
                out.append(f)
        return out
    if evals:
        interpreter = {native[i].module for i in evals}
        return (list(native[:evals[0]]) + py
                + [f for f in native[evals[0] + 1:] if f.module not in interpreter])
    return py + list(native)


def _is_operator_new(frame: Frame) -> bool:
    return bool(frame.function) and frame.function.startswith("operator new")


def drop_allocator_frames(frames: List[Frame]) -> List[Frame]:
    """Without the leading C++ `operator new` frames (libstdc++'s new calls malloc: the
    caller of new is the frame that matters, allocation-tracking.md section 1)."""
    i = 0
    while i < len(frames) and _is_operator_new(frames[i]):
        i += 1
    return list(frames[i:]) if i < len(frames) else list(frames)


# Sets leak.backtrace for every leak from its stack/python_stack (symbolized once per distinct
# stack); returns the number of distinct stacks. Leaks without a stack get [] (their Python
# frames alone when they have some).
def symbolize_leaks(leaks, modules: Sequence[Module], *, cache: Optional[SymbolCache] = None,
                    resolve: bool = True, pid: Optional[int] = None) -> int:
    index = _ModuleIndex(modules)
    done: Dict[tuple, List[Frame]] = {}
    for leak in leaks:
        stack = tuple(getattr(leak, "stack", ()) or ())
        pystack = tuple(tuple(p) for p in (getattr(leak, "python_stack", ()) or ()))
        key = (stack, pystack)
        if key not in done:
            native = symbolize(stack, index, cache=cache, resolve=resolve, pid=pid) if stack else []
            done[key] = merge_python(drop_allocator_frames(native), pystack)
        leak.backtrace = done[key]
    return len(done)


def format_frame(n: int, f: Frame) -> str:
    """'#N 0xPC in FUNCTION FILE:LINE (MODULE+0xOFFSET)' as LSan prints it; unresolved:
    '#N 0xPC (MODULE+0xOFFSET) (BuildId: HEX)'; Python: '#N FUNCTION FILE:LINE (Python)'."""
    if f.python:
        where = f" {f.file}:{f.line}" if f.file else ""
        return f"#{n} {f.function or '??'}{where} (Python)"
    module = f.module
    text = f"#{n} {f.pc:#x}"
    if f.function:
        text += f" in {f.function}"
        if f.file:
            text += f" {f.file}" + (f":{f.line}" if f.line else "")
    text += f" ({module}+{f.offset:#x})" if f.module else f" ({UNKNOWN_MODULE})"
    if f.inlined:
        text += " (inlined)"
    if not f.function and f.build_id:
        text += f" (BuildId: {f.build_id})"
    return text
