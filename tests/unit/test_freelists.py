"""Unit tests of glibc/freelists.py on in-memory heaps: which blocks shaped like a tcache are
real tcaches (glibc's own evidence, never shape alone)."""
import struct

from memunreachable._types import BufferMemory, FS_BASE_INDEX, Mapping, Range, REG_NAMES, ThreadState
from memunreachable.heaps.glibc import layout as L
from memunreachable.heaps.glibc.freelists import TcacheContext
from memunreachable.heaps.glibc.walker import _Walker
from test_walk import Run, in_use, tcache_struct

HEAP, LIBC_DATA, TLS = 0x10000000, 0x7F0000001000, 0x7F0000100000
K = 0x3C5A9D2E7F014B68          # a tcache_key: random, no address


def tcache_world(key_kind, tls_refs=(), threads=True, cookie_in_libc=False):
    """A heap with four blocks shaped like tcaches; returns the addresses find_tcaches accepts
    and the four (real: heads keyed K; selfish: heads keyed with its own address; ptr: heads
    keyed with a heap pointer; cookie: a random key that libc's data does not hold)."""
    tc = L.TCACHE_U16
    r = Run(base=HEAP, size=1 << 14)
    nodes = [r.chunk(0x20) for _ in range(4)]
    structs = [tcache_struct(r, [1] + [0] * 63, [n + 16] + [0] * 63, tc) for n in nodes]
    real, selfish, ptr, cookie = structs
    for n, key in zip(nodes, [K, selfish, HEAP + 0x40, 0x1111222233334444]):
        r.set_word(n + 16 + 8, key)
    r.finish_top()
    libc = bytearray(0x1000)
    struct.pack_into("<QQ", libc, 0x100, K, 0x5555)
    if cookie_in_libc:      # a static build: the program's own random cookie is in that data too
        struct.pack_into("<Q", libc, 0x200, 0x1111222233334444)
    tls = bytearray(0x2000)
    for i, a in enumerate(tls_refs):
        struct.pack_into("<Q", tls, 0x1f00 + 8 * i, a)
    mem = BufferMemory({HEAP: bytes(r.buf), LIBC_DATA: bytes(libc), TLS: bytes(tls)})
    maps = [Mapping(HEAP, HEAP + len(r.buf), "rw-p", 0, "00:00", 0, "[heap]"),
            Mapping(LIBC_DATA, LIBC_DATA + 0x1000, "rw-p", 0x1000, "08:01", 5, "/lib/libc.so.6"),
            Mapping(TLS, TLS + 0x2000, "rw-p", 0, "00:00", 0, "")]
    regs = [0] * len(REG_NAMES)
    regs[FS_BASE_INDEX] = TLS + 0x2000
    w = _Walker(mem, maps, None)
    w.copy(HEAP, len(r.buf))
    user, usable = in_use(r)
    tab, ntab = w.regions_table()
    ctx = TcacheContext((tc,), key_kind, True, 64, 7, [Range(LIBC_DATA, LIBC_DATA + 0x1000)],
                         [ThreadState(1, tuple(regs))] if threads else [])
    got = [a for a, _ in w.find_tcaches(tab, ntab, user, usable, ctx)]
    assert w.stats["tcache_candidates"] == 4
    return got, structs, w.stats["tcache_key_kind"]


def test_real_tcache_needs_glibcs_tcache_key():
    for kind in ("tcache_key", None):            # None: a static build that names no version
        got, structs, found = tcache_world(kind)
        assert got == [structs[0]] and found == "tcache_key"
    # a TLS reference does not make a look-alike a tcache when glibc keys its entries
    got, _, _ = tcache_world("tcache_key", tls_refs=structs)
    assert got == [structs[0]]


def test_self_keyed_tcache_needs_a_tls_reference_when_threads_are_known():
    _, structs, _ = tcache_world("self")
    real, selfish, ptr, cookie = structs
    assert tcache_world("self", tls_refs=[selfish])[0] == [selfish]
    assert tcache_world("self", tls_refs=[ptr])[0] == []
    assert tcache_world("self", threads=False)[0] == [selfish]


def test_keyless_tcache_is_the_one_tls_points_at():
    _, structs, _ = tcache_world("none")
    assert tcache_world("none", tls_refs=[structs[2]])[0] == [structs[2]]
    assert tcache_world("none")[0] == []
    # without threads (no fs_base known), only the old shape test is left
    assert tcache_world("none", threads=False)[0] == structs


