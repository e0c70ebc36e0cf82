"""noleaks.py: the in-process API (libmemunreachable's, in Python form).

A process cannot ptrace its own threads, so in-process checks go to a helper process
(memunreachable._tracer) that runs the ordinary check pipeline against us. One helper serves
every check of the process (started on the first, restarted if it died, replaced after a
fork, closed at exit), so a check costs the pipeline, not a Python start-up. We grant it
with prctl(PR_SET_PTRACER, helper) (EINVAL: Yama absent, nothing to grant) and wait in a
blocking read, which releases the GIL and holds no allocator lock while we are frozen.

NoLeaks()/assert_no_leaks() never turn "could not check" into a verdict: that raises a
MemunreachableError. no_new_leaks() compares against a baseline taken before the block,
the reliable form in test suites (the interpreter may hold a few unreachable blocks).
One module, a little over 600 lines: the API, the helper it talks to and the scrubbing of
the stack around each request share the helper's state and its reply buffer.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import logging
import os
import pickle
import atexit
import math
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Iterator, Optional

from memunreachable._errors import LeaksDetected, OutOfMemory, SweepError
from memunreachable.collect import procfs

if TYPE_CHECKING:       # imported when a result is unpickled: after the helper started
    from memunreachable.reporters.report import UnreachableMemoryInfo

log = logging.getLogger("memunreachable")

PR_SET_PTRACER = 0x59616D61
HELPER_TIMEOUT = 120.0

__all__ = ["get_unreachable_memory", "get_unreachable_memory_string", "log_unreachable_memory",
           "NoLeaks", "assert_no_leaks", "leak_baseline", "no_new_leaks", "LeakBaseline"]


def get_unreachable_memory(limit: Optional[int] = 100, pid: Optional[int] = None,
                           timeout: float = 2.0, *, suppressions=None,
                           symbolize: bool = True, partial: bool = False) -> UnreachableMemoryInfo:
    """Check process `pid` (None: this process); keep at most `limit` entries (None: all).

    suppressions: None, the path of an LSan suppressions file ('leak:PATTERN' lines) or rules
    from memunreachable.stacks.suppressions.parse(); suppressed leaks are not reported nor counted
    (a bad file raises SuppressionsError before anything is checked).
    symbolize: False shows allocation stacks as module+offset with build-ids only.
    partial: when part of the process could not be seen, return what could be checked
    (info.complete False, info.incomplete the reasons) instead of raising IncompleteCheck."""
    from memunreachable._errors import IncompleteCheck
    from memunreachable.stacks.suppressions import as_rules
    rules = as_rules(suppressions)
    try:
        if pid is not None and pid != os.getpid():
            from memunreachable.unreachable import check
            return check(pid, limit=limit, timeout=timeout, symbolize=symbolize,
                         suppressions=rules)
        _scrub_frames()         # the frames of the check below start clean
        return _check_self(limit, timeout, symbolize, rules)
    except IncompleteCheck as exc:
        if partial and exc.info is not None:
            return exc.info
        raise


def get_unreachable_memory_string(log_contents: bool = False, limit: Optional[int] = 100,
                                  pid: Optional[int] = None, *, suppressions=None,
                                  symbolize: bool = True, partial: bool = False) -> str:
    """The same text report as `memunreachable check` (--partial with partial=True)."""
    return _render(get_unreachable_memory(limit=limit, pid=pid, suppressions=suppressions,
                                          symbolize=symbolize, partial=partial), log_contents)


def log_unreachable_memory(log_contents: bool = False, limit: Optional[int] = 100,
                           logger: Optional[logging.Logger] = None, *, suppressions=None,
                           symbolize: bool = True) -> bool:
    """Log the summary and up to `limit` leaks; False (reason logged) if the check failed."""
    from memunreachable._errors import MemunreachableError
    lg = logger or log
    try:
        text = get_unreachable_memory_string(log_contents=log_contents, limit=limit,
                                             suppressions=suppressions, symbolize=symbolize)
    except MemunreachableError as exc:
        lg.error("unreachable memory check failed: %s%s", exc,
                 f" (hint: {exc.hint})" if getattr(exc, "hint", None) else "")
        return False
    for block in text.rstrip("\n").split("\n\n"):
        lg.error("%s", block)
    return True


def NoLeaks(suppressions=None) -> bool:  # noqa: N802 - libmemunreachable's name
    """True when this process has no unreachable memory (suppressed leaks aside); False when
    it has.

    Raises MemunreachableError when the check could not run (never a verdict)."""
    return get_unreachable_memory(limit=0, suppressions=suppressions,
                                  symbolize=bool(suppressions)).num_leaks == 0


def assert_no_leaks(limit: Optional[int] = 100, log_contents: bool = True, *,
                    suppressions=None, symbolize: bool = True) -> UnreachableMemoryInfo:
    """Raise LeaksDetected (an AssertionError with the report) if anything is unreachable."""
    info = get_unreachable_memory(limit=limit, suppressions=suppressions, symbolize=symbolize)
    if info.num_leaks:
        raise LeaksDetected(info, _render(info, log_contents))
    return info


_ADDRESS_MASK = (1 << 64) - 1


class LeakBaseline:
    """The unreachable blocks present at one moment (addresses, and sizes when built from a
    check's leaks: no contents are kept, so this object never makes an old leak look
    reachable).

    The addresses are kept complemented: a set stores each key's hash next to it, and the
    hash of an int below 2**61 - 1 is the int itself, so a set of raw addresses would hold
    an aligned pointer to every old leak, which a conservative scan rightly counts as a
    reference (the old leak would then look reachable, and "new" once the set is freed).
    The hash of a complemented address is about 2**61 - address: never a user-space pointer.
    A leak recorded with its size (of()) matches only a leak of that size at that address: a
    block seen unreachable once and freed later may leave its address to a new block that
    leaks, which is new.
    """

    def __init__(self, addresses) -> None:
        self._keys = frozenset(a ^ _ADDRESS_MASK for a in addresses)
        self._sized: frozenset = frozenset()        # (complemented address, size)

    @classmethod
    def of(cls, leaks) -> "LeakBaseline":
        """The baseline of these leaks (report.Leak: address and size)."""
        out = cls(())
        out._sized = frozenset((l.address ^ _ADDRESS_MASK, l.size) for l in leaks)
        return out

    def _complemented(self) -> set:
        return set(self._keys) | {k for k, _ in self._sized}

    @property
    def addresses(self) -> tuple:
        """The baseline's leak addresses, ascending (a tuple: no hashes are stored)."""
        return tuple(sorted(k ^ _ADDRESS_MASK for k in self._complemented()))

    def __contains__(self, address: int) -> bool:
        k = address ^ _ADDRESS_MASK
        return k in self._keys or any(a == k for a, _ in self._sized)

    def new_leaks(self, info: UnreachableMemoryInfo) -> list:
        """Leaks of `info` that were not in the baseline."""
        return [l for l in info.leaks if not self.holds(l)]

    @classmethod
    def unreachable_in(cls, info: UnreachableMemoryInfo) -> "LeakBaseline":
        """The baseline of info's leaks and of the roots of its cyclic garbage."""
        return cls.of(list(info.leaks) + list(info.cyclic_garbage))

    def holds(self, leak) -> bool:
        """Whether the baseline has this leak (report.Leak) at its address."""
        k = leak.address ^ _ADDRESS_MASK
        return k in self._keys or (k, leak.size) in self._sized

    def __or__(self, other: "LeakBaseline") -> "LeakBaseline":
        """The leaks of either baseline."""
        out = LeakBaseline(())
        out._keys = self._keys | other._keys
        out._sized = self._sized | other._sized
        return out


