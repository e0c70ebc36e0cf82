"""End-to-end `check(pid)` on the C fixtures: exact leak sets, folding and counts.

Each fixture (fixtures/NAME.c) prints its blocks and expected totals, then blocks in read(2).
For every fixture in expected.EXPECTED the test asserts, per check:
- the set of entry addresses is exactly the fixture's head blocks (a cycle's lowest address),
  with each entry's size, referenced_count and referenced_size;
- num_leaks and leak_bytes equal the fixture's own `expect` lines (computed there from
  malloc_usable_size), which in turn equal the labelled leak blocks;
- no live_* block is an entry or lies inside one;
- the target is still running normally: no thread left in a stop, no snapshot child left
  behind (zombie or not), and on quit its blocked read resumed and it exited 0 (fx.finish()).
"""
from __future__ import annotations

import bisect
import os

import pytest

import fixtures
from expected import EXPECTED, Head, Shape
from memunreachable.unreachable import check

pytestmark = pytest.mark.ptrace


def leak_labels(fx) -> list:
    return sorted(k for k in fx.blocks if k.startswith("leak"))


def live_labels(fx) -> list:
    return sorted(k for k in fx.blocks if k.startswith("live"))


def heads_of(fx, shape: Shape) -> list:
    if shape.singletons:
        return [Head((k,)) for k in sorted(fx.blocks) if k.startswith(shape.singletons)]
    return list(shape.heads)


def expected_entries(fx, shape: Shape) -> dict:
    """address -> (size, referenced_count, referenced_size), from the fixture's own output."""
    out = {}
    for head in heads_of(fx, shape):
        blocks = [fx.blocks[k] for k in head.members]
        rep = min(blocks, key=lambda b: b.address)
        folded = [b for b in blocks if b is not rep] + [fx.blocks[k] for k in head.refs]
        out[rep.address] = (rep.size, len(folded), sum(b.size for b in folded))
    return out


def assert_table_matches_fixture(fx, shape: Shape) -> None:
    """The table covers exactly the fixture's labelled leaks, and they add up to its expect lines."""
    named = set()
    for head in heads_of(fx, shape):
        named.update(head.members, head.refs)
    assert named == set(leak_labels(fx)), f"{fx.name}: table and fixture labels differ"
    assert fx.expect["num_leaks"] == len(named)
    assert fx.expect["leak_bytes"] == sum(fx.blocks[k].size for k in named)


def describe(fx, entries: dict) -> dict:
    names = {b.address: k for k, b in fx.blocks.items()}
    return {names.get(a, hex(a)): v for a, v in entries.items()}


