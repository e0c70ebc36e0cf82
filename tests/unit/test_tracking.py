"""Unit tests of tracking.py on in-memory tables laid out as native/mu_track.h says.

`Writer` below builds a table the way mu_track.c does (same hash, shards, linear probing,
tombstones, stack records), in a BufferMemory; the reader must find it, validate it and
answer lookups, stacks and Python frames. The line-table decoder is checked against the
running interpreter's own code objects (co_lines()).
"""
import struct

from memunreachable.stacks import tracking
from memunreachable._types import BufferMemory, Mapping, Range
from memunreachable.sweep.classify import classify
from memunreachable.sweep.sweeper import SweepEntry, SweepResult, decode, encode_result

BASE = 0x7f0000000000
SIZE = 2 << 20
NSHARDS = 256


def anon(begin, end, perms="rw-p", path=""):
    return Mapping(begin, end, perms, 0, "00:00", 0, path)


class Writer:
    """A tracking table in memory, written like mu_track.c writes it."""

    def __init__(self, base=BASE, size=SIZE, log2cap=4, version=3, **extra):
        self.base, self.size = base, size
        self.buf = bytearray(size)
        self.shards_off, self.sindex_off, self.sindex_cap = 4096, 4096 + NSHARDS * 32, 1024
        self.stack_off = self.sindex_off + 8 * self.sindex_cap
        self.stack_size = 256 << 10
        self.stack_used = 8
        self.live_off = self.stack_off + self.stack_size
        self.live_used = 0
        self.log2cap = log2cap
        self.tables = {}
        self.header = {1: tracking.HEADER_V1, 2: tracking.HEADER_V2}.get(version, tracking.HEADER)
        self.h = dict(magic=tracking.MAGIC, version=version, header_size=self.header.size,
                      self=base, map_size=size, budget=size, max_depth=32, max_py=16,
                      nshards=NSHARDS, flags=1, shards_off=self.shards_off,
                      sindex_off=self.sindex_off, sindex_cap=self.sindex_cap,
                      stack_arena_off=self.stack_off, stack_arena_size=self.stack_size,
                      stack_arena_used=8, live_arena_off=self.live_off,
                      live_arena_size=size - self.live_off, live_arena_used=0, stacks=0,
                      table_full_blocks=0, dropped_blocks=0, inserts=0, removes=0,
                      py_version=0, unwinder=3, co_filename=112, co_name=120, co_qualname=128,
                      co_firstlineno=72, co_linetable=136, str_ascii_data=48,
                      str_compact_data=72, str_state=32, pid=1234, generation=0,
                      py_linetable=tracking.LT_LOCATIONS, epoch=0, started=0)
        self.h.update(extra)
        self.entry = tracking.ENTRY if version >= 3 else tracking.ENTRY_V2

    def stack(self, pcs, py=()):
        """Append a stack record; return its id."""
        off = self.stack_used
        words = list(pcs) + [c for c, _ in py] + [o & (2 ** 64 - 1) for _, o in py]
        rec = struct.pack("<IHH", 0x1234567, len(pcs), len(py)) + struct.pack(f"<{len(words)}Q", *words)
        self.buf[self.stack_off + off:self.stack_off + off + len(rec)] = rec
        self.stack_used += len(rec)
        self.h["stacks"] += 1
        return off // 8

    def _table(self, shard):
        if shard not in self.tables:
            self.tables[shard] = self.live_off + self.live_used
            self.live_used += self.entry.size << self.log2cap
        return self.tables[shard]

    def insert(self, addr, stack, size, epoch=0):
        h = tracking.addr_hash(addr)
        shard = h & (NSHARDS - 1)
        t, mask, n = self._table(shard), (1 << self.log2cap) - 1, self.entry.size
        p = tracking.first_slot(addr, h, mask)
        while struct.unpack_from("<Q", self.buf, t + n * p)[0] > tracking.TOMB:
            p = (p + 1) & mask
        fields = (addr, stack, size, epoch) if n == tracking.ENTRY.size else (addr, stack, size)
        self.entry.pack_into(self.buf, t + n * p, *fields)
        self._count(shard, 1)

    def remove(self, addr):
        h = tracking.addr_hash(addr)
        t, mask = self._table(h & (NSHARDS - 1)), (1 << self.log2cap) - 1
        p, n = tracking.first_slot(addr, h, mask), self.entry.size
        while struct.unpack_from("<Q", self.buf, t + n * p)[0] != addr:
            p = (p + 1) & mask
        struct.pack_into("<Q", self.buf, t + n * p, tracking.TOMB)
        self._count(h & (NSHARDS - 1), -1)

    def _count(self, shard, d):
        off = self.shards_off + 32 * shard
        _, _, used, tombs, _, _ = tracking.SHARD.unpack_from(self.buf, off)
        tracking.SHARD.pack_into(self.buf, off, self.tables[shard], self.log2cap, used + d,
                                 tombs + (d < 0), 0, 0)

    def memory(self, extra=None):
        self.h["stack_arena_used"] = self.stack_used
        self.h["live_arena_used"] = self.live_used
        n = len(self.header.unpack(bytes(self.header.size)))    # fields of this version
        self.buf[:self.header.size] = self.header.pack(*(self.h[k] for k in tracking._FIELDS[:n]))
        blocks = {self.base: bytes(self.buf)}
        blocks.update(extra or {})
        return BufferMemory(blocks)

    @property
    def mapping(self):
        return anon(self.base, self.base + self.size)


