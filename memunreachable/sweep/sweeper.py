"""sweeper.py: Stages 4-8 run in a process forked from the checker (run_sweeper), or in the
checker itself when that is a disposable helper (run_here: same message, no fork).

The sweeper reads the snapshot through a /proc/<pid>/mem fd the checker opened, walks the
heap, classifies roots, marks, folds, and streams the result back over a pipe it alone
writes to, then _exits. The checker reads with poll() and a deadline and checks the
sweeper's exit status, so a crash or a hang becomes a SweepError, never a hang.

Wire format (version 2, little-endian):
    header  : magic b"MUSW", u16 version, u16 kind, u64 payload length
    kind 1  : result. u64 num_allocations, allocation_bytes, num_leaks, leak_bytes,
              bytes_scanned, u64 n_entries, u64 n_leak_addresses, u64 n_uncertain, then
              n_entries records of (u64 address, size, referenced_count, referenced_size,
              u8 contents_len, 32 bytes contents), then n_uncertain records of the same shape
              (unreachable blocks withheld as uncertain), then n_leak_addresses u64 (every
              unreachable block, sent only when a confirming snapshot may follow), then a
              UTF-8 JSON object (allocator, stats, warnings; "_python_objects" and
              "_cyclic_garbage" carry the CPython annotations and the cyclic garbage;
              "_stacks" the allocation stacks: {entry index: [status, [pc...],
              [[function, file, line]...], requested size or null]}, entries then cyclic
              garbage, only for entries whose status is not "untracked"; "_indirect" the
              blocks each entry lists: {entry index: [count, bytes, [[address, size,
              status, [pc...], [[function, file, line]...], requested]...]]})
    kind 2  : error. A pickled MemunreachableError (HeapInconsistent means: retake the snapshot)
"""
from __future__ import annotations

import ctypes
import faulthandler
import gc
from array import array
import json
import logging
import os
import select
import signal
import struct
import time
from typing import Callable, List, Optional, Tuple

from memunreachable._errors import MemunreachableError, OutOfMemory, SweepError
from memunreachable._types import Fields
from memunreachable.collect import procfs
from memunreachable.collect.interrupts import critical

log = logging.getLogger("memunreachable")

MAGIC = b"MUSW"
VERSION = 2
KIND_RESULT = 1
KIND_ERROR = 2
HEADER = struct.Struct("<4sHHQ")
TOTALS = struct.Struct("<8Q")
ENTRY = struct.Struct("<4QB32s")
# CPython additions ride in the JSON tail (additive): Python object annotations of entries
# ({entry index: [type name, refcount, repr]}) and the cyclic garbage entries
_PY_KEY = "_python_objects"
_GARBAGE_KEY = "_cyclic_garbage"
_STACKS_KEY = "_stacks"
_INDIRECT_KEY = "_indirect"


class SweepEntry(Fields):
    __slots__ = ("address", "size", "referenced_count", "referenced_size", "contents",
                 "python_type", "refcount", "repr", "stack", "python_stack", "stack_status",
                 "requested_size", "epoch", "num_indirect", "indirect_size", "indirect")

    def __init__(self, address: int, size: int, referenced_count: int, referenced_size: int,
                 contents: bytes,
                 # the block holds a Python object (cpython/objects.py)
                 python_type: Optional[str] = None, refcount: Optional[int] = None,
                 repr: Optional[str] = None,
                 # allocation stack (tracking.py), innermost first
                 stack: Tuple[int, ...] = (),
                 python_stack: Optional[List[Tuple[str, str, int]]] = None,
                 stack_status: str = "untracked",   # "recorded" | "untracked" | "table_full"
                 requested_size: Optional[int] = None,      # what was asked for, if tracked
                 epoch: Optional[int] = None,               # the tracker's epoch then
                 # the unreachable blocks this entry lists (folding.FoldedLeak.blocks): how
                 # many, their bytes, and the first INDIRECT_LIMIT of them (no contents)
                 num_indirect: int = 0, indirect_size: int = 0,
                 indirect: Optional[List["SweepEntry"]] = None):
        self.address = address
        self.size = size
        self.referenced_count = referenced_count
        self.referenced_size = referenced_size
        self.contents = contents
        self.python_type = python_type
        self.refcount = refcount
        self.repr = repr
        self.stack = stack
        self.python_stack = [] if python_stack is None else python_stack
        self.stack_status = stack_status
        self.requested_size = requested_size
        self.epoch = epoch
        self.num_indirect = num_indirect
        self.indirect_size = indirect_size
        self.indirect = [] if indirect is None else indirect

    def stack_record(self) -> list:
        """[status, pcs, Python frames, requested size, epoch] (the wire's _stacks values)."""
        return [self.stack_status, list(self.stack), [list(f) for f in self.python_stack],
                self.requested_size, self.epoch]

    def set_stack(self, record: list) -> None:
        """The inverse of stack_record()."""
        status, pcs, py, requested, epoch = record
        self.stack_status, self.stack, self.requested_size = status, tuple(pcs), requested
        self.epoch = epoch
        self.python_stack = [tuple(f) for f in py]


