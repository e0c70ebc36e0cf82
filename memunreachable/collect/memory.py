"""memory.py: read the snapshot's (or the frozen target's) memory, completely or not at all.

ProcessMemory wraps an open /proc/<pid>/mem fd. The checker opens it (the ptrace access
check happens at open), and the forked sweeper reads through the inherited fd.

A result is valid or it is an error: a byte the sweep needs and cannot read raises
MemoryUnreadable; it is never counted as zero. Two kinds of memory are handled apart:
    tolerated  ranges whose pages may legitimately fail to read and cannot hold a pointer:
               file pages past the end of their file (the process itself would get SIGBUS
               there) and device memory (VmFlags io/pf). They read as zeros, counted in
               .tolerated_bytes.
    guarded    mappings that may hold guard pages (VmFlags gu: MADV_GUARD_INSTALL, Linux 6.13+;
               glibc 2.42+ puts each thread stack's guard inside its mapping that way). A
               guard page is no memory: it cannot be read (EIO) and holds nothing. Unreadable
               pages there read as zeros too, counted in .guard_bytes, with no warning.
    overlays   [(base, buffer)] copies of memory the fork snapshot cannot show: MADV_DONTFORK
               mappings are absent from a fork, MADV_WIPEONFORK ones read as zeros there
               (VmFlags dc / wf, proc(5); madvise(2)). They are read from the frozen target
               during the pause (capture()) and reads inside them come from the copies.
               Except the vDSO getrandom() states (is_getrandom_state): wiped in a fork too,
               but they hold no pointer, so they need no copy and are no roots.
plan_snapshot() compares the target's mappings (captured while frozen) with the snapshot's
smaps and says which ranges need an overlay and which are tolerated.
"""
from __future__ import annotations

import bisect
import mmap
import os
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence, Tuple

from memunreachable._errors import MemoryUnreadable
from memunreachable._ffi import buffer_of, check, ffi, lib
from memunreachable._types import Mapping, Range, RangeCutter, local_buffer, merge_ranges

PAGE = 4096
# mappings the kernel gives every process and the sweep never reads as memory
SPECIAL = ("[vvar]", "[vvar_vclock]", "[vdso]", "[vsyscall]")
DEVICE_FLAGS = frozenset({"io", "pf"})      # VM_IO, VM_PFNMAP: not ordinary memory
GUARD_FLAG = "gu"       # the mapping may hold MADV_GUARD_INSTALL guard pages (proc(5))


