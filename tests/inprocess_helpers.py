"""Helpers for the in-process tests: build the `leaky` CPython extension at test time.

Tests import `leakytools as leaky` (tests/ext/leakytools.py, copied next to the built
extension): leak(n)/no_leak(n) -> (address, usable size).

The in-process tests leak blocks of 33 MiB + x: glibc maps them (above its 32 MiB maximum
mmap threshold), and since leakytools first reserves 1 GiB of PROT_NONE address space under
the interpreter's mappings, they land in address space never used before, so no stale word
of the interpreter (pymalloc arenas, slack bytes of reused chunks, dead frames: a
conservative scan counts them all, docs/limitations.md) can point into them. Only the first
64 bytes are written: 4 KiB resident.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig

import fixtures

EXT_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ext", "leaky.c")


def build_extension(name: str, flags=("-O0", "-g")) -> str:
    """Compile tests/ext/<name>.c into a CPython extension `name` for this interpreter;
    return the directory to put on sys.path."""
    out_dir = os.path.join(fixtures.build_dir(), "ext")
    target = os.path.join(out_dir, name + sysconfig.get_config_var("EXT_SUFFIX"))
    if not os.path.exists(target):
        os.makedirs(out_dir, exist_ok=True)
        cc = fixtures.compiler()
        if cc is None:
            raise fixtures.FixtureError(f"no C compiler: the {name} extension cannot be built")
        subprocess.run([cc, "-shared", "-fPIC", *flags, "-I", sysconfig.get_paths()["include"],
                        "-o", target, os.path.join(os.path.dirname(EXT_SRC), name + ".c")],
                       check=True, capture_output=True)
    return out_dir


def build_leaky() -> str:
    """Compile tests/ext/leaky.c; return the directory to put on sys.path."""
    out_dir = build_extension("leaky")
    if not os.path.exists(os.path.join(out_dir, "leakytools.py")):
        shutil.copy(os.path.join(os.path.dirname(EXT_SRC), "leakytools.py"), out_dir)
    return out_dir


def python_env(ext_dir: str, pymalloc: bool = False) -> dict:
    """Environment for a child interpreter that can import leakytools. By default it runs with
    PYTHONMALLOC=malloc: freed Python objects then become
    free glibc chunks (never scanned) instead of stale words in pymalloc arenas (roots)."""
    env = dict(os.environ)
    if not pymalloc:
        env["PYTHONMALLOC"] = "malloc"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ext_dir, env.get("PYTHONPATH")) if p)
    return env


def run_python(code: str, ext_dir: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=python_env(ext_dir), capture_output=True,
                          text=True, timeout=timeout, **kw)


def run_leak_script(script: str, ext_dir: str, *args: str, allocator=None, **env):
    """Runs `python -c script args` with ext_dir importable, under PYTHONMALLOC=allocator
    (None: the default allocator) and the extra variables env; asserts it exited 0. The
    script prints "block ADDR USABLE" (hex, decimal) for the block it made and "leak ADDR SIZE
    CONTENTS" per leak its check found. Returns (its stdout, (ADDR, USABLE), [(ADDR, SIZE,
    CONTENTS)]), as printed."""
    full = dict(os.environ, PYTHONPATH=ext_dir, **env)
    full.pop("PYTHONMALLOC", None)
    if allocator:
        full["PYTHONMALLOC"] = allocator
    done = subprocess.run([sys.executable, "-c", script, *args], env=full,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    block = re.search(r"^block (\w+) (\d+)$", out, re.M)
    assert block, out
    return out, block.groups(), re.findall(r"^leak (\w+) (\d+) (.*)$", out, re.M)


def reported(text: str, addr: str, usable) -> int:
    """How often text reports the block at hex addr of `usable` bytes: "N bytes unreachable
    at ADDR", or "R bytes (N usable) unreachable at ADDR" when the size asked for is known
    (a tracked process)."""
    return len(re.findall(rf"(?:^|\s)(?:{usable} bytes|\d+ bytes \({usable} usable\)) "
                          rf"unreachable at {addr}\b", text, re.M))
