"""`memunreachable run` and allocation stacks, for real.

Each test runs a fixture under `python -m memunreachable run [opts] -- PROG`, checks the
tracked process with unreachable.check() and asserts on the raw return addresses (resolved
here with addr2line against the fixture's source markers `@name`), the Python frames, the
table's counters; and on run's exit codes, LD_PRELOAD, fork following, the table-full stack.
"""
from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import pytest
from elftools.elf.elffile import ELFFile

import fixtures
import interpreters
from memunreachable import unreachable

pytestmark = pytest.mark.ptrace

RUN = [sys.executable, "-m", "memunreachable", "run"]
NO_FP = ["-O2", "-g", "-fomit-frame-pointer"]
PY_FIXTURE = os.path.join(fixtures.FIXTURE_DIR, "track_ctypes.py")
TRACK_LIB = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "memunreachable", "_track.so")


@dataclass
class Tracked:
    proc: subprocess.Popen
    pid: int = 0
    blocks: Dict[str, fixtures.Block] = field(default_factory=dict)
    expect: Dict[str, int] = field(default_factory=dict)

    def finish(self) -> int:
        """Send quit; return run's exit code (PROG's status passed through)."""
        out, err = self.proc.communicate(b"quit\n", timeout=30)
        return self.proc.returncode

    def kill(self) -> None:
        if self.pid:            # first: it holds run's stdout open (communicate waits on it)
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate(timeout=10)


def start_run(cmd: List[str], *opts: str, env: Optional[dict] = None,
              timeout: float = 30.0, hang: str = "") -> Tracked:
    """Start `run [opts] -- cmd`; return once the fixture printed `ready`. hang: what a
    missing ready line means; the message then carries every thread's backtrace (gdb)."""
    proc = subprocess.Popen(RUN + list(opts) + ["--"] + cmd, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ if env is None else env))
    t = Tracked(proc)
    buf, deadline = b"", time.monotonic() + timeout
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            parts = line.decode().split()
            if parts[:1] == ["ready"]:
                assert t.pid, "the fixture did not print its pid"
                return t
            fixtures.handshake_line(parts, t)
        left = deadline - time.monotonic()
        r, _, _ = select.select([proc.stdout], [], [], max(left, 0))
        chunk = os.read(proc.stdout.fileno(), 65536) if r else b""
        if not chunk:
            stacks = ""
            if hang and t.pid and proc.poll() is None:
                stacks = subprocess.run(["gdb", "-p", str(t.pid), "-batch", "-ex",
                                         "thread apply all bt"], capture_output=True,
                                        text=True, timeout=60).stdout
            rc = proc.poll()
            if t.pid:
                try:
                    os.kill(t.pid, 9)
                except ProcessLookupError:
                    pass
            try:
                _, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate(timeout=10)
            raise AssertionError(f"{cmd}: no ready line within {timeout} s (rc {rc}) "
                                 f"{hang}: {err.decode(errors='replace')}{stacks}")
        buf += chunk


def markers(path: str) -> Dict[str, int]:
    """{marker: line number} of the `@marker` comments in a source file."""
    out = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            for m in re.findall(r"@([\w-]+)", line):
                out[m] = n
    return out


def file_vaddr(path: str, offset: int) -> int:
    """ELF virtual address of a file offset (through the PT_LOAD holding it)."""
    with open(path, "rb") as f:
        for seg in ELFFile(f).iter_segments():
            if seg["p_type"] == "PT_LOAD" and seg["p_offset"] <= offset < seg["p_offset"] + seg["p_filesz"]:
                return offset - seg["p_offset"] + seg["p_vaddr"]
    raise AssertionError(f"offset {offset:#x} is in no PT_LOAD of {path}")


def resolve(pc: int, modules) -> tuple:
    """(module path, function, source basename, line) of a return address, with addr2line
    at pc - 1 (the call instruction)."""
    m = next((m for m in modules if m[0] <= pc < m[1]), None)
    assert m is not None, f"pc {pc:#x} is in no executable mapping"
    begin, _, off, path = m
    addr = file_vaddr(path, pc - begin + off) - 1
    out = subprocess.run(["addr2line", "-C", "-f", "-e", path, hex(addr)],
                         capture_output=True, text=True, check=True).stdout.split("\n")
    where = out[1].rsplit(":", 1)
    line = int(re.match(r"\d+", where[1]).group()) if len(where) == 2 and where[1][:1].isdigit() else 0
    return path, out[0], os.path.basename(where[0]), line


def frames_in(leak, modules, exe: str) -> List[tuple]:
    """(function, source basename, line) of the leak's frames that are in exe."""
    return [r[1:] for r in (resolve(pc, modules) for pc in leak.stack) if r[0] == exe]


def leaks_by_address(info) -> dict:
    return {l.address: l for l in info.leaks}


