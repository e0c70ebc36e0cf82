"""Unit tests of the C chunk walker (native/mu_walk.c) on synthetic in-memory chunk runs."""
import struct
import time
from array import array

from memunreachable._ffi import ffi, lib

BASE = 0x10000000
P, M, N = 1, 2, 4


class Run:
    """Builds a heap image: chunks appended at increasing addresses."""

    def __init__(self, base=BASE, size=1 << 16):
        self.base = base
        self.buf = bytearray(size)
        self.cur = base
        self.chunks = []           # (addr, size, in_use)

    def hdr(self, addr, size_word, prev=0):
        struct.pack_into("<QQ", self.buf, addr - self.base, prev, size_word)

    def chunk(self, size, in_use=True, flags=0):
        a = self.cur
        self.chunks.append((a, size, in_use))
        self.hdr(a, size | flags | P)
        self.cur += size
        return a

    def finish_top(self, top_size=0x100):
        """Fix PREV_INUSE bits from the in_use list, then a top chunk."""
        top = self.cur
        self.hdr(top, top_size | P)
        for i, (a, s, used) in enumerate(self.chunks):
            nxt = a + s
            w = struct.unpack_from("<Q", self.buf, nxt - self.base + 8)[0]
            w = (w | P) if used else (w & ~P)
            struct.pack_into("<Q", self.buf, nxt - self.base + 8, w)
        return top

    def set_word(self, addr, value):
        struct.pack_into("<Q", self.buf, addr - self.base, value)


def walk(run, first, top, non_main=0, cap=1000):
    user, usable = array("Q", bytes(8 * cap)), array("Q", bytes(8 * cap))
    res = ffi.new("mu_walk_result *")
    n = lib.mu_walk_run(ffi.from_buffer(run.buf), run.base, len(run.buf), first, top, non_main,
                        ffi.from_buffer("uint64_t[]", user), ffi.from_buffer("uint64_t[]", usable),
                        cap, res)
    assert n >= 0
    return list(zip(user[:n], usable[:n])), res


def test_in_use_by_next_prev_inuse_and_top():
    r = Run()
    a = r.chunk(0x20)
    b = r.chunk(0x90, in_use=False)
    c = r.chunk(0x410)
    top = r.finish_top(0x1000)
    got, res = walk(r, BASE, top)
    assert got == [(a + 16, 0x18), (c + 16, 0x408)]
    assert res.status == lib.MU_WALK_TOP and res.end == top + 0x1000
    assert (res.chunks, res.in_use, res.free_chunks, res.free_bytes) == (3, 2, 1, 0x90)
    assert res.in_use_bytes == 0x430
    assert b not in [u - 16 for u, _ in got]


def test_double_fencepost_ends_a_main_run():
    r = Run()
    a = r.chunk(0x30)
    r.finish_top()
    fence = r.cur
    r.hdr(fence, 0x10 | P)
    r.hdr(fence + 16, 0x10 | P)
    got, res = walk(r, BASE, 0)
    assert got == [(a + 16, 0x28)]
    assert res.status == lib.MU_WALK_FENCE2 and res.end == fence + 32


def test_heap_end_fencepost_and_pseudo_chunk_never_reported():
    r = Run()
    a = r.chunk(0x40, flags=N)
    pseudo = r.cur
    r.hdr(pseudo, 0x20 | P)          # old top < MINSIZE+16 became a 0x20 pseudo chunk
    r.hdr(pseudo + 0x20, 0 | P)
    r.set_word(a + 0x40 + 8, 0x20 | P)
    got, res = walk(r, BASE, 0, non_main=1)
    assert got == [(a + 16, 0x38)]
    assert res.status == lib.MU_WALK_FENCE0 and res.end == pseudo + 0x30
    # the usual {0x10|1, 0|1} pair
    r2 = Run()
    b = r2.chunk(0x40, flags=N)
    r2.hdr(r2.cur, 0x10 | P)
    r2.hdr(r2.cur + 16, 0 | P)
    got, res = walk(r2, BASE, 0, non_main=1)
    assert got == [(b + 16, 0x38)] and res.status == lib.MU_WALK_FENCE0


