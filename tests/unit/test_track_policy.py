"""track_pid / inject policy on in-memory data: which targets are refused before any ptrace
(musl, static, no loader), which seccomp rules forbid the load, and the lines `track` prints."""
from __future__ import annotations

import pytest

from memunreachable.collect import inject, seccomp as sc
from memunreachable import track_pid
from memunreachable._errors import UnsupportedTarget
from memunreachable._types import Mapping
from memunreachable.cli.track import describe

LIBC, LD = "/usr/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib64/ld-linux-x86-64.so.2"
MUSL = "/lib/ld-musl-x86_64.so.1"


def maps(*paths):
    return [Mapping(0x1000 * (i + 1) << 20, (0x1000 * (i + 1) << 20) + 0x1000, "r-xp", 0, "08:01",
                    i + 1, p) for i, p in enumerate(("/usr/bin/prog",) + paths)]


def test_refusals_before_any_ptrace():
    track_pid.refuse_unloadable(0, maps(LIBC, LD))          # glibc, dynamic: no refusal
    with pytest.raises(UnsupportedTarget, match="runs on musl libc, not glibc") as e:
        track_pid.refuse_unloadable(0, maps(MUSL))
    assert e.value.hint == "`memunreachable check` still finds its leaks, without allocation stacks"
    with pytest.raises(UnsupportedTarget, match=r"is a static executable \(/usr/bin/prog\)"):
        track_pid.refuse_unloadable(0, maps())
    with pytest.raises(UnsupportedTarget, match=r"allocates with libjemalloc.so.2, not glibc"):
        track_pid.refuse_unloadable(0, maps(LIBC, LD, "/usr/lib/libjemalloc.so.2"))
    with pytest.raises(UnsupportedTarget, match=r"has no dynamic loader \(ld-linux\) mapped"):
        track_pid.refuse_unloadable(0, maps(LIBC))
    assert inject.mapped_paths(maps(LIBC, LD, LIBC), lambda p: "lib" in p) == [LIBC, LD]
    assert track_pid.loaded_library(maps(LIBC, "/opt/mu/memunreachable/_track.so")) == \
        "/opt/mu/memunreachable/_track.so"


def deny(nr, ret):
    """A filter returning ret for syscall nr, ALLOW for the rest."""
    return [sc.Insn(0x20, 0, 0, 0), sc.Insn(0x15, 0, 1, nr), sc.Insn(0x06, 0, 0, ret),
            sc.Insn(0x06, 0, 0, sc.RET_ALLOW)]


def test_seccomp_rules_that_forbid_the_load():
    calls = inject.load_calls(0x7000)
    assert {c.ip for c in calls} == {0x7009}
    for nr, name in ((257, "openat"), (9, "mmap"), (10, "mprotect"), (15, "rt_sigreturn")):
        v = sc.verdict_for(7, 2, calls, lambda: [deny(nr, sc.RET_ERRNO | 1)])
        assert (v.ok, v.reason) == (False, f"its seccomp filter returns ERRNO(EPERM) for {name}")
    v = sc.verdict_for(7, 2, calls, lambda: [deny(56, sc.RET_KILL_PROCESS)])   # clone
    assert v.ok


def test_lines_track_prints():
    r = track_pid.Result(42, "svc", "started", 0.0, "/x/_track.so", 43, 1.25, 0.5)
    assert describe(r).startswith("tracking allocations of process 42 (svc) since an unknown "
                                  "time: `memunreachable check 42` shows")
    assert describe(r).endswith("(every thread paused 0.5 ms, then thread 43 1.2 ms for the "
                                "calls)")
    assert describe(track_pid.Result(42, "", "not_tracked")) == \
        "process 42 is not tracked: nothing to stop"
    assert describe(track_pid.Result(42, "svc", "already", None)) == \
        "process 42 (svc) is already tracked (since an unknown time): nothing changed"


class FakeFrozen:
    def __init__(self):
        self.released_ms, self.released = 1.5, None

    def release_others(self, tid):
        self.released = tid


def with_thread(monkeypatch, answers):
    """Run track_pid._with_thread with frozen() and inject.choose_thread faked: each freeze
    takes the next of answers (tid, refusals, busy); returns (result or exception, freezes)."""
    from contextlib import contextmanager
    freezes = []

    @contextmanager
    def frozen(pid, timeout):
        freezes.append(FakeFrozen())
        yield freezes[-1]

    it = iter(answers)
    monkeypatch.setattr(track_pid, "frozen", frozen)
    monkeypatch.setattr(track_pid.inject, "choose_thread",
                        lambda fz: (lambda a: (a[0], 0x7000, a[1], a[2]))(next(it)))
    monkeypatch.setattr(track_pid.time, "sleep", lambda s: None)
    try:
        out = track_pid._with_thread(9, 1.0, lambda fz, tid, rt: track_pid.Result(9, "", "started", tid=tid))
    except Exception as exc:    # noqa: BLE001 - the test looks at it
        out = exc
    return out, freezes


def test_busy_threads_are_waited_for_then_refused(monkeypatch):
    refused = sc.Verdict(12, 2, False, "its seccomp filter returns ERRNO(EACCES) for openat")
    out, freezes = with_thread(monkeypatch, [(0, [], [10, 11])] * 3 + [(11, [], [10])])
    assert (out.tid, out.others_ms, len(freezes), freezes[-1].released) == (11, 1.5, 4, 11)
    out, freezes = with_thread(monkeypatch, [(0, [refused], [10])] * track_pid.ATTEMPTS)
    assert len(freezes) == track_pid.ATTEMPTS and str(out) == (
        f"every thread of process 9 was inside malloc/free, the dynamic loader, an unwinder "
        f"or the tracking library at each of {track_pid.ATTEMPTS} tries (threads [10] the last "
        "time)")
    out, freezes = with_thread(monkeypatch, [(0, [refused], [])])
    assert isinstance(out, UnsupportedTarget) and len(freezes) == 1
    assert str(out) == ("no thread of process 9 may load a library under its seccomp rules "
                        "(thread 12: its seccomp filter returns ERRNO(EACCES) for openat)")
    out, freezes = with_thread(monkeypatch, [(0, [], [])])
    assert "none is at an interrupt stop" in str(out) and len(freezes) == 1


def test_code_where_a_stopped_thread_may_hold_what_the_call_needs():
    holds = inject._holds_locks_we_take
    assert holds(LD) and holds("/venv/memunreachable/_track.so")
    assert holds("/usr/lib/x86_64-linux-gnu/libgcc_s.so.1")
    assert holds("/usr/lib/x86_64-linux-gnu/libunwind.so.8")
    assert holds("/usr/lib/x86_64-linux-gnu/libunwind-x86_64.so.8")
    assert not holds("/usr/lib/x86_64-linux-gnu/libstdc++.so.6") and not holds("/usr/bin/prog")
