"""classify.py: Stage 5: which memory is a root.

Input: the target's mappings (/proc/PID/maps), the heap ranges and allocator metadata
the walker found, and the frozen threads. Output: a RootSet of memory ranges to scan and
root words (registers). Table-driven, following libmemunreachable.md section 2.2:

| mapping                                        | class                               |
|------------------------------------------------|-------------------------------------|
| unreadable, executable, shared, vvar/vdso/...  | skip                                |
| file-backed segments of a loaded object        | root (.data, relro, .bss in-file)   |
| other file-backed mappings (data files)        | skip                                |
| [heap], arena heaps, mmapped chunks            | heap: never a root (walker ranges)  |
| main_arena, mp_                                | cut out of roots (bin pointers alias|
|                                                |   the previous chunk's user bytes)  |
| a mapping holding a thread's SP                | root but the dead stack below each  |
|                                                |   SP (SP-128, the red zone, for a   |
|                                                |   thread stopped in user code)      |
| other anonymous rw memory (.bss tails, TLS,    | root, minus heap and metadata       |
|   TCB, user mmaps, pymalloc arenas)            |                                     |

All general registers (fs_base included) are root words, and every word of the FP/SIMD state
of a thread stopped in user code; a thread stopped inside a system call holds nothing live in
its vector registers (register_words).
"""
from __future__ import annotations

import bisect
import struct
from typing import Dict, List, Optional, Sequence, Tuple

from memunreachable._types import (REG_NAMES, Fields, Mapping, Range, RangeCutter, ThreadState,
                                   merge_ranges, subtract_ranges)

RED_ZONE = 128          # x86-64 ABI: leaf functions may keep live data below SP
PAGE = 4096
ORIG_RAX = 15           # user_regs_struct index; -1 when the thread was stopped in user code
SKIP_NAMES = ("[vvar]", "[vvar_vclock]", "[vdso]", "[vsyscall]")
SKIP_PREFIXES = ("/dev/", "/memfd:", "/SYSV", "[anon_shmem", "/dmabuf")


class RootSet(Fields):
    __slots__ = ("ranges", "kinds", "words")

    def __init__(self, ranges: Optional[List[Range]] = None,    # sorted, disjoint
                 kinds: Optional[Dict[Range, str]] = None,     # range -> "data" | "stack" | "anon"
                 words: Optional[List[int]] = None):
        self.ranges = [] if ranges is None else ranges
        self.kinds = {} if kinds is None else kinds
        self.words = [] if words is None else words

    @property
    def num_bytes(self) -> int:
        return sum(r.size for r in self.ranges)


def classify_mapping(m: Mapping, objects: set) -> str:
    """Class of one mapping before carve-outs: 'skip', 'data' or 'anon'.

    [heap] counts as 'anon': the walker's main-arena runs are cut out of it later, and
    what remains (a static binary's TCB before sbrk_base, foreign sbrk gaps) is a root.
    """
    if not m.readable or m.shared or m.executable:
        return "skip"
    if m.path in SKIP_NAMES or m.path.startswith(SKIP_PREFIXES):
        return "skip"
    if m.anonymous or m.path.startswith("[anon:") or m.path.startswith("[stack"):
        return "anon"
    if m.path in objects:
        return "data"
    return "skip"


def data_ranges(maps: Sequence[Mapping], unwritten: Sequence[Range]) -> List[Range]:
    """The loaded objects' data mappings that can be roots (classify's "data" class) minus
    the pages never written: read once, early, they serve every small read of the CPython
    stage (the runtime, static types, free lists) and then the roots."""
    global _LAST_DATA
    key = (tuple(maps), tuple(unwritten))
    if _LAST_DATA is None or _LAST_DATA[0] != key:
        cut = RangeCutter(unwritten)
        _LAST_DATA = (key, [piece for m in mapping_classes(maps)[1] for piece in cut(m.range)])
    return list(_LAST_DATA[1])


_LAST_DATA: Optional[tuple] = None     # data_ranges' last (inputs, answer)


# mapping_classes' last answer: (maps as a tuple, answer). The pytest plugin's helper checks
# one process after every test: its ~200 mappings are mostly the same Mapping objects
# (procfs.parse_maps keeps them), compared by identity first.
_LAST_CLASSES: Optional[tuple] = None


def mapping_classes(maps: Sequence[Mapping]) -> tuple:
    """([(mapping, class)] of every mapping not skipped, in order; [the "data" mappings])
    by classify_mapping, the same list for the same maps as last time."""
    global _LAST_CLASSES
    key = tuple(maps)
    if _LAST_CLASSES is not None and _LAST_CLASSES[0] == key:
        return _LAST_CLASSES[1]
    objects = loaded_objects(maps)
    kept = [(m, cls) for m in maps for cls in (classify_mapping(m, objects),) if cls != "skip"]
    answer = (kept, [m for m, cls in kept if cls == "data"])
    _LAST_CLASSES = (key, answer)
    return answer


