"""Unit tests of stage 7 (fold): libmemunreachable.md 5.4 worked examples, the upstream
LeakFolding table (5.5) with our one-entry-per-head-SCC rule, big rings and chains.

Heaps are Python buffers at addresses we pick (blocks in letter order, so A < B < C ...);
`X -> Y` means a word of X holds an address inside Y. Unless a test marks blocks, nothing
is reachable (all-zero marked flags), as in the upstream tests.
"""
import errno
import random
import struct
from array import array

import pytest

from memunreachable._types import HeapImage
from memunreachable.sweep.folding import FoldedLeak, fold
from memunreachable.sweep.mark import mark

BASE = 0x7F3A_0000_1000
W = 8


class Heap:
    """Named blocks laid out in the given order from `base`, 16-byte aligned."""

    def __init__(self, blocks, base=BASE):
        self.base = base
        self.names = [name for name, _ in blocks]
        self.sizes = [size for _, size in blocks]
        self.addr = {}
        self.slots = {}
        addr = base
        for name, size in blocks:
            self.addr[name] = addr
            self.slots[name] = 0
            addr += (max(size, 1) + 15) // 16 * 16
        self.buf = bytearray(addr - base)

    def link(self, src, dst, delta=0):
        """Store &dst + delta in the next free word of src."""
        off = self.addr[src] + 8 * self.slots[src] - self.base
        self.slots[src] += 1
        struct.pack_into("<Q", self.buf, off, self.addr[dst] + delta)

    def image(self):
        return HeapImage(array("Q", [self.addr[n] for n in self.names]), array("Q", self.sizes),
                         [(self.base, self.buf)])

    def fold(self, marked=None):
        """Entries as (name, referenced_count, referenced_size)."""
        flags = bytearray(len(self.names)) if marked is None else marked
        return [(self.names[e.index], e.referenced_count, e.referenced_size)
                for e in fold(self.image(), flags)]


def graph(blocks, edges):
    h = Heap(blocks)
    for src, dst in edges:
        h.link(src, dst)
    return h


# libmemunreachable.md 5.4 worked examples (sizes in bytes, A < B < C < D).
WORKED = {
    "chain": ([("A", 32), ("B", 48), ("C", 64)], [("A", "B"), ("B", "C")], [("A", 2, 112)]),
    "diamond": ([("A", 32), ("B", 48), ("C", 64), ("D", 16)],
                [("A", "B"), ("A", "C"), ("B", "D"), ("C", "D")], [("A", 3, 128)]),
    "ring": ([("A", 32), ("B", 48), ("C", 64)], [("A", "B"), ("B", "C"), ("C", "A")],
             [("A", 2, 112)]),
    "cycle_off_head": ([("A", 32), ("B", 48), ("C", 64)], [("A", "B"), ("B", "C"), ("C", "B")],
                       [("A", 2, 112)]),
    "head_is_cycle": ([("A", 32), ("B", 48), ("C", 64)], [("A", "B"), ("B", "A"), ("B", "C")],
                      [("A", 2, 112)]),
    "two_heads_share_child": ([("A", 32), ("B", 48), ("C", 64)], [("A", "C"), ("B", "C")],
                              [("A", 1, 64), ("B", 1, 64)]),
}


@pytest.mark.parametrize("name", sorted(WORKED))
def test_worked_examples(name):
    blocks, edges, expect = WORKED[name]
    assert graph(blocks, edges).fold() == expect


def test_two_heads_sharing_a_child_count_it_twice():
    blocks, edges, _ = WORKED["two_heads_share_child"]
    h = graph(blocks, edges)
    entries = h.fold()
    num_leaks, leak_bytes = 3, 144
    assert sum(1 + c for _, c, _ in entries) == 4 > num_leaks
    assert sum(dict(blocks)[n] + s for n, _, s in entries) == 208 > leak_bytes


def test_each_leak_is_listed_by_one_entry():
    # issue 23: the shared child C is listed by A's entry alone (the first head reaching it),
    # so entries add up to the leak totals while referenced_* still count it under both
    blocks, edges, _ = WORKED["two_heads_share_child"]
    h = graph(blocks, edges)
    entries = fold(h.image(), bytearray(3))
    assert [(e.index, e.blocks) for e in entries] == [(0, (2,)), (1, ())]
    assert sum(1 + len(e.blocks) for e in entries) == 3
    assert sum(h.sizes[e.index] + sum(h.sizes[b] for b in e.blocks) for e in entries) == 144


