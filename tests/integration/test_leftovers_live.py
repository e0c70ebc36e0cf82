"""No leftovers, whatever happens to the checker (docs/how-it-works.md, "Leftover processes").

The checker is the real CLI (`python -m memunreachable check -v --json PID`) in a subprocess.
A signal is sent at many moments of its check: the delays are measured from its first log
line ("collecting thread info", printed once the lock is held and preflight passed) and
spread over a whole check, plus a few from the spawn itself (Python start-up). After each
round the test asserts:
- the checker exited by that signal (-signum, or 128 + signum), or finished first with the
  exact result; never exit 3 or any other code;
- the target has no child left (zombie or not), no thread stopped (t/T) or traced, is alive,
  and no process of that checker (its sweeper) is still running;
- a following normal check of the target gives the exact expected result.
SIGKILL of the checker: at most the zombie clone (exit_signal 0) is left, and the next check
reaps it (its warnings say so) and gives the exact result. A SIGKILL that lands inside an
injected syscall (the clone, or the reap's wait4: about a millisecond per check) kills or
corrupts the target: the one case that cannot be made safe (docs/how-it-works.md); those
rounds are counted, printed and bounded. Overlapping checkers on one pid:
each exits 23 with the exact result (they queue on the per-target lock). A checker whose
sweeper is SIGKILLed fails with exit 3 and a clear message, or finished first.
The fixture own_clone has its own clone(0) zombie child: no check may ever reap it.
Rounds marked slow run many more delays (and the churning fixture).
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

import pytest

import fixtures
from expected import EXPECTED, Shape, single
from ptr_helpers import assert_running, children, states, wait_until
from test_check import assert_result, assert_target_running
from memunreachable.collect import leftovers
from memunreachable._errors import CollectionError
from memunreachable.reporters.json import load_json
from memunreachable.unreachable import check

pytestmark = pytest.mark.ptrace

CHECKER = [sys.executable, "-m", "memunreachable", "check", "-v", "--json"]
ANCHOR = b"collecting thread info"
SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
OWN_CLONE = Shape(single("leak_a"))


def shape_of(name: str) -> Shape:
    return OWN_CLONE if name == "own_clone" else EXPECTED[name]


def own_children(fx) -> list:
    """The fixture's own clone(0) zombie (own_clone), which must stay."""
    return [fx.expect["own_child"]] if "own_child" in fx.expect else []


