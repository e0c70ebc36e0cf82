"""fixtures.py: compile the C fixtures in fixtures/ and run them with the ready handshake.

    with start("leak_one") as fx:
        fx.blocks["leak"]      -> Block(address, size)
        fx.expect["num_leaks"] -> int
        ... check fx.pid ...
    # leaving the block sends "quit", and asserts the fixture said "bye" and exited 0.

Binaries are built once per test session into a temporary directory (cc -O0 -g), never
checked in. A fixture `NAME.c` may have a companion shared library `NAME_lib.c`, built as
libNAME_lib.so next to it (for dlopen tests); its path is passed in MU_FIXTURE_LIBDIR.
"""
from __future__ import annotations

import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE_DIR = os.path.join(ROOT, "fixtures")
_BUILD_DIR: Optional[str] = None
CFLAGS = ["-O0", "-g", "-fno-omit-frame-pointer", "-I", FIXTURE_DIR]


@dataclass(frozen=True)
class Block:
    address: int
    size: int


class FixtureError(AssertionError):
    pass


def compiler() -> Optional[str]:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_dir() -> str:
    global _BUILD_DIR
    if _BUILD_DIR is None:
        _BUILD_DIR = tempfile.mkdtemp(prefix="mu-fixtures-")
    return _BUILD_DIR


def build(name: str, extra_flags: List[str] = ()) -> str:
    """Compile fixtures/NAME.c (and NAME_lib.c if present); return the executable's path."""
    cc = compiler()
    if cc is None:
        raise FixtureError("no C compiler (cc/gcc) on PATH: fixtures cannot be built")
    out = os.path.join(build_dir(), name + ("-" + "-".join(f.strip("-") for f in extra_flags) if extra_flags else ""))
    if os.path.exists(out):
        return out
    lib_src = os.path.join(FIXTURE_DIR, name + "_lib.c")
    if os.path.exists(lib_src):
        lib_out = os.path.join(build_dir(), f"lib{name}_lib.so")
        _run([cc, *CFLAGS, "-shared", "-fPIC", "-o", lib_out, lib_src])
    src = os.path.join(FIXTURE_DIR, name + ".c")
    _run([cc, *CFLAGS, *extra_flags, "-o", out + ".tmp", src, "-pthread", "-ldl"])
    os.replace(out + ".tmp", out)
    return out


def _run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FixtureError(f"compile failed: {' '.join(cmd)}\n{proc.stderr}")


@dataclass
class FixtureProcess:
    name: str
    proc: subprocess.Popen
    blocks: Dict[str, Block] = field(default_factory=dict)
    expect: Dict[str, int] = field(default_factory=dict)
    lines: List[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def block_list(self, prefix: str) -> List[Block]:
        """Blocks whose label starts with prefix, in label order."""
        return [b for k, b in sorted(self.blocks.items()) if k.startswith(prefix)]

    def addresses(self, prefix: str = "") -> set:
        return {b.address for k, b in self.blocks.items() if k.startswith(prefix)}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def finish(self, timeout: float = 10.0) -> None:
        """Send quit; assert the fixture resumed its read normally, said bye and exited 0."""
        try:
            out, err = self.proc.communicate(b"quit\n", timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise FixtureError(f"{self.name}: did not exit after quit (state: stuck or stopped)")
        out_s = out.decode(errors="replace")
        if self.proc.returncode != 0 or "bye" not in out_s.split():
            raise FixtureError(f"{self.name}: exit {self.proc.returncode}, stdout {out_s!r}, "
                               f"stderr {err.decode(errors='replace')!r}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.communicate(timeout=10)
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finish()
        else:
            self.kill()


def start(name: str, *args: str, timeout: float = 30.0, env: Optional[dict] = None,
          extra_flags: List[str] = ()) -> FixtureProcess:
    """Build and start a fixture; return once it printed `ready`."""
    exe = build(name, list(extra_flags))
    full_env = dict(os.environ if env is None else env)
    full_env["MU_FIXTURE_LIBDIR"] = build_dir()
    proc = subprocess.Popen([exe, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=full_env)
    fx = FixtureProcess(name, proc)
    deadline = time.monotonic() + timeout
    buf = b""
    while True:
        if b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            text = line.decode()
            fx.lines.append(text)
            parts = text.split()
            if parts[:1] == ["ready"]:
                return fx
            if parts[:1] == ["block"] and len(parts) == 4:
                fx.blocks[parts[1]] = Block(int(parts[2], 16), int(parts[3]))
            elif parts[:1] == ["expect"] and len(parts) == 3:
                fx.expect[parts[1]] = int(parts[2])
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            fx.kill()
            raise FixtureError(f"{name}: no ready line within {timeout}s")
        r, _, _ = select.select([proc.stdout], [], [], left)
        if r:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                err = proc.stderr.read().decode(errors="replace")
                fx.kill()
                raise FixtureError(f"{name}: exited before ready (rc {proc.poll()}): {err}")
            buf += chunk


def explain_misses(pid: int, addresses, limit: int = 3) -> str:
    """Why each of `addresses` (leaks a check of pid missed) is reachable: checks pid again
    with MEMUNREACHABLE_EXPLAIN set to each (explain.py) and returns the chains it logged. For
    a test's failure message: a rare miss then names its stale word."""
    import pytest
    from memunreachable import unreachable
    out = []
    for addr in list(addresses)[:limit]:
        with tempfile.NamedTemporaryFile("r", suffix=".explain") as log, \
                pytest.MonkeyPatch.context() as mp:
            mp.setenv("MEMUNREACHABLE_EXPLAIN", hex(addr))
            mp.setenv("MEMUNREACHABLE_EXPLAIN_LOG", log.name)
            try:
                unreachable.check(pid)
            except Exception as e:          # the explanation must not hide the miss
                out.append(f"explain {hex(addr)}: the check failed: {e!r}")
            out += [line.rstrip() for line in log]
    return "\n".join(out)
