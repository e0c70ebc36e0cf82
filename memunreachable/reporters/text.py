"""reporters/text.py: Stage 9: the human text report.

Input: an UnreachableMemoryInfo (entries already sorted and limited). Output: lines on an
injected stream. The middle block keeps libmemunreachable's Leak::ToString shape
(libmemunreachable.md section 8, [ours] variants: sizes in decimal, bytes unsigned):

    memunreachable 0.1.0: pid 4242 (server), 3 threads, glibc 2.36          <- ours
    target paused 2.5 ms, snapshot (clone) lived 40.0 ms, whole check 120.0 ms
    1264 bytes in 5 allocations unreachable out of 65536 bytes in 120 allocations (1.2 KiB of 64.0 KiB)
    warning: ...
    <blank>
      1264 bytes in 5 unreachable allocations                               <- upstream
      ABI: 'x86_64'
    <blank>
      1000 bytes (1024 usable) unreachable at 55d0c0a012a0                  <- requested size
       referencing 240 unreachable bytes in 3 allocations                      when tracked
       first 32 bytes of contents:                                          (--contents)
       55d0c0a012a0: 68 65 6c 6c 6f 00 00 00 00 00 00 00 00 00 00 00 hello...........
       and 2048 similar unreachable bytes in 2 allocations                  <- same stack
       referencing 480 unreachable bytes in 6 allocations                      (grouped)
       #0 0x55d0c0a01234 in make_node src/list.c:42 (/usr/bin/server+0x1233)  <- issue 9
       #1 0x55d0c0a01300 in main src/main.c:7 (/usr/bin/server+0x12ff)
       no stack recorded (allocated before tracking / not tracked)          (tracked target)
       indirect: 160 bytes (192 usable) in 2 allocations at 55d0c0a01500, 55d0c0a01580
       #0 0x55d0c0a01250 in make_name src/list.c:30 (/usr/bin/server+0x124f)  <- issue 23:
       indirect: 48 bytes in 1 allocation at 55d0c0a01600                      the blocks
       #0 ...                                                                  it lists, by stack
    <blank>                                                                 (after each entry)
      ... 3 more entries not shown; use --limit 0 to show all               <- ours
      72 bytes in 1 uncertain allocation (not counted as leaks)             <- ours, only
       72 bytes uncertain at 55d0c0a01400                                      when any
      96 bytes in 2 allocations of cyclic garbage awaiting collection (not counted as leaks)
       48 bytes at 7f...0 (Node, refcount 1), referencing 1 allocation      <- CPython only
    <blank>
    -----------------------------------------------------                   <- LSan's block,
    Suppressions used:                                                         only when a
      count      bytes template                                                rule matched
          1        666 *LSanTestLeakingFunc*
    -----------------------------------------------------
    <blank>
    SUMMARY: memunreachable: 1264 bytes leaked in 5 allocations, 5 report entries

The SUMMARY line is the stable, greppable contract (landscape.md section 2). Colour (rich) is
used only on a terminal: NO_COLOR disables it, CLICOLOR_FORCE forces it, CLICOLOR=0 disables
it; the characters are identical either way, only ANSI styling is added.
"""
from __future__ import annotations

import os
from typing import IO, List, Optional, Tuple

from memunreachable.reporters.report import Leak, LeakGroup, UnreachableMemoryInfo, group_leaks

BYTES_PER_LINE = 16
CONTENTS_BYTES = 32               # at most this many bytes are shown (libmemunreachable)
ABI = "x86_64"

Segment = Tuple[str, str]          # (text, rich style; "" = plain)
Line = List[Segment]


def plural(n: int, word: str) -> str:
    """'1 allocation', '2 allocations', '0 allocations': the 's' is dropped only for exactly 1."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _entries(n: int, phrase: str) -> str:
    """'1 report entry', '3 report entries' (phrase ends in 'entry')."""
    return f"{n} {phrase}" if n == 1 else f"{n} {phrase[:-1]}ies"


def human_size(n: int) -> str:
    """1023 -> '1023 B', 1264 -> '1.2 KiB', 5 << 20 -> '5.0 MiB'."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024.0
        if value < 1024.0 or unit == "TiB":
            return f"{value:.1f} {unit}"
    return f"{n} B"  # unreachable


def duration(ms: float) -> str:
    """12.34 -> '12.3 ms'; 1250.0 -> '1.25 s'."""
    if ms >= 1000.0:
        return f"{ms / 1000.0:.2f} s"
    return f"{ms:.1f} ms"


def num_entries(info: UnreachableMemoryInfo) -> int:
    """All report entries (groups of root leaks with one stack), including those left out by
    the limit."""
    return len(info.groups or group_leaks(info.leaks)[0]) + info.truncated


