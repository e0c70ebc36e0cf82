"""reporters/json.py: Stage 9: the `--json` report, schema_version 1 (issue 2).

Input: an UnreachableMemoryInfo. Output: one JSON object. The fields issue 2 fixes:

    schema_version, pid, allocator {"name", "version"}, threads, pause_ms, duration_ms,
    num_allocations, allocation_bytes, num_leaks, leak_bytes, truncated,
    leaks: [{address (int), size, referenced_count, referenced_size,
             contents (hex of the first <= 32 bytes), backtrace (list)}]

Additive fields (allowed by the schema promise: additive changes only): tool_version, comm,
snapshot_mode, snapshot_ms, snapshots, retries, retake_counts, bytes_scanned, warnings, stats,
total_size per leak, and num_uncertain, uncertain_bytes, uncertain [{address, size,
contents}]: unreachable blocks withheld because what decides their fate could not be seen
(not leaks: not in num_leaks, leak_bytes nor the exit code);
for CPython targets python_type, refcount and repr per leak holding a Python object, and
num_cyclic_garbage, cyclic_garbage_bytes, cyclic_garbage (entries shaped like leaks).
Issue 9: backtrace per leak is [{pc, module, build_id, offset, function, file, line, inlined}]
(Python frames add "python": true), stack_status per leak; groups: [{leaks (indices into
leaks), num_entries, num_allocations, total_size, similar_count, similar_size,
similar_referenced_count, similar_referenced_size}] largest first; tracking (the target's
tracking table figures, null when untracked); num_suppressed, suppressed_bytes and
suppressions_used [{template, count, bytes}].
Issue 22: complete (false when part of the process could not be seen: only with --partial,
the leaks are then a lower bound) and incomplete (the reasons, one string each; [] when
complete).
Issue 23: requested_size per leak (what the program asked for; null when not tracked);
num_indirect, indirect_size and indirect [{address, size, requested_size, backtrace,
stack_status}] per leak: the unreachable blocks the entry lists (each in one entry only, so
the leaks' 1 + num_indirect add up to num_leaks; indirect holds the first 1,000 by address;
null counts: unknown, in a report re-rendered from an older one).
groups' num_allocations/total_size and similar_referenced_* count those.
Readers must ignore keys they do not know. load_json() is the inverse (for re-rendering).

stats is one flat object (flatten_stats): the walker's figures (arenas, chunks, ...) next to
the sweep's (seconds, root_bytes, ...); allocator and warnings appear only at the top level.
An error is data too (render_error): {"schema_version", "tool_version", "pid",
"error": {"kind", "message", "hint"}} where kind is the exception class name (NoSuchProcess,
AccessDenied, CommandError, ...) and the exit code is the one the text mode would give.
"""
from __future__ import annotations

import json
from typing import IO, Any, Dict, Optional

from memunreachable.reporters.report import (SCHEMA_VERSION, Leak, LeakGroup, UnreachableMemoryInfo,
                                            group_leaks)

CONTENTS_BYTES = 32


def _ms(value: float) -> float:
    return round(float(value), 3)


