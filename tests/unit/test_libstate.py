"""libstate.py on in-memory images: readline's run-time keymaps, found from the static keymaps
and the keymap pointers, each validated before its dead ranges (all but the function words) are
given;
readline's line buffer; terminfo's string tables."""
import struct

from memunreachable.heaps import libstate as K
from memunreachable._errors import MemoryUnreadable
from memunreachable._types import BufferMemory

N = 257
STD, META, CTLX = 0x7F0000010000, 0x7F0000011010, 0x7F0000012020    # static, in .data
H1, H2, H3, H4 = 0x555500001000, 0x555500003000, 0x555500005000, 0x555500007000
PTR = 0x7F0000020000                                                   # _rl_keymap
STALE = 0x5555000A0B00      # what the 7 bytes after a type byte kept: an old pointer


def keymap(subs=None, stale=False, kinds=None) -> bytes:
    """A keymap of N entries: ISKMAP entries at subs {key: address}, ISFUNC elsewhere (a
    function pointer at even keys); stale padding after each type byte when asked."""
    out = bytearray()
    for key in range(N):
        kind = K.ISFUNC
        func = 0x7F0000900000 + 16 * key if key % 2 == 0 else 0
        if subs and key in subs:
            kind, func = K.ISKMAP, subs[key]
        if kinds and key in kinds:
            kind = kinds[key]
        word = (STALE & ~0xFF if stale else 0) | kind
        out += struct.pack("<QQ", word, func)
    return bytes(out)


def image(h3_kinds=None):
    mem = BufferMemory()
    mem.blocks[STD] = keymap({27: META, 24: CTLX})
    mem.blocks[META] = keymap({ord("["): H1})
    mem.blocks[CTLX] = keymap()
    mem.blocks[H1] = keymap({ord("1"): H2, ord("2"): H3}, stale=True)
    mem.blocks[H2] = keymap({ord("~"): H1}, stale=True)          # a cycle back to H1
    mem.blocks[H3] = keymap(stale=True, kinds=h3_kinds)
    mem.blocks[H4] = keymap(stale=True)                           # only _rl_keymap points here
    mem.blocks[PTR] = struct.pack("<Q", H4)
    return mem


def dead_of(mem, *keymaps):
    """The expected dead ranges, word by word: every word of each keymap's entries but its
    non-zero function words, merged."""
    words = []
    for k in keymaps:
        raw = mem.blocks[k]
        for i in range(N):
            words.append(k + 16 * i)
            if not struct.unpack_from("<Q", raw, 16 * i + 8)[0]:
                words.append(k + 16 * i + 8)
    out = []
    for w in sorted(words):
        if out and out[-1][1] == w:
            out[-1] = (out[-1][0], w + 8)
        else:
            out.append((w, w + 8))
    return out


STATICS = [(STD, N), (META, N), (CTLX, N)]


def test_the_run_time_keymaps_entries_but_their_function_words():
    mem = image()
    keymaps, dead = K.runtime_keymaps(mem, STATICS, [PTR])
    assert keymaps == [H1, H2, H3, H4]
    assert dead == dead_of(mem, H1, H2, H3, H4)
    # the static keymaps' padding is the loader's zeros: none of their words
    assert all(not (STD <= b < CTLX + 16 * N) for b, _e in dead)
    # the non-zero function words (sub-keymaps, functions) stay references
    assert all(not (b <= H1 + 16 * ord("1") + 8 < e) for b, e in dead)
    assert all(not (b <= H1 + 8 < e) for b, e in dead)


def test_a_keymap_with_a_type_readline_never_writes_is_not_one():
    # H3's key 5 has type 7: not a keymap, its words count as before; the others still do
    mem = image(h3_kinds={5: 7})
    assert K.runtime_keymaps(mem, STATICS, [PTR]) == ([H1, H2, H4], dead_of(mem, H1, H2, H4))
    # an ISKMAP entry whose keymap pointer is misaligned invalidates its keymap too
    mem = image()
    mem.blocks[H2] = keymap({ord("~"): H1 + 4}, stale=True)
    assert K.runtime_keymaps(mem, STATICS, [PTR]) == ([H1, H3, H4], dead_of(mem, H1, H3, H4))


class Holey(BufferMemory):
    def __init__(self, blocks, hole):
        super().__init__(blocks)
        self.hole = hole

    def read(self, addr, size):
        if addr <= self.hole < addr + size:
            raise MemoryUnreadable("unreadable", address=self.hole)
        return super().read(addr, size)