def leak_baseline(suppressions=None) -> LeakBaseline:
    """The unreachable blocks of this process now (raises MemunreachableError if it cannot check)."""
    info = get_unreachable_memory(limit=None, suppressions=suppressions,
                                  symbolize=bool(suppressions))
    return LeakBaseline.of(info.leaks)


@contextlib.contextmanager
def no_new_leaks(log_contents: bool = True, *, suppressions=None,
                 symbolize: bool = True) -> Iterator[LeakBaseline]:
    """Fail (LeaksDetected) if unreachable blocks appear inside the with-block (leaks a
    suppression matches never fail it)."""
    from memunreachable.stacks.suppressions import as_rules
    rules = as_rules(suppressions)
    base = leak_baseline(rules)
    yield base
    info = get_unreachable_memory(limit=None, suppressions=rules, symbolize=symbolize)
    new = base.new_leaks(info)
    if new:
        new_info = _only(info, new)
        raise LeaksDetected(new_info, _render(new_info, log_contents))


def _only(info: UnreachableMemoryInfo, leaks: list) -> UnreachableMemoryInfo:
    """info reduced to `leaks` (counts, groups and the limit recomputed)."""
    import dataclasses
    from memunreachable.reporters.report import group_leaks
    total = sum(l.entry_count for l in leaks)
    size = sum(l.entry_size for l in leaks)
    groups, _ = group_leaks(leaks)
    return dataclasses.replace(info, leaks=[l for g in groups for l in g.leaks], groups=groups,
                               num_leaks=total, leak_bytes=size, truncated=0)


