"""_types.py: plain data shared by the pipeline stages.

Every range is half-open [begin, end). Nothing here knows about ptrace or /proc.
"""
from __future__ import annotations

import bisect
import mmap
import struct
from array import array
from operator import attrgetter
from typing import List, Optional, Protocol, Sequence, Tuple

# user_regs_struct word order on x86_64 (ptrace-snapshot.md section 3)
REG_NAMES: Tuple[str, ...] = (
    "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx", "rdx",
    "rsi", "rdi", "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base", "gs_base",
    "ds", "es", "fs", "gs",
)
RSP_INDEX = REG_NAMES.index("rsp")
FS_BASE_INDEX = REG_NAMES.index("fs_base")


class Fields:
    """Base of the plain data classes: their fields are the __slots__ (a subclass's after its
    base's), in __init__'s order. Gives them what @dataclass would: a repr of the fields (those
    named "_..." left out), == between objects of the same class with equal fields (so they are
    unhashable), and _replace(**changes) (dataclasses.replace). Issue 10, fast start: @dataclass
    builds its methods with exec, about 1 ms per class, 40 ms of `memunreachable check`."""
    __slots__ = ()
    _fields: tuple = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__slots__" not in cls.__dict__:
            return          # no fields of its own (it has a __dict__): its base's serve
        names = cls._fields + tuple(cls.__dict__["__slots__"])
        cls._fields = names
        # _values(obj): the field values in order (attrgetter of one name gives no tuple)
        cls._values = staticmethod(attrgetter(*names) if len(names) > 1 else
                                   lambda obj: tuple([getattr(obj, name) for name in names]))

    def _astuple(self) -> tuple:
        return self._values(self)

    def _replace(self, **changes):
        values = {name: getattr(self, name) for name in self._fields}
        values.update(changes)
        return type(self)(**values)

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._fields
                           if not name.startswith("_"))
        return f"{type(self).__qualname__}({fields})"

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values(self) == other._values(other)


class FrozenFields(Fields):
    """Fields that cannot be assigned after __init__ (set_fields sets them there), hashable
    (@dataclass(frozen=True))."""
    __slots__ = ()

    def __setattr__(self, name, value):
        raise AttributeError(f"cannot assign to field {name!r}")

    def __delattr__(self, name):
        raise AttributeError(f"cannot delete field {name!r}")

    def __hash__(self) -> int:
        return hash(self._values(self))

    def __reduce__(self):
        return type(self), self._values(self)


_set = object.__setattr__


def record(cls):
    """@dataclass(frozen=True) for plain records declared with annotations (and defaults): a
    FrozenFields class of the same name with the annotated names as fields, in order, and an
    __init__ taking them (the defaults filling in). Methods and properties stay. Only __init__
    is compiled (one small exec); the CPython layouts' 9 classes cost 10-17 ms of every import
    of the pipeline as dataclasses (plus the dataclasses module), 1-2 ms as records."""
    names = tuple(cls.__dict__.get("__annotations__", {}))
    defaults = {n: cls.__dict__[n] for n in names if n in cls.__dict__}
    ns = {k: v for k, v in cls.__dict__.items()
          if k not in names and k not in ("__dict__", "__weakref__")}
    ns["__slots__"] = names
    params = ", ".join(f"{n}=_d_{n}" if n in defaults else n for n in names)
    code = f"def __init__(self, {params}):\n    _set_fields(self, {', '.join(names)})\n"
    env = {"_set_fields": set_fields, **{f"_d_{n}": v for n, v in defaults.items()}}
    exec(code, env)     # noqa: S102 - names are the class's own identifiers
    ns["__init__"] = env["__init__"]
    ns["__init__"].__qualname__ = f"{cls.__qualname__}.__init__"
    return type(cls.__name__, (FrozenFields,), ns)


def set_fields(obj: FrozenFields, *values) -> None:
    """In a FrozenFields' __init__: its fields, in order, get `values`."""
    for name, value in zip(obj._fields, values):
        _set(obj, name, value)


class Range(FrozenFields):
    """Half-open address range [begin, end)."""
    __slots__ = ("begin", "end")

    def __init__(self, begin: int, end: int):
        _set(self, "begin", begin)      # not set_fields: ranges are made by the thousand
        _set(self, "end", end)

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return (self.begin, self.end) == (other.begin, other.end)

    def __hash__(self) -> int:
        return hash((self.begin, self.end))

    # ordered like (begin, end) tuples (@dataclass(order=True))
    def __lt__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return (self.begin, self.end) < (other.begin, other.end)

    def __le__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return (self.begin, self.end) <= (other.begin, other.end)

    def __gt__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return (self.begin, self.end) > (other.begin, other.end)

    def __ge__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return (self.begin, self.end) >= (other.begin, other.end)

    @property
    def size(self) -> int:
        return self.end - self.begin

    def contains(self, addr: int) -> bool:
        return self.begin <= addr < self.end

    def overlaps(self, other: "Range") -> bool:
        return self.begin < other.end and other.begin < self.end


