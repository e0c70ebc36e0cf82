"""Stage 4 on current glibc (issue 22): fixtures built and run inside Debian roots
(tests/distros.py: sid ships glibc 2.43, trixie 2.41), checked from the host. The leaks each
fixture prints are reported exactly, nothing else, and the walker's totals equal the
mallinfo2() the fixture took itself. glibc 2.42+ specifics: the 76-bin tcache with num_slots
and size-sorted large bins (enabled with the glibc.malloc.tcache_max tunable), 2.43's removed
fastbins and its mmapped chunks in the normal chunk layout (kept by a large tcache bin)."""
import os

import pytest

import fixtures
from memunreachable.sweep import detect
from memunreachable.collect.freeze import frozen
from memunreachable.heaps.glibc import layout as L
from memunreachable.heaps.glibc import locate
from memunreachable.heaps.glibc.walker import walk_heap
from memunreachable.collect.memory import ProcessMemory
from memunreachable.unreachable import check

pytestmark = [pytest.mark.distro, pytest.mark.ptrace]

LARGE_TCACHE = "glibc.malloc.tcache_max=4000000"    # 2.42+: frees of chunks < 4 MiB cached

# root -> (glibc version, malloc_par family, malloc_state family)
ROOTS = {"sid": ("2.43", L.MP_243, L.MALLOC_STATE_243),
         "trixie": ("2.41", L.MP_235, L.MALLOC_STATE_227)}


def start(name, root, tunables=""):
    """fixtures.start inside a root, with GLIBC_TUNABLES (empty: glibc's defaults)."""
    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    return fixtures.start(name, root=root, env=env)


def leak_blocks(fx):
    return sorted((b.address, b.size) for k, b in fx.blocks.items() if k.startswith("leak"))


def frozen_walk(pid):
    with frozen(pid) as fz:
        with ProcessMemory(pid) as mem:
            hw = walk_heap(mem, fz.maps, fz.threads, pid)
    return hw, set(zip(hw.image.begins, hw.image.sizes))


CASES = [("sid", ""), ("sid", LARGE_TCACHE), ("trixie", "")]


@pytest.mark.parametrize("root, tunables", CASES)
def test_leaks_are_reported_exactly(root, tunables):
    with start("glibc_current", root, tunables) as fx:
        info = check(fx.pid, limit=None)
    assert sorted((lk.address, lk.size) for lk in info.leaks) == leak_blocks(fx)
    assert info.num_leaks == fx.expect["num_leaks"] == 10
    assert info.stats["stats"]["arenas"] == fx.expect["threads"] + 1


@pytest.mark.parametrize("root, tunables", CASES)
def test_walker_totals_equal_mallinfo2(root, tunables):
    version, par, state = ROOTS[root]
    with start("glibc_current", root, tunables) as fx:
        hw, got = frozen_walk(fx.pid)
    st, e = hw.stats, fx.expect
    assert hw.allocator.version == version and hw.soft_issues == [] and hw.uncertain_sizes == {}
    # every block the fixture owns or leaked is an allocation, with its malloc_usable_size
    assert {(b.address, b.size) for b in fx.blocks.values()} <= got
    assert st["system_mem"] == e["mi_arena"]
    assert st["mmapped"] == e["mi_hblks"] and st["mmapped_bytes"] == e["mi_hblkhd"]
    # bins hold the chunks whose next header has PREV_INUSE clear; one top per arena
    assert st["free_chunks"] + st["arenas"] == e["mi_ordblks"]
    assert st["free_bytes"] + st["top_bytes"] + e["mi_fsmblks"] == e["mi_fordblks"]
    # in use: chunks (tcache'd ones too: mallinfo counts them used) and each thread arena's
    # heap_info + malloc_state before its first chunk (one heap each here)
    header = par.heap_info.first_chunk(0, state, True)
    assert st["in_use_bytes"] - e["mi_fsmblks"] + e["threads"] * header == e["mi_uordblks"]
    assert st["heaps"] == e["threads"]
    if root == "sid":
        assert st["fastbin_free"] == 0 and e["mi_smblks"] == 0     # 2.43: no fastbins


