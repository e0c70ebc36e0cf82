/* mu_cpython.c: array passes of the CPython pipeline stage (see mu_cpython.h). */
#include "mu_core_impl.h"

static int in_spans(const uint64_t *spans, uint64_t nspans, uint64_t *k, uint64_t addr)
{
    if (!spans)
        return 1;
    while (*k < nspans && spans[2 * *k + 1] <= addr)
        (*k)++;
    return *k < nspans && spans[2 * *k] <= addr;
}

int64_t mu_merge_blocks(const uint64_t *a_begin, const uint64_t *a_size, uint64_t na,
                        const uint64_t *b_begin, const uint64_t *b_size, uint64_t nb,
                        const uint64_t *spans, uint64_t nspans,
                        const uint64_t *drop, uint64_t ndrop,
                        uint64_t *out_begin, uint64_t *out_size, uint64_t cap,
                        mu_merge_stats *stats)
{
    if ((na && (!a_begin || !a_size)) || (nb && (!b_begin || !b_size)) ||
        (ndrop && !drop) || !stats || (cap && (!out_begin || !out_size)))
        return -EINVAL;
    stats->removed = 0;
    stats->overlap_at = 0;
    uint64_t i = 0, j = 0, ka = 0, kb = 0, d = 0, w = 0;
    uint64_t prev_end = 0;
    int prev_src = -1;
    while (i < na || j < nb) {
        int src;
        uint64_t begin, size;
        if (j >= nb || (i < na && a_begin[i] <= b_begin[j])) {
            src = 0;
            begin = a_begin[i];
            size = a_size[i++];
            if (!in_spans(spans, nspans, &ka, begin))
                continue;
        } else {
            src = 1;
            begin = b_begin[j];
            size = b_size[j++];
            if (!in_spans(spans, nspans, &kb, begin))
                continue;
        }
        if (prev_src >= 0 && prev_src != src && prev_end > begin) {
            stats->overlap_at = begin;
            return -ERANGE;
        }
        prev_src = src;
        prev_end = begin + (size ? size : 1);
        while (d < ndrop && drop[d] < begin)
            d++;
        if (d < ndrop && drop[d] == begin) {
            stats->removed++;
            while (d < ndrop && drop[d] == begin)
                d++;
            continue;
        }
        if (w >= cap)
            return -ENOSPC;
        out_begin[w] = begin;
        out_size[w] = size;
        w++;
    }
    return (int64_t)w;
}

int64_t mu_pools_overlapping(const uint64_t *blocks, uint64_t n, uint64_t pool_size,
                             const uint64_t *g_begin, const uint64_t *g_size, uint64_t gn,
                             uint64_t *out, uint64_t cap)
{
    if (!pool_size || (n && !blocks) || (gn && (!g_begin || !g_size)) || (cap && !out))
        return -EINVAL;
    uint64_t found = 0, g = 0, last = 0;
    int have = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t p = blocks[i] - blocks[i] % pool_size;
        if (have && p == last)
            continue;
        have = 1;
        last = p;
        while (g < gn && g_begin[g] < p + pool_size)    /* g: first beginning at or after the end */
            g++;
        if (g && g_begin[g - 1] + (g_size[g - 1] ? g_size[g - 1] : 1) > p) {
            if (found < cap)
                out[found] = p;
            found++;
        }
    }
    return (int64_t)found;
}
