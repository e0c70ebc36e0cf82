"""Unit tests of reporters/text.py and reporters/json.py on hand-built UnreachableMemoryInfo."""
import dataclasses
import io
import json
import re

import pytest

from memunreachable import __version__
from memunreachable.reporters.report import SCHEMA_VERSION, Leak, UnreachableMemoryInfo
from memunreachable.reporters import (format_text, human_size, load_json, render_json,
                                      render_text, summary_line, write_json)
from memunreachable.reporters.text import use_color

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def make_info(**over):
    leaks = [
        Leak(0x55d0c0a012a0, 1024, 3, 240, b"hello world\x00" + bytes(range(0x7c, 0x90))),
        Leak(0x55d0c0a01000, 24, 1, 48, b"abc" + bytes(21)),
        Leak(0x7f0000001000, 1, 0, 0, b"\x7f"),
    ]
    fields = dict(pid=4242, comm="server", allocator_version="2.36", threads=3, pause_ms=2.5,
                  duration_ms=120.04, snapshot_ms=40.0, num_allocations=120,
                  allocation_bytes=65536, num_leaks=6, leak_bytes=1337, leaks=leaks,
                  truncated=0, warnings=["heap was mid-update once"])
    fields.update(over)
    return UnreachableMemoryInfo(**fields)


HEADER = [
    f"memunreachable {__version__}: pid 4242 (server), 3 threads, glibc 2.36",
    "target paused 2.5 ms, snapshot (clone) lived 40.0 ms, whole check 120.0 ms",
    "1337 bytes in 6 allocations unreachable out of 65536 bytes in 120 allocations "
    "(1.3 KiB of 64.0 KiB)",
    "warning: heap was mid-update once",
    "",
    "  1337 bytes in 6 unreachable allocations",
    "  ABI: 'x86_64'",
    "",
]

ENTRIES_PLAIN = [
    "  1024 bytes unreachable at 55d0c0a012a0",
    "   referencing 240 unreachable bytes in 3 allocations",
    "",
    "  24 bytes unreachable at 55d0c0a01000",
    "   referencing 48 unreachable bytes in 1 allocation",
    "",
    "  1 bytes unreachable at 7f0000001000",
    "",
]

ENTRIES_CONTENTS = [
    "  1024 bytes unreachable at 55d0c0a012a0",
    "   referencing 240 unreachable bytes in 3 allocations",
    "   first 32 bytes of contents:",
    "   55d0c0a012a0: 68 65 6c 6c 6f 20 77 6f 72 6c 64 00 7c 7d 7e 7f hello world.|}~.",
    "   55d0c0a012b0: 80 81 82 83 84 85 86 87 88 89 8a 8b 8c 8d 8e 8f ................",
    "",
    "  24 bytes unreachable at 55d0c0a01000",
    "   referencing 48 unreachable bytes in 1 allocation",
    "   contents:",
    "   55d0c0a01000: 61 62 63 00 00 00 00 00 00 00 00 00 00 00 00 00 abc.............",
    "   55d0c0a01010: 00 00 00 00 00 00 00 00                         ........",
    "",
    "  1 bytes unreachable at 7f0000001000",
    "   contents:",
    "   7f0000001000: 7f                                              .",
    "",
]

SUMMARY = "SUMMARY: memunreachable: 1337 bytes leaked in 6 allocations, 3 report entries"


def render(info, **kw):
    buf = io.StringIO()
    render_text(info, buf, **kw)
    return buf.getvalue()


def test_text_exact_lines_without_contents():
    assert render(make_info()).split("\n") == HEADER + ENTRIES_PLAIN + [SUMMARY, ""]


def test_text_exact_lines_with_contents():
    assert render(make_info(), contents=True).split("\n") == \
        HEADER + ENTRIES_CONTENTS + [SUMMARY, ""]


