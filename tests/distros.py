"""Debian roots of current distributions, as test environments.

A root is a directory made with `debootstrap --variant=minbase SUITE`, with a compiler, glibc's
debug info and the suite's CPython interpreters (and their headers) installed inside. Tests build
fixtures with the root's own gcc, start them inside it (`chroot ROOT prog`: the pid is the
program's) and check them from the host, as one checks a container.

Roots are built once per machine and cached outside the checkout (MEMUNREACHABLE_ROOTS, default
/var/cache/memunreachable/roots); a missing root is built (about a minute), never skipped. A
stamp file records the package list a root was built with: a changed list installs what is
missing. Building needs root (debootstrap, chroot) and Debian's package registry.

    python tests/distros.py [trixie|sid ...]   builds (or refreshes) the roots and prints facts
"""
import fcntl
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List, Tuple

CACHE = os.environ.get("MEMUNREACHABLE_ROOTS", "/var/cache/memunreachable/roots")

BASE_PACKAGES = ["gcc", "libc6-dev", "libc6-dbg"]
# what memunreachable itself imports, as Debian packages it for the suite's own interpreters
# (its default python3 and the other versions the suite supports): in-process checks and the
# pytest plugin run inside the root (test_inprocess_current.py)
TOOL_PACKAGES = ["python3-cffi", "python3-psutil", "python3-pyelftools", "python3-rich",
                 "python3-ptrace", "python3-pytest"]


@dataclass(frozen=True)
class Distro:
    suite: str                 # debootstrap's suite name
    glibc: str                 # the glibc release it ships (what the tests expect to find)
    pythons: Tuple[str, ...]   # interpreters installed (python3.X), each with its -dev package
    in_process: Tuple[str, ...]    # those Debian builds TOOL_PACKAGES' C extensions for

    @property
    def packages(self) -> List[str]:
        extra = []
        for py in self.pythons:
            extra += [py, f"{py}-dev"]
        return BASE_PACKAGES + extra + TOOL_PACKAGES


DISTROS: Dict[str, Distro] = {
    "trixie": Distro("trixie", "2.41", ("python3.13",), ("python3.13",)),
    "sid": Distro("sid", "2.43", ("python3.13", "python3.14", "python3.15"),
                  ("python3.14", "python3.15")),
}


class RootBuildError(RuntimeError):
    pass


def _run(cmd: List[str], log) -> None:
    log.write(f"+ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                          env=dict(os.environ, DEBIAN_FRONTEND="noninteractive", LC_ALL="C"))
    if proc.returncode != 0:
        raise RootBuildError(f"{' '.join(cmd[:4])}... exited {proc.returncode}; see {log.name}")


def _install(root: str, packages: List[str], log) -> None:
    # the registry's snapshot of a suite can be older than its Release file's Valid-Until
    # (sid's expires within a week): apt would refuse it as expired
    with open(os.path.join(root, "etc/apt/apt.conf.d/99memunreachable"), "w") as f:
        f.write('Acquire::Check-Valid-Until "false";\n')
    _run(["chroot", root, "apt-get", "update", "-qq"], log)
    _run(["chroot", root, "apt-get", "install", "-y", "-qq", "--no-install-recommends"]
         + packages, log)


def _mount_proc(path: str) -> None:
    """A container has its /proc: fixtures read /proc/self (task states, maps)."""
    if not os.path.exists(os.path.join(path, "proc", "self")):
        subprocess.run(["mount", "-t", "proc", "proc", os.path.join(path, "proc")], check=True)


def root(name: str) -> str:
    """The path of the named root, built or refreshed first when needed, its /proc mounted.

    Raises RootBuildError with the log's path when debootstrap or apt-get fails."""
    path = _build(name)
    _mount_proc(path)
    return path


def _build(name: str) -> str:
    distro = DISTROS[name]
    os.makedirs(CACHE, exist_ok=True)
    path = os.path.join(CACHE, name)
    stamp = os.path.join(path, ".memunreachable-packages")
    want = " ".join(distro.packages) + "\n"
    with open(os.path.join(CACHE, f".{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(stamp):
            with open(stamp) as f:
                if f.read() == want:
                    return path
        with open(os.path.join(CACHE, f"{name}.log"), "a") as log:
            if not os.path.exists(stamp):
                if shutil.which("debootstrap") is None:
                    _run(["apt-get", "install", "-y", "-qq", "debootstrap"], log)
                tmp = path + ".tmp"
                for old in (tmp, path):     # never delete through a mounted /proc
                    if os.path.ismount(os.path.join(old, "proc")):
                        subprocess.run(["umount", "-l", os.path.join(old, "proc")], check=True)
                    shutil.rmtree(old, ignore_errors=True)
                _run(["debootstrap", "--variant=minbase", distro.suite, tmp], log)
                os.rename(tmp, path)
            _install(path, distro.packages, log)
        with open(stamp, "w") as f:
            f.write(want)
    return path


def glibc_version(path: str) -> str:
    """The root's glibc release, from its libc's version string."""
    out = subprocess.run(["chroot", path, "ldd", "--version"], capture_output=True, text=True)
    first = out.stdout.splitlines()[0] if out.stdout else ""
    return first.rsplit(" ", 1)[-1]


def python_version(path: str, python: str) -> str:
    out = subprocess.run(["chroot", path, python, "-c", "import sys; print(sys.version.split()[0])"],
                         capture_output=True, text=True)
    return out.stdout.strip()


def python_argv(spec: str) -> List[str]:
    """The command that starts an interpreter spec: a host path, or "ROOT:python3.X" for the
    root's /usr/bin/python3.X started inside it (chroot execs it: the pid is the interpreter's)."""
    if ":" not in spec:
        return [spec]
    name, python = spec.split(":", 1)
    return ["chroot", root(name), "/usr/bin/" + python]


def spec_root(spec: str):
    """(host path of the root, name) of a "ROOT:python3.X" spec, or (None, None) for the host."""
    if ":" not in spec:
        return None, None
    name = spec.split(":", 1)[0]
    return root(name), name


def python_specs() -> List[str]:
    """Every interpreter of every root, as "ROOT:python3.X"."""
    return [f"{name}:{py}" for name, d in DISTROS.items() for py in d.pythons]


def in_process_specs() -> List[str]:
    """The interpreters of every root that can import memunreachable (Distro.in_process)."""
    return [f"{name}:{py}" for name, d in DISTROS.items() for py in d.in_process]


if __name__ == "__main__":
    for name in sys.argv[1:] or list(DISTROS):
        p = root(name)
        print(name, p, "glibc", glibc_version(p),
              " ".join(f"{py}={python_version(p, py)}" for py in DISTROS[name].pythons))
