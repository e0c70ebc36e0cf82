"""explain.py: why is a block reachable? A diagnostic for missed leaks.

With MEMUNREACHABLE_EXPLAIN=<hex address> in the checker's environment (several: separated by
spaces or commas; @FILE: read from FILE at each sweep), the sweep logs (at
WARNING level) a chain of referrers that kept the block holding each address alive: each step
names the word that points into the previous block and what holds it (a root range, a thread's
register, or a marked allocation with its size and first words). Allocations are searched as mark scans them
(dead objects skipped, typed objects up to their live end) and dead ranges are left out, but a
GC link word may still be listed: the chain is a lead, not a proof.
Slow (Python over every scanned byte, per step); never used in normal runs.
MEMUNREACHABLE_EXPLAIN_LOG=<file> appends the lines to that file too (a pytest session
captures the helper's stderr with the test's output, which a passing test drops).
"""
from __future__ import annotations

import bisect
import struct
from typing import List, Optional, Sequence, Tuple

from memunreachable._ffi import lib
from memunreachable._types import Range, merge_ranges
from memunreachable.sweep.classify import fp_words

MAX_STEPS = 6


def _printable(raw: bytes) -> bool:
    return all(0x20 <= b <= 0x7E for b in raw)


def text_tail(prev: int, word: int, prev2: Optional[int] = None) -> bool:
    """native mu_text_tail: word ends a string (1-7 printable bytes, then a NUL; not 8-aligned)
    after a word whose 4 high bytes are printable; mu_text_tail_aligned: an 8-aligned one after
    two words of 8 printable bytes, with old bytes after its NUL (prev2: the word before prev,
    None when outside the range): text, never a reference."""
    raw = word.to_bytes(8, "little")
    nul = raw.find(0)
    if nul <= 0 or not _printable(raw[:nul]):
        return False
    if word % 8:
        return _printable(prev.to_bytes(8, "little")[4:])
    return prev2 is not None and any(raw[nul + 1:]) \
        and _printable(prev.to_bytes(8, "little") + prev2.to_bytes(8, "little"))


def int32_pair(word: int, begin: int) -> bool:
    """native page_search: a word past a 4 GiB boundary with a small low half, into a block
    that began below it, is a 4-byte int beside a stale high half (mu_types.h MU_PAIR_LOW_MAX)."""
    return word & 0xFFFFFFFF < lib.MU_PAIR_LOW_MAX and word & ~0xFFFFFFFF > begin \
        and word - begin >= lib.MU_PAIR_NEAR


