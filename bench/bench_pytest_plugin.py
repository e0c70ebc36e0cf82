"""Cost of the pytest plugin: 10 small tests, plain pytest vs `pytest --memunreachable`.

Prints the median wall time of N runs of each, and their ratio (issue 8: at most 3x).
Usage: python bench/bench_pytest_plugin.py [runs]
"""
import os
import statistics
import subprocess
import sys
import tempfile
import time

TESTS = "\n".join(f"def test_{i}():\n    assert sum(range({i} * 1000)) >= 0\n" for i in range(10))


def run(cwd: str, *args: str) -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                   cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - t0


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "test_small.py"), "w") as f:
            f.write(TESTS)
        plain, checked = [], []
        for _ in range(runs):
            plain.append(run(d))
            checked.append(run(d, "--memunreachable"))
    p, c = statistics.median(plain), statistics.median(checked)
    print(f"10 tests, median of {runs}: plain pytest {p:.2f} s, --memunreachable {c:.2f} s "
          f"({c / p:.1f}x; {1000 * (c - p) / 10:.0f} ms per test: 11 checks, one per fixture-free "
          f"test plus the first baseline)")


if __name__ == "__main__":
    main()
