"""How often the pytest plugin catches a real extension's leaks, per allocator.

Runs the 10-test suite of tests/integration/test_plugin.py (REAL: a 4 KiB scratch buffer
forgotten on an error path, a stray Py_INCREF of a list; 8 clean tests) RUNS times under each
PYTHONMALLOC setting and prints, per setting, in how many runs each leaky test failed and
whether any clean test failed.

    python bench/bench_plugin_detection.py [runs] [allocator ...] [--xdist N]

--xdist N runs the suite on N pytest-xdist workers (each checks itself).
"""
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "integration"))

from inprocess_helpers import build_extension  # noqa: E402
from test_plugin import REAL  # noqa: E402

LEAKY = ("test_parse_error_leaks", "test_remember_leaks_a_list")


def main() -> None:
    args = sys.argv[1:]
    xdist = []
    if "--xdist" in args:
        i = args.index("--xdist")
        xdist = ["-n", args[i + 1]]
        del args[i:i + 2]
    runs = int(args[0]) if args else 10
    allocators = args[1:] or ["pymalloc", "malloc", "pymalloc_debug", "malloc_debug"]
    ext = build_extension("textparse", flags=("-O2", "-g", "-fomit-frame-pointer"))
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "test_real.py"), "w") as f:
            f.write(REAL)
        for alloc in allocators:
            env = dict(os.environ, PYTHONPATH=ext)
            if alloc == "pymalloc":
                env.pop("PYTHONMALLOC", None)
            else:
                env["PYTHONMALLOC"] = alloc
            caught = dict.fromkeys(LEAKY, 0)
            false = 0
            for _ in range(runs):
                out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                      "--memunreachable", "-rf", *xdist, "test_real.py"], cwd=d, env=env,
                                     capture_output=True, text=True).stdout
                failed = set(re.findall(r"^FAILED test_real.py::(\w+)", out, re.M))
                for t in LEAKY:
                    caught[t] += t in failed
                false += bool(failed - set(LEAKY))
            print(f"{alloc:15s} " + ", ".join(f"{t} failed {caught[t]}/{runs}" for t in LEAKY)
                  + f"; runs with a clean test failing: {false}/{runs}")


if __name__ == "__main__":
    main()
