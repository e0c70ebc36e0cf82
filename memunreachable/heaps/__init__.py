"""heaps: stage 4, the allocators' own records of which blocks are allocated.

glibc/ (malloc's arenas, bins and tcache), cpython/ (CPython's runtime, pymalloc and
objects), libstate (libraries' private allocations and caches that look like leaks).
"""