class ProcessMemory:
    def __init__(self, pid: int, fd: int = None, *, overlays: Sequence[Tuple[int, object]] = (),
                 tolerated: Sequence[Range] = (), guarded: Sequence[Range] = ()):
        self.pid = pid
        self.fd = fd if fd is not None else os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        self.overlays = sorted(overlays, key=lambda o: o[0])
        self.guarded = merge_ranges(guarded)
        self.tolerated = merge_ranges(list(tolerated) + list(self.guarded))
        self.tolerated_bytes = 0
        self.guard_bytes = 0

    def read(self, addr: int, size: int) -> bytes:
        buf = bytearray(size)
        self.read_into(addr, buf)
        return bytes(buf)

    # Fills buf with [addr, addr+len(buf)). Returns 0. Raises MemoryUnreadable naming the
    # first byte that could not be read outside the tolerated ranges.
    def read_into(self, addr: int, buf) -> int:
        fill(addr, memoryview(buf).cast("B"), self.overlays, self._read_fd)
        return 0

    # True when [addr, addr+size) is read from the fd alone (no overlay, nothing tolerated
    # meets it): the C core may then read it straight through self.fd (glibc/walker.py).
    def plain(self, addr: int, size: int) -> bool:
        end = addr + size
        return not any(base < end and addr < base + len(data) for base, data in self.overlays) \
            and not any(r.begin < end and addr < r.end for r in self.tolerated)

    def _read_fd(self, addr: int, mv: memoryview) -> None:
        first = ffi.new("uint64_t *")
        while len(mv):
            bad = check(lib.mu_read(self.fd, addr, buffer_of(mv), len(mv), first),
                        "read memory", pid=self.pid)
            if not bad:
                return
            t = next((r for r in self.tolerated if r.contains(first[0])), None)
            if t is None:
                raise MemoryUnreadable(
                    f"{bad} byte(s) of process {self.pid}'s memory from {first[0]:#x} could "
                    "not be read", address=first[0])
            end = min(t.end, addr + len(mv))
            if any(g.contains(first[0]) for g in self.guarded):
                self.guard_bytes += end - first[0]
            else:
                self.tolerated_bytes += end - first[0]
            mv = mv[end - addr:]
            addr = end

    def close(self) -> None:
        if self.fd is not None and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def fill(addr: int, mv: memoryview, pieces, read_gap) -> None:
    """Fills mv, the bytes [addr, addr+len(mv)), from the (base, data) pieces (ascending by
    base) that meet it, and the rest by read_gap(address, view of mv)."""
    end, pos = addr + len(mv), addr
    for base, data in pieces:
        if base >= end:
            break
        lo, hi = max(pos, base), min(end, base + len(data))
        if lo >= hi:
            continue
        if lo > pos:
            read_gap(pos, mv[pos - addr:lo - addr])
        mv[lo - addr:hi - addr] = memoryview(data).cast("B")[lo - base:hi - base]
        pos = hi
    if pos < end:
        read_gap(pos, mv[pos - addr:])


def plain_page(mem, page: int) -> Optional[bytes]:
    """The PAGE bytes at page (aligned) read whole from mem, when no overlay or tolerated range
    meets them (mem.plain) and they can be read; else None (the caller reads as before)."""
    plain = getattr(mem, "plain", None)
    if plain is None or not plain(page, PAGE):
        return None
    buf = bytearray(PAGE)
    try:
        mem.read_into(page, buf)
    except MemoryUnreadable:
        return None
    return bytes(buf)


