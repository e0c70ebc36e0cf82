"""pytest_plugin.py: opt-in leak checks for test suites (entry point pytest11).

Inactive unless asked: `--memunreachable` checks every test, `@pytest.mark.no_leaks` one
test, and the `memunreachable` fixture gives explicit checks inside a test. A test fails
when unreachable blocks appeared during it (a baseline is taken just before it).
Consecutive checked tests that use no fixture share a check: the check after one test is
the baseline of the next (only pytest's own code ran between them), so such tests cost one
check each instead of two. A test with fixtures (their setup and the previous test's
teardown may allocate) gets its own baseline just before its body.
Batches (`--memunreachable`, `--memunreachable-batch N`, default 10): a test's check is a
snapshot (the pause only) whose sweep waits; the last test of a batch gets the one sweep,
and only when it finds a leak the session has not seen are the waiting snapshots swept, in
order, to tell whose leak it is. Reports wait with the batch and are then logged in order,
each test's verdict what a check after it alone gives for a leak still unreachable at the
batch's end. A batch ends after N tests, after a second, at a failure, and at the end.
A check that cannot run (no ptrace here, say) never skips or hides the test: its body always
runs and its own outcome stands; the check's failure then errors the test at teardown, with
the reason and hint, or is a warning with `--memunreachable-cannot-check=warn` (ini
`memunreachable_cannot_check`).
Suppressions (LSan format, issue 9): `--memunreachable-suppressions FILE` or the ini
`memunreachable_suppressions` (relative to the ini file's directory); leaks a rule matches never
fail a test. A file that cannot be read or parsed stops the run at start-up (usage error).
The failure text is pytest_report.py's; held reports on xdist workers are pytest_xdist.py's and
the tracked sessions' pure parts pytest_tracked.py's. Still about 950 lines: the next cuts that
would read well are _Tracked (the tracked session's hooks) and _Batch.
"""
from __future__ import annotations

import contextlib
import gc
import sys
import time
import warnings
from typing import Optional

import pytest

from memunreachable._errors import MemunreachableError, SweepError
from memunreachable.pytest_report import leak_text


def _xd():
    """memunreachable.pytest_xdist (held reports on xdist workers), imported on first use."""
    from memunreachable import pytest_xdist
    return pytest_xdist


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
    group.addoption("--memunreachable-batch", metavar="N", type=int, default=None,
                    help="tests whose checks share one sweep when none of them leaks "
                         "(default 10; 1: a sweep after every test)")
    parser.addini("memunreachable_batch", default="",
                  help="same as --memunreachable-batch")
    group.addoption("--memunreachable-untracked", action="store_true", default=False,
                    help="do not track allocations in this process: a snapshot per test "
                         "instead (no allocation stacks; slower)")
    parser.addini("memunreachable_untracked", type="bool", default=False,
                  help="same as --memunreachable-untracked")
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
    from memunreachable.stacks.suppressions import load
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
    return (_asked(config, option) and not _xdist_controller(config, option)
            and not getattr(option, "collectonly", False))


def _asked(config, option) -> bool:
    """--memunreachable, or the ini value."""
    try:
        return bool(getattr(option, "memunreachable", False) or config.getini("memunreachable"))
    except (ValueError, KeyError):
        return False


def _xdist_controller(config, option) -> bool:
    return bool(getattr(option, "numprocesses", None)) and not hasattr(config, "workerinput")


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


def _idle_options(config) -> list:
    """The memunreachable options given while --memunreachable (and its ini) is off."""
    if config.getoption("--memunreachable") or config.getini("memunreachable"):
        return []
    given = [opt for opt in ("--memunreachable-batch", "--memunreachable-suppressions",
                             "--memunreachable-cannot-check", "--memunreachable-untracked")
             if config.getoption(opt)]
    given += [f"the {name} ini value" for name in ("memunreachable_batch",
                                                   "memunreachable_suppressions")
              if config.getini(name)]
    return given + (["--memunreachable-strict"]
                    if config.getoption("--memunreachable-strict") else [])


