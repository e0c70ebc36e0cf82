"""demangle.py: symbol names as people read them (used by symbolize.py).

C++ (Itanium ABI) through libstdc++'s abi::__cxa_demangle (ctypes: 138 k names/s, about
c++filt's speed in one process; allocation-tracking.md section 6); Rust legacy names
(_ZN...17h<hash>E, Itanium-shaped, so __cxa_demangle would keep the hash) by rustc-demangle's
rules, hash dropped; Rust v0 (_R...) through binutils' c++filt (2.36+) when it is installed,
else left as is, with the crate disambiguators c++filt prints (`core[c1f1a4ba060b9bfa]::`)
dropped: both manglings then give the same `crate::module::function` that DWARF names
(DW_AT_name paths carry no hash) and that suppressions and grouping can rely on across
builds (the hashes change with the compiler and its flags). GCC clone suffixes (.isra.0, .constprop.0, .part.0, .cold) are dropped, as
llvm-symbolizer names them, so grouping and suppressions see one name per function.

References: Itanium C++ ABI section 5.1; Rust RFC 2603 (v0); rustc-demangle src/legacy.rs.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import re
import shutil
import subprocess
import threading
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


# Returns {mangled: demangled} for Rust v0 names through binutils' c++filt (2.36+); {} when
# c++filt is not installed or fails.
def _demangle_with_cxxfilt(names: Sequence[str]) -> Dict[str, str]:
    exe = shutil.which("c++filt")
    if not exe or not names:
        return {}
    try:
        out = subprocess.run([exe], input="\n".join(names) + "\n", capture_output=True,
                             text=True, timeout=30).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return {}
    return {m: d for m, d in zip(names, out) if d and d != m}


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