class CopiedMemory:
    """A Memory reader that serves reads from local copies of the same snapshot when one copy
    holds the whole range, and from `mem` otherwise: the sweep reads each byte once (the
    walk's copies of anonymous memory hold pymalloc's arenas and most root memory)."""

    def __init__(self, mem, copies: Sequence[Tuple[int, object]],
                 file_pages: Sequence[Tuple[Range, tuple]] = ()):
        self.mem = mem
        self.copies = sorted(copies, key=lambda c: c[0])
        self.bases = [b for b, _ in self.copies]
        self._pages: dict = {}      # page address -> its bytes, or None: read() outside copies
        # [(range, (dev, inode, file offset of range.begin))] of pages that hold their file's
        # bytes only (private file mappings never written: SnapshotPlan.unwritten), sorted:
        # their pages are kept between sweeps by file identity (_FILE_PAGES)
        self._file = sorted(file_pages, key=lambda f: f[0].begin)
        self._file_begins = [r.begin for r, _ in self._file]
        # (base, next copy's base, buffer, end) of the copy view() served last
        self._last = (0, 0, b"", 0)

    # Returns a memoryview of [addr, addr+size) inside one copy (the last copy beginning at or
    # below addr), or None. That copy for the last hit's address is tried first: a stage reads
    # one structure's words in a row (~1,500 reads a check of a pytest process).
    def view(self, addr: int, size: int):
        base, below, buf, end = self._last
        if base <= addr < below and addr + size <= end:
            return memoryview(buf)[addr - base:addr - base + size]
        i = bisect.bisect_right(self.bases, addr) - 1
        if i >= 0:
            base, buf = self.copies[i]
            end = base + len(buf)
            if addr + size <= end:
                below = self.bases[i + 1] if i + 1 < len(self.bases) else end
                self._last = (base, below, buf, end)
                return memoryview(buf)[addr - base:addr - base + size]
        return None

    # A small read outside the copies is served from whole pages read once and kept (type
    # names in the runtime's .rodata, ld.so's dynamic sections: ~120 reads of a few pages a
    # pytest-process check, one pread each before). Only pages no overlay or tolerated range
    # meets are cached (mem.plain); anything else, or a page that cannot be read, goes to
    # mem.read as before (same bytes, same errors).
    def read(self, addr: int, size: int) -> bytes:
        view = self.view(addr, size)
        if view is not None:
            return bytes(view)
        if 0 < size <= PAGE:
            first = addr & ~(PAGE - 1)
            pages = [self._page(p) for p in range(first, addr + size, PAGE)]
            if all(pg is not None for pg in pages):
                data = pages[0] if len(pages) == 1 else b"".join(pages)
                return data[addr - first:addr - first + size]
        return self.mem.read(addr, size)

    def _page(self, page: int):
        if page in self._pages:
            return self._pages[page]
        key = self._file_key(page)
        if key is not None:
            data = _FILE_PAGES.get(key)
            if data is not None:
                self._pages[page] = data
                return data
        data = plain_page(self.mem, page)
        self._pages[page] = data
        if key is not None and data is not None:
            if len(_FILE_PAGES) >= _FILE_PAGES_MAX:
                _FILE_PAGES.clear()
            _FILE_PAGES[key] = data
        return data

    def _file_key(self, page: int):
        """(dev, inode, file offset) of a page of an unwritten file mapping, else None."""
        i = bisect.bisect_right(self._file_begins, page) - 1
        if i < 0:
            return None
        r, (dev, inode, offset) = self._file[i]
        if not page + PAGE <= r.end:
            return None
        return dev, inode, offset + (page - r.begin)

    # Fills buf with [addr, addr+len(buf)); returns 0 or raises as mem.read_into does. The
    # parts that copies hold come from them, only the rest from mem: the pool scan's windows
    # are whole anonymous mappings, which the walk copies in parts when long untouched runs
    # split them; a window no single copy held was read again whole (11 MB, 3.2 ms of a
    # pytest process's 40 ms check, while the copies also left out short untouched ends).
    def read_into(self, addr: int, buf) -> int:
        mv = memoryview(buf).cast("B")
        view = self.view(addr, len(mv))
        if view is not None:
            mv[:] = view
        else:
            first = max(0, bisect.bisect_right(self.bases, addr) - 1)
            fill(addr, mv, self.copies[first:], self.mem.read_into)
        return 0

    def __getattr__(self, name):            # pid, tolerated_bytes, ...: the reader's own
        return getattr(self.mem, name)


# Pages of files, by (dev, inode, offset), read from the unwritten file mappings of earlier
# sweeps (CopiedMemory file_pages): a file's bytes are the same in every process that maps it,
# and the pytest plugin's helper reads the same ~50 pages of libpython's .rodata (type names)
# every check, each read faulting the page into the new snapshot process (~60 us each).
_FILE_PAGES: dict = {}
_FILE_PAGES_MAX = 1024


def unwritten_file_pages(maps: Sequence[Mapping], unwritten: Sequence[Range]):
    """CopiedMemory's file_pages: the parts of `unwritten` (SnapshotPlan.unwritten) inside
    each private mapping of a loaded object's file (one with code mapped: a library or the
    executable, which nothing rewrites while they run; not a data file, which another
    process may write), with its file identity (dev, inode, offset of the part)."""
    holes = sorted(unwritten, key=lambda r: r.begin)
    ends = [r.end for r in holes]
    objects = {m.path for m in maps if m.executable and m.inode}
    out = []
    for m in maps:
        if not m.inode or m.shared or not m.path.startswith("/") or m.path not in objects:
            continue
        i = bisect.bisect_right(ends, m.begin)
        while i < len(holes) and holes[i].begin < m.end:
            lo, hi = max(m.begin, holes[i].begin), min(m.end, holes[i].end)
            if lo < hi:
                out.append((Range(lo, hi), (m.dev, m.inode, m.offset + (lo - m.begin))))
            i += 1
    return out