def pytest_configure(config):
    idle = _idle_options(config)
    if idle:        # never a silent no-op: the user meant a check
        config.issue_config_time_warning(pytest.PytestConfigWarning(
            f"memunreachable: {', '.join(idle)} given without --memunreachable: no test is "
            "checked except those marked no_leaks (add --memunreachable, or memunreachable = "
            "true in the ini file, to check every test)"), stacklevel=2)
    config.stash[_RULES] = _load_rules(config)
    config.stash[_TRACKED] = _start_tracking(config)
    config.stash[_BATCH] = _batch_of(config) if config.stash[_TRACKED] is None else None
    config.addinivalue_line("markers", "no_leaks: fail the test if native heap blocks become "
                                       "unreachable during it (memunreachable)")
    _start_helper_early(config, config.option)      # a no-op when it runs already


def pytest_report_header(config):
    if not (config.getoption("--memunreachable") or config.getini("memunreachable")):
        return None
    line = "memunreachable: checking every test for unreachable native memory and Python objects"
    if config.stash.get(_TRACKED, None) is not None:
        line += ("\nmemunreachable: allocations are tracked in this process (allocation stacks; "
                 "one sweep per stretch of tests)")
    elif _UNTRACKED in config.stash:
        exc = config.stash[_UNTRACKED]
        hint = f" (hint: {exc.hint})" if exc.hint else ""
        line += (f"\nmemunreachable: allocations cannot be tracked here, so a snapshot per test "
                 f"and no allocation stacks: {exc}{hint}")
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
_AFTER = pytest.StashKey[tuple]()       # (item, baseline) of the last check after a test body
_PREVIOUS = pytest.StashKey[object]()   # the item whose protocol ran last
_SEEN = pytest.StashKey[object]()       # LeakBaseline: every leak a check of the session reported
_COLLECT = pytest.StashKey[bool]()      # a test failed or skipped since the last test body
                                        # (unset: no test body checked yet)
_BATCH = pytest.StashKey[object]()      # the session's _Batch (None: a sweep after every test)
_NEXT = pytest.StashKey[object]()       # the item's nextitem: set when our protocol runs it
_OWN_BASE = pytest.StashKey[object]()   # the baseline _before took for this item itself
_VERDICT = pytest.StashKey[tuple]()     # a held test's verdict: ("leaks", text) | ("cannot", exc)
_TRACKED = pytest.StashKey[object]()    # the session's _Tracked (None: a check per test)
_NUMBER = pytest.StashKey[int]()        # a tracked session's number of the test


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
# (noleaks._needs_collected): a second sweep, for garbage of pytest's own. The next test drops and
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


# ---- batches (module docstring) -----------------------------------------------------------
# A check is a pause (2 ms) and a sweep (45 ms of a pytest process's 150,000 blocks); a
# leak, once unreachable, stays so. So a test's check waits as a snapshot, and the sweep
# after the last test of its batch decides for all: no leak the session has not seen means
# every test of the batch passes, unswept. Reports are held meanwhile (the protocol runs with
# log=False, as pytest-rerunfailures does), and logged in order once the batch is settled.
BATCH = 10                  # tests per batch (--memunreachable-batch)
BATCH_SECONDS = 1.0         # a batch open this long ends at its next check
MAX_WAITING = 40            # waiting snapshots (helper processes' clones), at most


