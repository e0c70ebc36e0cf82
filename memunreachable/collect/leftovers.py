"""leftovers.py: no snapshot process left behind: the per-target lock and the clone record.

One check of process P runs inside `with guard(P):` (unreachable.check()). The guard
  1. catches SIGINT/SIGTERM/SIGHUP for the whole check (interrupts.interruptible()): a signal
     becomes FreezeInterrupted, which unwinds through every release (thaw, snapshot kill +
     reap, sweeper kill); the CLI then dies by that signal;
  2. takes the per-target lock: flock(LOCK_EX) on RUN_DIR/<P>-<start>.json, where <start> is
     P's start time (clock ticks since boot, /proc/P/stat field 22), so a reused pid is
     another file. An overlapping check of P waits up to `lock_wait` seconds, then fails with
     CollectionError naming the other checker's pid;
  3. keeps a record of every snapshot clone that may outlive the checker in that same file:
     the injection window (written just before a clone is injected) and the clone's pid and
     start time (written right after). The file is one page rewritten by one pwrite, so a
     SIGKILL leaves the old record or the new one, never half of one;
  4. on leaving (every path), releases every snapshot still registered (kill, then reap in
     the target), rewrites the record and drops the file when nothing is left in it.
After a SIGKILL of the checker the kernel kills its clone (PTRACE_O_EXITKILL) and the clone
stays a zombie of P. The record survives, so the next check of P finds it:
snapshot.reap_leftovers() reaps, while P is frozen anyway, every child of P that the record
names (or that was born inside a recorded injection window) and that still has exit_signal 0
(field 38). A clone(0) child that the program made itself is never touched.

RUN_DIR: /run/memunreachable for root, else $XDG_RUNTIME_DIR/memunreachable, else
/tmp/memunreachable-<uid>; it must be a directory of ours, mode 0700. When none is usable,
checks run without lock and record (overlapping checks then fail at PTRACE_SEIZE: EPERM).
References: flock(2), proc(5) (/proc/PID/stat, /proc/PID/task/TID/children), clone(2).
"""
from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import stat as stat_mod
import threading
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Tuple

from memunreachable.collect import procfs
from memunreachable._errors import CollectionError, NoSuchProcess
from memunreachable._types import Fields, FrozenFields, set_fields
from memunreachable.collect.interrupts import critical, interruptible

log = logging.getLogger("memunreachable")

LOCK_WAIT = 30.0                # seconds an overlapping check of one process waits
PAGE = 4096                     # the record is rewritten in one pwrite of whole pages
VERSION = 1
HZ = os.sysconf("SC_CLK_TCK")   # unit of /proc/PID/stat starttime


ProcStat = procfs.Stat      # the /proc/PID/stat fields used here: pid, state, ppid, start, exit_signal


def read_stat(pid: int) -> Optional[ProcStat]:
    """/proc/PID/stat parsed (procfs.parse_stat), or None when the process is gone."""
    try:
        return procfs.read_stat(pid)
    except (NoSuchProcess, OSError, ValueError):
        return None


def tracer_of(pid: int) -> int:
    """TracerPid of pid (0: not traced, or gone)."""
    try:
        return procfs.read_status(pid).tracer_pid
    except (NoSuchProcess, OSError, ValueError):
        return 0