# Returns a buffer holding [addr, addr+size) of mem: a view of a copy mem already holds
# (CopiedMemory), else a new local buffer read from mem (raises as mem.read_into does).
# The pool walk's windows are mostly the glibc walk's copies: viewed, not copied again.
def local_copy(mem, addr: int, size: int):
    view = mem.view(addr, size) if isinstance(mem, CopiedMemory) else None
    if view is not None:
        return view
    buf = local_buffer(size, zeroed=False)
    mem.read_into(addr, buf)
    return buf


# The vDSO getrandom() states: issue 22. Linux 6.11 added getrandom() to the vDSO; it keeps a
# per-thread opaque state in user memory (struct vgetrandom_state, lib/vdso/getrandom.c: a
# ChaCha20 key, a batch of its output, the RNG generation counter, a position and an in-use
# byte: random bytes and counters, never an address). The kernel tells user space how to map
# it (the vDSO's getrandom(NULL, 0, 0, &params, ~0UL) -> vgetrandom_opaque_params): PROT_READ |
# PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_DROPPABLE. MAP_DROPPABLE (Linux 6.11, 64-bit
# only; mm/mmap.c do_mmap) gives the mapping VM_DROPPABLE plus VM_WIPEONFORK, VM_DONTDUMP and
# VM_NORESERVE: smaps VmFlags "dp wf dd nr" (next to "rd wr mr mw me"). glibc 2.41+ maps the
# states so on a thread's first getrandom() (sysdeps/unix/sysv/linux/getrandom.c,
# vgetrandom_get_state_alloc: a page or a few at a time, the allocator's record is the static
# grnd_alloc; adjacent pages may merge into one mapping, others lie apart), named
# "[anon: glibc: getrandom]" when the glibc.mem.decorate_maps tunable is on and the kernel has
# CONFIG_ANON_VMA_NAME; Go 1.24+'s runtime maps its states with the same flags. Every CPython
# calls getrandom() at start-up, so on glibc 2.41 every Python process has such a page.
# Why it is safe to read none as pointers: VM_DROPPABLE is set by mmap(MAP_DROPPABLE) only (no
# madvise sets it), and the kernel may free a droppable page at any time under memory
# pressure, after which it reads as zeros: memory whose contents may vanish cannot be what
# keeps a block alive, whoever mapped it. So such a mapping is neither missing from a
# snapshot (nothing to copy during a second pause) nor a root. Everything else a fork does not
# copy keeps the rule above: an application's madvise(MADV_WIPEONFORK) or MADV_DONTFORK buffer
# has no "dp" and is copied during the pause, and so is anything shared, file-backed,
# executable, named by someone else, or larger than GETRANDOM_MAX_BYTES.
GETRANDOM_FLAGS = frozenset({"wf", "dd", "nr", "dp"})   # what MAP_DROPPABLE gives, all of it
GETRANDOM_NAMES = ("", "[anon: glibc: getrandom]")      # unnamed, or glibc's decorated name
# 16 MiB: glibc's states are a cache line each (~21 a page): 16 MiB holds ~86,000 threads'
GETRANDOM_MAX_BYTES = 16 << 20


def is_getrandom_state(m: Mapping, flags: frozenset) -> bool:
    """True when mapping m, with its smaps VmFlags `flags`, is vDSO getrandom() state memory:
    private anonymous read-write memory that mmap(MAP_DROPPABLE) made (all of GETRANDOM_FLAGS),
    unnamed or named by glibc, at most GETRANDOM_MAX_BYTES. It holds no pointers."""
    return (GETRANDOM_FLAGS <= flags and m.perms == "rw-p" and m.inode == 0
            and m.path in GETRANDOM_NAMES and m.end - m.begin <= GETRANDOM_MAX_BYTES)


