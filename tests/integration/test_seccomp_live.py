"""seccomp targets (issue 7): never a wrong answer, never a harmed target.

Fixtures (fixtures/sec_*.c) leak leak_1 and leak_2, keep live_x, and print them:
- sec_strict: the only thread runs in SECCOMP_MODE_STRICT and echoes lines on stdin;
- sec_strict_thread: a normal main thread and a second thread in strict mode;
- sec_filter CLONE WAIT4 SCOPE: two filters (allow-all, then CLONE for clone and WAIT4 for
  wait4) on both threads (SCOPE all) or on the main thread only (SCOPE main).
Each check must report exactly the fixture's leaks (by a snapshot taken through a thread
whose rules allow clone and wait4, or by reading the stopped target directly) or refuse
with exit 3 and a hint; afterwards every thread is alive and running (not stopped, not
traced), the target has no child left, and it answers on stdin (echo, or bye + exit 0).
"""
import os
import select
import subprocess
import sys

import pytest

import fixtures
from memunreachable import cli
from memunreachable.collect import diagnose, procfs
from memunreachable._errors import UnsupportedTarget
from memunreachable.collect.freeze import frozen
from memunreachable.collect.snapshot import take_snapshot
from memunreachable.unreachable import check
from ptr_helpers import assert_running, children, wait_until

pytestmark = pytest.mark.ptrace

STRICT_WHY = "it runs in seccomp strict mode (only read, write, exit and sigreturn are allowed)"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_strict(name: str):
    fx = fixtures.start(name)
    tid = fx.expect.get("strict_tid", fx.pid)
    assert wait_until(lambda: procfs.read_status(fx.pid, tid).seccomp == 1), "not in strict mode"
    return fx, tid


def leaks_of(fx) -> set:
    return {(fx.blocks[k].address, fx.blocks[k].size) for k in ("leak_1", "leak_2")}


def assert_exact(info, fx) -> None:
    assert {(l.address, l.size) for l in info.leaks} == leaks_of(fx)
    assert (info.num_leaks, info.leak_bytes) == (fx.expect["num_leaks"], fx.expect["leak_bytes"])
    assert (info.num_leaks, info.leak_bytes) == (2, fx.blocks["leak_1"].size + fx.blocks["leak_2"].size)
    assert fx.blocks["live_x"].address not in {l.address for l in info.leaks}


def assert_unharmed(fx, threads: int) -> None:
    """Every thread alive and running (not stopped, not traced), no child left."""
    tids = procfs.list_tasks(fx.pid)
    assert len(tids) == threads, tids
    assert all(procfs.task_state(fx.pid, t) not in ("Z", "X", "") for t in tids)
    assert_running(fx.pid)
    assert children(fx.pid) == []


def echo(fx, line: bytes = b"ping\n") -> bytes:
    """Write a line to a strict-mode fixture; return what it wrote back (within 5 s)."""
    fx.proc.stdin.write(line)
    fx.proc.stdin.flush()
    r, _, _ = select.select([fx.proc.stdout], [], [], 5.0)
    return os.read(fx.proc.stdout.fileno(), 64) if r else b""


def direct_warning(reason: str) -> str:
    return (f"no snapshot (no thread can run the injected clone and wait4 under its seccomp "
            f"rules ({reason})): the target stayed stopped for the whole sweep")


# ---- strict mode

def test_strict_only_thread_is_read_directly():
    fx, tid = start_strict("sec_strict")
    with fx:
        info = check(fx.pid)
        assert info.snapshot_mode == "direct"
        assert info.warnings == [direct_warning(f"thread {tid}: {STRICT_WHY}")]
        assert_exact(info, fx)
        assert_unharmed(fx, 1)
        assert echo(fx) == b"ping\n"
        info = check(fx.pid)            # again: still alive, still exact
        assert_exact(info, fx)
        assert_unharmed(fx, 1)
        assert echo(fx, b"again\n") == b"again\n"