def colliding(n, shard=5, first=0x555500000000):
    """n block addresses of one shard whose first probes collide (same first slot in a
    16-slot table)."""
    out, a, want = [], first, None
    while len(out) < n:
        h = tracking.addr_hash(a)
        if h & (NSHARDS - 1) == shard:
            slot = tracking.first_slot(a, h, 15)
            if want is None:
                want = slot
            if slot == want:
                out.append(a)
        a += 16
    return out


def test_header_layout_is_240_bytes_and_matches_the_c_offsets():
    assert (tracking.HEADER.size, tracking.HEADER_V2.size, tracking.HEADER_V1.size) == (240, 232, 224)
    # offsets written in native/mu_track.h's comments
    import re
    codes = re.findall(r"(8s|I|Q)", tracking.HEADER.format)
    assert len(codes) == len(tracking._FIELDS)
    offs, off = {}, 0
    for name, code in zip(tracking._FIELDS, codes):
        offs[name] = off
        off += 4 if code == "I" else 8
    assert (offs["self"], offs["stacks"], offs["py_version"], offs["co_filename"],
            offs["str_state"], offs["pid"], offs["generation"], offs["py_linetable"],
            offs["epoch"], offs["started"]) == (16, 128, 168, 176, 204, 208, 216, 224, 228, 232)
    assert tracking.ENTRY.size == 24 and tracking.ENTRY_V2.size == 16


def test_find_table_validates_the_header():
    w = Writer()
    sid = w.stack([0x401000])
    w.insert(0x555500001000, sid, 40)
    maps = [anon(0x10000, 0x10000 + SIZE), w.mapping, anon(BASE + SIZE + 4096, BASE + 2 * SIZE)]
    t = tracking.find_table(w.memory(), maps)
    assert t is not None and t.cuts == [Range(BASE, BASE + SIZE)]
    # a copy of the header elsewhere (self does not match) is not the table
    copy = Writer(base=BASE)
    mem = copy.memory({0x10000: bytes(copy.buf)})
    assert tracking.find_table(mem, [anon(0x10000, 0x10000 + SIZE)]) is None
    # another layout version, a shared or file mapping: not read
    assert tracking.find_table(Writer(version=4).memory(), [w.mapping]) is None
    # Python frames in a line-table format this reader does not know: not read
    assert tracking.find_table(Writer(flags=3, py_linetable=9).memory(), [w.mapping]) is None
    assert tracking.find_table(w.memory(), [anon(BASE, BASE + SIZE, "rw-s")]) is None
    wrong_size = anon(BASE, BASE + SIZE + 4096)
    assert tracking.find_table(w.memory(), [wrong_size]) is None
    named = anon(BASE, BASE + SIZE, path=tracking.MAP_NAME)
    assert tracking.find_table(w.memory(), [named]) is not None