@dataclass
class SnapshotPlan:
    """missing: readable ranges of the target that the snapshot lacks or wiped (overlays
    needed); tolerated: ranges whose unreadable pages are legitimate; notes: why, per range;
    unwritten: private file mappings the process never wrote (no anonymous page, resident or
    swapped): they hold only the file's bytes, never a pointer the process stored, so they
    are not roots (a library's .rodata, .eh_frame, an untouched .data: 70% of the root bytes
    of a pytest process), and the ranges of no_pointers, which are no roots either;
    no_pointers: vDSO getrandom() states (is_getrandom_state): wiped in the snapshot, but
    holding no pointer, so they are neither missing nor roots; guarded: mappings that may
    hold guard pages (VmFlags gu), read with ProcessMemory(guarded=...)."""
    missing: List[Range] = field(default_factory=list)
    tolerated: List[Range] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    unwritten: List[Range] = field(default_factory=list)
    no_pointers: List[Range] = field(default_factory=list)
    guarded: List[Range] = field(default_factory=list)

    @property
    def missing_bytes(self) -> int:
        return sum(r.size for r in self.missing)

    def why_missing(self, shown: int = 3) -> str:
        """The notes, the first `shown` of them and how many more."""
        more = len(self.notes) - shown
        return "; ".join(self.notes[:shown]) + (f"; and {more} more" if more > 0 else "")

    def copy(self) -> "SnapshotPlan":
        """The same plan in new lists."""
        return SnapshotPlan(list(self.missing), list(self.tolerated), list(self.notes),
                            list(self.unwritten), list(self.no_pointers), list(self.guarded))


def _needs_reading(m: Mapping) -> bool:
    return m.readable and m.path not in SPECIAL and not m.path.startswith("/dev/")


# Returns what a sweep of `snapshot_smaps` (the snapshot's [(Mapping, VmFlags)]) needs besides
# the snapshot, given the target's mappings at the freeze. file_size(path, mapping) gives the
# size of a file-backed mapping's file (None when unknown: then nothing past it is tolerated).
def plan_snapshot(target_maps: Sequence[Mapping], snapshot_smaps: Sequence[Tuple[Mapping, frozenset]],
                  file_size=None) -> SnapshotPlan:
    # the same inputs as last time (the plugin's helper, one check after every test: the same
    # Mapping objects, procfs.parse_maps keeps them): the same plan, in new lists
    global _LAST_PLAN
    sizes = tuple([file_size(m) for m in target_maps if _needs_reading(m)
                   and m.path.startswith("/")]) if file_size is not None else None
    key = (tuple(target_maps), tuple(snapshot_smaps), sizes)
    if _LAST_PLAN is not None and _LAST_PLAN[0] == key:
        return _LAST_PLAN[1].copy()
    plan = _plan_snapshot(target_maps, snapshot_smaps, file_size)
    _LAST_PLAN = (key, plan.copy())
    return plan


_LAST_PLAN: Optional[tuple] = None      # plan_snapshot's last (inputs, plan)