def _reach(adj, start):
    seen, todo = {start}, [start]
    while todo:
        for d in adj[todo.pop()]:
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


@pytest.mark.parametrize("seed", range(20))
def test_random_graphs_list_every_leak_once(seed):
    # every unreachable block is an entry's index or in exactly one entry's blocks: the first
    # entry (by index) whose head reaches it; none reachable is listed
    rnd = random.Random(seed)
    n = rnd.randrange(2, 40)
    names = [f"N{i:02d}" for i in range(n)]
    edges = [(rnd.randrange(n), rnd.randrange(n)) for _ in range(rnd.randrange(n * 2))]
    words = [sum(a == i for a, _ in edges) + rnd.randrange(2) for i in range(n)]
    h = graph([(name, 8 * max(w, 1)) for name, w in zip(names, words)],
              [(names[a], names[b]) for a, b in edges])
    marked = bytearray(rnd.random() < 0.2 for _ in range(n))
    adj = {i: [b for a, b in edges if a == i and not marked[b]] for i in range(n)}
    entries = fold(h.image(), marked)
    listed = [e.index for e in entries] + [b for e in entries for b in e.blocks]
    assert sorted(listed) == [i for i in range(n) if not marked[i]]
    for k, e in enumerate(entries):
        reach = _reach(adj, e.index)
        earlier = set().union(*(_reach(adj, f.index) for f in entries[:k]))
        assert set(e.blocks) == reach - earlier - {e.index}
        assert e.blocks == tuple(sorted(e.blocks))
        assert e.referenced_count == len(reach) - 1


def test_cycle_hanging_off_a_mark_root_is_not_a_leak():
    # global -> B, B <-> C; A is an unrelated leak
    h = graph([("A", 32), ("B", 48), ("C", 64)], [("B", "C"), ("C", "B")])
    res = mark(h.image(), [(0x5555_0000_0000, struct.pack("<Q", h.addr["B"]))])
    assert list(res.marked) == [0, 1, 1]
    assert h.fold(res.marked) == [("A", 0, 0)]


def test_pointed_to_by_a_reachable_block_is_not_folded():
    # R (reachable) -> B; A -> R; A -> C: B never enters the leak graph, R is not a leak
    h = graph([("A", 32), ("R", 16), ("B", 48), ("C", 64)], [("A", "R"), ("A", "C"), ("R", "B")])
    assert h.fold(bytearray([0, 1, 1, 0])) == [("A", 1, 64)]
    res = mark(h.image(), [], [h.addr["R"]])
    assert h.fold(res) == [("A", 1, 64)]          # a MarkResult is accepted too


def test_interior_pointers_count_one_past_end_does_not():
    h = Heap([("A", 32), ("B", 48), ("C", 64)])
    h.link("A", "B", delta=47)           # last byte of B: an edge
    h.link("A", "C", delta=64)           # one past C's end: no edge (and not D: there is none)
    h.link("B", "C", delta=-1)           # the byte before C is padding after B: B itself
    assert h.fold() == [("A", 1, 48), ("C", 0, 0)]


def test_self_edges_and_duplicate_edges_change_nothing():
    h = Heap([("A", 32), ("B", 48)])
    h.link("A", "A")
    h.link("A", "B")
    h.link("A", "B", delta=8)
    h.link("A", "B", delta=40)
    h.link("B", "B", delta=16)
    assert h.fold() == [("A", 1, 48)]


def test_zero_size_leak_uses_its_usable_size_in_sums():
    h = Heap([("A", 16), ("Z", 0)])
    h.link("A", "Z")
    assert h.fold() == [("A", 1, 0)]


# Upstream LeakFolding table (5.5), w = 8; ours: one entry per head SCC.
def _ring(n, prefix="r"):
    blocks = [(f"{prefix}{k}", W) for k in range(n)]
    edges = [(f"{prefix}{k}", f"{prefix}{(k + 1) % n}") for k in range(n)]
    return blocks, edges