def _render(info: UnreachableMemoryInfo, contents: bool) -> str:
    from memunreachable.reporters.text import format_text
    return format_text(info, contents)


def _set_ptracer(pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        if err != 22:  # EINVAL: Yama is not built in, nothing to grant
            raise OSError(err, os.strerror(err), "prctl(PR_SET_PTRACER)")


def helper_env(env) -> Optional[dict]:
    """The helper's environment: None (ours) unless bytecode writing is off here
    (PYTHONDONTWRITEBYTECODE, set by some CI images and containers). The helper then writes the
    bytecode of what it imports to memunreachable's own cache directory (PYTHONPYCACHEPREFIX;
    never next to the sources): an install without .pyc files recompiled the pipeline's
    modules at every start of a helper, 70 ms of a 10-test pytest session's 0.85 s here. An
    empty MEMUNREACHABLE_SYMCACHE_DIR (no disk cache) or a prefix already chosen by the user
    keeps the environment unchanged."""
    if not env.get("PYTHONDONTWRITEBYTECODE") or env.get("PYTHONPYCACHEPREFIX") \
            or env.get("MEMUNREACHABLE_SYMCACHE_DIR") == "":
        return None
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    prefix = os.path.join(base, "memunreachable", "pycache")
    try:
        os.makedirs(prefix, exist_ok=True)
    except OSError:
        return None
    if not os.access(prefix, os.W_OK | os.X_OK):
        return None
    out = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out["PYTHONPYCACHEPREFIX"] = prefix
    return out


def _supp_word(rules) -> str:
    """The SUPPRESSIONS word of a request line (_tracer.py): the hex of the rules as an LSan
    suppressions text, "-" for none."""
    return "\n".join(f"leak:{r.template}" for r in rules).encode().hex() or "-"


def _tracking_fd() -> int:
    """A userfaultfd of this process for the helper's write tracking (written.py); -1 when the
    kernel has none to give or MEMUNREACHABLE_WRITE_TRACKING=0."""
    if os.environ.get("MEMUNREACHABLE_WRITE_TRACKING", "1") == "0":
        return -1
    from memunreachable.sweep.written import open_fd
    fd, why = open_fd()
    if fd < 0:
        log.debug("%s", why)
    return fd


def _reap_clones() -> None:
    """After the helper died: its snapshot clones, zombies of this process, reaped here."""
    from memunreachable.collect import leftovers
    try:
        n = leftovers.reap_in_target()
    except Exception as exc:   # noqa: BLE001 - the helper's error is the one to raise
        log.warning("reaping the dead helper's snapshot processes failed: %s", exc)
        return
    if n:
        log.info("reaped %d snapshot process(es) the dead helper left", n)


class _Helper:
    """The long-lived helper process of this process, and the pipes to it."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        rfd, wfd = os.pipe2(os.O_CLOEXEC)
        cmd = [sys.executable, "-m", "memunreachable._tracer", "--pid", str(self.owner),
               "--fd", str(wfd)]
        # our memory's write tracking (written.py): the userfaultfd is ours, the helper keeps it
        uffd = _tracking_fd()
        if uffd >= 0:
            cmd += ["--uffd", str(uffd)]
        # an unbuffered stdin: a BufferedWriter's 4 KiB buffer is a raw block of this process
        # whose unwritten bytes (stale words of its earlier users) kept a leak reachable in 4 of
        # 14 runs of test_plugin's real-extension suite (MEMUNREACHABLE_EXPLAIN)
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE,
                                         pass_fds=(wfd,) + ((uffd,) if uffd >= 0 else ()),
                                         close_fds=True, bufsize=0, env=helper_env(os.environ))
        except BaseException:
            os.close(rfd)
            raise
        finally:
            os.close(wfd)
            if uffd >= 0:
                os.close(uffd)
        self.rfd = rfd
        try:
            _set_ptracer(self.proc.pid)
        except BaseException:
            self.close()
            raise
        # the replies' classes, imported while the helper starts (before its first check:
        # an import's cyclic garbage is then seen by that check, not by a later one)
        from memunreachable.reporters import report  # noqa: F401

    def alive(self) -> bool:
        return self.proc.poll() is None and self.owner == os.getpid()

    # Returns the pickled message of one check; raises SweepError when the helper died or
    # did not answer within HELPER_TIMEOUT (it is then closed: the next check starts anew).
    def run(self, limit: Optional[int], timeout: float, symbolize: bool = True,
            rules=(), collect: bool = True) -> bytes:
        if collect:     # unreachable reference cycles are not leaks: the cyclic GC frees them
            gc.collect()
        from memunreachable._tracer import format_ranges
        return self.request(lambda: f"go {-1 if limit is None else limit} {timeout} "
                                    f"{int(symbolize)} {_supp_word(rules)} "
                                    f"{format_ranges(_idle_altstack())}")

    # Returns the pickled reply to one request line (_tracer.py; a view of _REPLY) made by
    # line() and sent by _send_and_wait; raises SweepError as run() does, OutOfMemory when
    # the OOM killer took the helper (it sweeps from copies of our heap).
    def request(self, line) -> memoryview:
        oom_kills = procfs.oom_kills()
        try:
            _send_and_wait(self.proc.stdin.fileno(),
                           f"{line()} @{threading.get_native_id()}\n".encode(), self.rfd)
            size = struct.unpack("<Q", _read_exactly(self.rfd, 8, HELPER_TIMEOUT))[0]
            data = _read_exactly(self.rfd, size, HELPER_TIMEOUT)
        except (OSError, EOFError, SweepError) as exc:
            self.close()
            _reap_clones()
            if self.proc.returncode == -signal.SIGKILL and procfs.oom_killed_since(oom_kills):
                raise OutOfMemory(f"the helper process {self.proc.pid}") from None
            raise SweepError(f"the helper process failed ({exc}); exit status "
                             f"{self.proc.returncode}",
                             hint="run `python -m memunreachable check <pid>` from a shell to "
                                  "see why") from None
        return data

    def close(self) -> None:
        """End the helper (end of its stdin), reap it, drop our grant. Idempotent."""
        if self.rfd < 0:
            return
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=HELPER_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.rfd)
        self.rfd = -1
        with contextlib.suppress(OSError):
            _set_ptracer(0)


_HELPER: Optional[_Helper] = None
_CONFIRMED = LeakBaseline(())       # the leaks of the last check that ran gc.collect() first
_HELPER_LOCK = threading.Lock()


def _close_helper() -> None:
    global _HELPER
    if _HELPER is not None and _HELPER.owner == os.getpid():
        # a waiting snapshot (deferred_baseline) is a clone of us holding the helper's stdin
        # open: the end of stdin reaches the helper only once it released that snapshot
        if _HELPER.alive():
            with contextlib.suppress(SweepError):
                _HELPER.request(lambda: "drop")
        _HELPER.close()
    _HELPER = None


def _forget_helper_in_child() -> None:
    """After fork: the parent's helper checks the parent; the child starts its own."""
    global _HELPER
    if _HELPER is not None:
        with contextlib.suppress(OSError):
            os.close(_HELPER.rfd)
        with contextlib.suppress(OSError, ValueError):
            os.close(_HELPER.proc.stdin.fileno())
    _HELPER = None


atexit.register(_close_helper)
os.register_at_fork(after_in_child=_forget_helper_in_child)


def _ensure_helper() -> "_Helper":
    """This process's live helper, started (or restarted) when needed. Caller holds the lock."""
    global _HELPER
    if _HELPER is None or not _HELPER.alive():
        if _HELPER is not None and _HELPER.owner == os.getpid():
            _HELPER.close()
        _HELPER = _Helper()
    return _HELPER


def start_helper() -> None:
    """Start this process's helper now, so that its start-up (imports, parsing libc's and
    libpython's ELF files) overlaps with the caller's own work instead of the first check.
    Raises what starting it raises (OSError); checks start it anyway when it is absent."""
    with _HELPER_LOCK:
        _ensure_helper()


def _check_self(limit: Optional[int], timeout: float, symbolize: bool = True,
                rules=()) -> UnreachableMemoryInfo:
    with _HELPER_LOCK:
        info = _ask_helper(limit, timeout, symbolize, rules, collect=False)
        if _needs_collected(info):
            info = None     # before the next check: its leaks' addresses are ints (handles)
            info = _collected_check(limit, timeout, symbolize, rules)
        return info


# Returns the result of a check that ran gc.collect() first; records its leaks as confirmed.
# The caller drops the result of the check before it first: its leaks' addresses are ints,
# which hold native blocks as handles do (ctypes' c_void_p results: mu_types.h) and would hide
# them from this check. Caller holds _HELPER_LOCK.
def _collected_check(limit: Optional[int], timeout: float, symbolize: bool, rules):
    global _CONFIRMED
    info = _ask_helper(limit, timeout, symbolize, rules, collect=True)
    if not info.truncated:
        _CONFIRMED = LeakBaseline.of(info.leaks)
    return info


# Whether info may differ from the result of a check that ran gc.collect() first. A full
# gc.collect() costs 5-15 ms in a test process (more with more objects) and has nothing to
# free after most tests: check first, and collect and check again only when the check found
# what a collection may change (cyclic garbage, or a leak no collected check reported
# before). When it found nothing new, collecting first could not have changed the verdict:
# the cyclic GC only frees garbage. Caller holds _HELPER_LOCK.
def _needs_collected(info) -> bool:
    return bool(info.num_cyclic_garbage or info.truncated or _CONFIRMED.new_leaks(info))


# Returns the helper's UnreachableMemoryInfo (a new helper is tried once when one died); raises
# what the check raised. Caller holds _HELPER_LOCK.
def _ask_helper(limit: Optional[int], timeout: float, symbolize: bool, rules,
                collect: bool) -> UnreachableMemoryInfo:
    return _reply(lambda h: h.run(limit, timeout, symbolize, rules, collect))


# Returns the VALUE of the helper's ("ok", VALUE) reply to ask(helper) (a new helper is tried
# once when one died); raises the error of an ("error", ...) reply. Caller holds _HELPER_LOCK.
def _reply(ask, retry: bool = True):
    global _HELPER
    for attempt in (1, 2):
        helper = _ensure_helper()
        try:
            data = ask(helper)
            break
        except SweepError as exc:
            _HELPER = None
            # a new helper would copy the same heap: out of memory again
            if attempt == 2 or not retry or isinstance(exc, OutOfMemory):
                raise
    kind, payload = pickle.loads(data)
    _clear_reply(data)
    del data
    if kind == "error":
        raise payload
    return payload


class DeferredBaseline:
    """A leak_baseline() whose sweep waits in the helper until it is needed (deferred_baseline):
    resolve() sweeps it (or returns the baseline a full check gave at once), drop() forgets it.
    A check after it that finds no leak outside the session's known ones never needs it, and
    the test costs one sweep instead of two. Several may wait (the pytest plugin's batches);
    the helper's restart, or more than it keeps (_tracer.MAX_PENDING) taken after this one,
    makes resolve() raise (the helper names each snapshot by a token).
    unreachable(): the baseline with the roots of the cyclic garbage too (a block of a leak
    that garbage still held at this moment is unreachable all the same)."""

    def __init__(self, helper, rules, resolved: Optional[LeakBaseline] = None,
                 token: int = 0, unreachable: Optional[LeakBaseline] = None) -> None:
        self._helper, self._rules, self._resolved = helper, rules, resolved
        self._token = token
        self._unreachable = unreachable if unreachable is not None else resolved

    @property
    def waiting(self) -> bool:
        return self._resolved is None and self._helper is not None

    def resolve(self) -> LeakBaseline:
        if self._resolved is None:
            if self._helper is None:
                raise SweepError("this baseline was dropped", hint="take a new one")
            rules, helper, self._helper = self._rules, self._helper, None
            supp = _supp_word(rules)
            with _HELPER_LOCK:
                if helper is not _HELPER or not helper.alive():
                    raise SweepError("the helper process that held this baseline's snapshot "
                                     "was replaced", hint="take a new baseline")
                info = _reply(lambda h: h.request(
                    lambda: f"base {self._token} -1 {int(bool(rules))} {supp}"), retry=False)
            self._resolved = LeakBaseline.of(info.leaks)
            self._unreachable = LeakBaseline.unreachable_in(info)
        return self._resolved

    def unreachable(self) -> LeakBaseline:
        """The leaks and the cyclic garbage's roots of this moment (resolve() if needed)."""
        self.resolve()
        return self._unreachable

    def drop(self) -> None:
        """Release the waiting snapshot (a no-op when there is none)."""
        drop_all([self])


def drop_all(baselines, later: bool = False) -> None:
    """Release the waiting snapshots of these DeferredBaselines, in one request to the helper
    (a no-op for those that wait no more); later: the helper releases them once it has
    replied (the pytest plugin's batches: ten snapshots' teardown, 14 ms)."""
    waiting = []
    for b in baselines:
        helper, b._helper = b._helper, None
        if helper is not None and b._resolved is None:
            waiting.append((helper, b._token))
    with _HELPER_LOCK:
        tokens = [t for helper, t in waiting if helper is _HELPER]
        if tokens and _HELPER.alive():
            _reply(lambda h: h.request(lambda: "drop " + ",".join(map(str, tokens))
                                       + (" later" if later else "")), retry=False)


def deferred_baseline(suppressions=None, timeout: float = 2.0,
                      record: bool = False) -> DeferredBaseline:
    """leak_baseline(), with its sweep deferred: the snapshot is taken now (the same pause) and
    swept only if resolve() is called. When the snapshot could need a retake (a thread inside
    malloc/free, memory a snapshot lacks) the helper checks at once instead. record: the
    helper then records its allocations with the write tracker, as a sweep would (the later
    checks' fresh rule counts from it: the pytest plugin's batches, whose checks after the
    tests' bodies are such snapshots). Raises MemunreachableError when the snapshot cannot be
    taken."""
    from memunreachable._tracer import format_ranges
    from memunreachable.stacks.suppressions import as_rules
    rules = as_rules(suppressions)
    _scrub_frames()         # the frames of the check below start clean
    with _HELPER_LOCK:
        value = _reply(lambda h: h.request(lambda: f"snap {timeout} "
                                                   f"{format_ranges(_idle_altstack())} "
                                                   f"{int(record)}"))
        if isinstance(value, tuple) and value[:1] == ("later",):
            return DeferredBaseline(_HELPER, rules, token=value[1])
        info, value = value, None
        if _needs_collected(info):
            info = None     # before the next check: its leaks' addresses are ints (handles)
            info = _collected_check(None, timeout, bool(rules), rules)
    return DeferredBaseline(None, rules, LeakBaseline.of(info.leaks),
                            unreachable=LeakBaseline.unreachable_in(info))


SS_ONSTACK, SS_DISABLE = 1, 2
_LIBC = None


class _StackT(ctypes.Structure):
    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int),
                ("ss_size", ctypes.c_size_t)]