def _plan_snapshot(target_maps: Sequence[Mapping],
                   snapshot_smaps: Sequence[Tuple[Mapping, frozenset]],
                   file_size=None) -> SnapshotPlan:
    plan = SnapshotPlan()
    absent = RangeCutter([m.range for m, _ in snapshot_smaps])     # cut by what is present
    for m, flags in snapshot_smaps:
        if is_getrandom_state(m, flags):
            plan.no_pointers.append(m.range)
            continue
        if m.path.startswith("/") and m.inode and not m.shared and "written" not in flags:
            plan.unwritten.append(m.range)
        if GUARD_FLAG in flags:
            plan.guarded.append(m.range)
        if flags & DEVICE_FLAGS:
            plan.tolerated.append(m.range)
        elif _wiped(m, flags):
            plan.missing.append(m.range)
            plan.notes.append(f"{m.begin:#x}-{m.end:#x} is MADV_WIPEONFORK")
    for m in target_maps:
        if not _needs_reading(m):
            continue
        gone = absent(m.range)
        if gone:
            plan.missing.extend(gone)
            plan.notes.append(_dontfork_note(m))
        if m.path.startswith("/") and file_size is not None:
            size = file_size(m)
            if size is not None:
                valid = max(0, size - m.offset)         # file bytes this mapping shows
                first_past = m.begin + (valid + PAGE - 1) // PAGE * PAGE
                if first_past < m.end:
                    plan.tolerated.append(Range(first_past, m.end))
    plan.missing = merge_ranges(plan.missing)
    plan.tolerated = merge_ranges(plan.tolerated)
    plan.guarded = merge_ranges(plan.guarded)
    plan.no_pointers = merge_ranges(plan.no_pointers)
    plan.unwritten = merge_ranges(plan.unwritten + plan.no_pointers)
    return plan


def _wiped(m: Mapping, flags: frozenset) -> bool:
    """A fork shows mapping m (VmFlags flags) as zeros where it holds pointers (wf)."""
    return "wf" in flags and m.readable and m.writable and not m.shared \
        and not flags & DEVICE_FLAGS and not is_getrandom_state(m, flags)


def _dontfork_note(m: Mapping) -> str:
    return f"{m.begin:#x}-{m.end:#x} {m.path or '(anonymous)'} is not in the snapshot (MADV_DONTFORK)"


# Returns (ranges, notes): what a fork snapshot of the process will lack, known from the
# process's own smaps before the clone (VmFlags dc: VM_DONTCOPY, absent from a fork; wf:
# VM_WIPEONFORK, zeros there), so that the one pause that takes the snapshot copies it too.
def lacking_in_fork(target_smaps: Sequence[Tuple[Mapping, frozenset]]
                    ) -> Tuple[List[Range], List[str]]:
    ranges, notes = [], []
    for m, flags in target_smaps:
        if "dc" in flags and _needs_reading(m) and not flags & DEVICE_FLAGS:
            ranges.append(m.range)
            notes.append(_dontfork_note(m))
        elif _wiped(m, flags):
            ranges.append(m.range)
            notes.append(f"{m.begin:#x}-{m.end:#x} is MADV_WIPEONFORK")
    return merge_ranges(ranges), notes


def mapped_file_size(pid: int, objects: frozenset = frozenset()):
    """file_size callback for plan_snapshot: through map_files (deleted files too), else path;
    one stat per file (a library has 4-5 mappings). The sizes of `objects` (paths of loaded
    ELF objects, classify.loaded_objects: files that do not change while mapped) are kept
    between calls by (device, inode, path): 40 stats of map_files took 1.4 ms a check of the
    pytest plugin's helper. A data file's size is asked again every time."""
    sizes: dict = {}

    def size(m: Mapping):
        key = (m.dev, m.inode, m.path)
        if key in _OBJECT_SIZES:
            return _OBJECT_SIZES[key]
        if key not in sizes:
            sizes[key] = None
            for path in (f"/proc/{pid}/map_files/{m.begin:x}-{m.end:x}", m.path):
                try:
                    sizes[key] = os.stat(path).st_size
                    break
                except OSError:
                    continue
            if sizes[key] is not None and m.path in objects:
                if len(_OBJECT_SIZES) >= 4096:
                    _OBJECT_SIZES.clear()
                _OBJECT_SIZES[key] = sizes[key]
        return sizes[key]
    return size


_OBJECT_SIZES: dict = {}    # mapped_file_size of loaded objects: (dev, inode, path) -> size


