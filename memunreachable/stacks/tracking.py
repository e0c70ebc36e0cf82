"""tracking.py: allocation stacks from the tracking table in the snapshot (stage 8b).

A process started by `memunreachable run` has the tracking library (native/mu_track.c)
preloaded: it keeps, in one private anonymous mapping of its own, a table of live blocks
(address -> stack id) and a table of deduplicated stacks (native/mu_track.h is the layout;
this module mirrors it: change both and bump the version). Here, in the sweeper:

    table = find_table(mem, maps)    # None when the target is not tracked
    table.cuts                       # the table's mapping: never a root (it points at
                                     # every live block), cut out with classify's extra_cuts
    table.annotate(address, size)    # -> Annotation(stack, python_stack, status,
                                     #    requested size)
    table.summary()                  # -> info.tracking

The reader takes no lock: the writer publishes a slot (stack id and size, then the address)
and a rebuilt shard table (a complete copy, then its offset) with single stores, so the
fork snapshot shows each slot and each shard whole. Python frames are stored as (code
object address, bytecode offset) pairs and resolved here, from the code objects in the
snapshot (name, file, and the line from the code's line table: co_lnotab on 3.8/3.9, the
PEP 626 co_linetable on 3.10, the location table on 3.11+; the header says which).
"""
from __future__ import annotations

import struct
from typing import Dict, List, Optional, Sequence, Tuple

from memunreachable._errors import MemoryUnreadable
from memunreachable._types import Fields, Mapping, Range

MAGIC = b"MUTRACK\0"
VERSION = 3                             # 1 (224-byte header, 3.11+ frames) and 2 are read too
MAP_NAME = "[anon:memunreachable-track]"
STACK_FULL = 0xFFFFFFFF
SIZE_UNKNOWN = 0xFFFFFFFF               # an entry's size field: the request was >= this
EMPTY, TOMB = 0, 1
MAX_DEPTH, MAX_PY = 32, 16
UNWINDERS = {1: "fp", 2: "libgcc", 3: "libunwind"}
F_ENABLED, F_PYTHON = 1, 2
# py_linetable: the format of the bytes at co_linetable (MU_TRACK_LT_*)
LT_LNOTAB, LT_310, LT_LOCATIONS = 1, 2, 3

# struct mu_track_header (native/mu_track.h), 240 bytes; version 2 ended at epoch (then
# `reserved`), version 1 at generation
HEADER = struct.Struct("<8sII QQQ IIII QQQ QQQ QQQ QQQQQ II IIIII III QQ II Q")
HEADER_V2 = struct.Struct(HEADER.format[:-2])
HEADER_V1 = struct.Struct(HEADER.format[:-5])
_FIELDS = ("magic version header_size self map_size budget max_depth max_py nshards flags "
           "shards_off sindex_off sindex_cap stack_arena_off stack_arena_size stack_arena_used "
           "live_arena_off live_arena_size live_arena_used stacks table_full_blocks "
           "dropped_blocks inserts removes py_version unwinder co_filename co_name co_qualname "
           "co_firstlineno co_linetable str_ascii_data str_compact_data str_state pid "
           "generation py_linetable epoch started").split()
SHARD = struct.Struct("<QIIIIQ")        # table_off, log2cap, used, tombs, lock, seq
ENTRY = struct.Struct("<QIII4x")        # addr, stack, size, epoch
ENTRY_V2 = struct.Struct("<QII")        # versions 1 and 2: addr, stack, size
# PyBytesObject (3.8-3.15, checked with offsetof; 3.13.0-3.15.2 also in _Py_DebugOffsets'
# bytes_object): ob_size at 16, bytes at 32;
# PyObject.ob_type at 8, PyTypeObject.tp_name at 24
BYTES_SIZE, BYTES_DATA, OB_TYPE, TP_NAME = 16, 32, 8, 24
STALE = ("<stale code object>", "", 0)

_M64 = (1 << 64) - 1


def addr_hash(addr: int) -> int:
    """mu_track_addr_hash() of native/mu_track.h (one hash per 1 KiB window)."""
    h = addr >> 10
    h ^= h >> 33
    h = (h * 0xff51afd7ed558ccd) & _M64
    h ^= h >> 33
    h = (h * 0xc4ceb9fe1a85ec53) & _M64
    h ^= h >> 33
    return h


def first_slot(addr: int, h: int, mask: int) -> int:
    """mu_track_first_slot() of native/mu_track.h."""
    return (((h >> 8) << 6) | ((addr >> 4) & 63)) & mask


