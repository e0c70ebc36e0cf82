"""The low-memory sweep (steps.UNCOPIED_MIN_BYTES): heaps walked without keeping copies,
blocks read from the snapshot by the mark as it reaches them. The same fixtures run through
both paths: the copying one (the fixtures' heaps are far below the threshold) and the
low-memory one (threshold forced to 0; the sweeper is forked from this process, so it sees
the patched constant), once with the walk's reference candidates and once without (every
block the mark reaches read from the snapshot in waves). Both must give exactly the fixture's own leak table, entry for entry
identical (address, size, referenced count and size, contents), with the same totals, and
the low-memory run must really have dropped the heap copies."""
from __future__ import annotations

import pytest

import fixtures
from expected import EXPECTED
from memunreachable.sweep import steps
from memunreachable.heaps.glibc import walker
from memunreachable.heaps.glibc.copies import is_uncopied
from memunreachable.unreachable import check
from test_check import assert_result, assert_target_running

pytestmark = pytest.mark.ptrace

# chains, cycles, shared children, thread arenas, mmapped chunks, free chunks in bins and
# tcaches, many threads, a heap cut by foreign sbrk calls, 1000+ leaks
NAMES = ["leak_one", "leak_chain", "leak_ring_tail", "leak_head_cycle", "leak_shared_child",
         "live_interior", "free_chunks", "thread_arena", "mmap_chunk", "calloc_zero",
         "leak_lots", "threads_many", "churn", "clean", "leak_span_4gib"]
CHANGING = {"churn"}        # its threads allocate and free all along: totals move, leaks do not


def table(info) -> list:
    return [(l.address, l.size, l.referenced_count, l.referenced_size, l.contents)
            for l in info.leaks]


def totals(info) -> tuple:
    # heap bytes scanned, not root bytes: a stack's scanned part moves between two checks
    return (info.num_leaks, info.leak_bytes, info.num_allocations, info.allocation_bytes,
            info.stats["heap_bytes"])


@pytest.mark.parametrize("reads", ["candidates", "waves"])
@pytest.mark.parametrize("name", NAMES)
def test_lowmem_equals_copying(name, reads, monkeypatch):
    shape = EXPECTED[name]
    with fixtures.start(name, timeout=120) as fx:
        copying = check(fx.pid, limit=None)
        assert not copying.stats["stats"].get("uncopied_bytes")
        monkeypatch.setattr(steps, "UNCOPIED_MIN_BYTES", 0)
        if reads == "waves":        # no candidate kept: the mark reads every block it reaches
            monkeypatch.setattr(walker, "CANDIDATE_BUDGET_DIVISOR", 1 << 62)
        lowmem = check(fx.pid, limit=None)
        walk = lowmem.stats["stats"]
        assert walk["uncopied_bytes"] > 0
        if reads == "waves":
            assert walk["candidate_pieces"] == 0
        else:
            assert walk["candidate_pieces"] > 0
        assert_target_running(fx)
        for info in (copying, lowmem):
            assert_result(fx, shape, info)
        assert table(lowmem) == table(copying)
        if name not in CHANGING:
            assert totals(lowmem) == totals(copying)


def walk_both(fx):
    """The fixture (SIGSTOPped) walked keeping copies and without: (copying, low-memory)."""
    from memunreachable.heaps.glibc.walker import walk_heap
    from test_walker import read_maps, stopped_memory
    with stopped_memory(fx.pid) as mem:
        return [walk_heap(mem, read_maps(fx.pid), [], fx.pid, uncopied_from=u)
                for u in (None, 0)]


# foreign sbrk calls cut the main arena into runs (the dropped copy is read again to find the
# next run), thread arenas with two heaps each, free chunks in bins and tcaches
@pytest.mark.parametrize("name, args", [("walk_sbrk", ("foreign",)), ("walk_sbrk", ("blocked",)),
                                        ("walk_threads", ()), ("free_chunks", ())])