def test_broken_chains_are_reported():
    r = Run()
    r.chunk(0x30)
    bad = r.cur
    r.hdr(bad, 0x38 | P)             # not a multiple of 16
    _, res = walk(r, BASE, 0)
    assert res.status == lib.MU_WALK_BAD_SIZE and res.bad_at == bad
    r = Run()
    a = r.chunk(0x30)                # main arena chunk in a non-main walk: wrong flags
    top = r.finish_top()
    _, res = walk(r, BASE, top, non_main=1)
    assert res.status == lib.MU_WALK_BAD_FLAGS and res.bad_at == a
    r = Run()
    r.chunk(0x30)
    r.chunk(0x30)
    _, res = walk(r, BASE, BASE + 0x40)   # top inside the second chunk: stepped over
    assert res.status == lib.MU_WALK_PAST_TOP


def test_cap_counts_beyond_storage():
    r = Run()
    for _ in range(10):
        r.chunk(0x20)
    top = r.finish_top()
    got, res = walk(r, BASE, top, cap=4)
    assert len(got) == 4 and res.in_use == 10


def test_mmapped_scan_with_memalign_moved_header():
    buf = bytearray(0x40000)
    base = 0x7f0000000000
    struct.pack_into("<QQ", buf, 0, 0, 0x5000 | M)                 # plain chunk
    struct.pack_into("<QQ", buf, 0x5000, 0, 0x10000 | M)           # stale memalign header
    struct.pack_into("<QQ", buf, 0x5000 + 0x3ff0, 0x3ff0, (0x10000 - 0x3ff0) | M)
    struct.pack_into("<QQ", buf, 0x20000, 0, 0x1000 | M | P)       # flags wrong: not a chunk
    user, usable = array("Q", bytes(80)), array("Q", bytes(80))
    res = ffi.new("mu_mmap_result *")
    n = lib.mu_walk_mmapped(ffi.from_buffer(buf), base, len(buf), 4096,
                            ffi.from_buffer("uint64_t[]", user), ffi.from_buffer("uint64_t[]", usable),
                            10, res)
    assert n == 2
    assert list(zip(user[:2], usable[:2])) == [(base + 16, 0x5000 - 16),
                                               (base + 0x5000 + 0x3ff0 + 16, 0x10000 - 0x3ff0 - 16)]
    assert (res.found, res.bytes, res.moved) == (2, 0x15000, 1)


def regions(*runs):
    tab = ffi.new("mu_region[]", len(runs))
    keep = []
    for i, r in enumerate(sorted(runs, key=lambda r: r.base)):
        p = ffi.from_buffer(r.buf)
        keep.append(p)
        tab[i].base, tab[i].len, tab[i].data = r.base, len(r.buf), ffi.cast("uint8_t *", p)
    return tab, keep


def chain(tab, n, head, bias, mangled, size, max_nodes):
    out = array("Q", bytes(8 * 64))
    st = ffi.new("int64_t *")
    k = lib.mu_walk_chain(tab, n, head, bias, mangled, size, max_nodes,
                          ffi.from_buffer("uint64_t[]", out), 64, st)
    return st[0], list(out[:k])


