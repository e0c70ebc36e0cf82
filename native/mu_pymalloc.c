/* mu_pymalloc.c: pymalloc pools -> used blocks (see mu_pymalloc.h). Never prints. */
#include "mu_core_impl.h"

#define HDR 48u
#define STEP 16u
#define NCLASSES 32u
#define MAX_POOL 65536u

static int bad_pool_size(uint64_t pool_size)
{
    return pool_size < 4096 || pool_size > MAX_POOL || (pool_size & (pool_size - 1));
}

/* 1 when the 48-byte header h of the pool at address p passes the structural checks. */
static int header_ok(const uint8_t *h, uint64_t p, uint64_t pool_size)
{
    uint32_t count = mu_ld32(h + 0), pad = mu_ld32(h + 4), szidx = mu_ld32(h + 36);
    uint32_t nextoffset = mu_ld32(h + 40), maxnext = mu_ld32(h + 44);
    uint64_t freeblock = mu_ld64(h + 8), size;
    if (szidx >= NCLASSES || pad != 0)
        return 0;
    size = STEP * (szidx + 1);
    if (maxnext != pool_size - size)
        return 0;
    if (nextoffset < HDR || nextoffset > pool_size || (nextoffset - HDR) % size)
        return 0;
    if (count > (nextoffset - HDR) / size)
        return 0;
    if (freeblock) {
        if (freeblock < p + HDR || freeblock >= p + nextoffset || (freeblock - p - HDR) % size)
            return 0;
    }
    return 1;
}

int64_t mu_pymalloc_find_pools(const uint8_t *data, uint64_t base, uint64_t len, uint64_t pool_size,
                               uint64_t *out, uint64_t cap)
{
    uint64_t p, found = 0;
    if (!data || bad_pool_size(pool_size) || (cap && !out))
        return -EINVAL;
    p = (base + pool_size - 1) & ~(pool_size - 1);
    for (; p >= base && p - base + HDR <= len; p += pool_size) {
        if (header_ok(data + (p - base), p, pool_size)) {
            if (found < cap)
                out[found] = p;
            found++;
        }
    }
    return (int64_t)found;
}

static void reject(mu_pymalloc_result *res, uint64_t p, int64_t why)
{
    if (res->bad_pools++ == 0) {
        res->bad_at = p;
        res->bad_reason = why;
    }
}

int64_t mu_pymalloc_blocks(const uint8_t *data, uint64_t base, uint64_t len, uint64_t pool_size,
                           const uint64_t *pools, uint64_t npools, uint64_t *addr, uint64_t *size,
                           uint64_t cap, mu_pymalloc_result *res)
{
    uint8_t freemap[MAX_POOL / STEP / 8];
    uint64_t i, stored = 0, prev_end = 0;
    if (!data || !res || bad_pool_size(pool_size) || (npools && !pools) || (cap && (!addr || !size)))
        return -EINVAL;
    memset(res, 0, sizeof(*res));
    for (i = 0; i < npools; i++) {
        uint64_t p = pools[i], bsize, carved, nfree = 0, fb, off, steps = 0;
        const uint8_t *h;
        uint32_t count, nextoffset;
        if (i + 2 < npools && pools[i + 2] - base < len)      /* its header, ahead */
            __builtin_prefetch(data + (pools[i + 2] - base));
        if (p < base || p - base > len || len - (p - base) < pool_size || p < prev_end) {
            reject(res, p, MU_POOL_OUTSIDE);
            continue;
        }
        prev_end = p + pool_size;
        h = data + (p - base);
        if (!header_ok(h, p, pool_size)) {
            reject(res, p, MU_POOL_HEADER);
            continue;
        }
        count = mu_ld32(h + 0);
        if (count == 0) {
            res->empty_pools++;
            continue;
        }
        bsize = STEP * (mu_ld32(h + 36) + 1);
        nextoffset = mu_ld32(h + 40);
        carved = (nextoffset - HDR) / bsize;
        memset(freemap, 0, (carved + 7) / 8);
        fb = mu_ld64(h + 8);
        while (fb) {
            uint64_t k;
            if (fb < p + HDR || fb >= p + nextoffset || (fb - p - HDR) % bsize || ++steps > carved)
                break;
            k = (fb - p - HDR) / bsize;
            if (freemap[k >> 3] & (1u << (k & 7)))
                break;
            freemap[k >> 3] |= (uint8_t)(1u << (k & 7));
            nfree++;
            fb = mu_ld64(data + (fb - base));
        }
        if (fb) {
            reject(res, p, MU_POOL_CHAIN);
            continue;
        }
        if (carved - nfree != count) {
            reject(res, p, MU_POOL_COUNT);
            continue;
        }
        res->pools++;
        res->free_blocks += nfree;
        res->virgin_blocks += (pool_size - nextoffset) / bsize;
        res->used += count;
        res->used_bytes += count * bsize;
        for (off = 0; off < carved; off++) {
            if (freemap[off >> 3] & (1u << (off & 7)))
                continue;
            if (stored < cap) {
                addr[stored] = p + HDR + off * bsize;
                size[stored] = bsize;
                stored++;
            }
        }
    }
    return (int64_t)stored;
}

int64_t mu_pymalloc_text_heads(const uint8_t *data, uint64_t base, uint64_t len,
                               const uint64_t *addr, uint64_t n, uint64_t *out, uint64_t cap)
{
    int64_t found = 0;
    if (!data || (n && !addr) || (cap && !out))
        return -EINVAL;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t b = addr[i];
        /* a block's first word is most often its only load: wait for it ahead */
        if (i + 16 < n && addr[i + 16] - base < len)
            __builtin_prefetch(data + (addr[i + 16] - base));
        if (b < base || b - base > len || len - (b - base) < 8)
            continue;
        uint64_t v = mu_ld64(data + (b - base));
        if (!mu_tail_shape(v))
            continue;
        unsigned k = mu_first_nul(v);
        if (k > 4 || ((v ^ b) >> (8 * (k + 1))))
            continue;
        if ((uint64_t)found < cap)
            out[found] = b;
        found++;
    }
    return found;
}