class Annotation(Fields):
    __slots__ = ("stack", "python_stack", "status", "requested", "epoch")

    def __init__(self, stack: Tuple[int, ...] = (),
                 python_stack: Optional[List[Tuple[str, str, int]]] = None,
                 status: str = "untracked",   # "recorded" | "untracked" | "table_full"
                 requested: Optional[int] = None,   # the size asked for (malloc's n), if known
                 epoch: Optional[int] = None):      # the header's epoch when it was recorded
        self.stack = stack
        self.python_stack = [] if python_stack is None else python_stack
        self.status = status
        self.requested = requested
        self.epoch = epoch


def parse_header(data: bytes) -> Optional[dict]:
    """The header as a dict, or None when data does not start with a valid version-3, 2 or 1
    header. A version-1 header gets py_linetable = LT_LOCATIONS (it recorded Python frames of
    3.11+ only); versions 1 and 2 get epoch 0 and started 0 (not known)."""
    if len(data) < HEADER_V1.size or data[:8] != MAGIC:
        return None
    version, size = struct.unpack_from("<II", data, 8)
    if version == 1 and size == HEADER_V1.size:
        h = dict(zip(_FIELDS, HEADER_V1.unpack_from(data)))
        h.update(py_linetable=LT_LOCATIONS, epoch=0, started=0)
        return h
    layout = {2: HEADER_V2, VERSION: HEADER}.get(version)
    if layout is None or size != layout.size or len(data) < layout.size:
        return None
    h = dict(zip(_FIELDS, layout.unpack_from(data)))
    h.setdefault("started", 0)
    if version == 2:
        h["epoch"] = 0                          # `reserved` then
    if h["flags"] & F_PYTHON and h["py_linetable"] not in LINE_DECODERS:
        return None
    return h


def validate(h: dict, m: Mapping) -> Optional[str]:
    """None when header h fits mapping m; else why not (a copy of the magic elsewhere, a
    torn or foreign table)."""
    size = m.end - m.begin
    if h["self"] != m.begin:
        return f"header says it lives at {h['self']:#x}, not {m.begin:#x}"
    if h["map_size"] != size:
        return f"header says {h['map_size']} bytes, the mapping has {size}"
    n, cap = h["nshards"], h["sindex_cap"]
    if not n or n & (n - 1) or not cap or cap & (cap - 1):
        return "shard count or stack index size is not a power of two"
    if not 1 <= h["max_depth"] <= MAX_DEPTH or h["max_py"] > MAX_PY:
        return "stack depth out of range"
    ends = (h["shards_off"] + n * SHARD.size, h["sindex_off"] + 8 * cap,
            h["stack_arena_off"] + h["stack_arena_size"], h["live_arena_off"] + h["live_arena_size"])
    if any(e > size for e in ends):
        return "a table extends past the mapping"
    return None


def holds_table(mem, m: Mapping) -> bool:
    """Whether mapping m is a tracking table's (its name, or its magic where the kernel does
    not name anonymous mappings): no chunk of the heap lies there."""
    if m.path == MAP_NAME:
        return True
    if m.path or m.shared or not m.anonymous or m.end - m.begin < 1 << 20:
        return False
    try:
        return mem.read(m.begin, 8) == MAGIC
    except (MemoryUnreadable, OSError):
        return False


def find_table(mem, maps: Sequence[Mapping]) -> Optional["TrackingTable"]:
    """The tracking table of the snapshot, or None. Candidates are private anonymous rw
    mappings (named [anon:memunreachable-track] where the kernel names them); the header
    is at the start of the mapping (the library puts PROT_NONE pages around it)."""
    for m in maps:
        if not (m.readable and m.writable and not m.shared and m.anonymous
                and m.path in ("", MAP_NAME)) or m.end - m.begin < 1 << 20:
            continue
        try:
            if mem.read(m.begin, 8) != MAGIC:
                continue
            h = parse_header(mem.read(m.begin, HEADER.size))  # the longest layout
        except (MemoryUnreadable, OSError):     # a page the snapshot cannot show: not ours
            continue
        if h is None or validate(h, m) is not None:
            continue
        return TrackingTable(mem, h, m)
    return None


def modules(maps: Sequence[Mapping]) -> List[Tuple[int, int, int, str]]:
    """info.modules: (begin, end, file offset, path) of the executable file mappings, for
    symbolization after the target and the snapshot are gone."""
    return [(m.begin, m.end, m.offset, m.path) for m in maps
            if m.executable and m.path and not m.path.startswith("[") and not m.anonymous]


