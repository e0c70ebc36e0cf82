"""copies.py: Stage 4 (glibc): the walk's local copies of the snapshot's heap memory.

    Copy(mem, base, size)   [base, base+size) of target memory read into a local buffer (a
                            private anonymous mapping when its pages may be released), or,
                            once dropped (the low-memory walk), an Uncopied read on demand
    Uncopied(size, fd)      a region's buffer that is no copy: mu_region.uncopied reads it
                            through a /proc/<pid>/mem fd of the snapshot
    Backing(base, size)     one mapping whose views are the copies of a range's runs
    Piece(lo, user, usable) the in-use chunks found in one run
The chunk loops over them run in native/mu_walk.c (walker.py, mmapped.py, freelists.py).
"""
from __future__ import annotations

import mmap
import struct
from array import array
from typing import Optional, Tuple

from memunreachable._ffi import ffi, lib
from memunreachable._types import Fields, local_buffer

WORD = struct.Struct("<Q")


class Uncopied:
    """The buffer of a region the walk did not keep (walk_heap(uncopied_from=...)): its bytes
    are read on demand through fd, a /proc/<pid>/mem fd of the snapshot (mu_region.uncopied:
    mu_mark and the free-list walks accept it; _ffi.region_array builds it)."""

    def __init__(self, size: int, fd: int, cands=None):
        self.nbytes = size
        self.uncopied_fd = fd
        self.cands = cands          # mu_cands * kept by the walk (freed with this object), or None

    def kept(self) -> Tuple[int, int]:
        """(candidate words kept, 1 MiB pieces kept) of its mu_cands."""
        if self.cands is None:
            return 0, 0
        pieces = ffi.new("uint64_t *")
        return lib.mu_cands_words(self.cands, pieces), pieces[0]

    def __len__(self) -> int:
        return self.nbytes


def is_uncopied(buf) -> bool:
    return isinstance(buf, Uncopied)


class Copy:
    """A local copy of [base, base+len) of target memory (or, once dropped, an Uncopied)."""

    def __init__(self, mem, base: int, size: int, read: bool = True, private: bool = False,
                 within: "Optional[Backing]" = None):
        self.base = base
        self.size = size
        # read whole, here or by run_jobs; private: a private anonymous mapping (zeros);
        # within: a view of that Backing's mapping
        self.within = within
        if within is not None:
            self.buf = within.view(base, size)
        else:
            self.buf = (mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                        if private else local_buffer(size, zeroed=False))
        if read:
            mem.read_into(base, self.buf)
        self.ptr = ffi.cast("uint8_t *", ffi.from_buffer(self.buf))
        self.used = False
        # (records, page index, count): the walk's records of the words the free-list walks
        # read here (mu_read_job.rec, 4 words each; rec_ix), kept through drop(), or None
        self.rec = None

    def drop(self, fd: int, cands=None) -> None:
        """Release the copy: the region is read through fd (or its cands) from now on."""
        cands = cands or getattr(self, "cands", None)
        self.cands = cands
        self.close()
        self.ptr = None
        self.buf = Uncopied(self.size, fd, cands)

    def restore(self, mem) -> None:
        """Read a dropped copy again (a rare walk step needs the whole run: drop it after)."""
        self.buf = local_buffer(self.size, zeroed=False)
        mem.read_into(self.base, self.buf)
        self.ptr = ffi.cast("uint8_t *", ffi.from_buffer(self.buf))

    @property
    def end(self) -> int:
        return self.base + self.size

    def u64(self, addr: int) -> int:
        return WORD.unpack_from(self.buf, addr - self.base)[0]

    def close(self) -> None:
        if isinstance(self.buf, mmap.mmap):
            self.ptr = None
            self.buf.close()


class Backing:
    """One private anonymous mapping for [base, base+size) of target memory whose parts are
    read apart (the runs of pages in use of an anonymous mapping): their copies are views of
    it, and a copy of several parts with the untouched pages between them (zeros, never
    written: no memory) is one view more, not a copy of them (mmapped.join_spanned)."""

    def __init__(self, base: int, size: int):
        self.base = base
        self.mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    @property
    def end(self) -> int:
        return self.base + len(self.mapping)

    def view(self, base: int, size: int) -> memoryview:
        if not (self.base <= base and base + size <= self.end):
            raise ValueError(f"{base:#x}+{size:#x} outside the backing at {self.base:#x}")
        return memoryview(self.mapping)[base - self.base:base - self.base + size]


class Piece(Fields):
    """In-use chunks of one run, heap or mapping: ascending user addresses inside [lo, hi)
    (arrays, or 'Q' memoryviews of run_jobs' scratch)."""
    __slots__ = ("lo", "user", "usable", "at")

    def __init__(self, lo: int, user: object, usable: object,
                 at: int = -1):     # run_jobs' pieces: where in the scratch they start
        self.lo = lo
        self.user = user
        self.usable = usable
        self.at = at


def alloc_q(n: int) -> array:
    """A zeroed array('Q') of n entries (repetition: no temporary bytes object)."""
    return array("Q", (0,)) * n