def test_an_unreadable_keymap_is_skipped_alone():
    mem = image()
    holey = Holey(mem.blocks, H3 + 100)
    assert K.runtime_keymaps(holey, STATICS, [PTR]) == ([H1, H2, H4], dead_of(mem, H1, H2, H4))
    holey = Holey(mem.blocks, PTR)
    assert K.runtime_keymaps(holey, STATICS, [PTR]) == ([H1, H2, H3], dead_of(mem, H1, H2, H3))


def test_statics_that_disagree_on_the_size_give_nothing():
    mem = image()
    assert K.runtime_keymaps(mem, [(STD, N), (META, 256)], [PTR]) == ([], [])
    assert K.runtime_keymaps(mem, [], [PTR]) == ([], [])


def test_the_line_buffer_whole_or_nothing():
    mem = BufferMemory()
    buf, ptr_at, len_at = 0x555500009000, 0x7F0000030000, 0x7F0000030008
    mem.blocks[ptr_at] = struct.pack("<Q", buf)
    mem.blocks[len_at] = struct.pack("<i", 256)
    assert K.line_buffer(mem, ptr_at, len_at) == buf
    for bad in (0, -5, (16 << 20) + 1):
        mem.blocks[len_at] = struct.pack("<i", bad)
        assert K.line_buffer(mem, ptr_at, len_at) is None
    mem.blocks[len_at] = struct.pack("<i", 256)
    for bad in (0, buf + 4):                                # not made yet; misaligned
        mem.blocks[ptr_at] = struct.pack("<Q", bad)
        assert K.line_buffer(mem, ptr_at, len_at) is None


def test_terminfo_tables_only_when_the_termtype_looks_like_one():
    term, table, ext = 0x555500020000, 0x555500021000, 0x555500022000
    mem = BufferMemory()

    def termtype(names, str_table, ext_table, text=b"xterm|xterm-debian\0"):
        mem.blocks[term] = struct.pack("<6Q", names, str_table, 0x5555000300, 0x5555000400,
                                       0x5555000500, ext_table)
        mem.blocks[table] = text
    termtype(table, table, ext)
    assert K.terminfo_tables(mem, term) == [table, ext]
    termtype(table, table, 0)                               # no extended table
    assert K.terminfo_tables(mem, term) == [table]
    termtype(table + 8, table, ext)                         # names do not open the table
    assert K.terminfo_tables(mem, term) == []
    termtype(table, table, ext, text=b"\x10\x20binary")      # not a name
    assert K.terminfo_tables(mem, term) == []
    termtype(0, 0, ext)                                     # not loaded
    assert K.terminfo_tables(mem, term) == []


def test_ld_cache_words_next_to_cachesize_and_page_aligned():
    size = 35971                                          # /etc/ld.so.cache's size
    data = 0x7F0000040000
    words = [0] * 64
    words[10], words[11], words[12] = 0, 0x7F0000123000, size     # cache (unloaded), cache_new
    words[30], words[31] = size, 0x555500001234               # the size again: not page-aligned
    words[50], words[54] = 0x7F0000200000, size               # too far from the size
    mem = BufferMemory()
    mem.blocks[data] = struct.pack("<64Q", *words)
    assert K.ld_cache_words(mem, [(data, data + 512)], size) == [data + 8 * 11]
    words[10] = 0x7F0000123000                                # loaded: both point into it
    mem.blocks[data] = struct.pack("<64Q", *words)
    assert K.ld_cache_words(mem, [(data, data + 512)], size) == [data + 80, data + 88]
    # an unaligned hit of the size's bytes is no word; a small size is too likely by chance
    mem.blocks[data] = bytes(4) + struct.pack("<Q", size) + struct.pack("<Q", 0x7F0000123000) + bytes(500)
    assert K.ld_cache_words(mem, [(data, data + 512)], size) == []
    assert K.ld_cache_words(mem, [(data, data + 512)], 100) == []


def test_ld_data_is_its_writable_mappings_and_the_bss_after():
    from memunreachable._types import Mapping
    ld = "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
    maps = [Mapping(0x1000, 0x2000, "r--p", 0, "fe:00", 7, ld),
            Mapping(0x2000, 0x3000, "rw-p", 0x1000, "fe:00", 7, ld),
            Mapping(0x3000, 0x4000, "rw-p", 0, "00:00", 0, ""),
            Mapping(0x5000, 0x6000, "rw-p", 0, "00:00", 0, ""),
            Mapping(0x7000, 0x8000, "rw-p", 0, "fe:00", 8, "/usr/lib/libc.so.6")]
    assert [m.begin for m in K.ld_data(maps)] == [0x2000, 0x3000]


