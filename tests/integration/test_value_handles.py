"""Issue 23 item 2: a native block whose only handle is a Python int, bytes or float.
A handle points at most 16 bytes into its block (native/mu_types.h MU_HANDLE_SLACK): a number
deeper inside a block is no handle (Debian's non-PIE interpreter has its heap at 16 MiB-1 GiB).

ctypes' c_void_p results, cffi's int(ffi.cast("uintptr_t", p)) and numpy's
__array_interface__ hold a native block's address as an int; struct.pack("P", p) as bytes. Such
a block is in use, not leaked (python-magic keeps libmagic's handle so and failed under the
plugin): checked on every interpreter (check(pid), the targets of test_cpython_leaks), through
the pytest plugin (one test a batch and the default batches), and with python-magic (PyPI).
The twin of each: the same kind of block whose int was dropped is reported.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from inprocess_helpers import reported
from test_cpython_leaks import RESERVE, _ident, interpreters, run_target

pytestmark = pytest.mark.ptrace
pytest_plugins = ["pytester"]

# the plugin's sessions under PYTHONMALLOC=malloc: in the slow set (the README command's budget)
MALLOC = pytest.param("malloc", marks=pytest.mark.slow)
# a sweep after each test, or batches; the first in the slow set too
BATCHES = pytest.mark.parametrize(
    "batch", [pytest.param(["--memunreachable-batch=1"], marks=pytest.mark.slow), []],
    ids=["batch 1", "batches"])

LIBC = r"""
import ctypes, json, struct, sys
sys.path.insert(0, sys.argv[1])
import pyleaks
libc = ctypes.CDLL(None)
libc.calloc.restype = ctypes.c_void_p
libc.calloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
libc.malloc_usable_size.restype = ctypes.c_size_t
libc.malloc_usable_size.argtypes = [ctypes.c_void_p]
"""

HANDLES = LIBC + r"""
print("baseline", flush=True)
sys.stdin.readline()
@RESERVE@
reserve()
held, out = {}, {}

def block(k):
    # 4 MiB, calloc'ed: an mmapped chunk in address space never used before (RESERVE), zeroed
    p = libc.calloc(1, (4 << 20) + 4096 * k)
    out[k] = [f"{p:#x}", libc.malloc_usable_size(p)]    # addresses leave as text
    return p

def hold():
    held["int"] = block(0)                                  # ctypes' c_void_p result: an int
    held["bytes"] = struct.pack("P", block(1))              # 8 bytes of a bytes object
    held["float"] = struct.unpack("d", struct.pack("P", block(2)))[0]    # a float's 8 bytes
    block(3)                                                # its int dropped: a leak
    held["prefix"] = block(4) + 16          # 16 bytes in (CPython's debug hooks hand this out)
    held["inside"] = block(5) + 4096        # a number inside the block, no handle: a leak

hold()
print(json.dumps(out))
print("ready", flush=True)
sys.stdin.read(1)
""".replace("@RESERVE@", RESERVE)


@pytest.mark.parametrize("allocator", ["pymalloc", "malloc"])
@pytest.mark.parametrize("python", interpreters(), ids=_ident)
def test_blocks_held_by_an_int_bytes_or_float_are_in_use(python, allocator):
    made, info, before = run_target(python, HANDLES, allocator,
                                    expect=lambda made: [int(made[k][0], 16) for k in "35"])
    blocks = {k: (int(a, 16), size) for k, (a, size) in made.items()}
    new = {l.address: l.size for l in info.leaks if l.address not in before}
    assert new == {blocks[k][0]: blocks[k][1] for k in "35"}, \
        {hex(a): s for a, s in new.items()}     # held 0-2 and 4: not reported


# Each handle is made by one test and freed by the next: under one test a batch, the check
# after a test sees the block held by the int (bytes, float) alone (python-magic's handle
# failed so; with batches, the check came after the next test freed it). Three sizes: each
# block at an address of its own (a leak at an address and size reported before is no news).
SUITE = """
import ctypes, struct
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.malloc_usable_size.restype = ctypes.c_size_t
libc.malloc_usable_size.argtypes = [ctypes.c_void_p]
keep = []

def test_a_int_handle():
    keep.append(libc.malloc(64))

def test_b_bytes_handle():
    libc.free(keep.pop())
    keep.append(struct.pack("P", libc.malloc(100)))

def test_c_float_handle():
    libc.free(struct.unpack("P", keep.pop())[0])
    keep.append(struct.unpack("d", struct.pack("P", libc.malloc(140)))[0])

def test_d_freed():
    libc.free(struct.unpack("P", struct.pack("d", keep.pop()))[0])

def test_e_int_dropped():
    p = libc.malloc(200)
    print("LEAK", hex(p), libc.malloc_usable_size(p))
