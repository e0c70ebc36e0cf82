/* mu_scan.h: conservative mark over allocations (libmemunreachable.md section 3). */

typedef struct {
    uint64_t root_bytes;     /* bytes of root ranges scanned */
    uint64_t heap_bytes;     /* bytes of reached allocations scanned */
    uint64_t words;          /* 8-byte words examined in total */
    uint64_t marked;         /* allocations reached */
    uint64_t stale;          /* references to fresh allocations ignored (mu_dead.fresh) */
    /* the low-memory mark (uncopied regions): */
    uint64_t waves;          /* waves run */
    uint64_t reads;          /* reads of blocks on demand (one per run of neighbours) */
    uint64_t read_bytes;     /* bytes they read */
    uint64_t copy_budget;    /* bytes a copy would read: the pieces whose candidates were not kept */
    uint64_t overhead;       /* the waves' and reads' cost charged (mu_mark_policy), in bytes */
    uint64_t switch_wave;    /* the wave at which the mark switched to the copy (1: the first), 0: never */
    uint64_t copied_bytes;   /* bytes read into the copy (1 MiB pieces) */
    uint64_t size_total;     /* the sum of size[] over every allocation, reached or not */
} mu_mark_stats;

/* When the low-memory mark stops reading on demand (mu_mark). A deep graph (a linked list) gives
 * waves of one block per list: a wave and a read per node. Each wave is charged wave_cost and
 * each read read_cost (byte equivalents of their fixed costs: sorting, thread starts, a pread's
 * syscall and page walk); before a wave, once the charges reach copy_budget (the bytes of the
 * uncopied regions' pieces whose candidates were not kept), the mark switches to a copy: a wave
 * reads the whole 1 MiB piece of a block it needs (once), the rest of the mark scans blocks
 * there without a read, and a piece is released once no block still to scan touches it (ski
 * rental: the reads' overhead stays within the copy's bytes, whatever the graph's depth, the
 * copy reads each piece at most once, and a shallow graph never switches). wave_cost 0 and
 * read_cost 0: never copy; wave_cost UINT64_MAX: copy before the first wave. NULL: never. */
typedef struct {
    uint64_t wave_cost;
    uint64_t read_cost;
} mu_mark_policy;

/* Allocations: begin[] strictly ascending, size[] usable sizes (a size of 0 counts as 1 byte),
 * non-overlapping, so allocation i covers [begin[i], begin[i] + max(size[i], 1)).
 * heap[]: regions (sorted by base, disjoint) whose data holds the bytes of every allocation.
 * roots[]: memory scanned as roots, in order; words[]: root values (registers, fs_base, ...).
 * Word scan: start rounded up to 8, 8-byte steps, interior pointers count, one-past-end does not.
 * A scanned range scans [begin, begin + size) (a zero-size allocation has no words); a last
 * word that starts before the end is read whole when its bytes are in the same region or
 * root buffer, else zero-padded.
 * marked[i] is set to 1 for every allocation reachable from a root (iterative worklist).
 * Returns the number of marked allocations, or -EINVAL (unsorted/overlapping input, or an
 * allocation not inside any heap region, or unsorted/overlapping heap regions), -EOVERFLOW
 * (n >= 2^32 - 1) or -ENOMEM. dead: words to ignore (mu_dead), or NULL; -EINVAL when its ranges
 * are unsorted, overlapping or unaligned.
 * Uncopied heap regions (mu_region.uncopied, the low-memory mark): their allocations are read
 * when marked, wave by wave (sorted by address, in reads of up to 8 MiB through the region's
 * fd, on one thread per CPU), and the read bytes are dropped once scanned; the result equals
 * that over copies; policy (mu_mark_policy) says when the waves' overhead makes it copy the
 * rest instead, and stats say which way it went. -EIO when some of their bytes cannot be read
 * (the snapshot died), or the read's -errno. */
int64_t mu_mark(const uint64_t *begin, const uint64_t *size, uint64_t n,
                const mu_region *heap, uint64_t nheap,
                const mu_region *roots, uint64_t nroots,
                const uint64_t *words, uint64_t nwords,
                uint8_t *marked, mu_mark_stats *stats, uint32_t flags, const mu_dead *dead,
                const mu_mark_policy *policy);

/* flags for mu_mark.
 * MU_MARK_PARALLEL: mark on one thread per CPU (up to 4) whatever the number of
 * allocations (by default only from 2^18 on); the result is the same (tests compare the two). */
#define MU_MARK_PARALLEL 2