def children_of(pid: int) -> list:
    """(pid, state) of every process whose parent is `pid`, zombies included."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid:
            found.append((int(entry), fields[0]))
    return found


def thread_states(pid: int) -> dict:
    states = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        states[int(tid)] = stat[stat.rindex(")") + 2:].split()[0]
    return states


def assert_target_running(fx) -> None:
    assert fx.alive(), f"{fx.name} died during the check"
    stopped = {tid: s for tid, s in thread_states(fx.pid).items() if s in "tT"}
    assert stopped == {}, f"{fx.name}: threads left stopped after the check"
    assert children_of(fx.pid) == [], f"{fx.name}: snapshot process left behind"


def assert_result(fx, shape: Shape, info) -> None:
    want = expected_entries(fx, shape)
    got = {l.address: (l.size, l.referenced_count, l.referenced_size) for l in info.leaks}
    assert len(got) == len(info.leaks), "duplicate entry addresses"
    assert describe(fx, got) == describe(fx, want)
    assert info.num_leaks == fx.expect["num_leaks"]
    assert info.leak_bytes == fx.expect["leak_bytes"]
    assert info.truncated == 0
    for label in live_labels(fx):
        live = fx.blocks[label].address
        inside = [hex(l.address) for l in info.leaks if l.address <= live < l.address + l.size]
        assert inside == [], f"live block {label} reported as (inside) a leak"
    # every labelled block was enumerated as an allocation
    assert info.num_allocations >= len(fx.blocks)
    assert info.allocation_bytes >= sum(b.size for b in fx.blocks.values())
    # sorted by total size, ties by address
    keys = [(-l.total_size, l.address) for l in info.leaks]
    assert keys == sorted(keys)
    for label, contents in shape.contents.items():
        entry = next(l for l in info.leaks if l.address == fx.blocks[label].address)
        assert entry.contents == contents


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_check_fixture(name):
    shape = EXPECTED[name]
    with fixtures.start(name, timeout=120) as fx:
        assert_table_matches_fixture(fx, shape)
        for _ in range(shape.repeat):
            info = check(fx.pid, limit=None)
            assert_result(fx, shape, info)
            assert_target_running(fx)
    # leaving the block: fx.finish() asserts the read resumed without EINTR and exit 0


def test_limit_keeps_the_largest():
    with fixtures.start("leak_five") as fx:
        info = check(fx.pid, limit=2)
        assert [l.address for l in info.leaks] == [fx.blocks["leak_1"].address,
                                                  fx.blocks["leak_2"].address]
        assert [l.size for l in info.leaks] == [fx.blocks["leak_1"].size, fx.blocks["leak_2"].size]
        assert info.truncated == 3
        assert info.num_leaks == fx.expect["num_leaks"] == 5
        assert info.leak_bytes == fx.expect["leak_bytes"]
        assert_target_running(fx)


def test_limit_zero_gives_counts_only():
    with fixtures.start("leak_five") as fx:
        info = check(fx.pid, limit=0)
        assert info.leaks == []
        assert info.truncated == 5
        assert info.num_leaks == 5
        assert info.leak_bytes == fx.expect["leak_bytes"]
        assert_target_running(fx)


def test_repeated_checks_agree():
    """Checking twice gives the same result, and the second check does not see the first."""
    with fixtures.start("leak_chain") as fx:
        first = check(fx.pid, limit=None)
        second = check(fx.pid, limit=None)
        assert [(l.address, l.size, l.referenced_count, l.referenced_size) for l in first.leaks] == \
               [(l.address, l.size, l.referenced_count, l.referenced_size) for l in second.leaks]
        assert (first.num_leaks, first.leak_bytes) == (second.num_leaks, second.leak_bytes)
        assert_target_running(fx)


def test_snapshot_is_killed_once_the_sweep_has_copied_what_it_reads(tmp_path, monkeypatch):
    """For a target without a CPython runtime or tracking table the sweeper kills the snapshot
    process right after reading the roots (before the mark), and the result is exact."""
    from memunreachable.sweep import steps

    seen = tmp_path / "released"
    real = steps._early_release

    def recording(snap):
        release = real(snap)

        def wrapped():                  # runs in the sweeper: it leaves a file behind
            with open(seen, "w") as f:
                f.write(f"{snap.pid} {_state(snap.pid)}")
            release()
        return wrapped if release is not None else None
    monkeypatch.setattr(steps, "_early_release", recording)
    with fixtures.start("leak_five") as fx:
        info = check(fx.pid, limit=None)
        assert_result(fx, EXPECTED["leak_five"], info)
        assert_target_running(fx)
        clone, state = seen.read_text().split()
        assert int(clone) != fx.pid and state == "t"       # the stopped clone, alive until then
        assert info.snapshot_mode == "clone"


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return stat[stat.rindex(")") + 2:].split()[0]


def test_readline_and_terminfo_state_found_in_a_real_process():
    # what libstate.py finds from the libraries' exported symbols (Debian's libreadline and
    # libtinfo) is exactly what the fixture itself says is there
    from memunreachable.heaps import libstate
    from memunreachable.collect import procfs
    from memunreachable.collect.memory import ProcessMemory
    with fixtures.start("leak_keymap_stale") as fx:
        mem = ProcessMemory(fx.pid)
        try:
            state = libstate.of_process(mem, procfs.read_maps(fx.pid), fx.pid)
        finally:
            os.close(mem.fd)
        keymaps = [a for a, used in state.tails if used == 257 * 16]
        assert len(keymaps) == fx.expect["stale_keymaps"] > 0
        # every type word (with its stale padding) is inside a dead range
        starts = [b for b, _e in state.ranges]
        for k in keymaps:
            for i in range(257):
                j = bisect.bisect_right(starts, k + 16 * i) - 1
                assert j >= 0 and state.ranges[j][1] >= k + 16 * i + 8
        assert (fx.expect["line_buffer"], 0) in state.tails
        assert (fx.expect["terminfo_table"], 0) in state.tails and fx.expect["terminfo_table"]
        # readline's function map: its array up to the NULL, and each FUNMAP's 16 bytes
        n = fx.expect["funmap_entries"]
        assert n > 100 and (fx.expect["funmap"], 8 * (n + 1)) in state.tails
        entries = [a for a, used in state.tails if used == 16]
        assert len(entries) == n
        # readline's history: its three entries and their NULL
        assert fx.expect["history_entries"] == 3
        assert (fx.expect["history"], 8 * 4) in state.tails
        # and the environment's strings (the fixture's, and readline's LINES and COLUMNS),
        # and nothing else but terminfo's extended table
        mem = ProcessMemory(fx.pid)
        try:
            rest = [mem.read(a, 64).split(b"\0")[0] for a, used in state.tails
                    if used not in (257 * 16, 16) and a not in (
                        fx.expect["line_buffer"], fx.expect["terminfo_table"], fx.expect["funmap"],
                        fx.expect["history"])]
        finally:
            os.close(mem.fd)
        with open(f"/proc/{fx.pid}/environ", "rb") as f:
            names = {v.split(b"=")[0] for v in f.read().split(b"\0") if v} | {b"LINES", b"COLUMNS"}
        env = [t for t in rest if t.split(b"=")[0] in names and b"=" in t]
        assert len(rest) - len(env) in (0, 1) and len(env) >= len(names) - 2


def test_another_allocator_s_memory_is_said_to_be_unchecked():
    # 96 MiB of a pool of the program's own over mmap (as a prefixed, statically linked
    # jemalloc keeps) beside 1 glibc leak: the leak exactly, and the report says that this
    # much memory was read as roots and never checked as allocations; 16 MiB (less than the
    # threshold) says nothing of the kind
    with fixtures.start("own_pool", "96") as fx:
        info = check(fx.pid)
        leak = fx.blocks["leak_a"]
        assert {(l.address, l.size) for l in info.leaks} == {(leak.address, leak.size)}
        said = [w for w in info.warnings if "anonymous memory outside the heaps" in w]
        assert len(said) == 1, info.warnings
        mib, unit = said[0].split()[:2]
        assert unit == "MiB" and fx.expect["pool_bytes"] >> 20 <= float(mib) \
            <= (fx.expect["pool_bytes"] >> 20) + 2, said
        assert "never checked as allocations" in said[0] and "are not seen" in said[0]
    with fixtures.start("own_pool", "16") as fx:
        info = check(fx.pid)
        assert {l.address for l in info.leaks} == {fx.blocks["leak_a"].address}
        assert not [w for w in info.warnings if "anonymous memory outside" in w], info.warnings