def summary_line(info: UnreachableMemoryInfo) -> str:
    """'SUMMARY: memunreachable: <bytes> byte(s) leaked in <n> allocation(s), <k> report entries'."""
    return (f"SUMMARY: memunreachable: {plural(info.leak_bytes, 'byte')} leaked in "
            f"{plural(info.num_leaks, 'allocation')}, {_entries(num_entries(info), 'report entry')}"
            + ("" if info.complete else " (INCOMPLETE check)"))


# ---- the lines -----------------------------------------------------------------------------

def _header(info: UnreachableMemoryInfo) -> List[Line]:
    from memunreachable import __version__

    who = f"pid {info.pid}" + (f" ({info.comm})" if getattr(info, "comm", None) else "")
    alloc = info.allocator_name + (f" {info.allocator_version}" if info.allocator_version else "")
    lines: List[Line] = [[(f"memunreachable {__version__}: ", "bold"), (who, "bold cyan"),
                          (f", {plural(info.threads, 'thread')}, {alloc}", "")]]

    pause = [("target paused ", ""), (duration(info.pause_ms), "bold")]
    if info.snapshot_mode == "clone":
        pause.append((f", snapshot (clone) lived {duration(info.snapshot_ms)}", ""))
    else:
        pause.append((f", no snapshot ({info.snapshot_mode}: read the stopped target)", "yellow"))
    pause.append((f", whole check {duration(info.duration_ms)}", ""))
    if info.retries:
        pause.append((f", snapshot retaken {plural(info.retries, 'time')}", "yellow"))
    lines.append(pause)

    scanned = (f"{plural(info.leak_bytes, 'byte')} in {plural(info.num_leaks, 'allocation')} "
               f"unreachable out of {plural(info.allocation_bytes, 'byte')} in "
               f"{plural(info.num_allocations, 'allocation')}")
    if info.allocation_bytes >= 1024:
        scanned += f" ({human_size(info.leak_bytes)} of {human_size(info.allocation_bytes)})"
    lines.append([(scanned, "")])
    return lines


def _caveats(info: UnreachableMemoryInfo) -> List[Line]:
    """What the check could not see (INCOMPLETE) and its warnings."""
    lines: List[Line] = []
    if info.incomplete:     # issue 22: --partial; what was not seen may hold more leaks
        lines.append([("INCOMPLETE: ", "bold red"),
                      ("part of the process could not be checked; the leaks below are a lower "
                       "bound, and none found is no proof of none", "red")])
        for reason in info.incomplete:
            lines.append([("  not checked: ", "bold red"), (reason, "red")])
    for w in info.warnings:
        if w not in info.incomplete:
            lines.append([("warning: ", "bold yellow"), (w, "yellow")])
    return lines


def _hexdump(address: int, data: bytes) -> List[Line]:
    """'   <addr>: xx xx ... <ascii>': 16 bytes a line, 3 spaces per missing byte, '.' outside 0x20..0x7e."""
    lines: List[Line] = []
    for off in range(0, len(data), BYTES_PER_LINE):
        chunk = data[off:off + BYTES_PER_LINE]
        hexpart = "".join(f"{b:02x} " for b in chunk) + "   " * (BYTES_PER_LINE - len(chunk))
        ascii_part = "".join(chr(b) if 0x20 <= b <= 0x7e else "." for b in chunk)
        lines.append([(f"   {address + off:x}: ", "dim"), (hexpart, ""), (ascii_part, "green")])
    return lines


NO_STACK = "no stack recorded (allocated before tracking / not tracked)"
TABLE_FULL = ("no stack recorded: the tracking table was full ([stack table full]; raise "
              "MEMUNREACHABLE_TRACK_BUDGET)")


def _bytes(requested: Optional[int], usable: int) -> str:
    """'79 bytes (88 usable)' when the requested size is known and differs, else 'N bytes'."""
    if requested is None or requested == usable:
        return f"{usable} bytes"
    return f"{requested} bytes ({usable} usable)"


def _frames(leak: Leak) -> List[Line]:
    if leak.backtrace:      # symbolize.py loads only for a report with stacks (issue 10)
        from memunreachable.stacks.symbolize import format_frame
    lines: List[Line] = []
    n = 0
    for frame in leak.backtrace:
        if isinstance(frame, str):          # a frame already formatted, or a note
            lines.append([(f"   {frame}", "")])
        else:
            lines.append([(f"   {format_frame(n, frame)}", "magenta" if frame.python else "")])
            n += 1
    return lines


