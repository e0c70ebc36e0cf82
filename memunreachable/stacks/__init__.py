"""stacks: stage 8, where each leaked block was allocated.

tracking (the tracking library's table, read from the snapshot), symbolize (frames -> names,
files, lines), demangle (C++ and Rust names), suppressions (rules that hide known leaks),
elf (ELF reading, shared with the heap locators).
"""