/* Internal to the C core (shared by mu_mark and mu_fold); Python does not call these.
 * An address -> allocation lookup: a [lo, hi) filter, a region map (the heap region holding each
 * 64 KiB granule, by the granule number's low bits; a binary search over the regions when two
 * share a slot), then per region a page table (first allocation ending after each page start; the granule
 * gives about one page per 4 allocations) and a short binary search over the caller's begin[]
 * (which must outlive the index), the end from size[]. Fields are private to mu_scan.c. */
typedef struct {
    uint64_t n;
    uint64_t lo;             /* min begin */
    uint64_t hi;             /* max end */
    const uint64_t *begin;   /* the caller's arrays: allocation i is [begin[i], begin[i] + */
    const uint64_t *size;    /* max(size[i], 1)) (no copy: 16 bytes a block) */
    const mu_region *heap;
    uint64_t nheap;
    uint64_t *first_alloc;   /* nheap+1: allocations of region r are [first_alloc[r], first_alloc[r+1]) */
    uint64_t *page_off;      /* nheap: start of region r's table in page[] (pages(r) + 1 entries) */
    uint32_t *page;
    uint32_t shift;          /* log2 of the page-table granule (>= 4) */
    uint64_t last_region;    /* lookup cache */
    uint16_t *rmap;          /* region map: 64 KiB granules, direct-mapped by their low bits */
    uint64_t rmask;          /* its slots - 1 */
    const mu_dead *dead;     /* words to ignore, or NULL (set by mu_scan_index_set_dead) */
    uint64_t size_total;     /* the sum of size[] (the validating pass adds it up) */
    uint64_t *leaf;          /* mu_mark's: bit i set when allocation i, in an uncopied region,
                              * would be scanned from kept candidates and none lies in it */
} mu_scan_index;

/* Validates the inputs (as mu_mark) and builds ix. Returns 0, -EINVAL, -EOVERFLOW or -ENOMEM;
 * on success the caller must call mu_scan_index_free. */
int64_t mu_scan_index_init(mu_scan_index *ix, const uint64_t *begin, const uint64_t *size,
                           uint64_t n, const mu_region *heap, uint64_t nheap, uint32_t flags);
void mu_scan_index_free(mu_scan_index *ix);
/* Validates the inputs as mu_scan_index_init does, building nothing: 0, -EINVAL, -EOVERFLOW. */
int64_t mu_scan_index_check(const uint64_t *begin, const uint64_t *size, uint64_t n,
                            const mu_region *heap, uint64_t nheap);
/* Returns the index of the allocation containing address v, or -1. */
int64_t mu_scan_index_find(mu_scan_index *ix, uint64_t v);
/* Stores in out[k] the index of the allocation containing vals[k], or -1 (batched lookups). */
void mu_scan_index_find_many(mu_scan_index *ix, const uint64_t *vals, uint64_t nv, int64_t *out);
/* Returns the index of the heap region holding allocation i (i < n). */
uint64_t mu_scan_index_region_of(const mu_scan_index *ix, uint64_t i);
/* Validates dead (NULL: none) and attaches it to ix. Returns 0 or -EINVAL. */
int64_t mu_scan_index_set_dead(mu_scan_index *ix, const mu_dead *dead);

/* The CPython GC generation lists (cpython-memory.md section 4), walked over the allocations.
 * heads: nheads triples (address of a list head PyGC_Head, its _gc_next, its _gc_prev), the
 * head words read by the caller (heads live outside the allocations, or inside one).
 * From each head, follow _gc_next (bit 0 masked) back to the head; every node must be the
 * start of a PyGC_Head lying, 8-aligned, inside one allocation i (at most 254 words in, with
 * its 16 bytes inside), never visited before, whose _gc_prev (low 2 bits masked) is the node
 * before it; the head's _gc_prev must be the last node. head_word (n bytes, zeroed here)
 * receives, per allocation holding a node, 1 + the node's word offset in it (mu_dead).
 * At most max_nodes nodes in all. types (types_cap entries) receives the distinct ob_type
 * words of the nodes' objects (the word after the head), ascending; stats->ntypes their count,
 * which may exceed types_cap (then types holds the first types_cap).
 * Returns the number of nodes, or -EINVAL (bad input), -ELOOP (more than max_nodes, or a
 * node met twice), -EFAULT (a node not inside an allocation), -EPROTO (a _gc_prev that does
 * not point back); stats->bad_node / bad_list say where it stopped. */
typedef struct {
    uint64_t bad_node;
    uint64_t bad_list;
    uint64_t nodes;
    uint64_t ntypes;         /* distinct ob_type values (node + 24) written to types[] */
} mu_gc_walk_stats;

