"""Stage 4e: memory of common libraries that holds no reference, though malloc'd and only
partly written: it keeps whatever the memory held before (stale pointers of blocks freed long
ago, into which a later leak may fall). pytest imports readline, which loads ncurses' terminfo,
so every test session holds both (readline keymaps.h and readline.c; ncurses term.h):
- GNU readline's keymaps: arrays of KEYMAP_SIZE (257) entries {char type; function pointer},
  16 bytes each; rl_make_bare_keymap() writes each type's one byte, the 7 after it stay stale
  (a session holds a dozen run-time keymaps, about 1,800 stale bytes each), and malloc's slack
  after the entries; readline's line buffer (rl_line_buffer), text; readline's function
  map (funmap: a NULL-terminated array of FUNMAP *, each a malloc'd {name, function}, 16
  bytes): the slack after each entry (glibc may hand a 48-byte chunk to a 16-byte request
  when the remainder is too small to split) and the array's unused slots after the NULL;
  readline's history (history.c `the_history`: history_length entries, a NULL, then slots
  realloc never wrote).
- ncurses' terminfo string tables (cur_term->type.str_table and .ext_str_table): text, whose
  unwritten slack is stale.
- ld.so's `cache_new` (elf/dl-cache.c): a dlopen by name maps /etc/ld.so.cache and unmaps it
  after, clearing `cache` but not `cache_new`, which then dangles where a later big block may
  be mapped; its neighbour `cachesize` (the file's size) finds it without symbols.
- glibc's environment: the strings of `environ` that setenv() copied into blocks of their own
  ("NAME=value", then malloc's slack; os.environ's assignments, pytest's PYTEST_CURRENT_TEST:
  the slack after "...test_marked_leak (call)" kept a leaked 34 MB block in an xdist worker).
  A non-PIE executable holds `environ` itself (a copy relocation, Debian's python3): its
  symbol is then the one read.
Measured (MEMUNREACHABLE_EXPLAIN): a 4 KiB buffer a C extension leaked stayed reachable in 1 of
20 plugin runs, through a chain from vi_insertion_keymap across 5 run-time keymaps whose last
hop was an entry's type word (its stale bytes, with the type's zero as low byte, pointed inside
the buffer, which had reused the memory of a block freed long before); an earlier session's
34 MB leak was hidden by the terminfo table's last word; in 4 of 12 runs of test_plugin's
xdist suite with both CPUs busy, a worker's 34 MB leak mapped right below libreadline was kept
by a FUNMAP entry's slack word 0x00007fxxfa000053 (a stale pointer into readline, its low bytes
overwritten).

Found without debug symbols, from the libraries' exported symbols (cached by file identity):
- readline: the static keymaps (their .dynsym sizes give the entry count) and the current-keymap
  pointers start a walk that follows entries of type ISKMAP to the keymaps made at run time.
  Each run-time keymap is validated (every type byte ISFUNC, ISKMAP or ISMACR, every ISKMAP
  function word 8-aligned and non-zero); one that fails is not followed and its words count as
  before. Of a valid one only the non-zero function words are references (few: a run-time
  keymap binds a handful of keys), so its dead ranges are few. The static keymaps lie in .data, whose padding the loader zero-filled. The line buffer
  is taken when its length is sane (1 byte to 16 MiB).
- funmap: taken up to its NULL (at most MAX_FUNMAP entries), each entry non-zero and 8-aligned.
- the history: `the_history` is static; the exported `history_list()` is `return the_history;`,
  one RIP-relative load (`mov disp32(%rip), %rax; ret`, after an `endbr64` or not), which gives
  its address. Taken when history_length is sane, its entries non-zero and 8-aligned and the
  slot after them NULL.
- terminfo: cur_term's first words are its TERMTYPE (term_names, str_table, ..., ext_str_table
  at word 5); taken only when term_names equals str_table (the names open the table) and the
  table starts with a printable name.
The caller clips each "tail" to the allocation it starts (block_tails in sweep/steps.py).

    of_process(mem, maps, pid)      LibState of process pid: dead ranges, dead allocation tails
    runtime_keymaps(mem, ...)       readline's run-time keymaps and their dead ranges (pure)
    line_buffer(mem, ptr, len_at)   readline's line buffer (pure)
    funmap_tails(mem, funmap_at)    readline's function map: its entries' and array's tails (pure)
    history_tail(mem, list_fn, length_at)  readline's history array: the bytes in use (pure)
    terminfo_tables(mem, cur_term)  the terminfo string tables (pure)
    ld_cache_words(mem, data, size) ld.so's ld.so.cache pointers (pure)
    environ_strings(mem, environ_at) the environment's strings (pure)
    warm(maps, pid)                 parse the libraries' files now
"""
from __future__ import annotations

