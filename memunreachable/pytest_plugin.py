"""pytest_plugin.py: opt-in leak checks for test suites (entry point pytest11).

Inactive unless asked: `--memunreachable` checks every test, `@pytest.mark.no_leaks` one
test, and the `memunreachable` fixture gives explicit checks inside a test. A test fails
when unreachable blocks appeared during it (a baseline is taken just before it).
Consecutive checked tests that use no fixture share a check: the check after one test is
the baseline of the next (only pytest's own code ran between them), so such tests cost one
check each instead of two. A test with fixtures (their setup and the previous test's
teardown may allocate) gets its own baseline just before its body.
A check that cannot run (no ptrace here, say) never skips or hides the test: its body always
runs and its own outcome stands; the check's failure then errors the test at teardown, with
the reason and hint, or is a warning with `--memunreachable-cannot-check=warn` (ini
`memunreachable_cannot_check`).
Suppressions (LSan format, issue 9): `--memunreachable-suppressions FILE` or the ini
`memunreachable_suppressions` (relative to the ini file's directory); leaks a rule matches never
fail a test. A file that cannot be read or parsed stops the run at start-up (usage error).
"""
from __future__ import annotations

import contextlib
import gc
import sys
import warnings

import pytest

from memunreachable._errors import MemunreachableError, SweepError


def _nl():
    """memunreachable.noleaks, imported on first use: a pytest run that checks nothing does not
    pay its imports (14 ms here without .pyc files), and one that does starts the helper first."""
    from memunreachable import noleaks
    return noleaks


def pytest_addoption(parser):
    group = parser.getgroup("memunreachable", "native leak checks (memunreachable)")
    group.addoption("--memunreachable", action="store_true", default=False,
                    help="fail tests during which native heap blocks became unreachable")
    group.addoption("--memunreachable-cannot-check", choices=("error", "warn"), default=None,
                    help="when a leak check cannot run: 'error' the test at teardown (default) "
                         "or only 'warn'; the test body runs and its outcome stands either way")
    group.addoption("--memunreachable-strict", action="store_true", default=False,
                    help="deprecated: a check that cannot run is an error by default now")
    parser.addini("memunreachable", type="bool", default=False,
                  help="same as --memunreachable")
    parser.addini("memunreachable_cannot_check", default="error",
                  help="same as --memunreachable-cannot-check (error | warn)")
    group.addoption("--memunreachable-suppressions", metavar="FILE", default=None,
                    help="LeakSanitizer suppressions file ('leak:PATTERN' lines): matching "
                         "leaks never fail a test")
    parser.addini("memunreachable_suppressions", default="",
                  help="same as --memunreachable-suppressions (relative to the ini file)")


_RULES = pytest.StashKey[list]()


def _load_rules(config) -> list:
    """The suppression rules of the option or the ini ([] for none); UsageError when bad."""
    import os
    path = config.getoption("--memunreachable-suppressions")
    if not path:
        path = config.getini("memunreachable_suppressions")
        if path and not os.path.isabs(path):
            base = config.inipath.parent if config.inipath else config.rootpath
            path = os.path.join(str(base), path)
    if not path:
        return []
    from memunreachable.suppressions import load
    try:
        return load(path)
    except MemunreachableError as exc:
        raise pytest.UsageError(f"memunreachable: {exc}" + (f" (hint: {exc.hint})"
                                                             if exc.hint else ""))


def _rules(config) -> list:
    return config.stash.get(_RULES, [])


def _checks_every_test_here(config, option) -> bool:
    """--memunreachable (or the ini) in a process that runs the tests: not an xdist
    controller, not --collect-only."""
    xdist_controller = getattr(option, "numprocesses", None) and \
        not hasattr(config, "workerinput")
    try:
        enabled = getattr(option, "memunreachable", False) or config.getini("memunreachable")
    except (ValueError, KeyError):
        return False
    return bool(enabled) and not xdist_controller and not getattr(option, "collectonly", False)


def _start_helper_early(config, option) -> None:
    """Start this process's helper when every test is checked here: its start-up (an
    interpreter, the pipeline's imports, libc's and libpython's ELF files: 0.2-0.3 s) then
    overlaps with pytest's own conftest loading and collection instead of delaying the first
    check. A failure here is reported by the checks."""
    if _checks_every_test_here(config, option):
        with contextlib.suppress(MemunreachableError, OSError):
            _nl().start_helper()


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    # the earliest hook with the options parsed: before conftests are imported
    _start_helper_early(early_config, early_config.known_args_namespace)


def pytest_configure(config):
    config.stash[_RULES] = _load_rules(config)
    config.addinivalue_line("markers", "no_leaks: fail the test if native heap blocks become "
                                       "unreachable during it (memunreachable)")
    _start_helper_early(config, config.option)      # a no-op when it runs already