def _idle_altstack() -> list:
    """[(begin, end)] of this thread's alternate signal stack when it has one and is not running
    on it, else []. It holds no live reference then, only stale bytes: faulthandler's (which
    pytest enables) is a 16 KiB heap block whose old words kept leaked blocks reachable
    (MEMUNREACHABLE_EXPLAIN); the check treats it as dead."""
    global _LIBC
    st = _StackT()
    try:
        _LIBC = _LIBC or ctypes.CDLL(None, use_errno=True)
        if _LIBC.sigaltstack(None, ctypes.byref(st)) != 0:
            return []
    except (OSError, AttributeError):
        return []
    if st.ss_flags & (SS_ONSTACK | SS_DISABLE) or not st.ss_sp or not st.ss_size:
        return []
    return [(st.ss_sp, st.ss_sp + st.ss_size)]


SCRUB_BYTES = 64 * 1024
SCRUB_SLOTS = 1024


# Calling _scrub_frames writes SCRUB_SLOTS NULLs where the next calls' frames will live
# (CPython initializes a frame's locals; 3.11+ frames live in the thread's frame data stack):
# a frame's stack slots are not written before use, and the check's own frames would
# otherwise keep the stale pointers of the frames that ran there before (a test's own).
# Its locals are only assigned in dead code: the compiler counts them, the body does nothing.
exec("def _scrub_frames():\n    if False:\n        "
     + " = ".join(f"v{i}" for i in range(SCRUB_SLOTS)) + " = None\n")
