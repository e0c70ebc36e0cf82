"""pytest_xdist.py: the pytest plugin's held reports on pytest-xdist workers.

The plugin holds a test's reports until the sweep of its stretch (pytest_plugin.py: batches,
tracked stretches), so they are logged after later tests ran. On an xdist worker three things
stand in the way, and this module deals with each:

- the worker's interactor (xdist/remote.py WorkerInteractor) sends each report with the index
  of the test it is running, and asserts that the report is that test's: while a held report
  is logged, named_running() makes the interactor name the report's own test;
- a worker that crashes (a segfault in a C extension) takes its held reports with it, and
  xdist names only the test that crashed: the others of the stretch would vanish from the
  results. So each held test's reports also go to a journal file that the controller gave the
  worker (its workerinput); a flush empties it. When a worker goes down with an error, the
  controller logs the journal's reports: each test's own outcome, and its leak check as not
  run (a teardown error, or a warning under --memunreachable-cannot-check=warn);
- a worker's terminal summary is not shown: its sweeps' figures and the leaks no single test
  is blamed for (orphans) go to the controller in its workeroutput, which adds them up
  (Workers) for its own summary and exit status.

A worker whose interactor does not look so (another xdist) holds nothing: a sweep after every
test, as every worker did before (6-14x plain `pytest -n 2` on three real suites, against 1.9x
in one process).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Callable, Optional

import pytest

JOURNAL = "memunreachable_journal"      # the workerinput key of a worker's journal file
_DIR = pytest.StashKey[str]()           # the controller's folder of journals
_INDEX = pytest.StashKey[dict]()        # worker: id(item) -> its index in session.items
_INTERACTOR = pytest.StashKey[object]()  # worker: interactor()'s answer
OUTPUT = "memunreachable"               # the workeroutput key of a worker's figures


def interactor(config):
    """The xdist worker's interactor plugin: None in a process that is no xdist worker, False
    in a worker where none is found that runs tests one by one (run_one_test). Looked up once
    (every held test's flush asks)."""
    if not hasattr(config, "workerinput"):
        return None
    found = config.stash.get(_INTERACTOR, None)
    if found is None:
        found = config.stash[_INTERACTOR] = next(
            (p for p in config.pluginmanager.get_plugins()
             if type(p).__name__ == "WorkerInteractor" and hasattr(p, "run_one_test")), False)
    return found


def can_hold_reports(config) -> bool:
    return interactor(config) is not False


@contextlib.contextmanager
def named_running(item):
    """On an xdist worker: while item's held reports are logged, the interactor names item as
    the test running (its index in the session's items), so that they go out as item's."""
    it = interactor(item.config)
    if not it or getattr(it, "item_index", None) is None or getattr(it, "session", None) is None:
        yield
        return
    index = item.config.stash.get(_INDEX, None)
    if index is None or id(item) not in index:      # (built again if the items changed)
        index = item.config.stash[_INDEX] = {id(x): k for k, x in enumerate(it.session.items)}
    if id(item) not in index:       # not the session's: xdist's own check reports it
        yield
        return
    running = it.item_index
    it.item_index = index[id(item)]
    try:
        yield
    finally:
        it.item_index = running


# ---- the worker's journal of held reports ----------------------------------------------------

def _journal_path(config) -> Optional[str]:
    return getattr(config, "workerinput", {}).get(JOURNAL)


def journal_held(item, reports) -> None:
    """Worker: add item's reports to the journal (one JSON line; a full disk loses only the
    crash recovery, never the test)."""
    path = _journal_path(item.config)
    if path is None:
        return
    hook = item.config.hook
    line = json.dumps({"nodeid": item.nodeid, "location": list(item.location),
                       "reports": [hook.pytest_report_to_serializable(config=item.config,
                                                                      report=r)
                                   for r in reports]})
    with contextlib.suppress(OSError, TypeError, ValueError):
        with open(path, "a") as f:
            f.write(line + "\n")


def journal_flushed(config) -> None:
    """Worker: every held report was logged."""
    path = _journal_path(config)
    if path is not None:
        with contextlib.suppress(OSError):
            open(path, "w").close()


# ---- the controller ---------------------------------------------------------------------------

def configure_node(config, node) -> None:
    """Controller: give the worker a journal file of its own."""
    folder = config.stash.get(_DIR, None)
    if folder is None:
        folder = config.stash[_DIR] = tempfile.mkdtemp(prefix="memunreachable-xdist-")
    name = str(getattr(getattr(node, "gateway", None), "id", None) or len(os.listdir(folder)))
    path = os.path.join(folder, name + ".jsonl")
    open(path, "w").close()         # a replaced worker of the same name starts empty
    node.workerinput[JOURNAL] = path


def node_crashed(config, node, not_run: Callable[[str], str], warn: bool) -> None:
    """Controller: a worker went down with an error: log the reports it held. not_run(nodeid)
    is the text that its leak check did not run: the test's teardown error, or (warn) a
    warning."""
    path = getattr(node, "workerinput", {}).get(JOURNAL)
    if not path:
        return
    try:
        with open(path) as f:
            lines = f.read().splitlines()
        open(path, "w").close()
    except OSError:
        return
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue                # the last line, cut by the crash
        reports = [config.hook.pytest_report_from_serializable(config=config, data=d)
                   for d in entry["reports"]]
        text = not_run(entry["nodeid"])
        if warn:
            _warn(config, text)
        else:
            _fail_teardown(reports, text)
        location = tuple(entry["location"])
        config.hook.pytest_runtest_logstart(nodeid=entry["nodeid"], location=location)
        for r in reports:
            r.node = node           # as xdist's controller gives a worker's reports
            config.hook.pytest_runtest_logreport(report=r)
        config.hook.pytest_runtest_logfinish(nodeid=entry["nodeid"], location=location)


def _warn(config, text: str) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"memunreachable: {text}", yellow=True)


def _fail_teardown(reports, text: str) -> None:
    for r in reports:
        if r.when == "teardown" and not r.failed:
            r.outcome, r.longrepr = "failed", text
            return


# ---- what the workers' tracked sessions found -------------------------------------------------

class Workers:
    """Controller: the workers' tracked sessions added up (their workeroutput)."""

    def __init__(self) -> None:
        self.workers = self.tests = self.sweeps = 0
        self.seconds = 0.0
        self.orphans: list = []         # (where, report), as _Tracked.orphans


_WORKERS = pytest.StashKey[Workers]()


def worker_output(config, tests: int, sweeps: int, seconds: float, orphans: list) -> None:
    """Worker: its tracked session's figures and orphans, for the controller."""
    out = getattr(config, "workeroutput", None)
    if out is not None:
        out[OUTPUT] = {"tests": tests, "sweeps": sweeps, "seconds": seconds,
                       "orphans": [list(o) for o in orphans]}


def node_finished(config, node) -> None:
    """Controller: add what a worker that went down sent in its workeroutput."""
    got = (getattr(node, "workeroutput", None) or {}).get(OUTPUT)
    if not got:
        return
    w = config.stash.get(_WORKERS, None)
    if w is None:
        w = config.stash[_WORKERS] = Workers()
    w.workers += 1
    w.tests += got["tests"]
    w.sweeps += got["sweeps"]
    w.seconds += got["seconds"]
    w.orphans += [tuple(o) for o in got["orphans"]]


def workers(config) -> Optional[Workers]:
    return config.stash.get(_WORKERS, None)


def cleanup(config) -> None:
    folder = config.stash.get(_DIR, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