# The addresses of the words of buffers that point into block [lo, hi) at first (lo, or past
# a GC object's PyGC_Head) or above, as mark takes them (dead ranges, text and int32 pairs
# left out).
def _referrers(lo: int, hi: int, buffers: Sequence[Tuple[int, object]], dead,
               first: int) -> List[int]:
    out = []
    for base, buf in buffers:
        mv = memoryview(buf).cast("B")
        n = len(mv) // 8 * 8
        skip = (8 - base % 8) % 8
        words = [w for (w,) in struct.iter_unpack("<Q", mv[skip:skip + (n - skip) // 8 * 8])]
        for k, w in enumerate(words):
            if first <= w < hi and not (k and text_tail(words[k - 1], w,
                                                     words[k - 2] if k > 1 else None)) \
                    and not int32_pair(w, lo):
                a = base + skip + 8 * k
                j = bisect.bisect_right(dead, (a, 1 << 64)) - 1
                if j < 0 or not dead[j][0] <= a < dead[j][1]:
                    out.append(a)
    return out


def _type_name(mem, raw: bytes) -> str:
    """', a Python <tp_name> at +off' when an object header (small ob_refcnt, then a pointer to
    a type whose tp_name reads as a name) starts at offset 0, 16, 32 or 48 of raw; else ''."""
    for off in range(0, min(len(raw) - 15, 49), 16):
        refcnt, tp = struct.unpack_from("<QQ", raw, off)
        if not 0 < refcnt < 1 << 32 or tp < 4096 or mem is None:
            continue
        try:
            name = mem.read(struct.unpack("<Q", mem.read(tp + 24, 8))[0], 48).split(b"\0")[0]
        except Exception:  # noqa: BLE001 - not a type: no name
            continue
        if name and all(0x20 < c < 0x7F for c in name):
            return f", a Python {name.decode()} at +{off}"
    return ""


# dead: sorted, disjoint (begin, end) pairs of words that are no references.
# Returns log lines: the chain of referrers of the allocation holding addr (or why none).
# blocks: [(begin, bytes)] of the marked allocations as mark scans them (mark.scanned_blocks),
# or a callable giving them: called only when the block is reachable (a Python step per block).
# threads: the frozen threads (tid, sp), to say which stack a root word lies in; head_word:
# DeadWords.head_word (the PyGC_Head of each allocation), whose link words are skipped;
# maps: the target's mappings, to name the file a root word lies in (path+offset); mem: the
# snapshot, to name the Python type of an object in the chain.
def explain(addr: int, image, root_buffers, marked, dead_ranges, blocks, threads=(),
            head_word=None, maps=(), mem=None) -> List[str]:
    begins, sizes = image.begins, image.sizes
    i = bisect.bisect_right(begins, addr) - 1
    if i < 0 or addr >= begins[i] + max(sizes[i], 1):
        return [f"explain {addr:#x}: not inside any allocation (give a block's "
                "address from a report)"]
    where = f"allocation {begins[i]:#x} ({sizes[i]} bytes)"
    if addr != begins[i]:
        where = f"not a block start: {addr - begins[i]} bytes into {where}"
    if not marked[i]:
        return [f"explain {addr:#x}: {where} is unreachable (a leak)"]
    label = f"explain {addr:#x}: {where} is reachable; the chain that keeps it:"
    if callable(blocks):
        blocks = blocks()
    lines = []
    dead = list(dead_ranges)
    if head_word is not None:       # GC link words are no references either
        dead += [(begins[j] + 8 * (h - 1), begins[j] + 8 * (h + 1))
                 for j, h in enumerate(head_word) if h]
    dead = [(r.begin, r.end) for r in merge_ranges([Range(b, e) for b, e in dead])]
    seen = {i}
    for _ in range(MAX_STEPS):
        lo, hi = begins[i], begins[i] + max(sizes[i], 1)
        # a word into a PyGC_Head (or before it) is no reference (mark's page_search)
        first = lo + 8 * head_word[i] + 8 if head_word is not None and head_word[i] else lo
        roots = _referrers(lo, hi, root_buffers, dead, first)
        if roots:
            lines.append(f"  {lo:#x} ({sizes[i]} bytes) <- root words at "
                         + ", ".join(f"{a:#x}{_on_stack(a, threads, mem, maps)}"
                                     f"{_in_file(a, maps)}" for a in roots[:8]))
            return [label] + lines
        regs = _register_referrers(lo, hi, threads, first)
        if regs:
            lines.append(f"  {lo:#x} ({sizes[i]} bytes) <- " + ", ".join(regs[:8]))
            return [label] + lines
        refs = _referrers(lo, hi, blocks, dead, first)
        nxt: Optional[int] = None
        for a in refs:
            j = bisect.bisect_right(begins, a) - 1
            if j >= 0 and j not in seen:
                nxt = j
                break
        if nxt is None:
            lines.append(f"  {lo:#x} ({sizes[i]} bytes) <- no referrer found outside the chain")
            break
        raw = bytes(_view(image, begins[nxt], min(sizes[nxt], 64)))
        (word,) = struct.unpack("<Q", bytes(_view(image, a, 8)))
        lines.append(f"  {lo:#x} ({sizes[i]} bytes) <- word {word:#x} at {a:#x}"
                     f" (offset {a - begins[nxt]})"
                     f" of {begins[nxt]:#x} ({sizes[nxt]} bytes{_type_name(mem, raw)},"
                     f" starts {raw.hex()})")
        seen.add(nxt)
        i = nxt
    return [label] + lines


def _register_referrers(lo: int, hi: int, threads, first: int) -> List[str]:
    """The registers of `threads` (root words, classify.register_words) holding a value in
    [first, hi) of block [lo, hi): 'register rbx of thread T', 'FP/SIMD state +0x2c0 of
    thread T'."""
    from memunreachable._types import REG_NAMES
    out = []
    for t in threads:
        out += [f"register {REG_NAMES[k]} of thread {t.tid}" for k, v in enumerate(t.regs)
                if first <= v < hi and not int32_pair(v, lo)]
        out += [f"FP/SIMD state +{8 * k:#x} of thread {t.tid}"
                for k, v in enumerate(fp_words(t)) if first <= v < hi and not int32_pair(v, lo)]
    return out


def _on_stack(a: int, threads, mem=None, maps=()) -> str:
    """' (thread T's stack, SP+N)' when a lies at most 8 MiB above a thread's stack pointer,
    with the nearest code address above it when mem can be read (_frame_below)."""
    above = [(a - t.sp, t.tid) for t in threads if t.sp and 0 <= a - t.sp < 8 << 20]
    if not above:
        return ""
    off, tid = min(above)
    return f" (thread {tid}'s stack, SP+{off:#x}{_frame_below(a, mem, maps)})"


FRAME_SEARCH = 4096     # how far above a stack word explain looks for a return address


def _frame_below(a: int, mem, maps) -> str:
    """', N below a return address into FUNCTION': the nearest word above stack word a that
    points into a file's executable code, symbolized. A live one ends the frame a lies in; a
    dead frame's (a slot the live frame never wrote) reads the same, so it names where the
    word's neighbours came from, not for sure whose frame holds it. '' when none is found or
    the stack cannot be read."""
    if mem is None or not maps:
        return ""
    from memunreachable._errors import MemoryUnreadable
    from memunreachable.stacks.symbolize import modules_from_maps, symbolize
    mods = modules_from_maps(maps)
    top = next((m.end for m in maps if m.begin <= a < m.end), a + 8)
    try:
        data = mem.read(a + 8, max(0, min(FRAME_SEARCH, top - a - 8)) // 8 * 8)
    except MemoryUnreadable:
        return ""
    for k, (v,) in enumerate(struct.iter_unpack("<Q", data)):
        if any(b <= v < e for b, e, _, _ in mods):
            f = symbolize([v], mods, resolve=True)[-1]
            name = f.function or f"{f.module}+{f.offset:#x}"
            return f", {8 * (k + 1):#x} below a return address into {name}"
    return ""


def _in_file(a: int, maps) -> str:
    """' (FILE+0xOFFSET)' when a lies in a file mapping: the offset in the file, for nm; for
    the anonymous mapping right after a file's last mapping (its .bss), ' (FILE .bss +0xN)'."""
    prev = None
    for m in maps:
        if m.begin <= a < m.end:
            if m.path and not m.path.startswith("["):
                return f" ({m.path}+{a - m.begin + m.offset:#x})"
            if not m.path and prev is not None and prev.end == m.begin and prev.path \
                    and not prev.path.startswith("["):
                return f" ({prev.path} .bss +{a - m.begin:#x})"
            return ""
        prev = m
    return ""


def _view(image, addr: int, size: int):
    for base, buf in image.regions:
        if base <= addr and addr + size <= base + len(buf):
            return memoryview(buf)[addr - base:addr - base + size]
    return memoryview(b"")