class TrackingTable:
    """Reader of one tracking table in a snapshot (mem: the Memory protocol)."""

    def __init__(self, mem, header: dict, mapping: Mapping):
        self.mem, self.h, self.mapping = mem, header, mapping
        self.base = mapping.begin
        raw = mem.read(self.base + header["shards_off"], header["nshards"] * SHARD.size)
        self.shards = [SHARD.unpack_from(raw, i * SHARD.size) for i in range(header["nshards"])]
        self._tables: Dict[int, Tuple[bytes, int]] = {}
        self._stacks: Dict[int, Tuple[Tuple[int, ...], List[Tuple[str, str, int]]]] = {}
        self._code: Dict[int, Tuple[str, str, int, bytes]] = {}
        self.entry = ENTRY if header["version"] >= 3 else ENTRY_V2
        # recording stopped (track --stop, track_here.stop()): frees went past the table since,
        # so its entries may be stale: no stack is read from it (it is still no root)
        self.enabled = bool(header["flags"] & F_ENABLED)

    @property
    def cuts(self) -> List[Range]:
        return [self.mapping.range]

    def summary(self) -> dict:
        h = self.h
        return {"version": h["version"],
                "live_blocks": sum(s[2] for s in self.shards),
                "stacks": h["stacks"],
                "table_full_blocks": h["table_full_blocks"],
                "dropped_blocks": h["dropped_blocks"],
                "budget_bytes": h["budget"],
                "used_bytes": h["sindex_cap"] * 8 + h["stack_arena_used"] + h["live_arena_used"],
                "max_depth": h["max_depth"],
                "unwinder": UNWINDERS.get(h["unwinder"], str(h["unwinder"])),
                "python": (f"{h['py_version'] >> 24}.{(h['py_version'] >> 16) & 0xff}"
                           if h["flags"] & F_PYTHON else None),
                "recording": self.enabled,
                # when recording began (Unix time, s); None when the table does not say
                "started": h["started"] / 1e9 if h["started"] else None}

    # -- live table ---------------------------------------------------------------------
    def _table(self, shard: int) -> Tuple[bytes, int]:
        t = self._tables.get(shard)
        if t is None:
            off, log2, _, _, _, _ = self.shards[shard]
            size = self.entry.size
            if not off or log2 > 40 or off + (size << log2) > self.mapping.end - self.base:
                t = (b"", 0)
            else:
                t = (self.mem.read(self.base + off, size << log2), (1 << log2) - 1)
            self._tables[shard] = t
        return t

    def lookup(self, address: int) -> Optional[Tuple[int, int, int]]:
        """(stack id, recorded size, epoch) of the live block at address, or None."""
        h = addr_hash(address)
        data, mask = self._table(h & (self.h["nshards"] - 1))
        if not data:
            return None
        p, entry = first_slot(address, h, mask), self.entry
        for _ in range(mask + 1):
            a, stack, size, *epoch = entry.unpack_from(data, p * entry.size)
            if a == address:
                return stack, size, epoch[0] if epoch else 0
            if a == EMPTY:
                return None
            p = (p + 1) & mask
        return None

    # -- stacks -------------------------------------------------------------------------
    def stack(self, stack_id: int) -> Tuple[Tuple[int, ...], List[Tuple[str, str, int]]]:
        """(native pcs, Python frames) of a stack id; ((), []) when it cannot be read."""
        got = self._stacks.get(stack_id)
        if got is not None:
            return got
        got = ((), [])
        off = stack_id * 8
        if 8 <= off < self.h["stack_arena_used"] and off + 8 <= self.h["stack_arena_size"]:
            addr = self.base + self.h["stack_arena_off"] + off
            _, nf, npy = struct.unpack("<IHH", self.mem.read(addr, 8))
            if nf <= MAX_DEPTH and npy <= MAX_PY:
                words = struct.unpack(f"<{nf + 2 * npy}Q", self.mem.read(addr + 8, 8 * (nf + 2 * npy)))
                py = [self.python_frame(words[nf + i], words[nf + npy + i]) for i in range(npy)]
                got = (tuple(words[:nf]), py)
        self._stacks[stack_id] = got
        return got

    def annotate(self, address: int, usable_size: int) -> Annotation:
        """Stack, status and requested size of the block at address (usable_size: its size
        in the heap; a recorded size larger than that is a stale entry, i.e. untracked). The
        table keeps the size the program asked for (u32: SIZE_UNKNOWN from 4 GiB up)."""
        hit = self.lookup(address) if self.enabled else None
        if hit is None or hit[1] > usable_size:
            return Annotation()
        requested = hit[1] if hit[1] != SIZE_UNKNOWN else None
        if hit[0] == STACK_FULL:
            return Annotation(status="table_full", requested=requested, epoch=hit[2])
        pcs, py = self.stack(hit[0])
        return Annotation(pcs, py, "recorded", requested, hit[2])

    # -- Python frames ------------------------------------------------------------------
    def python_frame(self, code: int, offset: int) -> Tuple[str, str, int]:
        """(function, file, line) of a frame executing `code` at byte `offset`."""
        if code in self._code:
            info = self._code[code]
        else:
            try:
                info = self._read_code(code)
            except (MemoryUnreadable, OSError, ValueError, OverflowError, struct.error):
                info = None     # freed since (at exit, finalization frees code objects)
            self._code[code] = info
        if info is None:
            return STALE
        name, filename, first, table = info
        if offset >= 1 << 63:           # before the first instruction (an incomplete frame)
            return name, filename, first
        line = LINE_DECODERS[self.h["py_linetable"]](table, first, offset)
        return name, filename, line if line is not None else first

    def _read_code(self, code: int):
        h, mem = self.h, self.mem
        (tp,) = struct.unpack("<Q", mem.read(code + OB_TYPE, 8))
        if not tp:
            return None
        (tp_name,) = struct.unpack("<Q", mem.read(tp + TP_NAME, 8))
        if mem.read(tp_name, 5) != b"code\0":
            return None
        word = lambda off: struct.unpack("<Q", mem.read(code + off, 8))[0]   # noqa: E731
        name = self._str(word(h["co_qualname"] if h["co_qualname"] else h["co_name"]))
        filename = self._str(word(h["co_filename"]))
        (first,) = struct.unpack("<i", mem.read(code + h["co_firstlineno"], 4))
        table = word(h["co_linetable"])
        (n,) = struct.unpack("<q", mem.read(table + BYTES_SIZE, 8)) if table else (0,)
        data = mem.read(table + BYTES_DATA, n) if 0 < n < 1 << 24 else b""
        if name is None or filename is None:
            return None
        return name, filename, first, data

    def _str(self, obj: int) -> Optional[str]:
        """A compact str object of the snapshot, or None."""
        if not obj:
            return None
        h, mem = self.h, self.mem
        (length,) = struct.unpack("<q", mem.read(obj + 16, 8))
        (state,) = struct.unpack("<I", mem.read(obj + h["str_state"], 4))
        kind, compact, ascii_ = (state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1
        if not compact or kind not in (1, 2, 4) or not 0 <= length <= 4096:
            return None
        if ascii_:
            return mem.read(obj + h["str_ascii_data"], length).decode("latin-1")
        raw = mem.read(obj + h["str_compact_data"], length * kind)
        codec = {1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind]
        return raw.decode(codec, errors="replace")


def _varint(table: bytes, i: int) -> Tuple[int, int]:
    b = table[i]
    val, shift = b & 63, 6
    while b & 64:
        i += 1
        b = table[i]
        val |= (b & 63) << shift
        shift += 6
    return val, i + 1


def addr2line(table: bytes, firstlineno: int, offset: int) -> Optional[int]:
    """Line of the instruction at byte `offset`, from a CPython 3.11+ location table
    (Objects/locations.md); None when that instruction has no line."""
    line, pos, i, n = firstlineno, 0, 0, len(table)
    try:
        while i < n:
            b = table[i]
            code, length = (b >> 3) & 15, (b & 7) + 1
            if code in (13, 14):                     # no columns / long form: svarint delta
                v, _ = _varint(table, i + 1)
                line += -(v >> 1) if v & 1 else v >> 1
            elif code in (11, 12):                   # one-line forms: delta 1 or 2
                line += code - 10
            end = pos + 2 * length
            if pos <= offset < end:
                return None if code == 15 else line
            pos = end
            i += 1
            while i < n and not table[i] & 128:
                i += 1
    except IndexError:
        return None
    return None


def _s8(b: int) -> int:
    return b - 256 if b >= 128 else b


def lnotab_line(table: bytes, firstlineno: int, offset: int) -> Optional[int]:
    """Line of the instruction at byte `offset`, from a CPython 3.8/3.9 co_lnotab: pairs of
    (bytecode delta u8, line delta s8); PyCode_Addr2Line of those versions."""
    line, addr = firstlineno, 0
    for i in range(0, len(table) - 1, 2):
        addr += table[i]
        if addr > offset:
            break
        line += _s8(table[i + 1])
    return line


def linetable310_line(table: bytes, firstlineno: int, offset: int) -> Optional[int]:
    """Line of the instruction at byte `offset`, from a CPython 3.10 co_linetable (PEP 626):
    pairs of (bytecode delta u8, line delta s8) each ending a range [start, start + delta),
    a line delta of -128 = no line for that range; None when the range has no line."""
    line, start = firstlineno, 0
    for i in range(0, len(table) - 1, 2):
        end = start + table[i]
        delta = _s8(table[i + 1])
        if delta != -128:
            line += delta
        if start <= offset < end:
            return None if delta == -128 else line
        start = end
    return None


LINE_DECODERS = {LT_LNOTAB: lnotab_line, LT_310: linetable310_line, LT_LOCATIONS: addr2line}
