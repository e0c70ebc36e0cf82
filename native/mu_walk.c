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

static inline int region_word(const mu_region *r, uint64_t nr, uint64_t addr, uint64_t *v)
{
    int64_t i = mu_region_find(r, nr, addr, 8);
    if (i < 0)
        return -1;
    *v = ld64(r[i].data + (addr - r[i].base));
    return 0;
}

/* Index of u in the ascending user[0 .. n), or -1. */
static int64_t find_user(const uint64_t *user, uint64_t n, uint64_t u)
{
    uint64_t lo = 0, hi = n;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (user[mid] < u)
            lo = mid + 1;
        else
            hi = mid;
    }
    return (lo < n && user[lo] == u) ? (int64_t)lo : -1;
}

/* MU_LINK_* verdict on node; on MU_LINK_OK *link gets the raw word at node. */
static int64_t check_node(const mu_region *regions, uint64_t nregions, const uint64_t *user,
                          const uint64_t *usable, uint64_t n, uint64_t node, uint64_t chunk_size,
                          uint32_t arena, uint64_t *link)
{
    if (node & 15)
        return MU_LINK_MISALIGNED;
    int64_t i = find_user(user, n, node);
    if (i < 0)
        return MU_LINK_NOT_CHUNK;
    if (usable[i] + 8 != chunk_size)
        return MU_LINK_WRONG_SIZE;
    if (arena) {
        uint64_t sz;
        if (region_word(regions, nregions, node - 8, &sz))
            return MU_LINK_UNREADABLE;
        if (((sz & CHUNK_NON_MAIN) != 0) != (arena == 2))
            return MU_LINK_WRONG_ARENA;
    }
    if (region_word(regions, nregions, node, link))
        return MU_LINK_UNREADABLE;
    return MU_LINK_OK;
}

static inline uint64_t decode_link(uint64_t node, uint64_t link, uint32_t mangled, uint64_t bias)
{
    if (mangled)
        link ^= node >> 12;
    return link ? link + bias : 0;
}

int64_t mu_walk_chain(const mu_region *regions, uint64_t nregions, const uint64_t *user,
                      const uint64_t *usable, uint64_t n, uint64_t head, uint64_t bias,
                      uint32_t mangled, uint64_t chunk_size, uint32_t arena, uint64_t max_nodes,
                      uint64_t *out, uint64_t cap, mu_chain_result *res)
{
    if (!regions || !res || (cap && !out) || (n && (!user || !usable)) || arena > 2)
        return -EINVAL;
    memset(res, 0, sizeof *res);
    uint64_t node = head ? head + bias : 0, k = 0, link = 0;
    uint64_t saved = 0, s = 0, power = 1, prev = 0;     /* Brent's cycle finder */
    for (; node; k++) {
        if (saved && node == saved) {
            /* node k repeats node s: a cycle of length lam; mu nodes lead into it */
            uint64_t lam = k - s, mu = 0, p = head + bias, q = p;
            for (uint64_t j = 0; j < lam; j++) {
                region_word(regions, nregions, q, &link);
                q = decode_link(q, link, mangled, bias);
            }
            while (p != q) {
                region_word(regions, nregions, p, &link);
                p = decode_link(p, link, mangled, bias);
                region_word(regions, nregions, q, &link);
                q = decode_link(q, link, mangled, bias);
                mu++;
            }
            k = mu + lam;
            res->status = MU_CHAIN_CYCLE;
            res->bad = p;
            res->last = k <= cap ? out[k - 1] : prev;
            if (k > cap) {   /* walk to the last distinct node */
                uint64_t t = head + bias;
                for (uint64_t j = 1; j < k; j++) {
                    region_word(regions, nregions, t, &link);
                    t = decode_link(t, link, mangled, bias);
                }
                res->last = t;
            }
            break;
        }
        if (k >= max_nodes) {
            res->status = MU_CHAIN_LONG;
            res->last = prev;
            res->bad = node;
            break;
        }
        int64_t why = check_node(regions, nregions, user, usable, n, node, chunk_size, arena, &link);
        if (why != MU_LINK_OK) {
            res->status = MU_CHAIN_BAD;
            res->reason = why;
            res->last = prev;
            res->bad = node;
            break;
        }
        if (k < cap)
            out[k] = node;
        if (!saved || k - s == power) {
            if (saved)
                power <<= 1;
            saved = node;
            s = k;
        }
        prev = node;
        node = decode_link(node, link, mangled, bias);
    }
    if (res->status == MU_CHAIN_NULL)
        res->last = prev;
    res->nodes = k;
    return (int64_t)k;
}

