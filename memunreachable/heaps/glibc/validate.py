"""Stage 4 (allocations): consistency verdicts for a heap walk (glibc-heap.md section 11).

A snapshot taken while a thread was inside malloc/free can be half-updated, and a program can
corrupt its own free lists (a write through a dangling pointer). Each check here turns an
observation into nothing, a soft issue (a warning; a free list that is off or broken also
makes its block size "uncertain", so unreachable blocks of that size are not called leaks) or
a hard issue (the orchestrator retakes the snapshot). Pure policy: no memory access.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

from memunreachable._errors import HeapWalkError
from memunreachable._types import Fields

# mu_walk_run statuses (native/mu_walk.h)
WALK_TOP, WALK_FENCE2, WALK_FENCE0 = 0, 1, 2
WALK_STATUS_NAMES = {0: "top", 1: "double fencepost", 2: "heap-end fencepost", 3: "bad chunk size",
                     4: "bad chunk flags", 5: "stepped over top", 6: "region ended"}
# mu_walk_chain statuses and link reasons (native/mu_walk.h)
CHAIN_NULL, CHAIN_BAD, CHAIN_LONG, CHAIN_CYCLE = 0, 1, 2, 3
LINK_REASONS = {1: "not 16-byte aligned", 2: "not an in-use chunk of the heap",
                3: "a chunk of another size", 4: "a chunk of another arena", 5: "unreadable",
                6: "smaller than the chunk before it (a large tcache bin is sorted)"}
BINS_SOFT_SLACK = 2          # chunks in transit tolerated by the bins cross-check


class HeapInconsistent(HeapWalkError):
    """A hard inconsistency: the snapshot must be retaken.

    first_bad: address of the first bad chunk, heap or list node (0 if none). The message is
    deterministic (the same heap gives the same str), so two snapshots of an idle target that
    fail the same way show a permanently corrupt heap rather than one caught mid-update."""

    def __init__(self, msg: str = "", first_bad: int = 0, hint: Optional[str] = None):
        super().__init__(msg, hint)
        self.first_bad = first_bad


class Verdict(Fields):
    __slots__ = ("soft", "hard", "hard_at", "uncertain")

    def __init__(self, soft: Optional[List[str]] = None, hard: Optional[List[str]] = None,
                 hard_at: Optional[List[int]] = None,
                 uncertain: Optional[Dict[int, str]] = None):  # usable size -> warning
        self.soft = [] if soft is None else soft
        self.hard = [] if hard is None else hard
        self.hard_at = [] if hard_at is None else hard_at
        self.uncertain = {} if uncertain is None else uncertain

    def fail(self, msg: str, at: int = 0) -> None:
        """A hard issue; at: the bad chunk/node/heap address (0: none)."""
        self.hard.append(msg)
        self.hard_at.append(at)

    def warn_uncertain(self, msg: str, usable: int) -> None:
        """A soft issue that may hide free blocks of this usable size."""
        self.soft.append(msg)
        self.uncertain.setdefault(usable, msg)

    def raise_if_hard(self) -> None:
        if self.hard:
            first_bad = next((a for a in self.hard_at if a), 0)
            raise HeapInconsistent("heap walk inconsistent: " + "; ".join(self.hard[:5]),
                                   first_bad=first_bad)


def check_run(v: Verdict, what: str, status: int, end: int, bad_at: int, want_status,
              want_end=None) -> bool:
    """A run must end exactly: in one of want_status, at want_end when given. True if it did."""
    if status not in want_status:
        v.fail(f"{what}: chunk chain broke at {bad_at:#x} "
               f"({WALK_STATUS_NAMES.get(status, status)})", bad_at)
        return False
    if want_end is not None and end != want_end:
        v.fail(f"{what}: chain ends at {end:#x}, expected {want_end:#x}", end)
        return False
    return True


def _link_problem(status: int, reason: int, nodes: int, count: Optional[int], bad: int,
                  link: str = "next pointer") -> str:
    if status == CHAIN_CYCLE:
        return f"{link} {bad:#x} loops back into the chain"
    if status == CHAIN_LONG:
        return (f"more than {count + 1} chunks linked, count says {count}" if count is not None
                else f"more than {nodes} chunks linked (more than the arena holds)")
    if status == CHAIN_BAD:
        return f"{link} {bad:#x} is {LINK_REASONS.get(reason, 'invalid')}"
    return f"{nodes} chunk(s) linked, count says {count}"


def judge_tcache_bin(v: Verdict, tcache: int, i: int, usable: int, count: int, status: int,
                     nodes: int, reason: int, last: int, bad: int, in_transit_seen: bool,
                     usable_max: Optional[int] = None,
                     present: Iterable[int] = ()) -> Tuple[int, bool]:
    """Verdict on bin i of a real tcache; returns (free nodes: the verified prefix, in transit).

    Exact (chain ends in NULL after `count` nodes): nothing to say. One bin per tcache may be
    off by one (its thread inside tcache_put/tcache_get): soft. Anything else is a broken
    chain: soft too, naming it. Both expose the bin's size as uncertain, since a block of that
    size may be free without being on the chain. A 2.42+ large bin holds usable sizes
    [usable, usable_max]: the ones of them present in the heap become uncertain."""
    sizes = [usable] if usable_max is None else sorted(set(present))
    span = f"{usable}" if usable_max is None else f"{usable}-{usable_max}"
    what = f"tcache {tcache:#x} bin {i} ({span}-byte blocks)"
    if status == CHAIN_NULL and nodes == count:
        return nodes, False
    if status == CHAIN_NULL and abs(nodes - count) == 1 and not in_transit_seen:
        msg = (f"{what}: {nodes} chunk(s) linked, count says {count} "
               f"(a thread inside malloc/free; the chain was counted as free)")
        _warn_sizes(v, msg, sizes)
        return nodes, True
    where = f"at {last:#x}" if last else "at its head"
    link = "next pointer" if last else f"entries[{i}]"
    _warn_sizes(v, f"{what}: chain broken {where}: "
                   f"{_link_problem(status, reason, nodes, count, bad, link)}; unreachable "
                   f"{span}-byte blocks may be free", sizes)
    return min(nodes, count), False


def _warn_sizes(v: Verdict, msg: str, sizes: List[int]) -> None:
    v.soft.append(msg)
    for s in sizes:
        v.uncertain.setdefault(s, msg)


def judge_fastbin(v: Verdict, arena: int, i: int, usable: int, status: int, nodes: int,
                  reason: int, last: int, bad: int) -> int:
    """Verdict on fastbin i of an arena; returns the free nodes (the verified prefix). A broken
    chain (garbage, cycle) is a soft issue naming it; its size becomes uncertain."""
    if status == CHAIN_NULL:
        return nodes
    where = f"at {last:#x}" if last else "at its head"
    link = "next pointer" if last else f"fastbinsY[{i}] (as a user pointer)"
    v.warn_uncertain(f"arena {arena:#x} fastbin {i} ({usable}-byte blocks): chain broken {where}: "
                     f"{_link_problem(status, reason, nodes, None, bad, link)}; unreachable "
                     f"{usable}-byte blocks may be free", usable)
    return nodes


def check_bins(v: Verdict, arena: int, broken: int, binned: int, binned_bit_free: int,
               bit_free: int, bad_at: int = 0) -> None:
    """The chunks on bins 1-126 are exactly the arena's bit-free chunks."""
    off = abs(binned - bit_free) + (binned - binned_bit_free)
    if broken > 1:
        v.fail(f"arena {arena:#x}: {broken} bin lists are broken", bad_at)
    elif broken == 1:
        v.soft.append(f"arena {arena:#x}: one bin list in transit")
    elif off > BINS_SOFT_SLACK:
        v.fail(f"arena {arena:#x}: bins hold {binned} chunks, the walk found {bit_free} free", arena)
    elif off:
        v.soft.append(f"arena {arena:#x}: bins and walk differ by {off} chunk(s) in transit")