def test_text_hexdump_ascii_column_is_fixed():
    lines = [l for l in render(make_info(), contents=True).splitlines() if l.startswith("   55d0")]
    # "   " + 12 hex digits + ": " = 17 columns, then 16 * "xx " = 48: ASCII starts at column 65,
    # also on the short last line (3 spaces per missing byte)
    assert [l[65:] for l in lines] == ["hello world.|}~.", "................",
                                       "abc.............", "........"]


def test_text_no_leaks():
    info = UnreachableMemoryInfo(pid=7, allocator_version="2.36", threads=1, pause_ms=0.25,
                                 duration_ms=1500.0, snapshot_ms=3.0, num_allocations=1,
                                 allocation_bytes=24)
    assert render(info).split("\n") == [
        f"memunreachable {__version__}: pid 7, 1 thread, glibc 2.36",
        "target paused 0.2 ms, snapshot (clone) lived 3.0 ms, whole check 1.50 s",
        "0 bytes in 0 allocations unreachable out of 24 bytes in 1 allocation",
        "",
        "  0 bytes in 0 unreachable allocations",
        "  ABI: 'x86_64'",
        "",
        "SUMMARY: memunreachable: 0 bytes leaked in 0 allocations, 0 report entries",
        "",
    ]


def test_text_singular_forms_and_truncation_note():
    info = UnreachableMemoryInfo(pid=9, threads=2, num_allocations=5, allocation_bytes=100,
                                 num_leaks=1, leak_bytes=1,
                                 leaks=[Leak(0x1000, 1, 1, 1, b"")], truncated=1,
                                 snapshot_mode="direct", retries=1)
    assert render(info, contents=True).split("\n") == [
        f"memunreachable {__version__}: pid 9, 2 threads, glibc",
        "target paused 0.0 ms, no snapshot (direct: read the stopped target), whole check "
        "0.0 ms, snapshot retaken 1 time",
        "1 byte in 1 allocation unreachable out of 100 bytes in 5 allocations",
        "",
        "  1 bytes in 1 unreachable allocation",
        "  ABI: 'x86_64'",
        "",
        "  1 bytes unreachable at 1000",
        "   referencing 1 unreachable bytes in 1 allocation",
        "",
        "  ... 1 more entry not shown; use --limit 0 to show all",
        "",
        "SUMMARY: memunreachable: 1 byte leaked in 1 allocation, 2 report entries",
        "",
    ]


def test_text_truncation_note_plural():
    info = make_info(leaks=make_info().leaks[:1], truncated=2)
    lines = render(info).split("\n")
    assert lines[-5:] == [
        "",
        "  ... 2 more entries not shown; use --limit 0 to show all",
        "",
        SUMMARY,
        "",
    ]


def test_summary_line_singular_entry():
    info = UnreachableMemoryInfo(pid=1, num_leaks=2, leak_bytes=48, leaks=[Leak(0x10, 24, 1, 24)])
    assert summary_line(info) == \
        "SUMMARY: memunreachable: 48 bytes leaked in 2 allocations, 1 report entry"


def test_backtrace_frames_are_printed_after_contents():
    info = make_info(leaks=[Leak(0x2000, 8, 0, 0, b"ABCDEFGH",
                                 ["#00 pc 0000000000001234  /bin/x (main+20)"])],
                     num_leaks=1, leak_bytes=8)
    lines = render(info, contents=True).split("\n")
    i = lines.index("  8 bytes unreachable at 2000")
    assert lines[i:i + 5] == [
        "  8 bytes unreachable at 2000",
        "   contents:",
        "   2000: 41 42 43 44 45 46 47 48                         ABCDEFGH",
        "   #00 pc 0000000000001234  /bin/x (main+20)",
        "",
    ]


def test_text_contents_capped_at_32_bytes():
    info = make_info(leaks=[Leak(0x3000, 64, 0, 0, bytes(range(0x41, 0x41 + 40)))],
                     num_leaks=1, leak_bytes=64)
    lines = render(info, contents=True).split("\n")
    i = lines.index("  64 bytes unreachable at 3000")
    assert lines[i + 1:i + 5] == [
        "   first 32 bytes of contents:",
        "   3000: 41 42 43 44 45 46 47 48 49 4a 4b 4c 4d 4e 4f 50 ABCDEFGHIJKLMNOP",
        "   3010: 51 52 53 54 55 56 57 58 59 5a 5b 5c 5d 5e 5f 60 QRSTUVWXYZ[\\]^_`",
        "",
    ]