def test_validate_rejects_tables_past_the_mapping():
    w = Writer(live_arena_size=SIZE)
    w.memory()
    h = tracking.parse_header(bytes(w.buf[:tracking.HEADER.size]))
    assert "past the mapping" in tracking.validate(h, w.mapping)


def test_lookup_probes_past_collisions_and_tombstones():
    w = Writer()
    a = colliding(5)
    ids = [w.stack([0x401000 + i]) for i in range(5)]
    for addr, sid in zip(a, ids):
        w.insert(addr, sid, 64)
    w.remove(a[1])              # a tombstone in the middle of the probe chain
    t = tracking.find_table(w.memory(), [w.mapping])
    assert t.lookup(a[0]) == (ids[0], 64, 0)
    assert t.lookup(a[1]) is None
    assert t.lookup(a[4]) == (ids[4], 64, 0)       # found past the tombstone
    assert t.lookup(a[4] + 16 * NSHARDS * 1000) is None
    assert t.summary()["live_blocks"] == 4


def test_annotate_statuses():
    w = Writer(table_full_blocks=1)
    sid = w.stack([0x401234, 0x401456, 0x7f0000001000])
    w.insert(0x555500002000, sid, 100)
    w.insert(0x555500003000, tracking.STACK_FULL, 24)
    w.insert(0x555500004000, sid, 5000)          # recorded larger than the block: stale
    t = tracking.find_table(w.memory(), [w.mapping])
    a = t.annotate(0x555500002000, 104)
    assert (a.status, a.stack, a.python_stack) == ("recorded", (0x401234, 0x401456, 0x7f0000001000), [])
    assert t.annotate(0x555500003000, 24).status == "table_full"
    assert t.annotate(0x555500003000, 24).stack == ()
    assert t.annotate(0x555500004000, 40).status == "untracked"
    assert t.annotate(0x555500005000, 40).status == "untracked"
    s = t.summary()
    assert (s["version"], s["stacks"], s["table_full_blocks"], s["unwinder"], s["python"]) == \
        (3, 1, 1, "libunwind", None)


def test_each_entry_keeps_its_epoch_and_version_2_tables_are_read_without():
    w = Writer(epoch=7)
    sid = w.stack([0x401234])
    w.insert(0x555500002000, sid, 100, epoch=5)
    w.insert(0x555500003000, tracking.STACK_FULL, 24, epoch=6)
    t = tracking.find_table(w.memory(), [w.mapping])
    assert t.h["epoch"] == 7
    assert (t.annotate(0x555500002000, 104).epoch, t.annotate(0x555500003000, 24).epoch) == (5, 6)
    assert t.annotate(0x555500004000, 24).epoch is None
    old = Writer(version=2)
    sid = old.stack([0x401234])
    old.insert(0x555500002000, sid, 100)
    t = tracking.find_table(old.memory(), [old.mapping])
    a = t.annotate(0x555500002000, 104)
    assert (a.status, a.stack, a.requested, a.epoch) == ("recorded", (0x401234,), 100, 0)


# ---- Python frames -----------------------------------------------------------------------

CODE, TYPE, TPNAME, NAME, FILE, TABLE = (0x600000 + i * 0x1000 for i in range(6))


def ascii_str(s):
    state = (1 << 2) | (1 << 5) | (1 << 6)      # kind 1, compact, ascii
    b = bytearray(48 + len(s) + 1)
    struct.pack_into("<qQqqI", b, 0, 1, 0, len(s), -1, state)
    b[48:48 + len(s)] = s.encode()
    return bytes(b)


def ucs2_str(s):
    state = (2 << 2) | (1 << 5)                 # kind 2, compact, not ascii
    data = s.encode("utf-16-le")
    b = bytearray(72 + len(data) + 2)
    struct.pack_into("<qQqqI", b, 0, 1, 0, len(s), -1, state)
    b[72:72 + len(data)] = data
    return bytes(b)