class Mapping(FrozenFields):
    """One line of /proc/PID/maps."""
    __slots__ = ("begin", "end", "perms", "offset", "dev", "inode", "path")

    def __init__(self, begin: int, end: int,
                 perms: str,        # e.g. "rw-p"
                 offset: int, dev: str, inode: int,
                 path: str):        # "" for anonymous, "[heap]", "[stack]", a file path, ...
        set_fields(self, begin, end, perms, offset, dev, inode, path)

    @property
    def range(self) -> Range:
        return Range(self.begin, self.end)

    @property
    def readable(self) -> bool:
        return self.perms[0] == "r"

    @property
    def writable(self) -> bool:
        return self.perms[1] == "w"

    @property
    def executable(self) -> bool:
        return self.perms[2] == "x"

    @property
    def shared(self) -> bool:
        return self.perms[3] == "s"

    @property
    def anonymous(self) -> bool:
        """No backing file: plain anonymous, [heap], [stack], [anon:...], /anon_hugepage."""
        return self.inode == 0 or self.path.startswith("/anon_hugepage")


class ThreadState(FrozenFields):
    """What the freeze captured of one thread."""
    __slots__ = ("tid", "regs", "fpregs", "stop_signal")

    def __init__(self, tid: int,
                 regs: Tuple[int, ...],     # 27 words, REG_NAMES order
                 fpregs: bytes = b"",   # FP/SIMD state (fxsave/xsave area); scanned as root words
                 stop_signal: int = 0):     # signal to re-deliver at detach (0: none)
        set_fields(self, tid, regs, fpregs, stop_signal)

    @property
    def sp(self) -> int:
        return self.regs[RSP_INDEX]

    @property
    def fs_base(self) -> int:
        return self.regs[FS_BASE_INDEX]


class Memory(Protocol):
    """Read access to the (snapshot of the) target's memory."""

    def read(self, addr: int, size: int) -> bytes:
        """Bytes [addr, addr+size); unreadable pages read as zeros."""
        ...

    def read_into(self, addr: int, buf) -> int:
        """Fill the writable buffer buf with [addr, addr+len(buf)); return unreadable byte count."""
        ...


_Q = struct.Struct("<Q")


def read_u64(mem: Memory, addr: int) -> int:
    """The little-endian 8-byte word at addr of mem (unreadable: as mem.read says)."""
    return _Q.unpack(mem.read(addr, 8))[0]


class BufferMemory(Fields):
    """In-memory Memory for unit tests: {base: bytes} blocks; anything else reads as zeros."""
    __slots__ = ("blocks",)

    def __init__(self, blocks: Optional[dict] = None):
        self.blocks = {} if blocks is None else blocks

    def read(self, addr: int, size: int) -> bytes:
        out = bytearray(size)
        for base, data in self.blocks.items():
            lo = max(addr, base)
            hi = min(addr + size, base + len(data))
            if lo < hi:
                out[lo - addr:hi - addr] = data[lo - base:hi - base]
        return bytes(out)

    def read_into(self, addr: int, buf) -> int:
        mv = memoryview(buf).cast("B")
        mv[:] = self.read(addr, len(mv))
        return 0


class Allocator(FrozenFields):
    __slots__ = ("name", "version")

    def __init__(self, name: str,                   # "glibc"
                 version: Optional[str] = None):    # "2.36"; None when not found (static binaries)
        set_fields(self, name, version)


def _key(r: Range) -> tuple:
    return (r.begin, r.end)


def merge_ranges(ranges: Sequence[Range]) -> list:
    """Sorted, coalesced copy of ranges."""
    out: list = []
    for r in sorted(ranges, key=_key):      # a key: Range's generated __lt__ is 5x slower
        if r.begin >= r.end:
            continue
        if out and r.begin <= out[-1].end:
            if r.end > out[-1].end:
                out[-1] = Range(out[-1].begin, r.end)
        else:
            out.append(r)
    return out


def subtract_ranges(base: Sequence[Range], holes: Sequence[Range]) -> list:
    """Parts of `base` not covered by any of `holes` (both any order); result sorted."""
    cut = RangeCutter(holes)
    return [piece for r in merge_ranges(base) for piece in cut(r)]