# Returns [(base, buffer)] copies of `ranges` read from process `pid` (frozen by the caller).
# Raises MemoryUnreadable when a byte cannot be read (the caller then cannot use the snapshot).
def capture(pid: int, ranges: Iterable[Range]) -> List[Tuple[int, object]]:
    with ProcessMemory(pid) as mem:
        return read_copies(mem, ranges)


def _mapped(buf) -> bool:
    """Whether buf is a mapping of its own, or a view of one (copies.Backing)."""
    return isinstance(buf, mmap.mmap) or (isinstance(buf, memoryview)
                                          and isinstance(buf.obj, mmap.mmap))


# Fills every (address, buffer) pair from mem, as mem.read_into(address, buffer) each would.
# Returns a list parallel to pairs: None for a filled buffer, the MemoryUnreadable its
# read_into raised otherwise (other errors propagate). When mem is a ProcessMemory and no
# pair meets an overlay or a tolerated range, the reads are one native call (mu_read_walk
# without walks: 1 MiB pieces over one thread per CPU, destination pages populated first)
# instead of one call each (a pytest process: 250 anonymous ranges, 14 MB, read at 0.5 GB/s
# one by one); a pair with unreadable bytes is then read again through read_into, which
# decides as always (MemoryUnreadable naming the first bad byte).
# sparse: the buffers that are mmap objects (local_buffer's private anonymous mappings), or
# page-aligned views of one (copies.Backing): their pages read as all zeros are released
# (they still read as zeros; an untouched thread stack then costs no memory: 64 MiB for the
# bench target's 8 threads).
def read_many(mem, pairs: Sequence[Tuple[int, object]], sparse: bool = False) -> list:
    errors: list = [None] * len(pairs)
    batch = isinstance(mem, ProcessMemory) and len(pairs) > 1 and \
        all(mem.plain(addr, memoryview(buf).nbytes) for addr, buf in pairs)
    redo = range(len(pairs))
    if batch:
        tab = ffi.new("mu_read_job[]", len(pairs))
        keep = []
        for k, (addr, buf) in enumerate(pairs):
            n = memoryview(buf).nbytes
            tab[k].addr, tab[k].len, tab[k].first = addr, n, 0
            if n:
                keep.append(ffi.from_buffer("uint8_t[]", buf))
                tab[k].buf = keep[-1]
            # a mapping's pages (or a page-aligned view's) that read as zeros are released
            if sparse and n and _mapped(buf) and int(ffi.cast("uintptr_t", keep[-1])) % 4096 == 0:
                tab[k].drop = lib.MU_READ_SPARSE
        check(lib.mu_read_walk(mem.fd, tab, len(pairs)), "read memory", pid=mem.pid)
        redo = [k for k in range(len(pairs)) if tab[k].bad]
        for k in redo:
            check(tab[k].bad if tab[k].bad < 0 else 0, "read memory", pid=mem.pid)
        del keep
    for k in redo:
        try:
            mem.read_into(*pairs[k])
        except MemoryUnreadable as exc:
            errors[k] = exc
    return errors


# Returns [(base, buffer)] copies of `ranges` read from mem. An unreadable range raises
# MemoryUnreadable, or is left out when skip_unreadable (a later read of it raises then).
# packed: the buffers are views of one local buffer (many small ranges: no mapping each).
def read_copies(mem, ranges: Iterable[Range], skip_unreadable: bool = False,
                packed: bool = False):
    if packed:
        ranges = list(ranges)
        whole = memoryview(local_buffer(sum(r.size for r in ranges), zeroed=False))
        pairs, at = [], 0
        for r in ranges:
            pairs.append((r.begin, whole[at:at + r.size]))
            at += r.size
    else:
        pairs = [(r.begin, local_buffer(r.size, zeroed=False)) for r in ranges]
    out = []
    for pair, err in zip(pairs, read_many(mem, pairs, sparse=True)):
        if err is not None:
            if not skip_unreadable:
                raise err
            continue
        out.append(pair)
    return out
