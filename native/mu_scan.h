/* mu_scan.h: conservative mark over allocations (libmemunreachable.md section 3). */

typedef struct {
    uint64_t root_bytes;     /* bytes of root ranges scanned */
    uint64_t heap_bytes;     /* bytes of reached allocations scanned */
    uint64_t words;          /* 8-byte words examined in total */
    uint64_t marked;         /* allocations reached */
} mu_mark_stats;

/* Allocations: begin[] strictly ascending, size[] usable sizes (a size of 0 counts as 1 byte),
 * non-overlapping, so allocation i covers [begin[i], begin[i] + max(size[i], 1)).
 * heap[]: regions (sorted by base, disjoint) whose data holds the bytes of every allocation.
 * roots[]: memory scanned as roots, in order; words[]: root values (registers, fs_base, ...).
 * Word scan: start rounded up to 8, 8-byte steps, interior pointers count, one-past-end does not.
 * marked[i] is set to 1 for every allocation reachable from a root (iterative worklist).
 * Returns the number of marked allocations, or -EINVAL (unsorted/overlapping input, or an
 * allocation not inside any heap region) or -ENOMEM. */
int64_t mu_mark(const uint64_t *begin, const uint64_t *size, uint64_t n,
                const mu_region *heap, uint64_t nheap,
                const mu_region *roots, uint64_t nroots,
                const uint64_t *words, uint64_t nwords,
                uint8_t *marked, mu_mark_stats *stats);