class _Batch:
    """The checked tests of a session whose sweeps wait, and the reports held with them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: list = []     # items whose check after the body waits, in run order
        self.held: list = []        # (item, reports) of each test run since the last flush
        self.started = 0.0

    def add(self, item) -> None:
        if not self.entries:
            self.started = time.monotonic()
        self.entries.append(item)

    def waiting(self) -> int:
        return sum(1 for e in self.entries for key in (_OWN_BASE, _HELD)
                   if getattr(e.stash.get(key, None), "waiting", False))

    def ends_at(self, item) -> bool:
        """Whether item's check is its batch's last (a sweep now)."""
        return (item.stash.get(_NEXT, None) is None or len(self.entries) + 1 >= self.size
                or self.waiting() + 2 > MAX_WAITING
                or (bool(self.entries) and time.monotonic() - self.started >= BATCH_SECONDS))


_HELD = pytest.StashKey[object]()       # a held test's check after its body (DeferredBaseline)


def _batch_of(config) -> Optional[_Batch]:
    """The session's _Batch, None for a sweep after every test (--memunreachable-batch 1, not
    every test checked here, or an xdist worker that cannot hold reports: pytest_xdist.py)."""
    if not _checks_every_test_here(config, config.option) or not _xd().can_hold_reports(config):
        return None
    size = _batch_size(config) or BATCH
    return _Batch(size) if size > 1 else None


def _batch_size(config) -> Optional[int]:
    """--memunreachable-batch, else the ini value; None when neither is given."""
    size = config.getoption("--memunreachable-batch")
    if size is None:
        raw = config.getini("memunreachable_batch")
        if not raw:
            return None
        try:
            size = int(raw)
        except ValueError:
            raise pytest.UsageError(f"memunreachable_batch must be a number, not {raw!r}") \
                from None
    if size < 1:
        raise pytest.UsageError(f"--memunreachable-batch must be at least 1, not {size}")
    return size


def _runs_its_own_protocol(item) -> bool:
    """Another plugin runs the test protocol (pytest-rerunfailures, say): held reports and
    its reruns would not mix, so such a test is checked alone."""
    for impl in item.ihook.pytest_runtest_protocol.get_hookimpls():
        if (impl.hookwrapper or getattr(impl, "wrapper", False) or impl.plugin_name == "runner"
                or impl.plugin is sys.modules[__name__]):
            continue
        return True
    return False


@pytest.hookimpl(tryfirst=True, specname="pytest_runtest_protocol")
def pytest_runtest_protocol_batched(item, nextitem):
    tracked = _tracked(item)
    if tracked is not None:
        return tracked.protocol(item, nextitem)
    batch = item.config.stash.get(_BATCH, None)
    if batch is None:
        return None
    if _runs_its_own_protocol(item):
        _settle_now(item.config, batch)
        _flush(item.config, batch)
        return None
    from _pytest.runner import runtestprotocol      # pytest's protocol, reports not logged
    item.stash[_NEXT] = nextitem
    try:
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
    except BaseException:       # interrupted: what ran is logged unchecked, nothing waits
        _drop(*_snapshots(batch.entries))
        batch.entries = []
        _flush(item.config, batch)
        raise
    batch.held.append((item, reports))
    _xd().journal_held(item, reports)
    if batch.entries and (nextitem is None or any(r.failed for r in reports)):
        _settle_now(item.config, batch)     # a failure is logged at once (-x, --sw)
    if not batch.entries:
        _flush(item.config, batch)
    return True


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session):
    try:
        return (yield)
    finally:
        batch = session.config.stash.get(_BATCH, None)
        if batch is not None and batch.held:        # the loop stopped mid-batch
            _settle_now(session.config, batch)
            _flush(session.config, batch)
        tracked = session.config.stash.get(_TRACKED, None)
        if tracked is not None and tracked.held:
            tracked.sweep()
            _flush(session.config, tracked)



# ---- tracked sessions (pytest_tracked.py) --------------------------------------------------
# With the tracking library routing this process's allocations, each block carries the epoch of
# the test phase that allocated it: no baseline and no check per test, one sweep per stretch
# of tests (paced by pytest_tracked.sweep_due), and every leak comes with its allocation stack.

def _start_tracking(config):
    """The session's _Tracked when every test is checked here and the tracking library could
    route this process (track_here); None otherwise: a check per test, as before."""
    if (not _checks_every_test_here(config, config.option)
            or config.getoption("--memunreachable-untracked")
            or config.getini("memunreachable_untracked")):
        return None
    from memunreachable import track_here
    try:
        track_here.start(python=True)
    except MemunreachableError as exc:
        config.stash[_UNTRACKED] = exc
        return None
    cap = _batch_size(config)
    return _Tracked(config, track_here, cap, not _xd().can_hold_reports(config) or cap == 1)


_UNTRACKED = pytest.StashKey[MemunreachableError]()     # why the session is not tracked


def _tracked(item):
    return item.config.stash.get(_TRACKED, None)


class _Tracked:
    """A tracked session: its test numbers, the stretch of tests since the last sweep and
    their held reports (per_test: a sweep after every test body, reports not held:
    --memunreachable-batch 1, or an xdist worker that cannot hold them), and what fails no
    single test."""

    def __init__(self, config, track_here, cap, per_test: bool) -> None:
        self.config, self.track, self.cap, self.per_test = config, track_here, cap, per_test
        self.numbers = 0
        self.stretch: dict = {}         # number -> item, since the last sweep
        self.nodeids: dict = {}         # number -> nodeid, every test begun (orphans' makers)
        self.held: list = []            # (item, reports) not logged yet
        self.tests_seconds = 0.0        # the stretch's own time
        self.last_sweep = 0.0           # what the last sweep cost (s)
        self.baseline = False           # the leaks before the first test are known
        self.baseline_error = None      # why they are not
        self.orphans: list = []         # (headline, report) of leaks no single test made
        self.sweeps, self.sweep_seconds = 0, 0.0

    @property
    def tests(self) -> int:
        return self.numbers

    @property
    def seconds(self) -> float:
        return self.sweep_seconds

    # -- epochs ---------------------------------------------------------------------------
    def begin(self, item) -> int:
        if not self.baseline:           # what start-up and collection left: nobody's
            try:
                self._check()
                self.baseline, self.baseline_error = True, None
            except MemunreachableError as exc:  # the stretch's verdict; tried again after it
                self.baseline_error = exc
        self.numbers += 1
        item.stash[_NUMBER] = self.numbers
        self.stretch[self.numbers] = item
        self.nodeids[self.numbers] = item.nodeid
        return self.numbers

    def phase(self, item, phase: int):
        from memunreachable.pytest_tracked import epoch
        number = item.stash.get(_NUMBER, None)
        if number is not None:
            self.track.set_epoch(epoch(number, phase))

    def outside(self) -> None:
        self.track.set_epoch(0)

    # -- the protocol -----------------------------------------------------------------------
    def protocol(self, item, nextitem):
        if self.per_test or _runs_its_own_protocol(item):
            if self.held:
                self.sweep()
                _flush(self.config, self)
            return None
        from _pytest.runner import runtestprotocol      # pytest's protocol, reports not logged
        from memunreachable.pytest_tracked import sweep_due
        t0 = time.monotonic()
        try:
            reports = runtestprotocol(item, nextitem=nextitem, log=False)
        except BaseException:       # interrupted: what ran is logged unchecked
            self.stretch = {}
            _flush(self.config, self)
            raise
        self.tests_seconds += time.monotonic() - t0
        self.held.append((item, reports))
        _xd().journal_held(item, reports)
        if sweep_due(len(self.stretch), self.cap, self.tests_seconds, self.last_sweep,
                     nextitem is None, any(r.failed for r in reports)):
            self.sweep()
            _flush(self.config, self)
        return True

    def after_body(self, item) -> None:
        """per_test: the sweep right after the body fails the test with its leaks."""
        verdict = None
        if self.per_test or _runs_its_own_protocol(item):
            self.sweep()
            verdict = item.stash.get(_VERDICT, None)
            if verdict is not None:
                del item.stash[_VERDICT]
        if verdict is not None and verdict[0] == "leaks":
            pytest.fail(verdict[1], pytrace=False)
        if verdict is not None:
            item.stash[_CANNOT] = verdict[1]

    # -- sweeps -------------------------------------------------------------------------------
    def _check(self):
        """(a check of this process, its leaks no check of the session reported). A stretch of
        tests leaves cyclic garbage more often than not, and a check that finds some is
        repeated after a gc.collect(): collecting first costs one collection, not a sweep."""
        self.config.stash[_COLLECT] = False
        _collect_garbage()
        nl = _nl()
        nl._scrub_stack()
        t0 = time.monotonic()
        try:
            info = nl.get_unreachable_memory(limit=None, suppressions=_rules(self.config))
        finally:
            self.last_sweep = time.monotonic() - t0
            self.tests_seconds = 0.0
            self.sweeps += 1
            self.sweep_seconds += self.last_sweep
        new = _seen(self.config).new_leaks(info)
        _remember(self.config, nl.LeakBaseline.of(info.leaks))
        return info, new

    def sweep(self) -> None:
        """Sweep; give each test of the stretch its verdict."""
        from memunreachable import pytest_tracked as pt
        stretch, self.stretch = self.stretch, {}
        if not stretch:
            return
        try:
            if self.baseline_error is not None:
                raise self.baseline_error
            info, new = self._check()
        except MemunreachableError as exc:
            for item in stretch.values():
                item.stash[_VERDICT] = ("cannot", exc)
            return
        if not new:
            return
        att = pt.attribute(new, list(stretch))
        for number, leaks in att.by_test.items():
            stretch[number].stash[_VERDICT] = ("leaks", leak_text(info, leaks, number=number))
        for number, leaks in att.fixtures.items():
            warnings.warn(pytest.PytestWarning(
                f"{stretch[number].nodeid}: its fixtures (setup or teardown) leaked; no test "
                f"fails for that:\n{leak_text(info, leaks, 'during its fixtures')}"))
        if not att.orphans:
            return
        items = list(stretch.values())
        if len(items) == 1:
            own = items[0].stash.get(_VERDICT, (None, ""))
            text = leak_text(info, att.orphans, "during this test, allocated before it",
                             makers=self.nodeids)
            items[0].stash[_VERDICT] = ("leaks", (own[1] + "\n" if own[0] == "leaks" else "")
                                        + text)
        else:
            where = pt.orphan_text(items[0].nodeid, items[-1].nodeid, len(items))
            self.orphans.append((where, leak_text(info, att.orphans, "in a stretch of tests")))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    tracked = _tracked(item)
    if tracked is None:
        return (yield)
    from memunreachable.pytest_tracked import SETUP
    tracked.begin(item)
    tracked.phase(item, SETUP)
    try:
        return (yield)
    finally:
        tracked.outside()


@pytest.hookimpl(wrapper=True, specname="pytest_runtest_call")
def pytest_runtest_call_tracked(item):
    tracked = _tracked(item)
    if tracked is None:
        return (yield)
    from memunreachable.pytest_tracked import CALL
    tracked.phase(item, CALL)
    try:
        result = yield
    finally:
        tracked.outside()
    tracked.after_body(item)
    return result


@pytest.hookimpl(wrapper=True, specname="pytest_runtest_teardown")
def pytest_runtest_teardown_tracked(item, nextitem):
    tracked = _tracked(item)
    if tracked is None:
        return (yield)
    from memunreachable.pytest_tracked import TEARDOWN
    tracked.phase(item, TEARDOWN)
    try:
        return (yield)
    finally:
        tracked.outside()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tracked = config.stash.get(_TRACKED, None) or _xd().workers(config)
    if tracked is None:
        return
    n = getattr(tracked, "workers", 0)
    on = f" on {n} xdist worker{'s' if n != 1 else ''}" if n else ""
    terminalreporter.write_line(f"memunreachable: {tracked.tests} tests checked by "
                                f"{tracked.sweeps} sweeps{on} ({tracked.seconds:.2f} s)")
    if not tracked.orphans:
        return
    from memunreachable.pytest_tracked import summary_lines
    terminalreporter.section("memunreachable: leaks no single test is blamed for", red=True)
    for line in summary_lines(tracked.orphans):
        terminalreporter.line(line)


# ---- the xdist controller: a crashed worker's held reports (pytest_xdist.py) ----------------

def _checks_xdist_workers(config) -> bool:
    """--memunreachable in an xdist controller: its workers check their tests."""
    return _xdist_controller(config, config.option) and _asked(config, config.option)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    if _checks_xdist_workers(node.config):
        _xd().configure_node(node.config, node)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    config = node.config
    if not _checks_xdist_workers(config):
        return
    if error is None:
        _xd().node_finished(config, node)
        return
    name = getattr(getattr(node, "gateway", None), "id", "an xdist worker")
    _xd().node_crashed(
        config, node, warn=_cannot_check_mode(config) == "warn",
        not_run=lambda nodeid: f"{nodeid}: not checked for leaks: xdist worker {name} crashed "
                               "in a later test, before this test's leak check ran")


def pytest_unconfigure(config):
    _xd().cleanup(config)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    tracked = session.config.stash.get(_TRACKED, None)
    if tracked is not None:         # an xdist worker's go to the controller
        _xd().worker_output(session.config, tracked.tests, tracked.sweeps, tracked.seconds,
                            tracked.orphans)
    tracked = tracked or _xd().workers(session.config)
    if tracked is not None and tracked.orphans and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

def _settle_now(config, batch: _Batch) -> None:
    """A check now settles the held tests (after a failure, or a test with no check of its
    own): leaks it finds that no waiting snapshot held were not theirs (the failing test's,
    its teardown's: nobody's, as the next test's own baseline would have it)."""
    if not batch.entries:
        return
    entries, batch.entries = batch.entries, []
    _collect_garbage()
    try:
        info = _nl().get_unreachable_memory(limit=None, suppressions=_rules(config))
    except MemunreachableError as exc:
        _cannot_settle(entries, exc)
        return
    _settle(config, info, entries, None)


def _flush(config, batch: _Batch) -> None:
    """Log the held reports in order, each settled test's verdict applied first."""
    held, batch.held = batch.held, []
    for item, reports in held:
        verdict = item.stash.get(_VERDICT, None)
        if verdict is not None:
            del item.stash[_VERDICT]
            kind, what = verdict
            if kind == "leaks":
                _fail_report(item, reports, "call", what)
            elif _cannot_check_mode(config) == "warn":
                warnings.warn(pytest.PytestWarning(f"{item.nodeid}: {_reason(what)}"))
            else:
                _fail_report(item, reports, "teardown", _reason(what))
        with _xd().named_running(item):
            item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
            for report in reports:
                item.ihook.pytest_runtest_logreport(report=report)
            item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    if held:
        _xd().journal_flushed(config)


def _fail_report(item, reports, when: str, text: str) -> None:
    """The held report of that phase becomes the failure pytest.fail(text, pytrace=False)
    raised there gives (the same long report; duration and captured output kept)."""
    for report in reports:
        if report.when == when and not report.failed:
            call = pytest.CallInfo.from_call(lambda: pytest.fail(text, pytrace=False), when)
            made = item.ihook.pytest_runtest_makereport(item=item, call=call)
            report.outcome, report.longrepr = "failed", made.longrepr
            return


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
    if not _enabled(item) or _tracked(item) is not None:
        return (yield)
    base = _before(item)
    try:
        result = yield
    except BaseException:
        # a test that fails on its own: its outcome stands, no leak report on top
        _drop(item.stash.get(_OWN_BASE, None))
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
    tracked = _tracked(item)
    if _enabled(item) and (tracked is None or tracked.per_test
                           or _runs_its_own_protocol(item)):   # a sweep follows the body
        nl = _nl()
        nl._scrub_stack()
        nl._scrub_frames()


def _collect_garbage() -> None:
    """Drop what pytest keeps of the last failure (sys.last_*, for post-mortem debugging: its
    traceback roots the garbage; pytest's own pytest_runtest_call drops it next), collect."""
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        with contextlib.suppress(AttributeError):
            delattr(sys, name)
    gc.collect()


def _before(item):
    """The baseline of item's test: the previous test's check (a LeakBaseline, or its waiting
    snapshot in a batch), else a DeferredBaseline of its own (item.stash[_OWN_BASE]), swept
    only if a check after the test finds a leak the session has not seen; None when it cannot
    be taken (the reason is kept)."""
    if item.config.stash.get(_COLLECT, True):       # pytest's own garbage: not this test's
        item.config.stash[_COLLECT] = False
        _collect_garbage()
    base = _chained_baseline(item)
    item.config.stash[_AFTER] = None        # this test's body runs: any older check is stale
    if base is None:
        try:
            base = _nl().deferred_baseline(_rules(item.config))
            if not base.waiting:            # the helper checked at once: known now
                base = base.resolve()
                _remember(item.config, base)
            else:
                item.stash[_OWN_BASE] = base
        except MemunreachableError as exc:
            item.stash[_CANNOT] = exc       # reported at teardown; the test body runs regardless
    return base


def _drop(*bases, later: bool = False) -> None:
    """Release the waiting snapshots among bases, in one request (noleaks.drop_all; later:
    once the helper has replied). A failure only loses snapshots."""
    waiting = [b for b in bases if getattr(b, "waiting", False)]
    if waiting:
        with contextlib.suppress(MemunreachableError):
            _nl().drop_all(waiting, later=later)


def _snapshots(entries) -> list:
    """The held tests' snapshots: each one's own baseline and its check after the body."""
    return [e.stash.get(key, None) for e in entries for key in (_OWN_BASE, _HELD)]


def _cannot_settle(entries, exc, *also) -> None:
    """The held tests' verdicts cannot be known: each is exc; their snapshots (and also)
    are released."""
    for e in entries:
        e.stash[_VERDICT] = ("cannot", exc)
    _drop(*_snapshots(entries), *also)


def _after(item, base) -> None:
    """The check after item's test: in a batch that goes on, a snapshot whose sweep waits;
    else a sweep that settles the batch's tests and fails this one with its new leaks."""
    if base is None:
        return
    batch = item.config.stash.get(_BATCH, None) if _NEXT in item.stash else None
    if batch is not None and not batch.ends_at(item):
        try:        # recorded: the fresh rule of the batch's sweep counts from it, as from
            after = _nl().deferred_baseline(_rules(item.config), record=True)   # a sweep
        except MemunreachableError as exc:
            item.stash[_CANNOT] = exc
            return
        item.stash[_HELD] = after
        item.config.stash[_AFTER] = (item, after)
        batch.add(item)
        return
    entries = batch.entries if batch is not None else []
    if batch is not None:
        batch.entries = []
    try:
        info = _nl().get_unreachable_memory(limit=None, suppressions=_rules(item.config))
    except MemunreachableError as exc:
        item.stash[_CANNOT] = exc
        _cannot_settle(entries, exc, item.stash.get(_OWN_BASE, None))
        return
    item.config.stash[_AFTER] = (item, _nl().LeakBaseline.of(info.leaks))
    new, error = _settle(item.config, info, entries, item.stash.get(_OWN_BASE, None))
    if error is not None:
        item.stash[_CANNOT] = error
    elif new:
        pytest.fail(leak_text(info, new), pytrace=False)


# Returns (the leaks of check `info` that no earlier check of the session reported and no
# waiting snapshot held, error). New leaks are those no earlier check reported: a leak a check
# in between saw reachable, through a stale copy of its address overwritten since, is not this
# test's, and the clean test after it would fail. The waiting snapshots (each entry's own
# baseline, then its check after the body; then own_before, the baseline of the test `info`
# followed) are swept in order until every new leak is placed at the first that held it
# unreachable: an entry's check after its body makes it that test's (its verdict), a baseline
# nobody's (it leaked before the test's body). error: the SweepError of a snapshot that could
# not be swept; the entries from there on get it as their verdict. Every snapshot is released.
def _settle(config, info, entries, own_before):
    new = _seen(config).new_leaks(info)
    snaps = [(e, e.stash.get(key, None), key is _HELD) for e in entries
             for key in (_OWN_BASE, _HELD)] + [(None, own_before, False)]
    error = None
    for owner, snap, after_body in snaps:
        if snap is None or not new:
            continue
        if error is not None:
            if owner is not None:
                owner.stash[_VERDICT] = ("cannot", error)
            continue
        try:
            unreachable = snap.unreachable()
            _remember(config, snap.resolve())
        except MemunreachableError as exc:
            error = SweepError(
                f"{len(new)} block(s) unreachable after the test could not be told apart from "
                f"those before it: {'its check' if after_body else 'its baseline'} could not "
                f"be swept ({exc})", hint=exc.hint)
            if owner is not None:
                owner.stash[_VERDICT] = ("cannot", error)
            continue
        held = [leak for leak in new if unreachable.holds(leak)]
        new = [leak for leak in new if not unreachable.holds(leak)]
        if held and after_body:
            owner.stash[_VERDICT] = ("leaks", leak_text(info, held))
    _drop(*_snapshots(entries), own_before, later=True)
    _remember(config, _nl().LeakBaseline.of(info.leaks))
    return (new if error is None else []), error


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
