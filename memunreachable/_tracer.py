"""_tracer.py: the helper process of in-process checks (python -m memunreachable._tracer).

The caller (noleaks.py) starts us once, with a result fd and a control pipe on stdin, and
keeps us for its lifetime (start-up and imports are paid once, not per check). --uffd N: a
userfaultfd the caller opened for its own memory, which we keep (written.py: every check then
knows the pages written since the last one). Requests, one
line each, sent after the caller's prctl(PR_SET_PTRACER, our pid); each gets one framed reply:
u64 little-endian length, then the pickled ("ok", VALUE) or ("error", MemunreachableError).
    go LIMIT TIMEOUT [SYMBOLIZE SUPPRESSIONS [DEAD]]
        the ordinary check pipeline against the caller (freeze, clone snapshot, thaw, sweep,
        reap); VALUE the UnreachableMemoryInfo. SYMBOLIZE 0/1; SUPPRESSIONS the hex of an LSan
        suppressions text, "-" for none; DEAD "BEGIN-END,..." in hex: ranges of the caller that
        hold no references (its idle alternate signal stack).
    snap TIMEOUT DEAD [RECORD]
        a snapshot now, its sweep left for later (deferred.check_later): VALUE ("later",
        TOKEN); or, when the snapshot could need a retake, a full check's UnreachableMemoryInfo.
        RECORD 1: once the reply is sent, its allocations are recorded with the write tracker
        (deferred.record_allocations: the sweeps after it count their fresh rule from it).
        Up to MAX_PENDING snapshots wait at once (the pytest plugin's batches); a snap beyond
        that releases the oldest.
    base TOKEN LIMIT SYMBOLIZE SUPPRESSIONS
        the sweep of that waiting snapshot (deferred.sweep_pending), then its release.
    drop [TOKEN[,TOKEN...] [later]]
        release those snapshots (no TOKEN: every one) if they still wait (VALUE None); with
        "later", once the reply is sent: their processes' teardown (1 ms each) then overlaps
        with the caller's next steps.
A last word "@TID" names the caller's requesting thread: a check waits until that thread sits
in its wait for the reply (await_wait) before freezing it, and of its registers only those a
call preserves are roots (classify.waiting). The caller waits for each reply (a
blocking read on the result fd: it holds no GIL and no allocator lock while its threads are
frozen), so at most one request is ever buffered here.
End of stdin (the caller closed us), or the caller's death, ends us, releasing a waiting
snapshot.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import struct
import sys
from typing import Dict, Optional


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--uffd", type=int, default=-1)
    args = ap.parse_args(argv)
    _keep_freed_memory()
    from memunreachable.collect.procfs import oom_first
    oom_first()                 # it sweeps here, from copies of the caller's heap
    from memunreachable.sweep.mark import use_every_cpu
    use_every_cpu()             # the caller waits idle while we sweep: its CPU is free
    tracker = _tracker(args.pid, args.uffd)
    warm = _Warmer(args.pid)
    pending = _Pending(tracker)
    try:
        warm.when_idle()
        for line in _requests(os.getppid()):
            reply = _serve(args.pid, line.split(), pending, tracker)
            if reply is None:
                return 2
            data = pickle.dumps(reply)
            view = memoryview(struct.pack("<Q", len(data)) + data)
            while view:
                view = view[os.write(args.fd, view):]
            pending.after_reply()       # while the caller runs on
            warm.when_idle()
    finally:
        pending.drop()
        if tracker is not None:
            tracker.close()
    os.close(args.fd)
    return 0


def _tracker(pid: int, uffd: int):
    """The WriteTracker of the caller's userfaultfd (written.py), None without one."""
    if uffd < 0:
        return None
    try:
        from memunreachable.collect import procfs
        from memunreachable.sweep.written import WriteTracker
        tracker = WriteTracker(pid, uffd)
    except OSError:
        os.close(uffd)
        return None
    try:            # before the first check: its snapshot is the first one tracked
        tracker.register(procfs.read_maps(pid))
    except OSError:
        pass
    return tracker


def _requests(parent: int):
    """The request lines of stdin until its end, or until our parent (the caller) is gone: a
    waiting snapshot is a clone of the caller and holds the pipe's write end open, so that end
    would never come after the caller's death (the caller's exit drops the snapshot first)."""
    import select
    stdin = sys.stdin.buffer
    while True:
        if not select.select([stdin], [], [], 0.5)[0]:
            if os.getppid() != parent:
                return
            continue
        line = stdin.readline()
        if not line:
            return
        yield line