def pytest_report_header(config):
    if not (config.getoption("--memunreachable") or config.getini("memunreachable")):
        return None
    line = "memunreachable: checking every test for unreachable native memory and Python objects"
    if not _debug_hooks():
        line += ("\nmemunreachable: CPython's memory debug hooks are off, so a stale copy of a "
                 "pointer can hide a leak in some runs; `python -X dev -m pytest` (or "
                 "PYTHONMALLOC=pymalloc_debug) fills freed memory: the same outcome every run")
    return line


def _debug_hooks() -> bool:
    """CPython's allocator debug hooks are installed (-X dev, PYTHONMALLOC=*debug)."""
    import os
    import sys
    return bool(sys.flags.dev_mode) or os.environ.get("PYTHONMALLOC", "").endswith("debug")


def _enabled(item) -> bool:
    cfg = item.config
    return (cfg.getoption("--memunreachable") or cfg.getini("memunreachable")
            or item.get_closest_marker("no_leaks") is not None)


_CANNOT = pytest.StashKey[MemunreachableError]()
_AFTER = pytest.StashKey[tuple]()       # (item, LeakBaseline) of the last check after a test body
_PREVIOUS = pytest.StashKey[object]()   # the item whose protocol ran last
_SEEN = pytest.StashKey[object]()       # LeakBaseline: every leak a check of the session reported
_COLLECT = pytest.StashKey[bool]()      # a test failed or skipped since the last test body
                                        # (unset: no test body checked yet)


def _reason(exc: MemunreachableError) -> str:
    return f"memunreachable could not check: {exc}" + (f" (hint: {exc.hint})" if exc.hint else "")


def _cannot_check_mode(config) -> str:
    mode = config.getoption("--memunreachable-cannot-check") or \
        config.getini("memunreachable_cannot_check") or "error"
    if mode not in ("error", "warn"):
        raise pytest.UsageError(f"memunreachable_cannot_check must be 'error' or 'warn', not {mode!r}")
    return mode


def _runs_no_fixture_code(item) -> bool:
    """True when no fixture (setup or teardown code) belongs to the item: its fixture names
    are only direct parametrize arguments (pytest's pseudo-fixtures)."""
    names = set(getattr(item, "fixturenames", ()) or ())
    params = getattr(getattr(item, "callspec", None), "params", {})
    try:
        defs = item._fixtureinfo.name2fixturedefs        # private: any doubt means "no"
    except AttributeError:
        return not names
    for name in names:
        if name not in params or any(
                getattr(d.func, "__name__", "") != "get_direct_param_fixture_func"
                for d in defs.get(name, ())):
            return False
    return True


# A failed or skipped phase leaves reference cycles (its exception's traceback and frames,
# kept in sys.last_traceback until pytest's next pytest_runtest_call) that the next check would
# find as cyclic garbage, and a check that finds garbage is repeated after a gc.collect()
# (noleaks._collected): a second sweep, for garbage of pytest's own. The next test drops and
# collects it before its baseline instead (one gc.collect(), ~8 ms; the real-extension suite's
# clean tests after its two failing ones took 100 ms each, now 52-55 ms). So does the first
# checked test of the session: the imports and the collection may leave such garbage (6 of 6
# sessions of 10 tests with a conftest.py of 20 lines, none of 5 without one), and the first
# test then took a second sweep (50-90 ms); that collection overlaps with the helper's
# start-up, which the first baseline waits for anyway.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.outcome != "passed":
        item.config.stash[_COLLECT] = True
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    try:
        return (yield)
    finally:
        item.config.stash[_PREVIOUS] = item


def _chained_baseline(item):
    """The check after the previous test's body, when it may serve as this test's baseline:
    that test ran just before this one and neither has fixtures."""
    after = item.config.stash.get(_AFTER, None)
    if after is None:
        return None
    prev, base = after
    if (prev is not item.config.stash.get(_PREVIOUS, None) or not _runs_no_fixture_code(prev)
            or not _runs_no_fixture_code(item)):
        return None
    return base


# The wrapper stays this small: its generator's frame is allocated whole and its stack slots
# are written only when used, so a frame with room for deeper expressions than those it has
# run kept stale words of the block's earlier life (one held a leaked list's address, 1 of 40
# runs of the real-extension suite). Every slot of this one is written before the check.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if not _enabled(item):
        return (yield)
    base = _before(item)
    try:
        result = yield
    except BaseException:
        # a test that fails on its own: its outcome stands, no leak report on top
        _drop(base)
        raise
    _nl()._scrub_frames()
    _after(item, base)
    return result


