"""track_pid / inject policy on in-memory data: which targets are refused before any ptrace
(musl, static, no loader), which seccomp rules forbid the load, and the lines `track` prints."""
from __future__ import annotations

import pytest

from memunreachable import inject, seccomp as sc, track_pid
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
    assert describe(r).endswith("(thread 43 paused 1.2 ms, the others 0.5 ms)")
    assert describe(track_pid.Result(42, "", "not_tracked")) == \
        "process 42 is not tracked: nothing to stop"
    assert describe(track_pid.Result(42, "svc", "already", None)) == \
        "process 42 (svc) is already tracked (since an unknown time): nothing changed"
