"""The pytest plugin (in-process checks) under current distributions' own interpreters: Debian
trixie's python3.13 and sid's python3.14 (its default python3) and python3.15, glibc 2.41 and
2.43, memunreachable's dependencies as Debian packages them (tests/distros.py TOOL_PACKAGES).
The package built here is copied into the root (its C core is abi3) and the suite runs there,
as a developer's suite runs on that distribution.
"""
import json
import os
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest

import distros
import fixtures
import memunreachable

pytestmark = [pytest.mark.ptrace, pytest.mark.distro]

SUITE = r'''
import asyncio, ctypes, decimal, json, os, sys, zlib
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p

def record(key, value):
    with open(os.environ["MU_MADE"], "a") as f:
        f.write(json.dumps([key, value]) + "\n")

def test_clean():
    d = {i: str(i) * 3 for i in range(2000)}
    assert json.loads(zlib.decompress(zlib.compress(json.dumps(d).encode())))["7"] == "777"

def test_asyncio_and_decimal():
    async def third():
        await asyncio.sleep(0)
        return decimal.Decimal(1) / 3
    assert str(asyncio.run(third())).startswith("0.333")

def test_native_leak():
    record("native", libc.malloc(12345))

class Held:
    pass

def test_python_leak():
    h = Held()
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(h))
    record("python", id(h) - (sys.getsizeof(h) - Held.__basicsize__))
'''


def _install_package(root: str, name: str) -> str:
    """A copy of this checkout's package (its built C core and tracking library too) inside the
    root; returns the directory to put on PYTHONPATH, as the root sees it."""
    inside = os.path.join(fixtures.build_dir(root=name)[len(root):], "mu-package")
    dest = os.path.join(root + inside, "memunreachable")
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(os.path.dirname(memunreachable.__file__), dest,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return inside


@pytest.mark.parametrize("spec", distros.in_process_specs())
def test_the_plugin_fails_each_leaking_test_under_the_distribution_s_python(spec):
    root, name = distros.spec_root(spec)
    python = spec.split(":", 1)[1]
    pkg = _install_package(root, name)
    work = os.path.join(fixtures.build_dir(root=name)[len(root):], "plugin-" + python)
    shutil.rmtree(root + work, ignore_errors=True)
    os.makedirs(root + work)
    with open(os.path.join(root + work, "test_suite.py"), "w") as f:
        f.write(SUITE)
    made, junit = os.path.join(work, "made.jsonl"), os.path.join(work, "junit.xml")
    out = subprocess.run(
        ["chroot", root, "env", f"PYTHONPATH={pkg}", f"MU_MADE={made}", "PYTHONDONTWRITEBYTECODE=1",
         "/usr/bin/" + python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-p", "memunreachable.pytest_plugin", "--memunreachable", f"--junitxml={junit}",
         os.path.join(work, "test_suite.py")],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr        # tests failed, nothing else
    with open(root + made) as f:
        recorded = dict(json.loads(line) for line in f)
    results = {}
    for case in ET.parse(root + junit).getroot().iter("testcase"):
        failure = case.find("failure")
        results[case.get("name")] = None if failure is None else failure.get("message", "") \
            + (failure.text or "")
    assert results["test_clean"] is None and results["test_asyncio_and_decimal"] is None, results
    native = results["test_native_leak"]
    assert native is not None and f"12345 bytes (" in native, results
    assert f"unreachable at {recorded['native']:x}\n" in native, native
    assert "1 block leaked during this test" in native, native
    py = results["test_python_leak"]
    assert py is not None and f"unreachable at {recorded['python']:x}\n" in py, py
    assert "Python object: Held, refcount 1" in py, py
    assert ": 1 Python object (Held)" in py, py     # before 3.13 its dict's values apart
