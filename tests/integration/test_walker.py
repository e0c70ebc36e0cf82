"""Stage 4 on live fixtures: the walker's allocations equal the fixture's own live list plus
glibc's internal blocks (tcache structs, thread DTVs, stdout's buffer, static startup blocks)."""
import contextlib
import os
import signal
import struct
import time

import pytest

import fixtures
from memunreachable._types import Mapping
from memunreachable.heaps.glibc import layout as L
from memunreachable.heaps.glibc.walker import walk_heap
from memunreachable.collect.memory import ProcessMemory, plan_snapshot
from memunreachable.collect.procfs import read_smaps_flags

pytestmark = pytest.mark.ptrace

GLIBC = L.version_tuple(fixtures.glibc_version())
# the tcache struct: 648 bytes on glibc 2.30-2.41, 760 from 2.42 (76 bins)
TCACHE_USABLE = (L.TCACHE_76 if GLIBC >= L.TCACHE_76_FROM else L.TCACHE_U16).chunk_size - 8
DTV_USABLE = 280                               # calloc((max_idx + 16) * 16) per created thread (2.36)
HAS_FASTBINS = GLIBC < (2, 43)                 # 2.43 removed them
# 2.43 allocates a thread's tcache at its first free (or small-bin stash), no longer at its
# first malloc: a program that freed nothing has none
IDLE_TCACHE = [TCACHE_USABLE] if GLIBC < (2, 43) else []


def read_maps(pid):
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            p = line.split(None, 5)
            b, e = (int(x, 16) for x in p[0].split("-"))
            out.append(Mapping(b, e, p[1], int(p[2], 16), p[3], int(p[4]),
                               p[5].strip() if len(p) > 5 else ""))
    return out


def memory_of(pid: int) -> ProcessMemory:
    """pid's memory as a check reads it: guard pages (glibc 2.42+ thread stacks,
    MADV_GUARD_INSTALL) and pages past a file's end read as zeros."""
    plan = plan_snapshot(read_maps(pid), read_smaps_flags(pid))
    return ProcessMemory(pid, tolerated=plan.tolerated, guarded=plan.guarded)