def code_blocks(func, name=NAME, filename=FILE, tp_name=b"code\0"):
    co = func.__code__
    code = bytearray(200)
    struct.pack_into("<qQ", code, 0, 1, TYPE)
    struct.pack_into("<i", code, 72, co.co_firstlineno)
    struct.pack_into("<QQQ", code, 112, filename, 0, name)     # co_filename, co_name
    struct.pack_into("<QQ", code, 128, name, TABLE)            # co_qualname, co_linetable
    table = co.co_linetable
    tbl = bytearray(32 + len(table))
    struct.pack_into("<qQq", tbl, 0, 1, 0, len(table))
    tbl[32:] = table
    typ = bytearray(32)
    struct.pack_into("<Q", typ, 24, TPNAME)
    return {CODE: bytes(code), TYPE: bytes(typ), TPNAME: tp_name, TABLE: bytes(tbl)}


def sample_function(x):
    y = x + 1
    z = [y,
         y * 2]
    return len(z) + \
        y


def test_addr2line_matches_the_interpreter():
    import dis
    import json
    for f in (sample_function, json.dumps, json.JSONEncoder.iterencode, dis.dis, tracking.addr2line):
        co = f.__code__
        for start, end, line in co.co_lines():
            for off in range(start, end, 2):
                assert tracking.addr2line(co.co_linetable, co.co_firstlineno, off) == line, (f, off)


def test_python_frames_resolved_from_code_objects():
    w = Writer(py_version=0x030B07F0, flags=3)
    co = sample_function.__code__
    # the instruction computing `y * 2`: its line is firstlineno + 3
    off = next(s for s, e, line in co.co_lines() if line == co.co_firstlineno + 3)
    stale = 0x700000
    sid = w.stack([0x401000], py=[(CODE, off), (CODE, -2), (stale, 0)])
    w.insert(0x555500006000, sid, 16)
    extra = code_blocks(sample_function)
    extra[NAME] = ascii_str("sample_function")
    extra[FILE] = ucs2_str("/src/caf\u00e9\u4e2d.py")
    extra[stale] = bytes(200)           # freed and reused: no code type
    t = tracking.find_table(w.memory(extra), [w.mapping])
    a = t.annotate(0x555500006000, 24)
    assert a.python_stack == [("sample_function", "/src/caf\u00e9\u4e2d.py", co.co_firstlineno + 3),
                              ("sample_function", "/src/caf\u00e9\u4e2d.py", co.co_firstlineno),
                              tracking.STALE]
    assert t.summary()["python"] == "3.11"


def test_table_is_cut_out_of_the_roots():
    w = Writer()
    table = tracking.find_table(w.memory(), [w.mapping])
    other = anon(0x10000, 0x20000)
    roots = classify([other, w.mapping], [], [], [], table.cuts)
    assert roots.ranges == [Range(0x10000, 0x20000)]


def test_modules_are_executable_file_mappings():
    maps = [Mapping(0x400000, 0x401000, "r--p", 0, "08:01", 5, "/bin/x"),
            Mapping(0x401000, 0x402000, "r-xp", 0x1000, "08:01", 5, "/bin/x"),
            Mapping(0x7f0000, 0x7f1000, "r-xp", 0, "00:00", 0, "[vdso]"),
            Mapping(0x800000, 0x801000, "rwxp", 0, "00:00", 0, "")]
    assert tracking.modules(maps) == [(0x401000, 0x402000, 0x1000, "/bin/x")]


def test_stacks_ride_the_sweeper_wire_format():
    e1 = SweepEntry(0x1000, 32, 0, 0, b"x", stack=(0x401000, 0x402000),
                    python_stack=[("f", "/a.py", 3)], stack_status="recorded", epoch=12)
    e2 = SweepEntry(0x2000, 16, 0, 0, b"y", stack_status="table_full")
    e3 = SweepEntry(0x3000, 16, 0, 0, b"z")
    g = SweepEntry(0x4000, 64, 1, 64, b"g", stack=(0x403000,), stack_status="recorded")
    res = SweepResult(4, 128, 3, 64, 100, [e1, e2, e3], {"tracking": {"version": 1}},
                      cyclic_garbage=[g])
    got = decode(encode_result(res))
    assert got.entries == [e1, e2, e3] and got.cyclic_garbage == [g]
    assert got.meta == {"tracking": {"version": 1}}