def test_strict_only_thread_no_fallback_refuses_with_hint(capsys):
    fx, tid = start_strict("sec_strict")
    with fx:
        with pytest.raises(UnsupportedTarget) as ei:
            check(fx.pid, allow_direct=False)
        assert ei.value.msg == (f"no snapshot of process {fx.pid}: no thread can run the "
                                f"injected clone and wait4 under its seccomp rules (thread "
                                f"{tid}: {STRICT_WHY})")
        assert ei.value.hint == diagnose.hint_seccomp(fx.pid)
        assert cli.main(["check", str(fx.pid), "--no-fallback"]) == 3
        out, err = capsys.readouterr()
        assert out == ""
        assert err.splitlines() == [f"memunreachable: error: {ei.value.msg}",
                                    f"hint: {diagnose.hint_seccomp(fx.pid)}"]
        assert_unharmed(fx, 1)
        assert echo(fx) == b"ping\n"


def test_strict_second_thread_snapshot_through_main():
    fx, strict = start_strict("sec_strict_thread")
    with fx:
        info = check(fx.pid)
        assert info.snapshot_mode == "clone" and info.warnings == []
        assert_exact(info, fx)
        assert_unharmed(fx, 2)
        # asked to inject into the strict thread: never; the stopped target is read instead
        with frozen(fx.pid) as fz:
            snap = take_snapshot(fz, tid=strict)
            assert (snap.mode, snap.pid) == ("direct", fx.pid)
            assert snap.reason == ("no thread can run the injected clone and wait4 under its "
                                   f"seccomp rules (thread {strict}: {STRICT_WHY})")
            snap.release()
        assert_unharmed(fx, 2)
    # fx.finish(): the main thread found the strict thread alive, said bye, exited 0


# ---- filter mode

FILTER_CASES = [
    # clone, wait4, scope, expected mode, refusal of a filtered thread (None: none refused)
    ("kill_process", "allow", "all", "direct", "returns KILL_PROCESS for clone"),
    ("kill_thread", "allow", "all", "direct", "returns KILL_THREAD for clone"),
    ("errno", "allow", "all", "direct", "returns ERRNO(EPERM) for clone"),
    ("trap", "allow", "all", "direct", "returns TRAP for clone"),
    ("allow", "kill_thread", "all", "direct", "returns KILL_THREAD for wait4"),
    ("allow", "kill_process", "all", "direct", "returns KILL_PROCESS for wait4"),
    ("log", "log", "all", "clone", None),
    ("allow", "allow", "all", "clone", None),
    # only the main thread is filtered: the snapshot (and the reap) go through the other one
    ("kill_process", "allow", "main", "clone", None),
    ("allow", "kill_thread", "main", "clone", None),
]


@pytest.mark.parametrize("clone, wait4, scope, mode, why", FILTER_CASES)
def test_filter_targets(clone, wait4, scope, mode, why):
    with fixtures.start("sec_filter", clone, wait4, scope) as fx:
        other = fx.expect["other_tid"]
        st = procfs.read_status(fx.pid, other)
        assert (procfs.read_status(fx.pid).seccomp_filters, st.seccomp_filters) == \
            (2, 2 if scope == "all" else 0)
        for _ in range(2):      # repeated checks: no zombie piles up, nothing is harmed
            info = check(fx.pid)
            assert info.snapshot_mode == mode
            if mode == "direct":
                reason = f"thread {fx.pid}: its seccomp filter {why}; " \
                         f"thread {other}: its seccomp filter {why}"
                assert info.warnings == [direct_warning(reason)]
            else:
                assert info.warnings == []
            assert_exact(info, fx)
            assert_unharmed(fx, 2)


