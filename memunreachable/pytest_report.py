"""pytest_report.py: the pytest plugin's failure text (pytest_plugin.py).

A failing test's text is a headline that counts the leaks by kind, then the report's largest
groups in brief (no lines about the check itself), each block's allocation stack cut where the
test runner's frames begin; a block that another test, or CPython's free lists, handed out
says so instead of showing a stack that is not its own.
"""
from __future__ import annotations

import functools
import sys
from typing import Optional


SHOWN_GROUPS = 10          # report groups a failure shows (its headline counts every leak)
REUSED = ("(no stack: CPython handed this object out again from a free list, without its "
          "allocator; the blocks it holds show where it was filled)")
EARLIER = ("(allocated before this test, or handed out again from one of CPython's free "
           "lists; where it was first allocated:)")


def leak_text(info, leaks, when: str = "during this test", number: Optional[int] = None,
              makers: Optional[dict] = None) -> str:
    """The failure text of these leaks of check `info`. number: the tracked test's number; a
    block recorded with another test's epoch (or none) was reused, its stack is not this one.
    makers: {test number: nodeid}, for orphans (blocks an earlier test allocated): each
    block's stack then names the test that allocated it."""
    from memunreachable.pytest_tracked import split
    from memunreachable.reporters.text import format_text
    from memunreachable.noleaks import _only
    new_info = _only(info, leaks)
    for leak in new_info.leaks:
        for b in [leak] + list(leak.indirect):
            frames = _test_frames(b.backtrace)
            allocated_by = split(b.epoch)[0]
            maker = (makers or {}).get(allocated_by)
            if maker is not None:
                b.backtrace = [f"(allocated during {maker}:)"] + frames
            elif number is None or allocated_by == number:
                b.backtrace = frames
            elif b.python_type:
                b.backtrace = [REUSED]
            else:
                b.backtrace = [EARLIER] + frames
    head = headline(new_info, when)
    more = new_info.groups[SHOWN_GROUPS:]
    if more:        # the headline counts all; the report shows the largest groups
        import dataclasses
        new_info = dataclasses.replace(new_info, groups=new_info.groups[:SHOWN_GROUPS],
                                       leaks=[l for g in new_info.groups[:SHOWN_GROUPS]
                                              for l in g.leaks])
        rest = sum(len(g.leaks) for g in more)
        head += f"\n(the {SHOWN_GROUPS} largest groups of {len(more) + SHOWN_GROUPS} are shown; " \
                f"{rest} more report entries below them are not)"
    return f"{head}\n{format_text(new_info, True, brief=True)}"


@functools.lru_cache(maxsize=1)
def _runner_files() -> tuple:
    """Directories of the code that runs tests (pytest, pluggy, this plugin): its Python frames
    are in every stack and say nothing about the leak."""
    import os
    import _pytest
    import pluggy
    return tuple(os.path.dirname(m.__file__) + os.sep for m in (_pytest, pluggy, sys.modules[
        __name__]))


def _test_frames(frames) -> list:
    """An allocation stack without the Python frames of the test runner (and the native
    frames below the first of them: the interpreter running pytest)."""
    runner = _runner_files()
    out = []
    for f in frames:
        if getattr(f, "python", False) and (f.file or "").startswith(runner):
            break
        out.append(f)
    return out


def headline(info, when: str = "during this test") -> str:
    """'N blocks leaked during this test (X bytes): ...' naming what the report's entries are:
    Python objects by type, native heap blocks, and the blocks they hold."""
    from memunreachable.reporters.text import plural as n
    objects = [leak.python_type for leak in info.leaks if leak.python_type]
    native = len(info.leaks) - len(objects)
    held = info.num_leaks - len(info.leaks)
    parts = []
    if objects:
        parts.append(n(len(objects), "Python object") + f" ({', '.join(sorted(set(objects)))})")
    if native:
        parts.append(n(native, "native heap block"))
    what = " and ".join(parts) + (f", holding {n(held, 'more block')}" if held else "")
    return f"{n(info.num_leaks, 'block')} leaked {when} ({info.leak_bytes} bytes): {what}"
