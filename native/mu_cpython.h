/* mu_cpython.h: array passes of the CPython pipeline stage (memunreachable/heaps/cpython/pipeline.py)
 * over the sweep's allocation arrays: loops over 100k+ pymalloc blocks that Python ran slice by
 * slice. Plain ascending uint64 arrays in, caller-provided arrays out. */

/* mu_merge_blocks: counters and the first overlap found. */
typedef struct {
    uint64_t removed;       /* drop[] entries that matched an allocation (duplicates count once) */
    uint64_t overlap_at;    /* the later allocation of the first overlapping pair, or 0 */
} mu_merge_stats;

/* Merge the ascending allocations a (a_begin/a_size, na) and b (nb) into out_begin/out_size in
 * address order, keeping only those that begin inside one of the nspans ascending, disjoint
 * [lo, hi) pairs of spans[] (the copies that hold them; spans NULL: all of them), and leaving out every allocation that
 * begins at an address of drop[] (ndrop entries, ascending). Two neighbours in address order
 * taken from different inputs must not overlap (begin + max(size, 1) > next begin): then
 * stats->overlap_at gets the later one and -ERANGE is returned (a-b ties: a first).
 * Returns the number of allocations written, -ENOSPC when cap is too small, -EINVAL. */
int64_t mu_merge_blocks(const uint64_t *a_begin, const uint64_t *a_size, uint64_t na,
                        const uint64_t *b_begin, const uint64_t *b_size, uint64_t nb,
                        const uint64_t *spans, uint64_t nspans,
                        const uint64_t *drop, uint64_t ndrop,
                        uint64_t *out_begin, uint64_t *out_size, uint64_t cap,
                        mu_merge_stats *stats);

/* The pools (addresses b - b % pool_size of the ascending blocks[], n entries) that a glibc
 * allocation overlaps: pool p is listed when the last allocation of the ascending g_begin/g_size
 * (gn entries) that begins before p + pool_size ends (begin + max(size, 1)) after p. Writes up
 * to cap pool addresses, ascending, to out. Returns how many pools overlap (may exceed cap),
 * or -EINVAL. */
int64_t mu_pools_overlapping(const uint64_t *blocks, uint64_t n, uint64_t pool_size,
                             const uint64_t *g_begin, const uint64_t *g_size, uint64_t gn,
                             uint64_t *out, uint64_t cap);

/* One pass over the GC objects of the image (head_word[i] != 0: mu_gc_walk) storing the
 * (begin, end) pairs four rules find, as mu_list_slack, mu_field_blocks(metas, doc_field,
 * flag_off, flag_mask) and mu_field_blocks(buffered, buf_field, 0, 0) would one after the
 * other, then type flags (an object two rules apply to gives both pairs, in this order):
 *   list slack   objects of type list_type (0: none): [item + 8*ob_size, the item array's
 *                end) (mu_list_slack)
 *   type docs    objects whose type is in metas[] (ascending) and whose word at flag_off has a
 *                bit of flag_mask: the block their word at doc_field points at
 *   io buffers   objects whose type is in buffered[] (ascending): the block their word at
 *                buf_field points at
 *   type flags   objects whose type is in metas[] (a type object): their word at flag_off
 *                (tp_flags: 1 << 24 and up for the subclasses of int, list, dict,
 *                BaseException..., a number inside a non-PIE interpreter's heap)
 *   set hashes   objects whose type is in sets[] (ascending; set, frozenset, subclasses):
 *                the hashes of their table's entries are no references (an int's hash is its
 *                value: a set of id()s held every object it named): in the smalltable, a pair
 *                per hash in the span of the allocations (8-aligned; counts[4]); a table of
 *                its own (mask + 1 entries of 16 bytes, starting its allocation or 16 bytes
 *                into it, the debug hooks' prefix) is marked in live_end (MU_LIVE_SET_TABLE |
 *                that offset: the mark skips each entry's second word; counts[5] of them)
 * Pairs go to out (2 words each, up to cap pairs) in object order; counts[0..5] get how many
 * each rule found. With live_end (n uint32, zeroed by the caller; NULL: none), a list's slack
 * that runs from its used slots to the end of the allocation its item array starts is given
 * as that allocation's live_end (mu_dead: 1 + the used slots' bytes; the least when two lists
 * name it) instead of a pair: 4 M lists' 4 M pairs cost a sort and the mark's searches.
 * Returns the number of pairs found (may exceed cap), or -EINVAL. */
int64_t mu_gc_dead_ranges(const uint64_t *begin, const uint64_t *size, uint64_t n,
                          const mu_region *heap, uint64_t nheap, const uint8_t *head_word,
                          uint64_t list_type, const uint64_t *metas, uint64_t nmetas,
                          uint64_t doc_field, uint64_t flag_off, uint64_t flag_mask,
                          const uint64_t *buffered, uint64_t nbuffered, uint64_t buf_field,
                          const uint64_t *sets, uint64_t nsets,
                          uint64_t *out, uint64_t cap, uint64_t *counts, uint32_t *live_end);