TABLE = {
    "one": ([("A", W)], [], [("A", 0, 0)]),
    "two": ([("A", W), ("B", W)], [], [("A", 0, 0), ("B", 0, 0)]),
    "dominator": ([("A", W), ("B", W)], [("A", "B")], [("A", 1, W)]),
    "cycle": ([("A", W), ("B", W), ("C", W)], [("A", "B"), ("B", "C"), ("C", "B")],
              [("A", 2, 2 * W)]),
    "dominator_cycle": ([("A", 2 * W), ("B", 2 * W), ("C", W)],
                        [("A", "B"), ("B", "A"), ("B", "C")], [("A", 2, 3 * W)]),
    "two_cycles": ([("A", W), ("B", W), ("C", W), ("D", W), ("E", W), ("F", W)],
                   [("A", "C"), ("B", "E"), ("C", "D"), ("D", "C"), ("E", "F"), ("F", "E")],
                   [("A", 2, 2 * W), ("B", 2, 2 * W)]),
    "two_dominator_cycles": ([("A", W), ("B", W), ("C", W), ("D", W)],
                             [("A", "B"), ("B", "A"), ("C", "D"), ("D", "C")],
                             [("A", 1, W), ("C", 1, W)]),
    "giant_dominator_cycle": (_ring(1000)[0], _ring(1000)[1], [("r0", 999, 999 * W)]),
    "giant_cycle": ([("X", W)] + _ring(1000)[0], [("X", "r0")] + _ring(1000)[1],
                    [("X", 1000, 1000 * W)]),
    "multipath": ([("A", 2 * W), ("B", W), ("C", W), ("D", W)],
                  [("A", "B"), ("A", "C"), ("B", "D"), ("C", "D")], [("A", 3, 3 * W)]),
    "multicycle": ([("A", 2 * W), ("B", 2 * W), ("C", 2 * W), ("D", 2 * W)],
                   [("A", "B"), ("B", "C"), ("B", "D"), ("C", "A"), ("D", "C")],
                   [("A", 3, 6 * W)]),
}
TABLE_LEAKS = {"one": (1, W), "two": (2, 2 * W), "dominator": (2, 2 * W), "cycle": (3, 3 * W),
               "dominator_cycle": (3, 5 * W), "two_cycles": (6, 6 * W),
               "two_dominator_cycles": (4, 4 * W), "giant_dominator_cycle": (1000, 1000 * W),
               "giant_cycle": (1001, 1001 * W), "multipath": (4, 5 * W), "multicycle": (4, 8 * W)}


@pytest.mark.parametrize("name", sorted(TABLE))
def test_upstream_leak_folding_table(name):
    blocks, edges, expect = TABLE[name]
    h = graph(blocks, edges)
    res = mark(h.image(), [])
    leaks = [s for s, m in zip(h.sizes, res.marked) if not m]
    assert (len(leaks), sum(leaks)) == TABLE_LEAKS[name]
    entries = h.fold(res.marked)
    assert entries == expect
    # invariant (5.3): no leak here is reachable from two heads
    assert sum(1 + c for _, c, _ in entries) == len(leaks)


def _chain_image(n, step=1):
    """n 8-byte blocks at BASE + 8k; block k holds &block(k+step) (or 0 past the ends)."""
    begins = array("Q", range(BASE, BASE + 8 * n, 8))
    words = array("Q", bytes(8 * n))
    if step == 1:
        words[:n - 1] = array("Q", range(BASE + 8, BASE + 8 * n, 8))
    else:
        words[1:] = array("Q", range(BASE, BASE + 8 * (n - 1), 8))
    return HeapImage(begins, array("Q", [8]) * n, [(BASE, words)])


def test_ring_of_10000_is_one_entry():
    n = 10_000
    img = _chain_image(n)
    img.regions[0][1][n - 1] = BASE
    assert fold(img, bytearray(n)) == [FoldedLeak(0, n - 1, 8 * (n - 1), range(1, n))]


