"""sym_helpers.py: build the symbolization fixtures (fixtures/sym_chain*.c*) the way
distributions build code (-O2 -g, no frame pointers), run them, and read what they print.

    exe = build_sym("sym_chain.c", out_dir)             # gcc -O2 -g -fomit-frame-pointer
    with run_sym(exe) as sp:                            # waits for "ready"
        sp.pcs, sp.pid, modules_of(sp.pid)
    lines_marked("sym_chain.c") -> {"leaf_bt": 21, ...} the "@line NAME" comments
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Dict, List, Optional

from memunreachable.collect import procfs
from memunreachable.stacks.symbolize import modules_from_maps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE_DIR = os.path.join(ROOT, "fixtures")
NO_FP_FLAGS = ["-O2", "-g", "-fomit-frame-pointer"]
LIBC_DEBUG_DIR = "/usr/lib/debug"


def source(name: str) -> str:
    return os.path.join(FIXTURE_DIR, name)


def lines_marked(name: str) -> Dict[str, int]:
    """{"NAME": line number} of every "@line NAME" comment in fixtures/<name>."""
    out = {}
    with open(source(name)) as f:
        for number, text in enumerate(f, 1):
            m = re.search(r"@line (\w+)", text)
            if m and "NAME" not in text:
                out[m.group(1)] = number
    return out


def run(cmd: List[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")
    return proc.stdout


def build_sym(name: str, out_dir: str, extra: List[str] = (), out_name: Optional[str] = None) -> str:
    """Compile fixtures/<name> (C or C++) -O2 -g without frame pointers; return the executable."""
    cxx = name.endswith(".cc")
    cc = shutil.which("g++" if cxx else "gcc")
    if cc is None:
        raise AssertionError(f"{'g++' if cxx else 'gcc'} is not installed: apt-get install "
                             f"{'g++' if cxx else 'gcc'}")
    out = os.path.join(out_dir, out_name or name.split(".")[0] + ("-" + "-".join(
        e.strip("-") for e in extra) if extra else ""))
    run([cc, *NO_FP_FLAGS, *extra, "-I", FIXTURE_DIR, "-o", out, source(name)])
    return out


def build_id_of(path: str) -> str:
    """The GNU build-id of an ELF file, as `readelf -n` prints it."""
    m = re.search(r"Build ID: ([0-9a-f]+)", run(["readelf", "-n", path]))
    assert m, f"{path} has no build-id note"
    return m.group(1)


def addr2line(path: str, offset: int) -> List[tuple]:
    """[(function, line)] of `addr2line -f -i -e path 0xOFFSET`, innermost first."""
    out = run(["addr2line", "-f", "-i", "-e", path, f"{offset:#x}"]).split("\n")
    pairs = []
    for fn, loc in zip(out[0::2], out[1::2]):
        line = loc.rsplit(":", 1)[-1].split(" ")[0]
        pairs.append((fn, int(line) if line.isdigit() else None))
    return pairs


class SymProcess:
    """A running fixture that printed its return addresses ("pc I HEX", or "stack KIND HEX...")
    and "ready"."""

    def __init__(self, exe: str):
        self.proc = subprocess.Popen([exe], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.pcs: List[int] = []
        self.addrs: Dict[str, int] = {}
        self.stacks: Dict[str, List[int]] = {}
        for line in self.proc.stdout:
            words = line.split()
            if words[:1] == ["stack"]:
                self.stacks[words[1]] = [int(w, 16) for w in words[2:]]
            elif words[:1] == ["pc"]:
                self.pcs.append(int(words[2], 16))
            elif words[:1] == ["addr"]:
                self.addrs[words[1]] = int(words[2], 16)
            elif words[:1] == ["ready"]:
                break
        else:
            err = self.proc.stderr.read()
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{exe} exited before ready: {err}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def modules(self):
        return modules_from_maps(procfs.read_maps(self.pid))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            out, _ = self.proc.communicate("quit\n", timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise AssertionError("fixture did not exit after quit")
        if exc[0] is None:
            assert self.proc.returncode == 0 and "bye" in out.split(), (self.proc.returncode, out)


def libc_path(modules) -> str:
    return next(p for _, _, _, p in modules if os.path.basename(p).startswith("libc.so"))


def ensure_libc_debug(libc: str) -> str:
    """The path of libc's separate debug file (Debian's libc6-dbg) by build-id; installs the
    package with apt-get when it is missing, fails with what to do when that is impossible."""
    bid = build_id_of(libc)
    path = os.path.join(LIBC_DEBUG_DIR, ".build-id", bid[:2], bid[2:] + ".debug")
    if os.path.isfile(path):
        return path
    apt = shutil.which("apt-get")
    if apt:
        subprocess.run([apt, "update", "-qq"], capture_output=True, timeout=600)
        subprocess.run([apt, "install", "-y", "-qq", "libc6-dbg"], capture_output=True,
                       timeout=600, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    if not os.path.isfile(path):
        raise AssertionError(
            f"libc's debug file {path} (build-id {bid}) is missing and could not be installed: "
            "run `apt-get install libc6-dbg` (its version must match the installed libc6)")
    return path
