/* mu_scan.c: STUB, to be replaced by the mark implementation. */
#include "mu_core_impl.h"
int64_t mu_mark(const uint64_t *begin, const uint64_t *size, uint64_t n,
                const mu_region *heap, uint64_t nheap,
                const mu_region *roots, uint64_t nroots,
                const uint64_t *words, uint64_t nwords,
                uint8_t *marked, mu_mark_stats *stats) { return -ENOSYS; }
