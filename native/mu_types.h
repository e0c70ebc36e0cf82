/* mu_types.h: plain structs shared by the stages of the C core (cdef-clean). */

/* A copy of target memory held by the sweeper: bytes [base, base+len) live at data.
 * uncopied = 1 (data NULL): no copy is held; the bytes are read on demand through fd, a
 * /proc/<pid>/mem fd of the snapshot (and the words of its cands' complete pieces are kept:
 * mu_mark scans a block from them without a read; the list walks read the words the walk
 * recorded, rec). Only mu_mark and mu_walk's list walks (mu_walk_chain, mu_walk_tcache_scan,
 * mu_walk_bin) accept such regions; every other function needs data. */
typedef struct mu_cands mu_cands;  /* reference candidates of an uncopied region (mu_walk.h) */

typedef struct {
    uint64_t base;
    uint64_t len;
    uint8_t *data;
    int32_t fd;
    uint32_t uncopied;
    const mu_cands *cands;  /* uncopied: its candidates kept by the walk, or NULL */
    /* words the walk read there for the list walks (mu_read_job.rec), nrec records of 4
     * words ascending by chunk, or NULL: the list walks read them first (not through fd; and
     * a chain's nodes are found in them, not searched for in the chunks) */
    const uint64_t *rec;
    uint64_t nrec;
    const uint32_t *rec_ix;     /* rec's page index (mu_read_job.rec_ix) */
} mu_region;

/* Words that are not references (GC links, dead free-list slots): mark and fold ignore every
 * 8-byte word whose start address is
 *   - inside one of the nranges pairs ranges[2k] .. ranges[2k+1] (sorted, disjoint, 8-aligned;
 *     they may lie in roots or inside allocations), or
 *   - inside allocation i at [begin[i] + 8*(head_word[i]-1), +16) when head_word[i] != 0
 *     (head_word: n bytes or NULL; a PyGC_Head's two link words).
 * A word pointing into allocation i below the end of its PyGC_Head (head_word[i] != 0) is no
 * reference either: references to a GC object point at the object, after its head.
 * Pass NULL for none. */