READ_BYTES = 64 * 1024


def _scrub_stack() -> None:
    from memunreachable._ffi import lib
    lib.mu_scrub_stack(SCRUB_BYTES)


def _send_and_wait(wfd: int, line: bytes, rfd: int) -> None:
    """Write the request line to the helper and wait until its reply can be read, in one C
    call that first zeroes the stack below it: dead frames of functions that returned (a C
    extension's malloc'ing call, say) may hold pointers exactly where the wait's frames live,
    and the helper freezes this thread in that call (or in the write, when it reads the line
    first) and scans its stack from SP up. Nothing runs between the zeroing and the freeze but
    the write and the poll; before, the Python code that wrote the line and then waited ran
    after the zeroing, and the helper could freeze it anywhere in that code."""
    from memunreachable._ffi import ffi, lib
    rc = lib.mu_request_wait(wfd, ffi.from_buffer(line), len(line), rfd,
                             int(HELPER_TIMEOUT * 1000), SCRUB_BYTES)
    if rc == -errno.ETIMEDOUT:
        raise SweepError(f"the in-process check did not finish within {HELPER_TIMEOUT:.0f} s")
    if rc < 0:
        raise OSError(-rc, os.strerror(-rc))


# The replies are read into this buffer, kept for the process's life and grown when needed:
# a reply read into a fresh bytes object (a few KB: a glibc block) was freed right after its
# unpickling, and a test's next block of that size took its address, while the check's own
# frames, at the same stack depths at every check, could still hold copies of it.
_REPLY = bytearray(64 * 1024)
_ZEROS = bytes(len(_REPLY))     # what a read reply is cleared with (_clear_reply)


