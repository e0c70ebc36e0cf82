"""`memunreachable track PID` / `track --stop PID`: allocation stacks for a process started
normally (no preload), by an injected dlopen + mu_track_route (memunreachable/track_pid.py,
inject.py, native/mu_ptrace.c mu_inject_call).

Each leak made after `track` has its exact allocating frames (addr2line against the
fixtures' `@name` markers, as test_run.py); one made before has none; the GOT entries of the
malloc family hold the library's wrappers while tracked and their old values after `track
--stop` (read from /proc/PID/mem, as test_track_here.py); a target whose every thread churns
malloc/free is tracked and keeps its data; a checker SIGKILLed at each step of each call
leaves the target running (tracked or not, never stopped) and `track --stop` still works.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import distros
import fixtures
from ptr_helpers import assert_running, moves, wait_until
from test_run import PY_ENV, TRACK_LIB, frames_in, markers, python_exe, resolve, wait_in_read
from test_track_here import FAMILY, Session, dynsym, family_gots, mapped_objects
from memunreachable.sweep import detect
from memunreachable.collect import inject, procfs
from memunreachable import track_pid, unreachable
from memunreachable._errors import CollectionError, NoSuchProcess, UnsupportedTarget
from memunreachable.collect.freeze import frozen
from memunreachable.collect.sites import find_guard
from memunreachable._ffi import lib

pytestmark = pytest.mark.ptrace

CLI = [sys.executable, "-m", "memunreachable"]
SRC = os.path.join(fixtures.FIXTURE_DIR, "track_pid.c")
CPP_SRC = os.path.join(fixtures.FIXTURE_DIR, "track_pid_new.cc")
PY_SRC = os.path.join(fixtures.FIXTURE_DIR, "track_pid_py.py")
CALL_STEPS = {"call started": lib.MU_STEP_SETREGS, "call returned": lib.MU_STEP_ENTER,
              "thread state restored": lib.MU_STEP_EXIT, "restore": lib.MU_STEP_RESTORED}


def track(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + ["track", *args], capture_output=True, text=True, timeout=60)


def wrappers(pid: int) -> dict:
    """{name: address} of the library's wrappers of FAMILY in pid."""
    base = mapped_objects(pid)[os.path.realpath(TRACK_LIB)]
    return {n: base + v for n, v in dynsym(TRACK_LIB).items() if n in FAMILY}


def assert_routed(gots: dict, pid: int) -> None:
    want = wrappers(pid)
    assert set(gots["libc.so"]) >= {"malloc", "free", "calloc", "realloc"}
    for obj, words in gots.items():
        for name, values in words.items():
            assert values == [want[name]] * len(values), (obj, name)


def build_cpp() -> str:
    exe = os.path.join(fixtures.build_dir(), "track_pid_new")
    if not os.path.exists(exe):
        assert shutil.which("g++"), "g++ is needed for the operator new fixture (apt-get install g++)"
        subprocess.run(["g++", *fixtures.CFLAGS, "-o", exe, CPP_SRC], check=True)
    return exe


