"""Python side of the `leaky` test extension: undoes the address complement."""
import array  # noqa: F401 - loaded by the check (see below)
import json  # noqa: F401 - the text reporter's _json

import leaky
import memunreachable  # noqa: F401
import memunreachable.noleaks  # noqa: F401
import memunreachable.reporters.text  # noqa: F401
from memunreachable._ffi import lib as _lib  # noqa: F401 - _cffi_backend, the C core
from memunreachable.reporters.report import Address

MASK = (1 << 64) - 1

# Shared objects hold legitimate words pointing just below their own mapping (glibc's
# link_map.l_gnu_chain_zero = buckets - symbias, for one), and interpreter start-up leaves
# stale words pointing just below its lowest mappings: a conservative scan rightly counts
# both. So every shared object an in-process check loads is loaded first (the imports
# above), then the address range under the mappings is filled with an unreadable
# reservation, so the large blocks the tests leak land in address space that was never used
# and that no library loaded later borders.
#
# A 32-bit value next to 4 stale bytes forms a word too: a 1-digit Python int (digit < 2**30)
# whose malloc slack still holds the high half of an old pointer (0x00007fxx) reads as
# 0x00007fxx_dddddddd. So the reservation goes down to an address whose low 32 bits are
# LOW32_TOP: the blocks leaked below it (1.75 GiB of room) have low halves in
# [2**30, LOW32_TOP), which no such int and no small C int can form.
LOW32_TOP = 0xB0000000
_top = leaky.reserve(1 << 30)
_floor = (_top - LOW32_TOP) // (1 << 32) * (1 << 32) + LOW32_TOP
if _floor < _top:
    leaky.reserve(_top - _floor, _floor)


# The addresses go back as report.Address, an int that holds nothing: a test keeps them to
# find its leak in a report, and an exact int holding a native block's address is its handle.
def leak(n):
    """malloc(n) in C and drop the pointer; returns (address, usable size)."""
    hidden, size = leaky.leak(n)
    return Address((~hidden) & MASK), size


def no_leak(n):
    """malloc(n) in C and free it; returns (address it had, usable size)."""
    hidden, size = leaky.no_leak(n)
    return Address((~hidden) & MASK), size
