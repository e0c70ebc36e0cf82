"""reporters: Stage 9 rendering of an UnreachableMemoryInfo (text and JSON).

Reporters write into an injected stream (style.md rule 8), so tests compare exact lines.
    render_text(info, stream, contents=False, color=None)   libmemunreachable.md section 8
    render_json(info) -> dict / write_json(info, stream)    issue 2, schema_version 1
    load_json(data) -> UnreachableMemoryInfo                the inverse of render_json
"""
from memunreachable.reporters.json import load_json, render_json, write_json
from memunreachable.reporters.text import format_text, human_size, render_text, summary_line

__all__ = ["render_text", "format_text", "summary_line", "human_size",
           "render_json", "write_json", "load_json"]