# Indirect-leak addresses shown per stack; the count and bytes cover all.
INDIRECT_ADDRESSES = 8


def _indirect(leak: Leak, no_stack: Optional[str]) -> List[Line]:
    """The entry's indirect leaks (blocks only it reaches first), grouped by allocation
    stack, each group with its addresses and its stack (issue 23)."""
    by_stack: dict = {}
    for b in leak.indirect:     # by the symbolized stack: a re-read report has no raw pcs
        key = (b.stack_status, tuple(f if isinstance(f, str) else tuple(f.to_dict().values())
                                     for f in b.backtrace))
        by_stack.setdefault(key, []).append(b)
    lines: List[Line] = []
    for blocks in by_stack.values():
        known = all(b.requested_size is not None for b in blocks)
        size = _bytes(sum(b.requested_size for b in blocks) if known else None,
                      sum(b.size for b in blocks))
        shown = ", ".join(f"{b.address:x}" for b in blocks[:INDIRECT_ADDRESSES])
        more = ", ..." if len(blocks) > INDIRECT_ADDRESSES else ""
        lines.append([("   indirect: ", "bold"), (f"{size} in {plural(len(blocks), 'allocation')}", ""),
                      (" at ", ""), (shown + more, "cyan")])
        lines.extend(_frames(blocks[0]))
        lines.extend(_no_stack(blocks[0], no_stack))
    unlisted = leak.entry_count - 1 - len(leak.indirect)
    if leak.indirect and unlisted > 0:
        lines.append([(f"   indirect: {plural(unlisted, 'more allocation')} not listed", "yellow")])
    return lines


def _no_stack(leak: Leak, no_stack: Optional[str]) -> List[Line]:
    if not leak.backtrace and leak.stack_status == "table_full":
        return [[(f"   {TABLE_FULL}", "yellow")]]
    if not leak.backtrace and no_stack:
        return [[(f"   {no_stack}", "dim")]]
    return []


def no_stack_text(tracking: Optional[dict]) -> Optional[str]:
    """What a leak without a stack says in a tracked process (None: untracked, nothing)."""
    if tracking is None:
        return None
    started = tracking.get("started")
    if not started:
        return NO_STACK
    import time
    return (f"no stack recorded (allocated before tracking began, "
            f"{time.strftime('%H:%M:%S', time.localtime(started))}, or not tracked)")


def _entry(leak: Leak, contents: bool, group: Optional[LeakGroup] = None,
           no_stack: Optional[str] = None) -> List[Line]:
    lines: List[Line] = [[("  ", ""), (_bytes(leak.requested_size, leak.size), "bold red"),
                          (" unreachable at ", ""), (f"{leak.address:x}", "cyan")]]
    if leak.python_type is not None:
        lines.append([(f"   Python object: {leak.python_type}", "magenta"),
                      (_refcount_text(leak), ""),
                      (f", value {leak.repr}" if leak.repr is not None else "", "")])
    if leak.referenced_count > 0:
        lines.append([(f"   referencing {leak.referenced_size} unreachable bytes in "
                       f"{plural(leak.referenced_count, 'allocation')}", "")])
    if group is not None and group.similar_count:
        lines.append([(f"   and {group.similar_size} similar unreachable bytes in "
                       f"{plural(group.similar_count, 'allocation')}", "bold")])
        if group.similar_referenced_count:
            lines.append([(f"   referencing {group.similar_referenced_size} unreachable bytes "
                           f"in {plural(group.similar_referenced_count, 'allocation')}", "")])
    if contents and leak.contents:
        data = bytes(leak.contents[:CONTENTS_BYTES])
        if len(data) >= leak.size:
            lines.append([("   contents:", "")])
        else:
            lines.append([(f"   first {len(data)} bytes of contents:", "")])
        lines.extend(_hexdump(leak.address, data))
    lines.extend(_frames(leak))
    lines.extend(_no_stack(leak, no_stack))
    lines.extend(_indirect(leak, no_stack))
    lines.append([])
    return lines


def _refcount_text(leak: Leak) -> str:
    return "" if leak.refcount is None else f", refcount {leak.refcount}"


