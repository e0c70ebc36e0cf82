"""Issue 22: a check that could not see part of the process never answers "no leaks".

On hand-built results: unreachable.verdict() raises IncompleteCheck (reasons, hint, the partial
result) unless partial was asked for; the CLI exits 3 with the reason, or with --partial prints
the report marked incomplete and exits 23 (leaks) or 3 (none), never 0; the text and JSON
reports say so; the error pickles (it crosses the helper's pipe) with its result.
"""
import json
import pickle
import sys
import types

import pytest

import memunreachable
from memunreachable import cli
from memunreachable._errors import IncompleteCheck, UnsupportedTarget
from memunreachable.reporters.report import Leak, UnreachableMemoryInfo
from memunreachable.reporters import format_text, load_json, render_json

REASON = ("CPython runtime at 0x7f00 in /usr/bin/python3.14 is 3.14, which has no known memory "
          "layout: its Python objects and pymalloc blocks cannot be checked")


def incomplete(num_leaks=0, reasons=(REASON,)):
    leaks = [Leak(0x5000, 48, 0, 0, b"x" * 32)] if num_leaks else []
    return UnreachableMemoryInfo(pid=4242, allocator_version="2.43", threads=1,
                                 num_allocations=10, allocation_bytes=480, num_leaks=num_leaks,
                                 leak_bytes=48 * num_leaks, leaks=leaks,
                                 warnings=list(reasons) + ["another warning"],
                                 incomplete=list(reasons))


def test_verdict_raises_with_reasons_hint_and_result():
    from memunreachable.unreachable import verdict
    info = incomplete()
    with pytest.raises(IncompleteCheck) as e:
        verdict(info)
    exc = e.value
    assert isinstance(exc, UnsupportedTarget)       # "could not check": exit 3, plugin error
    assert exc.reasons == [REASON] and exc.info is info
    assert str(exc) == ("part of process 4242 could not be checked, so no verdict is given: "
                        + REASON)
    assert "--partial" in exc.hint and "partial=True" in exc.hint


def test_verdict_partial_returns_the_result_marked_incomplete():
    from memunreachable.unreachable import verdict
    info = incomplete(num_leaks=1)
    assert verdict(info, partial=True) is info and not info.complete
    whole = UnreachableMemoryInfo(pid=1)
    assert verdict(whole) is whole and whole.complete


def test_error_pickles_with_its_result():
    exc = IncompleteCheck("msg", "hint", reasons=["a", "b"], info=incomplete(num_leaks=1))
    back = pickle.loads(pickle.dumps(exc))
    assert (str(back), back.hint, back.reasons) == ("msg", "hint", ["a", "b"])
    assert back.info.incomplete == [REASON] and back.info.leaks[0].address == 0x5000


def test_text_report_says_incomplete_and_lists_what_was_not_checked():
    lines = format_text(incomplete()).splitlines()
    assert lines[3] == ("INCOMPLETE: part of the process could not be checked; the leaks below "
                        "are a lower bound, and none found is no proof of none")
    assert lines[4] == "  not checked: " + REASON
    assert lines[5] == "warning: another warning"       # the reason is not repeated as a warning
    assert lines[-1] == ("SUMMARY: memunreachable: 0 bytes leaked in 0 allocations, "
                         "0 report entries (INCOMPLETE check)")
    assert "INCOMPLETE" not in format_text(UnreachableMemoryInfo(pid=1))


def test_json_report_complete_flag_and_reasons_round_trip():
    data = render_json(incomplete(num_leaks=1))
    assert (data["complete"], data["incomplete"]) == (False, [REASON])
    assert load_json(json.loads(json.dumps(data))).incomplete == [REASON]
    whole = render_json(UnreachableMemoryInfo(pid=1))
    assert (whole["complete"], whole["incomplete"]) == (True, [])


class _Engine:
    def __init__(self, info):
        self.info, self.calls = info, []

    def check(self, pid, **kwargs):
        from memunreachable.unreachable import verdict
        self.calls.append(kwargs)
        return verdict(self.info, kwargs.get("partial", False))


@pytest.fixture
def engine(monkeypatch):
    import memunreachable.unreachable as real
    monkeypatch.setenv("NO_COLOR", "1")

    def install(info):
        fake = _Engine(info)
        module = types.ModuleType("memunreachable.unreachable")
        module.check, module.verdict = fake.check, real.verdict
        monkeypatch.setitem(sys.modules, "memunreachable.unreachable", module)
        monkeypatch.setattr(memunreachable, "unreachable", module, raising=False)
        return fake
    return install


def test_cli_without_partial_exits_3_with_the_reason(engine, capsys):
    engine(incomplete(num_leaks=1))
    assert cli.main(["check", "4242"]) == 3
    out, err = capsys.readouterr()
    assert out == ""
    assert REASON in err and "--partial" in err


def test_cli_json_error_names_the_kind(engine, capsys):
    engine(incomplete())
    assert cli.main(["check", "4242", "--json"]) == 3
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["kind"] == "IncompleteCheck" and REASON in err["message"]


@pytest.mark.parametrize("num_leaks, code", [(0, 3), (1, 23)])
def test_cli_partial_reports_and_never_exits_0(engine, capsys, num_leaks, code):
    fake = engine(incomplete(num_leaks=num_leaks))
    assert cli.main(["check", "4242", "--partial", "--json"]) == code
    data = json.loads(capsys.readouterr().out)
    assert (data["complete"], data["incomplete"], data["num_leaks"]) == (False, [REASON], num_leaks)
    assert fake.calls[0]["partial"] is True


def test_api_partial_returns_the_result(monkeypatch):
    import memunreachable.noleaks as nl
    import memunreachable.unreachable as real

    def check(pid, **kw):
        return real.verdict(incomplete(num_leaks=1))
    monkeypatch.setattr(real, "check", check)
    with pytest.raises(IncompleteCheck):
        nl.get_unreachable_memory(pid=4242)
    info = nl.get_unreachable_memory(pid=4242, partial=True)
    assert not info.complete and info.num_leaks == 1
    text = nl.get_unreachable_memory_string(pid=4242, partial=True)
    assert "INCOMPLETE: part of the process could not be checked" in text
    assert "  not checked: " + REASON in text


@pytest.mark.parametrize("no_interpreter, blind", [(False, [REASON]), (True, [])])
def test_an_unusable_runtime_is_a_blind_spot_unless_it_has_no_interpreter(
        monkeypatch, no_interpreter, blind):
    # a runtime before Py_Initialize or after Py_Finalize (a check at exit) has no Python
    # objects to see: its warning stays, but the check is complete
    from memunreachable._types import HeapImage
    from memunreachable.heaps.cpython import pipeline
    from memunreachable.heaps.cpython.walker import CPythonMap
    cp = CPythonMap(found=True, no_interpreter=no_interpreter, warnings=[REASON])
    monkeypatch.setattr(pipeline, "walk_cpython", lambda *a, **k: cp)
    image = HeapImage.__new__(HeapImage)
    out = pipeline.prepare(None, [], [], None, image)
    assert (out.blind, out.warnings, out.image) == (blind, [REASON], image)