def test_tcache_and_fastbin_chains_safe_linking():
    r = Run()
    nodes = [r.chunk(0x30) for _ in range(4)]
    r.finish_top()
    users = [c + 16 for c in nodes]
    # tcache chain users[0] -> users[2] -> users[3] -> NULL, mangled with the field address
    links = {users[0]: users[2], users[2]: users[3], users[3]: 0}
    for at, nxt in links.items():
        r.set_word(at, (at >> 12) ^ nxt)
    tab, keep = regions(r)
    assert chain(tab, 1, users[0], 0, 1, 0x30, 3) == (lib.MU_CHAIN_NULL, [users[0], users[2], users[3]])
    st, got = chain(tab, 1, users[0], 0, 0, 0x30, 3)        # wrong decoding: breaks at once
    assert st == lib.MU_CHAIN_BAD and got == [users[0]]
    assert chain(tab, 1, users[0], 0, 1, 0x40, 3)[0] == lib.MU_CHAIN_BAD   # wrong bin size
    assert chain(tab, 1, users[0], 0, 1, 0x30, 1)[0] == lib.MU_CHAIN_LONG
    # fastbin: chunk pointers, bias 16, raw (pre-2.32)
    r.set_word(users[1], nodes[0])
    r.set_word(users[0], 0)
    assert chain(tab, 1, nodes[1], 16, 0, 0x30, 10) == (lib.MU_CHAIN_NULL, [users[1], users[0]])
    # a cycle stops at max_nodes
    r.set_word(users[0], nodes[1])
    assert chain(tab, 1, nodes[1], 16, 0, 0x30, 10)[0] == lib.MU_CHAIN_LONG


def test_bin_list_walk():
    r = Run()
    a = r.chunk(0x100, in_use=False)
    r.chunk(0x20)
    b = r.chunk(0x100, in_use=False)
    r.chunk(0x20)
    r.finish_top()
    arena = Run(base=0x20000000, size=0x100)
    binc = arena.base + 0x40
    arena.set_word(binc + 16, a)        # fd
    arena.set_word(binc + 24, b)        # bk
    r.set_word(a + 16, b)
    r.set_word(a + 24, binc)
    r.set_word(b + 16, binc)
    r.set_word(b + 24, a)
    tab, keep = regions(r, arena)
    nodes, nbytes, bitfree = ffi.new("uint64_t *"), ffi.new("uint64_t *"), ffi.new("uint64_t *")
    assert lib.mu_walk_bin(tab, 2, binc, 100, nodes, nbytes, bitfree) == 0
    assert (nodes[0], nbytes[0], bitfree[0]) == (2, 0x200, 2)
    r.set_word(b + 24, binc)            # b->bk no longer a: broken
    assert lib.mu_walk_bin(tab, 2, binc, 100, nodes, nbytes, bitfree) == 1
    empty = arena.base + 0x80
    arena.set_word(empty + 16, empty)
    arena.set_word(empty + 24, empty)
    assert lib.mu_walk_bin(tab, 2, empty, 100, nodes, nbytes, bitfree) == 0 and nodes[0] == 0


def test_subtract():
    user = array("Q", [16, 48, 80, 112, 144])
    usable = array("Q", [1, 2, 3, 4, 5])
    drop = array("Q", [144, 48, 48, 999])
    removed = ffi.new("uint64_t *")
    n = lib.mu_walk_subtract(ffi.from_buffer("uint64_t[]", user), ffi.from_buffer("uint64_t[]", usable),
                             5, ffi.from_buffer("uint64_t[]", drop), 4, removed)
    assert n == 3 and list(user[:3]) == [16, 80, 112] and list(usable[:3]) == [1, 3, 4]
    assert removed[0] == 2


def test_five_million_chunks_walk_fast():
    n = 5_000_000
    size = 0x40
    buf = bytearray(n * size + 0x100)
    # every header {prev 0, 0x40|P}: all chunks in use; top at the end
    hdr = struct.pack("<QQ", 0, size | P) + bytes(size - 16)
    buf[:n * size] = hdr * n
    top = BASE + n * size
    struct.pack_into("<QQ", buf, n * size, 0, 0x100 | P)
    r = Run(size=0)
    r.buf = buf
    user, usable = array("Q", bytes(8 * n)), array("Q", bytes(8 * n))
    res = ffi.new("mu_walk_result *")
    t = time.perf_counter()
    k = lib.mu_walk_run(ffi.from_buffer(buf), BASE, len(buf), BASE, top, 0,
                        ffi.from_buffer("uint64_t[]", user), ffi.from_buffer("uint64_t[]", usable), n, res)
    dt = time.perf_counter() - t
    assert k == n and res.status == lib.MU_WALK_TOP and user[-1] == top - size + 16
    assert dt < 0.5, f"walk of {n} chunks took {dt:.3f}s"
