/* mu_walk.h: the glibc chunk walker (our malloc_iterate), glibc-heap.md sections 2, 9, 10.
 * Layout facts that vary by glibc release come from memunreachable/glibc/layout.py; the chunk
 * format below (16-byte headers, flag bits 1/2/4) is the same in glibc 2.26-2.42 on x86_64. */

/* Why mu_walk_run stopped (mu_walk_result.status). */
enum {
    MU_WALK_TOP = 0,        /* reached the arena's top chunk; end = top + chunksize(top) */
    MU_WALK_FENCE2 = 1,     /* main-arena double fencepost {0x10|1, 0x10|1}; end = after them */
    MU_WALK_FENCE0 = 2,     /* non-main heap end fencepost {0x10|1 or pseudo chunk, 0|1}; end = after it */
    MU_WALK_BAD_SIZE = 3,   /* size not a multiple of 16, below MINSIZE, or beyond the buffer */
    MU_WALK_BAD_FLAGS = 4,  /* IS_MMAPPED set, or NON_MAIN_ARENA wrong on an in-use chunk */
    MU_WALK_PAST_TOP = 5,   /* the chain stepped over top */
    MU_WALK_TRUNCATED = 6   /* the buffer ended before top or a fencepost */
};

typedef struct {
    uint64_t chunks;        /* chunks stepped over (top and fenceposts excluded) */
    uint64_t in_use;        /* chunks whose next header has PREV_INUSE (may exceed cap) */
    uint64_t in_use_bytes;  /* sum of their chunk sizes */
    uint64_t free_chunks;   /* chunks whose next header has PREV_INUSE clear */
    uint64_t free_bytes;    /* sum of their chunk sizes */
    uint64_t end;           /* address where the run ends (see status) */
    uint64_t bad_at;        /* chunk address of the failure (status >= MU_WALK_BAD_SIZE) */
    int64_t status;         /* MU_WALK_* */
} mu_walk_result;

/* Walk the chunks of one run held in data[0 .. len) (a local copy of [base, base+len)),
 * starting at the chunk header `first`, until `top` (0: none in this run) or a fencepost.
 * non_main: 1 for a thread-arena heap (NON_MAIN_ARENA must be set on in-use chunks), else 0.
 * For every in-use chunk c of size S (in address order) stores user = c+16 and usable = S-8
 * while fewer than cap were stored. The chunk right before a size-0 fencepost is never stored.
 * Returns the number stored (min(res->in_use, cap)); -EINVAL on bad arguments. */
int64_t mu_walk_run(const uint8_t *data, uint64_t base, uint64_t len, uint64_t first, uint64_t top,
                    uint32_t non_main, uint64_t *user, uint64_t *usable, uint64_t cap,
                    mu_walk_result *res);

/* Positions p in [base, base+len) with p % step == 0 (step a power of two >= 16) where the
 * words at p and p+8 satisfy: prev_size == 0, (size & 7) == flags, chunksize >= min_size and
 * chunksize % align == 0 (align a power of two). Candidate run starts (step 16 after a foreign
 * sbrk, 4096 for NONCONTIGUOUS runs). Stores up to cap positions; returns the number found. */
int64_t mu_walk_find_headers(const uint8_t *data, uint64_t base, uint64_t len, uint64_t step,
                             uint64_t flags, uint64_t min_size, uint64_t align,
                             uint64_t *out, uint64_t cap);

typedef struct {
    uint64_t found;         /* mmapped chunks found (may exceed cap) */
    uint64_t bytes;         /* sum of prev_size + size (what mp_.mmapped_mem counts) */
    uint64_t moved;         /* chunks found behind a stale memalign header */
} mu_mmap_result;

/* Scan data[0 .. len) (a copy of [base, base+len), base page aligned) page by page for mmapped
 * chunk headers {0, S|IS_MMAPPED} with S % 4096 == 0, S >= 4096, fitting the buffer. A stale
 * memalign header at m is followed by zeros and the real header {o, (S-o)|IS_MMAPPED} at m+o
 * (o >= 32, o % 16 == 0): the chunk is then m+o. After a hit the scan continues at m+S.
 * Stores user = chunk+16, usable = size-16 (ascending) while fewer than cap were stored.
 * Returns the number stored; -EINVAL on bad arguments. */
int64_t mu_walk_mmapped(const uint8_t *data, uint64_t base, uint64_t len, uint64_t page,
                        uint64_t *user, uint64_t *usable, uint64_t cap, mu_mmap_result *res);

/* Why mu_walk_chain stopped. */
enum {
    MU_CHAIN_NULL = 0,      /* the chain ended in NULL */
    MU_CHAIN_BAD = 1,       /* a node was misaligned, unreadable, of the wrong size or bit-free */
    MU_CHAIN_LONG = 2       /* more than max_nodes nodes (a cycle, or a count off) */
};

/* Follow a singly linked free list through the sorted, disjoint regions[0 .. nregions).
 * Link addresses L are user pointers (chunk = L-16). The first node is head + bias; the link
 * of node L is the word at L, mangled (glibc >= 2.32 safe-linking: stored = (L >> 12) ^ value)
 * when mangled != 0, and the next node is value + bias (bias 0: tcache entries are user
 * pointers; bias 16: fastbin fd values are chunk pointers). Each node must be 16-aligned,
 * inside a region, have chunksize == chunk_size and the PREV_INUSE bit set in the next header.
 * Stores the valid nodes' user pointers (up to cap, in chain order); *status gets MU_CHAIN_*.
 * Returns the number of valid nodes (at most max_nodes + 1). */
int64_t mu_walk_chain(const mu_region *regions, uint64_t nregions, uint64_t head, uint64_t bias,
                      uint32_t mangled, uint64_t chunk_size, uint64_t max_nodes,
                      uint64_t *out, uint64_t cap, int64_t *status);

/* Walk a doubly linked bin list from the bin's fake chunk `bin` (its fd at bin+16, bk at
 * bin+24) through the regions: each node n needs n->bk == previous node, a readable header,
 * chunksize >= 32, and (counted separately) the PREV_INUSE bit clear in the next header.
 * Stops back at `bin`, or after max_nodes nodes. Writes nodes, bytes and bit-free nodes.
 * Returns 0 when the list closed correctly, 1 if it is broken or too long. */
int64_t mu_walk_bin(const mu_region *regions, uint64_t nregions, uint64_t bin, uint64_t max_nodes,
                    uint64_t *nodes, uint64_t *bytes, uint64_t *bit_free);

/* Remove from the ascending user[]/usable[] (n entries) every address listed in drop[]
 * (ndrop entries, any order; sorted in place). Returns the new length; *removed gets the number
 * of drop[] entries that matched (duplicates in drop count once). */
int64_t mu_walk_subtract(uint64_t *user, uint64_t *usable, uint64_t n, uint64_t *drop,
                         uint64_t ndrop, uint64_t *removed);