int64_t mu_walk_tcache_scan(const mu_region *regions, uint64_t nregions, const uint64_t *user,
                            const uint64_t *usable, uint64_t n, uint64_t struct_usable,
                            uint32_t count_width, uint64_t entries_off, uint64_t nbins,
                            uint64_t active_bins, uint64_t max_count, uint64_t key_off,
                            uint64_t want_key, mu_tcache_cand *out, uint64_t cap)
{
    if (!regions || (n && (!user || !usable)) || (cap && !out) || (count_width != 1 && count_width != 2) ||
        entries_off < count_width * nbins)
        return -EINVAL;
    uint64_t found = 0;
    const uint64_t span = entries_off + 8 * nbins;
    for (uint64_t i = 0; i < n; i++) {
        if (usable[i] != struct_usable)
            continue;
        uint64_t addr = user[i];
        int64_t r = mu_region_find(regions, nregions, addr, span);
        if (r < 0)
            continue;
        const uint8_t *p = regions[r].data + (addr - regions[r].base);
        int ok = 1;
        for (uint64_t b = 0; b < nbins && ok; b++) {
            uint64_t c = count_width == 1 ? p[b] : (uint64_t)p[2 * b] | ((uint64_t)p[2 * b + 1] << 8);
            if (c > max_count || (b >= active_bins && c))
                ok = 0;
        }
        if (!ok)
            continue;
        mu_tcache_cand cd;
        memset(&cd, 0, sizeof cd);
        cd.addr = addr;
        for (uint64_t b = 0; b < nbins; b++) {
            uint64_t c = count_width == 1 ? p[b] : (uint64_t)p[2 * b] | ((uint64_t)p[2 * b + 1] << 8);
            uint64_t e = ld64(p + entries_off + 8 * b), kv;
            if ((c == 0) != (e == 0))
                cd.mismatched++;
            if (!c)
                continue;
            cd.nonempty++;
            if (!e || (e & 15))
                continue;
            int64_t j = find_user(user, n, e);
            if (j < 0 || usable[j] + 8 != CHUNK_MINSIZE + 16 * b ||
                region_word(regions, nregions, e + key_off, &kv))
                continue;
            cd.heads++;
            if (cd.heads == 1)
                cd.key = kv;
            cd.want_key += want_key && kv == want_key;
            cd.self_key += kv == addr;
        }
        if (!cd.heads || (want_key && !cd.want_key))
            continue;
        if (found < cap)
            out[found] = cd;
        found++;
    }
    return (int64_t)found;
}

int64_t mu_walk_bin(const mu_region *regions, uint64_t nregions, uint64_t bin, uint64_t max_nodes,
                    uint64_t *nodes, uint64_t *bytes, uint64_t *bit_free, uint64_t *bad_at)
{
    if (!regions || !nodes || !bytes || !bit_free || !bad_at)
        return -EINVAL;
    *nodes = *bytes = *bit_free = *bad_at = 0;
    uint64_t prev = bin, cur;
    if (region_word(regions, nregions, bin + 16, &cur)) {
        *bad_at = bin;
        return 1;
    }
    while (cur != bin) {
        uint64_t bk, sz, nexthdr;
        if (*nodes >= max_nodes || (cur & 15) || region_word(regions, nregions, cur + 24, &bk) ||
            bk != prev || region_word(regions, nregions, cur + 8, &sz) ||
            (sz & ~(uint64_t)CHUNK_FLAGS) < CHUNK_MINSIZE) {
            *bad_at = cur;
            return 1;
        }
        uint64_t s = sz & ~(uint64_t)CHUNK_FLAGS;
        (*nodes)++;
        *bytes += s;
        if (!region_word(regions, nregions, cur + s + 8, &nexthdr) && !(nexthdr & CHUNK_PREV_INUSE))
            (*bit_free)++;
        prev = cur;
        if (region_word(regions, nregions, cur + 16, &cur)) {
            *bad_at = prev;
            return 1;
        }
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
