"""Stage 4 (allocations): consistency verdicts for a heap walk (glibc-heap.md section 11).

A snapshot taken while a thread was inside malloc/free can be half-updated. Each check here
turns an observation into nothing, a soft issue (a tolerated in-transit state, reported as a
warning) or a hard issue (the orchestrator retakes the snapshot). Pure policy: no memory access.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from memunreachable._errors import HeapWalkError

# mu_walk_run statuses (native/mu_walk.h)
WALK_TOP, WALK_FENCE2, WALK_FENCE0 = 0, 1, 2
WALK_STATUS_NAMES = {0: "top", 1: "double fencepost", 2: "heap-end fencepost", 3: "bad chunk size",
                     4: "bad chunk flags", 5: "stepped over top", 6: "region ended"}
# mu_walk_chain statuses
CHAIN_NULL, CHAIN_BAD, CHAIN_LONG = 0, 1, 2
BINS_SOFT_SLACK = 2          # chunks in transit tolerated by the bins cross-check


class HeapInconsistent(HeapWalkError):
    """A hard inconsistency: the snapshot must be retaken."""


@dataclass
class Verdict:
    soft: List[str] = field(default_factory=list)
    hard: List[str] = field(default_factory=list)

    def raise_if_hard(self) -> None:
        if self.hard:
            raise HeapInconsistent("heap walk inconsistent: " + "; ".join(self.hard[:5]))


def check_run(v: Verdict, what: str, status: int, end: int, bad_at: int, want_status,
              want_end=None) -> bool:
    """A run must end exactly: in one of want_status, at want_end when given. True if it did."""
    if status not in want_status:
        v.hard.append(f"{what}: chunk chain broke at {bad_at:#x} "
                      f"({WALK_STATUS_NAMES.get(status, status)})")
        return False
    if want_end is not None and end != want_end:
        v.hard.append(f"{what}: chain ends at {end:#x}, expected {want_end:#x}")
        return False
    return True


def judge_tcache(valid_bins: int, bad_bins: int) -> str:
    """'tcache' (accept), 'ignore' (not a tcache), or 'hard' (a tcache too broken to use).

    Accept at most one inconsistent bin (a tcache_put/get in flight in the owning thread).
    A struct with no valid bin is an ordinary 0x290 block (or an empty tcache: it hides nothing)."""
    if valid_bins == 0:
        return "ignore"
    if bad_bins <= 1:
        return "tcache"
    return "hard" if valid_bins >= 2 else "ignore"


def check_fastbin(v: Verdict, arena: int, i: int, status: int) -> None:
    if status != CHAIN_NULL:
        v.hard.append(f"arena {arena:#x}: fastbin {i} chain is broken")


def check_bins(v: Verdict, arena: int, broken: int, binned: int, binned_bit_free: int,
               bit_free: int) -> None:
    """The chunks on bins 1-126 are exactly the arena's bit-free chunks."""
    off = abs(binned - bit_free) + (binned - binned_bit_free)
    if broken > 1:
        v.hard.append(f"arena {arena:#x}: {broken} bin lists are broken")
    elif broken == 1:
        v.soft.append(f"arena {arena:#x}: one bin list in transit")
    elif off > BINS_SOFT_SLACK:
        v.hard.append(f"arena {arena:#x}: bins hold {binned} chunks, the walk found {bit_free} free")
    elif off:
        v.soft.append(f"arena {arena:#x}: bins and walk differ by {off} chunk(s) in transit")


def check_mmapped(v: Verdict, found: int, found_bytes: int, n_mmaps: int, mmapped_mem: int) -> None:
    if found != n_mmaps or found_bytes != mmapped_mem:
        v.hard.append(f"mmapped chunks: found {found} ({found_bytes} bytes), "
                      f"mp_ says {n_mmaps} ({mmapped_mem} bytes)")


def check_tcache_bad_bin(v: Verdict, tcache: int, bad_bins: int) -> None:
    if bad_bins:
        v.soft.append(f"tcache {tcache:#x}: one bin in transit (its chain counted as free)")