def test_human_size():
    assert [human_size(n) for n in (0, 1023, 1024, 1264, 5 << 20, 3 << 30)] == \
        ["0 B", "1023 B", "1.0 KiB", "1.2 KiB", "5.0 MiB", "3.0 GiB"]


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("env, tty, expected", [
    ({}, False, False),
    ({}, True, True),
    ({"NO_COLOR": "1"}, True, False),
    ({"CLICOLOR_FORCE": "1"}, False, True),
    ({"CLICOLOR_FORCE": "0"}, False, False),
    ({"CLICOLOR": "0"}, True, False),
    ({"NO_COLOR": "1", "CLICOLOR_FORCE": "1"}, True, False),
])
def test_use_color(env, tty, expected):
    stream = FakeTTY() if tty else io.StringIO()
    assert use_color(stream, env) is expected


def test_color_output_has_identical_text(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("CLICOLOR", raising=False)
    monkeypatch.delenv("CLICOLOR_FORCE", raising=False)
    tty = FakeTTY()
    render_text(make_info(), tty, contents=True)
    colored = tty.getvalue()
    assert "\x1b[" in colored
    assert ANSI.sub("", colored) == format_text(make_info(), contents=True)
    assert render(make_info(), contents=True) == format_text(make_info(), contents=True)


def test_no_color_env_keeps_tty_plain(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    tty = FakeTTY()
    render_text(make_info(), tty)
    assert tty.getvalue() == format_text(make_info())


# ---- JSON ----------------------------------------------------------------------------------

# issue 23's per-leak fields of a hand-built Leak: no requested size, indirect leaks unknown
UNKNOWN_INDIRECT = {"requested_size": None, "num_indirect": None, "indirect_size": None,
                    "indirect": []}
EXPECTED_JSON = {
    "schema_version": 1,
    "tool_version": __version__,
    "pid": 4242,
    "comm": "server",
    "complete": True,
    "incomplete": [],
    "allocator": {"name": "glibc", "version": "2.36"},
    "threads": 3,
    "pause_ms": 2.5,
    "duration_ms": 120.04,
    "snapshot_mode": "clone",
    "snapshot_ms": 40.0,
    "snapshots": 0,
    "retries": 0,
    "retake_counts": {},
    "num_allocations": 120,
    "allocation_bytes": 65536,
    "bytes_scanned": 0,
    "num_leaks": 6,
    "leak_bytes": 1337,
    "leaks": [
        {"address": 0x55d0c0a012a0, "size": 1024, "referenced_count": 3, "referenced_size": 240,
         "total_size": 1264,
         "contents": "68656c6c6f20776f726c64007c7d7e7f808182838485868788898a8b8c8d8e8f",
         "backtrace": [], "stack_status": "untracked", **UNKNOWN_INDIRECT},
        {"address": 0x55d0c0a01000, "size": 24, "referenced_count": 1, "referenced_size": 48,
         "total_size": 72, "contents": "616263" + "00" * 21, "backtrace": [],
         "stack_status": "untracked", **UNKNOWN_INDIRECT},
        {"address": 0x7f0000001000, "size": 1, "referenced_count": 0, "referenced_size": 0,
         "total_size": 1, "contents": "7f", "backtrace": [], "stack_status": "untracked",
         **UNKNOWN_INDIRECT},
    ],
    "groups": [
        {"leaks": [i], "num_entries": 1, "num_allocations": n, "total_size": t,
         "similar_count": 0, "similar_size": 0, "similar_referenced_count": 0,
         "similar_referenced_size": 0}
        for i, n, t in ((0, 4, 1264), (1, 2, 72), (2, 1, 1))],
    "truncated": 0,
    "num_uncertain": 0,
    "uncertain_bytes": 0,
    "uncertain": [],
    "warnings": ["heap was mid-update once"],
    "stats": {},
    "tracking": None,
    "num_suppressed": 0,
    "suppressed_bytes": 0,
    "suppressions_used": [],
}


def test_json_exact_object():
    assert SCHEMA_VERSION == 1
    assert render_json(make_info()) == EXPECTED_JSON


def test_json_issue_fields_present():
    obj = render_json(make_info())
    for key in ("schema_version", "pid", "allocator", "threads", "pause_ms", "duration_ms",
                "num_allocations", "allocation_bytes", "num_leaks", "leak_bytes", "leaks",
                "truncated"):
        assert key in obj
    for key in ("address", "size", "referenced_count", "referenced_size", "contents",
                "backtrace"):
        assert key in obj["leaks"][0]


def test_json_round_trip_through_text():
    buf = io.StringIO()
    write_json(make_info(), buf)
    text = buf.getvalue()
    assert text.endswith("}\n")
    parsed = json.loads(text)
    assert parsed == EXPECTED_JSON
    info = load_json(parsed)
    assert [g.leaks for g in info.groups] == [[l] for l in make_info().leaks]
    assert dataclasses.replace(info, groups=[]) == make_info()
    assert render_json(info) == EXPECTED_JSON


def test_json_contents_capped_at_32_bytes_and_stats_sanitised():
    info = make_info(leaks=[Leak(0x10, 64, 0, 0, bytes(range(40)))], num_leaks=1,
                     leak_bytes=64, stats={"walk_ms": 1.5, "arenas": (1, 2), "kind": object})
    obj = render_json(info)
    assert obj["leaks"][0]["contents"] == bytes(range(32)).hex()
    assert obj["stats"] == {"walk_ms": 1.5, "arenas": [1, 2], "kind": "<class 'object'>"}
    json.dumps(obj)


def test_load_json_rejects_other_schema():
    obj = render_json(make_info())
    obj["schema_version"] = 2
    with pytest.raises(ValueError, match="schema_version 2"):
        load_json(obj)


def test_uncertain_blocks_are_listed_apart_and_not_in_the_summary():
    from memunreachable.reporters.report import Leak, UnreachableMemoryInfo
    from memunreachable.reporters.text import format_text
    info = UnreachableMemoryInfo(pid=7, num_leaks=1, leak_bytes=200,
                                 leaks=[Leak(0x1000, 200)], num_uncertain=3, uncertain_bytes=216,
                                 uncertain=[Leak(0x2000, 72), Leak(0x3000, 72)])
    text = format_text(info)
    lines = text.splitlines()
    i = lines.index("  216 bytes in 3 uncertain allocations (not counted as leaks)")
    assert lines[i + 1:i + 4] == ["   72 bytes uncertain at 2000", "   72 bytes uncertain at 3000",
                                  "   ... 1 more not shown"]
    assert lines[-1] == "SUMMARY: memunreachable: 200 bytes leaked in 1 allocation, 1 report entry"


def test_json_carries_uncertain_blocks_and_round_trips():
    from memunreachable.reporters.report import Leak, UnreachableMemoryInfo
    info = UnreachableMemoryInfo(pid=7, num_uncertain=2, uncertain_bytes=144,
                                 uncertain=[Leak(0x2000, 72, contents=b"ab"), Leak(0x3000, 72)],
                                 retries=1, retake_counts={"capture": 1})
    obj = render_json(info)
    assert obj["num_uncertain"] == 2 and obj["uncertain_bytes"] == 144
    assert obj["uncertain"] == [{"address": 0x2000, "size": 72, "contents": "6162"},
                                {"address": 0x3000, "size": 72, "contents": ""}]
    assert obj["num_leaks"] == 0 and obj["retake_counts"] == {"capture": 1}
    back = load_json(obj)
    assert back.uncertain == info.uncertain and back.num_uncertain == 2
    assert back.retake_counts == {"capture": 1}