/* The GC objects of the image (head_word[i] != 0: mu_gc_walk) whose type is in types[]
 * (ascending) and whose word at flag_off satisfies (word & flag_mask) == flag_want: their
 * object addresses (block + GC-link offset + 16), ascending, up to cap of them to out.
 * Returns how many there are (may exceed cap), or -EINVAL. */
int64_t mu_gc_objects_of(const uint64_t *begin, const uint64_t *size, uint64_t n,
                         const mu_region *heap, uint64_t nheap, const uint8_t *head_word,
                         const uint64_t *types, uint64_t ntypes, uint64_t flag_off,
                         uint64_t flag_mask, uint64_t flag_want, uint64_t *out, uint64_t cap);

/* One pass over the GC objects of the image (head_word[i] != 0) whose type is in deques[]
 * (ascending: collections.deque and its subclasses) storing the (begin, end) pairs of their
 * blocks' words that hold no reference (_collectionsmodule.c: a chain of 528-byte blocks
 * {leftlink, data[64], rightlink} from leftblock (object offset 24) to rightblock (32), the
 * items from data[leftindex] (40) in the first to data[rightindex] (48) in the last, ob_size
 * of them): the first block's leftlink and data before leftindex, the last block's data after
 * rightindex and its rightlink, each block's allocation slack past 528 bytes; with free_off
 * (3.11+: the object offset of numfreeblocks (72), then freeblocks[16]; 0 before) the whole of each
 * cached free block and the unused freeblocks slots. A deque whose indexes, count and chain
 * (every block an allocation of the image of at least 528 bytes) do not agree gives none.
 * Pairs go to out (2 words each, up to cap pairs); counts[0] gets the deques taken. Returns
 * the number of pairs found (may exceed cap), or -EINVAL. */
int64_t mu_deque_dead_ranges(const uint64_t *begin, const uint64_t *size, uint64_t n,
                             const mu_region *heap, uint64_t nheap, const uint8_t *head_word,
                             const uint64_t *deques, uint64_t ndeques, uint64_t free_off,
                             uint64_t *out, uint64_t cap, uint64_t *counts);

/* One pass over the GC objects of the image (head_word[i] != 0) storing the (begin, end) pairs
 * of their stale parts, words that hold no reference (cpython-memory.md section 7):
 *   set smalltable  objects whose type is in sets[] (ascending; set, frozenset, subclasses):
 *                   when its table (object offset 40) is no longer its smalltable (offset 64,
 *                   8 entries of 16 bytes), the smalltable keeps the entries of before the
 *                   resize: [obj + 64, obj + 192);
 *   dict values     3.11/3.12 PyDictValues arrays (values_tag 0: none), reached from objects
 *                   whose type is in managed[] (ascending; their word at values_field from the
 *                   object, 3.12 tagged: odd, values = word + 1; 3.11: values_tag 2, the word
 *                   itself) or in dicts[] (ascending; ma_values at object offset 40): the
 *                   array's prefix [values - prefix, values) holds insertion-order bytes, not
 *                   references, and the slots past the highest index of its order list hold
 *                   NULL or the allocator's stale slack: [values + 8 * (max index + 1), end
 *                   of the allocation). Used only when the prefix (its size in byte values[-1],
 *                   8..248, a multiple of 8; the count in values[-2], the indices at
 *                   values[-3 - j]) is consistent and values - prefix starts an allocation.
 *                   The managed[] objects' materialized dict too (its pointer at object
 *                   offset -24; 3.12: an even word), tracked by the GC or not: its ma_values.
 *                   3.13+ (values_tag MU_VALUES_313): the values of inline_types[] (ascending;
 *                   Py_TPFLAGS_INLINE_VALUES) lie at object offset values_field (3.13: 16),
 *                   or with values_field 0 at the type's tp_basicsize (3.14+: read from the
 *                   type object, a heap type in the image; none when unreadable), and
 *                   ma_values must start an allocation; the array is {capacity, size,
 *                   embedded, valid bytes, padding} then capacity slots then size order
 *                   bytes: the header word and everything from the slot past the highest
 *                   ordered index to the allocation's end are dead.
 *   str buffers     objects whose type is in strs[] (ascending; str subclasses) that are not
 *                   compact (state bit 0x20 at object offset 32 clear): their text lives in
 *                   separate allocations, data (object offset str_data) and utf8 (str_utf8)
 *                   when it differs: each such allocation whole (text, no references; the
 *                   allocator's slack after its NUL keeps stale pointer bytes).
 *   generator head  objects of type gen_type (0: none; PyGen_Type, 3.11+): the two words at
 *                   object offset gen_dead (gi_origin_or_finalizer and the flag bytes before
 *                   the inline frame), which make_gen never writes for a plain generator
 *                   (only coroutines and async generators use them): [obj + gen_dead, +16).
 *   type names      objects whose type is in metas[] (ascending; type and its subclasses)
 *                   that are heap types (Py_TPFLAGS_HEAPTYPE): the allocation tp_name starts
 *                   (PyType_FromSpec's copy of the spec's name; text, its slack stale).
 *   old frames      objects of type frame_type (0: none; 3.8-3.10 PyFrame_Type): the 240-byte
 *                   try-block stack at object offset frame_blocks (ints), the 16 bytes before
 *                   it (f_lasti, f_lineno, f_iblock, a state char, padding) and the word 32
 *                   bytes before it (trace flag chars, padding): no pointers; and, frame_stack
 *                   MU_FRAME_39 (3.8/3.9): from f_stacktop (offset 72; NULL while running) to
 *                   the allocation's end, MU_FRAME_310: from f_valuestack (64) + 8 *
 *                   f_stackdepth (int at 80) to the end while f_state (int8 at 108) is
 *                   negative (created or suspended).
 * Pairs go to out (up to cap pairs) in object order; counts[0..5] get how many objects each
 * rule found (a values array gives one or two pairs, a str one or two). Returns the number of
 * pairs (may exceed cap), -EINVAL or -ENOMEM. */
