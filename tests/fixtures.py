"""fixtures.py: compile the C fixtures in fixtures/ and run them with the ready handshake.

    with start("leak_one") as fx:
        fx.blocks["leak"]      -> Block(address, size)
        fx.expect["num_leaks"] -> int
        ... check fx.pid ...
    # leaving the block sends "quit", and asserts the fixture said "bye" and exited 0.

Binaries are built once per test session into a temporary directory (cc -O0 -g), never
checked in. A fixture `NAME.c` may have a companion shared library `NAME_lib.c`, built as
libNAME_lib.so next to it (for dlopen tests); its path is passed in MU_FIXTURE_LIBDIR.

Target roots (tests/distros.py): with MU_TARGET_ROOT=trixie (or sid) in the environment, or
start(..., root="sid"), a fixture is built with the root's own gcc against its own glibc and
started inside it (`chroot ROOT prog`: the pid is the program's); the checker stays on the
host, as when a host checks a container. The same tests then run against that distribution.
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
# -U_FORTIFY_SOURCE: Ubuntu's gcc fortifies by default, and at -O2 its object-size checks abort
# the fixtures that write a block's usable bytes past the size they asked malloc for
CFLAGS = ["-O0", "-g", "-fno-omit-frame-pointer", "-U_FORTIFY_SOURCE", "-I", FIXTURE_DIR]


@dataclass(frozen=True)
class Block:
    address: int
    size: int


def handshake_line(parts, target) -> bool:
    """Take one line of the ready handshake ("pid N", "block LABEL ADDR SIZE", "expect KEY N")
    into target's pid, blocks and expect; False for any other line."""
    if parts[:1] == ["pid"]:
        target.pid = int(parts[1])
    elif parts[:1] == ["block"]:
        target.blocks[parts[1]] = Block(int(parts[2], 16), int(parts[3]))
    elif parts[:1] == ["expect"]:
        target.expect[parts[1]] = int(parts[2])
    else:
        return False
    return True


class FixtureError(AssertionError):
    pass


def compiler() -> Optional[str]:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def glibc_version(root: Optional[str] = "default") -> str:
    """The glibc release fixtures run on: the root's, or the host's ("2.36")."""
    root = target_root() if root == "default" else root
    if root is not None:
        import distros
        return distros.DISTROS[root].glibc
    return os.confstr("CS_GNU_LIBC_VERSION").split()[-1]


def target_root() -> Optional[str]:
    """The name of the root fixtures run in by default (MU_TARGET_ROOT), or None: the host."""
    return os.environ.get("MU_TARGET_ROOT") or None


class _Root:
    """Where a root's fixtures are built: `inside` is the path the root's programs see,
    `outside` the same directory seen from the host."""

    def __init__(self, name: str):
        import distros
        self.name = name
        self.path = distros.root(name)
        self.inside = "/tmp/mu-fixtures-" + os.path.basename(build_dir())
        self.outside = self.path + self.inside
        if not os.path.isdir(self.outside):
            shutil.copytree(FIXTURE_DIR, os.path.join(self.outside, "src"))

    def host_path(self, inside: str) -> str:
        return self.path + inside


_ROOTS: Dict[str, _Root] = {}


def _root(name: str) -> _Root:
    if name not in _ROOTS:
        _ROOTS[name] = _Root(name)
    return _ROOTS[name]


def build_dir(root: Optional[str] = None) -> str:
    """The directory fixtures are built into: on the host, or a root's (its host path)."""
    global _BUILD_DIR
    if _BUILD_DIR is None:
        _BUILD_DIR = tempfile.mkdtemp(prefix="mu-fixtures-")
    if root is None:
        return _BUILD_DIR
    return _root(root).outside


def build(name: str, extra_flags: List[str] = (), root: Optional[str] = "default") -> str:
    """Compile fixtures/NAME.c (and NAME_lib.c if present); return the executable's path.

    root: a tests/distros.py root to build in with its own gcc ("default": MU_TARGET_ROOT,
    None: the host); the path returned is then the one seen inside the root."""
    root = target_root() if root == "default" else root
    tag = "-" + "-".join(f.strip("-") for f in extra_flags) if extra_flags else ""
    if root is not None:
        r = _root(root)
        cc, cflags, base, src_dir = ["chroot", r.path, "gcc"], CFLAGS[:-1] + [r.inside + "/src"], \
            r.inside, r.inside + "/src"
        exists = lambda p: os.path.exists(r.host_path(p))          # noqa: E731
        replace = lambda a, b: os.replace(r.host_path(a), r.host_path(b))   # noqa: E731
    else:
        host_cc = compiler()
        if host_cc is None:
            raise FixtureError("no C compiler (cc/gcc) on PATH: fixtures cannot be built")
        cc, cflags, base, src_dir = [host_cc], CFLAGS, build_dir(), FIXTURE_DIR
        exists, replace = os.path.exists, os.replace
    out = os.path.join(base, name + tag)
    if exists(out):
        return out
    if os.path.exists(os.path.join(FIXTURE_DIR, name + "_lib.c")):
        _run([*cc, *cflags, "-shared", "-fPIC", "-o", os.path.join(base, f"lib{name}_lib.so"),
              os.path.join(src_dir, name + "_lib.c")])
    _run([*cc, *cflags, *extra_flags, "-o", out + ".tmp", os.path.join(src_dir, name + ".c"),
          "-pthread", "-ldl"])
    replace(out + ".tmp", out)
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
          extra_flags: List[str] = (), root: Optional[str] = "default") -> FixtureProcess:
    """Build and start a fixture; return once it printed `ready`.

    root: as for build(); inside a root the fixture runs as `chroot ROOT exe`, which execs exe
    in place (the pid is the fixture's)."""
    root = target_root() if root == "default" else root
    exe = build(name, list(extra_flags), root=root)
    full_env = dict(os.environ if env is None else env)
    argv = [exe, *args]
    if root is not None:
        full_env["MU_FIXTURE_LIBDIR"] = _root(root).inside
        argv = ["chroot", _root(root).path, *argv]
    else:
        full_env["MU_FIXTURE_LIBDIR"] = build_dir()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
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
