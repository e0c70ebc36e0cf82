"""memunreachable: find unreachable (leaked) native memory in a running glibc Linux process.

In-process API (libmemunreachable's, in Python form):
    get_unreachable_memory(limit=100, pid=None) -> UnreachableMemoryInfo
    get_unreachable_memory_string(log_contents=False, limit=100, pid=None) -> str
    log_unreachable_memory(log_contents=False, limit=100) -> bool
    NoLeaks() -> bool;  assert_no_leaks() raises LeaksDetected
    leak_baseline(); no_new_leaks()   (context manager: only leaks made inside it count)
    enable_signal_dump(signum=SIGUSR2, ...); disable_signal_dump()
"""
__version__ = "0.1.0"

# The public names load on first use (PEP 562): `memunreachable check` imports only what
# the check needs (issue 10, fast start), and `import memunreachable` stays cheap.
_LAZY = {
    "memunreachable._errors": ("AccessDenied", "CollectionError", "HeapWalkError",
                               "IncompleteCheck", "LeaksDetected", "MemunreachableError", "NoSuchProcess",
                               "OutOfMemory", "SweepError", "UnsupportedTarget", "ZombieProcess"),
    "memunreachable.noleaks": ("LeakBaseline", "NoLeaks", "assert_no_leaks",
                               "get_unreachable_memory", "get_unreachable_memory_string",
                               "leak_baseline", "log_unreachable_memory", "no_new_leaks"),
    "memunreachable.reporters.report": ("Leak", "UnreachableMemoryInfo"),
    "memunreachable.signal_dump": ("disable_signal_dump", "enable_signal_dump"),
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'memunreachable' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))


__all__ = [
    "get_unreachable_memory", "get_unreachable_memory_string", "log_unreachable_memory",
    "NoLeaks", "assert_no_leaks", "leak_baseline", "no_new_leaks", "LeakBaseline",
    "enable_signal_dump", "disable_signal_dump", "UnreachableMemoryInfo", "Leak",
    "MemunreachableError", "NoSuchProcess", "ZombieProcess", "AccessDenied", "UnsupportedTarget",
    "CollectionError", "HeapWalkError", "SweepError", "OutOfMemory", "IncompleteCheck",
    "LeaksDetected", "__version__",
]