import os
import struct
from typing import Dict, List, Optional, Sequence, Tuple

from memunreachable.collect import procfs
from memunreachable.stacks import elf as E
from memunreachable._errors import MemoryUnreadable
from memunreachable._types import Fields, Mapping, set_fields

ENTRY = 16                          # sizeof(KEYMAP_ENTRY) on LP64
ISFUNC, ISKMAP, ISMACR = 0, 1, 2
MAX_KEYMAPS = 512
STATIC_KEYMAPS = ("emacs_standard_keymap", "emacs_meta_keymap", "emacs_ctlx_keymap",
                  "vi_movement_keymap", "vi_insertion_keymap")
KEYMAP_POINTERS = ("_rl_keymap", "rl_binding_keymap", "_rl_dispatching_keymap",
                   "rl_executing_keymap")
LINE_BUFFER = ("rl_line_buffer", "rl_line_buffer_len")
HISTORY = ("history_list", "history_length")
ENDBR64 = bytes.fromhex("f30f1efa")
LOAD_RAX_RIP = bytes.fromhex("488b05")     # mov disp32(%rip), %rax
RET = 0xC3
MAX_HISTORY = 1 << 20
FUNMAP = "funmap"
FUNMAP_ENTRY = 16                   # sizeof(FUNMAP): name, function
MAX_FUNMAP = 4096
MAX_LINE = 16 << 20
EXT_STR_TABLE = 40                  # TERMTYPE: term_names, str_table, Booleans, Numbers,
                                    # Strings, ext_str_table
# library file name prefix -> the symbols read from it
LIBRARIES = {"libreadline.so": STATIC_KEYMAPS + KEYMAP_POINTERS + LINE_BUFFER + (FUNMAP,)
             + HISTORY,
             "libtinfo.so": ("cur_term",), "libncursesw.so": ("cur_term",),
             "libncurses.so": ("cur_term",), "libc.so": ("__environ",)}
MAX_ENVIRON = 1 << 16
# the executable's: a non-PIE executable that uses `environ` holds it (a copy relocation:
# Debian's python3), and libc's own copy is then never written
EXECUTABLE = ("__environ",)

LD_SO = "ld-linux"
PAGE = 4096

_SYMBOLS: Dict[tuple, Optional[Tuple[Tuple[int, int], Dict[str, Tuple[int, int]]]]] = {}


def _library(path: str) -> Optional[str]:
    name = os.path.basename(path)
    return next((k for k in LIBRARIES if name.startswith(k)), None)


# Returns (first_load, {symbol: (value, size)}) of the library file f, cached by file identity
# (a long-lived checker sees the same library at every check); None when unusable.
def _symbols(f, names: Sequence[str]) -> Optional[Tuple[Tuple[int, int], Dict[str, Tuple[int, int]]]]:
    def read(elf):
        first = elf.first_load()
        if first is None or elf.machine_name != "EM_X86_64":
            return None
        return first, elf.dynsym_symbols(names)
    return E.cached_by_file(_SYMBOLS, f, read, most=64)


def _libraries(maps: Sequence[Mapping], pid: Optional[int]):
    """{symbol: (address, size)} of every usable library of LIBRARIES mapped in process pid
    (the symbols' run-time addresses), then the executable's own EXECUTABLE symbols."""
    groups: Dict[str, List[Mapping]] = {}
    exe = procfs.read_exe(pid)
    for m in maps:
        if m.path.startswith("/") and (_library(m.path) or m.path == exe):
            groups.setdefault(m.path, []).append(m)
    for path, mappings in sorted(groups.items(), key=lambda g: g[0] == exe):
        try:
            with procfs.open_mapped_file(mappings, pid, path) as f:
                facts = _symbols(f, LIBRARIES[_library(path)] if path != exe else EXECUTABLE)
        except OSError:
            continue
        if facts is None:
            continue
        (page_off, page_vaddr), syms = facts
        first = next((m for m in sorted(mappings, key=lambda m: m.begin)
                      if m.offset == page_off), None)
        if first is not None:
            bias = first.begin - page_vaddr
            yield {n: (bias + v, size) for n, (v, size) in syms.items()}


