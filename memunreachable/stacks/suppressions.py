"""suppressions.py: Stage 11: LeakSanitizer suppressions over symbolized leaks.

Input: a suppressions file in LSan's format and the leaks with their backtraces (symbolize.py).
Output: the leaks no rule matches, and per rule its hit count (allocations) and bytes, for the
"Suppressions used:" block. Semantics copied from compiler-rt (allocation-tracking.md section 7;
llvm-project compiler-rt/lib/sanitizer_common/sanitizer_suppressions.cpp SuppressionContext::Parse,
sanitizer_common.cpp TemplateMatch, lsan/lsan_common.cpp GetSuppressionForAddr), so existing
.supp files work unchanged:

- one rule per line, `leak:TEMPLATE`; leading blanks skipped, trailing blanks and \\r trimmed;
  empty lines and lines starting with `#` ignored (no inline comments); any other type
  (`race:`, `interceptor_via_fun:`, no colon) is an error that names the line ([ours]: LSan
  dies without a line number). [ours] a line holding only `\\r` is empty (LSan rejects it).
- TEMPLATE is a substring search: `*` matches any run of characters, a leading `^` anchors at
  the start, `$` anchors at the end; an empty name never matches; `leak:` alone matches any.
- a leak is suppressed by the first rule that matches, trying each frame from the innermost:
  first the frame's module path (`<unknown module>` outside every module), then for every
  symbolized frame at that pc (inlined ones included) its function name, then its source file.
  [ours] Python frames are tried too (function, then file; they have no module).
  Leaks without a stack are never suppressed.
- a suppressed entry counts its whole folded group (the block and its indirect leaks, each
  unreachable block listed by one entry only): hit count += Leak.entry_count, bytes +=
  Leak.entry_size.
"""
from __future__ import annotations

import os
from typing import Iterable, List, Optional, Sequence, Tuple

from memunreachable._errors import SuppressionsError
from memunreachable._types import Fields

UNKNOWN_MODULE = "<unknown module>"
SUPPORTED_TYPES = ("leak",)
RULE_LINE = "-----------------------------------------------------"


class Suppression(Fields):
    __slots__ = ("template", "line", "hit_count", "weight")

    def __init__(self,
                 template: str,        # as written after "leak:"
                 line: int,            # 1-based line in its file
                 hit_count: int = 0,   # allocations suppressed (LSan's hit_count)
                 weight: int = 0):     # their bytes (LSan's weight)
        self.template = template
        self.line = line
        self.hit_count = hit_count
        self.weight = weight


# Returns the rules of a suppressions text, in file order; raises SuppressionsError naming the
# line of the first one that is not `leak:TEMPLATE`.
def parse(text: str, source: str = "<suppressions>") -> List[Suppression]:
    rules = []
    for number, raw in enumerate(text.split("\n"), 1):
        line = raw.lstrip(" \t")
        if not line.strip(" \t\r") or line.startswith("#"):
            continue
        line = line.rstrip(" \t\r")
        kind, colon, template = line.partition(":")
        if not colon or kind not in SUPPORTED_TYPES:
            what = f"unknown suppression type {kind!r}" if colon else "no 'TYPE:' prefix"
            raise SuppressionsError(
                f"{source}:{number}: failed to parse suppressions: {what} in {raw.rstrip()!r}",
                hint="each rule is 'leak:PATTERN' (the only type memunreachable and LeakSanitizer "
                     "support); '#' starts a comment line", path=source, line=number)
        rules.append(Suppression(template, number))
    return rules


# Returns the rules of a suppressions file; SuppressionsError when it cannot be read or parsed.
def load(path: str) -> List[Suppression]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise SuppressionsError(f"cannot read the suppressions file {path!r}: {exc.strerror}",
                                hint="give an existing, readable file (LSan format: "
                                     "'leak:PATTERN' lines)", path=path) from None
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise SuppressionsError(f"{path}:{line}: the suppressions file is not UTF-8 text",
                                hint="save it as UTF-8", path=path, line=line) from None
    return parse(text, path)


