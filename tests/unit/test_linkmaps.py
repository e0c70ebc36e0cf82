"""glibc/linkmaps.py on in-memory images: r_debug from the executable's DT_DEBUG, each
object's l_gnu_chain_zero from its GNU hash header, and the link-map words equal to it."""
import struct

from memunreachable._types import BufferMemory
from memunreachable.heaps.glibc import linkmaps as LM
from memunreachable.collect.procfs import parse_auxv

BIAS = 0x555500000000                   # the executable's load bias
PHDR = BIAS + 0x40
R_DEBUG = 0x7F0000001000
LM1, LM2, LM3 = 0x5555AAAA0000, 0x5555AAAA1000, 0x7F0000002000
LIB1, LIB2 = 0x7F1000000000, 0x7F2000000000


def dyn(*pairs) -> bytes:
    return b"".join(struct.pack("<QQ", t, v) for t, v in pairs) + bytes(16)


def image():
    mem = BufferMemory()
    phdrs = [(LM.PT_PHDR, 4, 0x40, 0x40, 0), (1, 5, 0, 0, 0), (LM.PT_DYNAMIC, 6, 0x3000, 0x3000, 0)]
    mem.blocks[PHDR] = b"".join(struct.pack("<IIQQQ", *p) + bytes(24) for p in phdrs)
    mem.blocks[BIAS + 0x3000] = dyn((1, 7), (LM.DT_DEBUG, R_DEBUG))
    mem.blocks[R_DEBUG] = struct.pack("<IIQ", 1, 0, LM1)
    # object 1: GNU hash relocated in place (absolute), 1,000 skipped symbols
    h1 = LIB1 + 0x300
    mem.blocks[LIB1 + 0x200] = dyn((LM.DT_GNU_HASH, h1))
    mem.blocks[h1] = struct.pack("<IIII", 4, 1000, 2, 6)
    cz1 = h1 + 16 + 16 + 16 - 4000                    # below LIB1's first page
    lm1 = bytearray(1300)
    struct.pack_into("<QQQQ", lm1, 0, LIB1, 0, LIB1 + 0x200, LM2)
    struct.pack_into("<Q", lm1, 808, cz1)
    mem.blocks[LM1] = bytes(lm1)
    # object 2: GNU hash not relocated (a link-time address below l_addr)
    mem.blocks[LIB2 + 0x200] = dyn((5, 0x123), (LM.DT_GNU_HASH, 0x2a8))
    mem.blocks[LIB2 + 0x2a8] = struct.pack("<IIII", 1, 3, 1, 6)
    cz2 = LIB2 + 0x2a8 + 16 + 8 + 4 - 12
    lm2 = bytearray(1300)
    struct.pack_into("<QQQQ", lm2, 0, LIB2, 0, LIB2 + 0x200, LM3)
    struct.pack_into("<Q", lm2, 800, cz2)
    mem.blocks[LM2] = bytes(lm2)
    # object 3: no GNU hash; its words are left alone, the chain ends
    mem.blocks[LM3] = struct.pack("<QQQQ", 0, 0, LIB1 + 0x900, 0) + struct.pack("<Q", cz1)
    mem.blocks[LIB1 + 0x900] = dyn((5, 1))
    return mem, cz1, cz2


def auxv():
    return {LM.AT_PHDR: PHDR, LM.AT_PHNUM: 3}


def test_r_debug_from_dt_debug():
    mem, _, _ = image()
    assert LM.r_debug_address(mem, auxv()) == R_DEBUG
    assert LM.r_debug_address(mem, {}) is None                     # no AT_PHDR: static


def test_chain_zero_relocated_or_not():
    mem, cz1, cz2 = image()
    assert LM.chain_zero(mem, LIB1, LIB1 + 0x200) == cz1
    assert LM.chain_zero(mem, LIB2, LIB2 + 0x200) == cz2
    assert LM.chain_zero(mem, LIB1, LIB1 + 0x900) is None


def test_computed_words_are_the_link_map_words_equal_to_it():
    mem, cz1, cz2 = image()
    assert LM.computed_words(mem, auxv()).words == [LM1 + 808, LM2 + 800]


def test_a_cyclic_or_unset_chain_stops():
    mem, _, _ = image()
    mem.blocks[R_DEBUG] = struct.pack("<IIQ", 1, 0, 0)             # r_map not set yet
    assert LM.computed_words(mem, auxv()).words == []
    mem, _, _ = image()
    lm2 = bytearray(mem.blocks[LM2])
    struct.pack_into("<Q", lm2, 24, LM1)                          # l_next back to the first
    mem.blocks[LM2] = bytes(lm2)
    assert LM.computed_words(mem, auxv()).words == [LM1 + 808, LM2 + 800]


def test_parse_auxv():
    data = struct.pack("<6Q", 3, PHDR, 5, 3, 0, 0) + struct.pack("<2Q", 9, 1)
    assert parse_auxv(data) == {3: PHDR, 5: 3}


class Holey(BufferMemory):
    """BufferMemory with one unreadable range."""

    def __init__(self, blocks, hole):
        super().__init__(blocks)
        self.hole = hole

    def read(self, addr, size):
        lo, hi = self.hole
        if addr < hi and lo < addr + size:
            from memunreachable._errors import MemoryUnreadable
            raise MemoryUnreadable("unreadable", address=max(addr, lo))
        return super().read(addr, size)


