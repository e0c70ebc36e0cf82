"""Expected leak shapes of the `check <pid>` fixtures (fixtures/*.c), by block label.

Every fixture prints `block <label> <address> <usable size>` for each block it makes a claim
about: labels starting with `leak` are unreachable, labels starting with `live` are reachable.
A shape lists the head SCCs of the leak graph (libmemunreachable.md §5.3, [ours]): one entry
per head, at its lowest-address member, whose referenced_count/referenced_size cover every
other member and every leak reachable from the head. Addresses and sizes always come from the
fixture's own output; nothing here is a number the engine could merely echo.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Tuple


@dataclass(frozen=True)
class Head:
    members: Tuple[str, ...]          # the head SCC (one label, or a cycle's labels)
    refs: Tuple[str, ...] = ()        # every other leak reachable from it


@dataclass(frozen=True)
class Shape:
    heads: Tuple[Head, ...] = ()
    singletons: str = ""              # label prefix: each such block is its own head, no refs
    repeat: int = 1                   # checks in a row on the same process
    contents: Dict[str, bytes] = field(default_factory=dict)   # label -> Leak.contents


def single(*labels: str) -> Tuple[Head, ...]:
    return tuple(Head((label,)) for label in labels)


EXPECTED: Dict[str, Shape] = {
    # graph shapes (libmemunreachable.md §5.4)
    "clean": Shape(),
    "leak_one": Shape(single("leak"), contents={"leak": b"A" * 32}),
    "leak_chain": Shape((Head(("leak_a",), ("leak_b", "leak_c")),)),
    "deep_list": Shape((Head(("leak_a",), ("leak_b",)), Head(("leak_x",)))),  # 100,000 nodes
    "ptr_regs": Shape((Head(("leak_a",), ("leak_b",)),)),   # threads that check their registers
    "leak_ring": Shape((Head(("leak_a", "leak_b", "leak_c")),)),
    "leak_diamond": Shape((Head(("leak_a",), ("leak_b", "leak_c", "leak_d")),)),
    "leak_ring_tail": Shape((Head(("leak_a",), ("leak_b", "leak_c", "leak_d")),)),
    "leak_head_cycle": Shape((Head(("leak_a", "leak_b"), ("leak_c",)),)),
    "leak_shared_child": Shape((Head(("leak_a",), ("leak_c",)), Head(("leak_b",), ("leak_c",)))),
    "leak_five": Shape(singletons="leak"),
    # roots
    "live_interior": Shape(single("leak_pastend")),
    # structs linked through their last member: every link is a next chunk's header address
    "live_tail_link": Shape(),
    "live_data": Shape(single("leak_a")),
    "live_bss": Shape(single("leak_a")),
    "live_stack": Shape(single("leak_a")),
    "live_register": Shape(single("leak_a")),
    # a vector register is a root in user code, not inside a system call (stale there)
    "stale_simd": Shape(singletons="leak"),
    "live_tls": Shape(single("leak_a")),
    "live_thread_stack": Shape(single("leak_a")),
    # glibc 2.42+: an exited thread's cached stack between two live ones keeps its TCB's DTV
    "live_cached_stack": Shape(single("leak_a")),
    "live_dlopen": Shape(single("leak_a")),
    # words of 4 bytes beside a stale pointer's high half (small ints, "FIX\0") just past a 4 GiB
    # boundary inside a leaked 100 MiB block that spans it; a word 8 MiB past another boundary
    # keeps a second one
    "leak_span_4gib": Shape(single("leak_span")),
    # a big block right below a library whose link_map.l_gnu_chain_zero points into it
    "leak_below_lib": Shape(single("leak_big")),
    # a leak pointed into only by the stale padding of readline's run-time keymaps
    "leak_keymap_stale": Shape(single("leak_a")),
    # a big leak pointed into only by ld.so's dangling ld.so.cache pointer (cache_new)
    "leak_ldcache": Shape(single("leak_a")),
    # a leak pointed into only by stale malloc slack past the NUL of a dlopen'ed library's
    # l_origin and l_name strings
    "leak_origin_stale": Shape(single("leak_a")),
    "live_mmap": Shape(single("leak_a")),
    # an allocator of the program's own over mmap (96 MiB of nodes): roots, never allocations
    "own_pool": Shape(single("leak_a")),
    "live_data_readonly": Shape(single("leak_a")),
    # glibc heap shapes
    "free_chunks": Shape(singletons="leak"),
    # leaks right below chunks glibc points at (top, bins, fastbins, free chunks' links)
    "leak_below_free": Shape(singletons="leak"),
    "thread_arena": Shape((Head(("leak_t",), ("leak_m",)),)),
    "mmap_chunk": Shape((Head(("leak_big",), ("leak_child",)),)),
    "aligned": Shape(singletons="leak"),
    "realloc": Shape(singletons="leak"),
    "calloc_zero": Shape(single("leak_calloc", "leak_calloc_big", "leak_zero")
                         + (Head(("leak_zero2",), ("leak_calloc2",)),)),
    # scale and concurrency
    "leak_lots": Shape(singletons="leak"),
    "threads_many": Shape(singletons="leak"),
    "churn": Shape(single("leak_s0", "leak_s1", "leak_s2", "leak_s3", "leak_s4")
                   + (Head(("leak_a",), ("leak_b",)), Head(("leak_r1", "leak_r2"))),
                   repeat=20),
}
