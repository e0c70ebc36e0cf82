"""reporters: Stage 9 rendering of an UnreachableMemoryInfo (text and JSON).

Reporters write into an injected stream (style.md rule 8), so tests compare exact lines.
    render_text(info, stream, contents=False, color=None)   libmemunreachable.md section 8
    render_json(info) -> dict / write_json(info, stream)    issue 2, schema_version 1
    load_json(data) -> UnreachableMemoryInfo                the inverse of render_json
"""
_WHERE = {"load_json": "json", "render_json": "json", "write_json": "json",
          "format_text": "text", "human_size": "text", "render_text": "text",
          "summary_line": "text"}


def __getattr__(name):
    """The reporters load on first use: the text report does not import the JSON one."""
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'memunreachable.reporters' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(f"memunreachable.reporters.{where}"), name)
    globals()[name] = value
    return value


__all__ = ["render_text", "format_text", "summary_line", "human_size",
           "render_json", "write_json", "load_json"]