#define MU_VALUES_TAGGED 1      /* 3.12: the object's word is values - 1 (odd) or a dict */
#define MU_VALUES_PLAIN 2       /* 3.11: the object's word is values or NULL */
#define MU_VALUES_313 3         /* 3.13+: values inline at the object's offset values_field */
#define MU_TP_BASICSIZE 32      /* PyTypeObject.tp_basicsize */
#define MU_FRAME_39 1           /* 3.8/3.9 frames: f_stacktop */
#define MU_FRAME_310 2          /* 3.10 frames: f_stackdepth and f_state */
int64_t mu_gc_stale_parts(const uint64_t *begin, const uint64_t *size, uint64_t n,
                          const mu_region *heap, uint64_t nheap, const uint8_t *head_word,
                          const uint64_t *sets, uint64_t nsets,
                          const uint64_t *managed, uint64_t nmanaged, int64_t values_field,
                          uint32_t values_tag, const uint64_t *inline_types, uint64_t ninline,
                          const uint64_t *dicts, uint64_t ndicts,
                          const uint64_t *strs, uint64_t nstrs, uint64_t str_utf8,
                          uint64_t str_data, uint64_t gen_type, uint64_t gen_dead,
                          const uint64_t *metas, uint64_t nmetas, uint64_t frame_type,
                          uint64_t frame_blocks, uint32_t frame_stack,
                          uint64_t *out, uint64_t cap, uint64_t *counts);

/* The indexes of the words among words[0..n) that are 16-aligned addresses inside one of the
 * nin ranges in[] and inside none of the nex ranges ex[] ((begin, end) pairs, sorted and
 * disjoint): up to cap into idx, ascending. Returns how many there are (may exceed cap) or
 * -EINVAL. (obmalloc.scanned_arena_dead: a runtime's words that may point at a malloc'd
 * table.) */
int64_t mu_words_into(const uint64_t *words, uint64_t n, const uint64_t *in, uint64_t nin,
                      const uint64_t *ex, uint64_t nex, uint64_t *idx, uint64_t cap);

/* The indexes of the words among words[0..n) equal to one of the nvals values vals[] (sorted
 * ascending): up to cap into idx, ascending. Returns how many there are (may exceed cap) or
 * -EINVAL. (typerules._static_types: the words of a loaded object's data that may be a static
 * type's ob_type, one pass for every metatype, not a byte search each.) */
int64_t mu_words_equal(const uint64_t *words, uint64_t n, const uint64_t *vals, uint64_t nvals,
                       uint64_t *idx, uint64_t cap);

/* A chain of n objects from `first` (cpython/walker.py read_freelists: floats through ob_type,
 * tuples through ob_item[0]): object o must be 8-aligned, with its words at o + check_off
 * (ob_refcnt) and o + link_off in one region of r[] (sorted by base; the last region that
 * begins at or below an address serves it, as memory.CopiedMemory.view does), and the word at
 * o + check_off 0; out[k] = o_k, then o_k+1 is the word at o_k + link_off. Returns n;
 * -EFAULT when an object's words are in no region (out[0..k) hold the objects before it, *done
 * says k: the caller reads on another way), -ENOENT when the chain ends (NULL) early, -EPROTO
 * when an object's check word is not 0 or it is misaligned (*done: its index), -EINVAL.
 * check_off MU_CHAIN_NO_CHECK: no check word (3.14+ free lists link through ob_refcnt). */
#define MU_CHAIN_NO_CHECK 4294967295
int64_t mu_follow_chain(const mu_region *r, uint64_t nr, uint64_t first, uint64_t n,
                        uint64_t link_off, uint64_t check_off, uint64_t *out, uint64_t *done);