@contextlib.contextmanager
def stopped_memory(pid: int):
    """The memory of process pid while it is SIGSTOPped (SIGCONT on exit)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline
        time.sleep(0.001)
    try:
        with memory_of(pid) as mem:
            yield mem
    finally:
        os.kill(pid, signal.SIGCONT)


def stopped_walk(fx):
    """SIGSTOP the fixture, walk it, SIGCONT; returns (HeapWalk, set of (address, size))."""
    with stopped_memory(fx.pid) as mem:
        hw = walk_heap(mem, read_maps(fx.pid), [], fx.pid)
    begins, sizes = list(hw.image.begins), list(hw.image.sizes)
    assert begins == sorted(set(begins))
    return hw, set(zip(begins, sizes))


def owned(fx):
    return {(b.address, b.size) for b in fx.blocks.values()}


def covered(hw, addr, size):
    return any(base <= addr and addr + size <= base + len(buf) for base, buf in hw.image.regions)


def test_main_arena_sizes_bins_mmapped():
    with fixtures.start("walk_basic") as fx:
        hw, got = stopped_walk(fx)
    want = owned(fx)
    assert len(want) == fx.expect["live"] + 1
    assert want <= got
    extra = got - want
    # glibc's own: the main thread's tcache (it holds free chunks, so it validated)
    assert extra == {(t, TCACHE_USABLE) for t in hw.stats["tcaches"]}
    assert len(hw.stats["tcaches"]) == 1
    assert hw.allocator.name == "glibc" and hw.allocator.version == fixtures.glibc_version()
    assert hw.stats["tcache_free"] > 0 and hw.stats["free_chunks"] > 0
    assert (hw.stats["fastbin_free"] > 0) == HAS_FASTBINS
    assert hw.stats["mmapped"] == 5 and hw.stats["mmapped_moved"] == 2
    assert hw.soft_issues == []
    for a, s in got:
        assert covered(hw, a, max(s, 1))
    # metadata: main_arena and mp_, inside libc's data; never inside a heap range
    assert len(hw.metadata_ranges) == 2
    for r in hw.metadata_ranges:
        assert not any(h.overlaps(r) for h in hw.heap_ranges)
    for a, s in got:
        assert any(h.begin <= a and a + s <= h.end for h in hw.heap_ranges)


def test_thread_arenas_two_heaps_each():
    with fixtures.start("walk_threads") as fx:
        hw, got = stopped_walk(fx)
    want = owned(fx)
    assert want <= got
    extra = sorted(s for _, s in got - want)
    # a tcache struct per worker (each frees), each as large as the walker found it: its own
    # chunk, or a bin chunk 16 bytes larger taken whole (the rest below MINSIZE; seen on sid
    # 2.43: 0x310 chunks, usable 776); the main thread's, which only mallocs, is empty (not
    # told from a zeroed block, so a plain allocation) before 2.43 and absent on 2.43; and
    # one DTV per created thread
    sizes = dict(got - want)
    tcaches = [sizes[t] for t in hw.stats["tcaches"]]
    assert len(tcaches) == fx.expect["threads"]
    assert set(tcaches) <= {TCACHE_USABLE, TCACHE_USABLE + L.TCACHE_STRUCT_SLACK}
    assert extra == sorted([DTV_USABLE] * fx.expect["threads"] + tcaches + IDLE_TCACHE)
    assert hw.stats["arenas"] == 5
    assert hw.stats["heaps"] == 8
    assert hw.soft_issues == []


@pytest.mark.parametrize("mode, runs", [("foreign", 2), ("blocked", 2)])
def test_main_arena_split_runs(mode, runs):
    with fixtures.start("walk_sbrk", mode) as fx:
        hw, got = stopped_walk(fx)
    want = owned(fx)
    assert want <= got
    assert got - want == {(t, TCACHE_USABLE) for t in hw.stats["tcaches"]}
    assert hw.stats["main_runs"] == runs


def test_static_glibc():
    with fixtures.start("walk_basic", extra_flags=["-static"]) as fx:
        hw, got = stopped_walk(fx)
    want = owned(fx)
    assert want <= got
    assert hw.allocator.version is None          # static builds carry no version string
    # (2.43 allocates it at the first free, here from a bin chunk 16 bytes larger)
    tcaches = {(t, s) for t, s in got if t in hw.stats["tcaches"]}
    assert len(tcaches) == 1 and {s for _, s in tcaches} <= {TCACHE_USABLE, TCACHE_USABLE + 16}
    startup = got - want - tcaches
    # ld.so's startup allocations in a static binary (origin, link_map, search paths, ...):
    # all made before main() allocated stdout's buffer, after the tcache (the first chunk)
    stdio = fx.blocks["stdio"].address
    tc = min(tcaches)[0]
    assert 1 <= len(startup) <= 8
    # (2.43: the tcache comes at the first free, after them)
    assert all((tc if GLIBC < (2, 43) else 0) < a < stdio for a, _ in startup)
    assert hw.stats["mmapped"] == 5


def test_static_heap_range_starts_at_sbrk_base():
    with fixtures.start("walk_basic", extra_flags=["-static"]) as fx:
        maps = read_maps(fx.pid)
        hw, got = stopped_walk(fx)
    heap = [m for m in maps if m.path == "[heap]"][0]
    main_runs = [r for r in hw.heap_ranges if heap.begin <= r.begin < heap.end]
    assert len(main_runs) == 1
    assert main_runs[0].begin > heap.begin          # the TCB/TLS before sbrk_base is a root
    assert main_runs[0].end == heap.end


@pytest.mark.parametrize("flags", [[], ["-static"]])
def test_memory_scan_locator_agrees_with_file_image(flags):
    from memunreachable.sweep import detect
    from memunreachable.heaps.glibc import locate
    with fixtures.start("walk_basic", extra_flags=flags) as fx:
        maps = read_maps(fx.pid)
        scan = detect.scan_maps(maps, fx.pid)
        with ProcessMemory(fx.pid) as mem:
            a = locate.locate_in_file(scan.object_mappings, fx.pid, scan.malloc_object)
            b = locate.locate_in_memory(mem, maps, scan.object_mappings, scan.malloc_object, a.version)
    assert (a.method, b.method) == ("file", "memory")
    assert (b.main_arena, b.mp, b.layout) == (a.main_arena, a.mp, a.layout)


# ---- issue 7: never a wrong answer ------------------------------------------------------

def frozen_walk(pid):
    """Freeze pid with ptrace (threads with fs_base, maps), walk its heap, thaw."""
    from memunreachable.collect.freeze import frozen
    with frozen(pid) as fz:
        with memory_of(pid) as mem:
            hw = walk_heap(mem, fz.maps, fz.threads, pid)
        maps = list(fz.maps)
    return hw, set(zip(hw.image.begins, hw.image.sizes)), maps


@pytest.mark.parametrize("mode", ["tcache_garbage", "tcache_cycle", "fastbin_garbage", "fastbin_cycle"])
def test_broken_free_list_is_a_warning_and_its_size_uncertain(mode):
    with fixtures.start("corrupt_freelist", mode) as fx:
        hw, got, _ = frozen_walk(fx.pid)
    size = fx.expect["usable"]
    a, b, c = (fx.blocks[k].address for k in ("freed_a", "freed_b", "freed_c"))
    addrs = {x for x, _ in got}
    # the verified prefix of the chain (c, then b) is free; everything the fixture owns is live
    assert b not in addrs and c not in addrs
    assert owned(fx) - {(a, size), (b, size), (c, size)} <= got
    # a is behind the break: it still looks in use, so its size is uncertain, with a warning
    # that names the list, the node where it broke and why
    assert (a, size) in got
    assert list(hw.uncertain_sizes) == [size]
    msg = hw.uncertain_sizes[size]
    assert msg in hw.soft_issues and len(hw.soft_issues) == 1
    if mode.startswith("tcache"):
        assert msg.startswith(f"tcache {hw.stats['tcaches'][0]:#x} bin 3 (72-byte blocks): "
                              f"chain broken at {b:#x}: next pointer ")
    elif not HAS_FASTBINS:      # 2.43: no fastbins; the fixture breaks the 88-byte tcache chain
        assert msg.startswith(f"tcache {hw.stats['tcaches'][0]:#x} bin 4 (88-byte blocks): "
                              f"chain broken at {b:#x}: next pointer ")
    else:
        assert msg.startswith(f"arena {hw.stats['arena_addresses'][0]:#x} fastbin 4 "
                              f"(88-byte blocks): chain broken at {b:#x}: next pointer ")
    if mode.endswith("cycle"):          # (2.43: the fixture links freed_b to freed_c's user pointer)
        assert f"next pointer {c:#x} loops back into the chain" in msg
    else:
        assert "is not 16-byte aligned" in msg or "is not an in-use chunk" in msg


@pytest.mark.parametrize("free", ["", "free"])
@pytest.mark.parametrize("flags", [[], ["-static"]])
def test_lookalike_tcache_is_not_a_tcache(flags, free):
    with fixtures.start("lookalike_tcache", "0", free, extra_flags=flags) as fx:
        hw, got, _ = frozen_walk(fx.pid)
    want = owned(fx)
    assert want <= got                     # every node and string is an allocation
    cache = fx.blocks["live_cache"].address
    assert cache not in hw.stats["tcaches"]
    # the look-alike passed the shape prefilter; only the main thread's real tcache (when it
    # holds free chunks) is a tcache
    # (2.42+: the look-alike has the 2.30-2.41 shape, which is no 2.42 tcache's)
    assert hw.stats["tcache_candidates"] == (1 if free else 0) + (GLIBC < L.TCACHE_76_FROM)
    assert len(hw.stats["tcaches"]) == (1 if free else 0)
    assert hw.stats.get("tcache_key_kind", "tcache_key") == "tcache_key"
    assert hw.stats["tcache_free"] == (2 if free else 0)
    assert hw.uncertain_sizes == {} and hw.soft_issues == []


NO_FP = ["-O2", "-fomit-frame-pointer"]


@pytest.mark.parametrize("flags", [[], NO_FP])
def test_lookalike_tcache_string_is_not_a_leak_end_to_end(flags):
    from memunreachable.unreachable import check
    with fixtures.start("lookalike_tcache", extra_flags=flags) as fx:
        info = check(fx.pid)
    assert [(lk.address, lk.size) for lk in info.leaks] == [(fx.blocks["leak"].address,
                                                             fx.blocks["leak"].size)]
    assert info.num_leaks == fx.expect["num_leaks"] == 1


def test_forked_heap_grown_after_fork_is_one_heap():
    with fixtures.start("heap_split", "fork") as fx:
        child = fx.expect["child_pid"]
        hw, got, maps = frozen_walk(child)
    heaps = [m for m in maps if m.path == "[heap]"]
    assert len(heaps) >= 2 and all(x.end == y.begin for x, y in zip(heaps, heaps[1:]))
    want = owned(fx)
    assert len(want) == 200 + 64 + 3
    assert want <= got
    # beyond the fixture's blocks, only glibc's tcache struct (empty: nothing small was freed)
    assert [s for _, s in got - want] == IDLE_TCACHE
    # the run crosses the VMA boundary: one main run from sbrk_base to the end of the last [heap]
    assert hw.stats["main_runs"] == 1
    assert any(r.begin < heaps[0].end and r.end == heaps[-1].end for r in hw.heap_ranges)
    assert hw.soft_issues == [] and hw.uncertain_sizes == {}


@pytest.mark.parametrize("flags", [[], NO_FP])
def test_forked_heap_leak_found_end_to_end(flags):
    from memunreachable.unreachable import check
    with fixtures.start("heap_split", "fork", extra_flags=flags) as fx:
        info = check(fx.expect["child_pid"])
    assert [(lk.address, lk.size) for lk in info.leaks] == [(fx.blocks["leak"].address,
                                                             fx.blocks["leak"].size)]


def test_mprotect_split_heap_is_one_heap():
    with fixtures.start("heap_split", "mprotect") as fx:
        hw, got, maps = frozen_walk(fx.pid)
    heaps = [m for m in maps if m.path == "[heap]"]
    assert [m.perms for m in heaps] == ["rw-p", "r--p", "rw-p"]
    assert owned(fx) <= got
    assert [s for _, s in got - owned(fx)] == IDLE_TCACHE
    assert hw.stats["main_runs"] == 1 and hw.soft_issues == []


def test_mprotect_split_mmapped_chunk_is_found():
    with fixtures.start("heap_split", "mmap_mprotect") as fx:
        hw, got, maps = frozen_walk(fx.pid)
    mm = fx.blocks["live_mmap"]
    split = [m for m in maps if m.begin < mm.address + mm.size and m.end > mm.address]
    assert [m.perms for m in split] == ["rw-p", "r--p", "rw-p"]
    assert owned(fx) <= got and (mm.address, mm.size) in got
    assert hw.stats["mmapped"] == 1 and hw.soft_issues == []


def test_mprotect_split_thread_heap_is_walked():
    with fixtures.start("heap_split", "thread_mprotect") as fx:
        hw, got, maps = frozen_walk(fx.pid)
    big = fx.blocks["live_thread_big"]
    heap = [m for m in maps if m.begin <= big.address < m.end][0]
    assert heap.path == "" and heap.end < big.address + big.size     # split inside the block
    assert owned(fx) <= got
    assert hw.stats["arenas"] == 2 and hw.stats["heaps"] == 1 and hw.soft_issues == []


@pytest.mark.parametrize("pages", ["1", "2"])
def test_pages_that_read_as_mmapped_chunks_are_told_apart_by_mp_s_counters(pages):
    # the program's own anonymous mapping begins (and, with 2, has at +32 KiB) 0, size|2: it
    # reads as 1 (2) mmapped chunk(s) more than mp_ counts; the surplus' size tells them apart,
    # so the check neither calls the heap corrupt nor reports them, and what only the mapping
    # points at is live
    from memunreachable.unreachable import check
    with fixtures.start("lookalike_mmapped", pages) as fx:
        info = check(fx.pid, limit=None)
    assert sorted((lk.address, lk.size) for lk in info.leaks) == sorted(
        (fx.blocks[k].address, fx.blocks[k].size) for k in ("leak_big", "leak"))
    assert info.num_leaks == fx.expect["num_leaks"] == 2
    assert info.stats["stats"]["mmapped"] == 2
    # (the fixture writes the header format of the glibc it runs on: 2.43's too)
    assert info.stats["stats"]["mmapped_lookalikes"] == int(pages)


def test_untouched_anonymous_pages_are_neither_read_nor_roots_and_chunks_span_them():
    # a 64 MiB mapping untouched but its last page, a 16 MiB calloc'd chunk touched at its
    # header and at +12 MiB (its upper half advised MADV_HUGEPAGE: its VMA is split), a leaked
    # 8 MiB one touched at +6 MiB: the chunks are found whole, what their far pages point at
    # is live (or folded under the leak), and the untouched pages outside them are skipped
    from memunreachable.unreachable import check
    with fixtures.start("untouched") as fx:
        info = check(fx.pid, limit=None)
    b = fx.blocks
    assert sorted((lk.address, lk.size, lk.referenced_count) for lk in info.leaks) == sorted(
        [(b["leak_big"].address, b["leak_big"].size, 1), (b["leak"].address, b["leak"].size, 0)])
    assert info.num_leaks == fx.expect["num_leaks"] == 3
    assert info.stats["stats"]["mmapped"] == 2
    assert info.stats["stats"]["untouched_bytes"] >= 63 << 20, info.stats["stats"]


def test_glibc_points_at_the_chunk_after_each_leak_below_free():
    """leak_below_free's leaks face what they claim: each leak's last usable 8 bytes are the
    header of a chunk that an arena's malloc_state points at (top, a bin, a fastbin), or, for
    leak_mid, that only free chunks' links point at (the fixture checks those)."""
    with fixtures.start("leak_below_free") as fx:
        with stopped_memory(fx.pid) as mem:
            hw = walk_heap(mem, read_maps(fx.pid), [], fx.pid)
            main = hw.metadata_ranges[0]
            words = {a: {w for (w,) in struct.iter_unpack("<Q", mem.read(a, main.size))}
                     for a in hw.stats["arena_addresses"]}
    assert hw.stats["arena_addresses"][0] == main.begin and len(words) == 2
    thread_arena = next(a for a in words if a != main.begin)
    headers = {k: b.address + b.size - 8 for k, b in fx.blocks.items()}
    assert {k for k, h in headers.items() if h in words[main.begin]} == {
        "leak_top", "leak_small", "leak_unsorted", "leak_fast"}
    assert {k for k, h in headers.items() if h in words[thread_arena]} == {
        "leak_t_top", "leak_t_unsorted"}
    assert "leak_mid" in headers