class SweepResult(Fields):
    __slots__ = ("num_allocations", "allocation_bytes", "num_leaks", "leak_bytes", "bytes_scanned",
                 "entries", "meta", "leak_addresses", "uncertain", "cyclic_garbage")

    def __init__(self, num_allocations: int = 0, allocation_bytes: int = 0, num_leaks: int = 0,
                 leak_bytes: int = 0, bytes_scanned: int = 0,
                 entries: Optional[List[SweepEntry]] = None, meta: Optional[dict] = None,
                 leak_addresses: Optional[List[int]] = None,
                 uncertain: Optional[List[SweepEntry]] = None,        # withheld, not leaks
                 cyclic_garbage: Optional[List[SweepEntry]] = None):  # the GC will free them
        self.num_allocations = num_allocations
        self.allocation_bytes = allocation_bytes
        self.num_leaks = num_leaks
        self.leak_bytes = leak_bytes
        self.bytes_scanned = bytes_scanned
        self.entries = [] if entries is None else entries
        self.meta = {} if meta is None else meta
        self.leak_addresses = [] if leak_addresses is None else leak_addresses
        self.uncertain = [] if uncertain is None else uncertain
        self.cyclic_garbage = [] if cyclic_garbage is None else cyclic_garbage


def encode_result(res: SweepResult) -> bytes:
    parts = [TOTALS.pack(res.num_allocations, res.allocation_bytes, res.num_leaks,
                         res.leak_bytes, res.bytes_scanned, len(res.entries),
                         len(res.leak_addresses), len(res.uncertain))]
    for e in res.entries + res.uncertain:
        c = e.contents[:32]
        parts.append(ENTRY.pack(e.address, e.size, e.referenced_count, e.referenced_size, len(c), c))
    parts.append(array("Q", res.leak_addresses).tobytes())
    meta = dict(res.meta)
    py = {str(k): [e.python_type, e.refcount, e.repr]
          for k, e in enumerate(res.entries) if e.python_type is not None}
    if py:
        meta[_PY_KEY] = py
    both = res.entries + res.cyclic_garbage
    stacks = {str(k): e.stack_record() for k, e in enumerate(both) if e.stack_status != "untracked"}
    if stacks:
        meta[_STACKS_KEY] = stacks
    indirect = {str(k): [e.num_indirect, e.indirect_size,
                         [[b.address, b.size] + b.stack_record() for b in e.indirect]]
                for k, e in enumerate(both) if e.num_indirect}
    if indirect:
        meta[_INDIRECT_KEY] = indirect
    if res.cyclic_garbage:
        meta[_GARBAGE_KEY] = [[e.address, e.size, e.referenced_count, e.referenced_size,
                               e.contents.hex(), e.python_type, e.refcount, e.repr]
                              for e in res.cyclic_garbage]
    parts.append(json.dumps(meta).encode())
    payload = b"".join(parts)
    return HEADER.pack(MAGIC, VERSION, KIND_RESULT, len(payload)) + payload


def encode_error(exc: BaseException) -> bytes:
    if not isinstance(exc, MemunreachableError):
        exc = SweepError(f"sweeper failed: {type(exc).__name__}: {exc}",
                         hint="this is a bug in memunreachable; please report it with -vv output")
    import pickle           # errors only: a check that succeeds does not load it (issue 10)
    payload = pickle.dumps(exc)
    return HEADER.pack(MAGIC, VERSION, KIND_ERROR, len(payload)) + payload


