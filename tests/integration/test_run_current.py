"""`run`'s Python frames on current distributions' interpreters (issue 22): Debian trixie's
python3.13 (3.13.5) and sid's python3.13 (3.13.18), python3.14 (3.14.10) and python3.15
(3.15.2), non-PIE static executables started inside their root (tests/distros.py; a missing
root is built, never skipped). From 3.13 on the tracking library takes the frame, code and
str offsets from the runtime's own _Py_DebugOffsets (native/mu_track.c).

The root cannot see the installed library, so each test copies _track.so and the fixture into
ROOT/tmp/mu-track/ and has `run` preload the in-root path (MEMUNREACHABLE_TRACK_LIB); the
checker runs on the host, as one checks a container.
"""
import json
import os
import shutil
import subprocess

import pytest

import distros
from memunreachable.stacks import tracking
from memunreachable import unreachable
from test_run import (PY_ENV, PY_FIXTURE, PY_RUN_OPTS, TRACK_LIB, _LINES_PROBE, markers,
                      start_run, wait_in_read)

pytestmark = [pytest.mark.ptrace, pytest.mark.distro]

# spec -> the version its python reports (what distros.py installs: a change there must show)
SPECS = {"trixie:python3.13": "3.13", "sid:python3.13": "3.13", "sid:python3.14": "3.14",
         "sid:python3.15": "3.15"}
IN_ROOT = "/tmp/mu-track"


def stage(root: str) -> str:
    """Copy the tracking library and the fixture into the root; return the in-root fixture."""
    d = os.path.join(root, IN_ROOT.lstrip("/"))
    os.makedirs(d, exist_ok=True)
    for src in (TRACK_LIB, PY_FIXTURE):
        tmp = os.path.join(d, "." + os.path.basename(src) + f".{os.getpid()}")
        shutil.copy(src, tmp)
        os.replace(tmp, os.path.join(d, os.path.basename(src)))   # never a half-copied .so
    return os.path.join(IN_ROOT, os.path.basename(PY_FIXTURE))


@pytest.mark.parametrize("spec", list(SPECS))
def test_python_frames_in_root(spec):
    """test_run.test_python_frames on each root's interpreter: the calloc made by the
    fixture's leak_here() has python_stack [leak_here, outer, <module>] with the fixture's
    marked lines exactly (the file as the interpreter saw it, the in-root path), and
    nothing else; the native stack goes through libffi or _ctypes."""
    root, _ = distros.spec_root(spec)
    script = stage(root)
    env = dict(PY_ENV, MEMUNREACHABLE_TRACK_LIB=os.path.join(IN_ROOT, "_track.so"))
    marks = markers(PY_FIXTURE)
    t = start_run(distros.python_argv(spec) + [script], *PY_RUN_OPTS, env=env)
    try:
        wait_in_read(t.pid)
        info = unreachable.check(t.pid)
        assert info.tracking is not None, "the in-root tracking library was not loaded"
        assert info.tracking["python"] == SPECS[spec]
        found = [l for l in info.leaks if 300000 <= l.size < 300000 + 4096]
        assert len(found) == 1, [(hex(l.address), l.size) for l in info.leaks]
        (leak,) = found
        assert leak.stack_status == "recorded"
        assert leak.python_stack == [("leak_here", script, marks["py-leak"]),
                                     ("outer", script, marks["py-outer"]),
                                     ("<module>", script, marks["py-module"])]
        mods = [next((m[3] for m in info.modules if m[0] <= pc < m[1]), "")
                for pc in leak.stack[:6]]
        assert any("ffi" in m or "_ctypes" in m for m in mods), mods
    finally:
        assert t.finish() == 0


@pytest.mark.parametrize("spec", list(SPECS))
def test_location_tables_match_the_interpreter(spec):
    """tracking.addr2line (the 3.11+ location table) gives, at every instruction of real
    code objects (a 300-line jump, a loop, try/except, the stdlib's json/dis/inspect), the
    line the root interpreter's own PyCode_Addr2Line gives (-1 = no line = None)."""
    out = subprocess.run(distros.python_argv(spec) + ["-c", _LINES_PROBE], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    checked = 0
    for table, first, lines in json.loads(out.stdout):
        for off, line in lines.items():
            want = None if line == -1 else line
            assert tracking.addr2line(bytes.fromhex(table), first, int(off)) == want, \
                (spec, first, off)
            checked += 1
    assert checked > 500
