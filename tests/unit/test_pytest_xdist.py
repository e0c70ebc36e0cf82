"""pytest_xdist.py on fakes: which workers hold reports, the interactor naming a held
report's own test, and the workers' figures added up by the controller."""
from types import SimpleNamespace as NS

import pytest

from memunreachable import pytest_xdist as px


class WorkerInteractor:          # the name xdist's interactor has (xdist/remote.py)
    def __init__(self, items):
        self.session = NS(items=items)
        self.item_index = None

    def run_one_test(self):
        pass


def config(plugins=(), workerinput=None, workeroutput=None):
    c = NS(pluginmanager=NS(get_plugins=lambda: list(plugins)), stash=pytest.Stash())
    if workerinput is not None:
        c.workerinput = workerinput
    if workeroutput is not None:
        c.workeroutput = workeroutput
    return c


def test_only_a_worker_without_a_known_interactor_cannot_hold_reports():
    one = WorkerInteractor([])
    assert px.interactor(config([one])) is None and px.can_hold_reports(config([one]))
    assert px.interactor(config([one], workerinput={})) is one
    assert px.can_hold_reports(config([one], workerinput={}))
    other = type("WorkerInteractor", (), {})()      # another xdist: no run_one_test
    assert px.interactor(config([other], workerinput={})) is False
    assert not px.can_hold_reports(config([other], workerinput={}))


def test_a_held_report_is_sent_as_its_own_test_s_then_the_running_one_again():
    items = [NS(name=k) for k in range(4)]
    it = WorkerInteractor(items)
    cfg = config([it], workerinput={})
    for item in items:
        item.config = cfg
    it.item_index = 3                               # the test running now
    seen = []
    for item in (items[1], items[0], items[2]):
        with px.named_running(item):
            seen.append(it.item_index)
    assert seen == [1, 0, 2] and it.item_index == 3
    with px.named_running(NS(config=cfg)):          # not the session's: left to xdist's check
        assert it.item_index == 3
    items.append(NS(name=4, config=cfg))            # the items changed: found again
    with px.named_running(items[4]):
        assert it.item_index == 4
    assert it.item_index == 3
    it.item_index = None                            # before the first test: left alone
    with px.named_running(items[2]):
        assert it.item_index is None


def test_the_controller_adds_up_what_each_worker_sent():
    outs = []
    for tests, sweeps, seconds, orphans in ((10, 3, 0.5, []), (7, 2, 0.25, [("where", "text")])):
        worker = config(workeroutput={})
        px.worker_output(worker, tests, sweeps, seconds, orphans)
        outs.append(worker.workeroutput)
    controller = config()
    assert px.workers(controller) is None
    px.node_finished(controller, NS(workeroutput={}))           # a worker that checked nothing
    assert px.workers(controller) is None
    for out in outs:
        px.node_finished(controller, NS(workeroutput=out))
    w = px.workers(controller)
    assert (w.workers, w.tests, w.sweeps, w.seconds) == (2, 17, 5, 0.75)
    assert w.orphans == [("where", "text")]
    px.worker_output(config(), 1, 1, 0.1, [])                   # not a worker: nowhere to put it
