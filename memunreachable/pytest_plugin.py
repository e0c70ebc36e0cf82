"""pytest_plugin.py: opt-in leak checks for test suites (entry point pytest11).

Inactive unless asked: `--memunreachable` checks every test, `@pytest.mark.no_leaks` one
test, and the `memunreachable` fixture gives explicit checks inside a test. A test fails
when unreachable blocks appeared during it (a baseline is taken just before it). When the
check cannot run (no ptrace here), tests are skipped with the exact reason, or fail with
`--memunreachable-strict`.
"""
from __future__ import annotations

import pytest

from memunreachable._errors import MemunreachableError
from memunreachable.noleaks import _only, _render, get_unreachable_memory, leak_baseline


def pytest_addoption(parser):
    group = parser.getgroup("memunreachable", "native leak checks (memunreachable)")
    group.addoption("--memunreachable", action="store_true", default=False,
                    help="fail tests during which native heap blocks became unreachable")
    group.addoption("--memunreachable-strict", action="store_true", default=False,
                    help="fail (instead of skip) tests whose leak check cannot run")
    parser.addini("memunreachable", type="bool", default=False,
                  help="same as --memunreachable")


def pytest_configure(config):
    config.addinivalue_line("markers", "no_leaks: fail the test if native heap blocks become "
                                       "unreachable during it (memunreachable)")


def pytest_report_header(config):
    import os
    if not (config.getoption("--memunreachable") or config.getini("memunreachable")):
        return None
    if os.environ.get("PYTHONMALLOC") != "malloc":
        return ("memunreachable: PYTHONMALLOC is not 'malloc': Python objects live in pymalloc "
                "arenas, which are scanned as roots, so stale words there can hide leaks; "
                "run with PYTHONMALLOC=malloc for precise checks")
    return "memunreachable: checking every test for unreachable native memory"


def _enabled(item) -> bool:
    cfg = item.config
    return (cfg.getoption("--memunreachable") or cfg.getini("memunreachable")
            or item.get_closest_marker("no_leaks") is not None)


def _cannot_check(item, exc: MemunreachableError):
    reason = f"memunreachable could not check: {exc}" + (f" (hint: {exc.hint})" if exc.hint else "")
    if item.config.getoption("--memunreachable-strict"):
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if not _enabled(item):
        return (yield)
    try:
        base = leak_baseline()
    except MemunreachableError as exc:
        _cannot_check(item, exc)
    # a test that fails on its own raises here: no leak report is piled on top
    result = yield
    try:
        info = get_unreachable_memory(limit=None)
    except MemunreachableError as exc:
        _cannot_check(item, exc)
    new = base.new_leaks(info)
    if new:
        new_info = _only(info, new)
        item.add_report_section("call", "memunreachable", _render(new_info, True))
        pytest.fail(f"{new_info.num_leaks} native heap block(s) became unreachable during the "
                    f"test ({new_info.leak_bytes} bytes):\n{_render(new_info, True)}", pytrace=False)
    return result


class _Checker:
    """The `memunreachable` fixture: explicit checks inside a test."""

    def __init__(self):
        self.baseline = leak_baseline()

    def new_leaks(self):
        return self.baseline.new_leaks(get_unreachable_memory(limit=None))

    def assert_no_new_leaks(self):
        from memunreachable._errors import LeaksDetected
        info = get_unreachable_memory(limit=None)
        new = self.baseline.new_leaks(info)
        if new:
            new_info = _only(info, new)
            raise LeaksDetected(new_info, _render(new_info, True))


@pytest.fixture
def memunreachable(request):
    try:
        return _Checker()
    except MemunreachableError as exc:
        _cannot_check(request.node, exc)
