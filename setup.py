"""Build glue that pyproject.toml cannot express: the cffi extension, the demo binary and
the tracking library.

`cffi_modules` is a setup() keyword only; the custom build_ext also compiles the bundled
leaky demo program (fixtures/demo.c) next to the C core, so `memunreachable demo` needs no
compiler at run time, and the allocation-tracking library preloaded by `memunreachable run`
(native/mu_track.c -> memunreachable/_track.so: plain C, no Python or cffi dependency).
"""
import os
import subprocess
import sysconfig

from setuptools import setup
from setuptools.command.build_ext import build_ext


class BuildExtWithDemo(build_ext):
    def run(self):
        super().run()
        self._build_demo()
        self._build_track()

    def _outdir(self) -> str:
        return "memunreachable" if self.inplace else os.path.join(self.build_lib, "memunreachable")

    def _build_track(self):
        cc = os.environ.get("CC") or sysconfig.get_config_var("CC").split()[0] or "cc"
        out = os.path.join(self._outdir(), "_track.so")
        subprocess.check_call([cc, "-O2", "-g", "-std=gnu11", "-Wall", "-Wextra", "-fPIC", "-shared",
                               "-fvisibility=hidden", "-fno-builtin", "-fno-strict-aliasing",
                               "-fno-omit-frame-pointer",   # the fp unwinder walks through us
                               "-Inative", "-o", out + ".tmp", os.path.join("native", "mu_track.c"),
                               "-ldl", "-pthread"])
        os.replace(out + ".tmp", out)

    def _build_demo(self):
        src = os.path.join("fixtures", "demo.c")
        outdir = os.path.join(self._outdir(), "_demo")
        os.makedirs(outdir, exist_ok=True)
        cc = os.environ.get("CC") or sysconfig.get_config_var("CC").split()[0] or "cc"
        out = os.path.join(outdir, "memunreachable-demo")
        subprocess.check_call([cc, "-O0", "-g", "-Ifixtures", "-o", out, src, "-lpthread"])


setup(
    cffi_modules=["native/ffi_build.py:ffibuilder"],
    cmdclass={"build_ext": BuildExtWithDemo},
)
