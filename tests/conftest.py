"""Shared pytest setup.

The fixture harness lives in tests/fixtures.py (importable as `fixtures`). Tests marked
`ptrace` need to trace a child process: a cached probe decides whether this machine allows
it. Locally they are skipped with the exact reason; under CI (CI set in the environment)
they FAIL instead, so a CI machine without ptrace can never pass by skipping.
"""
import os
import signal
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_PROBE = None


def ptrace_probe() -> str:
    """'' when PTRACE_SEIZE of a child works here, else the reason it does not."""
    global _PROBE
    if _PROBE is not None:
        return _PROBE
    try:
        from ptrace import PtraceError
        from ptrace.binding.func import ptrace
    except ImportError as exc:
        _PROBE = f"python-ptrace is not importable: {exc}"
        return _PROBE
    child = subprocess.Popen(["sleep", "30"])
    try:
        ptrace(0x4206, child.pid, 0, 0)        # PTRACE_SEIZE
        _PROBE = ""
    except PtraceError as exc:
        scope = "absent"
        try:
            with open("/proc/sys/kernel/yama/ptrace_scope") as f:
                scope = f.read().strip()
        except OSError:
            pass
        _PROBE = f"PTRACE_SEIZE refused ({exc}); kernel.yama.ptrace_scope={scope}"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    return _PROBE


def pytest_runtest_setup(item):
    if item.get_closest_marker("ptrace") is None:
        return
    reason = ptrace_probe()
    if not reason:
        return
    if os.environ.get("CI"):
        pytest.fail(f"ptrace tests must run in CI, but ptrace is unavailable: {reason}", pytrace=False)
    pytest.skip(f"ptrace unavailable: {reason}")
