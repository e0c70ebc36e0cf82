/* mu_walk.c: the glibc chunk walker (our malloc_iterate): hot loops over local copies of
 * heap memory. Layout policy (where runs start, which offsets) lives in memunreachable/glibc. */
#include "mu_core_impl.h"

#define CHUNK_PREV_INUSE 1u
#define CHUNK_IS_MMAPPED 2u
#define CHUNK_NON_MAIN 4u
#define CHUNK_FLAGS 7u
#define CHUNK_MINSIZE 32u
#define CHUNK_FENCE 16u
#define MU_WALK_PREFETCH 4096u

static inline uint64_t ld64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

int64_t mu_walk_run(const uint8_t *data, uint64_t base, uint64_t len, uint64_t first, uint64_t top,
                    uint32_t non_main, uint64_t *user, uint64_t *usable, uint64_t cap,
                    mu_walk_result *res)
{
    if (!data || !res || (cap && (!user || !usable)) || first < base || (first & 15))
        return -EINVAL;
    memset(res, 0, sizeof *res);
    const uint64_t lim = base + len;
    uint64_t c = first, stored = 0;
    uint64_t last_in_use = 0;   /* chunk address of the last chunk counted in use */
    uint64_t last_size = 0;
    for (;;) {
        if (top && c == top) {
            if (c + 16 > lim) {
                res->status = MU_WALK_TRUNCATED;
                res->bad_at = c;
                break;
            }
            uint64_t ts = ld64(data + (c - base) + 8) & ~(uint64_t)CHUNK_FLAGS;
            if (ts < 16 || c + ts > lim) {
                res->status = MU_WALK_BAD_SIZE;
                res->bad_at = c;
                break;
            }
            res->status = MU_WALK_TOP;
            res->end = c + ts;
            break;
        }
        if (top && c > top && c - last_size < top) {
            res->status = MU_WALK_PAST_TOP;
            res->bad_at = c - last_size;
            break;
        }
        if (c + 16 > lim) {
            res->status = MU_WALK_TRUNCATED;
            res->bad_at = c;
            break;
        }
        const uint8_t *h = data + (c - base);
        /* The chain is a dependent load per chunk: prefetch ahead of the (ascending) walk. */
        if (c + MU_WALK_PREFETCH < lim)
            __builtin_prefetch(h + MU_WALK_PREFETCH);
        uint64_t sz = ld64(h + 8);
        uint64_t s = sz & ~(uint64_t)CHUNK_FLAGS;
        if (s == 0) {
            /* {0|1}: a non-main heap's end; the chunk right before is a pseudo chunk. */
            if (last_in_use && last_in_use + last_size == c) {
                res->in_use--;
                res->in_use_bytes -= last_size;
                res->chunks--;
                if (stored && stored <= cap && user[stored - 1] == last_in_use + 16)
                    stored--;
            }
            res->status = MU_WALK_FENCE0;
            res->end = c + 16;
            break;
        }
        if (s == CHUNK_FENCE) {
            if (c + 32 > lim) {
                res->status = MU_WALK_TRUNCATED;
                res->bad_at = c;
                break;
            }
            uint64_t nsz = ld64(h + 24);
            if ((nsz & ~(uint64_t)CHUNK_FLAGS) == CHUNK_FENCE && !non_main) {
                uint64_t e = c + 32;
                /* an old top smaller than MINSIZE leaves a third 0x10 header */
                while (e + 16 <= lim && ld64(data + (e - base) + 8) == (CHUNK_FENCE | CHUNK_PREV_INUSE))
                    e += 16;
                res->status = MU_WALK_FENCE2;
                res->end = e;
                break;
            }
            if (nsz == 0 || nsz == CHUNK_PREV_INUSE) {
                res->status = MU_WALK_FENCE0;
                res->end = c + 32;
                break;
            }
            res->status = MU_WALK_BAD_SIZE;
            res->bad_at = c;
            break;
        }
        if ((sz & 8) || s < CHUNK_MINSIZE || c + s + 16 > lim) {
            res->status = MU_WALK_BAD_SIZE;
            res->bad_at = c;
            break;
        }
        if (sz & CHUNK_IS_MMAPPED) {
            res->status = MU_WALK_BAD_FLAGS;
            res->bad_at = c;
            break;
        }
        uint64_t next = ld64(h + s + 8);
        res->chunks++;
        if (next & CHUNK_PREV_INUSE) {
            /* the pseudo chunk before a {0|1} fencepost has no NON_MAIN_ARENA (arena.c) */
            if (((sz & CHUNK_NON_MAIN) != 0) != (non_main != 0) &&
                (next & ~(uint64_t)CHUNK_FLAGS) != 0) {
                res->status = MU_WALK_BAD_FLAGS;
                res->bad_at = c;
                break;
            }
            res->in_use++;
            res->in_use_bytes += s;
            if (stored < cap) {
                user[stored] = c + 16;
                usable[stored] = s - 8;
                stored++;
            }
            last_in_use = c;
        } else {
            res->free_chunks++;
            res->free_bytes += s;
            last_in_use = 0;
        }
        last_size = s;
        c += s;
    }
    return (int64_t)(stored < cap ? stored : cap);
}