def _jsonable(value: Any) -> Any:
    """Plain JSON data from a stats dict: nested dicts/lists of str/int/float/bool/None; the rest as str."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


# keys of the engine's sweep metadata that the report carries at its top level already
_TOP_LEVEL_KEYS = ("allocator", "warnings")


# Returns one flat dict: the nested walker figures (stats["stats"]) lifted to the top, then
# the other keys except allocator and warnings (reported at the top level of the JSON); a
# key present in both keeps the walker's value and the other is renamed "sweep_<key>".
# Idempotent (a flat dict comes back equal).
def flatten_stats(stats: Dict[str, Any]) -> Dict[str, Any]:
    inner = stats.get("stats")
    flat: Dict[str, Any] = dict(inner) if isinstance(inner, dict) else {}
    for key, value in stats.items():
        if key in _TOP_LEVEL_KEYS or (key == "stats" and isinstance(value, dict)):
            continue
        flat[key if key not in flat else f"sweep_{key}"] = value
    return flat


def _backtrace(leak: Leak) -> list:
    return [f if isinstance(f, str) else f.to_dict() for f in leak.backtrace]


def leak_to_dict(leak: Leak) -> Dict[str, Any]:
    out = {
        "address": leak.address,
        "size": leak.size,
        "requested_size": leak.requested_size,
        "referenced_count": leak.referenced_count,
        "referenced_size": leak.referenced_size,
        "total_size": leak.total_size,
        "contents": bytes(leak.contents[:CONTENTS_BYTES]).hex(),
        "backtrace": _backtrace(leak),
        "stack_status": leak.stack_status,
        "num_indirect": leak.num_indirect,
        "indirect_size": leak.indirect_size,
        "indirect": [{"address": b.address, "size": b.size, "requested_size": b.requested_size,
                      "backtrace": _backtrace(b), "stack_status": b.stack_status}
                     for b in leak.indirect],
    }
    if leak.python_type is not None:
        out.update(python_type=leak.python_type, refcount=leak.refcount, repr=leak.repr)
    return out


def render_json(info: UnreachableMemoryInfo) -> Dict[str, Any]:
    """The schema_version 1 object for `info` (plain dict, ready for json.dumps)."""
    from memunreachable import __version__

    out = {
        "schema_version": SCHEMA_VERSION,
        "tool_version": __version__,
        "pid": info.pid,
        "comm": info.comm,
        "complete": info.complete,
        "incomplete": list(info.incomplete),
        "allocator": {"name": info.allocator_name, "version": info.allocator_version},
        "threads": info.threads,
        "pause_ms": _ms(info.pause_ms),
        "duration_ms": _ms(info.duration_ms),
        "snapshot_mode": info.snapshot_mode,
        "snapshot_ms": _ms(info.snapshot_ms),
        "snapshots": info.snapshots,
        "retries": info.retries,
        "retake_counts": dict(info.retake_counts),
        "num_allocations": info.num_allocations,
        "allocation_bytes": info.allocation_bytes,
        "bytes_scanned": info.bytes_scanned,
        "num_leaks": info.num_leaks,
        "leak_bytes": info.leak_bytes,
        "leaks": [leak_to_dict(leak) for leak in info.leaks],
        "groups": _groups_to_json(info),
        "truncated": info.truncated,
        "num_uncertain": info.num_uncertain,
        "uncertain_bytes": info.uncertain_bytes,
        "uncertain": [{"address": u.address, "size": u.size,
                       "contents": bytes(u.contents[:CONTENTS_BYTES]).hex()}
                      for u in info.uncertain],
        "warnings": list(info.warnings),
        "stats": _jsonable(flatten_stats(info.stats)),
        "tracking": _jsonable(info.tracking),
        "num_suppressed": info.num_suppressed,
        "suppressed_bytes": info.suppressed_bytes,
        "suppressions_used": [{"template": t, "count": c, "bytes": b}
                              for t, c, b in info.suppressions_used],
    }
    if info.num_cyclic_garbage:
        out.update(num_cyclic_garbage=info.num_cyclic_garbage,
                   cyclic_garbage_bytes=info.cyclic_garbage_bytes,
                   cyclic_garbage=[leak_to_dict(g) for g in info.cyclic_garbage])
    return out


def _groups_to_json(info: UnreachableMemoryInfo) -> list:
    """groups with their members as indices into leaks (info.leaks holds every kept member)."""
    groups = info.groups or group_leaks(info.leaks)[0]
    index = {id(l): i for i, l in enumerate(info.leaks)}
    return [{"leaks": [index[id(l)] for l in g.leaks if id(l) in index],
             "num_entries": g.num_entries, "num_allocations": g.num_allocations,
             "total_size": g.total_size, "similar_count": g.similar_count,
             "similar_size": g.similar_size,
             "similar_referenced_count": g.similar_referenced_count,
             "similar_referenced_size": g.similar_referenced_size} for g in groups]


def _frame(d):
    from memunreachable.stacks.symbolize import Frame      # only to read a report back (issue 10)
    return d if isinstance(d, str) else Frame.from_dict(d)


def write_json(info: UnreachableMemoryInfo, stream: IO[str]) -> None:
    """render_json(info) as indented JSON plus a final newline."""
    json.dump(render_json(info), stream, indent=2)
    stream.write("\n")
    stream.flush()


def render_error(kind: str, message: str, hint: Optional[str] = None,
                 pid: Optional[int] = None) -> Dict[str, Any]:
    """The JSON object for an error (kind: the exception class name)."""
    from memunreachable import __version__

    return {"schema_version": SCHEMA_VERSION, "tool_version": __version__, "pid": pid,
            "error": {"kind": kind, "message": message, "hint": hint}}


def write_json_error(stream: IO[str], kind: str, message: str, hint: Optional[str] = None,
                     pid: Optional[int] = None) -> None:
    """render_error(...) as indented JSON plus a final newline."""
    json.dump(render_error(kind, message, hint, pid), stream, indent=2)
    stream.write("\n")
    stream.flush()


def _load_leak(e: Dict[str, Any]) -> Leak:
    """A leaks[] (or indirect[]) record as a Leak; keys a report of an older version lacks
    keep their defaults (num_indirect None: referenced_* stand in for the counts)."""
    return Leak(address=int(e["address"]), size=int(e["size"]),
                referenced_count=int(e.get("referenced_count", 0)),
                referenced_size=int(e.get("referenced_size", 0)),
                contents=bytes.fromhex(e.get("contents", "")),
                backtrace=[_frame(f) for f in e.get("backtrace", [])],
                python_type=e.get("python_type"), refcount=e.get("refcount"),
                repr=e.get("repr"), stack_status=e.get("stack_status", "untracked"),
                requested_size=e.get("requested_size"),
                num_indirect=e.get("num_indirect"), indirect_size=e.get("indirect_size"),
                indirect=[_load_leak(b) for b in e.get("indirect", [])])


def load_json(data: Dict[str, Any]) -> UnreachableMemoryInfo:
    """Rebuild an UnreachableMemoryInfo from a render_json() object (unknown keys ignored).

    Raises ValueError for a schema_version this code does not understand.
    """
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(f"unsupported schema_version {version!r} (this memunreachable reads "
                         f"{SCHEMA_VERSION})")
    allocator = data.get("allocator") or {}
    leaks = [_load_leak(e) for e in data.get("leaks", []) + data.get("cyclic_garbage", [])]
    garbage = leaks[len(data.get("leaks", [])):]
    leaks = leaks[:len(data.get("leaks", []))]
    groups = [LeakGroup(leaks=[leaks[i] for i in g.get("leaks", [])],
                        **{k: int(g.get(k, 0)) for k in (
                            "num_entries", "num_allocations", "total_size", "similar_count",
                            "similar_size", "similar_referenced_count",
                            "similar_referenced_size")})
              for g in data.get("groups", []) if g.get("leaks")]
    return UnreachableMemoryInfo(
        pid=int(data["pid"]),
        comm=data.get("comm"),
        allocator_name=allocator.get("name", "glibc"),
        allocator_version=allocator.get("version"),
        threads=int(data.get("threads", 0)),
        pause_ms=float(data.get("pause_ms", 0.0)),
        duration_ms=float(data.get("duration_ms", 0.0)),
        snapshot_mode=data.get("snapshot_mode", "clone"),
        snapshot_ms=float(data.get("snapshot_ms", 0.0)),
        snapshots=int(data.get("snapshots", 0)),
        retries=int(data.get("retries", 0)),
        retake_counts=dict(data.get("retake_counts", {})),
        num_allocations=int(data.get("num_allocations", 0)),
        allocation_bytes=int(data.get("allocation_bytes", 0)),
        bytes_scanned=int(data.get("bytes_scanned", 0)),
        num_leaks=int(data.get("num_leaks", 0)),
        leak_bytes=int(data.get("leak_bytes", 0)),
        leaks=leaks,
        truncated=int(data.get("truncated", 0)),
        num_uncertain=int(data.get("num_uncertain", 0)),
        uncertain_bytes=int(data.get("uncertain_bytes", 0)),
        uncertain=[Leak(address=int(e["address"]), size=int(e["size"]),
                        contents=bytes.fromhex(e.get("contents", "")))
                   for e in data.get("uncertain", [])],
        warnings=list(data.get("warnings", [])),
        incomplete=list(data.get("incomplete", [])),
        stats=dict(data.get("stats", {})),
        cyclic_garbage=garbage,
        num_cyclic_garbage=int(data.get("num_cyclic_garbage", 0)),
        cyclic_garbage_bytes=int(data.get("cyclic_garbage_bytes", 0)),
        groups=groups,
        tracking=data.get("tracking"),
        num_suppressed=int(data.get("num_suppressed", 0)),
        suppressed_bytes=int(data.get("suppressed_bytes", 0)),
        suppressions_used=[(u["template"], int(u["count"]), int(u["bytes"]))
                           for u in data.get("suppressions_used", [])],
    )