def test_environ_strings_up_to_the_null_entry():
    mem = Holey({}, 0)
    at, env = 0x7F0000040000, 0x555500050000
    strings = [0x555500060000, 0x555500060040, 0x7FFC00001000]
    mem.blocks[at] = struct.pack("<Q", env)
    mem.blocks[env] = struct.pack("<4Q", *strings, 0) + struct.pack("<Q", 0x555500070000)
    assert K.environ_strings(mem, at) == strings
    mem.blocks[at] = struct.pack("<Q", env + 4)             # misaligned: not an array
    assert K.environ_strings(mem, at) == []
    mem.blocks[at] = struct.pack("<Q", 0)                   # no environment
    assert K.environ_strings(mem, at) == []
    mem.hole = env + 16                                     # unreadable third entry: the two
    mem.blocks[at] = struct.pack("<Q", env)
    assert K.environ_strings(mem, at) == strings[:2]


def test_history_tail_is_found_through_history_lists_load_of_the_static_array():
    # history_list() is `mov disp32(%rip), %rax; ret` (Debian's 8.2; trixie's and sid's after
    # an endbr64): the word it loads is the_history; its entries and their NULL are in use
    fn, the_history, length_at = 0x7F0000010000, 0x7F0000040100, 0x7F00000400F0
    array, e1, e2 = 0x555500030000, 0x555500031000, 0x555500031040
    mem = BufferMemory()
    for prefix in (b"", bytes.fromhex("f30f1efa")):
        at = fn + len(prefix)
        disp = the_history - (at + 7)
        mem.blocks[fn] = prefix + bytes.fromhex("488b05") + struct.pack("<i", disp) + b"\xc3" \
            + bytes(16)
        mem.blocks[the_history] = struct.pack("<Q", array)
        mem.blocks[length_at] = struct.pack("<i", 2)
        mem.blocks[array] = struct.pack("<4Q", e1, e2, 0, 0x555500031008)     # a stale slot
        assert K.history_tail(mem, fn, length_at) == [(array, 24)]
        mem.blocks[length_at] = struct.pack("<i", 0)                # no history yet: its NULL
        mem.blocks[array] = struct.pack("<2Q", 0, 0x555500031008)
        assert K.history_tail(mem, fn, length_at) == [(array, 8)]
    mem.blocks[length_at] = struct.pack("<i", 2)
    for entries in ((e1, e2, e1), (e1, e2 + 4, 0), (e1, 0, 0)):     # no NULL; misaligned; early
        mem.blocks[array] = struct.pack("<3Q", *entries)
        assert K.history_tail(mem, fn, length_at) == []
    mem.blocks[array] = struct.pack("<3Q", e1, e2, 0)
    for bad in (-1, K.MAX_HISTORY + 1):
        mem.blocks[length_at] = struct.pack("<i", bad)
        assert K.history_tail(mem, fn, length_at) == []
    mem.blocks[length_at] = struct.pack("<i", 2)
    code = bytearray(mem.blocks[fn])
    code[-17] = 0x90                                # no ret after the load: another function
    mem.blocks[fn] = bytes(code)
    assert K.history_tail(mem, fn, length_at) == []
    mem.blocks[fn] = bytes.fromhex("488b0d") + bytes(13)    # a load into another register
    assert K.history_tail(mem, fn, length_at) == []
    assert K.history_tail(Holey(mem.blocks, fn), fn, length_at) == []


def test_funmap_tails_are_each_entrys_slack_and_the_arrays_slots_after_its_null():
    funmap_at, array = 0x7F0000040000, 0x555500030000
    e1, e2 = 0x555500031000, 0x555500031030
    mem = BufferMemory()
    mem.blocks[funmap_at] = struct.pack("<Q", array)
    # two entries, the NULL, then realloc's unwritten slot holding a stale pointer
    mem.blocks[array] = struct.pack("<4Q", e1, e2, 0, 0x7F00FA000053)
    assert K.funmap_tails(mem, funmap_at) == [(array, 24), (e1, 16), (e2, 16)]
    mem.blocks[array] = struct.pack("<3Q", e1, e2 + 4, 0)              # misaligned: not one
    assert K.funmap_tails(mem, funmap_at) == []
    mem.blocks[array] = struct.pack("<2Q", e1, e2)                     # unreadable before a NULL
    assert K.funmap_tails(Holey(mem.blocks, array + 16), funmap_at) == []
    mem.blocks[funmap_at] = struct.pack("<Q", 0)                       # readline not set up
    assert K.funmap_tails(mem, funmap_at) == []
