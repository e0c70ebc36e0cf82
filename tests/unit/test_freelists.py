"""Unit tests of glibc/freelists.py on in-memory heaps: which blocks shaped like a tcache are
real tcaches (glibc's own evidence, never shape alone)."""
import struct

from memunreachable._types import BufferMemory, FS_BASE_INDEX, Mapping, Range, REG_NAMES, ThreadState
from memunreachable.glibc import layout as L
from memunreachable.glibc.freelists import TcacheContext
from memunreachable.glibc.walker import _Walker
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