@pytest.mark.parametrize("step", [1, -1])
def test_leaked_chain_of_a_million_is_one_entry(step):
    n = 1_000_000
    img = _chain_image(n, step)
    head = 0 if step == 1 else n - 1
    assert fold(img, bytearray(n)) == [FoldedLeak(head, n - 1, 8 * (n - 1),
                                                 (i for i in range(n) if i != head))]


def test_chain_partly_reachable():
    n = 1000
    img = _chain_image(n)
    marked = bytearray(n)
    marked[500:] = b"\1" * 500
    assert fold(img, marked) == [FoldedLeak(0, 499, 8 * 499, range(1, 500))]


def test_many_heads_share_one_large_structure():
    # 3000 heads h_k -> a 2000-node ring; heads also point at a private child each
    ring_blocks, ring_edges = _ring(2000)
    blocks = [(f"h{k}", 16) for k in range(3000)] + [(f"p{k}", 24) for k in range(3000)]
    h = graph(blocks + ring_blocks, ring_edges)
    for k in range(3000):
        h.link(f"h{k}", f"r{(7 * k) % 2000}")
        h.link(f"h{k}", f"p{k}")
    entries = h.fold()
    assert entries == [(f"h{k}", 2001, 2000 * W + 24) for k in range(3000)]


def test_heads_reaching_a_shared_chain_at_different_points():
    # h_k -> c_(10k), chain c_0 -> c_1 -> ... -> c_999: each head reaches the chain's tail
    blocks = [(f"c{k}", W) for k in range(1000)] + [(f"h{k}", W) for k in range(100)]
    edges = [(f"c{k}", f"c{k + 1}") for k in range(999)] + [(f"h{k}", f"c{10 * k}") for k in range(100)]
    entries = graph(blocks, edges).fold()
    assert entries == [(f"h{k}", 1000 - 10 * k, (1000 - 10 * k) * W) for k in range(100)]