/* Objects whose words are not scanned: types holds ntypes pairs (type address, code), sorted
 * by address; code = object offset in its block (low 8 bits) | kind << 8. An allocation whose
 * word at offset off + 8 (ob_type) is a listed type with that offset is not scanned when
 *   kind MU_TYPE_DEAD_AT_ZERO: its ob_refcnt (at off) is 0 and its PyGC_Head (at off - 16)
 *       is an untracked one (next 0, prev 0 or 1): a dead object (a zombie or free-listed
 *       frame, a free-listed tuple, cpython-memory.md section 6);
 *   kind MU_TYPE_OPAQUE: always (the object holds no references; its slack bytes would only
 *       add stale words);
 *   kinds MU_TYPE_INT, MU_TYPE_FLOAT, MU_TYPE_BYTES: always, but a value object's words are
 *       looked up as addresses of native blocks (allocations holding no Python object a rule
 *       or a PyGC_Head tells: an int equal to an object's address is its id()): ctypes'
 *       c_void_p results, cffi's int(ffi.cast("uintptr_t", p)) and numpy's
 *       __array_interface__ hold a block's address as an int, struct.pack("P", p) as bytes.
 *       A value is a handle only at most MU_HANDLE_SLACK bytes into its block: what an
 *       allocator hands out (the block; CPython's debug hooks' 16-byte prefix, C++ new[]'s
 *       8-byte count before it). Ints are counters, sizes and constants too: under a non-PIE
 *       interpreter (Debian's) the brk heap lies at 16 MiB-1 GiB, where 1 << 29 or 10 ** 8
 *       fall inside a large block;
 *       MU_TYPE_INT: the value of a positive int of 1-3 30-bit digits (uint32 each at
 *       off + 24, within the block) below 2**64; bits 16-23 of code say what its size word
 *       (off + 16) is: MU_INT_OB_SIZE (3.8-3.11: ob_size = +-ndigits) or MU_INT_LV_TAG (3.12+:
 *       lv_tag = ndigits << 3 | flags, sign bits 0-1 (0: positive), bit 2 3.14's immortal
 *       small int). MU_TYPE_FLOAT: ob_fval (off + 16). MU_TYPE_BYTES: the whole words of a
 *       bytes object's data of 8-64 bytes (ob_size at off + 16, ob_sval at off + bits 16-47 of
 *       code, a multiple of 8): a packed pointer or small struct; longer bytes are data (a
 *       file's, a socket's; a read in progress fills a new bytes object whose bytes are stale
 *       until then);
 *   kind MU_TYPE_STR: the str is compact ASCII (state bits at off + 32): text only;
 * and is scanned only up to its live end for
 *   kind MU_TYPE_FRAME: a 3.11+ frame object, its inline frame data at object offset fo
 *       (bits 16-31 of code; tp_basicsize minus the data's slots offset), of flavour bits
 *       32-39 (MU_FRAME_FLAVOUR_*: 3.11-3.13 an int stacktop at fo + 64 and slots from fo + 72;
 *       3.14+ a stackpointer at fo + 64 and slots from fo + 80): when it owns that data
 *       (f_frame, at off + 24, points at it) the slots above the stack top are dead: CPython
 *       copies a frame only up to its top and never clears the slots above (cpython-memory.md
 *       section 5); while its frame runs elsewhere (a thread's data stack, a generator) the
 *       inline data is never written: only the head up to fo is live;
 *   kind MU_TYPE_SIZED: an object of a fixed-size type whose size (tp_basicsize) is in bits
 *       16-47 of code: the allocator's rounding slack after it holds only stale words; bits
 *       56-63 of code, when not 0, count words from the one whose index (from the object's
 *       start) is bits 48-55 that hold no reference either (3.14+ code objects'
 *       _co_unique_id, written by free-threaded builds only, and _co_firsttraceable's
 *       padding), in an object without GC links;
 *   kind MU_TYPE_CDATA: cffi's plain cdata (_cffi_backend._CDataBase), tp_basicsize in bits
 *       16-47 of code: as MU_TYPE_SIZED, unless its data pointer (off + 24) points into
 *       the block past that size: a casted primitive's value (ffi.cast("intptr_t", p)) lies
 *       there (at 40, or 48 when aligned for a long double);
 *   kind MU_TYPE_DICT: a dict (PyDict_Type itself), as MU_TYPE_SIZED, whose header words
 *       (refcount, the static type, ma_used and the version tag at object offset 24:
 *       ma_version_tag, a global counter stepped by 1 on 3.8-3.11 and 4096 on 3.12/3.13,
 *       _ma_watcher_tag from 3.14) are integers: not scanned, with the GC head before them (a
 *       version tag can equal a heap address of a non-PIE interpreter's brk heap, below
 *       4 GiB); and, as DEAD_AT_ZERO, not scanned at all when its ob_refcnt is 0 and its head
 *       untracked (a free-listed dict: 3.8-3.10 give dicts that rule too);
 *   kind MU_TYPE_VARSIZED: an object whose items follow its header inline (a tuple): the
 *       header's size in bits 16-47 of code, an item's in bits 48-55, the item count at
 *       off + 16 (ob_size): scanned up to header + count * item (the allocator's rounding
 *       slack after the last item holds only stale words); and, as DEAD_AT_ZERO, not scanned
 *       at all when its ob_refcnt is 0 and its head untracked (a free-listed tuple). An item
 *       size of 0: a fixed-size type (as MU_TYPE_SIZED, no count read) with the dead-at-zero
 *       rule too (3.8-3.10 give every GC type that rule, and a type has one code).
 *   kind MU_TYPE_GEN_FRAME: a 3.11+ generator, coroutine or async generator, whose frame data
 *       lies inline at object offset fo (bits 16-31 of code, flavour bits 32-39, as for
 *       MU_TYPE_FRAME): while it is not running (its int8 frame state at fo - 5: created or
 *       suspended, negative before 3.15, 0-3 from 3.15) the slots above the frame's stack top
 *       are dead, as in a frame object's (a suspended pluggy hook wrapper's slot 10 kept a
 *       leaked block's address); cleared (FRAME_CLEARED, 4 before 3.15, 5 from 3.15: its slots
 *       released but not zeroed) only its frame's head; running or completing (3.11-3.13): its
 *       ob_size slots, not the allocator's slack after them (a finished generator's last word,
 *       offset 248 of a 256-byte block, kept a leaked 34 MB block's address); 3.14+: all.
 *   kind MU_TYPE_MEMORYVIEW: a memoryview, tp_basicsize in bits 16-47 of code: its ob_size
 *       (3 * ndim) Py_ssize_t follow the header (shape, strides, suboffsets); when its
 *       view.suboffsets (at off + basicsize - 24) is NULL the suboffsets third is never
 *       written: scanned up to header + 8 * ob_size, or + 16 * ndim then.
 * dict_keys (MU_DICT_KEYS_*): an allocation whose header is a CPython dict key table
 * (PyDictKeysObject, consistent in every field) is scanned only up to the table's end as
 * new_keys_object sized it; the allocator's slack after it (under 16 bytes) holds only stale
 * words of the block's earlier users. 0: no such rule.
 * debug_hooks (1: CPython's debug hooks are on, PYTHONMALLOC=*debug): an allocation that starts
 * with a valid debug-hook prefix (its requested size n big-endian, an API id 'r', 'm' or 'o',
 * 7 bytes 0xfd) and holds 8 bytes 0xfd at 16 + n (the tail) is scanned only in [16, 16 + n):
 * the prefix and tail are never addresses, and the allocator's slack after the tail (3.8: a
 * serial number, then slack) is never written by this allocation (cpython-memory.md).
 * fresh (n bytes or NULL) and unwritten (nunwritten (begin, end, level) triples, sorted and
 * disjoint), over earlier snapshots numbered 1 (the oldest) up: fresh[i] is the latest one in
 * which no allocation began at allocation i's address (0: none), a range's level the oldest one
 * since which the target has not written that memory (mu_written.h). A word in a range of
 * level u is no reference to allocation i when 0 < u <= fresh[i]: the word was there before
 * the block, a stale copy of an address freed earlier. mu_mark only (mu_fold ignores it).
 * live_end (n uint32 or NULL): live_end[i] - 1 is how many bytes from allocation i's start can
 * hold references (a list's item array: its used slots; the rest is stale), 0: no limit; or
 * MU_LIVE_SET_TABLE | the offset (0 or 16, the debug hooks' prefix) of a set's table of its
 * own in allocation i, whose entries' second words (hashes) hold no reference: an int's hash
 * is its value, and a set of id()s held every object it named (mu_gc_dead_ranges). */