def test_track_a_running_c_service():
    """track: the GOT entries of the malloc family (the program's, libc's) hold the wrappers;
    leaks made since have their exact frames (malloc, calloc, realloc in the program; strdup
    through libc's own GOT), the one made before has none; track again: nothing changes.
    track --stop: every entry holds its old value again and a new leak has no stack. track
    once more (the library is loaded already): stacks again."""
    exe = fixtures.build("track_pid", root=None)
    marks = markers(SRC)
    objs = ("libc.so", os.path.basename(exe))
    s = Session([exe])
    try:
        s.read_phase()
        before = family_gots(s.pid, objs)
        r = track(str(s.pid))
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(f"tracking allocations of process {s.pid} (track_pid) since "), r.stdout
        assert_routed(family_gots(s.pid, objs), s.pid)
        s.send("leak a")
        s.read_phase()
        assert s.words["got_malloc"] == wrappers(s.pid)["malloc"]
        info = unreachable.check(s.pid, limit=None)
        leaks = {l.address: l for l in info.leaks}
        assert leaks[s.blocks["pre_malloc"].address].stack_status == "untracked"
        for kind in ("malloc", "calloc", "realloc"):
            leak = leaks[s.blocks["a_" + kind].address]
            assert leak.stack_status == "recorded", kind
            assert resolve(leak.stack[0], info.modules)[0] == exe, kind    # no frame of ours
            got = frames_in(leak, info.modules, exe)
            assert got[:3] == [(f"leak_{kind}", "track_pid.c", marks["p-" + kind]),
                               ("make_leaks", "track_pid.c", got[1][2]),
                               ("serve", "track_pid.c", got[2][2])], (kind, got)
        strdup = leaks[s.blocks["a_strdup"].address]
        first = resolve(strdup.stack[0], info.modules)
        assert "libc.so" in first[0] and first[1].endswith("strdup"), first
        assert frames_in(strdup, info.modules, exe)[0] == ("leak_strdup", "track_pid.c", marks["p-strdup"])

        r = track(str(s.pid))
        assert r.returncode == 0 and "is already tracked (since " in r.stdout, (r.stdout, r.stderr)
        r = track("--stop", str(s.pid))
        assert r.returncode == 0 and r.stdout.startswith(f"stopped tracking allocations of process {s.pid}"), r
        assert family_gots(s.pid, objs) == before
        s.send("leak b")
        s.read_phase()
        assert s.words["got_malloc"] != wrappers(s.pid)["malloc"]
        leaks = {l.address: l for l in unreachable.check(s.pid, limit=None).leaks}
        assert all(leaks[s.blocks[f"b_{k}"].address].stack_status == "untracked"
                   for k in ("malloc", "calloc", "realloc", "strdup"))
        r = track("--stop", str(s.pid))
        assert r.returncode == 0 and "is not tracked: nothing to stop" in r.stdout, r

        before = family_gots(s.pid, objs)       # calloc@plt & co. bound by "leak b" since
        r = track(str(s.pid))                   # the library is there already: route only
        assert r.returncode == 0 and r.stdout.startswith("tracking allocations"), r
        assert_routed(family_gots(s.pid, objs), s.pid)
        s.send("leak c")
        s.read_phase()
        info = unreachable.check(s.pid, limit=None)
        leak = {l.address: l for l in info.leaks}[s.blocks["c_malloc"].address]
        assert frames_in(leak, info.modules, exe)[0] == ("leak_malloc", "track_pid.c", marks["p-malloc"])
        assert track("--stop", str(s.pid)).returncode == 0
        assert family_gots(s.pid, objs) == before
        s.finish()
    except BaseException:
        s.kill()
        raise


def test_track_a_process_whose_threads_all_wait_in_futexes():
    """Every thread waits in a futex inside libc, as an idle thread pool does: main in
    pthread_join, two in pthread_cond_wait, the one serving commands in a 20 ms
    pthread_cond_timedwait between non-blocking reads. None waits on an arena's lock, so track
    picks one (it refused after 20 freezes when any futex wait in libc counted as inside
    malloc); a leak made since has its exact frames."""
    exe = fixtures.build("track_pid", root=None)
    marks = markers(SRC)
    s = Session([exe, "condvar"])
    try:
        s.read_phase()
        tasks = os.listdir(f"/proc/{s.pid}/task")
        deadline = time.monotonic() + 10
        while True:             # the premise: all 4 threads in futex (202) at one moment
            calls = [open(f"/proc/{s.pid}/task/{t}/syscall").read().split()[0] for t in tasks]
            if len(tasks) == 4 and calls == ["202"] * 4 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert len(tasks) == 4 and calls == ["202"] * 4, calls
        r = track(str(s.pid))
        assert r.returncode == 0, r.stderr
        s.send("leak a")
        s.read_phase()
        info = unreachable.check(s.pid, limit=None)
        leak = {l.address: l for l in info.leaks}[s.blocks["a_malloc"].address]
        got = frames_in(leak, info.modules, exe)
        assert got[:3] == [("leak_malloc", "track_pid.c", marks["p-malloc"]),
                           ("make_leaks", "track_pid.c", got[1][2]),
                           ("serve", "track_pid.c", got[2][2])], got
    finally:
        s.finish()


