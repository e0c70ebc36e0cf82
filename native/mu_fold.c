/* mu_fold.c: STUB, to be replaced by the fold implementation. */
#include "mu_core_impl.h"
int64_t mu_fold(const uint64_t *begin, const uint64_t *size, uint64_t n,
                const mu_region *heap, uint64_t nheap, const uint8_t *marked,
                uint64_t *rep, uint64_t *ref_count, uint64_t *ref_size, uint64_t cap) { return -ENOSYS; }
