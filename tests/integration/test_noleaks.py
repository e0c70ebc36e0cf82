"""Issue 3: the in-process API against a C extension that leaks on purpose."""
import importlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from inprocess_helpers import build_leaky, python_env, run_python
from ptr_helpers import oom_score_adj
from memunreachable import noleaks
from memunreachable._errors import LeaksDetected
from memunreachable.collect.leftovers import children_of
from memunreachable.sweep.sweeper import join_reapers

pytestmark = pytest.mark.ptrace


@pytest.fixture(scope="module")
def ext_dir():
    return build_leaky()


ASSERT_SCRIPT = r"""
import leakytools as leaky, memunreachable
from memunreachable import LeaksDetected
addr, size = leaky.{fn}(34604008)
try:
    info = memunreachable.assert_no_leaks(limit=None)
    print("clean", info.num_leaks)
except LeaksDetected as e:
    print("leaks", e.info.num_leaks, e.info.leak_bytes, [(l.address, l.size) for l in e.info.leaks])
    assert ("%x" % addr) in e.report, e.report
print("block", addr, size)
"""


def parse(out: str):
    lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
    addr, size = map(int, lines["block"].split())
    return lines, addr, size


def test_assert_no_leaks_catches_the_leak_with_exact_address_and_size(ext_dir):
    proc = run_python(ASSERT_SCRIPT.format(fn="leak"), ext_dir)
    assert proc.returncode == 0, proc.stderr
    lines, addr, size = parse(proc.stdout)
    assert lines["leaks"] == f"1 {size} [({addr}, {size})]"


def test_assert_no_leaks_passes_when_the_block_is_freed(ext_dir):
    proc = run_python(ASSERT_SCRIPT.format(fn="no_leak"), ext_dir)
    assert proc.returncode == 0, proc.stderr
    lines, _, _ = parse(proc.stdout)
    assert lines["clean"] == "0"


def test_noleaks_true_then_false(ext_dir):
    code = ("import leakytools as leaky, memunreachable\n"
            "print(memunreachable.NoLeaks())\n"
            "leaky.leak(34603080)\n"
            "print(memunreachable.NoLeaks())\n")
    proc = run_python(code, ext_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "False"]


NO_NEW_LEAKS = r"""
import leakytools as leaky
from memunreachable import no_new_leaks, LeaksDetected
try:
    with no_new_leaks():
        addr, size = leaky.leak(34606008)
    print("missed")
except LeaksDetected as e:
    print("caught", [(l.address, l.size, l.referenced_count) for l in e.info.leaks] == [(addr, size, 0)],
          (e.info.num_leaks, e.info.leak_bytes) == (1, size), ("%x" % addr) in e.report)
with no_new_leaks():
    leaky.no_leak(34606008)
print("clean-ok")
"""