# Returns the user addresses among `sizes` ({user address: bytes of its mapping}: the page
# starts of anonymous memory that read as mmapped chunks) that are no chunks, when mp_'s counters
# (n_mmaps chunks, mmapped_mem bytes) tell them apart: one or two more were found than mp_
# counts, and exactly one set of that many sums to the surplus bytes. Anything else: none (the
# count check then fails as before). Any data can read as a chunk header at a page start: a
# Python object inside a pymalloc arena began 0, 0x2002 (an 8 KiB chunk) in 1 of ~20 checks of
# a process using numpy, scipy and pydantic, and the heap was called corrupt.
# overcount: the bytes mp_ adds per mremap (MmapChunk.mremap_overcount; 0: mp_ is exact). Then
# mp_ may exceed the real chunks' bytes by any multiple of it (the drift), and the set must sum
# to the surplus plus a drift below a page (fewer than 256 mremaps of 16 bytes): every mapping
# is whole pages, so that is the surplus rounded up to a page, and the rest must be a multiple
# of overcount. A larger drift cannot tell the sets apart by bytes: none is dropped.
def lookalikes(sizes: Dict[int, int], n_mmaps: int, mmapped_mem: int, overcount: int = 0,
               page: int = 4096) -> set:
    extra, surplus = len(sizes) - n_mmaps, sum(sizes.values()) - mmapped_mem
    if n_mmaps < 0 or extra not in (1, 2) or surplus <= 0:
        return set()
    if overcount:
        target = -(-surplus // page) * page
        if (target - surplus) % overcount:
            return set()
        surplus = target
    fits = sorted((n, u) for u, n in sizes.items() if n <= surplus)
    if extra == 1:
        sets = [{u} for n, u in fits if n == surplus]
    else:
        by_size: Dict[int, List[int]] = {}
        for n, u in fits:
            by_size.setdefault(n, []).append(u)
        sets = [{u, w} for n, u in fits for w in by_size.get(surplus - n, ()) if w > u]
    return sets[0] if len(sets) == 1 else set()


# Returns mp_'s bytes beyond the chunks found (the mremap drift, 0 when exact), or fails the
# verdict: the count must be n_mmaps, the bytes mmapped_mem exactly or, when glibc over-counts
# each mremap by `overcount` bytes (2.43: MmapChunk.mremap_overcount), less a multiple of it.
def check_mmapped(v: Verdict, found: int, found_bytes: int, n_mmaps: int, mmapped_mem: int,
                  overcount: int = 0) -> int:
    drift = mmapped_mem - found_bytes
    if found == n_mmaps and (drift == 0 or (overcount and drift > 0 and drift % overcount == 0)):
        return drift
    v.fail(f"mmapped chunks: found {found} ({found_bytes} bytes), "
           f"mp_ says {n_mmaps} ({mmapped_mem} bytes)")
    return 0