def _serve(pid: int, words: list, pending: "_Pending", tracker=None):
    """The reply to one request line (module docstring), or None for a malformed one."""
    waiting = []
    if words and words[-1].startswith(b"@"):        # the requesting thread
        waiting = [int(words.pop()[1:])]
        if words[:1] in ([b"go"], [b"snap"]):
            await_wait(pid, waiting[0])
    if words[:1] == [b"go"] and len(words) in (3, 5, 6):
        limit, timeout = int(words[1]), float(words[2])
        symbolize, supp = (words[3] != b"0", words[4]) if len(words) >= 5 else (True, b"-")
        dead = parse_ranges(words[5].decode()) if len(words) == 6 else []
        return _one_check(pid, None if limit < 0 else limit, timeout, symbolize, supp, dead,
                          waiting, tracker)
    if words[:1] == [b"snap"] and len(words) in (3, 4):
        return _guarded(lambda: pending.take(pid, float(words[1]), parse_ranges(words[2].decode()),
                                             waiting, record=words[3:] == [b"1"]))
    if words[:1] == [b"base"] and len(words) == 5:
        token, limit = int(words[1]), int(words[2])
        return _guarded(lambda: pending.sweep(token, None if limit < 0 else limit,
                                              words[3] != b"0", _rules(words[4])))
    if words[:1] == [b"drop"] and len(words) <= 3 and words[2:] in ([], [b"later"]):
        tokens = [int(t) for t in words[1].split(b",")] if len(words) >= 2 else None
        return _guarded(lambda: (pending.drop_later if words[2:] else pending.drop)(tokens))
    return None


WAIT_LIMIT = 0.25


def await_wait(pid: int, tid: int, limit: float = WAIT_LIMIT) -> bool:
    """Wait (up to `limit` seconds) until the caller's thread `tid` sits in its wait for our
    reply, so that the freeze finds it there: right after writing a request it still runs
    Python code for a moment, and under load (another process on its CPU) the freeze caught
    it running in 63 of 112 checks, its registers and fresh stack holding whatever that code
    left. False when it did not get there in time or cannot be seen (the check goes on)."""
    import time
    from memunreachable.sweep.classify import WAIT_SYSCALLS      # select is pselect6 in glibc
    deadline = time.monotonic() + limit
    while True:
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall", "rb") as f:
                first = f.read().split(None, 1)[:1]
        except OSError:
            return False
        if first and first[0].isdigit() and int(first[0]) in WAIT_SYSCALLS:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.0002)


MAX_PENDING = 48


class _Pending:
    """The snapshots of "snap" requests, until their "base" or "drop" (at most MAX_PENDING:
    a newer one releases the oldest). Each gets a token, which its "base" and "drop" name."""

    def __init__(self, tracker=None) -> None:
        self.pending: Dict[int, object] = {}        # token -> deferred.Pending, oldest first
        self.token = self.recorded_token = 0
        self.tracker = tracker
        self.lacks_memory = False       # a snapshot lacked memory: plan the next ones at once
        self.dropped: list = []         # forgotten, released after the reply (drop_later)

    def take(self, pid: int, timeout: float, dead, waiting=(), record: bool = False) -> object:
        """("later", token) when the snapshot waits for a sweep; else the result of a full
        check (the snapshot could need a retake: deferred.check_later). record: its
        allocations are to be recorded (after_reply)."""
        from memunreachable.deferred import check_later
        from memunreachable.unreachable import check
        while len(self.pending) >= MAX_PENDING:
            self.drop([next(iter(self.pending))])
        # the session's first is planned at once: a process whose snapshots lack memory
        # (a library's MADV_DONTFORK buffer, mapped at import) is known before any waits
        plan_later = self.token > 0 and not self.lacks_memory
        taken = check_later(pid, timeout=timeout, dead_ranges=dead, waiting_tids=waiting,
                            tracker=self.tracker, plan_later=plan_later)
        if taken is None and not plan_later:
            self.lacks_memory = True        # or another reason to check at once: all planned
        if taken is not None:
            self.token += 1
            self.pending[self.token] = taken
            if not record:
                self.recorded_token = self.token
            return ("later", self.token)
        return check(pid, limit=None, timeout=timeout, symbolize=False, sweep_here=True,
                     dead_ranges=dead, waiting_tids=waiting, tracker=self.tracker)

    def after_reply(self) -> None:
        """Once a reply is sent (the caller's test runs meanwhile): the release of the
        snapshots a "drop" forgot; once, the record of the
        newest snapshot's allocations with the write tracker when its request asked
        (record_allocations: the sweeps after it count their fresh rule from it). A snapshot
        found to lack memory there (Pending.complete) makes the next ones planned during
        their requests (checked at once, as check_later says)."""
        self.release_dropped()
        taken = self.pending.get(self.token)
        if taken is None or self.token == self.recorded_token:
            return
        from memunreachable.deferred import record_allocations
        self.recorded_token = self.token
        record_allocations(taken)
        if taken.lacking is not None:
            self.lacks_memory = True

    def sweep(self, token: int, limit, symbolize: bool, rules):
        from memunreachable._errors import CollectionError
        from memunreachable.deferred import sweep_pending
        pending = self.pending.pop(token, None)
        if pending is None:
            raise CollectionError("that snapshot is gone: it was dropped, or more snapshots "
                                  "than the helper keeps were taken after it",
                                  hint="take a new baseline")
        return sweep_pending(pending, limit=limit, symbolize=symbolize, suppressions=rules)

    def drop(self, tokens: Optional[list] = None) -> None:
        """Release those waiting snapshots (None: every one) now."""
        self.drop_later(tokens)
        self.release_dropped()

    def drop_later(self, tokens: Optional[list] = None) -> None:
        """Forget those waiting snapshots (None: every one); release_dropped() releases them."""
        for t in list(self.pending) if tokens is None else tokens:
            pending = self.pending.pop(t, None)
            if pending is not None:
                self.dropped.append(pending)

    def release_dropped(self) -> None:
        dropped, self.dropped = self.dropped, []
        for pending in dropped:
            pending.release()


