"""pytest_tracked.py: the pytest plugin's tracked sessions (issue 24), its pure parts.

Under `--memunreachable` the plugin routes the test process's allocations through the
tracking library (track_here: the malloc family of every loaded object, and CPython's object
allocator), so each block records its allocation stack and an epoch: which test, and which
phase of it, was running. A test then needs no check of its own: one sweep after a stretch of
tests finds the blocks that became unreachable since the last sweep, and each is blamed on the
test whose body allocated it. What this module decides, on plain data:

- epochs: 4 * n + phase for test number n (1, 2, ...), phase SETUP, CALL or TEARDOWN; 0 is
  outside any test (collection, pytest's own code between tests);
- attribute(): a new leak allocated by the body of a test of the stretch is that test's; one
  allocated by its fixtures (setup or teardown) is reported as a warning and fails nobody, as
  the per-test baseline had it; one allocated before the stretch (or before tracking began) was
  orphaned during it: the stretch's only test's, else the stretch's as a whole;
- Pacing: when a sweep is due. A sweep costs 50-200 ms in a pytest process: the stretch
  grows until the tests' own time since the last sweep is RATIO (8) times what that sweep cost,
  so sweeps take at most a ninth of the session.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

OUTSIDE, SETUP, CALL, TEARDOWN = 0, 1, 2, 3
PHASES = {SETUP: "setup", CALL: "call", TEARDOWN: "teardown"}
RATIO = 8.0                 # tests' time : sweep time
MAX_EPOCH = (1 << 32) - 1   # the table's epochs are u32


def epoch(number: int, phase: int) -> int:
    """The epoch of phase `phase` of test `number` (numbers past the u32 range wrap, skipping 0)."""
    return (4 * number + phase) % (MAX_EPOCH + 1) or OUTSIDE


def split(value: Optional[int]) -> Tuple[int, int]:
    """(test number, phase) of an epoch; (0, OUTSIDE) for none."""
    if not value:
        return 0, OUTSIDE
    return value // 4, value % 4


class Attribution:
    """The new leaks of one sweep, sorted out (each list keeps the sweep's order)."""

    def __init__(self) -> None:
        self.by_test: Dict[int, list] = {}      # test number -> leaks its body allocated
        self.fixtures: Dict[int, list] = {}     # test number -> leaks its setup/teardown made
        self.orphans: list = []                 # allocated before the stretch


def newest_epoch(leak) -> Optional[int]:
    """The latest epoch among a leak's blocks (the entry's own and those it holds): the leak
    formed after that allocation. Not the entry's own alone: CPython hands out tuples, lists,
    dicts and floats again from free lists without its allocator, so a leaked object may be a
    block allocated long before, holding blocks the test made (a list's item array)."""
    epochs = [b.epoch for b in [leak] + list(getattr(leak, "indirect", ())) if b.epoch]
    return max(epochs) if epochs else None


def attribute(leaks: Sequence, numbers: Sequence[int]) -> Attribution:
    """Sort the new leaks of a sweep by the newest epoch of their blocks (Leak.epoch: None when
    untracked) against the test numbers of the stretch the sweep closes."""
    out, stretch = Attribution(), set(numbers)
    for leak in leaks:
        number, phase = split(newest_epoch(leak))
        if number not in stretch or phase == OUTSIDE:
            out.orphans.append(leak)
        elif phase == CALL:
            out.by_test.setdefault(number, []).append(leak)
        else:
            out.fixtures.setdefault(number, []).append(leak)
    return out


def sweep_due(tests: int, cap: Optional[int], tests_seconds: float, last_sweep: float,
              last: bool, failed: bool) -> bool:
    """Whether the stretch of `tests` tests ends now: the session's last test, a failure (so
    -x and --sw stop at once), `cap` tests (--memunreachable-batch), or the tests' time since
    the last sweep RATIO times what that sweep cost."""
    return (last or failed or (cap is not None and tests >= cap)
            or tests_seconds >= RATIO * last_sweep)


def orphan_text(first: str, last: str, count: int) -> str:
    """Where a stretch's orphans come from, for its report."""
    return (f"allocated before these tests, unreachable since one of the {count} tests from "
            f"{first} to {last} ran (--memunreachable-batch 1 names the test)")


def summary_lines(orphans: List[Tuple[str, str]]) -> List[str]:
    """The terminal summary's section: where, then the report, of each stretch's orphans."""
    out: List[str] = []
    for where, report in orphans:
        out += [where] + report.rstrip("\n").splitlines() + [""]
    return out
