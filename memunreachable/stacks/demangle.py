"""demangle.py: symbol names as people read them (used by symbolize.py).

C++ (Itanium ABI) through libstdc++'s abi::__cxa_demangle (ctypes: 138 k names/s, about
c++filt's speed in one process; allocation-tracking.md section 6); Rust legacy names
(_ZN...17h<hash>E, Itanium-shaped, so __cxa_demangle would keep the hash) by rustc-demangle's
rules, hash dropped; Rust v0 (_R...) through binutils' c++filt (2.36+, one process kept
open) when it is installed, else left as is, with the crate disambiguators c++filt prints
(`core[c1f1a4ba060b9bfa]::`) dropped: both manglings then give the same
`crate::module::function` that DWARF names (DW_AT_name paths carry no hash), which grouping
and suppressions can rely on across builds (the hashes change with the compiler and its
flags). GCC clone suffixes (.isra.0, .constprop.0, .part.0, .cold) are dropped, as
llvm-symbolizer names them, so grouping and suppressions see one name per function.

References: Itanium C++ ABI section 5.1; Rust RFC 2603 (v0); rustc-demangle src/legacy.rs.
"""
from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import os
import re
import select
import shutil
import subprocess
import threading
import time
from typing import Dict, Optional, Sequence

_cxa = None
_cxa_lock = threading.Lock()
_RUST_HASH = re.compile(r"17h[0-9a-f]{16}E(\.[^E]*)?$")
# a v0 crate disambiguator as c++filt prints it (a 64-bit hash in hex) after the crate name
_RUST_DISAMBIGUATOR = re.compile(r"(?<=[\w])\[[0-9a-f]{1,16}\]")
_RUST_ESCAPES = {"SP": "@", "BP": "*", "RF": "&", "LT": "<", "GT": ">", "LP": "(", "RP": ")",
                 "C": ","}


def _cxa_demangle(name: str) -> Optional[str]:
    """libstdc++'s abi::__cxa_demangle (None when libstdc++ is absent or the name is invalid)."""
    global _cxa
    with _cxa_lock:
        if _cxa is None:
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
                fn = lib.__cxa_demangle
                fn.restype = ctypes.c_void_p
                fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.POINTER(ctypes.c_int)]
                free = ctypes.CDLL(None).free
                free.argtypes = [ctypes.c_void_p]
                _cxa = (fn, free)
            except (OSError, AttributeError):
                _cxa = False
        if not _cxa:
            return None
        fn, free = _cxa
        status = ctypes.c_int(0)
        ptr = fn(name.encode(), None, None, ctypes.byref(status))
        if status.value != 0 or not ptr:
            return None
        try:
            return ctypes.string_at(ptr).decode(errors="replace")
        finally:
            free(ptr)


# Returns the demangled Rust legacy name (path without the ::h<hash> part, $LT$-style escapes
# undone), or None when `name` is not one (rustc-demangle's legacy rules).
def demangle_rust_legacy(name: str) -> Optional[str]:
    if not (name.startswith("_ZN") and _RUST_HASH.search(name)):
        return None
    body, i, parts = name[3:], 0, []
    while i < len(body) and body[i] != "E":
        j = i
        while j < len(body) and body[j].isdigit():
            j += 1
        if j == i:
            return None
        n = int(body[i:j])
        parts.append(body[j:j + n])
        i = j + n
    if not parts or i >= len(body) or not re.fullmatch(r"h[0-9a-f]{16}", parts[-1]):
        return None
    return "::".join(_rust_unescape(p) for p in parts[:-1])


def _rust_unescape(part: str) -> str:
    if part.startswith("_$"):
        part = part[1:]
    out, i = [], 0
    while i < len(part):
        if part[i] == "$":
            end = part.find("$", i + 1)
            code = part[i + 1:end] if end > 0 else ""
            if code in _RUST_ESCAPES:
                out.append(_RUST_ESCAPES[code])
            elif code.startswith("u") and re.fullmatch(r"u[0-9a-f]+", code):
                out.append(chr(int(code[1:], 16)))
            else:
                return part                 # not a valid escape: leave the part alone
            i = end + 1
        elif part.startswith("..", i):
            out.append("::")
            i += 2
        else:
            out.append(part[i])
            i += 1
    return "".join(out)