def iter_lines(info: UnreachableMemoryInfo, contents: bool = False,
               brief: bool = False) -> List[Line]:
    """Every line of the report as styled segments (no trailing newlines). brief: without the
    lines about the whole check (who, pause, totals, ABI) that a caller's own headline replaces
    (the pytest plugin: one check's timing is no test's), the caveats kept."""
    if brief:
        lines = _caveats(info)
    else:
        lines = _header(info) + _caveats(info)
        lines.append([])
        lines.append([(f"  {info.leak_bytes} bytes in "
                       f"{plural(info.num_leaks, 'unreachable allocation')}", "bold")])
        lines.append([(f"  ABI: '{ABI}'", "")])
    lines.append([])
    no_stack = no_stack_text(info.tracking)
    for group in _groups(info):
        lines.extend(_entry(group.representative, contents, group, no_stack))
    if info.truncated:
        more = _entries(info.truncated, "more entry")
        lines.append([(f"  ... {more} not shown; use --limit 0 to show all", "yellow")])
        lines.append([])
    lines.extend(_uncertain(info, contents))
    lines.extend(_cyclic_garbage(info))
    if info.suppressions_used:
        from memunreachable.stacks.suppressions import format_used
        lines.extend([[(text, "")] for text in format_used(info.suppressions_used)] + [[]])
    lines.append([(summary_line(info), "bold")])
    return lines


def _groups(info: UnreachableMemoryInfo) -> List[LeakGroup]:
    """info.groups, or (a hand-built or re-loaded info without them) the leaks grouped here."""
    if info.groups:
        return info.groups
    return group_leaks(info.leaks)[0]


def _uncertain(info: UnreachableMemoryInfo, contents: bool) -> List[Line]:
    """Unreachable blocks withheld because what decides their fate could not be seen (the
    warnings say why); not leaks, not in the SUMMARY nor the exit code."""
    if not info.num_uncertain:
        return []
    lines: List[Line] = [[(f"  {info.uncertain_bytes} bytes in "
                           f"{plural(info.num_uncertain, 'uncertain allocation')} "
                           "(not counted as leaks)", "bold yellow")]]
    for leak in info.uncertain:
        lines.append([("   ", ""), (f"{leak.size} bytes", "yellow"), (" uncertain at ", ""),
                      (f"{leak.address:x}", "cyan")])
        if contents and leak.contents:
            lines.extend(_hexdump(leak.address, bytes(leak.contents[:CONTENTS_BYTES])))
    if info.num_uncertain > len(info.uncertain):
        lines.append([(f"   ... {info.num_uncertain - len(info.uncertain)} more not shown", "yellow")])
    lines.append([])
    return lines


def _cyclic_garbage(info: UnreachableMemoryInfo) -> List[Line]:
    """Unreachable Python reference cycles the cyclic GC will free: not leaks, not in the
    SUMMARY nor the exit code."""
    n = getattr(info, "num_cyclic_garbage", 0)
    if not n:
        return []
    lines: List[Line] = [[(f"  {info.cyclic_garbage_bytes} bytes in "
                           f"{plural(n, 'allocation')} of cyclic garbage awaiting collection "
                           "(not counted as leaks)", "bold")]]
    for g in info.cyclic_garbage:
        what = f" ({g.python_type}{_refcount_text(g)})" if g.python_type else ""
        more = (f", referencing {plural(g.referenced_count, 'allocation')}"
                if g.referenced_count else "")
        lines.append([("   ", ""), (f"{g.size} bytes", ""), (" at ", ""),
                      (f"{g.address:x}", "cyan"), (what + more, "")])
    lines.append([])
    return lines


def format_text(info: UnreachableMemoryInfo, contents: bool = False, brief: bool = False) -> str:
    """The plain report as one string (every line ends with a newline); brief: iter_lines."""
    return "".join("".join(t for t, _ in line) + "\n"
                   for line in iter_lines(info, contents, brief))


# ---- colour decision and output ------------------------------------------------------------

def use_color(stream: IO[str], environ: Optional[dict] = None) -> bool:
    """NO_COLOR (non-empty) -> never; CLICOLOR_FORCE (not '0') -> always; CLICOLOR=0 -> never;
    otherwise only when the stream is a terminal."""
    env = os.environ if environ is None else environ
    if env.get("NO_COLOR"):
        return False
    if env.get("CLICOLOR_FORCE", "0") not in ("", "0"):
        return True
    if env.get("CLICOLOR") == "0":
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):
        return False


def render_text(info: UnreachableMemoryInfo, stream: IO[str], contents: bool = False,
                color: Optional[bool] = None) -> None:
    """Write the report to `stream`. color None = decide with use_color(stream); True/False force."""
    if color is None:
        color = use_color(stream)
    if not color:
        stream.write(format_text(info, contents))
        stream.flush()
        return
    from rich.console import Console
    from rich.text import Text

    console = Console(file=stream, force_terminal=True, no_color=False, color_system="standard",
                      highlight=False, markup=False, emoji=False, soft_wrap=True)
    for line in iter_lines(info, contents):
        console.print(Text.assemble(*[(t, s or "") for t, s in line]) if line else "")
    stream.flush()
