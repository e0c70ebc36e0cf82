"""Build glue that pyproject.toml cannot express: the cffi extension and the demo binary.

`cffi_modules` is a setup() keyword only; the custom build_ext also compiles the bundled
leaky demo program (fixtures/demo.c) next to the C core, so `memunreachable demo` needs no
compiler at run time.
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

    def _build_demo(self):
        src = os.path.join("fixtures", "demo.c")
        if self.inplace:
            outdir = os.path.join("memunreachable", "_demo")
        else:
            outdir = os.path.join(self.build_lib, "memunreachable", "_demo")
        os.makedirs(outdir, exist_ok=True)
        cc = os.environ.get("CC") or sysconfig.get_config_var("CC").split()[0] or "cc"
        out = os.path.join(outdir, "memunreachable-demo")
        subprocess.check_call([cc, "-O0", "-g", "-Ifixtures", "-o", out, src, "-lpthread"])


setup(
    cffi_modules=["native/ffi_build.py:ffibuilder"],
    cmdclass={"build_ext": BuildExtWithDemo},
)