class _CxxFilt:
    """One binutils c++filt process kept open for the Rust v0 names: it answers a line per
    line and flushes at each newline (binutils cxxfilt.c), so a name costs a pipe round trip
    (600 v0 names of a Rust program: 20 ms) instead of a process (2.4 ms each). A c++filt
    that does not answer within TIMEOUT s is killed and not used again (names stay as is)."""

    TIMEOUT = 5.0

    def __init__(self):
        self.lock = threading.Lock()
        self.proc: Optional[subprocess.Popen] = None
        self.pid = 0                # the process that started it (a fork child starts its own)
        self.broken = False

    def _running(self) -> Optional[subprocess.Popen]:
        if self.proc is not None and self.pid == os.getpid() and self.proc.poll() is None:
            return self.proc
        exe = shutil.which("c++filt")
        if not exe:
            self.broken = True
            return None
        try:
            self.proc = subprocess.Popen([exe], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, bufsize=0)
        except OSError:
            self.broken = True
            return None
        self.pid = os.getpid()
        return self.proc

    def _line(self, proc: subprocess.Popen) -> bytes:
        fd, buf = proc.stdout.fileno(), b""
        deadline = time.monotonic() + self.TIMEOUT
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise OSError("c++filt did not answer")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise OSError("c++filt exited")
            buf += chunk
        return buf[:-1]

    # Returns {mangled: demangled} of the names c++filt changed; {} when c++filt is not
    # installed or fails (then it is not tried again).
    def demangle(self, names: Sequence[str]) -> Dict[str, str]:
        names = [n for n in names if n and n.isascii() and not any(c.isspace() for c in n)]
        out: Dict[str, str] = {}
        with self.lock:
            if self.broken or not names:
                return out
            proc = self._running()
            if proc is None:
                return out
            try:
                for n in names:
                    proc.stdin.write(n.encode() + b"\n")
                    d = self._line(proc).decode(errors="replace")
                    if d and d != n:
                        out[n] = d
            except (OSError, ValueError):
                self.broken = True
                proc.kill()
                proc.wait()
                self.proc = None
        return out

    def close(self) -> None:
        with self.lock:
            if self.proc is not None and self.pid == os.getpid():
                self.proc.stdin.close()
                self.proc.wait()
            self.proc = None


_cxxfilt = _CxxFilt()
atexit.register(_cxxfilt.close)


# Returns {mangled: demangled} for Rust v0 names through binutils' c++filt (2.36+); {} when
# c++filt is not installed or fails.
def _demangle_with_cxxfilt(names: Sequence[str]) -> Dict[str, str]:
    return _cxxfilt.demangle(names)


_demangled: Dict[str, str] = {}
# GCC's clones (foo.isra.0, foo.constprop.0, foo.part.0, foo.cold) are named after the function
# they came from, as llvm-symbolizer and LSan show them: stable names for grouping/suppressions
CLONE_SUFFIX = re.compile(r"(\.(isra|constprop|part|cold|lto_priv|localalias)(\.\d+)?)+$")
_CLONE_DEMANGLED = re.compile(r"( \[clone [^\]]*\])+$")


def demangle(name: str) -> str:
    """The readable form of a symbol name; the name itself when it is not mangled (C) or
    cannot be demangled."""
    hit = _demangled.get(name)
    if hit is not None:
        return hit
    out = name
    if name.startswith("_Z"):
        out = demangle_rust_legacy(name) or _cxa_demangle(name) or name
        out = _CLONE_DEMANGLED.sub("", out)
    elif name.startswith("_R"):
        got = _demangle_with_cxxfilt([name]).get(name)
        out = _RUST_DISAMBIGUATOR.sub("", got) if got else name
    else:
        out = CLONE_SUFFIX.sub("", name) or name
    _demangled[name] = out
    return out
