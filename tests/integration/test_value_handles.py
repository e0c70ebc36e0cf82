"""Issue 23 item 2: a native block whose only handle is a Python int, bytes or float.

ctypes' c_void_p results, cffi's int(ffi.cast("uintptr_t", p)) and numpy's
__array_interface__ hold a native block's address as an int; struct.pack("P", p) as bytes. Such
a block is in use, not leaked (python-magic keeps libmagic's handle so and failed under the
plugin): checked on every interpreter (check(pid), the targets of test_cpython_leaks), through
the pytest plugin (one test a batch and the default batches), and with python-magic's own suite.
The twin of each: the same kind of block whose int was dropped is reported.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from test_cpython_leaks import RESERVE, _ident, interpreters, run_target

pytestmark = pytest.mark.ptrace
pytest_plugins = ["pytester"]

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

hold()
print(json.dumps(out))
print("ready", flush=True)
sys.stdin.read(1)
""".replace("@RESERVE@", RESERVE)


@pytest.mark.parametrize("allocator", ["pymalloc", "malloc"])
@pytest.mark.parametrize("python", interpreters(), ids=_ident)
def test_blocks_held_by_an_int_bytes_or_float_are_in_use(python, allocator):
    made, info, before = run_target(python, HANDLES, allocator,
                                    expect=lambda made: [int(made["3"][0], 16)])
    blocks = {k: (int(a, 16), size) for k, (a, size) in made.items()}
    new = {l.address: l.size for l in info.leaks if l.address not in before}
    assert new == {blocks["3"][0]: blocks["3"][1]}, \
        {hex(a): s for a, s in new.items()}     # held 0-2: not reported