def now_ticks() -> int:
    """Now, in the unit and clock of /proc/PID/stat starttime (CLOCK_BOOTTIME ticks)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * HZ)


def children_of(pid: int) -> List[int]:
    """pids whose parent is process pid (zombies included), from /proc/PID/task/*/children,
    or a scan of /proc when the kernel lacks CONFIG_PROC_CHILDREN."""
    out: List[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    try:
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    out += [int(c) for c in f.read().split()]
            except FileNotFoundError:
                if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                    continue            # a thread that ended meanwhile
                raise
        return out
    except FileNotFoundError:
        pass
    return [int(e) for e in os.listdir("/proc") if e.isdigit()
            and (st := read_stat(int(e))) is not None and st.ppid == pid]


class Clone(FrozenFields):
    __slots__ = ("pid", "start")

    def __init__(self, pid: int, start: int):
        set_fields(self, pid, start)


class Record(Fields):
    """What the file of one target holds (JSON, padded with spaces to whole pages)."""
    __slots__ = ("target", "target_start", "checker", "checker_start", "clones", "windows")

    def __init__(self, target: int, target_start: int, checker: int = 0, checker_start: int = 0,
                 clones: Optional[List[Clone]] = None,
                 # [first, last] tick of an injection
                 windows: Optional[List[Tuple[int, int]]] = None):
        self.target = target
        self.target_start = target_start
        self.checker = checker
        self.checker_start = checker_start
        self.clones = [] if clones is None else clones
        self.windows = [] if windows is None else windows

    @property
    def empty(self) -> bool:
        return not self.clones and not self.windows

    def encode(self) -> bytes:
        data = json.dumps({"version": VERSION, "target": self.target,
                           "target_start": self.target_start, "checker": self.checker,
                           "checker_start": self.checker_start,
                           "clones": [[c.pid, c.start] for c in self.clones],
                           "windows": [list(w) for w in self.windows]}).encode()
        return data + b" " * (-len(data) % PAGE)


# Returns the Record in data, or None when data is empty or not a record of ours (a
# half-written file cannot happen: see the module docstring; garbage is ignored).
def decode_record(data: bytes) -> Optional[Record]:
    try:
        obj = json.loads(data.decode("utf-8").strip() or "null")
        if not isinstance(obj, dict) or obj.get("version") != VERSION:
            return None
        return Record(target=int(obj["target"]), target_start=int(obj["target_start"]),
                      checker=int(obj.get("checker", 0)),
                      checker_start=int(obj.get("checker_start", 0)),
                      clones=[Clone(int(p), int(s)) for p, s in obj.get("clones", [])],
                      windows=[(int(a), int(b)) for a, b in obj.get("windows", [])])
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError):
        return None


# Returns [(pid, ProcStat)] of the children of `target` that an earlier check left: named
# in `inherited` with the same start time, or born inside one of the recorded injection
# `windows`; in both cases still a child of target with exit_signal 0 (clone(flags=0)).
# Pure: `stats` maps every child pid of target to its ProcStat.
def match_leftovers(target: int, stats: Dict[int, ProcStat], inherited: List[Clone],
                    windows: List[Tuple[int, int]]) -> List[Tuple[int, ProcStat]]:
    named = {(c.pid, c.start) for c in inherited}
    out = []
    for pid, st in sorted(stats.items()):
        if st.ppid != target or st.exit_signal != 0:
            continue
        if (pid, st.start) in named or any(lo <= st.start <= hi for lo, hi in windows):
            out.append((pid, st))
    return out


def _run_dir_candidates(uid: int) -> Iterator[str]:
    if uid == 0:
        yield "/run/memunreachable"
    if os.environ.get("XDG_RUNTIME_DIR"):
        yield os.path.join(os.environ["XDG_RUNTIME_DIR"], "memunreachable")
    import tempfile         # only when the others are not usable (issue 10, fast start)
    yield os.path.join(tempfile.gettempdir(), f"memunreachable-{uid}")


def run_dir() -> Optional[str]:
    """The directory of the lock/record files (created 0700), or None when none is usable."""
    uid = os.geteuid()
    for d in _run_dir_candidates(uid):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        except OSError:
            continue
        try:
            st = os.lstat(d)
        except OSError:
            continue
        if stat_mod.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077:
            return d
        log.debug("not using %s for check locks: not a private directory of uid %d", d, uid)
    return None


class Session:
    """The lock, the record and the live snapshots of one check of one target."""

    def __init__(self, pid: int, start: int, path: str, fd: int, previous: Optional[Record]):
        self.pid = pid
        self.start = start
        self.path = path
        self.fd = fd
        me = read_stat(os.getpid())
        self.checker_start = me.start if me else 0
        # what earlier checks left: reaped by snapshot.reap_leftovers() at the next freeze
        self.inherited: List[Clone] = list(previous.clones) if previous else []
        self.windows: List[Tuple[int, int]] = list(previous.windows) if previous else []
        self.own: List[Clone] = []                  # clones of this check not reaped yet
        self.injecting: Optional[Tuple[int, int]] = None
        self.snapshots: list = []                   # live Snapshot objects (release() on exit)
        self.thread = threading.get_ident()         # the thread whose guard opened it
        self.holders = 0                            # the guards open on it (guard())
        self.size = 0
        self.write()

    @property
    def record(self) -> Record:
        return Record(target=self.pid, target_start=self.start, checker=os.getpid(),
                      checker_start=self.checker_start, clones=self.inherited + self.own,
                      windows=self.windows + ([self.injecting] if self.injecting else []))

    def write(self) -> None:
        data = self.record.encode()
        if len(data) < self.size:
            data += b" " * (self.size - len(data))
        try:
            os.pwrite(self.fd, data, 0)
            self.size = len(data)
        except OSError as exc:
            log.warning("cannot update the check record %s: %s", self.path, exc)

    def close(self) -> None:
        """Release every snapshot still live, save or drop the record, unlock."""
        for snap in list(self.snapshots):
            try:
                snap.release()
            except BaseException as exc:  # noqa: BLE001 - the lock must be released
                log.warning("releasing the snapshot process %d failed: %s", snap.pid, exc)
        self.injecting = None
        try:
            if self.record.empty:
                os.unlink(self.path)        # before the unlock: see _lock()
            else:
                self.write()
                log.info("check record %s keeps snapshot process(es) %s to reap",
                         self.path, [c.pid for c in self.record.clones])
        except OSError:
            pass
        os.close(self.fd)


_SESSIONS: Dict[int, Session] = {}


def session(pid: int) -> Optional[Session]:
    """The session of the check of pid running in this process, or None."""
    return _SESSIONS.get(pid)


def _holder(path: str) -> str:
    try:
        with open(path, "rb") as f:
            rec = decode_record(f.read(PAGE))
        if rec is not None and rec.checker:
            return f"pid {rec.checker}"
    except OSError:
        pass
    return "pid unknown"


# Returns an fd holding flock(LOCK_EX) on path, the file path names right now (a holder
# unlinks an empty record before it unlocks: a waiter that got the lock on the unlinked
# inode retries on the new file). Raises CollectionError after lock_wait seconds.
def _lock(path: str, pid: int, lock_wait: float) -> int:
    deadline = time.monotonic() + lock_wait
    waited = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not waited:
                        log.info("another check of process %d is running (%s); waiting for it",
                                 pid, _holder(path))
                        waited = True
                    if time.monotonic() >= deadline:
                        raise CollectionError(
                            f"another memunreachable check ({_holder(path)}) is running on "
                            f"process {pid}; gave up after waiting {lock_wait:g} s",
                            hint="checks of one process run one at a time: wait for the "
                                 "other check to finish, then run this one again") from None
                    time.sleep(0.01)
            here = os.fstat(fd)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (here.st_dev, here.st_ino):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _open(pid: int, lock_wait: float) -> Optional[Session]:
    target = read_stat(pid)
    if target is None:
        return None                 # preflight says why
    directory = run_dir()
    if directory is None:
        log.info("no private directory for check locks; overlapping checks are not serialized")
        return None
    path = os.path.join(directory, f"{pid}-{target.start}.json")
    fd = _lock(path, pid, lock_wait)
    try:
        previous = decode_record(os.pread(fd, 16 * PAGE, 0))
        if previous is not None and (previous.target, previous.target_start) != (pid, target.start):
            previous = None
        if previous is not None and not previous.empty:
            log.info("the last check of process %d (pid %d) left a record: clones %s",
                     pid, previous.checker, [c.pid for c in previous.clones])
        return Session(pid, target.start, path, fd, previous)
    except BaseException:
        os.close(fd)
        raise


# Runs the body as one check of pid (lock_wait None: LOCK_WAIT): signals handled for its whole
# duration, the per-target lock held, every snapshot registered by note_clone() released on
# every exit path (by the last open guard of pid, when nested in this process). Yields
# the Session (None: no such process, or no usable RUN_DIR). Raises CollectionError when
# another check of pid held the lock for lock_wait seconds, FreezeInterrupted on a signal.
@contextmanager
def guard(pid: int, lock_wait: Optional[float] = None) -> Iterator[Optional[Session]]:
    with interruptible():
        sess = _SESSIONS.get(pid)
        if sess is None or sess.thread != threading.get_ident():
            sess = _open(pid, LOCK_WAIT if lock_wait is None else lock_wait)
            if sess is None:
                yield None
                return
            _SESSIONS[pid] = sess
        # else nested in an open guard of this thread (a check, or another snapshot, while
        # snapshots of deferred.check_later wait): its lock and record serve, and the
        # last guard to end closes it, whichever opened it
        sess.holders += 1
        try:
            yield sess
        finally:
            sess.holders -= 1
            if not sess.holders:
                with critical():
                    try:
                        sess.close()
                    finally:
                        _SESSIONS.pop(pid, None)


def guarded(check):
    """Decorator: run check(pid, ...) inside guard(pid) (unreachable.check uses it)."""
    @functools.wraps(check)
    def wrapper(pid: int, *args, **kwargs):
        with guard(pid):
            return check(pid, *args, **kwargs)
    return wrapper


# ---- called by snapshot.py (no-ops outside a guard)

def note_injection(pid: int, timeout: float) -> None:
    """A clone injection into pid starts now and ends within timeout: record the window."""
    sess = _SESSIONS.get(pid)
    if sess is None:
        return
    t = now_ticks()
    sess.injecting = (t - 1, t + int((timeout + 1.0) * HZ) + 1)
    sess.write()


def note_clone(pid: int, child: int, snap=None) -> None:
    """The injection ended; child > 0 is the new clone (registered for release on exit)."""
    sess = _SESSIONS.get(pid)
    if sess is None:
        return
    sess.injecting = None
    if child > 0:
        st = read_stat(child)
        sess.own.append(Clone(child, st.start if st else 0))
        if snap is not None:
            sess.snapshots.append(snap)
    sess.write()


def note_released(snap, reaped: bool) -> None:
    """snap was killed; reaped: its zombie is gone too (else the record keeps it)."""
    sess = _SESSIONS.get(snap.target_pid)
    if sess is None:
        return
    if snap in sess.snapshots:
        sess.snapshots.remove(snap)
    if reaped:
        sess.own = [c for c in sess.own if c.pid != snap.pid]
    sess.write()


# Returns [(pid, ProcStat)] of the leftover clones of target (see match_leftovers), from the
# record the session inherited; [] outside a guard or when nothing was inherited.
def find_leftovers(pid: int) -> List[Tuple[int, ProcStat]]:
    sess = _SESSIONS.get(pid)
    if sess is None or (not sess.inherited and not sess.windows):
        return []
    stats = {c: st for c in children_of(pid) if (st := read_stat(c)) is not None}
    return match_leftovers(pid, stats, sess.inherited, sess.windows)


__WALL = 0x40000000             # wait for a child of any exit signal (a clone's is 0)


def reap_in_target(wait: float = 2.0, lock_wait: float = 1.0) -> int:
    """In a process whose in-process checks' helper died: reap the snapshot clones it left
    as zombies of this process (the kernel kills a clone with its tracer, PTRACE_O_EXITKILL;
    the OOM killer may have taken it first). A process reaps its own children with waitpid,
    without ptrace. Only the children the record names (or born in a recorded injection
    window) with exit_signal 0 are touched, once they are zombies (up to `wait` seconds for
    one still dying). Returns how many were reaped. Raises CollectionError when another
    check of this process holds its lock for lock_wait seconds (that check reaps them)."""
    pid = os.getpid()
    sess = _open(pid, lock_wait)        # the dead helper's lock is free
    if sess is None:
        return 0
    reaped = 0
    try:
        stats = {c: st for c in children_of(pid) if (st := read_stat(c)) is not None}
        left = []
        for child, st in match_leftovers(pid, stats, sess.inherited, sess.windows):
            deadline = time.monotonic() + wait
            while st is not None and st.state != "Z" and time.monotonic() < deadline:
                time.sleep(0.01)
                st = read_stat(child)
            if st is not None and st.state != "Z":
                left.append(Clone(child, st.start))
                continue
            try:
                if os.waitpid(child, os.WNOHANG | __WALL)[0] == child:
                    reaped += 1
            except ChildProcessError:
                pass                    # reaped by someone else meanwhile
        sess.inherited, sess.windows = left, []
    finally:
        sess.close()
    return reaped


def settle_leftovers(pid: int, left: List[Clone]) -> None:
    """After a reaping pass: only `left` (not reaped) stays in the record; windows resolved."""
    sess = _SESSIONS.get(pid)
    if sess is not None and (sess.inherited != list(left) or sess.windows):
        sess.inherited = list(left)
        sess.windows = []
        sess.write()
