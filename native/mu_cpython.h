/* mu_cpython.h: array passes of the CPython pipeline stage (memunreachable/cpython/pipeline.py)
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
 * (begin, end) pairs three rules find, as mu_list_slack, mu_field_blocks(metas, doc_field,
 * flag_off, flag_mask) and mu_field_blocks(buffered, buf_field, 0, 0) would one after the
 * other (an object two rules apply to gives both pairs, list slack first):
 *   list slack   objects of type list_type (0: none): [item + 8*ob_size, item + 8*allocated)
 *   type docs    objects whose type is in metas[] (ascending) and whose word at flag_off has a
 *                bit of flag_mask: the block their word at doc_field points at
 *   io buffers   objects whose type is in buffered[] (ascending): the block their word at
 *                buf_field points at
 * Pairs go to out (2 words each, up to cap pairs) in object order; counts[0..2] get how many
 * each rule found. Returns the number of pairs found (may exceed cap), or -EINVAL. */
int64_t mu_gc_dead_ranges(const uint64_t *begin, const uint64_t *size, uint64_t n,
                          const mu_region *heap, uint64_t nheap, const uint8_t *head_word,
                          uint64_t list_type, const uint64_t *metas, uint64_t nmetas,
                          uint64_t doc_field, uint64_t flag_off, uint64_t flag_mask,
                          const uint64_t *buffered, uint64_t nbuffered, uint64_t buf_field,
                          uint64_t *out, uint64_t cap, uint64_t *counts);