class RangeCutter:
    """Cuts ranges by one set of holes, merged once: cut(r) is the parts of r outside every
    hole, ascending, in O(log holes + holes inside r)."""

    def __init__(self, holes: Sequence[Range]) -> None:
        self.holes = merge_ranges(holes)
        self.ends = [h.end for h in self.holes]

    def __call__(self, r: Range) -> List[Range]:
        out = []
        cur = r.begin
        i = bisect.bisect_right(self.ends, cur)
        while i < len(self.holes) and cur < r.end:
            h = self.holes[i]
            if h.begin >= r.end:
                break
            if h.begin > cur:
                out.append(Range(cur, h.begin))
            cur = max(cur, h.end)
            i += 1
        if cur < r.end:
            out.append(Range(cur, r.end))
        return out


class HeapImage(Fields):
    """The snapshot's allocations plus local copies of the memory that holds them.

    begins: user addresses, strictly ascending; sizes: usable sizes (malloc_usable_size);
    each an array('Q') or a 'Q' memoryview (the glibc walk's arrays compacted in place, a
    merged image's: u64_scratch), read-only for their users; regions: [(base, buffer)] sorted and disjoint, whose bytes
    cover every allocation (buffers are bytearray or mmap objects; after a low-memory walk a
    heap's buffer is a glibc/copies.Uncopied, read on demand: only mark() accepts those).
    """
    __slots__ = ("begins", "sizes", "regions")

    def __init__(self, begins, sizes, regions: list):
        self.begins = begins
        self.sizes = sizes
        self.regions = regions


_HEAP_BUFFERS = False
_UNCLEARED = None       # cffi allocator that does not zero (use_heap_buffers)


def use_heap_buffers() -> None:
    """From now on local_buffer gives bytearrays (the malloc heap), for a long-lived process
    that sweeps again and again with glibc told to keep what it frees (the in-process checks'
    helper, _tracer.py): a check then reuses the last check's pages instead of faulting fresh
    ones in (an idle pytest process's check: 7,300 page faults -> 50, system time 40 -> 25 ms)."""
    global _HEAP_BUFFERS
    _HEAP_BUFFERS = True


def u64_scratch(n: int) -> memoryview:
    """A 'Q' memoryview of n entries over local_buffer(zeroed=False): for an output a native
    pass writes before anything reads it (no zero fill of the whole length: 2 x 12 M entries
    of a Python process's merged image took 0.1 s of zeroing)."""
    return memoryview(local_buffer(8 * n, zeroed=False)).cast("Q")


MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)     # (Python 3.13+ names it)
_STRICT: List[bool] = []


def _strict_overcommit() -> bool:
    """Whether the kernel charges every private writable mapping in full (overcommit mode 2)."""
    if not _STRICT:
        try:
            with open("/proc/sys/vm/overcommit_memory") as f:
                _STRICT.append(f.read().strip() == "2")
        except (OSError, ValueError):
            _STRICT.append(True)            # unknown: as if strict
    return _STRICT[0]


def u64_reserve(n: int) -> Optional[memoryview]:
    """u64_scratch(n) as address space alone (MAP_NORESERVE: no commit charge, only the pages
    written cost memory), for an output whose size is known only by a generous bound; None
    when local buffers are malloc's, under strict overcommit (vm.overcommit_memory 2: there
    MAP_NORESERVE is ignored, and the whole bound would be charged, taking it from every
    process's allocations, the target's too), or when the kernel refuses it."""
    if _HEAP_BUFFERS or n * 8 < 4096 or _strict_overcommit():
        return None
    try:
        buf = mmap.mmap(-1, 8 * n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    except (OSError, OverflowError, ValueError):
        return None
    return memoryview(buf).cast("Q")


def extend_u64(out: array, values) -> None:
    """out += values: as bytes for an array('Q') or a 'Q' memoryview (array.extend would read
    a memoryview entry by entry), else entry by entry."""
    if isinstance(values, (array, memoryview)):
        out.frombytes(memoryview(values).cast("B"))
    else:
        out.extend(values)


def local_buffer(size: int, zeroed: bool = True):
    """A zeroed local buffer for a copy of target memory: a private anonymous mapping (a
    shared one, mmap.mmap(-1, n)'s default, pays shmem page faults and page-cache removal:
    16% of a small check's time here; reading 1 GiB into it took 1.8-2.8 s against 1.4 s).
    Not advised for huge pages: with THP defrag "madvise" the faults compact memory
    synchronously (2.2-2.4 s for the same read). A bytearray below a page, or always after
    use_heap_buffers(); there zeroed=False, for a buffer the caller overwrites whole (a read
    of target memory), gives malloc's memory as it is (a cffi buffer): zeroing the ~35 MB an
    idle pytest process's check copies cost 3-8 ms."""
    if size < 4096:
        return bytearray(size)
    if _HEAP_BUFFERS:
        if zeroed:
            return bytearray(size)
        from memunreachable._ffi import ffi
        global _UNCLEARED
        if _UNCLEARED is None:
            _UNCLEARED = ffi.new_allocator(should_clear_after_alloc=False)
        return ffi.buffer(_UNCLEARED("uint8_t[]", size))
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
