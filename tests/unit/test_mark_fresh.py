"""mark's fresh rule (mu_dead.fresh, written.py): a word in memory the target has not written
since an earlier snapshot is no reference to a block that began after that snapshot."""
import random
import struct
from array import array

import pytest

from memunreachable._types import HeapImage
from memunreachable.sweep.mark import DeadWords, mark

BASE = 0x7F3A_0000_0000         # page aligned
ROOT = 0x5555_0000_0000
PAGE = 4096


def heap(nblocks, size=48):
    """nblocks blocks of `size` bytes, one per page (block k at BASE + k * PAGE + 16)."""
    begins = [BASE + k * PAGE + 16 for k in range(nblocks)]
    return begins, bytearray(nblocks * PAGE)


def put(buf, base, addr, value):
    struct.pack_into("<Q", buf, addr - base, value)


def image(begins, buf, size=48):
    return HeapImage(array("Q", begins), array("Q", [size] * len(begins)), [(BASE, buf)])


def dead(n, fresh=(), unwritten=()):
    """fresh: block indexes (level 1) or {index: level}; unwritten: (begin, end[, level])."""
    f = bytearray(n)
    for i, level in (fresh.items() if isinstance(fresh, dict) else ((i, 1) for i in fresh)):
        f[i] = level
    return DeadWords(fresh=f, unwritten=[tuple(u) + (1,) * (3 - len(u)) for u in unwritten])


ROOT_PAGES = [(ROOT, ROOT + PAGE), (ROOT + PAGE, ROOT + 2 * PAGE)]


def roots_with(*slots):
    """Two root pages; slots: (page, word index, value)."""
    buf = bytearray(2 * PAGE)
    for page, word, value in slots:
        struct.pack_into("<Q", buf, page * PAGE + 8 * word, value)
    return [(ROOT, buf)]


@pytest.mark.parametrize("unwritten, fresh, reached", [
    ([ROOT_PAGES[0]], [0], 0),      # the stale word: block 0 is a leak
    ([ROOT_PAGES[0]], [], 1),       # block 0 was there before: a reference
    ([ROOT_PAGES[1]], [0], 1),      # the word's page was written: a reference
    ([], [0], 1),                   # nothing tracked: today's mark
])
def test_a_word_in_an_unwritten_page_does_not_reach_a_fresh_block(unwritten, fresh, reached):
    begins, buf = heap(2)
    roots = roots_with((0, 5, begins[0] + 8))       # an interior pointer into block 0
    res = mark(image(begins, buf), roots, dead=dead(2, fresh, unwritten))
    assert res.marked[0] == reached
    assert res.stale == (1 - reached if fresh and unwritten else 0)


def test_the_same_value_written_elsewhere_still_reaches_it():
    # first met in the unwritten page, then (same lookup batch) in a written one: the mark is
    # redone without its cache of values met
    begins, buf = heap(2)
    roots = roots_with((0, 1, begins[0]), (1, 3, begins[0]))
    res = mark(image(begins, buf), roots, dead=dead(2, [0], [ROOT_PAGES[0]]))
    assert res.marked[0] == 1


def test_a_fresh_block_reached_through_a_written_block_stays_reached():
    # root (written) -> block 1 (old) -> block 0 (fresh); a stale copy in an unwritten page
    # changes nothing
    begins, buf = heap(2)
    put(buf, BASE, begins[1], begins[0])
    roots = roots_with((1, 0, begins[1]), (0, 7, begins[0]))
    res = mark(image(begins, buf), roots, dead=dead(2, [0], [ROOT_PAGES[0]]))
    assert list(res.marked) == [1, 1]


def test_unwritten_heap_pages_hold_stale_words_too():
    # block 1's page is unwritten: its word to fresh block 0 is stale, its word to old block 2
    # is a reference
    begins, buf = heap(3)
    put(buf, BASE, begins[1], begins[0])
    put(buf, BASE, begins[1] + 8, begins[2])
    roots = roots_with((1, 0, begins[1]))
    page1 = (BASE + PAGE, BASE + 2 * PAGE)
    res = mark(image(begins, buf), roots, dead=dead(3, [0], [page1]))
    assert list(res.marked) == [0, 1, 1]
    assert res.stale == 1


@pytest.mark.parametrize("word_level, block_level, reached", [
    (1, 1, 0), (1, 2, 0),       # unwritten since snapshot 1, the block absent from snapshot 1/2
    (2, 2, 0),                  # unwritten since 2, absent from 2
    (2, 1, 1),                  # unwritten only since 2, the block already in 2: maybe real
])
def test_levels_a_word_predates_a_block_only_when_its_snapshot_is_as_old(word_level, block_level,
                                                                        reached):
    begins, buf = heap(1)
    roots = roots_with((0, 0, begins[0]))
    res = mark(image(begins, buf), roots,
               dead=dead(1, {0: block_level}, [ROOT_PAGES[0] + (word_level,)]))
    assert res.marked[0] == reached


def test_register_words_are_never_stale():
    begins, buf = heap(1)
    res = mark(image(begins, buf), [], words=[begins[0]],
               dead=dead(1, [0], [(0, 1 << 47)]))
    assert res.marked[0] == 1


def test_bad_unwritten_ranges_raise():
    begins, buf = heap(1)
    with pytest.raises(OSError):
        mark(image(begins, buf), [], dead=dead(1, [0], [(2 * PAGE, PAGE)]))
    with pytest.raises(ValueError):
        mark(image(begins, buf), [], dead=DeadWords(fresh=bytearray(2), unwritten=[(0, PAGE, 1)]))
    with pytest.raises(ValueError):
        mark(image(begins, buf), [], dead=DeadWords(fresh=bytearray(1), unwritten=[(0, PAGE)]))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("parallel", [False, True])
def test_random_heaps_match_a_graph_search(seed, parallel):
    # the rule on random graphs, against a reference search that applies it word by word
    rnd = random.Random(seed)
    n = 3000
    begins, buf = heap(n, size=64)
    fresh = {i for i in range(n) if rnd.random() < 0.2}
    unwritten_pages = {k for k in range(n) if rnd.random() < 0.5}
    edges = [[] for _ in range(n)]
    for k in range(n):
        for slot in range(rnd.choice([0, 1, 2, 3])):
            j = rnd.randrange(n)
            put(buf, BASE, begins[k] + 8 * slot, begins[j] + rnd.randrange(64))
            if not (j in fresh and k in unwritten_pages):
                edges[k].append(j)
    roots_buf = bytearray(PAGE)
    root_edges = []
    for w in range(40):
        j = rnd.randrange(n)
        struct.pack_into("<Q", roots_buf, 8 * w, begins[j])
        root_edges.append(j)
    unwritten = [(BASE + k * PAGE, BASE + (k + 1) * PAGE) for k in sorted(unwritten_pages)]
    root_stale = rnd.random() < 0.5
    if root_stale:
        unwritten = [(ROOT, ROOT + PAGE)] + unwritten
    expect = bytearray(n)
    todo = [j for j in root_edges if not (root_stale and j in fresh)]
    for j in todo:
        expect[j] = 1
    while todo:
        for j in edges[todo.pop()]:
            if not expect[j]:
                expect[j] = 1
                todo.append(j)
    res = mark(image(begins, buf, 64), [(ROOT, roots_buf)],
               dead=dead(n, fresh, unwritten), parallel=parallel)
    assert res.marked == expect
