"""Routing a running process's malloc family through the tracking library, in process and
without LD_PRELOAD (native/mu_track.c "routing", memunreachable/track_here.py).

A fixture dlopens memunreachable/_track.so (RTLD_LOCAL) and calls mu_track_route, or a
Python program calls track_here.start(); `check` then shows each leak made after routing
with its exact allocating frames, read from the table as for `run` (test_run.py's
helpers resolve the raw pcs with addr2line against the fixtures' `@name` markers); a leak
from before routing or after mu_track_unroute has no stack; the GOT entries routing changed
hold our wrappers, and their old values again after unrouting.
"""
from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional

import pytest
from elftools.elf.elffile import ELFFile
from elftools.elf.relocation import RelocationSection

import distros
import fixtures
from memunreachable import unreachable
from test_run import PY_ENV, TRACK_LIB, frames_in, markers, python_exe, resolve, wait_in_read

ROUTE_SRC = os.path.join(fixtures.FIXTURE_DIR, "track_route.cc")
ROUTE_LIB_SRC = os.path.join(fixtures.FIXTURE_DIR, "track_route_lib.c")
PY_FIXTURE = os.path.join(fixtures.FIXTURE_DIR, "track_here_py.py")
# the malloc family entries checked word by word in the GOTs (the wrappers are exported
# under these names; dlopen/dlclose/dlsym's are hidden)
FAMILY = ("malloc", "free", "calloc", "realloc", "posix_memalign", "aligned_alloc", "memalign",
          "valloc", "pvalloc", "reallocarray", "malloc_usable_size")


def build_route_lib() -> str:
    """fixtures/track_route_lib.c as a shared library (the one loaded after routing), with
    DT_RUNPATH $ORIGIN/runpath, where fixtures/track_route_dep.c is built."""
    out = fixtures.build_dir()
    lib = os.path.join(out, "libtrack_route_lib.so")
    if not os.path.exists(lib):
        os.makedirs(os.path.join(out, "runpath"), exist_ok=True)
        subprocess.run([fixtures.compiler(), *fixtures.CFLAGS, "-shared", "-fPIC", "-o",
                        os.path.join(out, "runpath", "libtrack_route_dep.so"),
                        os.path.join(fixtures.FIXTURE_DIR, "track_route_dep.c")], check=True)
        subprocess.run([fixtures.compiler(), *fixtures.CFLAGS, "-shared", "-fPIC", "-o", lib,
                        "-Wl,--enable-new-dtags,-rpath,$ORIGIN/runpath", ROUTE_LIB_SRC, "-ldl"],
                       check=True)
    return lib


def build_route_fixture() -> tuple:
    """(exe, lib) of fixtures/track_route.cc (g++) and its dlopen'ed library (cc)."""
    exe = os.path.join(fixtures.build_dir(), "track_route")
    if not os.path.exists(exe):
        assert shutil.which("g++"), "g++ is needed for the C++ operator new leak (apt-get install g++)"
        subprocess.run(["g++", *fixtures.CFLAGS, "-o", exe, ROUTE_SRC, "-ldl", "-pthread"], check=True)
    return exe, build_route_lib()