class _Warmer:
    """Fills the caches (_warm) once, when no request waits: a first request is served at
    once (a "snap" needs none of them), the warming then overlaps with the caller's work."""

    def __init__(self, pid: int) -> None:
        self.pid, self.done = pid, False

    def when_idle(self) -> None:
        import select
        if not self.done and not select.select([sys.stdin.buffer], [], [], 0)[0]:
            self.done = True
            _warm(self.pid)


def _rules(supp: bytes):
    from memunreachable.stacks.suppressions import parse
    return parse(bytes.fromhex(supp.decode()).decode()) if supp != b"-" else None


def _guarded(fn) -> tuple:
    """("ok", fn()) or ("error", MemunreachableError): every failure goes back to the caller."""
    try:
        return ("ok", fn())
    except BaseException as exc:  # noqa: BLE001
        from memunreachable._errors import MemunreachableError, SweepError
        if not isinstance(exc, MemunreachableError):
            exc = SweepError(f"in-process check failed: {type(exc).__name__}: {exc}")
        return ("error", exc)


def _run(argv=None) -> None:
    """main(), then an immediate _exit: the caller waits for our exit when it closes us (at
    its own exit), and tearing down this interpreter (the imported pipeline, the heap kept by
    _keep_freed_memory) took 30-35 ms of a pytest session's end. Nothing needs flushing: our
    results went through os.write, stdout is unused."""
    code = 70
    try:
        code = main(argv)
    except SystemExit as exc:           # argparse's usage errors
        code = exc.code if isinstance(exc.code, int) else 2
    except BaseException:  # noqa: BLE001 - shown as the interpreter would, then the exit
        import traceback
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3      # mallopt(3)


def _keep_freed_memory() -> None:
    """Every check sweeps here (check(sweep_here=True)) and frees tens of MB; let glibc keep
    them for the next one: allocations up to 32 MiB come from the heap, which is not trimmed
    below 256 MiB, and the copies of target memory are heap buffers too. A check then writes
    into pages it already has instead of faulting fresh zeroed ones in (an idle pytest
    process: 7,300 page faults a check -> 50). Not glibc (no mallopt): nothing changes."""
    import ctypes
    from memunreachable import _types
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 256 << 20)
    except (OSError, AttributeError):
        return
    _types.use_heap_buffers()


def _warm(pid: int) -> None:
    """Import the pipeline and parse the caller's malloc and Python ELF files before the first
    request (the caller may have started us early: this overlaps with its own work). Only
    caches are filled; a failure here shows up, if it matters, in the first check."""
    try:
        from memunreachable.collect import procfs
        from memunreachable.sweep.steps import warm_caches
        warm_caches(procfs.read_maps(pid), pid)
    except Exception:  # noqa: BLE001 - a cache that stays cold is only slower
        pass


def format_ranges(ranges) -> str:
    """The DEAD word of a "go" line: "BEGIN-END,..." in hex, "-" for none."""
    return ",".join(f"{b:x}-{e:x}" for b, e in ranges) or "-"


def parse_ranges(text: str) -> list:
    """[(begin, end)] of a DEAD word (format_ranges), 8-aligned inwards; [] for "-"."""
    out = []
    for part in text.split(",") if text != "-" else ():
        b, e = (int(x, 16) for x in part.split("-"))
        b, e = (b + 7) & ~7, e & ~7
        if b < e:
            out.append((b, e))
    return out


def _one_check(pid: int, limit, timeout: float, symbolize: bool = True,
               supp: bytes = b"-", dead=(), waiting=(), tracker=None) -> tuple:
    from memunreachable.unreachable import check
    # the sweep runs here, not in a forked sweeper: this helper is disposable (the caller
    # restarts one that died), and a fork costs an idle pytest process's check ~20 ms
    return _guarded(lambda: check(pid, limit=limit, timeout=timeout, symbolize=symbolize,
                                  suppressions=_rules(supp), sweep_here=True, dead_ranges=dead,
                                  waiting_tids=waiting, tracker=tracker))


if __name__ == "__main__":
    _run()
