"""A target whose heap is not managed by glibc malloc is refused, never called clean."""
import os

import pytest

import fixtures
from memunreachable._errors import UnsupportedTarget
from memunreachable.unreachable import check

pytestmark = pytest.mark.ptrace


def test_preloaded_allocator_is_refused():
    fixtures.build("other_allocator")
    lib = os.path.join(fixtures.build_dir(), "libother_allocator_lib.so")
    env = dict(os.environ, LD_PRELOAD=lib)
    with fixtures.start("other_allocator", env=env) as fx:
        with pytest.raises(UnsupportedTarget) as ei:
            check(fx.pid)
        assert "nothing was checked" in str(ei.value)


def test_cli_exit_code_for_unsupported_allocator(capsys):
    from memunreachable.cli import main
    fixtures.build("other_allocator")
    lib = os.path.join(fixtures.build_dir(), "libother_allocator_lib.so")
    with fixtures.start("other_allocator", env=dict(os.environ, LD_PRELOAD=lib)) as fx:
        assert main(["check", str(fx.pid)]) == 3
    err = capsys.readouterr().err
    assert "nothing was checked" in err


def test_a_preloaded_allocator_s_refusal_says_to_start_without_it():
    fixtures.build("other_allocator")
    lib = os.path.join(fixtures.build_dir(), "libother_allocator_lib.so")
    with fixtures.start("other_allocator", env=dict(os.environ, LD_PRELOAD=lib)) as fx:
        with pytest.raises(UnsupportedTarget) as ei:
            check(fx.pid)
    assert ei.value.hint == ("LD_PRELOAD loads libother_allocator_lib.so: start the program "
                             "without it, and its allocations go to glibc's malloc, which this "
                             "check reads")


def test_a_glibc_newer_than_the_known_layouts_is_refused_with_a_hint(monkeypatch):
    # the host's glibc (2.36) as if it were past the newest release this version knows
    from memunreachable.heaps.glibc import layout
    monkeypatch.setattr(layout, "MAX_MINOR", 35)
    with fixtures.start("leak_one") as fx:
        with pytest.raises(UnsupportedTarget) as ei:
            check(fx.pid)
    assert str(ei.value) == ("glibc 2.36 is outside the supported range 2.27-2.35; nothing was "
                             "checked")
    assert ei.value.hint.startswith("glibc 2.36 is newer than this memunreachable knows")
