"""cffi API-mode build of the C core: memunreachable._native.

Every native/mu_*.h header is both C API and cffi cdef (keep them cdef-clean: no includes,
no macros beyond integer constants). Every native/mu_*.c file is compiled in.
"""
import glob
import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
# mu_types.h first (shared structs), then each stage's header; mu_core*.h only include them.
HEADERS = [os.path.join(HERE, "mu_types.h")] + sorted(
    h for h in glob.glob(os.path.join(HERE, "mu_*.h"))
    if os.path.basename(h) not in ("mu_types.h", "mu_core.h", "mu_core_impl.h", "mu_track.h"))
# mu_track.c is the preloaded tracking library (memunreachable/_track.so, built by setup.py):
# never part of the cffi module
SOURCES = sorted(os.path.relpath(p, os.path.dirname(HERE)) for p in glob.glob(os.path.join(HERE, "mu_*.c"))
                 if os.path.basename(p) != "mu_track.c")

ffibuilder = FFI()
ffibuilder.cdef("\n".join(open(h).read() for h in HEADERS))
ffibuilder.set_source(
    "memunreachable._native",
    '#include "mu_core_impl.h"\n',
    sources=SOURCES,
    include_dirs=[os.path.relpath(HERE, os.path.dirname(HERE))],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-pthread"],
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