def as_rules(suppressions) -> List[Suppression]:
    """Rules from what the API accepts: None, a path (str / os.PathLike), or rules already
    parsed (returned as fresh copies with zero counts)."""
    if suppressions is None:
        return []
    if isinstance(suppressions, (str, os.PathLike)):
        return load(os.fspath(suppressions))
    return [Suppression(s.template, s.line) for s in suppressions]


def template_match(template: str, s: Optional[str]) -> bool:
    """compiler-rt's TemplateMatch: substring search with '*' wildcards, '^' and '$' anchors."""
    if not s:
        return False
    start = template.startswith("^")
    t = template[1:] if start else template
    pos = 0
    asterisk = False
    while t:
        if t[0] == "*":
            t = t[1:]
            start = False
            asterisk = True
            continue
        if t[0] == "$":
            return pos == len(s) or asterisk
        if pos == len(s):
            return False
        cut = [i for i in (t.find("*"), t.find("$")) if i >= 0]
        end = min(cut) if cut else len(t)
        piece, t = t[:end], t[end:]
        found = s.find(piece, pos)
        if found < 0:
            return False
        if start and found != pos:
            return False
        pos = found + len(piece)
        start = False
        asterisk = False
    return True


def _first_match(rules: Sequence[Suppression], name: Optional[str]) -> Optional[Suppression]:
    for rule in rules:
        if template_match(rule.template, name):
            return rule
    return None


# Returns the rule that suppresses a leak with these frames (innermost first, inlined frames
# before the frame they are inlined into, as symbolize.symbolize gives them), or None.
def match(rules: Sequence[Suppression], frames: Sequence) -> Optional[Suppression]:
    if not rules:
        return None
    i = 0
    while i < len(frames):
        f = frames[i]
        if getattr(f, "python", False):
            group = [f]
            i += 1
        else:                        # every frame at one pc: its inline chain
            j = i + 1
            while j < len(frames) and frames[j - 1].inlined and frames[j].pc == f.pc \
                    and not getattr(frames[j], "python", False):
                j += 1
            group, i = list(frames[i:j]), j
            hit = _first_match(rules, f.module or UNKNOWN_MODULE)
            if hit is not None:
                return hit
        for g in group:
            hit = _first_match(rules, g.function) or _first_match(rules, g.file)
            if hit is not None:
                return hit
    return None


# Returns (kept leaks, suppressed leaks); adds each suppressed leak to its rule's hit_count
# (Leak.entry_count: itself and its indirect leaks) and weight (entry_size).
def apply(rules: Sequence[Suppression], leaks: Iterable) -> Tuple[list, list]:
    kept, gone = [], []
    for leak in leaks:
        rule = match(rules, leak.backtrace) if leak.backtrace else None
        if rule is None:
            kept.append(leak)
            continue
        rule.hit_count += leak.entry_count
        rule.weight += leak.entry_size
        gone.append(leak)
    return kept, gone


def used(rules: Sequence[Suppression]) -> List[Tuple[str, int, int]]:
    """(template, hit count, bytes) of the rules that matched, in file order."""
    return [(r.template, r.hit_count, r.weight) for r in rules if r.hit_count]


def format_used(used_rules: Sequence[Tuple[str, int, int]]) -> List[str]:
    """LSan's block (PrintMatchedSuppressions), without newlines; [] when no rule matched:

    -----------------------------------------------------
    Suppressions used:
      count      bytes template
          1        666 *LSanTestLeakingFunc*
    -----------------------------------------------------
    """
    if not used_rules:
        return []
    return ([RULE_LINE, "Suppressions used:", "  count      bytes template"]
            + [f"{count:7d} {size:10d} {template}" for template, count, size in used_rules]
            + [RULE_LINE])