def test_filter_refusal_with_no_fallback_and_opt_in_does_not_override():
    with fixtures.start("sec_filter", "kill_thread", "allow", "all") as fx:
        other = fx.expect["other_tid"]
        why = "its seccomp filter returns KILL_THREAD for clone"
        with pytest.raises(UnsupportedTarget) as ei:
            check(fx.pid, allow_direct=False)
        assert ei.value.hint == diagnose.hint_seccomp(fx.pid)
        assert ei.value.msg.endswith(f"(thread {fx.pid}: {why}; thread {other}: {why})")
        # --allow-seccomp-target only covers filters that cannot be read: a known KILL stays
        info = check(fx.pid, allow_seccomp=True)
        assert info.snapshot_mode == "direct"
        assert_exact(info, fx)
        assert_unharmed(fx, 2)


def test_reap_skips_a_thread_whose_filter_kills_wait4():
    # the snapshot goes through the unfiltered thread; the reap's first pick (the main
    # thread) kills wait4, so the reap freezes every thread and uses the other one
    with fixtures.start("sec_filter", "allow", "kill_thread", "main") as fx:
        other = fx.expect["other_tid"]
        with frozen(fx.pid) as fz:
            snap = take_snapshot(fz)
            assert (snap.mode, snap.inject_tid) == ("clone", other)
            fz.thaw()
        assert children(fx.pid) == [snap.pid]
        snap.release()
        assert not snap.zombie_left and snap.warnings == []
        assert snap.reap_pause_ms > 0
        assert wait_until(lambda: children(fx.pid) == [])
        assert_unharmed(fx, 2)


UNPRIVILEGED_CHECK = """
import json, sys
from memunreachable.unreachable import check
info = check(int(sys.argv[1]), allow_seccomp=sys.argv[2] == "1")
print(json.dumps([info.snapshot_mode, info.warnings, sorted(l.address for l in info.leaks)]))
"""


@pytest.mark.parametrize("opt_in", [False, True])
def test_unreadable_filters_keep_the_old_rule(opt_in):
    # without CAP_SYS_ADMIN, PTRACE_SECCOMP_GET_FILTER answers EACCES: no verdict, so no
    # injection unless --allow-seccomp-target; the errno filter then refuses the clone
    import json
    with fixtures.start("sec_filter", "errno", "allow", "all") as fx:
        other = fx.expect["other_tid"]
        proc = subprocess.run(
            ["setpriv", "--inh-caps=-sys_admin", "--bounding-set=-sys_admin", sys.executable,
             "-c", UNPRIVILEGED_CHECK, str(fx.pid), "1" if opt_in else "0"],
            capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        mode, warnings, leaks = json.loads(proc.stdout)
        assert mode == "direct"
        assert leaks == sorted(a for a, _ in leaks_of(fx))
        if opt_in:
            assert warnings == ["no snapshot (the target's clone() was refused (EPERM: a "
                                "seccomp filter?)): the target stayed stopped for the whole "
                                "sweep"]
        else:
            why = "its seccomp filters cannot be read (EACCES)"
            assert warnings == [direct_warning(f"thread {fx.pid}: {why}; thread {other}: {why}")]
        assert_unharmed(fx, 2)


@pytest.mark.parametrize("sigreturn", ["allow", "errno", "kill_process"])
def test_a_filter_on_rt_sigreturn_decides_the_guard(sigreturn):
    # the guard (docs/how-it-works.md) makes the thread run rt_sigreturn (and the child
    # exit_group) only if the checker dies; a filter that would refuse it gets the legacy
    # sequence, never a guard that would kill the target when it is needed
    from memunreachable.collect.sites import choose_thread
    with fixtures.start("sec_filter", "allow", "allow", "all", sigreturn) as fx:
        with frozen(fx.pid) as fz:
            tid, insn, restore_rt, refusals = choose_thread(fz)
            assert tid == fx.pid and refusals == []
            assert bool(restore_rt) == (sigreturn == "allow")
            snap = take_snapshot(fz)
            assert snap.mode == "clone" and bool(snap.restore_rt) == (sigreturn == "allow")
            fz.thaw()
        snap.release()
        assert not snap.zombie_left and snap.warnings == []
        info = check(fx.pid)
        assert info.snapshot_mode == "clone"
        assert_exact(info, fx)
        assert_unharmed(fx, 2)