def _reference_fold(n, edges, sizes):
    """One entry per head SCC by brute force: reach sets, mutual reach, in-edges."""
    succ = [set() for _ in range(n)]
    for u, v in edges:
        succ[u].add(v)
    reach = []
    for s in range(n):
        seen, stack = {s}, [s]
        while stack:
            for v in succ[stack.pop()]:
                if v not in seen:
                    seen.add(v)
                    stack.append(v)
        reach.append(seen)
    scc = [frozenset(v for v in reach[u] if u in reach[v]) for u in range(n)]
    out = []
    for u in range(n):
        if min(scc[u]) != u:
            continue
        if any(v in scc[u] for w in range(n) if w not in scc[u] for v in succ[w]):
            continue
        total = reach[u]
        out.append((u, len(total) - 1, sum(sizes[v] for v in total) - sizes[u]))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_random_graphs_match_the_reference(seed):
    rnd = random.Random(seed)
    n = rnd.randrange(2, 120)
    blocks = [(f"n{k}", rnd.choice([8, 16, 24, 40])) for k in range(n)]
    h = Heap(blocks)
    edges = []
    style = seed % 4
    for u in range(n):
        for _ in range(h.sizes[u] // 8):
            if style == 0 and rnd.random() < 0.3:           # sparse, any direction
                v = rnd.randrange(n)
            elif style == 1 and rnd.random() < 0.8:         # mostly DAG, shared tails
                v = rnd.randrange(u, n)
            elif style == 2 and rnd.random() < 0.6:         # many heads into one hub region
                v = rnd.randrange(n // 2, n) if u < n // 2 else rnd.randrange(n // 2, n)
            elif style == 3 and rnd.random() < 0.5:
                v = rnd.randrange(max(0, u - 3), n)
            else:
                continue
            edges.append((u, v))
            h.link(f"n{u}", f"n{v}", delta=rnd.randrange(h.sizes[v]))
    marked = bytearray(n)
    got = [(int(name[1:]), c, s) for name, c, s in h.fold(marked)]
    assert got == _reference_fold(n, edges, h.sizes)


def test_invalid_input_raises_einval():
    img = HeapImage(array("Q", [BASE + 16, BASE]), array("Q", [8, 8]), [(BASE, bytearray(64))])
    with pytest.raises(OSError) as exc:
        fold(img, bytearray(2))
    assert exc.value.errno == errno.EINVAL
    img = HeapImage(array("Q", [BASE + 64]), array("Q", [8]), [(BASE, bytearray(64))])
    with pytest.raises(OSError) as exc:
        fold(img, bytearray(1))
    assert exc.value.errno == errno.EINVAL


def test_all_reachable_and_empty():
    h = graph([("A", 16), ("B", 16)], [("A", "B")])
    assert fold(h.image(), bytearray([1, 1])) == []
    assert fold(HeapImage(array("Q"), array("Q"), []), bytearray()) == []
    assert fold(HeapImage([BASE], [16], [(BASE, bytes(16))]), b"\0") == [FoldedLeak(0, 0, 0)]


def test_fold_follows_a_word_at_a_blocks_last_8_bytes():
    import struct
    from array import array
    from memunreachable._types import HeapImage
    # A(40) holds the address of B's last 8 bytes (on glibc's heap, B's next chunk's header):
    # an edge A -> B, as a list linked through its last member has
    a, b = 0x1010, 0x1040
    buf = bytearray(0x100)
    struct.pack_into("<Q", buf, a - 0x1000, b + 40 - 8)
    img = HeapImage(array("Q", [a, b]), array("Q", [40, 40]), [(0x1000, buf)])
    assert [(f.index, f.referenced_count) for f in fold(img, bytearray(2))] == [(0, 1)]


def test_flagged_sizes_counts_and_sums_the_flagged():
    from array import array
    from memunreachable.sweep.folding import flagged_sizes
    assert flagged_sizes(array("Q", [8, 24, 40, 56]), bytes([1, 0, 1, 0])) == (2, 48)
    assert flagged_sizes(array("Q"), b"") == (0, 0)
    # zero: the zero bytes are the flagged ones (the mark's flags: the unmarked blocks)
    assert flagged_sizes(array("Q", [8, 24, 40, 56]), bytes([1, 0, 1, 0]), zero=True) == (2, 80)


@pytest.mark.parametrize("zero", [False, True])
def test_flagged_sizes_over_every_length_and_mask_byte(zero):
    # eight entries a step, then the rest: a flag in any lane, any non-zero flag value
    import random
    from array import array
    from memunreachable.sweep.folding import flagged_sizes
    rng = random.Random(7)
    for n in list(range(20)) + [1000, 4099]:
        sizes = array("Q", [rng.randrange(1, 1 << 40) for _ in range(n)])
        mask = bytes(rng.choice([0, 0, 0, 1, 2, 0x80, 0xff]) if rng.random() < 0.3 else
                     (0 if not zero else 1) for _ in range(n))
        sel = [s for s, m in zip(sizes, mask) if (m == 0) == zero]
        assert flagged_sizes(sizes, mask, zero=zero) == (len(sel), sum(sel))


# Few leaks among many reachable blocks (fewer than a quarter unmarked): mu_fold then looks
# words up among the leaks alone. Edges into reachable blocks must still count for nothing,
# and the entries equal the reference over the leaks' own graph.
@pytest.mark.parametrize("seed", range(12))
def test_few_leaks_among_reachable_blocks_match_the_reference(seed):
    rnd = random.Random(1000 + seed)
    n = rnd.randrange(200, 400)
    blocks = [(f"n{k}", rnd.choice([8, 16, 24, 40])) for k in range(n)]
    h = Heap(blocks)
    leaks = sorted(rnd.sample(range(n), rnd.randrange(1, n // 5)))
    marked = bytearray(b"\x01" * n)
    for u in leaks:
        marked[u] = 0
    edges = []
    for u in range(n):
        for _ in range(h.sizes[u] // 8):
            if rnd.random() < 0.5:
                v = rnd.choice(leaks) if rnd.random() < 0.5 else rnd.randrange(n)
                h.link(f"n{u}", f"n{v}", delta=rnd.randrange(h.sizes[v]))
                if not marked[u] and not marked[v]:
                    edges.append((leaks.index(u), leaks.index(v)))
                break
    got = [(int(name[1:]), c, s) for name, c, s in h.fold(marked)]
    sizes = [h.sizes[u] for u in leaks]
    want = [(leaks[u], c, s) for u, c, s in _reference_fold(len(leaks), edges, sizes)]
    assert got == want
    assert len(leaks) * 4 < n