typedef struct {
    const uint64_t *ranges;
    uint64_t nranges;
    const uint8_t *head_word;
    const uint64_t *types;
    uint64_t ntypes;
    uint32_t dict_keys;
    uint32_t debug_hooks;
    const uint8_t *fresh;
    const uint64_t *unwritten;
    uint64_t nunwritten;
    const uint32_t *live_end;
} mu_dead;

#define MU_LIVE_SET_TABLE 2147483648
#define MU_DICT_KEYS_NONE 0
#define MU_DICT_KEYS_38 1     /* 3.8-3.10: {refcnt, dk_size, dk_lookup, dk_usable, dk_nentries} */
#define MU_DICT_KEYS_311 2    /* 3.11-3.13: {refcnt, log2_size, log2_index_bytes, kind, version,
                               * dk_usable, dk_nentries} */

#define MU_TYPE_DEAD_AT_ZERO 0
#define MU_TYPE_OPAQUE 1
#define MU_TYPE_STR 2
#define MU_TYPE_FRAME 3
#define MU_TYPE_SIZED 4
#define MU_TYPE_VARSIZED 5
#define MU_TYPE_GEN_FRAME 6
#define MU_TYPE_MEMORYVIEW 7
#define MU_TYPE_INT 8
#define MU_TYPE_FLOAT 9
#define MU_TYPE_BYTES 10
#define MU_HANDLE_SLACK 16
/* A word whose low half is below MU_PAIR_LOW_MAX, pointing into a block that began below the
 * 4 GiB boundary the word's high half names, is no reference: 4 bytes of a count, a flag or a
 * short string ("FIX" and a NUL: 0x00584946) next to 4 bytes that kept the high half of an old
 * pointer read as an address just past that boundary, inside any large block that spans it
 * (the mmapped chunks next to the libraries). A block's own start, a word 8 MiB or more past
 * the boundary, and any word into a block that begins past the boundary stay references; so
 * does a word less than MU_PAIR_NEAR past the block's start (its headers: a glibc heap block
 * that began 16 bytes below the boundary held a CPython GC object there under the debug hooks,
 * and the GC walk lost that node, s39ci6). */
#define MU_PAIR_LOW_MAX 0x800000
#define MU_PAIR_NEAR 4096
#define MU_TYPE_DICT 11
#define MU_TYPE_CDATA 12
#define MU_TYPE_LAST 12          /* the highest kind */

#define MU_FRAME_FLAVOUR_311 0   /* MU_TYPE_FRAME/GEN_FRAME's frame data: 3.11-3.13 */
#define MU_FRAME_FLAVOUR_314 1   /* 3.14: a stackpointer, slots from 80 */
#define MU_FRAME_FLAVOUR_315 2   /* 3.15: as 3.14, frame states renumbered */

#define MU_INT_OB_SIZE 0         /* MU_TYPE_INT's parameter: its size word's meaning */
#define MU_INT_LV_TAG 1