# Runs right after the test's body (the last plain implementation; not after a test that
# raised), from pluggy's own call frame, before the wrapper's generator is resumed: the C stack
# and the frame data stack where the test's calls ran are zeroed, so the frames that resume the
# wrapper and run the check start clean (a resumed generator's eval loop reuses the stack the
# test's eval loop left, and leaves most of its spill slots unwritten).
@pytest.hookimpl(trylast=True, specname="pytest_runtest_call")
def pytest_runtest_call_scrub(item):
    if _enabled(item):
        nl = _nl()
        nl._scrub_stack()
        nl._scrub_frames()


def _before(item):
    """The baseline of item's test: the previous test's check (a LeakBaseline), else a
    DeferredBaseline, swept only if the check after the test finds a leak the session has not
    seen; None when it cannot be taken (the reason is kept)."""
    if item.config.stash.get(_COLLECT, True):       # pytest's own garbage: not this test's
        item.config.stash[_COLLECT] = False
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            # what pytest's own pytest_runtest_call drops next (kept for post-mortem
            # debugging of the failure): its traceback is the garbage's root
            with contextlib.suppress(AttributeError):
                delattr(sys, name)
        gc.collect()
    base = _chained_baseline(item)
    item.config.stash[_AFTER] = None        # this test's body runs: any older check is stale
    if base is None:
        try:
            base = _nl().deferred_baseline(_rules(item.config))
            if not base.waiting:            # the helper checked at once: known now
                base = base.resolve()
                _remember(item.config, base)
        except MemunreachableError as exc:
            item.stash[_CANNOT] = exc       # reported at teardown; the test body runs regardless
    return base


def _drop(base) -> None:
    """Release base's waiting snapshot, if any (a failure only loses a snapshot)."""
    if base is not None and getattr(base, "waiting", False):
        with contextlib.suppress(MemunreachableError):
            base.drop()


def _after(item, base) -> None:
    """The check after item's test: fails it with the report of the new leaks."""
    if base is None:
        return
    try:
        info = _nl().get_unreachable_memory(limit=None, suppressions=_rules(item.config))
    except MemunreachableError as exc:
        item.stash[_CANNOT] = exc
        _drop(base)
        return
    after = _nl().LeakBaseline.of(info.leaks)
    item.config.stash[_AFTER] = (item, after)
    # New leaks are those no earlier check of the session reported (the baseline is one of
    # them): a leak a check in between saw reachable, through a stale copy of its address
    # overwritten since, is not this test's, and the clean test after it would fail
    new = _seen(item.config).new_leaks(info)
    if new and getattr(base, "waiting", False):
        try:
            _remember(item.config, base.resolve())
        except MemunreachableError as exc:
            item.stash[_CANNOT] = SweepError(
                f"{len(new)} block(s) unreachable after the test could not be told apart from "
                f"those before it: its baseline could not be swept ({exc})", hint=exc.hint)
            _remember(item.config, after)
            return
        new = _seen(item.config).new_leaks(info)
    _drop(base)
    _remember(item.config, after)
    if new:
        new_info = _nl()._only(info, new)
        pytest.fail(f"{new_info.num_leaks} native heap block(s) became unreachable during the "
                    f"test ({new_info.leak_bytes} bytes):\n{_nl()._render(new_info, True)}",
                    pytrace=False)


def _seen(config):
    return config.stash.get(_SEEN, None) or _nl().LeakBaseline(())


def _remember(config, leaks) -> None:
    config.stash[_SEEN] = _seen(config) | leaks


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    exc = item.stash.get(_CANNOT, None)
    if exc is not None:
        del item.stash[_CANNOT]
        if _cannot_check_mode(item.config) == "warn":
            warnings.warn(pytest.PytestWarning(_reason(exc)))
        else:
            pytest.fail(_reason(exc), pytrace=False)
    return result


class _Checker:
    """The `memunreachable` fixture: explicit checks inside a test. When the baseline cannot
    be taken the test still runs; each check then raises the reason."""

    def __init__(self, rules=()):
        self.error = None
        self.baseline = None
        self.rules = list(rules)
        try:
            self.baseline = _nl().leak_baseline(self.rules)
        except MemunreachableError as exc:
            self.error = exc

    def _info(self):
        if self.error is not None:
            raise self.error
        return _nl().get_unreachable_memory(limit=None, suppressions=self.rules)

    def new_leaks(self):
        info = self._info()             # raises the reason when the baseline could not be taken
        return self.baseline.new_leaks(info)

    def assert_no_new_leaks(self):
        from memunreachable._errors import LeaksDetected
        info = self._info()
        new = self.baseline.new_leaks(info)
        if new:
            new_info = _nl()._only(info, new)
            raise LeaksDetected(new_info, _nl()._render(new_info, True))


@pytest.fixture
def memunreachable(request):
    return _Checker(_rules(request.config))