def test_lowmem_walk_finds_the_same_chunks(name, args):
    with fixtures.start(name, *args) as fx:
        copying, lowmem = walk_both(fx)
    assert list(lowmem.image.begins) == list(copying.image.begins)
    assert list(lowmem.image.sizes) == list(copying.image.sizes)
    same = ("chunks", "in_use", "free_chunks", "tcache_free", "fastbin_free", "mmapped",
            "main_runs", "heaps", "arenas", "tcaches")
    assert {k: lowmem.stats[k] for k in same} == {k: copying.stats[k] for k in same}
    assert (lowmem.soft_issues, lowmem.uncertain_sizes) == (copying.soft_issues,
                                                            copying.uncertain_sizes)
    assert lowmem.stats["uncopied_bytes"] > 0
    assert sum(len(buf) for _, buf in lowmem.image.regions if is_uncopied(buf)) == \
        lowmem.stats["uncopied_bytes"]
    # the free-list walks read the words the walk recorded (one read a word before)
    if copying.stats["free_chunks"] or copying.stats["fastbin_free"]:
        assert lowmem.stats["list_word_records"] > 0


@pytest.mark.parametrize("after", [True, False], ids=["after", "before"])
@pytest.mark.parametrize("reads", ["candidates", "waves"])
def test_snapshot_dying_after_a_lowmem_walk_is_retaken_and_exact(reads, after, tmp_path,
                                                                 monkeypatch):
    """The low-memory mark and fold read the snapshot after the walk: its death then is a
    retake (MemoryUnreadable, never zeros), and the retaken check is exact. Dead before the
    walk: the ring's pieces read nothing, the walk's own path finds the memory unreadable,
    the same retake."""
    from test_check import assert_result
    from test_reliability import _killing_walk
    monkeypatch.setattr(steps, "UNCOPIED_MIN_BYTES", 0)
    if reads == "waves":
        monkeypatch.setattr(walker, "CANDIDATE_BUDGET_DIVISOR", 1 << 62)
    marker = tmp_path / "kills"
    monkeypatch.setattr(steps, "walk_heap", _killing_walk(str(marker), 1, after=after))
    with fixtures.start("leak_chain") as fx:
        info = check(fx.pid, limit=None)
        assert marker.read_text() == "k"
        assert info.retake_counts == {"died": 1}
        assert_result(fx, EXPECTED["leak_chain"], info)
        assert_target_running(fx)


@pytest.mark.parametrize("reads", ["candidates", "waves"])
def test_a_deep_list_is_checked_exactly_and_copied_once_the_waves_get_small(reads, monkeypatch):
    """Issue 25: a 100,000-node linked list read on demand meets one node per wave. The mark
    copies the rest once the waves' charges reach the copy's bytes, and the leak table is the
    fixture's, as with the copying sweep and with the wave-per-node mark (on-demand only)."""
    shape = EXPECTED["deep_list"]
    with fixtures.start("deep_list", timeout=120) as fx:
        copying = check(fx.pid, limit=None)
        assert copying.stats["mark_method"] == "copy"
        monkeypatch.setattr(steps, "UNCOPIED_MIN_BYTES", 0)
        if reads == "waves":
            monkeypatch.setattr(walker, "CANDIDATE_BUDGET_DIVISOR", 1 << 62)
        else:   # candidates for part of the heap only: the list crosses pieces not kept
            monkeypatch.setattr(walker, "CANDIDATE_BUDGET_DIVISOR", 64)
        runs = {}
        for method in ("on-demand", "auto"):
            monkeypatch.setenv("MEMUNREACHABLE_MARK", method)
            runs[method] = check(fx.pid, limit=None)
        assert_target_running(fx)
    for info in (copying, *runs.values()):
        assert_result(fx, shape, info)
        assert table(info) == table(copying)
        assert totals(info) == totals(copying)
    old, auto = runs["on-demand"].stats, runs["auto"].stats
    assert old["mark_method"] == "on-demand" and old["mark_waves"] > 10_000
    assert auto["mark_method"] == "on-demand, then copy", auto["mark_switch_reason"]
    assert auto["mark_waves"] < old["mark_waves"] // 10
    assert auto["mark_reads"] < old["mark_reads"] // 10


def test_lowmem_walk_reads_a_heap_of_small_chunks_once():
    """Issue 25: the low-memory walk drops each piece of a heap once walked, so a heap with
    more chunks than its room was read a second time (deep_list: 100,000 chunks of 48-144
    bytes, more than one per 192 bytes). It has room for every chunk a heap can hold."""
    with fixtures.start("deep_list", timeout=120) as fx:
        copying, lowmem = walk_both(fx)
    assert list(lowmem.image.begins) == list(copying.image.begins)
    assert lowmem.stats["in_use"] == copying.stats["in_use"] > 100_000
    assert lowmem.stats["uncopied_bytes"] > 0
    assert lowmem.stats["heaps_read_again"] == 0