class Session:
    """A fixture speaking the ready protocol over several phases: read_phase() returns once
    it printed `ready`, with what it printed (blocks, expect, got, wrapper, real)."""

    def __init__(self, argv: List[str], env: Optional[dict] = None):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env)
        self.buf = b""
        self.pid = 0
        self.blocks: Dict[str, fixtures.Block] = {}
        self.expect: Dict[str, int] = {}
        self.words: Dict[str, int] = {}

    def read_phase(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                p = line.decode().split()
                if p[:1] == ["ready"]:
                    return
                if fixtures.handshake_line(p, self):
                    continue
                if p[:1] == ["got"]:
                    self.words["got_" + p[1]] = int(p[2], 16)
                elif p[:1] in (["wrapper"], ["real"]):
                    self.words[p[0]] = int(p[1], 16)
            r, _, _ = select.select([self.proc.stdout], [], [], max(deadline - time.monotonic(), 0))
            chunk = os.read(self.proc.stdout.fileno(), 65536) if r else b""
            if not chunk:
                self.kill()
                raise AssertionError(f"no ready line (rc {self.proc.returncode}): "
                                     f"{self.proc.stderr.read().decode(errors='replace')}")
            self.buf += chunk

    def send(self, text: str) -> None:
        self.proc.stdin.write(text.encode() + b"\n")
        self.proc.stdin.flush()

    def finish(self) -> None:
        out, err = self.proc.communicate(b"quit\n", timeout=30)
        assert self.proc.returncode == 0 and b"bye" in out, (self.proc.returncode, err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=10)


def mapped_objects(pid: int) -> Dict[str, int]:
    """{path: load base} of the file-backed objects mapped in pid (base: the mapping at
    file offset 0)."""
    out = {}
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith("/") and int(parts[2], 16) == 0:
                out.setdefault(parts[5], int(parts[0].split("-")[0], 16))
    return out


def dynsym(path: str) -> Dict[str, int]:
    """{name: st_value} of the symbols path defines (its .dynsym)."""
    with open(path, "rb") as f:
        elf = ELFFile(f)
        return {s.name: s["st_value"] for s in elf.get_section_by_name(".dynsym").iter_symbols()
                if s["st_shndx"] != "SHN_UNDEF"}


def got_words(pid: int, path: str, base: int) -> Dict[str, List[int]]:
    """{name: [word, ...]}: what the JUMP_SLOT and GLOB_DAT entries of FAMILY in the object
    at path (loaded at base in pid) hold now, read from /proc/pid/mem."""
    slots: Dict[str, List[int]] = {}
    with open(path, "rb") as f:
        elf = ELFFile(f)
        syms = elf.get_section_by_name(".dynsym")
        for sec in elf.iter_sections():
            if not isinstance(sec, RelocationSection):
                continue
            for r in sec.iter_relocations():
                if r["r_info_type"] in (6, 7):       # R_X86_64_GLOB_DAT, R_X86_64_JUMP_SLOT
                    name = syms.get_symbol(r["r_info_sym"]).name
                    if name in FAMILY:
                        slots.setdefault(name, []).append(base + r["r_offset"])
    out: Dict[str, List[int]] = {}
    with open(f"/proc/{pid}/mem", "rb") as mem:
        for name, addrs in slots.items():
            for a in addrs:
                mem.seek(a)
                out.setdefault(name, []).append(int.from_bytes(mem.read(8), "little"))
    return out


def family_gots(pid: int, names=("libc.so", "libstdc++")) -> Dict[str, Dict[str, List[int]]]:
    objs = mapped_objects(pid)
    found = {n: next((p for p in objs if n in os.path.basename(p)), None) for n in names}
    assert all(found.values()), f"not mapped in {pid}: {found}"
    return {n: got_words(pid, p, objs[p]) for n, p in found.items()}


@pytest.mark.ptrace
def test_route_c_and_cpp():
    """Every allocation made after mu_track_route has its exact allocating frames: malloc,
    calloc, realloc, posix_memalign from the program, strdup through libc's own GOT, operator
    new through libstdc++'s, a library dlopen'ed after routing, and a malloc pointer dlsym'd
    while routed. The leak from before routing has no stack; the GOT entries of the family in
    the program, libc and libstdc++ hold our wrappers; route twice changes nothing; a bare
    name dlopen'ed by a library with a DT_RUNPATH is found through it. After
    mu_track_unroute: every such entry holds what it held before routing again, no leak has a
    stack (the table stopped recording), and blocks freed across the switch were harmless."""
    exe, lib = build_route_fixture()
    marks, lib_marks = markers(ROUTE_SRC), markers(ROUTE_LIB_SRC)
    s = Session([exe, TRACK_LIB, lib])
    try:
        s.read_phase()
        before = family_gots(s.pid)
        s.send("route")
        s.read_phase()
        assert s.expect["route_rc"] == 0 and s.expect["route_again_rc"] == 0
        assert s.expect["runpath_dlopen"] == 1      # the routed dlopen kept its caller's RUNPATH
        assert s.words["got_malloc"] == s.words["wrapper"] != s.words["real"]
        objs = mapped_objects(s.pid)
        track_base = objs[os.path.realpath(TRACK_LIB)]
        wrappers = {n: track_base + v for n, v in dynsym(TRACK_LIB).items() if n in FAMILY}
        routed = family_gots(s.pid)
        assert set(routed["libc.so"]) >= {"malloc", "free", "calloc", "realloc"}
        assert set(routed["libstdc++"]) >= {"malloc", "free"}
        for obj, words in routed.items():
            for name, values in words.items():
                assert values == [wrappers[name]] * len(values), (obj, name)

        info = unreachable.check(s.pid, limit=None)
        leaks = {l.address: l for l in info.leaks}
        want = {k: s.blocks[k].address for k in ("pre", "malloc", "calloc", "realloc", "strdup",
                                                 "memalign", "new", "lib", "dlsym")}
        assert set(want.values()) <= set(leaks), {k: hex(a) for k, a in want.items() if a not in leaks}
        assert leaks[want["pre"]].stack_status == "untracked"
        for kind in ("malloc", "calloc", "realloc", "memalign", "dlsym"):
            leak = leaks[want[kind]]
            assert leak.stack_status == "recorded", kind
            assert resolve(leak.stack[0], info.modules)[0] == exe, kind   # no frame of ours
            got = frames_in(leak, info.modules, exe)
            assert got[:2] == [(f"leak_{kind}", "track_route.cc", marks[f"r-{kind}"]),
                               ("main", "track_route.cc", got[1][2])], (kind, got)
        strdup = leaks[want["strdup"]]
        first = resolve(strdup.stack[0], info.modules)
        assert "libc.so" in first[0] and first[1].endswith("strdup"), first
        assert frames_in(strdup, info.modules, exe)[0] == ("leak_strdup", "track_route.cc", marks["r-strdup"])
        new = leaks[want["new"]]
        first = resolve(new.stack[0], info.modules)
        assert "libstdc++" in first[0] and first[1].startswith("operator new"), first
        assert frames_in(new, info.modules, exe)[0] == ("leak_new", "track_route.cc", marks["r-new"])
        in_lib = leaks[want["lib"]]
        assert resolve(in_lib.stack[0], info.modules) == (lib, "lib_leak", "track_route_lib.c",
                                                         lib_marks["lib-malloc"])
        assert frames_in(in_lib, info.modules, exe)[0] == ("leak_lib", "track_route.cc", marks["r-lib"])

        s.send("unroute")
        s.read_phase()
        assert s.expect["unroute_rc"] == 0
        assert s.words["got_malloc"] == s.words["real"] and s.words["got_free"] != s.words["wrapper"]
        assert family_gots(s.pid) == before     # libc's lazy stubs too (realloc@plt unbound)
        info = unreachable.check(s.pid, limit=None)
        leaks = {l.address: l for l in info.leaks}
        assert leaks[s.blocks["after"].address].stack_status == "untracked"
        # recording stopped: frees no longer reach the table, so an entry may name a block
        # that was freed and whose address was reused: no stack is read from it any more (and
        # the table is still no root: every leak is still found)
        assert leaks[want["malloc"]].stack_status == "untracked"
        assert info.tracking["recording"] is False
        s.finish()
    except BaseException:
        s.kill()
        raise


@pytest.mark.parametrize("root", [None, pytest.param("trixie", marks=pytest.mark.distro),
                                  pytest.param("sid", marks=pytest.mark.distro)])
def test_route_toggles_under_churn(root):
    """4 threads allocate (malloc, calloc, realloc, posix_memalign, strdup), check and free
    blocks while the main thread routes and unroutes 50 times and a fifth thread forks
    children that dlopen a new library: blocks cross the switch both ways, no crash, no block
    corrupted (the program checks each before freeing it), no child stuck on a lock a fork
    copied held (before the routing lock had fork handlers: hung 3 runs of 3), exit 0.
    Also in the Debian roots (glibc 2.41, 2.43): their libc's relocations are routed."""
    out = subprocess.run(_churn_argv(root, "50"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    assert words[-1] == "ok" and words[:2] == ["toggles", "50"]
    assert int(words[3]) > 10000 and int(words[5]) > 5     # the threads ran throughout


def _churn_argv(root, toggles: str) -> list:
    """track_route_churn's command line, on the host (root None) or inside a Debian root (the
    fixture and its companion library built by the root's gcc, the tracking library copied
    next to them)."""
    exe = fixtures.build("track_route_churn", root=root)
    if root is None:
        return [exe, TRACK_LIB, toggles]
    shutil.copy(TRACK_LIB, os.path.join(fixtures.build_dir(root), "_track.so"))
    return ["chroot", distros.root(root), exe, os.path.join(os.path.dirname(exe), "_track.so"),
            toggles]


def _churn_run(argv: list, run: int, env=None) -> str:
    """One run of track_route_churn in a session of its own; its stdout. A run that has not
    ended after 30 s is killed with its children and fails the test."""
    import signal
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)     # the hung child too
        proc.communicate()
        pytest.fail(f"run {run}: hung (a forked child stuck on a lock the fork copied held)")
    assert proc.returncode == 0, f"run {run}: {err}"
    return out


@pytest.mark.slow
def test_forks_while_other_threads_unwind_leave_no_child_stuck():
    """The churn above 100 times under load (a busy loop per CPU): a fork while another
    thread is inside the unwinder copied its lock held (libunwind's cache of register states,
    one global lock in Debian's build), and the child's first tracked malloc waited forever:
    5 of 150 runs hung before the fork handlers waited for the unwinders. A fork while the
    first route walked the loaded objects did the same to the loader's lock (the test below):
    2 of about 3,000 runs, 0 of 1,800 once the routing walked only under its lock."""
    from ptr_helpers import busy_cpus
    argv = _churn_argv(None, "50")
    with busy_cpus():
        for run in range(100):
            _churn_run(argv, run)


@pytest.mark.parametrize("root", [pytest.param(None, marks=pytest.mark.slow),  # 4 s: README budget
                                  pytest.param("trixie", marks=pytest.mark.distro),
                                  pytest.param("sid", marks=pytest.mark.distro)])
def test_forks_while_the_routing_walks_the_loaded_objects_leave_no_child_stuck(root):
    """A walk of the loaded objects (dl_iterate_phdr: the first route's setup) holds the
    loader's write lock, which fork does not reset in the child: a fork from another thread
    meanwhile left a child whose first dlopen waited forever (the churn test above, 2 of about
    3,000 runs under load). The companion library, preloaded, makes each of the main thread's
    walks sleep 30 ms with the lock held: every run hung before the routing walked only under
    its lock, which its fork handler takes. Also with the Debian roots' glibc 2.41 and 2.43."""
    argv = _churn_argv(root, "2")
    exe = argv[0] if root is None else argv[2]      # as the program sees its own path
    env = dict(os.environ, MU_SLOW_DL_ITERATE_MS="30",
               LD_PRELOAD=os.path.join(os.path.dirname(exe), "libtrack_route_churn_lib.so"))
    for run in range(3):
        words = _churn_run(argv, run, env).split()
        assert words[-1] == "ok" and int(words[5]) >= 1     # children were forked meanwhile


def python_in_root(root: str, version: str) -> tuple:
    """(argv prefix, fixture, library, PYTHONPATH) for PY_FIXTURE run by python3.N inside a
    tests/distros.py root: the package (for track_here and _track.so), the fixture and the
    library built with the root's gcc, under the root's fixture directory."""
    rpath, out = distros.root(root), fixtures.build_dir(root)
    inside = out[len(rpath):]
    pkg = os.path.join(out, "pkg")
    shutil.copytree(os.path.join(fixtures.ROOT, "memunreachable"), os.path.join(pkg, "memunreachable"),
                    ignore=shutil.ignore_patterns("__pycache__", "_native*"), dirs_exist_ok=True)
    shutil.copy(PY_FIXTURE, out)
    lib = inside + "/libtrack_route_lib.so"
    subprocess.run(["chroot", rpath, "gcc", "-O0", "-g", "-fno-omit-frame-pointer", "-shared", "-fPIC",
                    "-o", lib, inside + "/src/track_route_lib.c"], check=True)
    return (["chroot", rpath, "/usr/bin/python" + version], inside + "/" + os.path.basename(PY_FIXTURE),
            lib, inside + "/pkg")


@pytest.mark.ptrace
@pytest.mark.parametrize("root,version", [(None, "3.11"), (None, "debian")] + [
    pytest.param("sid", v, marks=pytest.mark.distro) for v in ("3.13", "3.14", "3.15")])
def test_python_track_here(root, version):
    """A Python program calls track_here.start(), then leaks through ctypes' libc.malloc and
    through a library ctypes loads after start: each leak has its Python frames exactly
    (function, file, line: the leaking line, main, <module>) and its C frames (libffi's call
    for libc.malloc; lib_leak's line for the library's own malloc@plt). pyenv's 3.11 and
    Debian's python3 here; 3.13-3.15 (frames from _Py_DebugOffsets) on sid's glibc 2.43."""
    if root is None:
        python = python_exe(version)
        argv, fixture, lib, path = [python], PY_FIXTURE, build_route_lib(), fixtures.ROOT
        host = ""
    else:
        argv, fixture, lib, path = python_in_root(root, version)
        python, host = None, distros.root(root)
    marks, lib_marks = markers(PY_FIXTURE), markers(ROUTE_LIB_SRC)
    env = dict(PY_ENV, PYTHONPATH=path, MEMUNREACHABLE_TRACK_BUDGET="256M")
    s = Session(argv + [fixture, lib], env=env)
    try:
        s.read_phase()
        wait_in_read(s.pid)
        info = unreachable.check(s.pid, limit=None)
        modules = info.modules          # paths as seen from here (a root's are prefixed)
        leaks = {l.address: l for l in info.leaks}
        for name, fn in (("libc", "leak_libc"), ("lib", "leak_lib")):
            leak = leaks.get(s.blocks[name].address)
            assert leak is not None, f"{name} missed:\n" + fixtures.explain_misses(s.pid, [s.blocks[name].address])
            assert leak.stack_status == "recorded", name
            assert leak.python_stack == [(fn, fixture, marks["py-" + name]),
                                         ("main", fixture, marks["py-main-" + name]),
                                         ("<module>", fixture, marks["py-module"])], name
        first = resolve(leaks[s.blocks["lib"].address].stack[0], modules)
        assert first == (host + lib, "lib_leak", "track_route_lib.c", lib_marks["lib-malloc"])
        libc_leak = leaks[s.blocks["libc"].address]
        assert any("ffi" in resolve(pc, modules)[0] for pc in libc_leak.stack[:4])
        if python is not None:
            version = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                     capture_output=True, text=True).stdout.strip()
        assert info.tracking["python"] == version
        s.finish()
    except BaseException:
        s.kill()
        raise