def test_neighbouring_blocks_are_neighbouring_slots():
    """Blocks of one 1 KiB window share shard and hash: their first slots are consecutive
    (one cache line per four 16-byte blocks), so a run of mallocs does not miss per block."""
    base = 0x555500123400
    hashes = {tracking.addr_hash(base + 16 * i) for i in range(64)}
    assert len(hashes) == 1
    h = hashes.pop()
    slots = [tracking.first_slot(base + 16 * i, h, (1 << 12) - 1) for i in range(64)]
    assert slots == list(range(slots[0], slots[0] + 64))
    assert tracking.addr_hash(base + 1024) != h


def test_unreadable_candidates_are_skipped():
    from memunreachable._errors import MemoryUnreadable

    class Holes(BufferMemory):
        def read(self, addr, size):
            if addr < BASE:
                raise MemoryUnreadable("hole", address=addr)
            return super().read(addr, size)

    w = Writer()
    w.memory()
    mem = Holes({BASE: bytes(w.buf)})
    t = tracking.find_table(mem, [anon(0x10000, 0x10000 + SIZE), w.mapping])
    assert t is not None and t.mapping == w.mapping


def test_a_freed_code_object_pointing_anywhere_is_stale():
    """A code object freed and overwritten may hold any words: a type pointer that cannot
    be read (here: the reader raises, as /proc/PID/mem does past the address space) gives
    the stale frame, not an error."""
    from memunreachable._errors import MemoryUnreadable

    class Strict(BufferMemory):
        def read(self, addr, size):
            if addr >= 1 << 47:
                raise OSError(22, "Invalid argument")
            if not any(b <= addr < b + len(d) for b, d in self.blocks.items()):
                raise MemoryUnreadable("unmapped", address=addr)
            return super().read(addr, size)

    w = Writer(py_version=0x030B07F0, flags=3)
    sid = w.stack([0x401000], py=[(CODE, 0), (CODE + 0x800, 0)])
    w.insert(0x555500007000, sid, 16)
    garbage = bytearray(200)
    struct.pack_into("<Q", garbage, 8, 0xdead000000000000)        # ob_type: non-canonical
    junk = bytearray(200)
    struct.pack_into("<Q", junk, 8, 0x123456789000)               # ob_type: unmapped
    mem = w.memory({CODE: bytes(garbage) + bytes(0x800 - 200) + bytes(junk)})
    t = tracking.find_table(Strict(mem.blocks), [w.mapping])
    assert t.annotate(0x555500007000, 16).python_stack == [tracking.STALE, tracking.STALE]


def test_a_version_1_header_is_read_as_3_11_plus_frames():
    """Version 1 (224 bytes, no py_linetable) recorded 3.11+ frames only: read as such."""
    w = Writer(version=1, py_version=0x030B07F0, flags=3)
    co = sample_function.__code__
    off = next(s for s, e, line in co.co_lines() if line == co.co_firstlineno + 3)
    sid = w.stack([0x401000], py=[(CODE, off)])
    w.insert(0x555500006000, sid, 16)
    extra = code_blocks(sample_function)
    extra[NAME] = ascii_str("sample_function")
    extra[FILE] = ascii_str("/src/a.py")
    t = tracking.find_table(w.memory(extra), [w.mapping])
    assert t is not None and t.h["py_linetable"] == tracking.LT_LOCATIONS
    assert t.annotate(0x555500006000, 16).python_stack == [
        ("sample_function", "/src/a.py", co.co_firstlineno + 3)]
    assert t.summary()["version"] == 1


# 3.8/3.9 co_lnotab: (bytecode delta, line delta s8) pairs, a line change takes effect at the
# byte where the pair's address delta lands; big deltas are split across pairs.
LNOTAB = bytes([0, 1,        # byte 0: line +1
                4, 2,        # byte 4: +2
                255, 0,      # address jump split: 255 + 45 = byte 304
                45, 127,     # byte 304: +127 ...
                0, 127,      # ... +127 = +254
                2, 0xfd])    # byte 306: -3