def run_cli(*args: str, env: Optional[dict] = None, timeout: float = 60.0, stdin=b""):
    return subprocess.run(RUN + list(args), input=stdin, capture_output=True,
                          timeout=timeout, env=env)


# ---- stacks ----------------------------------------------------------------------------

@pytest.mark.parametrize("unwinder", ["libunwind", "libgcc"])
def test_c_chain_without_frame_pointers(unwinder):
    """-O2 -fomit-frame-pointer: every leak's stack shows leaf -> mid -> top -> make_leaks
    -> main at the marked call lines; strdup's stack starts in libc; the live block made by
    the same chain is not reported; the table (which points at every block) is no root."""
    exe = fixtures.build("track_chain", NO_FP)
    marks = markers(os.path.join(fixtures.FIXTURE_DIR, "track_chain.c"))
    t = start_run([exe], "--unwinder", unwinder)
    try:
        info = unreachable.check(t.pid, limit=None)
        leaks = leaks_by_address(info)
        assert set(leaks) == {t.blocks[k].address for k in ("leak_malloc", "leak_calloc", "leak_strdup")}
        assert info.num_leaks == t.expect["num_leaks"] == 3
        table = _table_words(t.pid)
        for kind in ("malloc", "calloc", "strdup"):
            leak = leaks[t.blocks["leak_" + kind].address]
            assert leak.stack_status == "recorded"
            assert leak.address in table        # the table points at it, and it is reported
            got = frames_in(leak, info.modules, exe)
            assert got[:5] == [(f"leaf_{kind}", "track_chain.c", marks[f"{kind}-leaf"]),
                               (f"mid_{kind}", "track_chain.c", marks[f"{kind}-mid"]),
                               (f"top_{kind}", "track_chain.c", marks[f"{kind}-top"]),
                               ("make_leaks", "track_chain.c", marks[f"{kind}-outer"]),
                               ("main", "track_chain.c", marks["make-leaks"])], got
            # the report's own symbolization (step 9) names the same frames
            named = [(f.function, os.path.basename(f.file or ""), f.line)
                     for f in leak.backtrace if f.module == exe]
            assert named[:5] == got[:5], named
            first = resolve(leak.stack[0], info.modules)
            if kind == "strdup":
                assert "libc.so" in first[0] and first[1].endswith("strdup")   # __GI___strdup
            else:
                assert first[0] == exe
            assert leak.python_stack == []
        assert info.tracking["version"] == 3
        assert info.tracking["live_blocks"] >= 4 and info.tracking["stacks"] >= 4
        assert info.tracking["table_full_blocks"] == 0
        assert info.tracking["unwinder"] == unwinder
        assert info.tracking["python"] is None
        assert any(m[3] == exe for m in info.modules)
    finally:
        rc = t.finish()
    assert rc == 0


def test_stack_depth_and_fp_unwinder():
    """--stack-depth 2 keeps the two innermost frames; the fp unwinder, through code built
    without frame pointers, gets the first return address right and loses the rest (why it
    is not the default)."""
    exe = fixtures.build("track_chain", NO_FP)
    marks = markers(os.path.join(fixtures.FIXTURE_DIR, "track_chain.c"))
    for opts in (("--stack-depth", "2"), ("--unwinder", "fp")):
        t = start_run([exe], *opts)
        try:
            info = unreachable.check(t.pid)
            leak = leaks_by_address(info)[t.blocks["leak_malloc"].address]
            got = frames_in(leak, info.modules, exe)
            if opts[0] == "--stack-depth":
                assert len(leak.stack) == 2 and info.tracking["max_depth"] == 2
                assert got == [("leaf_malloc", "track_chain.c", marks["malloc-leaf"]),
                               ("mid_malloc", "track_chain.c", marks["malloc-mid"])]
            else:
                assert info.tracking["unwinder"] == "fp"
                assert got[0] == ("leaf_malloc", "track_chain.c", marks["malloc-leaf"])
                assert ("mid_malloc", "track_chain.c", marks["malloc-mid"]) not in got
        finally:
            assert t.finish() == 0


def test_usage_errors():
    assert run_cli().returncode == 2
    assert run_cli("--budget", "12x", "--", "true").returncode == 2
    assert run_cli("--stack-depth", "33", "--", "true").returncode == 2
    assert run_cli("--exitcode", "300", "--", "true").returncode == 2
    assert run_cli("--budget", "16M", "--stack-depth", "8", "--", "true").returncode == 0