def decode(message: bytes):
    """Return a SweepResult, or raise the error the sweeper sent; SweepError on garbage."""
    if len(message) < HEADER.size:
        raise SweepError("the sweeper sent a truncated message")
    magic, version, kind, length = HEADER.unpack_from(message)
    if magic != MAGIC or version != VERSION:
        raise SweepError(f"the sweeper sent an unknown message (magic {magic!r}, version {version})")
    payload = message[HEADER.size:]
    if len(payload) != length:
        raise SweepError(f"the sweeper's message is {len(payload)} bytes, expected {length}")
    if kind == KIND_ERROR:
        import pickle
        exc = pickle.loads(payload)
        raise exc
    if kind != KIND_RESULT:
        raise SweepError(f"the sweeper sent an unknown message kind {kind}")
    vals = TOTALS.unpack_from(payload)
    res = SweepResult(*vals[:5])
    off = TOTALS.size
    for i in range(vals[5] + vals[7]):
        a, s, rc, rs, clen, c = ENTRY.unpack_from(payload, off)
        (res.entries if i < vals[5] else res.uncertain).append(SweepEntry(a, s, rc, rs, c[:clen]))
        off += ENTRY.size
    addrs = array("Q")
    addrs.frombytes(payload[off:off + 8 * vals[6]])
    res.leak_addresses = addrs.tolist()
    off += 8 * vals[6]
    res.meta = json.loads(payload[off:].decode() or "{}")
    for k, (t, rc, r) in res.meta.pop(_PY_KEY, {}).items():
        e = res.entries[int(k)]
        e.python_type, e.refcount, e.repr = t, rc, r
    res.cyclic_garbage = [SweepEntry(a, s, rc, rs, bytes.fromhex(c), t, n, r)
                          for a, s, rc, rs, c, t, n, r in res.meta.pop(_GARBAGE_KEY, [])]
    both = res.entries + res.cyclic_garbage
    for k, record in res.meta.pop(_STACKS_KEY, {}).items():
        both[int(k)].set_stack(record)
    for k, (num, size, blocks) in res.meta.pop(_INDIRECT_KEY, {}).items():
        e = both[int(k)]
        e.num_indirect, e.indirect_size = num, size
        for address, bsize, *record in blocks:
            b = SweepEntry(address, bsize, 0, 0, b"")
            b.set_stack(record)
            e.indirect.append(b)
    return res


def run_sweeper(work: Callable[[], SweepResult], timeout: float) -> SweepResult:
    """Fork a sweeper that runs work() and send its result back; return it or raise.

    Only the sweeper holds the pipe's write end, so its death is seen as EOF. The sweeper
    never outlives the checker: it is killed on every exit path of this function (signal,
    timeout, error), and PR_SET_PDEATHSIG kills it when the checker itself is killed.
    """
    _libc_prctl()           # resolved before the fork
    oom_kills = procfs.oom_kills()
    rfd, wfd = os.pipe2(os.O_CLOEXEC)
    parent = os.getpid()
    pid = 0
    try:
        with critical():        # no signal between the fork and `pid` being known
            pid = os.fork()
            if pid == 0:
                _sweeper_main(work, rfd, wfd, parent)      # never returns
            os.close(wfd)
            wfd = -1
        data = _read_all(rfd, pid, timeout)
    except BaseException:
        if wfd >= 0:
            os.close(wfd)
        if pid:
            _kill(pid)      # interrupted (SIGINT/SIGTERM/SIGHUP) or timed out: none left behind
        raise
    finally:
        os.close(rfd)
    if data:
        # the whole message: the sweeper closed the pipe and exits, still giving its memory
        # back (the copies of a 1 GiB heap: 0.1-0.3 s); it is reaped without waiting for that
        _reap_soon(pid)
        return decode(data)
    status = _reap(pid)
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        if os.WTERMSIG(status) == signal.SIGKILL and procfs.oom_killed_since(oom_kills):
            raise OutOfMemory(f"the sweeper process {pid}")
        if os.WTERMSIG(status) in (signal.SIGKILL, signal.SIGTERM):
            raise SweepError(f"the sweeper process {pid} was killed ({sig}) before sending "
                             "a result; nothing was reported",
                             hint="something outside memunreachable killed it (the OOM "
                                  "killer? see dmesg); run the check again")
        raise SweepError(f"the sweeper process crashed ({sig}) before sending a result",
                         hint="this is a bug in memunreachable; please report it with -vv output")
    raise SweepError(f"the sweeper exited with status {os.waitstatus_to_exitcode(status)} "
                     "without sending a result")