def test_track_a_running_cpp_service():
    """operator new and new[] (libstdc++'s malloc@plt) of a C++ program started normally:
    the leaks made after `track` have their frames; the one made before has none."""
    exe = build_cpp()
    marks = markers(CPP_SRC)
    s = Session([exe])
    try:
        s.read_phase()
        r = track(str(s.pid))
        assert r.returncode == 0, r.stderr
        assert_routed(family_gots(s.pid, ("libc.so", "libstdc++")), s.pid)
        s.send("leak")
        s.read_phase()
        info = unreachable.check(s.pid, limit=None)
        leaks = {l.address: l for l in info.leaks}
        assert leaks[s.blocks["pre"].address].stack_status == "untracked"
        for label, fn, mark, op in (("node", "leak_new", "n-new", "operator new"),
                                    ("array", "leak_array", "n-array", "operator new")):
            leak = leaks[s.blocks[label].address]
            first = resolve(leak.stack[0], info.modules)
            assert "libstdc++" in first[0] and first[1].startswith(op), first
            assert frames_in(leak, info.modules, exe)[0] == (fn, "track_pid_new.cc", marks[mark])
        assert track("--stop", str(s.pid)).returncode == 0
        s.finish()
    except BaseException:
        s.kill()
        raise


def python_leak_after_track(s: Session, request: str, *opts: str):
    """`track [opts] PID` of track_pid_py.py's session s, then its leak `request`, checked:
    (info, the leak, what track printed)."""
    r = track(*opts, str(s.pid))
    assert r.returncode == 0, r.stderr
    s.send(request)
    s.read_phase()
    wait_in_read(s.pid)
    info = unreachable.check(s.pid, limit=None)
    leak = {l.address: l for l in info.leaks}.get(s.blocks[request].address)
    assert leak is not None, fixtures.explain_misses(s.pid, [s.blocks[request].address])
    return info, leak, r.stdout


@pytest.mark.parametrize("version", ["3.11", "debian"])
def test_track_a_running_python(version):
    """A CPython process started normally (PYTHONMALLOC=malloc): a block it mallocs through
    ctypes after `track` has its exact Python frames (function, file, line of the call, its
    caller, <module>) and a libffi frame; --stop puts libc's entries back."""
    marks = markers(PY_SRC)
    s = Session([python_exe(version), PY_SRC], env=PY_ENV)
    try:
        s.read_phase()
        before = family_gots(s.pid, ("libc.so",))
        info, leak, _ = python_leak_after_track(s, "leak")
        assert leak.stack_status == "recorded"
        assert leak.python_stack == [("leak_libc", PY_SRC, marks["pp-libc"]),
                                     ("serve", PY_SRC, marks["pp-serve"]),
                                     ("<module>", PY_SRC, marks["pp-module"])]
        assert any("ffi" in resolve(pc, info.modules)[0] for pc in leak.stack[:4])
        assert track("--stop", str(s.pid)).returncode == 0
        assert family_gots(s.pid, ("libc.so",)) == before
        s.finish()
    except BaseException:
        s.kill()
        raise


@pytest.mark.parametrize("version", ["3.11", "3.13"])
def test_track_routes_a_running_python_s_object_allocator(version):
    """Under CPython's default allocator (pymalloc), an object made after `track
    --python-objects` (once the interpreter ran Python code: it routes its domains at a
    pending-call check) has its Python frame; `track --stop` has it route them back."""
    marks = markers(PY_SRC)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONMALLOC"}
    s = Session([python_exe(version), PY_SRC], env=env)
    try:
        s.read_phase()
        _, leak, said = python_leak_after_track(s, "obj", "--python-objects")
        assert "Python objects' too once the interpreter next runs Python code" in said
        assert (leak.python_type, leak.stack_status) == ("int", "recorded")
        assert leak.python_stack[0] == ("leak_object", PY_SRC, marks["pp-obj"])
        assert track("--stop", str(s.pid)).returncode == 0
        s.finish()
    except BaseException:
        s.kill()
        raise


def ops(s: Session) -> int:
    """The fixture's operation count now."""
    s.send("ops")
    s.read_phase()
    return s.expect["ops"]