"""


@BATCHES
@pytest.mark.parametrize("allocator", ["pymalloc", MALLOC])
def test_the_plugin_keeps_handles_and_reports_the_dropped_one(pytester, monkeypatch, allocator,
                                                              batch):
    if allocator == "malloc":
        monkeypatch.setenv("PYTHONMALLOC", "malloc")
    else:
        monkeypatch.delenv("PYTHONMALLOC", raising=False)
    pytester.makepyfile(test_handles=SUITE)
    res = pytester.runpytest_subprocess("--memunreachable", *batch, "-s", "-v", "-rf")
    out = res.stdout.str()
    res.assert_outcomes(passed=4, failed=1)
    addr, size = re.search(r"LEAK 0x([0-9a-f]+) (\d+)", out).groups()
    res.stdout.fnmatch_lines(
        ["FAILED test_handles.py::test_e_int_dropped - Failed: 1 block leaked*"])
    # (tracked: "R bytes (N usable) unreachable at ..." when the size asked for is known)
    assert reported(out, addr, size), out


# python-magic (PyPI's 0.4.27, the library of 0.4.28 unchanged in what matters here) keeps
# libmagic's magic_open() handle, a 312-byte block, as a ctypes c_void_p result (an int) in
# Magic objects cached per flag set: 0.4.28's test_from_file_str_and_bytes failed under the
# plugin with "10 native heap block(s) became unreachable ... (127152 bytes)" while the handle
# was in use. The suite below drives the library as python-magic's own tests do.
MAGIC_SUITE = r"""
import os, pathlib
import magic

PDF = os.environ["MAGIC_PDF"]

def test_from_file_str_and_bytes():
    assert magic.from_file(PDF, mime=True) == "application/pdf"
    assert magic.from_file(PDF.encode(), mime=True) == "application/pdf"

def test_description_and_pathlike():
    assert magic.from_file(pathlib.Path(PDF)).startswith("PDF document")

def test_from_buffer():
    with open(PDF, "rb") as f:
        assert magic.from_buffer(f.read(), mime=True) == "application/pdf"
    assert magic.from_buffer(b"hello world\n", mime=True) == "text/plain"

def test_own_instances_and_params():
    m = magic.Magic(mime=True, keep_going=True)
    assert m.from_file(PDF).startswith("application/pdf")
    assert magic.Magic(mime_encoding=True).from_buffer(b"abc") == "us-ascii"
    assert magic.Magic().getparam(magic.MAGIC_PARAM_NAME_MAX) > 0

def test_errors():
    try:
        magic.from_file(PDF + ".missing")
    except (IOError, magic.MagicException):
        pass
    else:
        raise AssertionError("no error for a missing file")

def test_cached_handles_still_answer():
    assert magic.from_file(PDF, mime=True) == "application/pdf"
"""
PDF = (b"%PDF-1.4\n1 0 obj << /Type /Catalog /Pages 2 0 R >> endobj\n2 0 obj << /Type /Pages "
       b"/Kids [] /Count 0 >> endobj\ntrailer << /Root 1 0 R >>\n%%EOF\n")


@pytest.fixture(scope="module")
def python_magic(tmp_path_factory) -> str:
    """A directory holding python-magic 0.4.27 from PyPI (the test needs libmagic too)."""
    import ctypes.util
    if not ctypes.util.find_library("magic"):
        subprocess.run(["apt-get", "install", "-y", "-qq", "libmagic1"], capture_output=True,
                       env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    assert ctypes.util.find_library("magic"), \
        "python-magic needs libmagic: apt-get install libmagic1 failed"
    site = tmp_path_factory.mktemp("magic-site")
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                          "--target", str(site), "python-magic==0.4.27"],
                         capture_output=True, text=True)
    assert res.returncode == 0, f"pip install python-magic==0.4.27 failed:\n{res.stderr}"
    return str(site)


@BATCHES
@pytest.mark.parametrize("allocator", ["pymalloc", MALLOC])
def test_python_magic_under_the_plugin(pytester, monkeypatch, python_magic, allocator, batch):
    pdf = pytester.path / "test.pdf"
    pdf.write_bytes(PDF)
    monkeypatch.setenv("MAGIC_PDF", str(pdf))
    monkeypatch.setenv("PYTHONPATH", python_magic)
    if allocator == "malloc":
        monkeypatch.setenv("PYTHONMALLOC", "malloc")
    else:
        monkeypatch.delenv("PYTHONMALLOC", raising=False)
    pytester.makepyfile(test_magic=MAGIC_SUITE)
    res = pytester.runpytest_subprocess("--memunreachable", *batch, "-v", "-rf")
    out = res.stdout.str()
    assert "leaked during this test" not in out, out
    res.assert_outcomes(passed=6)
