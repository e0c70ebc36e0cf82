"""The interpreters the tests run, found on this machine instead of hard-coded paths: pyenv's
(PYENV_ROOT, else `pyenv root`, else ~/.pyenv) newest 3.N.* of each minor, and Debian's
/usr/bin/python3. A test whose interpreter is missing fails with what to install (CI never
skips)."""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
from typing import Dict


@functools.lru_cache(maxsize=None)
def pyenv_root() -> str:
    root = os.environ.get("PYENV_ROOT")
    if not root and shutil.which("pyenv"):
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip()
    return root or os.path.expanduser("~/.pyenv")


@functools.lru_cache(maxsize=None)
def pyenv_pythons() -> Dict[str, str]:
    """{"3.N": path of pyenv's newest 3.N.x interpreter} (final releases only)."""
    vdir = os.path.join(pyenv_root(), "versions")
    best: Dict[str, tuple] = {}
    for d in sorted(os.listdir(vdir)) if os.path.isdir(vdir) else []:
        parts = d.split(".")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            continue
        minor = f"{parts[0]}.{parts[1]}"
        exe = os.path.join(vdir, d, "bin", "python" + minor)
        if os.path.exists(exe) and int(parts[2]) >= best.get(minor, (-1, ""))[0]:
            best[minor] = (int(parts[2]), exe)
    return {minor: exe for minor, (_, exe) in best.items()}


def python(version: str) -> str:
    """The interpreter for "3.N" (pyenv's newest 3.N.x) or "debian" (/usr/bin/python3); an
    AssertionError naming what to install when it is missing."""
    if version == "debian":
        exe = "/usr/bin/python3"
        assert os.path.exists(exe), "Debian's /usr/bin/python3 is missing (apt-get install python3)"
        return exe
    exe = pyenv_pythons().get(version)
    assert exe, (f"no CPython {version} under {pyenv_root()}/versions: these tests need it "
                 f"(pyenv install {version})")
    return exe