def _table_words(pid: int) -> set:
    """Every 8-byte word of the tracking table's live-block tables in process pid."""
    import struct
    from memunreachable.stacks import tracking
    with open(f"/proc/{pid}/maps") as f:
        lines = f.read().splitlines()
    with open(f"/proc/{pid}/mem", "rb") as mem:
        for line in lines:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if not parts[1].startswith("rw") or len(parts) > 6 and not parts[5].startswith("[anon"):
                continue
            mem.seek(lo)
            try:
                head = mem.read(tracking.HEADER.size)
            except OSError:
                continue
            h = tracking.parse_header(head)
            if h is None:
                continue
            mem.seek(lo + h["live_arena_off"])
            data = mem.read(h["live_arena_used"])
            return set(struct.unpack(f"<{len(data) // 8}Q", data))
    raise AssertionError("no tracking table in the target")


def test_cpp_new():
    """operator new: the stack starts in libstdc++'s operator new, then the C++ callers."""
    src = os.path.join(fixtures.FIXTURE_DIR, "track_new.cpp")
    exe = os.path.join(fixtures.build_dir(), "track_new")
    subprocess.run(["g++", *NO_FP, "-o", exe, src], check=True)
    marks = markers(src)
    t = start_run([exe])
    try:
        info = unreachable.check(t.pid)
        (leak,) = info.leaks
        assert leak.address == t.blocks["leak_new"].address
        assert leak.stack_status == "recorded"
        first = resolve(leak.stack[0], info.modules)
        assert "libstdc++" in first[0] and first[1].startswith("operator new")
        assert frames_in(leak, info.modules, exe)[:3] == [
            ("leaks::build(long)", "track_new.cpp", marks["new-leak"]),
            ("leaks::Factory::make(long)", "track_new.cpp", marks["new-make"]),
            ("make_leak()", "track_new.cpp", marks["new-outer"])]
    finally:
        assert t.finish() == 0


# Every CPython whose frames the tracker reads (mu_track.c pylayouts): pyenv's 3.8-3.13 and
# Debian's python3. A missing one is a failure: the machine (or CI image) lost a version the
# tracker claims to support.
PYTHONS = ["3.8", "3.9", "3.10", "3.11", "3.12", "3.13", "debian"]


def python_exe(version: str) -> str:
    """The interpreter for a PYTHONS entry (pyenv's newest 3.N.*, or /usr/bin/python3)."""
    return interpreters.python(version)


# PYTHONMALLOC=malloc (as docs/cli.md advises for Python targets): with pymalloc, freed
# objects in its arenas (scanned as roots) keep stale pointers into memory that the leaked
# block reuses later, and the leak was "reachable" in 1 run of ~10. The bigger budget: this
# machine's pyenv 3.11.7 imports ~100 modules at start-up (site-packages .pth files) and
# interns ~34 000 stacks under PYTHONMALLOC=malloc, more than the stack arena (a quarter of
# the budget) of the default 64 MiB holds.
PY_ENV = dict(os.environ, PYTHONMALLOC="malloc")
PY_RUN_OPTS = ("--budget", "256M")