int64_t mu_gc_walk(const uint64_t *begin, const uint64_t *size, uint64_t n,
                   const mu_region *heap, uint64_t nheap,
                   const uint64_t *heads, uint64_t nheads, uint64_t max_nodes,
                   uint8_t *head_word, uint64_t *types, uint64_t types_cap,
                   mu_gc_walk_stats *stats);

/* The stale slots of CPython lists: list.pop() and del shrink ob_size without clearing the
 * slots above it, which keep pointers to objects that may since have leaked. For every
 * allocation i with head_word[i] != 0 (a GC object, mu_gc_walk) whose object's ob_type is
 * list_type, with 0 <= ob_size <= allocated and ob_item 8-aligned, stores the pair
 * (ob_item + 8*ob_size, end) in out (2*cap words), in allocation order: end is the end of the
 * allocation that starts at ob_item when it holds the `allocated` slots (the allocator's slack
 * after them is stale too: a 48-slot array's 392-byte chunk kept a leaked block's address in
 * its last word), else ob_item + 8*allocated; no pair when that is ob_item + 8*ob_size.
 * Object layout: ob_type at +8, ob_size +16, ob_item +24, allocated +32 after the 16-byte head.
 * Returns the number of pairs found (may exceed cap: then only cap were stored), or -EINVAL. */
int64_t mu_list_slack(const uint64_t *begin, const uint64_t *size, uint64_t n,
                      const mu_region *heap, uint64_t nheap, const uint8_t *head_word,
                      uint64_t list_type, uint64_t *out, uint64_t cap);

/* Blocks that a field of a GC object owns and that hold no references (heap types' docstrings,
 * the buffers of io's buffered objects): for every allocation i with head_word[i] != 0 whose
 * object's ob_type is one of the ntypes types (ascending), whose word at object offset flag_off
 * has a bit of flag_mask set (flag_mask 0: always) and whose pointer at object offset field is
 * exactly the start of another allocation, that allocation is stored as the pair (begin,
 * begin + size) in out (2*cap words), in the order of the objects. Returns the number of pairs
 * found (may exceed cap: then only cap were stored), or -EINVAL (field below 16 or unaligned). */
int64_t mu_field_blocks(const uint64_t *begin, const uint64_t *size, uint64_t n,
                        const mu_region *heap, uint64_t nheap, const uint8_t *head_word,
                        const uint64_t *types, uint64_t ntypes, uint64_t field,
                        uint64_t flag_off, uint64_t flag_mask, uint64_t *out, uint64_t cap);

/* The bytes of allocation [b, b+len) (data at p, avail readable) that mu_mark scans under
 * dead: 0 for a dead or reference-free object, else its live length (mu_dead kinds FRAME and
 * SIZED), else len. For diagnostics (explain.py); dead may be NULL. */
uint64_t mu_scanned_len(const mu_dead *dead, const uint8_t *p, uint64_t b, uint64_t len,
                        uint64_t avail);

/* The words [*hb, *he) inside allocation i, [b, b+len) (data at p, avail readable), that
 * mu_mark skips in the middle of its scan: its PyGC_Head's links, a dict's integer header
 * words (MU_TYPE_DICT), a MU_TYPE_SIZED object's unwritten words; 0, 0 for none; and in
 * [*zb, *ze) the hashes it skips too, the words *zb + *zs * k (a dict key table's entries' first
 * words, every 24 bytes; a set's table entries' second words, every 16; 0, 0 for none). For
 * diagnostics (explain.py); dead may be NULL. */
void mu_scanned_head(const mu_dead *dead, uint64_t i, const uint8_t *p, uint64_t b, uint64_t len,
                     uint64_t avail, uint64_t *hb, uint64_t *he, uint64_t *zb, uint64_t *ze,
                     uint64_t *zs);

/* The words of the value object (an int, a float, a short bytes: mu_dead kinds INT, FLOAT,
 * BYTES) in allocation [b, b+len) (data at p, avail readable) that mu_mark looks up as native
 * blocks' handles: up to 8 values into vals, the addresses they were read from into at;
 * returns how many (0: no value object). For diagnostics (explain.py); dead may be NULL. */
uint64_t mu_value_words(const mu_dead *dead, const uint8_t *p, uint64_t b, uint64_t len,
                        uint64_t avail, uint64_t *vals, uint64_t *at);

/* Sorts the n (begin, end) pairs of pairs[] (2n words) by begin (then end), drops the empty
 * ones (begin >= end) and merges those that overlap or touch, in place, as mark.merge_pairs
 * specifies. Returns the number of pairs left at the front, or -EINVAL. */
int64_t mu_merge_pairs(uint64_t *pairs, uint64_t n);
