"""CPython's own memory seen from outside: runtime, interpreters, threads, pymalloc.

walker.walk_cpython(mem, maps, threads, pid) -> CPythonMap is the entry point; layout.py holds
the per-version offsets, locate.py finds and validates the runtime, obmalloc.py walks pymalloc.
"""
