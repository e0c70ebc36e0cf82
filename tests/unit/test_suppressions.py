"""Unit tests of suppressions.py: LSan's file syntax, TemplateMatch, which frame parts are
matched, hit counts and bytes, and the "Suppressions used:" block."""
import pytest

from memunreachable._errors import SuppressionsError
from memunreachable.reporters.report import Leak
from memunreachable.stacks.suppressions import (Suppression, apply, as_rules, format_used, load, match,
                                                parse, template_match, used)
from memunreachable.stacks.symbolize import Frame


def test_parse_lsan_syntax():
    text = ("# known leaks\n"
            "\n"
            "   \t\n"
            "leak:foo\n"
            "  \tleak:*bar*   \r\n"
            "leak:^/usr/lib/libx.so$\t\n"
            "   # indented comment\n"
            "leak:\n"
            "\r\n"
            "leak:a b # not a comment")
    rules = parse(text)
    assert [(r.template, r.line) for r in rules] == [
        ("foo", 4), ("*bar*", 5), ("^/usr/lib/libx.so$", 6), ("", 8), ("a b # not a comment", 10)]


@pytest.mark.parametrize("line, what", [
    ("race:foo", "unknown suppression type 'race'"),
    ("interceptor_via_fun:foo", "unknown suppression type 'interceptor_via_fun'"),
    ("foo", "no 'TYPE:' prefix"),
    ("Leak:foo", "unknown suppression type 'Leak'"),
])
def test_parse_error_names_the_line(line, what):
    with pytest.raises(SuppressionsError) as ei:
        parse(f"# ok\nleak:fine\n{line}\n", "my.supp")
    err = ei.value
    assert err.line == 3 and err.path == "my.supp"
    assert str(err) == f"my.supp:3: failed to parse suppressions: {what} in {line!r}"
    assert "leak:PATTERN" in err.hint


def test_load_missing_and_non_utf8(tmp_path):
    with pytest.raises(SuppressionsError) as ei:
        load(str(tmp_path / "nope.supp"))
    assert "cannot read the suppressions file" in str(ei.value) and ei.value.line == 0
    bad = tmp_path / "bad.supp"
    bad.write_bytes(b"leak:a\nleak:\xff\n")
    with pytest.raises(SuppressionsError) as ei:
        load(str(bad))
    assert ei.value.line == 2
    good = tmp_path / "good.supp"
    good.write_text("leak:x\n")
    assert [(r.template, r.line) for r in load(str(good))] == [("x", 1)]
    assert [(r.template, r.hit_count) for r in as_rules(str(good))] == [("x", 0)]
    assert as_rules(None) == []


# compiler-rt TemplateMatch semantics
@pytest.mark.parametrize("template, s, expected", [
    ("foo", "foo", True),
    ("foo", "xfoox", True),               # a substring search
    ("foo", "fo", False),
    ("^foo", "foox", True),
    ("^foo", "xfoo", False),
    ("foo$", "xfoo", True),
    ("foo$", "foox", False),
    ("^foo$", "foo", True),
    ("^foo$", "foofoo", False),
    ("*foo*", "foo", True),
    ("a*c", "abbbc", True),
    ("a*c", "cba", False),
    ("a*c$", "acx", False),
    ("a*c$", "acxc", False),              # compiler-rt takes the first 'c', then needs the end
    ("a*c$", "abc", True),
    ("a*$", "abc", True),                 # '$' right after '*' matches any end
    ("^*foo", "xxfoo", True),             # '*' drops the start anchor
    ("", "anything", True),               # `leak:` alone matches every name
    ("foo", "", False),                   # an empty name never matches
    ("foo", None, False),
    ("std::vector<*>::push_back", "std::vector<int>::push_back(int const&)", True),
])
def test_template_match(template, s, expected):
    assert template_match(template, s) is expected


MOD = "/usr/lib/libfoo.so"


def frames():
    """pc 1: inlined 'inl' (inl.h) in 'outer_fn' (outer.c); pc 2: 'caller' (main.c) in the
    executable; pc 3: no name in libbar; a Python frame."""
    return [Frame(pc=1, module=MOD, offset=0, function="inl", file="/src/inl.h", line=1,
                  inlined=True),
            Frame(pc=1, module=MOD, offset=0, function="outer_fn", file="/src/outer.c", line=2),
            Frame(pc=2, module="/usr/bin/app", offset=1, function="caller", file="/src/main.c",
                  line=3),
            Frame(pc=3, module="/usr/lib/libbar.so", offset=2),
            Frame(pc=0, module="", function="handler", file="/app/views.py", line=9,
                  python=True)]


@pytest.mark.parametrize("template, hit", [
    ("libfoo", True),            # module path
    ("^/usr/lib/libfoo.so$", True),
    ("inl", True),               # an inlined frame's function
    ("outer_fn", True),
    ("inl.h", True),             # source file
    ("main.c", True),
    ("libbar.so", True),         # a frame without names still has its module
    ("handler", True),           # Python frame: function
    ("views.py", True),          # Python frame: file
    ("nowhere", False),
    ("<unknown module>", False),
])
def test_match_frame_parts(template, hit):
    rules = parse(f"leak:{template}\n")
    assert (match(rules, frames()) is rules[0]) is hit


def test_unknown_module_is_matched_by_lsan_name():
    rules = parse("leak:<unknown module>\n")
    assert match(rules, [Frame(pc=5, module=None, offset=4)]) is rules[0]


def test_first_rule_in_file_order_wins_module_before_names():
    rules = parse("leak:caller\nleak:outer_fn\nleak:libfoo\n")
    # frame 0 (pc 1): module 'libfoo' is tried against every rule before its function names
    assert match(rules, frames()) is rules[2]
    rules = parse("leak:caller\nleak:outer_fn\n")
    # pc 1's names come before pc 2's: outer_fn wins although 'caller' is first in the file
    assert match(rules, frames()) is rules[1]


def test_apply_counts_allocations_and_bytes():
    rules = parse("leak:outer_fn\nleak:never\nleak:caller\n")
    a = Leak(0x10, 100, referenced_count=2, referenced_size=64, backtrace=frames())
    b = Leak(0x20, 50, backtrace=frames())
    c = Leak(0x30, 7, backtrace=frames()[2:3])              # only 'caller'
    d = Leak(0x40, 9)                                         # no stack: never suppressed
    e = Leak(0x50, 11, backtrace=[Frame(pc=9, module="/x", offset=8, function="y")])
    kept, gone = apply(rules, [a, b, c, d, e])
    assert kept == [d, e] and gone == [a, b, c]
    assert [(r.hit_count, r.weight) for r in rules] == [(4, 214), (0, 0), (1, 7)]
    assert used(rules) == [("outer_fn", 4, 214), ("caller", 1, 7)]


def test_used_block_is_lsans():
    assert format_used([]) == []
    assert format_used([("*LSanTestLeakingFunc*", 1, 666), ("libfoo", 1234567, 9876543210)]) == [
        "-----------------------------------------------------",
        "Suppressions used:",
        "  count      bytes template",
        "      1        666 *LSanTestLeakingFunc*",
        "1234567 9876543210 libfoo",
        "-----------------------------------------------------",
    ]


def test_as_rules_copies_parsed_rules_with_zero_counts():
    rules = [Suppression("x", 1, hit_count=5, weight=9)]
    fresh = as_rules(rules)
    assert [(r.template, r.line, r.hit_count, r.weight) for r in fresh] == [("x", 1, 0, 0)]
    assert fresh[0] is not rules[0]
