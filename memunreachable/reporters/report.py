"""report.py: Stage 9 data: Leak and UnreachableMemoryInfo, grouping, sorting and the limit.

Field names follow libmemunreachable (num_leaks, leak_bytes, referenced_size, total_size,
similar_count, similar_size, ...). Sort: total_size descending, ties by address ascending;
then truncate to `limit` (0 = no limit in the CLI's sense is handled by the caller passing None).

Grouping (libmemunreachable.md section 6.2): entries whose recorded allocation stack is the
same (same native pcs and Python frames) form one LeakGroup, shown once with "and N similar
unreachable bytes in K allocations"; its representative is the lowest-address member. Entries
without a recorded stack never merge. Groups are sorted by what their members reach (the sum
of Leak.total_size, as single entries sort), largest first; a group's num_allocations and
total_size count its members with their indirect leaks (Leak.entry_count/entry_size), so the
groups add up to the leak totals.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

SCHEMA_VERSION = 1


class Address(int):
    """A leak's address: an int that holds nothing. A check reads an exact int's value as a
    native block's handle (ctypes' c_void_p results: native mu_types.h MU_TYPE_INT); a report
    the checked process keeps (an in-process check's result, alive through the next check)
    must not keep its leaks reachable."""
    __slots__ = ()


@dataclass
class Leak:
    address: int                      # an Address (any int given is made one)
    size: int
    referenced_count: int = 0
    referenced_size: int = 0
    contents: bytes = b""            # first min(size, 32) bytes, from the snapshot
    # symbolize.Frame records of the allocation stack, innermost first (issue 9); [] when none
    backtrace: List[Any] = field(default_factory=list)
    python_type: Optional[str] = None   # the block holds a Python object of this type
    refcount: Optional[int] = None      # its ob_refcnt in the snapshot
    repr: Optional[str] = None          # short value of a str/bytes/int/float
    # allocation stack from the tracking table (issue 9, filled by the sweep): native return
    # addresses innermost first; Python (function, file, line) innermost first; "recorded",
    # "untracked" (no table, or the block is not in it) or "table_full"
    stack: List[int] = field(default_factory=list)
    python_stack: List[Tuple[str, str, int]] = field(default_factory=list)
    stack_status: str = "untracked"
    # issue 23: the size the program asked for (tracked processes; None: not known). size
    # stays the usable size, what the heap holds
    requested_size: Optional[int] = None
    # the tracking table's epoch when the block was recorded (None: untracked). The pytest
    # plugin numbers its tests with it: the test during which the block was allocated
    epoch: Optional[int] = None
    # issue 23: the indirect leaks this entry lists: the unreachable blocks it reaches that no
    # entry before it does, so that each unreachable block is in exactly one entry (a block
    # reachable from two heads counts in referenced_* of both). num_indirect / indirect_size
    # cover all of them (None: unknown, e.g. a report written before; referenced_* then
    # stand in); indirect: the first of them (Leak records without contents), by address
    num_indirect: Optional[int] = None
    indirect_size: Optional[int] = None
    indirect: List["Leak"] = field(default_factory=list)

    def __post_init__(self) -> None:
        if type(self.address) is int:
            self.address = Address(self.address)

    @property
    def total_size(self) -> int:
        return self.size + self.referenced_size

    @property
    def entry_count(self) -> int:
        """Unreachable blocks this entry accounts for: itself and its indirect leaks."""
        return 1 + (self.referenced_count if self.num_indirect is None else self.num_indirect)

    @property
    def entry_size(self) -> int:
        """Bytes of entry_count's blocks."""
        return self.size + (self.referenced_size if self.indirect_size is None
                            else self.indirect_size)


@dataclass
class UnreachableMemoryInfo:
    pid: int
    allocator_name: str = "glibc"
    allocator_version: Optional[str] = None
    threads: int = 0
    pause_ms: float = 0.0            # total time the target was stopped
    duration_ms: float = 0.0         # whole check
    snapshot_ms: float = 0.0         # how long the copy-on-write snapshot lived
    snapshot_mode: str = "clone"     # "clone" or "direct" (read the stopped target)
    snapshots: int = 0               # freezes, each one pause taking a snapshot (retakes and
                                     # the confirmation included; a reap's short one not)
    retries: int = 0                 # snapshots retaken (see retake_counts for why)
    retake_counts: dict = field(default_factory=dict)   # inflight | capture | died -> count
    num_allocations: int = 0
    allocation_bytes: int = 0
    num_leaks: int = 0               # every unreachable allocation, folded ones included
    leak_bytes: int = 0
    leaks: List[Leak] = field(default_factory=list)
    truncated: int = 0               # entries left out by the limit
    warnings: List[str] = field(default_factory=list)
    bytes_scanned: int = 0
    stats: dict = field(default_factory=dict)   # per-stage timings and walker figures
    confirmed: bool = False          # a second snapshot confirmed every reported leak
    # unreachable blocks that are not reported as leaks because what decides their fate could
    # not be seen (a broken free list that may hold them, memory the snapshot lacked): counted
    # apart, never in num_leaks nor in the exit code
    uncertain: List[Leak] = field(default_factory=list)
    num_uncertain: int = 0
    uncertain_bytes: int = 0
    comm: Optional[str] = None       # /proc/PID/comm of the target, when known (reports only)
    # unreachable Python reference cycles whose reference counts are all explained from inside
    # (cpython-memory.md section 8): the cyclic GC frees them at its next run; not leaks, not
    # in num_leaks nor in the exit code
    cyclic_garbage: List[Leak] = field(default_factory=list)
    num_cyclic_garbage: int = 0
    cyclic_garbage_bytes: int = 0
    # issue 9: the target's executable file mappings [(begin, end, offset, path)] (symbolization
    # runs after the target and snapshot are gone) and its tracking table's header figures
    modules: List[Tuple[int, int, int, str]] = field(default_factory=list)
    tracking: Optional[dict] = None
    # leak groups shown (same allocation stack), largest first; leaks holds their members
    groups: List["LeakGroup"] = field(default_factory=list)
    # suppressions (suppressions.py): leaks a rule matched are in none of the counts above
    num_suppressed: int = 0
    suppressed_bytes: int = 0
    suppressions_used: List[Tuple[str, int, int]] = field(default_factory=list)  # template, count, bytes
    # issue 22: the parts of the process that could not be seen (one reason each). Empty: the
    # check saw everything. A check with reasons raises IncompleteCheck unless partial was
    # asked for; then this result says it is incomplete and its leaks are a lower bound
    incomplete: List[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.incomplete


@dataclass
class LeakGroup:
    """Report entries sharing one allocation stack (a single entry when it has none).

    leaks: members kept (representative = lowest address first, at most the limit);
    num_entries: every member; num_allocations / total_size: every member with its indirect
    leaks (Leak.entry_count / entry_size: each unreachable block in one group only, so the
    groups add up to num_leaks and leak_bytes); similar_*: the members other than the
    representative (libmemunreachable's similar_count/size; similar_referenced_count/size:
    their indirect leaks).
    """
    leaks: List[Leak]
    num_entries: int = 1
    num_allocations: int = 0
    total_size: int = 0
    similar_count: int = 0
    similar_size: int = 0
    similar_referenced_count: int = 0
    similar_referenced_size: int = 0

    @property
    def representative(self) -> Leak:
        return self.leaks[0]

    @property
    def backtrace(self) -> list:
        return self.leaks[0].backtrace

    @property
    def stack_status(self) -> str:
        return self.leaks[0].stack_status


def stack_key(leak: Leak) -> Optional[tuple]:
    """What groups a leak with others: its recorded stack (pcs and Python frames); None when it
    has none (it then stands alone)."""
    if leak.stack_status != "recorded" or not (leak.stack or leak.python_stack):
        return None
    return (tuple(leak.stack), tuple(tuple(p) for p in leak.python_stack))


# Returns (groups kept, groups left out): leaks grouped by stack_key, each group's members by
# address (the representative first), groups by reach (members' total_size) desc then
# representative address; at most `limit` groups (None: all), each keeping at most `limit`
# members (counts stay whole).
def group_leaks(leaks: List[Leak], limit: Optional[int] = None) -> Tuple[List[LeakGroup], int]:
    by_key: dict = {}
    singles: List[List[Leak]] = []
    for leak in leaks:
        key = stack_key(leak)
        if key is None:
            singles.append([leak])
        else:
            by_key.setdefault(key, []).append(leak)
    ranked = []             # (what the members reach, group)
    for members in list(by_key.values()) + singles:
        if len(members) == 1:   # (most groups: without the sums below, 1,000 took 9 ms)
            lone = members[0]
            ranked.append((lone.total_size, LeakGroup(
                leaks=members, num_entries=1, num_allocations=lone.entry_count,
                total_size=lone.entry_size, similar_count=0, similar_size=0,
                similar_referenced_count=0, similar_referenced_size=0)))
            continue
        members.sort(key=lambda l: l.address)
        rest = members[1:]
        ranked.append((sum(l.total_size for l in members), LeakGroup(
            leaks=members if limit is None else members[:max(limit, 1)],
            num_entries=len(members),
            num_allocations=sum(l.entry_count for l in members),
            total_size=sum(l.entry_size for l in members),
            similar_count=len(rest),
            similar_size=sum(l.size for l in rest),
            similar_referenced_count=sum(l.entry_count - 1 for l in rest),
            similar_referenced_size=sum(l.entry_size - l.size for l in rest))))
    # largest first by what the members reach (libmemunreachable's total_size), as single
    # entries sort (sort_and_limit): a block shared by two entries weighs in both
    ranked.sort(key=lambda rg: (-rg[0], rg[1].representative.address))
    groups = [g for _, g in ranked]
    if limit is None or limit >= len(groups):
        return groups, 0
    return groups[:limit], len(groups) - limit


def members(groups: List[LeakGroup]) -> List[Leak]:
    """The kept members of every group, in group order (what info.leaks holds)."""
    return [l for g in groups for l in g.leaks]


def sort_and_limit(leaks: List[Leak], limit: Optional[int]) -> tuple:
    """Return (kept, left_out_count): sorted by total_size desc, address asc; limit None = all."""
    ordered = sorted(leaks, key=lambda l: (-l.total_size, l.address))
    if limit is None or limit >= len(ordered):
        return ordered, 0
    return ordered[:limit], len(ordered) - limit