def _clear_reply(data: memoryview) -> None:
    """Zero a reply once unpickled: it holds the addresses and first bytes of the leaks it
    reported, which the next check would scan in the kept buffer (no allocation here: a
    temporary's address is what the buffer exists to keep out of the check's frames)."""
    data[:] = memoryview(_ZEROS)[:len(data)]


def _read_exactly(fd: int, n: int, timeout: float) -> memoryview:
    """n bytes from fd within timeout, as a view of _REPLY (valid until the next read: the
    caller holds _HELPER_LOCK); EOFError when the writer went away first. Called once the
    reply can be read (_send_and_wait), when the check's freeze is over."""
    global _REPLY, _ZEROS
    if n > len(_REPLY):
        _REPLY = bytearray(max(n, 2 * len(_REPLY)))
        _ZEROS = bytes(len(_REPLY))
    view, got = memoryview(_REPLY), 0
    deadline = time.monotonic() + timeout
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SweepError(f"the in-process check did not finish within {timeout:.0f} s")
        if not poller.poll(math.ceil(left * 1000)):
            continue
        # 64 KiB reads at most (READ_BYTES), into the buffer: no read buffer is allocated
        k = os.readv(fd, [view[got:got + min(READ_BYTES, n - got)]])
        if not k:
            raise EOFError("the helper process closed its result pipe")
        got += k
    return view[:n]