def test_two_random_keys_in_the_data_tls_decides():
    _, structs, _ = tcache_world("tcache_key")
    real, selfish, ptr, cookie = structs
    assert tcache_world("tcache_key", tls_refs=[real], cookie_in_libc=True)[0] == [real]
    # no threads known: both keys stand (never drop a real tcache)
    assert tcache_world("tcache_key", threads=False, cookie_in_libc=True)[0] == [real, cookie]


# ---- glibc 2.42+: 76 bins, num_slots, large bins sorted by size (issue 22) ------------------
def tcache76_world(order=(0, 1, 2), slots=None, large_count=3):
    """A heap with one 2.42+ tcache: small bin 0 holds 2 chunks, large bin 64 three (0x420,
    0x600, 0x7f0, linked in `order`); num_slots = 16 - count unless given. Returns the walker
    after subtract_tcaches, the free nodes expected, and the large nodes."""
    from test_walk import tcache76_struct
    tc = L.TCACHE_76
    r = Run(base=HEAP, size=1 << 15)
    small = [r.chunk(0x20) + 16 for _ in range(2)]
    large = [r.chunk(s) + 16 for s in (0x420, 0x600, 0x7f0)]
    live = r.chunk(0x500) + 16          # an in-use block of the large bin's range
    linked = [large[i] for i in order]
    counts = {0: 2, 64: large_count}
    if slots is not None:
        counts = {i: -s for i, s in slots.items()}
    t = tcache76_struct(r, tc, counts, {0: small[0], 64: linked[0]})
    for chain_ in (small, linked):
        for a, b in zip(chain_, chain_[1:] + [0]):
            r.set_word(a, (a >> 12) ^ b)
            r.set_word(a + 8, K)
    r.finish_top()
    libc = bytearray(0x1000)
    struct.pack_into("<Q", libc, 0x100, K)
    mem = BufferMemory({HEAP: bytes(r.buf), LIBC_DATA: bytes(libc)})
    maps = [Mapping(HEAP, HEAP + len(r.buf), "rw-p", 0, "00:00", 0, "[heap]"),
            Mapping(LIBC_DATA, LIBC_DATA + 0x1000, "rw-p", 0x1000, "08:01", 5, "/lib/libc.so.6")]
    w = _Walker(mem, maps, None)
    w.copy(HEAP, len(r.buf))
    user, usable = in_use(r)
    ctx = TcacheContext((tc,), L.KEY_GLOBAL, True, 76, 16, [Range(LIBC_DATA, LIBC_DATA + 0x1000)], [])
    assert w.subtract_tcaches(user, usable, ctx) is True
    return w, t, small, large, live


def test_tcache76_small_and_large_chains_are_free():
    w, t, small, large, live = tcache76_world()
    assert w.stats["tcaches"] == [t]
    assert sorted(w.free_nodes) == sorted(small + large)
    assert w.stats["tcache_free"] == 5
    assert w.stats["tcache_free_bytes"] == 2 * 0x20 + 0x420 + 0x600 + 0x7f0
    assert w.v.soft == [] and w.v.uncertain == {} and w.v.hard == []


def test_tcache76_count_off_by_one_is_soft_and_uncertain():
    # num_slots says 4 chunks in bin 64 (12 slots left), the chain holds 3: a free in flight
    w, t, small, large, live = tcache76_world(large_count=4)
    assert sorted(w.free_nodes) == sorted(small + large)
    assert len(w.v.soft) == 1 and w.v.hard == []
    assert w.v.soft[0].startswith(f"tcache {t:#x} bin 64 (1048-2024-byte blocks): 3 chunk(s) "
                                  f"linked, count says 4")
    # the sizes of that range the heap holds may be free: the in-use 0x500 block's among them
    assert sorted(w.v.uncertain) == [0x418, 0x4f8, 0x5f8, 0x7e8]


def test_tcache76_unsorted_large_chain_is_broken():
    # 0x600 -> 0x420: glibc keeps large bins sorted, so this is no chain of its (garbage)
    w, t, small, large, live = tcache76_world(order=(1, 0, 2))
    assert sorted(w.free_nodes) == sorted(small + [large[1]])       # the verified prefix
    assert len(w.v.soft) == 1
    msg = w.v.soft[0]
    assert msg.startswith(f"tcache {t:#x} bin 64 (1048-2024-byte blocks): chain broken at "
                          f"{large[1]:#x}: next pointer {large[0]:#x} is smaller than the chunk "
                          f"before it")
    assert 0x4f8 in w.v.uncertain and 0x18 not in w.v.uncertain


def test_tcache76_with_num_slots_above_tcache_count_is_no_tcache():
    w, t, small, large, live = tcache76_world(slots={0: 17})
    assert w.stats["tcaches"] == [] and list(w.free_nodes) == []