def test_every_thread_churning_is_tracked_and_keeps_its_data():
    """4 threads, the main one too, allocate, check and free blocks without pause: `track`
    finds a thread outside malloc (retrying while all are inside), routes the family, and
    they run on (more operations after) with every block intact; --stop puts the entries
    back; the program checks each block before freeing it and exits 0."""
    exe = fixtures.build("track_pid_churn", root=None)
    s = Session([exe])
    try:
        s.read_phase()
        before = family_gots(s.pid, ("libc.so",))
        r = track(str(s.pid))
        assert r.returncode == 0, r.stderr
        assert_routed(family_gots(s.pid, ("libc.so",)), s.pid)
        first = ops(s)
        time.sleep(0.3)
        assert ops(s) > first + 1000
        r = track("--stop", str(s.pid))
        assert r.returncode == 0, r.stderr
        assert family_gots(s.pid, ("libc.so",)) == before
        s.finish()
    except BaseException:
        s.kill()
        raise


def die_in_track(pid: int, step: int) -> int:
    """Fork a checker that runs `track PID` (track_pid.start) and SIGKILLs itself when an
    injected call reaches step; returns its wait status."""
    child = os.fork()
    if child == 0:
        try:
            lib.mu_test_die_at(lib.MU_CALL_NR, step, 0)
            track_pid.start(pid)
        finally:
            os._exit(3)
    return os.waitpid(child, 0)[1]


def tracked(pid: int) -> bool:
    maps = procfs.read_maps(pid)
    table = track_pid.table_of(pid, maps)
    return table is not None and table.enabled


@pytest.mark.parametrize("step", sorted(CALL_STEPS), ids=str)
def test_checker_killed_during_the_calls(step):
    """The checker SIGKILLed at a step of the dlopen call: the target runs on (no thread
    stopped, no tracer), the library loaded, not tracked; then at the same step of the
    mu_track_route call: it runs on, tracked. `track --stop` then puts every entry back, and
    the fixture's read(0) resumed without an EINTR (it exits 0)."""
    exe = fixtures.build("track_pid", root=None)
    s = Session([exe])
    try:
        s.read_phase()
        before = family_gots(s.pid, ("libc.so",))
        for want_tracked in (False, True):
            status = die_in_track(s.pid, CALL_STEPS[step])
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, hex(status)
            assert wait_until(lambda: procfs.read_status(s.pid).tracer_pid == 0, 5.0)
            assert_running(s.pid)
            assert wait_until(lambda: os.path.realpath(TRACK_LIB) in mapped_objects(s.pid), 5.0)
            assert wait_until(lambda: tracked(s.pid) == want_tracked, 5.0), want_tracked
        r = track("--stop", str(s.pid))
        assert r.returncode == 0, r.stderr
        assert family_gots(s.pid, ("libc.so",)) == before
        s.send("leak a")
        s.read_phase()
        s.finish()
    except BaseException:
        s.kill()
        raise


def test_refusals(tmp_path):
    """A static executable, a pid that does not exist, our own process: refused by name
    with a hint, exit 3; the static program runs on untouched."""
    src = tmp_path / "st.c"
    src.write_text("#include <unistd.h>\nint main(void) { char c; return read(0, &c, 1) == 1 ? 0 : 5; }\n")
    exe = tmp_path / "st"
    subprocess.run(["cc", "-static", "-o", str(exe), str(src)], check=True)
    proc = subprocess.Popen([str(exe)], stdin=subprocess.PIPE)
    try:
        assert wait_until(lambda: procfs.read_maps(proc.pid) and procfs.read_exe(proc.pid) == str(exe))
        r = track(str(proc.pid))
        assert r.returncode == 3
        assert f"error: process {proc.pid} is a static executable ({exe}): no library can be " \
               "loaded into it" in r.stderr, r.stderr
        assert "hint: `memunreachable check` still finds its leaks" in r.stderr
        assert procfs.read_status(proc.pid).tracer_pid == 0
        proc.communicate(b"x", timeout=10)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    r = track("4194304")
    assert r.returncode == 3 and "no such process" in r.stderr and "hint:" in r.stderr, r.stderr
    with pytest.raises(UnsupportedTarget, match="memunreachable's own process"):
        track_pid.start(os.getpid())
    with pytest.raises(NoSuchProcess):
        track_pid.stop(4194304)


