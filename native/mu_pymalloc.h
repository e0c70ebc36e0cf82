/* mu_pymalloc.h: CPython's pymalloc (Objects/obmalloc.c) seen as an allocator: pools -> blocks.
 * The pool header (48 bytes: count u32 +0, freeblock +8, nextpool +16, prevpool +24,
 * arenaindex u32 +32, szidx u32 +36, nextoffset u32 +40, maxnextoffset u32 +44) and the block
 * sizes 16*(szidx+1), szidx < 32, are the same in CPython 3.8-3.13 (cpython-memory.md section 2);
 * pool sizes come from memunreachable/heaps/cpython/layout.py. */

/* Why mu_pymalloc_blocks rejected a pool (mu_pymalloc_result.bad_reason). */
enum {
    MU_POOL_OK = 0,
    MU_POOL_HEADER = 1,     /* header fails the structural checks */
    MU_POOL_CHAIN = 2,      /* freeblock chain leaves the carved blocks, is misaligned or loops */
    MU_POOL_COUNT = 3,      /* carved blocks - chain length != ref.count */
    MU_POOL_OUTSIDE = 4     /* the pool is not inside the buffer, or pools not ascending */
};

typedef struct {
    uint64_t pools;         /* pools with at least one used block */
    uint64_t empty_pools;   /* pools with ref.count == 0 (their blocks are all free) */
    uint64_t used;          /* used blocks (may exceed cap) */
    uint64_t used_bytes;    /* their sizes summed */
    uint64_t free_blocks;   /* blocks on freeblock chains of non-empty pools */
    uint64_t virgin_blocks; /* never-carved blocks (offset >= nextoffset) of non-empty pools */
    uint64_t bad_pools;     /* pools rejected (not walked) */
    uint64_t bad_at;        /* address of the first rejected pool */
    int64_t bad_reason;     /* MU_POOL_* of the first rejected pool */
} mu_pymalloc_result;

/* Scan data[0 .. len) (a copy of [base, base+len)) at every pool_size-aligned address p with
 * [p, p+48) inside the buffer for headers that hold (cpython-memory.md section 2): szidx < 32;
 * the 4 bytes after count are 0; maxnextoffset == pool_size - 16*(szidx+1);
 * 48 <= nextoffset <= pool_size and (nextoffset-48) % size == 0;
 * count <= (nextoffset-48)/size; freeblock 0 or a block boundary in [p+48, p+nextoffset).
 * pool_size: a power of two, 4096..65536. Stores up to cap pool addresses (ascending).
 * Returns the number found (may exceed cap); -EINVAL on bad arguments. */
int64_t mu_pymalloc_find_pools(const uint8_t *data, uint64_t base, uint64_t len, uint64_t pool_size,
                               uint64_t *out, uint64_t cap);

/* Walk the pools pools[0 .. npools) (ascending, each [p, p+pool_size) inside the copy
 * data[0 .. len) of [base, base+len)). A pool with ref.count 0 is empty. In a non-empty pool the
 * carved blocks are [p+48, p+nextoffset) by size; the freeblock chain (first word of each free
 * block -> next, NULL-terminated) must stay on distinct carved blocks and leave exactly
 * ref.count used blocks, else the pool is rejected (counted in res, nothing stored for it).
 * Stores each used block's address and size, ascending, while fewer than cap were stored.
 * Returns the number stored (min(res->used, cap)); -EINVAL on bad arguments. */
int64_t mu_pymalloc_blocks(const uint8_t *data, uint64_t base, uint64_t len, uint64_t pool_size,
                           const uint64_t *pools, uint64_t npools, uint64_t *addr, uint64_t *size,
                           uint64_t cap, mu_pymalloc_result *res);

/* The blocks among addr[0 .. n) (ascending, inside the copy data[0 .. len) of [base, base+len))
 * whose first word is a short C string written over a free block's link: 1-4 printable bytes,
 * a NUL, and after it the block's own address bytes (a free block's first word links to a
 * block of its pool; the string kept the link's high bytes), and not 8-aligned (an object's
 * address never is dismissed). Such a word reads as an address in the same arena: ctypes'
 * type format strings ("<?", "<Q": 16-byte blocks) held 8 of the 1,000 ints of a leaked list
 * "reachable" in 1 of about 1,200 runs (3.8, MEMUNREACHABLE_EXPLAIN). Stores up to cap of
 * their addresses in out; returns how many there are; -EINVAL on bad arguments. */
int64_t mu_pymalloc_text_heads(const uint8_t *data, uint64_t base, uint64_t len,
                               const uint64_t *addr, uint64_t n, uint64_t *out, uint64_t cap);