int64_t mu_walk_find_headers(const uint8_t *data, uint64_t base, uint64_t len, uint64_t step,
                             uint64_t flags, uint64_t min_size, uint64_t align,
                             uint64_t *out, uint64_t cap)
{
    if (!data || step < 16 || (step & (step - 1)) || !align || (align & (align - 1)))
        return -EINVAL;
    uint64_t p = (base + step - 1) & ~(step - 1), n = 0;
    for (; p + 16 <= base + len; p += step) {
        const uint8_t *h = data + (p - base);
        if (ld64(h) != 0)
            continue;
        uint64_t sz = ld64(h + 8);
        uint64_t s = sz & ~(uint64_t)CHUNK_FLAGS;
        if ((sz & CHUNK_FLAGS) != flags || s < min_size || (s & (align - 1)))
            continue;
        if (n < cap)
            out[n] = p;
        n++;
    }
    return (int64_t)n;
}

int64_t mu_walk_mmapped(const uint8_t *data, uint64_t base, uint64_t len, uint64_t page,
                        uint64_t *user, uint64_t *usable, uint64_t cap, mu_mmap_result *res)
{
    if (!data || !res || page < 4096 || (page & (page - 1)) || (base & (page - 1)) ||
        (cap && (!user || !usable)))
        return -EINVAL;
    memset(res, 0, sizeof *res);
    uint64_t stored = 0, off = 0;
    while (off + 16 <= len) {
        const uint8_t *h = data + off;
        uint64_t sz = ld64(h + 8);
        uint64_t s = sz & ~(uint64_t)CHUNK_FLAGS;
        if (ld64(h) != 0 || (sz & CHUNK_FLAGS) != CHUNK_IS_MMAPPED || s < 4096 || (s & 4095) ||
            s > len - off) {
            off += page;
            continue;
        }
        /* The stale memalign header: the first non-zero word after it is the moved prev_size. */
        uint64_t chunk = off, csize = s;
        uint64_t o = 16;
        while (o + 16 <= s && ld64(h + o) == 0)
            o += 8;
        if (o >= 32 && !(o & 15) && o + 16 <= s && ld64(h + o) == o &&
            ld64(h + o + 8) == ((s - o) | CHUNK_IS_MMAPPED)) {
            chunk = off + o;
            csize = s - o;
            res->moved++;
        }
        res->found++;
        res->bytes += s;
        if (stored < cap) {
            user[stored] = base + chunk + 16;
            usable[stored] = csize - 16;
            stored++;
        }
        off += s;
    }
    return (int64_t)stored;
}