def test_lnotab_line():
    first = 10
    assert [tracking.lnotab_line(LNOTAB, first, off) for off in (0, 2, 4, 6, 302, 304, 306, 400)] \
        == [11, 11, 13, 13, 13, 267, 264, 264]
    assert tracking.lnotab_line(b"", first, 6) == first


# 3.10 co_linetable: (bytecode delta, line delta s8) pairs, each ending the range
# [start, start + delta) at that line; -128 = the range has no line.
LINETABLE_310 = bytes([6, 1,        # [0, 6): first + 1
                       0, 3,        # empty range: line + 3, no bytes
                       4, 0,        # [6, 10): first + 4
                       2, 0x80,     # [10, 12): no line
                       254, 0xfe,   # [12, 266): first + 2
                       8, 0])       # [266, 274): first + 2


def test_linetable310_line():
    first = 20
    assert [tracking.linetable310_line(LINETABLE_310, first, off)
            for off in (0, 4, 6, 8, 10, 12, 264, 266, 272, 274)] == \
        [21, 21, 24, 24, None, 22, 22, 22, 22, None]


def test_python_frames_of_3_8_code_objects():
    """A 3.8 table: frames are (code, f_lasti bytes); the code object has no co_qualname
    (header says 0: co_name is used) and its line table is co_lnotab."""
    w = Writer(py_version=0x030812F0, flags=3, co_filename=104, co_name=112, co_qualname=0,
               co_firstlineno=40, co_linetable=120, py_linetable=tracking.LT_LNOTAB)
    code = bytearray(200)
    struct.pack_into("<qQ", code, 0, 1, TYPE)
    struct.pack_into("<i", code, 40, 10)
    struct.pack_into("<QQQ", code, 104, FILE, NAME, TABLE)
    tbl = bytearray(32 + len(LNOTAB))
    struct.pack_into("<qQq", tbl, 0, 1, 0, len(LNOTAB))
    tbl[32:] = LNOTAB
    typ = bytearray(32)
    struct.pack_into("<Q", typ, 24, TPNAME)
    sid = w.stack([0x401000], py=[(CODE, 304), (CODE, -1)])
    w.insert(0x555500006000, sid, 16)
    mem = w.memory({CODE: bytes(code), TYPE: bytes(typ), TPNAME: b"code\0", TABLE: bytes(tbl),
                    NAME: ascii_str("old_function"), FILE: ascii_str("/src/old.py")})
    t = tracking.find_table(mem, [w.mapping])
    assert t.annotate(0x555500006000, 16).python_stack == [("old_function", "/src/old.py", 267),
                                                           ("old_function", "/src/old.py", 10)]
    assert t.summary()["python"] == "3.8"


def test_the_table_s_mapping_is_known_by_name_or_by_its_magic():
    w = Writer()
    mem = w.memory()
    assert tracking.holds_table(mem, anon(BASE, BASE + SIZE, path=tracking.MAP_NAME))
    assert tracking.holds_table(mem, w.mapping)                          # unnamed: the magic
    other = anon(0x10000, 0x10000 + SIZE)
    assert not tracking.holds_table(BufferMemory({0x10000: bytes(SIZE)}), other)
    assert not tracking.holds_table(mem, anon(BASE, BASE + SIZE, "rw-s"))


def test_a_table_that_stopped_recording_gives_no_stacks_and_says_when_it_began():
    w = Writer(started=1_795_000_000_123_456_789)
    sid = w.stack([0x401234])
    w.insert(0x555500002000, sid, 100, epoch=3)
    t = tracking.find_table(w.memory(), [w.mapping])
    assert t.annotate(0x555500002000, 104).status == "recorded"
    assert t.summary()["started"] == 1_795_000_000.123456789 and t.summary()["recording"]
    stopped = Writer(flags=0)               # track --stop: frees no longer reach the table
    sid = stopped.stack([0x401234])
    stopped.insert(0x555500002000, sid, 100)
    t = tracking.find_table(stopped.memory(), [stopped.mapping])
    assert t is not None and t.cuts == [stopped.mapping.range]      # still no root
    assert t.annotate(0x555500002000, 104).status == "untracked"
    assert t.summary()["recording"] is False and t.summary()["started"] is None