def test_no_new_leaks(ext_dir):
    proc = run_python(NO_NEW_LEAKS, ext_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["caught True True True", "clean-ok"]


GC_POLICY = r"""
import gc
import leakytools as leaky
from memunreachable import get_unreachable_memory
runs = []
gc.callbacks.append(lambda phase, info: phase == "start" and runs.append(info["generation"]))
gc.disable()                                # only the checks' own collections are counted
get_unreachable_memory(limit=None)          # warm-up
n = len(runs)
info = get_unreachable_memory(limit=None)
print("clean", info.num_leaks, info.num_cyclic_garbage, runs[n:])
class Node:
    pass
def make_cycles():
    for _ in range(3):
        a, b = Node(), Node()
        a.other, b.other = b, a
        c = [1, 2]
        c.append(c)
make_cycles()
n = len(runs)
info = get_unreachable_memory(limit=None)
print("garbage", info.num_leaks, info.num_cyclic_garbage, runs[n:])
addr, size = leaky.leak(34604008)
n = len(runs)
info = get_unreachable_memory(limit=None)
print("leak", [(l.address, l.size) for l in info.leaks] == [(addr, size)], runs[n:])
n = len(runs)
info = get_unreachable_memory(limit=None)
print("known", [(l.address, l.size) for l in info.leaks] == [(addr, size)], runs[n:])
"""


def test_gc_collect_runs_only_when_the_check_finds_what_it_may_change(ext_dir):
    # a check that finds nothing new does not pay for a full collection; one that finds
    # cyclic garbage or a new leak collects and checks again, so garbage never shows
    proc = run_python(GC_POLICY, ext_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["clean 0 0 []", "garbage 0 0 [2]", "leak True [2]",
                                        "known True []"]


ALTSTACK = r"""
import ctypes, faulthandler, struct
import leakytools as leaky
from memunreachable import no_new_leaks, LeaksDetected
from memunreachable.noleaks import _idle_altstack
faulthandler.enable()                       # as pytest does: a heap block as alternate stack
(lo, hi), = _idle_altstack()
try:
    with no_new_leaks():
        addr, size = leaky.leak(34606008)
        # an old copy of the address in the idle signal stack: stale bytes, not a reference
        ctypes.memmove(lo + 64, struct.pack("<Q", addr), 8)
    print("missed")
except LeaksDetected as e:
    print("caught", [(l.address, l.size) for l in e.info.leaks] == [(addr, size)])
"""


def test_a_stale_address_in_the_idle_signal_stack_hides_nothing(ext_dir):
    proc = run_python(ALTSTACK, ext_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["caught", "True"], proc.stdout


STRING_AND_LOG = r"""
import logging, io
import leakytools as leaky, memunreachable
addr, size = leaky.leak(34603512)
text = memunreachable.get_unreachable_memory_string(limit=None)
print(f"{size} bytes unreachable at {addr:x}" in text, text.splitlines()[-1].startswith("SUMMARY: memunreachable:"))
buf = io.StringIO()
logging.basicConfig(stream=buf, level=logging.ERROR, format="%(levelname)s %(message)s")
addr2, size2 = leaky.leak(34603704)
print(memunreachable.log_unreachable_memory(limit=None))
log = buf.getvalue()
print(f"ERROR   {size2} bytes unreachable at {addr2:x}" in log, f"ERROR   {size} bytes unreachable at {addr:x}" in log,
      f"{size + size2} bytes in 2 unreachable allocations" in log)
"""


def test_get_unreachable_memory_string_and_log(ext_dir):
    proc = run_python(STRING_AND_LOG, ext_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True", "True", "True", "True", "True"], proc.stdout


THREADS = r"""
import threading, time
import leakytools as leaky
from memunreachable import no_new_leaks, LeaksDetected
stop = threading.Event()
counters = [0, 0]
def busy(i):
    while not stop.is_set():
        counters[i] += 1
        _ = [str(n) for n in range(50)]
workers = [threading.Thread(target=busy, args=(i,)) for i in range(2)]
for w in workers:
    w.start()
result = {}
def run():
    try:
        with no_new_leaks():
            result["leak"] = leaky.leak(34604248)
    except LeaksDetected as exc:
        result["info"] = exc.info
t = threading.Thread(target=run)
t.start()
t.join(60)
before = list(counters)
time.sleep(0.2)
stop.set()
for w in workers:
    w.join()
addr, size = result["leak"]
print([(l.address, l.size) for l in result["info"].leaks] == [(addr, size)],
      counters[0] > before[0] and counters[1] > before[1])
"""


def test_check_from_a_non_main_thread_with_busy_python_threads(ext_dir):
    proc = run_python(THREADS, ext_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"], proc.stdout


def _resources():
    join_reapers(10)        # earlier tests' sweepers are reaped in background threads
    pid = os.getpid()
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    tasks = len(os.listdir(f"/proc/{pid}/task"))
    return fds, tasks, set(children_of(pid))


@pytest.mark.slow
def test_one_thousand_checks_leave_nothing_behind():
    noleaks.get_unreachable_memory(limit=0)      # warm-up: imports, caches
    before = _resources()
    t0 = time.monotonic()
    for _ in range(1000):
        noleaks.get_unreachable_memory(limit=0)
    elapsed = time.monotonic() - t0
    assert _resources() == before, f"resources before/after differ ({elapsed:.0f} s for 1000 checks)"


OWN_OOM_SCORE_ADJ = oom_score_adj(os.getpid())


def test_one_helper_serves_every_check_and_a_dead_one_is_replaced():
    noleaks.get_unreachable_memory(limit=0)
    first = noleaks._HELPER.proc.pid
    for _ in range(3):
        noleaks.get_unreachable_memory(limit=0)
    assert noleaks._HELPER.proc.pid == first          # no new process per check
    # it sweeps from copies of this process's heap: the OOM killer's first choice, not us
    assert oom_score_adj(first) == 1000 and oom_score_adj(os.getpid()) == OWN_OOM_SCORE_ADJ
    os.kill(first, signal.SIGKILL)
    noleaks._HELPER.proc.wait()
    info = noleaks.get_unreachable_memory(limit=None)  # transparently a new helper
    assert noleaks._HELPER.proc.pid != first and noleaks._HELPER.alive()
    assert info.pid == os.getpid()



HELPER_DIES = r"""
import os, signal, sys
from memunreachable import noleaks
from memunreachable._errors import OutOfMemory, SweepError
from memunreachable.collect import procfs
from memunreachable.collect.leftovers import children_of, read_stat
def zombies():
    return sorted(c for c in children_of(os.getpid()) if (st := read_stat(c)) and st.state == "Z")
send_and_wait = noleaks._send_and_wait
def kill_helper_on_wait(wfd, line, rfd):    # the request was sent: the helper dies while it works
    os.write(wfd, line)
    os.kill(noleaks._HELPER.proc.pid, signal.SIGKILL)
    return send_and_wait(wfd, b"", rfd)
b = noleaks.deferred_baseline()     # its snapshot waits in the helper (a child of ours)
noleaks._send_and_wait = kill_helper_on_wait
try:
    b.resolve()
except SweepError as exc:
    print("error", type(exc).__name__, "exit status -9" in str(exc))
print("zombies", zombies())
if sys.argv[1] == "oom":            # the OOM killer's count went up meanwhile
    kills = iter(range(100, 200))
    procfs.oom_kills = lambda: next(kills)
    helpers = []
    start = noleaks._Helper.__init__
    def counting(self):
        start(self)
        helpers.append(self.proc.pid)
    noleaks._Helper.__init__ = counting
    try:
        noleaks.get_unreachable_memory()
    except OutOfMemory as exc:
        print("oom", len(helpers), "OOM killer" in str(exc), "free memory" in exc.hint)
    print("zombies", zombies())
"""


@pytest.mark.parametrize("how", ["killed", "oom"])
def test_a_helper_that_dies_while_it_works_leaves_no_snapshot_behind(ext_dir, how):
    # the kernel kills the helper's snapshot clone with it (PTRACE_O_EXITKILL): a zombie
    # child of this process, reaped here (no new helper need come). Killed while the OOM
    # killer ran: OutOfMemory, and no second helper (it would copy the same heap)
    proc = subprocess.run([sys.executable, "-c", HELPER_DIES, how], env=python_env(ext_dir),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["error SweepError True", "zombies []"]
    if how == "oom":
        assert lines[2:] == ["oom 1 True True", "zombies []"]

DEFERRED = r"""
import os
import leakytools as leaky
from memunreachable import noleaks
from memunreachable._errors import MemunreachableError
from memunreachable._tracer import MAX_PENDING
from memunreachable.collect.leftovers import children_of
old, _ = leaky.leak(34604008)
b1 = noleaks.deferred_baseline()
print("waiting", b1.waiting, len(children_of(os.getpid())))
mid, _ = leaky.leak(34604008)
b2 = noleaks.deferred_baseline()            # b1 waits on: each is its own moment
print("both", b1.waiting, b2.waiting, len(children_of(os.getpid())))
new, _ = leaky.leak(34604008)               # after both snapshots: in neither baseline
base1, base2 = b1.resolve(), b2.resolve()
print("b1", old in base1, mid in base1, new in base1)
print("b2", old in base2, mid in base2, new in base2, b2.waiting, len(children_of(os.getpid())))
more = [noleaks.deferred_baseline() for _ in range(MAX_PENDING + 1)]
try:                                        # one more than the helper keeps: the oldest went
    more[0].resolve()
    print("oldest resolved")
except MemunreachableError as exc:
    print("oldest gone", "more snapshots than the helper keeps" in str(exc))
print("newest", more[-1].resolve() is not None, len(children_of(os.getpid())))
for b in more:
    b.drop()
b3 = noleaks.deferred_baseline()
b3.drop()
b1.drop()                                   # swept already: a no-op
print("dropped", b3.waiting, len(children_of(os.getpid())))
"""


def test_a_deferred_baseline_is_the_moment_of_its_snapshot_and_only_its_own(ext_dir):
    # deferred_baseline(): the snapshot now, its sweep only on resolve(); several wait at
    # once (the plugin's batches), each its own moment, up to _tracer.MAX_PENDING: a newer
    # one beyond releases the oldest (resolve() then raises, never sweeps another snapshot);
    # drop() releases one
    proc = run_python(DEFERRED, ext_dir)
    assert proc.returncode == 0, proc.stderr
    # children: the helper, and each snapshot while it waits
    from memunreachable._tracer import MAX_PENDING
    assert proc.stdout.splitlines() == [
        "waiting True 2", "both True True 3", "b1 True False False",
        "b2 True True False False 1", "oldest gone True", f"newest True {MAX_PENDING}",
        "dropped False 1"]


def test_the_helper_waits_until_the_requesting_thread_sits_in_its_wait():
    # _tracer.await_wait: a thread blocked in select (pselect6) is seen at once; a thread
    # running Python code is waited for up to the limit, then the check goes on (False)
    import subprocess
    from memunreachable._tracer import await_wait
    code = {"select": "import select, os, sys\nr, w = os.pipe()\nprint('ready', flush=True)\n"
                      "select.select([r], [], [], 60)\n",
            "busy": "print('ready', flush=True)\nwhile True:\n    pass\n"}
    for kind, want in (("select", True), ("busy", False)):
        p = subprocess.Popen([sys.executable, "-c", code[kind]], stdout=subprocess.PIPE)
        try:
            assert p.stdout.readline() == b"ready\n"
            time.sleep(0.1)
            t0 = time.monotonic()
            assert await_wait(p.pid, p.pid, limit=0.2) is want
            took = time.monotonic() - t0
            assert (took < 0.1) if want else (0.2 <= took < 1.0)
        finally:
            p.kill()
            p.wait()


WAITING = r"""
import os, sys, time
from memunreachable import noleaks
b = noleaks.deferred_baseline()
print("waiting", b.waiting, flush=True)
if sys.argv[1] == "sleep":
    time.sleep(60)
"""


def _ours(marker: str) -> list:
    """Processes whose command line holds marker: a helper (--pid) or a snapshot clone."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_a_waiting_snapshot_never_outlives_its_process(ext_dir, how):
    # the snapshot is a clone of the caller, holding the helper's stdin open: the caller's exit
    # drops it first, and a helper whose caller died releases it and ends (no EOF ever comes)
    import subprocess
    marker = f"mu-waiting-{os.getpid()}-{how}"
    p = subprocess.Popen([sys.executable, "-c", WAITING, "sleep" if how == "sigkill" else "exit",
                          marker], env=python_env(ext_dir), stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"waiting True\n"
        t0 = time.monotonic()
        if how == "sigkill":
            p.kill()
        p.wait(timeout=30)
        assert time.monotonic() - t0 < 10
        deadline = time.monotonic() + 10
        while _ours(marker) or _ours(f"--pid\0{p.pid}\0"):
            assert time.monotonic() < deadline, "helper or snapshot left behind"
            time.sleep(0.1)
    finally:
        p.kill()
        p.wait()


WAIT_DEPTH = r"""
import os, sys
from memunreachable import noleaks
r, w = os.pipe()
print("go", flush=True)
if sys.argv[1] == "check":              # the in-process checks' request and wait for the reply
    noleaks._send_and_wait(os.pipe()[1], b"go\n", r)
else:
    os.read(r, 8)                       # a plain blocking read from the same depth
"""


def _wait_depth(how: str) -> int:
    """How far below the top of its stack a child's thread waits (/proc/PID/syscall's SP)."""
    import subprocess
    from memunreachable.sweep.classify import WAIT_SYSCALLS
    waits = {str(n) for n in WAIT_SYSCALLS}
    proc = subprocess.Popen([sys.executable, "-c", WAIT_DEPTH, how], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"go"
        deadline = time.monotonic() + 10
        while True:
            fields = open(f"/proc/{proc.pid}/syscall").read().split()
            if fields[0] in waits or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert fields[0] in waits, fields
        top = next(int(l.split("-")[1].split()[0], 16) for l in open(f"/proc/{proc.pid}/maps")
                   if l.rstrip().endswith("[stack]"))
        return top - int(fields[-2], 16)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_the_wait_for_the_helper_leaves_no_big_frame_to_scan():
    # The helper freezes the caller in this wait and scans its stack from the SP up: a wait in
    # select.select kept three arrays of 1,025 fd entries (46 KB more than a plain read) on the
    # C stack, written only for the fds given, and the scan read whatever deeper calls had
    # left there (a leaked 34 MB block's address, 1 of ~70 loaded runs of the xdist suite).
    extra = _wait_depth("check") - _wait_depth("read")
    assert extra < 8 << 10, extra


def test_replies_are_read_into_one_buffer_kept_for_the_process_life():
    # a reply read into a fresh bytes object was freed after its unpickling, and a test's next
    # block of that size took its address while the check's frames could still hold copies of it
    r, w = os.pipe()
    try:
        os.write(w, b"a" * 5000 + b"b" * 3000)
        first = noleaks._read_exactly(r, 5000, 5)
        buf = first.obj
        assert bytes(first) == b"a" * 5000
        # once unpickled (_reply), a reply is zeroed: it held the reported leaks' addresses
        # and first bytes, which the next check would scan there
        noleaks._clear_reply(first)
        assert bytes(noleaks._REPLY[:5000]) == bytes(5000)
        second = noleaks._read_exactly(r, 3000, 5)
        assert bytes(second) == b"b" * 3000 and second.obj is buf is noleaks._REPLY
    finally:
        os.close(r)
        os.close(w)