def test_seccomp_filter_forbidding_openat_is_refused():
    """A filter that answers openat with EACCES on the only thread: refused by name (the
    thread, the rule), exit 3, with a hint; nothing was loaded and the target runs on."""
    with fixtures.start("track_pid_seccomp", root=None) as fx:
        r = track(str(fx.pid))
        assert r.returncode == 3, (r.stdout, r.stderr)
        assert f"error: no thread of process {fx.pid} may load a library under its seccomp " \
               f"rules (thread {fx.pid}: its seccomp filter returns ERRNO(EACCES) for openat)" \
               in r.stderr, r.stderr
        assert "hint: the program's seccomp filter forbids what dlopen needs" in r.stderr
        assert os.path.realpath(TRACK_LIB) not in mapped_objects(fx.pid)
        assert_running(fx.pid)


@pytest.mark.parametrize("who", ["spin", "sys"])
def test_calls_leave_every_register_as_it_was(who):
    """Calls injected into ptr_regs' spin thread (no syscall) and sys thread (in nanosleep),
    the others released: memset on a copy of data on the thread's stack (it clobbers vector
    registers), a call to address 0 (it crashes: abandoned through the frame), sleep(1) with a
    0.2 s timeout (the thaw lets it finish). After each, the thread's counter moves; at quit
    the fixture finds every general register, xmm/ymm and MXCSR of both threads intact and
    no nanosleep that returned EINTR."""
    with fixtures.start("ptr_regs", root=None) as fx:
        tid, counter = fx.expect[f"{who}_tid"], fx.expect[f"{'spins' if who == 'spin' else 'sys'}_addr"]
        maps = procfs.read_maps(fx.pid)
        libc = inject.mapped_paths(maps, detect.is_libc)[0]
        syms = inject.symbols(fx.pid, maps, libc, ["memset", "sleep"])
        for func, args, data, timeout, raises in (
                (syms["memset"], (0, 0x55, 256), b"x" * 256, 5.0, None),
                (0, (), b"", 5.0, "the function crashed"),
                (syms["sleep"], (1,), b"", 0.2, "did not return within 0.2 s")):
            with frozen(fx.pid) as fz:
                restore_rt = find_guard(fx.pid, fz.maps)[1]
                fz.release_others(tid)
                if raises is None:
                    assert inject.call(fz, tid, func, restore_rt, args, data, timeout) > 0
                else:
                    with pytest.raises(CollectionError, match=raises):
                        inject.call(fz, tid, func, restore_rt, args, data, timeout)
            assert moves(fx.pid, counter), (who, func)


@pytest.mark.distro
@pytest.mark.parametrize("root", ["trixie", "sid"])
def test_track_in_a_debian_root(root):
    """A service running in a chroot of Debian trixie (glibc 2.41) or sid (2.43): the
    library is opened through our /proc/PID/root; the leak made since has its frames, the
    one before none; --stop puts libc's entries back."""
    exe = fixtures.build("track_pid", root=root)
    host = distros.root(root)
    marks = markers(SRC)
    s = Session(["chroot", host, exe])
    try:
        s.read_phase()
        before = family_gots(s.pid, ("libc.so",))
        r = track(str(s.pid))
        assert r.returncode == 0, r.stderr
        assert_routed(family_gots(s.pid, ("libc.so",)), s.pid)
        s.send("leak a")
        s.read_phase()
        info = unreachable.check(s.pid, limit=None)
        leaks = {l.address: l for l in info.leaks}
        assert leaks[s.blocks["pre_malloc"].address].stack_status == "untracked"
        leak = leaks[s.blocks["a_malloc"].address]
        assert frames_in(leak, info.modules, host + exe)[:2] == [
            ("leak_malloc", "track_pid.c", marks["p-malloc"]),
            ("make_leaks", "track_pid.c", frames_in(leak, info.modules, host + exe)[1][2])]
        assert track("--stop", str(s.pid)).returncode == 0
        assert family_gots(s.pid, ("libc.so",)) == before
        s.finish()
    except BaseException:
        s.kill()
        raise
