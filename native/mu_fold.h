/* mu_fold.h: fold unreachable allocations into leak entries (libmemunreachable.md section 5, [ours]). */

/* Inputs as for mu_mark; marked[i] == 0 means allocation i is unreachable (a leak).
 * Builds the leak graph (edges: words of a leak that point, interior included, into another leak),
 * runs an iterative Tarjan SCC, and emits one entry per head SCC (no incoming edge from another
 * leaked SCC): rep[k] = index of its lowest-address member; ref_count[k] / ref_size[k] = number /
 * summed sizes of every other unreachable allocation reachable from that SCC (its other members
 * included; shared descendants are counted under each head). Entries are ordered by rep.
 * cap must be >= the number of unreachable allocations.
 * Returns the number of entries, or -EINVAL (as mu_mark; the allocations are not checked when
 * none is unreachable: the mark of the same input did), -EOVERFLOW (n >= 2^32 - 1),
 * -ENOMEM, or -ENOSPC (more entries than cap). dead: words that are not edges (mu_dead), or NULL.
 * owner (n slots, or NULL): owner[i] = the entry that lists unreachable allocation i, the first
 * (by rep) whose head reaches it, so each is counted in exactly one entry; UINT64_MAX for a
 * reachable one. */
int64_t mu_fold(const uint64_t *begin, const uint64_t *size, uint64_t n,
                const mu_region *heap, uint64_t nheap, const uint8_t *marked,
                uint64_t *rep, uint64_t *ref_count, uint64_t *ref_size, uint64_t cap,
                const mu_dead *dead, uint64_t *owner);

/* The selected ones of n allocations: mask[i] != 0 (mask: n bytes), or mask[i] == 0 when
 * zero != 0 (the mark's flags: the unmarked ones). *selected gets the sum of their size[]
 * (read only for them). Returns how many there are. (The sum of every size: the mark's
 * size_total.) */
int64_t mu_sum_sizes(const uint64_t *size, const uint8_t *mask, uint64_t n, uint32_t zero,
                     uint64_t *selected);