def spawn(pid: int) -> subprocess.Popen:
    # the checker starts with the signals at their defaults, as from a terminal: a suite run
    # as a background job (nohup, `cmd &` in a script) begins with SIGINT or SIGHUP ignored,
    # which the checker rightly keeps ignored
    return subprocess.Popen(CHECKER + [str(pid)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=default_signals)


def default_signals() -> None:
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def read_until(proc: subprocess.Popen, marker: bytes, timeout: float = 60.0) -> bytes:
    """stderr of proc up to and including the line holding marker (or up to its exit)."""
    buf = b""
    fd = proc.stderr.fileno()
    deadline = time.monotonic() + timeout
    while marker not in buf:
        left = deadline - time.monotonic()
        assert left > 0, f"no {marker!r} from the checker within {timeout} s: {buf!r}"
        r, _, _ = select.select([fd], [], [], left)
        if r:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
    return buf


def finish(proc: subprocess.Popen, head: bytes = b"") -> tuple:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out.decode(errors="replace"), (head + err).decode(errors="replace")


def checker_processes(pid: int) -> list:
    """Live (non-zombie) processes running our checker command on pid: checkers, sweepers."""
    found = []
    for e in os.listdir("/proc"):
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            st = leftovers.read_stat(int(e))
        except OSError:
            continue
        if st is not None and st.state != "Z" and b"memunreachable" in argv and \
                b"check" in argv and str(pid).encode() in argv:
            found.append(int(e))
    return found


def assert_clean(fx, allowed=()) -> None:
    """Target alive, running, untraced, no child but `allowed`, no checker process left."""
    assert fx.alive(), f"{fx.name} died"
    want = sorted(own_children(fx) + list(allowed))
    assert wait_until(lambda: sorted(children(fx.pid)) == want, 2.0), \
        f"children of {fx.name}: {children(fx.pid)}, expected {want}"
    assert wait_until(lambda: checker_processes(fx.pid) == [], 2.0), \
        f"checker processes left: {checker_processes(fx.pid)}"
    assert_running(fx.pid)


def assert_exact(fx, info) -> None:
    assert_result(fx, shape_of(fx.name), info)


def normal_check(fx):
    """A plain in-process check: exact result, nothing left (but the fixture's own zombie)."""
    info = check(fx.pid, limit=None)
    assert_exact(fx, info)
    assert_clean(fx)
    return info


def signal_round(fx, sig: int, delay: float, anchored: bool = True) -> str:
    """One checker, sig after delay; returns "interrupted" or "finished"."""
    proc = spawn(fx.pid)
    head = read_until(proc, ANCHOR) if anchored else b""
    time.sleep(delay)
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass
    rc, out, err = finish(proc, head)
    where = f"{signal.Signals(sig).name} at {delay * 1000:.0f} ms (anchored={anchored}): rc {rc}, stderr {err[-600:]!r}"
    if rc in (0, 23):
        assert_exact(fx, load_json(json.loads(out)))        # it finished before the signal
        outcome = "finished"
    elif rc == 1 and not anchored:
        # SIGINT while the interpreter starts or imports our modules (site, .pth files, the
        # CLI's imports): CPython exits 1 with a KeyboardInterrupt traceback before the check
        # began (nothing was touched: assert_clean below)
        assert sig == signal.SIGINT and err.rstrip().endswith("KeyboardInterrupt"), where
        assert "interrupted by" not in err and "leftovers.py" not in err, where
        outcome = "interrupted"
    else:
        assert rc in (-sig, 128 + sig), where
        if "interrupted by" not in err:
            assert rc == -sig, where    # killed by the default action before our handlers
        outcome = "interrupted"
    assert_clean(fx)
    normal_check(fx)
    return outcome


def check_duration(fx) -> float:
    """Seconds from the checker's first log line to its exit (one measured run)."""
    return check_timing(fx)[0]


def check_timing(fx) -> tuple:
    """(seconds from the checker's first log line to its exit, (lo, hi) seconds after that
    line while its snapshot clone lives), from one measured run: the clone lives for the
    report's snapshot_ms and is released when the sweep ends, just before the check does."""
    proc = spawn(fx.pid)
    head = read_until(proc, ANCHOR)
    t0 = time.monotonic()
    rc, out, err = finish(proc, head)
    assert rc == 23, err
    info = load_json(json.loads(out))
    assert_exact(fx, info)
    end, life = info.duration_ms / 1000, info.snapshot_ms / 1000
    return time.monotonic() - t0, (max(0.0, end - life - 0.01), end)


def signal_rounds(name: str, per_signal: int, startup: int) -> dict:
    counts = {"rounds": 0, "interrupted": 0, "finished": 0}
    with fixtures.start(name, timeout=120) as fx:
        span = check_duration(fx) * 1.1
        for sig in SIGNALS:
            delays = [span * i / max(per_signal - 1, 1) for i in range(per_signal)]
            rounds = [(d, True) for d in delays] + [(0.05 + 0.1 * i, False) for i in range(startup)]
            for delay, anchored in rounds:
                counts[signal_round(fx, sig, delay, anchored)] += 1
                counts["rounds"] += 1
    print(f"{name}: check window {span * 1000:.0f} ms, {counts}")
    return counts


class TargetDied(Exception):
    pass


def kill_round(fx, delay: float) -> int:
    """SIGKILL the checker after delay; returns how many leftover clones it left (0 or 1).
    Raises TargetDied when the target did not survive (SIGKILL inside an injected syscall)."""
    proc = spawn(fx.pid)
    head = read_until(proc, ANCHOR)
    time.sleep(delay)
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    rc, out, err = finish(proc, head)
    # the target either survives intact or (the known window) dies; never stopped or duplicated
    time.sleep(0.05)
    if not fx.alive():
        raise TargetDied(f"SIGKILL at {delay * 1000:.0f} ms: target exit {fx.proc.returncode}")
    if rc in (0, 23):
        assert_exact(fx, load_json(json.loads(out)))
    else:
        assert rc == -signal.SIGKILL, err
    # the kernel kills the traced clone (EXITKILL): a zombie of the target at most
    assert wait_until(lambda: all(leftovers.read_stat(c) is None or leftovers.read_stat(c).state == "Z"
                                  for c in children(fx.pid)), 2.0)
    left = [c for c in children(fx.pid) if c not in own_children(fx)]
    assert len(left) <= 1, left
    for c in left:
        st = leftovers.read_stat(c)
        assert st is None or (st.exit_signal == 0 and st.ppid == fx.pid), st
    assert wait_until(lambda: checker_processes(fx.pid) == [], 2.0), checker_processes(fx.pid)
    assert wait_until(lambda: not [s for s in states(fx.pid).values() if s in ("t", "T")], 2.0)
    info = check(fx.pid, limit=None)
    assert_exact(fx, info)
    assert_clean(fx)
    if left:
        assert any(f"pid {left[0]})" in w and w.startswith("reaped 1 snapshot") for w in info.warnings), \
            info.warnings
    return len(left)


def kill_rounds(name: str, rounds: int, around_injections: bool = False) -> dict:
    """SIGKILL rounds; a target that died is counted and replaced by a fresh one, and the
    callers require that count to be 0 (the guard: docs/how-it-works.md, "Tracer death").
    around_injections: every moment within 2 ms of the clone (the snapshot's start) or of the
    reaping wait4 (its end), in 0.1 ms steps, instead of spread over the whole check."""
    counts = {"rounds": 0, "left_a_zombie": 0, "target_died": 0}
    died = []
    fx = fixtures.start(name, timeout=120)
    try:
        span, (lo, hi) = check_timing(fx)
        span *= 1.1
        # half the moments spread over the whole check, half over the snapshot's life (the
        # moments that leave a clone to reap: a shrinking share of the check as start-up and
        # the report got faster)
        half = max(rounds // 2, 1)
        delays = [span * i / max(half - 1, 1) for i in range(half)]
        delays += [lo + (hi - lo) * i / max(rounds - half - 1, 1) for i in range(rounds - half)]
        if around_injections:
            delays = [max(0.0, at - 0.002 + 0.0001 * (i % 40))
                      for i, at in enumerate([lo, hi] * (rounds // 2))]
        for delay in sorted(delays):
            try:
                counts["left_a_zombie"] += kill_round(fx, delay)
            except TargetDied as exc:
                died.append(str(exc))
                counts["target_died"] += 1
                fx.kill()
                fx = fixtures.start(name, timeout=120)
            counts["rounds"] += 1
        fx.finish()
    except BaseException:
        fx.kill()
        raise
    print(f"{name}: SIGKILL over a {span * 1000:.0f} ms window (snapshot {lo * 1000:.0f}-"
          f"{hi * 1000:.0f} ms): {counts} {died}")
    return counts


def overlap_rounds(name: str, rounds: int, checkers: int) -> dict:
    counts = {"rounds": 0, "exact": 0, "busy": 0}
    with fixtures.start(name, timeout=120) as fx:
        for _ in range(rounds):
            procs = [spawn(fx.pid) for _ in range(checkers)]
            for proc in procs:
                rc, out, err = finish(proc)
                if rc == 3 and "another memunreachable check (pid" in err:
                    counts["busy"] += 1
                    continue
                assert rc == 23, err[-600:]
                assert_exact(fx, load_json(json.loads(out)))
                counts["exact"] += 1
            assert_clean(fx)
            counts["rounds"] += 1
    print(f"{name}: overlapping {counts}")
    return counts


# ---- the default (fast) subset -------------------------------------------------------------

def test_signals_at_many_moments_leave_nothing():
    counts = signal_rounds("leak_chain", per_signal=4, startup=1)
    assert counts["rounds"] == 15
    # the premise: many delays fall inside the check (6-10 of 12 on a quiet machine; 5 with
    # both CPUs busy, where a check's duration varies more than the one measured)
    assert counts["interrupted"] >= 4


JOB_STOPS = [signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU]


@pytest.mark.parametrize("mode", ["clone", pytest.param("direct", marks=pytest.mark.slow)])
def test_job_control_stops_the_checker_never_the_target(mode):
    """Ctrl-Z (SIGTSTP), or a background job's terminal I/O (SIGTTIN, SIGTTOU), stops the
    checker; while it has the target frozen the stop waits for the thaw, and the sweeper
    ignores it, so a suspended check never keeps the target stopped. In direct mode
    (sec_filter's errno filter refuses the clone) the target is frozen for the whole sweep:
    the checker stops after it. After SIGCONT the check ends with the exact leaks."""
    args = ("leak_chain",) if mode == "clone" else ("sec_filter", "errno", "allow", "all")
    stopped = 0
    with fixtures.start(*args) as fx:
        # most delays fall inside a check of leak_chain (about 30 ms after the anchor now that
        # a check reuses its memos); the last ones may come after it ends
        for i, delay in enumerate((0.0, 0.002, 0.005, 0.01, 0.015, 0.02, 0.04, 0.08)):
            proc = spawn(fx.pid)
            head = read_until(proc, ANCHOR)
            time.sleep(delay)
            proc.send_signal(JOB_STOPS[i % 3])
            assert wait_until(lambda: proc.poll() is not None or
                              leftovers.read_stat(proc.pid).state == "T", 10.0)
            if proc.poll() is None:
                stopped += 1
                assert_running(fx.pid)          # the checker is stopped, the target is not
                time.sleep(0.05)
                assert_running(fx.pid)
                proc.send_signal(signal.SIGCONT)
            rc, out, err = finish(proc, head)
            assert rc == 23, err[-800:]
            info = load_json(json.loads(out))
            if mode == "clone":
                assert_exact(fx, info)
            else:
                assert info.snapshot_mode == "direct"
                assert sorted(l.address for l in info.leaks) == \
                    sorted(fx.blocks[k].address for k in ("leak_1", "leak_2"))
            assert_clean(fx)
    assert stopped >= 4


def test_sigkill_of_the_checker_next_check_reaps_the_clone():
    counts = kill_rounds("leak_chain", rounds=6)
    assert counts["rounds"] == 6 and counts["target_died"] == 0   # the guard: see test_tracer_death


def test_leftover_zombie_reaped_but_never_the_programs_own_clone():
    # SIGKILL right after the snapshot exists (the sweep runs: "searching process" is logged
    # by the sweeper), so a zombie clone is left for sure; the own clone(0) zombie stays.
    with fixtures.start("own_clone") as fx:
        own = fx.expect["own_child"]
        assert wait_until(lambda: leftovers.read_stat(own).state == "Z")
        assert leftovers.read_stat(own).exit_signal == 0
        proc = spawn(fx.pid)
        head = read_until(proc, b"searching process")
        proc.kill()
        finish(proc, head)
        assert wait_until(lambda: len(children(fx.pid)) == 2, 2.0), children(fx.pid)
        clone = [c for c in children(fx.pid) if c != own][0]
        assert wait_until(lambda: leftovers.read_stat(clone).state == "Z", 2.0)
        info = check(fx.pid, limit=None)
        assert_exact(fx, info)
        assert_clean(fx)                    # only the program's own zombie is left
        assert f"reaped 1 snapshot process(es) (pid {clone})" in info.warnings[0]
        info = normal_check(fx)
        assert not [w for w in info.warnings if "reaped" in w]


def test_clone_born_in_a_recorded_injection_window_is_reaped():
    # a checker killed between the clone and the record update left only the window: make
    # that state for real (a clone snapshot taken outside any check, killed like EXITKILL
    # does, never reaped in the target), with a record naming a dead checker
    from memunreachable.collect.freeze import frozen
    from memunreachable.collect.snapshot import _kill_child, take_snapshot
    with fixtures.start("own_clone") as fx:
        own = fx.expect["own_child"]
        assert wait_until(lambda: leftovers.read_stat(own).state == "Z")
        time.sleep(0.05)                    # another clock tick than the own clone's birth
        with frozen(fx.pid) as fz:
            snap = take_snapshot(fz)
        _kill_child(snap.pid, 2.0)
        snap.released = True
        clone = leftovers.read_stat(snap.pid)
        assert clone.state == "Z" and clone.ppid == fx.pid and clone.exit_signal == 0
        assert clone.start != leftovers.read_stat(own).start
        target = leftovers.read_stat(fx.pid)
        path = os.path.join(leftovers.run_dir(), f"{fx.pid}-{target.start}.json")
        dead = subprocess.Popen(["true"])
        dead.wait()
        with open(path, "wb") as f:
            f.write(leftovers.Record(fx.pid, target.start, checker=dead.pid,
                                     windows=[(clone.start, clone.start)]).encode())
        info = check(fx.pid, limit=None)
        assert_exact(fx, info)
        assert f"reaped 1 snapshot process(es) (pid {snap.pid})" in info.warnings[0]
        assert_clean(fx)                    # the own zombie stays
        assert not os.path.exists(path)     # nothing left to record


def test_overlapping_checks_queue_on_the_lock():
    counts = overlap_rounds("leak_chain", rounds=3, checkers=3)
    assert counts["exact"] + counts["busy"] == 9 and counts["exact"] >= 3


def test_a_check_waits_a_bounded_time_then_names_the_other_checker(monkeypatch):
    with fixtures.start("leak_one") as fx:
        holder = threading.Event()
        release = threading.Event()

        def hold():
            with leftovers.guard(fx.pid) as sess:
                assert sess is not None
                holder.set()
                release.wait(30)

        # the other "checker" is this process here: guard() works from any thread (no
        # signal handlers there), and the lock is per open file, so it excludes us too
        t = threading.Thread(target=hold)
        t.start()
        try:
            assert holder.wait(10)
            monkeypatch.setattr(leftovers, "LOCK_WAIT", 0.3)
            t0 = time.monotonic()
            with pytest.raises(CollectionError) as ei:
                check(fx.pid)
            assert 0.3 <= time.monotonic() - t0 < 5
            assert f"another memunreachable check (pid {os.getpid()}) is running on process {fx.pid}" \
                in str(ei.value)
            assert ei.value.hint
        finally:
            release.set()
            t.join()
        assert_clean(fx)
        monkeypatch.setattr(leftovers, "LOCK_WAIT", 30.0)
        normal_check(fx)


def test_sweeper_killed_mid_sweep_fails_cleanly():
    with fixtures.start("leak_chain") as fx:
        proc = spawn(fx.pid)
        head = read_until(proc, b"searching process")
        kids = children(proc.pid)          # its threads may end while they are read
        for kid in kids:
            os.kill(kid, signal.SIGKILL)
        rc, out, err = finish(proc, head)
        if rc == 23:
            assert_exact(fx, load_json(json.loads(out)))       # the sweep was already done
        else:
            assert rc == 3, err
            assert "the sweeper process" in err and "was killed (SIGKILL)" in err, err
        assert_clean(fx)
        normal_check(fx)


def test_another_tracer_holds_the_target():
    with fixtures.start("leak_one") as fx:
        gdbish = subprocess.Popen([sys.executable, "-c",
                                   "import sys, time; from ptrace.binding.func import ptrace;"
                                   f"ptrace(0x4206, {fx.pid}, 0, 0); print('ok', flush=True);"
                                   "sys.stdin.read()"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert gdbish.stdout.readline().strip() == b"ok"
            proc = spawn(fx.pid)
            rc, out, err = finish(proc)
            assert rc == 3, err
            assert "traced" in err.lower() or "tracer" in err.lower(), err
            assert sorted(children(fx.pid)) == []
        finally:
            gdbish.communicate(b"", timeout=10)
        assert_clean(fx)
        normal_check(fx)


# ---- slow: many more rounds ------------------------------------------------------------------

@pytest.mark.slow
def test_signals_at_many_moments_slow():
    counts = signal_rounds("leak_chain", per_signal=15, startup=3)
    assert counts["rounds"] == 54


@pytest.mark.slow
def test_signals_on_a_churning_target_slow():
    counts = signal_rounds("churn", per_signal=5, startup=0)
    assert counts["rounds"] == 15


@pytest.mark.slow
def test_sigkill_at_many_moments_slow():
    counts = kill_rounds("leak_chain", rounds=20)
    assert counts["rounds"] == 20 and counts["left_a_zombie"] >= 5
    assert counts["target_died"] == 0      # even inside an injected syscall (the guard)


@pytest.mark.slow
def test_sigkill_around_the_injections_slow():
    counts = kill_rounds("leak_chain", rounds=40, around_injections=True)
    assert counts["rounds"] == 40 and counts["target_died"] == 0


@pytest.mark.slow
def test_overlapping_checks_slow():
    counts = overlap_rounds("leak_chain", rounds=20, checkers=3)
    assert counts["rounds"] == 20