def wait_in_read(pid: int, timeout: float = 10.0) -> None:
    """Return once pid's main thread is blocked in read(2). Checked earlier (between the
    `ready` line and the read), the scanned part of its stack reaches deeper and can hold
    stale copies of the leak's address from the calloc call chain (1 run in ~30)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/syscall") as f:
            if f.read().split()[0] == "0":
                return
        time.sleep(0.005)
    raise AssertionError(f"pid {pid} did not block in read() within {timeout} s")


def _own_mapping(pid: int, size: int) -> int:
    """The address glibc gives a calloc(1, size) above its mmap threshold in pid: 16 bytes into
    the one anonymous mapping of that (page-rounded) size, or 0."""
    want = (size + 16 + 4095) // 4096 * 4096
    with open(f"/proc/{pid}/maps") as f:
        spans = [[int(x, 16) for x in line.split()[0].split("-")] for line in f]
    found = [lo + 16 for lo, hi in spans if hi - lo == want]
    return found[0] if len(found) == 1 else 0


@pytest.mark.parametrize("version", PYTHONS)
def test_python_frames(version):
    """A ctypes malloc from Python: python_stack names the line that called into C, then
    its callers, innermost first (function, file, line exactly); the native stack goes
    through libffi/_ctypes. 3.8-3.10 walk PyFrameObject.f_back, 3.11+ the interpreter
    frames; the lines come from co_lnotab (3.8/3.9), the 3.10 co_linetable, or the 3.11+
    location table."""
    python = python_exe(version)
    marks = markers(PY_FIXTURE)
    t = start_run([python, PY_FIXTURE], *PY_RUN_OPTS, env=PY_ENV)
    try:
        wait_in_read(t.pid)
        info = unreachable.check(t.pid)
        found = [l for l in info.leaks if 300000 <= l.size < 300000 + 4096]  # calloc(1, 300000)
        if not found:       # a rare miss (1 CI run): say which word kept the block
            addr = _own_mapping(t.pid, 300000)
            assert found, f"missed {addr and hex(addr)}:\n" + fixtures.explain_misses(t.pid, [addr])
        (leak,) = found
        assert leak.stack_status == "recorded"
        assert leak.python_stack[:3] == [("leak_here", PY_FIXTURE, marks["py-leak"]),
                                         ("outer", PY_FIXTURE, marks["py-outer"]),
                                         ("<module>", PY_FIXTURE, marks["py-module"])]
        assert len(leak.python_stack) == 3
        assert any("ffi" in resolve(pc, info.modules)[0] for pc in leak.stack[:4])
        ver = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True).stdout.strip()
        assert info.tracking["python"] == ver
        if version != "debian":
            assert ver == version
    finally:
        assert t.finish() == 0


# Run by each interpreter: for code objects of its stdlib and one with long jumps, the line
# table's bytes and the line CPython itself gives (PyCode_Addr2Line, through ctypes) at
# every instruction.
_LINES_PROBE = r'''
import ctypes, inspect, json, sys
a2l = ctypes.pythonapi.PyCode_Addr2Line
a2l.argtypes, a2l.restype = [ctypes.py_object, ctypes.c_int], ctypes.c_int
src = ("def far(x):\n    y = x + 1\n    z = [y,\n         y * 2]\n" + "\n" * 300 +
       "    for i in range(3):\n        try:\n            y += i\n"
       "        except Exception:\n            pass\n" + "\n" * 40 +
       "    return len(z) + \\\n        y\n")
ns = {}
exec(compile(src, "far.py", "exec"), ns)
import dis, json.encoder
codes = [ns["far"].__code__, json.dumps.__code__, json.JSONEncoder.iterencode.__code__,
         dis.dis.__code__, inspect.getsource.__code__, inspect.signature.__code__]
codes += [c for c in json.encoder._make_iterencode.__code__.co_consts if hasattr(c, "co_code")]
attr = "co_lnotab" if sys.version_info < (3, 10) else "co_linetable"
print(json.dumps([[getattr(co, attr).hex(), co.co_firstlineno,
                   {off: a2l(co, off) for off in range(0, len(co.co_code), 2)}]
                  for co in codes]))
'''


@pytest.mark.parametrize("version", ["3.8", "3.9", "3.10"])
def test_old_line_tables_match_the_interpreter(version):
    """tracking's co_lnotab (3.8/3.9) and 3.10 co_linetable decoders give, at every
    instruction of real code objects (one with a 300-line jump, a loop, try/except), the
    line the interpreter's own PyCode_Addr2Line gives (-1 = no line = None): ~1000
    instructions per version."""
    import json
    from memunreachable.stacks import tracking
    decode = tracking.linetable310_line if version == "3.10" else tracking.lnotab_line
    out = subprocess.run([python_exe(version), "-c", _LINES_PROBE], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    codes = json.loads(out.stdout)
    assert len(codes) >= 7
    checked = nolines = 0
    for table, first, lines in codes:
        for off, line in lines.items():
            want = None if line == -1 else line
            nolines += want is None
            assert decode(bytes.fromhex(table), first, int(off)) == want, (version, first, off)
            checked += 1
    assert checked > 500
    if version == "3.10":
        assert nolines > 0          # the -128 "no line" entries were exercised


RUST_FIXTURE = os.path.join(fixtures.FIXTURE_DIR, "leaky_rs.rs")


def build_rust(out_dir: str, mangling: str) -> str:
    """fixtures/leaky_rs.rs built with rustc: debuginfo, no frame pointers, opt-level 1
    (make_leak is #[inline(never)]), legacy or v0 symbol mangling."""
    rustc = shutil.which("rustc")
    assert rustc, "rustc is needed to build the Rust fixture (rustup, or apt-get install rustc)"
    exe = os.path.join(out_dir, f"leaky_rs_{mangling}")
    cmd = [rustc, "-g", "-C", "opt-level=1", "-C", "force-frame-pointers=no", "-o", exe,
           RUST_FIXTURE]
    if mangling == "v0":        # legacy is the default (naming it needs -Z unstable-options)
        cmd[1:1] = ["-C", "symbol-mangling-version=v0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(cmd)} failed: {r.stderr}"
    return exe


@pytest.mark.parametrize("mangling", ["legacy", "v0"])
def test_rust_names_demangled(tmp_path, mangling):
    """A Vec leaked by a Rust function: the report names the frames as Rust paths without
    hashes (legacy ::h<hash> and v0 crate[disambiguator] both dropped, as DWARF names them),
    with the allocating line and the caller's line; every frame of the stack, Rust's
    precompiled std (v0-mangled) included, is demangled."""
    exe = build_rust(str(tmp_path), mangling)
    syms = [l.split()[-1] for l in subprocess.run(["nm", exe], capture_output=True, text=True,
                                                  check=True).stdout.splitlines()]
    (mangled,) = [n for n in syms if "make_leak" in n]
    assert mangled.startswith("_RNv" if mangling == "v0" else "_ZN8leaky_rs9make_leak17h")
    marks = markers(RUST_FIXTURE)
    t = start_run([exe])
    try:
        info = unreachable.check(t.pid)
        leak = leaks_by_address(info).get(t.blocks["leak"].address)
        assert leak is not None, [hex(l.address) for l in info.leaks]
        assert leak.stack_status == "recorded"
        own = [(f.function, f.file, f.line) for f in leak.backtrace
               if f.module == exe and not f.inlined]
        i = next(i for i, f in enumerate(own) if f[0] == "leaky_rs::make_leak")
        assert own[i:i + 2] == [("leaky_rs::make_leak", RUST_FIXTURE, marks["rs-alloc"]),
                                ("leaky_rs::main", RUST_FIXTURE, marks["rs-call"])]
        names = [f.function for f in leak.backtrace if f.function]
        assert len(names) >= 5
        for n in names:
            assert not n.startswith(("_R", "_ZN")), n
            assert not re.search(r"\[[0-9a-f]{6,16}\]|::h[0-9a-f]{16}$", n), n
    finally:
        assert t.finish() == 0


SIGNAL_FIXTURE = os.path.join(fixtures.FIXTURE_DIR, "track_signals.c")


def test_signal_handlers_allocate_while_threads_churn():
    """Async-signal tolerance: for 2.5 s, ITIMER_PROF and a signaller thread interrupt two
    threads churning malloc/calloc/realloc/free through the tracker, and the handler
    allocates, reallocs and frees (except while the thread is inside glibc's allocator,
    which is not async-signal-safe: fixtures/track_signals_lib.c, a shim under the tracker,
    says when). The program must finish (no deadlock: its threads' backtraces are shown if
    not), exit 0, and the check must find exactly its 5 leaks, each with the stack of its
    allocating function, the 2 made inside a handler through the signal frame."""
    exe = fixtures.build("track_signals")
    shim = os.path.join(fixtures.build_dir(), "libtrack_signals_lib.so")
    marks = markers(SIGNAL_FIXTURE)
    t = start_run([exe, "2500"], env=dict(os.environ, LD_PRELOAD=shim), timeout=40,
                  hang="after 2.5 s of signal-handler churn: a deadlock or a crash in the tracker?")
    try:
        # the storm was real: thousands of handler runs, hundreds inside the tracker's code
        assert t.expect["signals"] >= 1000, t.expect
        assert t.expect["handler_allocs"] >= 1000, t.expect
        assert t.expect["in_tracker"] >= 100, t.expect
        info = unreachable.check(t.pid)
        want = {t.blocks[k].address: k for k in ("churn0", "churn1", "async0", "async1", "raise")}
        assert set(leaks_by_address(info)) == set(want)
        assert info.num_leaks == t.expect["num_leaks"] == 5
        for leak in info.leaks:
            kind = want[leak.address]
            assert leak.stack_status == "recorded", kind
            named = [(f.function, os.path.basename(f.file or ""), f.line)
                     for f in leak.backtrace if f.module == exe and not f.inlined]
            funcs = [n[0] for n in named]
            if kind.startswith("churn"):
                assert named[0] == ("leak_in_churn", "track_signals.c", marks["sig-churn"]), named
                assert "churn_loop" in funcs[1:], named
            elif kind.startswith("async"):
                assert named[:2] == [("leak_from_async_handler", "track_signals.c",
                                      marks["sig-async"]),
                                     ("on_signal", "track_signals.c", marks["sig-async-call"])], named
                assert "churn_loop" in funcs[2:], named         # past the signal frame
            else:
                assert named[:2] == [("leak_from_raise_handler", "track_signals.c",
                                      marks["sig-raise"]), ("on_raise", "track_signals.c",
                                                            marks["sig-on-raise"])], named
                assert "main" in funcs[2:], named
    finally:
        rc = t.finish()
    assert rc == 0


def test_fork_followed_and_not():
    """A leak made in a forked child has its stack; with --no-follow-fork the child has
    no table (untracked) and the leak is still found."""
    exe = fixtures.build("track_fork", NO_FP)
    marks = markers(os.path.join(fixtures.FIXTURE_DIR, "track_fork.c"))
    for opts, status in (((), "recorded"), (("--no-follow-fork",), "untracked")):
        t = start_run([exe], *opts)
        try:
            info = unreachable.check(t.pid)
            (leak,) = info.leaks
            assert leak.address == t.blocks["child_leak"].address
            assert leak.stack_status == status
            if status == "recorded":
                assert frames_in(leak, info.modules, exe)[:2] == [
                    ("child_leak", "track_fork.c", marks["fork-leak"]),
                    ("make_leak", "track_fork.c", marks["fork-make"])]
                assert info.tracking is not None
            else:
                assert leak.stack == [] and info.tracking is None
        finally:
            assert t.finish() == 0


def test_table_full():
    """--budget 1M: after 4096 distinct stacks, a new leak gets the "[stack table full]"
    stack (status table_full, counted), a leak made before keeps its stack."""
    exe = fixtures.build("track_full")
    t = start_run([exe], "--budget", "1M")
    try:
        info = unreachable.check(t.pid)
        leaks = leaks_by_address(info)
        before, after = leaks[t.blocks["before"].address], leaks[t.blocks["after"].address]
        assert before.stack_status == "recorded" and before.stack
        assert after.stack_status == "table_full" and after.stack == []
        tr = info.tracking
        assert tr["budget_bytes"] == 1 << 20
        assert tr["table_full_blocks"] >= 1
        assert 1 <= tr["stacks"] < 4096
        assert tr["used_bytes"] <= tr["budget_bytes"]
        # never silent: the report says how many blocks have no stack, and why
        assert any(w.startswith(f"{tr['table_full_blocks']} block(s) got no allocation stack")
                   and "1 MiB budget" in w for w in info.warnings), info.warnings
    finally:
        assert t.finish() == 0


# ---- run's behaviour ---------------------------------------------------------------------

def test_exit_status_passed_through():
    assert run_cli("--", "sh", "-c", "exit 7").returncode == 7
    assert run_cli("--", "/bin/true").returncode == 0
    r = run_cli("--", "sh", "-c", "kill -TERM $$")
    assert r.returncode == 128 + 15


def test_not_found_and_not_executable(tmp_path):
    r = run_cli("--", "no-such-program-mu")
    assert r.returncode == 127 and b"command not found" in r.stderr
    r = run_cli("--", str(tmp_path / "missing"))
    assert r.returncode == 127
    f = tmp_path / "data.txt"
    f.write_text("hello\n")
    r = run_cli("--", str(f))
    assert r.returncode == 126 and b"not executable" in r.stderr
    r = run_cli("--", str(tmp_path))
    assert r.returncode == 126


def test_static_refused_unless_allowed(tmp_path):
    src = tmp_path / "st.c"
    src.write_text("int main(void) { return 5; }\n")
    exe = tmp_path / "st"
    subprocess.run(["cc", "-static", "-o", str(exe), str(src)], check=True)
    r = run_cli("--", str(exe))
    assert r.returncode == 126
    assert b"statically linked" in r.stderr and b"--allow-untracked" in r.stderr
    r = run_cli("--allow-untracked", "--", str(exe))
    assert r.returncode == 5


def test_setuid_refused(tmp_path):
    exe = tmp_path / "suid-true"
    shutil.copy("/bin/true", exe)
    os.chmod(exe, 0o4755)
    r = run_cli("--", str(exe))
    assert r.returncode == 126 and b"setuid" in r.stderr
    assert run_cli("--allow-untracked", "--", str(exe)).returncode == 0


def test_check_at_exit():
    """--check-at-exit: leaks -> 23 (or --exitcode) and the report on stderr naming each
    leak; a clean program keeps its status."""
    exe = fixtures.build("track_chain", NO_FP)
    r = run_cli("--check-at-exit", "--", exe, stdin=b"quit\n")
    assert r.returncode == 23, r.stderr
    out = r.stdout.decode()
    addrs = re.findall(r"block leak_\w+ 0x([0-9a-f]+)", out)
    assert len(addrs) == 3
    for a in addrs:
        assert f"unreachable at {a}" in r.stderr.decode()
    r = run_cli("--check-at-exit", "--exitcode", "42", "--", exe, stdin=b"quit\n")
    assert r.returncode == 42
    r = run_cli("--check-at-exit", "--", "sh", "-c", "exit 3")
    assert r.returncode == 3
    assert run_cli("--check-at-exit", "--", "/bin/true").returncode == 0
    # a Python program, checked after its finalization freed its code objects (the stack's
    # Python frames then point at freed memory: they must not break the check)
    r = run_cli("--check-at-exit", "--", "/usr/bin/python3", PY_FIXTURE, stdin=b"\n", env=PY_ENV)
    assert r.returncode == 23, r.stderr
    # the size the program asked for, with the usable size (issue 23)
    assert re.search(r"\n  300000 bytes \(30\d\d\d\d usable\) unreachable at [0-9a-f]+\n",
                     r.stderr.decode())


@dataclass
class ExitLeak:
    label: str
    address: int
    requested: int
    usable: int
    kind: str               # "direct" (an entry) or "indirect" (listed under one)
    marker: str             # the source line in main that allocated it


def track_exit_exe() -> str:
    """fixtures/track_exit.cpp, built -O0 -g (its blocks are made in main itself)."""
    exe = os.path.join(fixtures.build_dir(), "track_exit")
    if not os.path.exists(exe):
        subprocess.run(["g++", "-O0", "-g", "-o", exe,
                        os.path.join(fixtures.FIXTURE_DIR, "track_exit.cpp")], check=True)
    return exe


def check_exit_leaks(exe: str, marks: Dict[str, int], tmp_path) -> List[ExitLeak]:
    """One `run --check-at-exit --json` of track_exit: asserts that every block it printed
    is reported, as an entry or listed under one as the fixture says, with its usable and
    requested sizes and a stack through main at its marker line; that nothing else is; and
    that the groups add up to the leak totals. Returns the blocks."""
    out = tmp_path / "report.json"
    r = run_cli("--check-at-exit", "--json", "--limit", "0", "-o", str(out), "--", exe)
    assert r.returncode == 23, r.stderr
    expect = [ExitLeak(p[1], int(p[2], 16), int(p[3]), int(p[4]), p[5], p[6])
              for p in (line.split() for line in r.stdout.decode().splitlines())
              if p[:1] == ["leak"]]
    assert len(expect) == 13
    report = json.loads(out.read_text())
    got = {l["address"]: ("direct", l) for l in report["leaks"]}
    got.update({b["address"]: ("indirect", b) for l in report["leaks"] for b in l["indirect"]})
    assert sorted(got) == sorted(e.address for e in expect), r.stderr
    for e in expect:
        kind, block = got[e.address]
        assert (kind, block["size"], block["requested_size"]) == (e.kind, e.usable, e.requested), e
        assert block["stack_status"] == "recorded", e
        frames = [(f.get("function"), os.path.basename(f.get("file") or ""), f.get("line"))
                  for f in block["backtrace"]]
        assert ("main", "track_exit.cpp", marks[e.marker]) in frames, (e, frames)
    assert report["num_leaks"] == 13
    assert report["leak_bytes"] == sum(e.usable for e in expect)
    assert sum(g["num_allocations"] for g in report["groups"]) == report["num_leaks"]
    assert sum(g["total_size"] for g in report["groups"]) == report["leak_bytes"]
    return expect


def exit_check_rounds(rounds: int, tmp_path) -> None:
    """`rounds` exit checks of track_exit with ASLR on (the heap moves between runs)."""
    exe = track_exit_exe()
    marks = markers(os.path.join(fixtures.FIXTURE_DIR, "track_exit.cpp"))
    heaps = {check_exit_leaks(exe, marks, tmp_path)[0].address >> 12 for _ in range(rounds)}
    assert len(heaps) > 1, "the heap did not move between runs: is ASLR off?"


def test_check_at_exit_cpp_every_leak_with_its_stack(tmp_path):
    """Issue 23: a C++ program leaking in main (new, std::vector<std::string>, a list, two
    blocks of one stack sharing a child): every block found at exit, the indirect ones listed
    under one entry, each with its stack and requested size, the groups adding up to the
    totals. Before, words main left in exit()'s frames kept 1-7 of them reachable (every run
    under setarch -R), and the shared child was counted twice in the group."""
    exit_check_rounds(3, tmp_path)


@pytest.mark.slow
def test_check_at_exit_cpp_20_runs(tmp_path):
    exit_check_rounds(20, tmp_path)


def test_check_at_exit_keeps_the_exit_callers_frame():
    """exit() called from a function whose frame holds a block: the block stays reachable
    (only exit()'s own path is cut from the roots, as its caller is live for LSan too)."""
    r = run_cli("--check-at-exit", "--", track_exit_exe(), "exit-holding")
    assert r.returncode == 0, r.stderr
    assert re.search(rb"live kept 0x[0-9a-f]+", r.stdout)
    assert b"SUMMARY: memunreachable: 0 bytes leaked in 0 allocations" in r.stderr


def test_ld_preload_kept(tmp_path):
    """An existing LD_PRELOAD stays (after the tracking library), both are loaded."""
    src = tmp_path / "other.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void hi(void)'
                   ' { fputs("other-preload-loaded\\n", stderr); }\n')
    lib = tmp_path / "libother.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    env = dict(os.environ, LD_PRELOAD=str(lib))
    r = run_cli("--", "sh", "-c", 'echo "$LD_PRELOAD"; grep -c -e _track.so -e libother.so '
                "/proc/$$/maps >/dev/null && cat /proc/$$/maps", env=env)
    assert r.returncode == 0
    out = r.stdout.decode()
    assert out.splitlines()[0] == f"{TRACK_LIB}:{lib}"
    assert TRACK_LIB in out and str(lib) in out
    assert b"other-preload-loaded" in r.stderr


def test_no_follow_fork_strips_preload_for_exec():
    r = run_cli("--no-follow-fork", "--", "sh", "-c", 'echo "[$LD_PRELOAD]"')
    assert r.returncode == 0 and r.stdout.decode().strip() == "[]"
    r = run_cli("--", "sh", "-c", 'echo "[$LD_PRELOAD]"')
    assert r.stdout.decode().strip() == f"[{TRACK_LIB}]"


def test_signal_forwarded():
    """A signal sent to `run` reaches PROG; PROG's death by it is 128+N."""
    proc = subprocess.Popen(RUN + ["--", "sh", "-c", "echo up; exec sleep 30"],
                            stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"up\n"
    time.sleep(0.2)
    proc.send_signal(10)        # SIGUSR1: kills sleep
    assert proc.wait(timeout=10) == 128 + 10


def test_every_allocation_function_from_threads():
    """Blocks from malloc, calloc, realloc, reallocarray, posix_memalign, aligned_alloc,
    memalign, valloc and pvalloc, made by 4 threads that churned concurrently: the table of
    the running process holds each with its leak_<fn> frame at the marked line, then the
    thread's worker; nothing was dropped, and every churned block that was freed is gone."""
    from memunreachable.collect import procfs
    from memunreachable.stacks import tracking
    from memunreachable.collect.memory import ProcessMemory
    exe = fixtures.build("track_family", NO_FP)
    marks = markers(os.path.join(fixtures.FIXTURE_DIR, "track_family.c"))
    t = start_run([exe])
    try:
        assert len(t.blocks) == t.expect["blocks"] == 9
        maps = procfs.read_maps(t.pid)
        mem = ProcessMemory(t.pid)
        try:
            table = tracking.find_table(mem, maps)
            modules = tracking.modules(maps)
            for fn, block in t.blocks.items():
                a = table.annotate(block.address, block.size)
                assert a.status == "recorded", fn
                got = [r[1:] for r in (resolve(pc, modules) for pc in a.stack) if r[0] == exe]
                assert got[0] == (f"leak_{fn}", "track_family.c", marks[f"fam-{fn}"]), (fn, got)
                assert got[1][0] == "worker"
            s = table.summary()
        finally:
            os.close(mem.fd)
        assert s["dropped_blocks"] == 0 and s["table_full_blocks"] == 0
        # 4 x 20000 churn rounds, all freed: only the program's live blocks remain
        assert 9 <= s["live_blocks"] < 100
    finally:
        assert t.finish() == 0


@pytest.mark.parametrize("opts", [(), ("--no-follow-fork",)])
def test_fork_while_threads_allocate(opts):
    """200 forks while 3 threads churn malloc/free: every child frees the threads' blocks
    and allocates through the tracking library and exits 0, no deadlock (the atfork
    handlers hold every shard lock across fork; without them this deadlocked in 10 runs
    out of 10 when written), with children tracked or not."""
    exe = fixtures.build("track_forks", ["-O2"])
    r = run_cli(*opts, "--", exe, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().split() == ["forks", "200", "bad", "0"]


DOMAINS_FIXTURE = os.path.join(fixtures.FIXTURE_DIR, "track_domains.py")


@pytest.mark.parametrize("version, how", [("3.8", "now"), ("3.11", "now"), ("3.13", "now"),
                                          ("3.11", "later"), ("3.13", "later")])
def test_python_objects_get_stacks_and_epochs_once_the_domains_are_routed(version, how):
    """With CPython's default allocator (pymalloc), an object's block never passes through
    malloc: mu_track_route_python wraps the MEM and OBJ domains, and each leaked object then
    has its Python frames and the epoch set when it was allocated; after
    mu_track_unroute_python a new one has none."""
    python = python_exe(version)
    marks = markers(DOMAINS_FIXTURE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONMALLOC"}
    t = start_run([python, DOMAINS_FIXTURE, TRACK_LIB, how], *PY_RUN_OPTS, env=env)
    try:
        wait_in_read(t.pid)
        info = unreachable.check(t.pid)
        got = leaks_by_address(info)
        a, b, c = (got.get(t.blocks[k].address) for k in ("int_a", "bytes_b", "int_c"))
        assert a is not None and b is not None and c is not None, (t.blocks, list(got))
        assert (a.python_type, a.stack_status, a.epoch) == ("int", "recorded", 7)
        assert a.python_stack[0] == ("leak_int", DOMAINS_FIXTURE, marks["dom-int"])
        assert (b.python_type, b.stack_status, b.epoch) == ("bytes", "recorded", 8)
        assert b.python_stack[0] == ("leak_bytes", DOMAINS_FIXTURE, marks["dom-bytes"])
        assert (c.python_type, c.stack_status, c.epoch) == ("int", "untracked", None)
    finally:
        assert t.finish() == 0
