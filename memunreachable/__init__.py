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

from memunreachable._errors import (AccessDenied, CollectionError, HeapWalkError, LeaksDetected,
                                    MemunreachableError, NoSuchProcess, SweepError,
                                    UnsupportedTarget, ZombieProcess)
from memunreachable.noleaks import (LeakBaseline, NoLeaks, assert_no_leaks, get_unreachable_memory,
                                    get_unreachable_memory_string, leak_baseline,
                                    log_unreachable_memory, no_new_leaks)
from memunreachable.report import Leak, UnreachableMemoryInfo
from memunreachable.signal_dump import disable_signal_dump, enable_signal_dump

__all__ = [
    "get_unreachable_memory", "get_unreachable_memory_string", "log_unreachable_memory",
    "NoLeaks", "assert_no_leaks", "leak_baseline", "no_new_leaks", "LeakBaseline",
    "enable_signal_dump", "disable_signal_dump", "UnreachableMemoryInfo", "Leak",
    "MemunreachableError", "NoSuchProcess", "ZombieProcess", "AccessDenied", "UnsupportedTarget",
    "CollectionError", "HeapWalkError", "SweepError", "LeaksDetected", "__version__",
]