def loaded_objects(maps: Sequence[Mapping]) -> set:
    """Paths of ELF objects with executable code mapped (libraries and the executable)."""
    return {m.path for m in maps if m.executable and m.path and not m.path.startswith("[")}


def in_syscall(t: ThreadState) -> bool:
    """t stopped inside a system call: orig_rax holds the call's number from the kernel entry
    by `syscall` until the next entry; an entry by an interrupt or an exception (a thread
    stopped while running user code) sets it to -1."""
    return t.regs[ORIG_RAX] != 0xFFFFFFFFFFFFFFFF


def live_stack_start(t: ThreadState) -> int:
    """Lowest live stack address of a stopped thread: SP - 128 in user code (a leaf function's
    red zone may hold live data), SP inside a system call (the code that made it is not a
    leaf running below SP, so the red zone holds only dead data, e.g. stale pointers)."""
    return t.sp if in_syscall(t) else max(0, t.sp - RED_ZONE)


# A thread blocked in one of these syscalls, made through a C call, holds live values only in
# the registers a call preserves (SysV ABI): read, poll, select, pselect6, ppoll (the in-process
# caller's wait for its helper's reply).
WAIT_SYSCALLS = frozenset((0, 7, 23, 270, 271))
_CALL_CLOBBERED = frozenset(REG_NAMES.index(r) for r in
                            ("rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11"))


def waiting(threads: Sequence[ThreadState], tids) -> List[ThreadState]:
    """threads, where each of `tids` stopped in a WAIT_SYSCALLS syscall (its orig_rax; a thread
    found elsewhere stays whole) keeps only the registers a call preserves: the caller-saved
    general registers are zeroed, as by the ABI they hold nothing live across the call that
    made the syscall, only what earlier code left (its FP/SIMD state, likewise, is no root:
    fp_words). For the in-process checks: `tids` is the requesting thread, in its wait for
    the reply."""
    tids = set(tids)
    out = []
    for t in threads:
        if t.tid in tids and t.regs[ORIG_RAX] in WAIT_SYSCALLS:
            regs = tuple(0 if k in _CALL_CLOBBERED else v for k, v in enumerate(t.regs))
            t = ThreadState(t.tid, regs, t.fpregs, t.stop_signal)
        out.append(t)
    return out


def register_words(threads: Sequence[ThreadState]) -> List[int]:
    """Every general register, per thread, and every 8-byte word of the FP/SIMD state of a
    thread stopped in user code (fp_words)."""
    words: List[int] = []
    for t in threads:
        words.extend(t.regs)
        words.extend(w for w in fp_words(t) if w)
    return words


def fp_words(t: ThreadState) -> List[int]:
    """The 8-byte words of t's FP/SIMD state that may be live: all of them in user code, none
    inside a system call. By the x86-64 ABI every vector register is caller-saved, and a system
    call is made through a call (a libc wrapper, syscall(2)): what they hold then is only what
    earlier code left, e.g. copies of addresses glibc's AVX-512 string functions leave in
    zmm16-31, which kept a leaked 4 MB block reachable on a loaded machine."""
    if in_syscall(t):
        return []
    fp = t.fpregs[: len(t.fpregs) - len(t.fpregs) % 8]
    return [w for (w,) in struct.iter_unpack("<Q", fp)]


# The parts of a mapping that holds thread stacks, each with its kind: every SP's dead stack
# (from SP, or SP - 128, down to the bottom of that thread's stack block) is cut out.
# Before glibc 2.42 a thread stack was a mapping of its own (its guard page a ---p mapping),
# so the bottom was the mapping's start. glibc 2.42+ installs the guard with MADV_GUARD_INSTALL
# inside the rw-p mapping (Linux 6.13+: VmFlags gu), and the stacks created one after another
# merge into one mapping: [guard|stack ... TLS, TCB][guard|stack ... TLS, TCB]... Cutting
# everything below the lowest SP there left out the stack blocks below it, with their TCBs: a
# thread running on a stack of its own (a coroutine's, Go's) keeps its glibc block, its TCB
# holding the DTV, an interior pointer into the heap (calloc'd at pthread_create): the DTV read
# as a 280-byte leak on sid (glibc 2.43, fixtures/ptr_regs.c's "carved" thread). A block ends
# at the page end after its TCB (fs_base: nptl's allocate_stack puts struct pthread, smaller
# than a page, at the block's top), so a dead stack stops at the end of the highest block
# below its SP whose thread is known, or at the guard pages below its SP when the kernel
# shows them (pagemap bit 58, PM_GUARD_REGION): a block begins with its guard, so the
# highest guard below an SP is that thread's own, and a cached stack of an exited thread
# between two live ones keeps its TCB, whose DTV it still owns (a 280-byte false leak on sid
# for a program that joined one thread while two others ran). Without guard positions, blocks
# of no thread there stay cut out.
def stack_pieces(m: Mapping, starts: Sequence[tuple], ends: Sequence[int],
                 guards: Sequence[Tuple[int, int]] = ()) -> List[tuple]:
    """[(range, "stack" | "anon")] of a mapping holding thread stacks, in order: "stack" for
    the pieces that begin at a live SP, "anon" for other blocks. starts: (SP, live stack
    start) of every thread, sorted; ends: every thread's block end (after its fs_base), sorted;
    guards: the runs of guard pages in m, sorted."""
    lo = bisect.bisect_left(starts, (m.begin,))
    hi = bisect.bisect_left(starts, (m.end,))
    guard_ends = [e for _, e in guards]
    live, dead = [], []
    for sp, start in starts[lo:hi]:
        start = max(m.begin, start)
        k = bisect.bisect_right(ends, start)
        bottom = max(m.begin, ends[k - 1]) if k else m.begin
        g = bisect.bisect_right(guard_ends, start)
        if g:
            bottom = max(bottom, guard_ends[g - 1])
        live.append(start)
        if bottom < start:
            dead.append(Range(bottom, start))
    pieces = subtract_ranges([m.range], dead)
    return [(r, "stack" if any(r.begin <= s < r.end for s in live) else "anon") for r in pieces]


