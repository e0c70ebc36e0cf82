"""Step 9 (symbolize, suppress, group) end to end on real processes, before the tracking
library exists: the leaks come from a real check of fixtures/leak_five.c, and the allocation
stacks are the real return addresses fixtures/sym_chain.c printed (built -O2 -g without frame
pointers), with that process's modules, exactly what the tracker hands to step 9.

Also the CLI: a bad --suppressions file is a usage error (exit 2) found before the target is
touched; --suppressions/--no-symbolize on an untracked target change nothing (no stacks: no
frames, nothing suppressed, exit 23).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import fixtures
from memunreachable.collect import procfs
from memunreachable.stacks import suppressions
from memunreachable import unreachable
from memunreachable.reporters import format_text, render_json
from memunreachable.stacks.symbolize import SymbolCache
from sym_helpers import SymProcess, build_sym, lines_marked, source

pytestmark = pytest.mark.ptrace

CLI = [sys.executable, "-m", "memunreachable", "check"]


@pytest.fixture(autouse=True)
def private_symbol_cache(tmp_path, monkeypatch):
    """Step 9 uses the process-wide cache: give it a fresh one whose disk cache is private."""
    from memunreachable.stacks import symbolize
    monkeypatch.setattr(symbolize, "DEFAULT_CACHE", SymbolCache(disk_dir=str(tmp_path / "sc")))


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    exe = build_sym("sym_chain.c", str(tmp_path_factory.mktemp("symlive")))
    with SymProcess(exe) as sp:
        yield sp, exe


def checked_leak_five():
    """(info, leaks) of a real check of leak_five with the limit off; the fixture's blocks."""
    with fixtures.start("leak_five") as fx:
        info = unreachable.check(fx.pid, limit=None)
        blocks = fx.block_list("leak_")
    assert sorted(l.address for l in info.leaks) == sorted(b.address for b in blocks)
    return info, blocks


def with_stacks(info, sp, n_recorded):
    """The tracker's part: the first n leaks (by address) get sym_chain's stack; the rest
    were allocated untracked. info.modules = sym_chain's executable mappings."""
    leaks = sorted(info.leaks, key=lambda l: l.address)
    for l in leaks[:n_recorded]:
        l.stack, l.stack_status = list(sp.pcs), "recorded"
    info.modules = sp.modules()
    info.groups = []
    return leaks


def test_step9_groups_same_stack_and_names_frames(chain):
    sp, exe = chain
    info, blocks = checked_leak_five()
    leaks = with_stacks(info, sp, 3)
    recorded = leaks[:3]
    unreachable.symbolize_and_group(info, leaks, None, True, [])
    # one group for the three leaks with the stack (largest total first), two single leaks
    sizes = {b.address: b.size for b in blocks}
    group = next(g for g in info.groups if g.num_entries == 3)
    assert [l.address for l in group.leaks] == [l.address for l in recorded]
    assert group.total_size == sum(sizes[l.address] for l in recorded)
    assert len(info.groups) == 3 and info.truncated == 0
    assert [g.total_size for g in info.groups] == sorted((g.total_size for g in info.groups),
                                                         reverse=True)
    marks = lines_marked("sym_chain.c")
    names = [(f.function, f.file, f.line) for f in group.backtrace if f.module == exe][:5]
    assert names == [("leaf", source("sym_chain.c"), marks["leaf_bt"]),
                     ("helper", source("sym_chain.c"), marks["helper_leaf"]),
                     ("mid", source("sym_chain.c"), marks["mid_helper"]),
                     ("outer", source("sym_chain.c"), marks["outer_mid"]),
                     ("main", source("sym_chain.c"), marks["main_outer"])]
    text = format_text(info)
    rep = group.representative
    assert (f"   and {group.similar_size} similar unreachable bytes in 2 allocations"
            in text.split("\n"))
    assert text.count(" in leaf ") == 1                     # the stack is printed once
    obj = render_json(info)
    first = obj["leaks"][obj["groups"][info.groups.index(group)]["leaks"][0]]
    assert first["address"] == rep.address
    assert first["backtrace"][0]["function"] == "leaf"
    assert first["backtrace"][0]["line"] == marks["leaf_bt"]
    assert all(obj["leaks"][i]["backtrace"] == [] for g in obj["groups"] if g["num_entries"] == 1
               for i in g["leaks"])