def warm(maps: Sequence[Mapping], pid: Optional[int]) -> None:
    """Parse the libraries' files of pid now (in a long-lived checker: every sweeper finds
    them cached)."""
    for _ in _libraries(maps, pid):
        pass


class LibState(Fields):
    """What of the libraries' memory holds no reference."""
    __slots__ = ("ranges", "tails")

    def __init__(self, ranges: List[Tuple[int, int]], tails: List[Tuple[int, int]]):
        # ranges: 8-aligned (begin, end) ranges (readline keymaps' entries but their non-zero
        # function words); tails: (allocation address, bytes in use): the allocation's bytes
        # past them hold no reference (malloc's slack after a keymap; text buffers: in use 0)
        set_fields(self, ranges, tails)


def of_process(mem, maps: Sequence[Mapping], pid: Optional[int]) -> LibState:
    """The LibState of the libraries mapped in process pid; empty when there is none or their
    files cannot be read (the memory then counts as before)."""
    ranges: List[Tuple[int, int]] = []
    tails: List[Tuple[int, int]] = []
    environ_at = 0
    for syms in _libraries(maps, pid):
        statics = [(syms[n][0], syms[n][1] // ENTRY) for n in STATIC_KEYMAPS if n in syms]
        if statics:
            keymaps, dead = runtime_keymaps(mem, statics, [syms[n][0] for n in KEYMAP_POINTERS
                                                           if n in syms])
            ranges += dead
            tails += [(k, statics[0][1] * ENTRY) for k in keymaps]
        if all(n in syms for n in LINE_BUFFER):
            buf = line_buffer(mem, syms["rl_line_buffer"][0], syms["rl_line_buffer_len"][0])
            if buf is not None:
                tails.append((buf, 0))
        if FUNMAP in syms:
            tails += funmap_tails(mem, syms[FUNMAP][0])
        if all(n in syms for n in HISTORY):
            tails += history_tail(mem, syms["history_list"][0], syms["history_length"][0])
        if "cur_term" in syms:
            try:
                term = struct.unpack("<Q", mem.read(syms["cur_term"][0], 8))[0]
            except (MemoryUnreadable, struct.error):
                term = 0
            if term:
                tails += [(t, 0) for t in terminfo_tables(mem, term)]
        if "__environ" in syms:
            environ_at = syms["__environ"][0]       # the executable's last
    if environ_at:
        tails += [(e, 0) for e in environ_strings(mem, environ_at)]
    cache = ld_cache_size(pid)
    if cache:
        data = [(m.begin, m.end) for m in ld_data(maps)]
        ranges += [(w, w + 8) for w in ld_cache_words(mem, data, cache)]
    return LibState(sorted(set(ranges)), sorted(set(tails)))


def ld_cache_size(pid: Optional[int]) -> int:
    """The size of the target's /etc/ld.so.cache (through its root), 0 when it has none."""
    for path in ([f"/proc/{pid}/root/etc/ld.so.cache"] if pid else []) + ["/etc/ld.so.cache"]:
        try:
            return os.stat(path).st_size
        except OSError:
            continue
    return 0


def ld_data(maps: Sequence[Mapping]) -> List[Mapping]:
    """ld.so's writable mappings: its file-backed data and the anonymous one right after (the
    rest of its .bss)."""
    return procfs.object_data(maps, lambda m: os.path.basename(m.path).startswith(LD_SO))


# Returns the addresses of ld.so's dl-cache.c `cache` and `cache_new` words: the 8-aligned
# words of the data ranges [(begin, end)] that hold a page-aligned value and lie within two
# words of one equal to `size` (their neighbour `cachesize`, the size of /etc/ld.so.cache).
# ld.so maps the cache for a dlopen by name and unmaps it after, leaving cache_new dangling
# (dl_unload_cache only clears `cache`); a later big block mapped there (a 34 MB leak in the
# xdist suite of test_plugin.py, MEMUNREACHABLE_EXPLAIN) then had a "reference". Loaded or
# not, they point into the cache file's mapping, never at a heap block.
def ld_cache_words(mem, data: Sequence[Tuple[int, int]], size: int) -> List[int]:
    if size < PAGE:
        return []                       # a small number: too likely by chance
    needle = size.to_bytes(8, "little")
    out = []
    for begin, end in data:
        try:
            raw = mem.read(begin, end - begin)
        except MemoryUnreadable:
            continue
        k = raw.find(needle)
        while k >= 0:
            if k % 8 == 0:
                for near in (k - 16, k - 8, k + 8, k + 16):
                    if 0 <= near <= len(raw) - 8:
                        value = int.from_bytes(raw[near:near + 8], "little")
                        if value and value % PAGE == 0:
                            out.append(begin + near)
            k = raw.find(needle, k + 1)
    return sorted(set(out))


# Returns the address of the line buffer stored at ptr_at whose length (an int) is at len_at,
# or None when unset, unreadable or of an insane length.
def line_buffer(mem, ptr_at: int, len_at: int) -> Optional[int]:
    try:
        ptr = struct.unpack("<Q", mem.read(ptr_at, 8))[0]
        length = struct.unpack("<i", mem.read(len_at, 4))[0]
    except (MemoryUnreadable, struct.error):
        return None
    if not ptr or ptr % 8 or not 0 < length <= MAX_LINE:
        return None
    return ptr


# Returns [(the history array, the bytes of its entries and their NULL)] of readline's history,
# found through history_list()'s code at list_fn (see the docstring), or [] when that code is
# not the one load, or the array does not read as history_length entries and a NULL. The rest
# of the array is slots realloc never wrote (one kept a C extension's leaked 4 KiB buffer in a
# pytest-xdist worker: MEMUNREACHABLE_EXPLAIN, a chain from libreadline's .bss).
def history_tail(mem, list_fn: int, length_at: int) -> List[Tuple[int, int]]:
    try:
        code = mem.read(list_fn, 12)
        if code.startswith(ENDBR64):
            code, list_fn = code[4:], list_fn + 4
        if code[:3] != LOAD_RAX_RIP or code[7] != RET:
            return []
        slot = list_fn + 7 + struct.unpack_from("<i", code, 3)[0]
        array = struct.unpack("<Q", mem.read(slot, 8))[0]
        length = struct.unpack("<i", mem.read(length_at, 4))[0]
        if not array or array % 8 or not 0 <= length <= MAX_HISTORY:
            return []
        entries = struct.unpack(f"<{length + 1}Q", mem.read(array, 8 * (length + 1)))
    except (MemoryUnreadable, struct.error):
        return []
    if entries[length] or any(not e or e % 8 for e in entries[:length]):
        return []
    return [(array, 8 * (length + 1))]


# Returns the tails (allocation, bytes in use) of readline's function map at *funmap_at: each
# FUNMAP entry's 16 bytes, and the array's entries up to its NULL (realloc'd in steps of 64
# slots, the rest never written). Entries are taken up to the NULL while each is non-zero and
# 8-aligned (at most MAX_FUNMAP); [] when unset or unreadable.
def funmap_tails(mem, funmap_at: int) -> List[Tuple[int, int]]:
    entries: List[int] = []
    try:
        array = struct.unpack("<Q", mem.read(funmap_at, 8))[0]
        if not array or array % 8:
            return []
        while len(entries) < MAX_FUNMAP:
            e = struct.unpack("<Q", mem.read(array + 8 * len(entries), 8))[0]
            if not e:
                break
            if e % 8:
                return []
            entries.append(e)
        else:
            return []
    except (MemoryUnreadable, struct.error):
        return []
    return [(array, 8 * (len(entries) + 1))] + [(e, FUNMAP_ENTRY) for e in entries]


# Returns the strings of the environment array at *environ_at (up to its NULL, at most
# MAX_ENVIRON): "NAME=value" text, which setenv() copies into blocks of its own.
def environ_strings(mem, environ_at: int) -> List[int]:
    out: List[int] = []
    try:
        env = struct.unpack("<Q", mem.read(environ_at, 8))[0]
        while env and not env % 8 and len(out) < MAX_ENVIRON:
            w = struct.unpack("<Q", mem.read(env + 8 * len(out), 8))[0]
            if not w:
                break
            out.append(w)
    except (MemoryUnreadable, struct.error):
        pass
    return out


# Returns the terminfo string tables (str_table, then ext_str_table when set) of the TERMINAL
# at term, or [] when its TERMTYPE does not look like one: term_names must equal str_table and
# the table must start with a printable name.
def terminfo_tables(mem, term: int) -> List[int]:
    try:
        names, table = struct.unpack("<QQ", mem.read(term, 16))
        ext = struct.unpack("<Q", mem.read(term + EXT_STR_TABLE, 8))[0]
        head = mem.read(table, 2) if table else b""
    except (MemoryUnreadable, struct.error):
        return []
    if not table or table % 8 or names != table or len(head) < 2 \
            or not all(0x20 < c < 0x7F for c in head):
        return []
    return [table] + ([ext] if ext and ext % 8 == 0 else [])


# Returns (the run-time keymaps reachable from the static keymaps `statics` ([(address,
# entries)]) and from the keymap pointers at `pointers`, ascending; their dead ranges): each
# keymap's entries but its non-zero function words (the type words with their stale padding,
# and null function words), as 8-aligned (begin, end) ranges, ascending. Every keymap has the
# entry count of the static ones (readline's KEYMAP_SIZE); statics that disagree, or none,
# give ([], []).
def runtime_keymaps(mem, statics: Sequence[Tuple[int, int]],
                    pointers: Sequence[int] = ()) -> Tuple[List[int], List[Tuple[int, int]]]:
    sizes = {n for _a, n in statics}
    if len(sizes) != 1 or not 0 < next(iter(sizes)) <= 1024:
        return [], []
    entries = sizes.pop()
    static_at = {a for a, _n in statics}
    todo: List[int] = []
    for a, _n in statics:
        todo += (_read_keymap(mem, a, entries) or ([], []))[0]
    for p in pointers:
        try:
            value = struct.unpack("<Q", mem.read(p, 8))[0]
        except (MemoryUnreadable, struct.error):
            continue
        if value and value % 8 == 0 and value not in static_at:
            todo.append(value)
    seen, keymaps, ranges = set(static_at), [], []
    while todo and len(seen) < MAX_KEYMAPS:
        k = todo.pop()
        if k in seen:
            continue
        seen.add(k)
        got = _read_keymap(mem, k, entries)
        if got is None:
            continue                    # not a keymap (or unreadable): left as it is
        subs, live = got
        keymaps.append(k)
        b = k
        for off in live:
            if k + off > b:
                ranges.append((b, k + off))
            b = k + off + 8
        if b < k + entries * ENTRY:
            ranges.append((b, k + entries * ENTRY))
        todo += subs
    return sorted(keymaps), sorted(ranges)


# Returns (the sub-keymap addresses of the keymap at k: its ISKMAP entries' function words;
# the offsets of its non-zero function words, ascending), or None when k does not hold a valid
# keymap of `entries` entries.
def _read_keymap(mem, k: int, entries: int) -> Optional[Tuple[List[int], List[int]]]:
    try:
        raw = mem.read(k, entries * ENTRY)
    except MemoryUnreadable:
        return None
    key = (k, raw)
    if key not in _KEYMAPS:
        if len(_KEYMAPS) >= 4096:
            _KEYMAPS.clear()
        _KEYMAPS[key] = _parse_keymap(raw, entries)
    return _KEYMAPS[key]


# {(address, its bytes): _parse_keymap's answer}: readline's keymaps stay the same from check
# to check of one process (the pytest plugin's helper checks after every test: 50 keymaps of
# 257 entries parsed again each time, 0.5-1 ms)
_KEYMAPS: Dict[Tuple[int, bytes], Optional[Tuple[List[int], List[int]]]] = {}


def _parse_keymap(raw: bytes, entries: int) -> Optional[Tuple[List[int], List[int]]]:
    types = raw[0::ENTRY]
    if len(types) != entries or types.translate(None, bytes((ISFUNC, ISKMAP, ISMACR))):
        return None
    funcs = struct.unpack(f"<{2 * entries}Q", raw)[1::2]
    subs = []
    i = types.find(ISKMAP)
    while i >= 0:
        if not funcs[i] or funcs[i] % 8:
            return None
        subs.append(funcs[i])
        i = types.find(ISKMAP, i + 1)
    return subs, [ENTRY * i + 8 for i, f in enumerate(funcs) if f]