def run_here(work: Callable[[], SweepResult]) -> SweepResult:
    """Run work() in this process and return its result as run_sweeper would: the message
    goes through the same encoding (a SweepResult as decoded from the wire; an error as the
    sweeper sends it: a MemunreachableError as raised, anything else a SweepError). For a
    long-lived helper whose process is disposable (noleaks.py restarts one that died): no
    fork, no copy-on-write of the checker's objects, no fresh process to fault in. The cyclic
    GC is off during the sweep (its objects are freed by reference counting). KeyboardInterrupt
    and SystemExit propagate. sweep_timeout is not enforced here."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        try:
            msg = encode_result(work())
        except Exception as exc:  # noqa: BLE001 - as the sweeper: everything becomes a message
            msg = encode_error(exc)
    finally:
        if enabled:
            gc.enable()
    return decode(msg)


def _sweeper_main(work: Callable[[], SweepResult], rfd: int, wfd: int, parent: int) -> None:
    """The sweeper process: run work(), write the message, _exit. Never returns."""
    global _RETAIN
    code = 0
    _RETAIN = []
    try:
        os.close(rfd)
        # dies with the checker, even by SIGKILL (PR_SET_PDEATHSIG); a terminal's SIGINT,
        # SIGHUP or SIGTSTP reaches the whole process group: the checker alone decides
        _set_pdeathsig(signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(71)                        # the checker died before the prctl
        faulthandler.disable()      # a crash is reported by the checker, not dumped here
        procfs.oom_first()          # its copies of the heap go before the target's memory
        # no cyclic GC here: we exit right after the sweep (its cycles die with us), and a
        # collection would traverse, and so copy-on-write, the checker's inherited objects
        # (a pytest process's check: sweep 125 -> 95 ms)
        gc.disable()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        for signum in (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):
            signal.signal(signum, signal.SIG_IGN)   # Ctrl-Z: the checker decides (freeze.py)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            msg = encode_result(work())
        except BaseException as exc:  # noqa: BLE001 - everything goes over the pipe
            msg = encode_error(exc)
        view = memoryview(msg)
        while view:
            n = os.write(wfd, view)
            view = view[n:]
        os.close(wfd)       # the checker sees the end now, not after our memory is torn down
    except BaseException:  # noqa: BLE001
        code = 70
    finally:
        os._exit(code)


PR_SET_PDEATHSIG = 1
_prctl = None


def _libc_prctl():
    global _prctl
    if _prctl is None:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    return _prctl


def _set_pdeathsig(sig: int) -> None:
    _libc_prctl()(PR_SET_PDEATHSIG, ctypes.c_ulong(sig), 0, 0, 0)


def _read_all(fd: int, pid: int, timeout: float) -> bytes:
    chunks = []
    deadline = time.monotonic() + timeout
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SweepError(f"the sweep did not finish within {timeout:.0f} s; it was stopped",
                             hint="raise --sweep-timeout for very large heaps")
        if not poller.poll(min(left, 1.0) * 1000):
            continue
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


# Objects the sweeper keeps until it exits (sweep(retain=...)): freeing 1 GiB of copies page
# by page before writing the result only delays it, the exit frees them anyway.
_RETAIN: Optional[list] = None


def retain_list() -> Optional[list]:
    """Inside a sweeper process, the list whose objects live until it exits; else None."""
    return _RETAIN


def _reap_soon(pid: int) -> None:
    """Reap a sweeper that sent its result: now if it has exited, else in a daemon thread
    (its exit is unmapping its copies of the heap)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return
    except ChildProcessError:
        return
    import threading
    threading.Thread(target=_reap, args=(pid,), name=f"{REAPER_PREFIX}{pid}",
                     daemon=True).start()


REAPER_PREFIX = "memunreachable-reap-"


def join_reapers(timeout: Optional[float] = None) -> None:
    """Wait for the background reaps of this process's sweepers (a sweeper's peak RSS counts
    in RUSAGE_CHILDREN, and its thread leaves /proc/self/task, only then)."""
    import threading
    for t in threading.enumerate():
        if t.name.startswith(REAPER_PREFIX):
            t.join(timeout)


def _kill(pid: int) -> None:
    with critical():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _reap(pid)


def _reap(pid: int) -> int:
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            return status
        except InterruptedError:
            continue
        except ChildProcessError:
            return 0