/* Index of the region holding [addr, addr+n), or -1. */
static int64_t region_find(const mu_region *r, uint64_t nr, uint64_t addr, uint64_t n)
{
    uint64_t lo = 0, hi = nr;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (r[mid].base + r[mid].len <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < nr && r[lo].base <= addr && addr + n <= r[lo].base + r[lo].len && addr + n >= addr)
        return (int64_t)lo;
    return -1;
}

static inline int region_word(const mu_region *r, uint64_t nr, uint64_t addr, uint64_t *v)
{
    int64_t i = region_find(r, nr, addr, 8);
    if (i < 0)
        return -1;
    *v = ld64(r[i].data + (addr - r[i].base));
    return 0;
}

int64_t mu_walk_chain(const mu_region *regions, uint64_t nregions, uint64_t head, uint64_t bias,
                      uint32_t mangled, uint64_t chunk_size, uint64_t max_nodes,
                      uint64_t *out, uint64_t cap, int64_t *status)
{
    if (!regions || !status || (cap && !out))
        return -EINVAL;
    uint64_t n = 0;
    uint64_t node = head ? head + bias : 0;
    *status = MU_CHAIN_NULL;
    while (node) {
        if (n > max_nodes) {
            *status = MU_CHAIN_LONG;
            break;
        }
        uint64_t sz, nexthdr, link;
        if ((node & 15) || node < 16 ||
            region_word(regions, nregions, node - 8, &sz) ||
            (sz & ~(uint64_t)CHUNK_FLAGS) != chunk_size ||
            region_word(regions, nregions, node - 16 + chunk_size + 8, &nexthdr) ||
            !(nexthdr & CHUNK_PREV_INUSE) ||
            region_word(regions, nregions, node, &link)) {
            *status = MU_CHAIN_BAD;
            break;
        }
        if (n < cap)
            out[n] = node;
        n++;
        if (mangled)
            link ^= node >> 12;
        node = link ? link + bias : 0;
    }
    return (int64_t)n;
}

int64_t mu_walk_bin(const mu_region *regions, uint64_t nregions, uint64_t bin, uint64_t max_nodes,
                    uint64_t *nodes, uint64_t *bytes, uint64_t *bit_free)
{
    if (!regions || !nodes || !bytes || !bit_free)
        return -EINVAL;
    *nodes = *bytes = *bit_free = 0;
    uint64_t prev = bin, cur;
    if (region_word(regions, nregions, bin + 16, &cur))
        return 1;
    while (cur != bin) {
        uint64_t bk, sz, nexthdr;
        if (*nodes >= max_nodes || (cur & 15) || region_word(regions, nregions, cur + 24, &bk) ||
            bk != prev || region_word(regions, nregions, cur + 8, &sz) ||
            (sz & ~(uint64_t)CHUNK_FLAGS) < CHUNK_MINSIZE)
            return 1;
        uint64_t s = sz & ~(uint64_t)CHUNK_FLAGS;
        (*nodes)++;
        *bytes += s;
        if (!region_word(regions, nregions, cur + s + 8, &nexthdr) && !(nexthdr & CHUNK_PREV_INUSE))
            (*bit_free)++;
        prev = cur;
        if (region_word(regions, nregions, cur + 16, &cur))
            return 1;
    }
    return 0;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

int64_t mu_walk_subtract(uint64_t *user, uint64_t *usable, uint64_t n, uint64_t *drop,
                         uint64_t ndrop, uint64_t *removed)
{
    if ((n && (!user || !usable)) || (ndrop && !drop) || !removed)
        return -EINVAL;
    *removed = 0;
    if (ndrop > 1)
        qsort(drop, ndrop, sizeof *drop, cmp_u64);
    uint64_t w = 0, j = 0;
    for (uint64_t i = 0; i < n; i++) {
        while (j < ndrop && drop[j] < user[i])
            j++;
        if (j < ndrop && drop[j] == user[i]) {
            (*removed)++;
            while (j < ndrop && drop[j] == user[i])
                j++;
            continue;
        }
        user[w] = user[i];
        usable[w] = usable[i];
        w++;
    }
    return (int64_t)w;
}