def test_an_unreadable_object_skips_only_itself():
    mem, cz1, cz2 = image()
    # object 1's GNU hash header cannot be read: object 2 is still handled
    holey = Holey(mem.blocks, (LIB1 + 0x300, LIB1 + 0x310))
    assert LM.computed_words(holey, auxv()).words == [LM2 + 800]
    # a dynamic section that ends its mapping 48 bytes in: read up to there
    holey = Holey(mem.blocks, (LIB2 + 0x200 + 48, LIB2 + 0x2a0))
    assert LM.computed_words(holey, auxv()).words == [LM1 + 808, LM2 + 800]


def test_a_memo_serves_the_same_words_until_one_no_longer_holds_its_value():
    mem, cz1, cz2 = image()
    memo = LM.Memo(("files",))
    assert LM.computed_words(mem, auxv(), memo).words == [LM1 + 808, LM2 + 800]
    assert memo.have_r_debug and memo.r_debug == R_DEBUG
    assert memo.chain_zero == {(LIB1, LIB1 + 0x200): cz1, (LIB2, LIB2 + 0x200): cz2,
                               (0, LIB1 + 0x900): None}
    # the memo answers without the auxiliary vector or the chain (r_debug emptied: unread)
    mem.blocks[R_DEBUG] = struct.pack("<IIQ", 1, 0, 0)
    assert LM.computed_words(mem, {}, memo).words == [LM1 + 808, LM2 + 800]
    # a word that no longer holds its value: the chain is walked again (from r_debug, known)
    mem.blocks[R_DEBUG] = struct.pack("<IIQ", 1, 0, LM1)
    lm2 = bytearray(mem.blocks[LM2])
    struct.pack_into("<Q", lm2, 800, 0)
    struct.pack_into("<Q", lm2, 816, cz2)
    mem.blocks[LM2] = bytes(lm2)
    assert LM.computed_words(mem, {}, memo).words == [LM1 + 808, LM2 + 816]
    assert memo.words == [(LM1 + 808, cz1), (LM2 + 816, cz2)]


def test_path_strings_tails_cover_each_l_name_and_l_origin_up_to_its_nul():
    mem, _, _ = image()
    name1, origin1, name2, origin2 = 0x5555BBBB0000, 0x5555BBBB0100, 0x5555BBBB0200, 0x5555BBBB0300
    stale = (0x5555CCCC0000).to_bytes(8, "little")
    mem.blocks[name1] = b"/usr/lib/libone.so\0" + bytes(5) + stale
    mem.blocks[origin1] = b"/usr/lib\0" + bytes(7) + stale       # malloc(strlen(path) + 1)
    mem.blocks[name2] = b"/opt/x/libtwo.so\0" + stale
    mem.blocks[origin2] = b"/opt/x\0" + bytes(1) + stale
    for lm, name, origin, at in ((LM1, name1, origin1, 872), (LM2, name2, origin2, 872)):
        words = bytearray(mem.blocks[lm])
        struct.pack_into("<Q", words, 8, name)
        struct.pack_into("<Q", words, 40, lm + 600)      # a pointer into the link map itself
        struct.pack_into("<Q", words, 64, name)          # l_libname's name: l_name again
        struct.pack_into("<Q", words, at, origin)
        mem.blocks[lm] = bytes(words)
    found = LM.computed_words(mem, auxv())
    assert found.words == [LM1 + 808, LM2 + 800]
    assert sorted(found.string_tails) == [(name1, 19), (origin1, 9), (name2, 17), (origin2, 7)]
    # the offset is found once and kept; a memo serves the same answer while the words hold
    memo = LM.Memo(("files",))
    assert LM.computed_words(mem, auxv(), memo) == found and memo.origin_offset == 872
    assert LM.computed_words(mem, {}, memo) == found
    # an origin that is no path (unset: -1 in glibc) gives no tail
    words = bytearray(mem.blocks[LM2])
    struct.pack_into("<Q", words, 872, (1 << 64) - 1)
    mem.blocks[LM2] = bytes(words)
    assert sorted(LM.computed_words(mem, auxv(), memo).string_tails) == [
        (name1, 19), (origin1, 9), (name2, 17)]


def test_no_origin_is_guessed_from_a_word_that_points_at_other_text():
    mem, _, _ = image()
    name1, other = 0x5555BBBB0000, 0x5555BBBB0100
    mem.blocks[name1] = b"/usr/lib/libone.so\0"
    mem.blocks[other] = b"/usr/libexec\0"                # the directory is only its prefix
    words = bytearray(mem.blocks[LM1])
    struct.pack_into("<Q", words, 8, name1)
    struct.pack_into("<Q", words, 872, other)
    mem.blocks[LM1] = bytes(words)
    assert sorted(LM.computed_words(mem, auxv()).string_tails) == [(name1, 19)]


def test_words_that_are_no_user_address_are_never_read():
    mem, _, _ = image()
    name1 = 0x5555BBBB0000
    mem.blocks[name1] = b"/usr/lib/libone.so\0"
    words = bytearray(mem.blocks[LM1])
    struct.pack_into("<Q", words, 8, name1)
    struct.pack_into("<Q", words, 864, 0xDDDDDDDDDDDDDD00)   # a debug hooks' fill byte
    mem.blocks[LM1] = bytes(words)

    class Kernel(BufferMemory):     # /proc/PID/mem: offsets from 2**63 are EINVAL
        def read(self, addr, size):
            if addr >= 1 << 63:
                raise OSError(22, "Invalid argument")
            return super().read(addr, size)

    assert sorted(LM.computed_words(Kernel(mem.blocks), auxv()).string_tails) == [(name1, 19)]