def stack_maps(maps: Sequence[Mapping], threads: Sequence[ThreadState]) -> List[Tuple[int, int]]:
    """(begin, end) of the anonymous mappings holding a thread's SP (glibc's thread stacks)."""
    sps = sorted(t.sp for t in threads if t.sp)
    return [(m.begin, m.end) for m in maps if not m.path
            and bisect.bisect_left(sps, m.begin) < bisect.bisect_left(sps, m.end)]


def classify(maps: Sequence[Mapping], threads: Sequence[ThreadState],
             heap_ranges: Sequence[Range], metadata_ranges: Sequence[Range],
             extra_cuts: Sequence[Range] = (), guards: Optional[dict] = None) -> RootSet:
    """Return the RootSet: root ranges (minus heap, allocator metadata and extra_cuts: other
    allocators' heaps and dead memory, e.g. CPythonSweep.root_cuts) and root words. guards:
    {(begin, end): runs of guard pages} of the mappings that hold thread stacks (stack_maps),
    where known."""
    starts = sorted((t.sp, live_stack_start(t)) for t in threads if t.sp)
    ends = sorted((t.fs_base | (PAGE - 1)) + 1 for t in threads if t.fs_base)
    candidates: List[tuple] = []
    for m, cls in mapping_classes(maps)[0]:
        k = bisect.bisect_left(starts, (m.begin,))
        if k < len(starts) and starts[k][0] < m.end:
            # thread stacks: live from each SP (- red zone) up, other threads' blocks whole
            candidates.extend(stack_pieces(m, starts, ends, (guards or {}).get((m.begin, m.end), ())))
            continue
        kind = "data" if cls == "data" else "anon"
        if m.path.startswith("[stack"):
            kind = "stack"
        candidates.append((m.range, kind))

    cut = RangeCutter(list(heap_ranges) + list(metadata_ranges) + list(extra_cuts))
    roots = RootSet(words=register_words(threads))
    for rng, kind in candidates:
        for piece in cut(rng):
            roots.ranges.append(piece)
            roots.kinds[piece] = kind
    roots.ranges.sort(key=lambda r: r.begin)
    return roots


# Anonymous memory read as roots from this many bytes on, and more than the heap's allocations,
# is said in the report: it may be another allocator's heap.
UNMANAGED_MIN = 64 << 20


def unmanaged_memory(roots: RootSet, heap_bytes: int) -> List[str]:
    """A warning (or none) when the anonymous memory read as roots (mappings no heap the sweep
    knows covers, untouched runs left out: user mmaps, an allocator of the program's own or a
    language runtime's heap) is at least UNMANAGED_MIN bytes and more than heap_bytes, the
    bytes of the allocations found. Blocks another allocator keeps there are scanned as roots,
    never checked: a statically linked jemalloc with prefixed names, a pool over mmap, a JIT's
    or garbage collector's heap; a check of such a process could otherwise only say "no
    leaks" about its glibc blocks."""
    anon = sum(r.size for r in roots.ranges if roots.kinds.get(r) == "anon")
    if anon < UNMANAGED_MIN or anon <= heap_bytes:
        return []
    from memunreachable.reporters.text import human_size    # (rare: loaded only then)
    return [f"{human_size(anon)} of anonymous memory outside the heaps this check knows (more "
            f"than the {human_size(heap_bytes)} of allocations it found) was read as roots, "
            "never checked as allocations: leaks of another allocator there (a statically "
            "linked or prefixed jemalloc or tcmalloc, a pool over mmap, a runtime's own heap) "
            "are not seen"]