def test_step9_suppression_removes_leaks_from_counts(chain):
    sp, exe = chain
    info, blocks = checked_leak_five()
    leaks = with_stacks(info, sp, 3)
    before_n, before_bytes = info.num_leaks, info.leak_bytes
    suppressed_bytes = sum(l.size for l in leaks[:3])
    rules = suppressions.parse("# the chain's middle function\nleak:outer\nleak:never\n")
    unreachable.symbolize_and_group(info, leaks, None, True, rules)
    assert sorted(l.address for l in info.leaks) == sorted(l.address for l in leaks[3:])
    assert (info.num_leaks, info.leak_bytes) == (before_n - 3, before_bytes - suppressed_bytes)
    assert (info.num_suppressed, info.suppressed_bytes) == (3, suppressed_bytes)
    assert info.suppressions_used == [("outer", 3, suppressed_bytes)]
    lines = format_text(info).split("\n")
    assert f"      3 {suppressed_bytes:10d} outer" in lines


def test_step9_module_rule_matches_without_symbols(chain):
    sp, exe = chain
    info, _ = checked_leak_five()
    leaks = with_stacks(info, sp, 5)
    rules = suppressions.parse(f"leak:^{exe}$\n")
    unreachable.symbolize_and_group(info, leaks, None, False, rules)
    assert info.leaks == [] and info.num_leaks == 0 and info.suppressions_used[0][1] == 5


def test_cli_bad_suppressions_file_exit_2_target_untouched(tmp_path):
    supp = tmp_path / "bad.supp"
    supp.write_text("leak:fine\nrace:not_ours\n")
    with fixtures.start("leak_one") as fx:
        res = subprocess.run(CLI + [str(fx.pid), "--suppressions", str(supp)],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 2, res.stderr
        assert f"{supp}:2: failed to parse suppressions: unknown suppression type 'race'" \
            in res.stderr
        assert procfs.read_status(fx.pid).tracer_pid == 0
        missing = subprocess.run(CLI + [str(fx.pid), "--suppressions", str(tmp_path / "no")],
                                 capture_output=True, text=True, timeout=60)
        assert missing.returncode == 2 and "cannot read the suppressions file" in missing.stderr


def test_cli_untracked_target_with_suppressions_and_no_symbolize(tmp_path):
    supp = tmp_path / "all.supp"
    supp.write_text("leak:*\n")
    with fixtures.start("leak_five") as fx:
        res = subprocess.run(CLI + [str(fx.pid), "--json", "--no-symbolize", "--suppressions",
                                    str(supp)], capture_output=True, text=True, timeout=120)
        expect = fx.expect
    assert res.returncode == 23, res.stderr
    obj = json.loads(res.stdout)
    # no allocation stacks: nothing to match, nothing suppressed, every leak its own group
    assert obj["num_leaks"] == expect["num_leaks"] and obj["num_suppressed"] == 0
    assert obj["suppressions_used"] == []
    assert all(l["backtrace"] == [] and l["stack_status"] == "untracked" for l in obj["leaks"])
    assert [g["leaks"] for g in obj["groups"]] == [[i] for i in range(len(obj["leaks"]))]


def test_api_suppressions_in_process_and_bad_file(tmp_path):
    from memunreachable._errors import SuppressionsError
    from memunreachable.noleaks import get_unreachable_memory
    bad = tmp_path / "bad.supp"
    bad.write_text("leak:a\n\nnot a rule\n")
    with pytest.raises(SuppressionsError) as ei:
        get_unreachable_memory(suppressions=str(bad))
    assert ei.value.line == 3 and ei.value.path == str(bad)
    # the rules travel to the in-process helper; this process has no stacks: nothing matches
    info = get_unreachable_memory(limit=None, suppressions=suppressions.parse("leak:*\n"),
                                  symbolize=False)
    assert info.num_suppressed == 0 and info.suppressions_used == []
    assert all(l.backtrace == [] and l.stack_status == "untracked" for l in info.leaks)
    assert len(info.groups) == len(info.leaks)