def read_bins(mem, t, tc, max_count):
    """[(bin, count from num_slots, [(node, chunk size)] following the chain)] of the
    non-empty bins of the tcache at t, read straight from the target: heads are plain user
    pointers, links safe-linked ((field address >> 12) ^ next)."""
    data = mem.read(t, tc.entries + 8 * tc.nbins)
    out = []
    for i in range(tc.nbins):
        slots = int.from_bytes(data[2 * i:2 * i + 2], "little")
        e = int.from_bytes(data[tc.entries + 8 * i:tc.entries + 8 * i + 8], "little")
        if not e:
            assert slots == max_count
            continue
        nodes = []
        while e and len(nodes) <= max_count:
            assert e % 16 == 0
            nodes.append((e, int.from_bytes(mem.read(e - 8, 8), "little") & ~7))
            e = int.from_bytes(mem.read(e, 8), "little") ^ (e >> 12)
        out.append((i, max_count - slots, nodes))
    return out


def test_large_tcache_bins_hold_sorted_chains_and_an_mmapped_chunk():
    tc = L.TCACHE_76
    with start("glibc_current", "sid", LARGE_TCACHE) as fx:
        hw, got = frozen_walk(fx.pid)
        with frozen(fx.pid):
            with ProcessMemory(fx.pid) as mem:
                bins = {t: read_bins(mem, t, tc, L.MP_INIT_TCACHE_COUNT_243)
                        for t in hw.stats["tcaches"]}
    # one tcache per thread (760-byte structs)
    assert len(hw.stats["tcaches"]) == fx.expect["threads"] + 1
    assert all((t, tc.chunk_size - L.SIZE_SZ) in got for t in hw.stats["tcaches"])
    large = 0
    for t, found in bins.items():
        for i, count, nodes in found:
            lo, hi = tc.bin_size_range(i)
            sizes = [s for _, s in nodes]
            # num_slots is the room left: the chain holds tcache_count - num_slots chunks, of
            # the bin's sizes, sorted (a large bin); none of them is reported
            assert len(nodes) == count and all(lo <= s <= hi for s in sizes)
            assert sizes == sorted(sizes)
            assert not {u for u, _ in nodes} & {a for a, _ in got}
            large += i >= tc.small_bins and len(set(sizes)) > 1
    assert large >= 4           # a sorted chain of several sizes in every arena's tcache
    free = sum(len(n) for found in bins.values() for _, _, n in found)
    assert free == hw.stats["tcache_free"]
    # the freed 150000-byte mmapped chunk stays mapped (glibc counts it) but is free
    assert hw.stats["mmapped"] == 5 == fx.expect["mi_hblks"]
    owned = {(b.address, b.size) for b in fx.blocks.values()}
    assert sorted((a, s) for a, s in got if s > 100000) == sorted(x for x in owned if x[1] > 100000)


@pytest.mark.parametrize("root", sorted(ROOTS))
def test_locators_find_the_layout_families(root):
    version, par, state = ROOTS[root]
    with start("glibc_current", root) as fx:
        with frozen(fx.pid) as fz:
            maps = list(fz.maps)
            scan = detect.scan_maps(maps, fx.pid)
            with ProcessMemory(fx.pid) as mem:
                a = locate.locate_in_file(scan.object_mappings, fx.pid, scan.malloc_object)
                b = locate.locate_in_memory(mem, maps, scan.object_mappings, scan.malloc_object,
                                            None)
    assert (a.method, b.method) == ("file", "memory")
    assert a.version == version and a.layout == L.Layout(state, par)
    # the memory scan needs no version hint: the ring and mp_'s fields pick the families
    assert (b.main_arena, b.mp, b.layout) == (a.main_arena, a.mp, a.layout)
