"""report.py: Stage 9 data: Leak and UnreachableMemoryInfo, sorting and the limit.

Field names follow libmemunreachable (num_leaks, leak_bytes, referenced_size, total_size).
Sort: total_size descending, ties by address ascending; then truncate to `limit`
(0 = no limit in the CLI's sense is handled by the caller passing None).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

SCHEMA_VERSION = 1


@dataclass
class Leak:
    address: int
    size: int
    referenced_count: int = 0
    referenced_size: int = 0
    contents: bytes = b""            # first min(size, 32) bytes, from the snapshot
    backtrace: List[str] = field(default_factory=list)
    python_type: Optional[str] = None   # the block holds a Python object of this type
    refcount: Optional[int] = None      # its ob_refcnt in the snapshot
    repr: Optional[str] = None          # short value of a str/bytes/int/float
    # allocation stack from the tracking table (memunreachable run; tracking.py):
    stack: List[int] = field(default_factory=list)        # return addresses, innermost first
    python_stack: List[Tuple[str, str, int]] = field(default_factory=list)  # (function, file, line)
    stack_status: str = "untracked"     # "recorded" | "untracked" | "table_full"

    @property
    def total_size(self) -> int:
        return self.size + self.referenced_size


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
    # the tracking table's counters (tracking.TrackingTable.summary), None when untracked
    tracking: Optional[dict] = None
    # (begin, end, file offset, path) of the target's executable file mappings (symbolization)
    modules: List[Tuple[int, int, int, str]] = field(default_factory=list)


def sort_and_limit(leaks: List[Leak], limit: Optional[int]) -> tuple:
    """Return (kept, left_out_count): sorted by total_size desc, address asc; limit None = all."""
    ordered = sorted(leaks, key=lambda l: (-l.total_size, l.address))
    if limit is None or limit >= len(ordered):
        return ordered, 0
    return ordered[:limit], len(ordered) - limit
