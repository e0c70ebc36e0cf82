/* mu_walk.c: the glibc chunk walker (our malloc_iterate): hot loops over local copies of
 * heap memory. Layout policy (where runs start, which offsets) lives in memunreachable/heaps/glibc. */
#include "mu_core_impl.h"
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#define CHUNK_PREV_INUSE 1u
#define CHUNK_IS_MMAPPED 2u
#define CHUNK_NON_MAIN 4u
#define CHUNK_FLAGS 7u
#define CHUNK_MINSIZE 32u
#define CHUNK_FENCE 16u
#define MU_WALK_PREFETCH 4096u

/* Where a walk stands: it can stop when the next step needs bytes not copied yet, and go on
 * later from here (mu_read_walk). */
typedef struct {
    uint64_t c, stored, last_in_use, last_size, rec_stored;
} walk_pos;

/* Where a walk keeps the words of free-list nodes (mu_read_job.rec), or NULL. */
typedef struct {
    uint64_t *out, cap, lo, hi, max;
    uint32_t mangled;
} walk_rec;

/* mu_read_walk reads a dropped job's pieces (MU_READ_DROP) into a ring of RW_RING slots of
 * 1 MiB, piece r of the dropped jobs' pieces into slot r % RW_RING, instead of into the
 * job's buffer: into memory already mapped and still in the CPU's caches, not into fresh
 * pages faulted in, zeroed and given back (over 256 MiB: 85 ms of mu_read_walk that way, 49 ms
 * reading into reused buffers). A slot takes its pieces in order, each once the walk is past
 * the one before it, so every piece from the walk's position on stays in the ring while the
 * walk needs it, and the walk never needs a piece RW_RING - 1 or more past the one it stands
 * in: the size of the chunk after a larger chunk is read from the snapshot apart
 * (walk_ring.fd), fenceposts once the 4 KiB after them are read. */
#define RW_PIECE (1ull << 20)
#define RW_RING 8u
#define FENCE_RUN_MAX 4096u     /* the bytes of fenceposts a ring walk looks at, at most */

typedef struct {
    const uint8_t *slots;       /* RW_RING * RW_PIECE bytes */
    uint64_t piece0;            /* the job's first piece's number among the ring's pieces */
    int fd;                     /* the snapshot's memory, for the size after a large chunk */
} walk_ring;

/* The byte at address a of a walk over data (a copy of [base, ...)) or, with a ring, over
 * the ring's piece that holds it. */
static inline const uint8_t *walk_at(const uint8_t *data, uint64_t base, const walk_ring *r,
                                     uint64_t a)
{
    if (!r)
        return data + (a - base);
    uint64_t off = a - base;
    return r->slots + ((r->piece0 + (off >> 20)) % RW_RING) * RW_PIECE + (off & (RW_PIECE - 1));
}

/* Whether w, the first word of a chunk's user bytes at u, is a free-list link (walk_rec). */
static inline int rec_link(const walk_rec *wr, uint64_t u, uint64_t w)
{
    for (uint32_t k = 0; k < 2; k++) {
        if ((wr->mangled == 0 && k) || (wr->mangled == 1 && !k))
            continue;
        uint64_t d = k ? w ^ (u >> 12) : w;
        if (!d || (!(d & 15) && d >= wr->lo && d < wr->hi))
            return 1;
    }
    return 0;
}

/* Records chunk c (size word sz, size s; free: the walk found it free) for the list walks,
 * when its words up to c+32 are at hand (below avail). */
static inline void walk_record(const walk_rec *wr, uint64_t *n, const uint8_t *data,
                               uint64_t base, const walk_ring *ring, uint64_t avail, uint64_t c,
                               uint64_t sz, uint64_t s, int free)
{
    if (*n >= wr->cap || (!free && s > wr->max) || c + 32 > avail)
        return;
    uint64_t w16 = mu_ld64(walk_at(data, base, ring, c + 16));
    if (!free && !rec_link(wr, c + 16, w16))
        return;
    uint64_t *o = wr->out + 4 * (*n)++;
    o[0] = c | (uint64_t)(free != 0);
    o[1] = sz;
    o[2] = w16;
    o[3] = mu_ld64(walk_at(data, base, ring, c + 24));
}

/* Walks from pos while the bytes a step reads lie below avail; final (avail == the end of
 * the copy): to the end of the run. Returns 1 when it stopped for bytes not copied yet
 * (only when !final: the top chunk, fenceposts and the chunk after the last complete one
 * wait for the final call, or with a ring only for the bytes they read), 0 when the run
 * ended (res->status says how). ring: the bytes are in mu_read_walk's ring (data unused).
 * wr: where the chunks the free-list walks will read are recorded (walk_record), or NULL. */
static int walk_steps(const uint8_t *data, uint64_t base, uint64_t len, uint64_t avail, int final,
                      uint64_t top, uint32_t non_main, uint64_t *user, uint64_t *usable,
                      uint64_t cap, mu_walk_result *res, walk_pos *pos, const walk_ring *ring,
                      const walk_rec *wr)
{
    const uint64_t lim = base + len;
    uint64_t c = pos->c, stored = pos->stored;
    uint64_t last_in_use = pos->last_in_use;   /* chunk address of the last chunk counted in use */
    uint64_t last_size = pos->last_size, rec_stored = pos->rec_stored;
    int paused = 0;
    for (;;) {
        if (!final && ((top && c == top && !ring) || c + 16 > avail)) {
            paused = 1;
            break;
        }
        if (top && c == top) {
            if (c + 16 > lim) {
                res->status = MU_WALK_TRUNCATED;
                res->bad_at = c;
                break;
            }
            uint64_t ts = mu_ld64(walk_at(data, base, ring, c + 8)) & ~(uint64_t)CHUNK_FLAGS;
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
        const uint8_t *h = walk_at(data, base, ring, c);
        /* The chain is a dependent load per chunk: prefetch ahead of the (ascending) walk
         * (a ring's pieces were just read: still in the caches). */
        if (!ring && c + MU_WALK_PREFETCH < lim)
            __builtin_prefetch(h + MU_WALK_PREFETCH);
        uint64_t sz = mu_ld64(h + 8);
        uint64_t s = sz & ~(uint64_t)CHUNK_FLAGS;
        uint64_t next = 0;
        int have_next = 0;
        if (!final && !ring && (s == 0 || s == CHUNK_FENCE || s > avail - c || avail - c - s < 16)) {
            paused = 1;         /* a fencepost, or the next header is not copied yet */
            break;
        }
        if (!final && ring) {
            uint64_t fence_end = lim - c < FENCE_RUN_MAX + 32 ? lim : c + FENCE_RUN_MAX + 32;
            if (s == 0 || s == CHUNK_FENCE) {
                if (avail < fence_end) {
                    paused = 1;         /* a fencepost: the bytes after it are not read yet */
                    break;
                }
            } else if ((s > avail - c || avail - c - s < 16) && !(sz & 8) && s >= CHUNK_MINSIZE
                       && c + s + 16 <= lim) {
                /* the next header is not read yet: wait for it, unless it lies so far
                 * ahead that the ring cannot hold it before the walk moves on */
                if (((c + s + 15 - base) >> 20) - ((c - base) >> 20) < RW_RING - 1) {
                    paused = 1;
                    break;
                }
                uint8_t w[8];
                if (pread(ring->fd, w, 8, (off_t)(c + s + 8)) != 8) {
                    res->status = MU_WALK_TRUNCATED;    /* the job's pieces say it too */
                    res->bad_at = c + s;
                    break;
                }
                next = mu_ld64(w);
                have_next = 1;
            }
        }
        if (s == 0) {
            /* {0|1}: a non-main heap's end; the chunk right before is a pseudo chunk. */
            if (last_in_use && last_in_use + last_size == c) {
                res->in_use--;
                res->in_use_bytes -= last_size;
                res->chunks--;
                if (stored && stored <= cap && user[stored - 1] == last_in_use + 16)
                    stored--;
                if (wr && rec_stored && (wr->out[4 * (rec_stored - 1)] & ~(uint64_t)1)
                                            == last_in_use)
                    rec_stored--;   /* nor recorded: the list walks take records for chunks */
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
            uint64_t nsz = mu_ld64(walk_at(data, base, ring, c + 24));
            if ((nsz & ~(uint64_t)CHUNK_FLAGS) == CHUNK_FENCE && !non_main) {
                uint64_t e = c + 32;
                /* an old top smaller than MINSIZE leaves a third 0x10 header */
                while (e + 16 <= lim && (!ring || e - c < FENCE_RUN_MAX) &&
                       mu_ld64(walk_at(data, base, ring, e + 8))
                           == (CHUNK_FENCE | CHUNK_PREV_INUSE))
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
        if (!have_next)
            next = mu_ld64(walk_at(data, base, ring, c + s + 8));
        res->chunks++;
        if (wr)
            walk_record(wr, &rec_stored, data, base, ring, avail, c, sz, s,
                        !(next & CHUNK_PREV_INUSE));
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
    pos->c = c;
    pos->stored = stored;
    pos->last_in_use = last_in_use;
    pos->last_size = last_size;
    pos->rec_stored = rec_stored;
    return paused;
}

int64_t mu_walk_run(const uint8_t *data, uint64_t base, uint64_t len, uint64_t first, uint64_t top,
                    uint32_t non_main, uint64_t *user, uint64_t *usable, uint64_t cap,
                    mu_walk_result *res)
{
    if (!data || !res || (cap && (!user || !usable)) || first < base || (first & 15))
        return -EINVAL;
    memset(res, 0, sizeof *res);
    walk_pos pos = {first, 0, 0, 0, 0};
    walk_steps(data, base, len, base + len, 1, top, non_main, user, usable, cap, res, &pos, NULL,
               NULL);
    return (int64_t)(pos.stored < cap ? pos.stored : cap);
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
        if (mu_ld64(h) != 0)
            continue;
        uint64_t sz = mu_ld64(h + 8);
        uint64_t s = sz & ~(uint64_t)CHUNK_FLAGS;
        if ((sz & CHUNK_FLAGS) != flags || s < min_size || (s & (align - 1)))
            continue;
        if (n < cap)
            out[n] = p;
        n++;
    }
    return (int64_t)n;
}

int64_t mu_walk_mmapped(const uint8_t *data, uint64_t base, uint64_t len, uint64_t limit,
                        uint64_t page, uint64_t tail, uint64_t usable_delta, uint64_t prev_mask,
                        uint64_t *user, uint64_t *usable, uint64_t cap, mu_mmap_result *res)
{
    if (!data || !res || page < 4096 || (page & (page - 1)) || (base & (page - 1)) ||
        (cap && (!user || !usable)) || limit < len || tail >= 4096 || usable_delta > 16 ||
        (prev_mask & ~(uint64_t)15))
        return -EINVAL;
    memset(res, 0, sizeof *res);
    uint64_t stored = 0, off = 0;
    while (off + 16 <= len) {
        const uint8_t *h = data + off;
        uint64_t sz = mu_ld64(h + 8);
        uint64_t s = sz & ~(uint64_t)CHUNK_FLAGS, total = s + tail;   /* the mapping's bytes */
        if ((mu_ld64(h) & ~prev_mask) != 0 || (sz & CHUNK_FLAGS) != CHUNK_IS_MMAPPED ||
            total < 4096 || (total & 4095) || total > limit - off) {
            off += page;
            continue;
        }
        /* The stale memalign header: the first non-zero word after it is the moved prev_size. */
        uint64_t chunk = off, csize = s, have = total < len - off ? total : len - off;
        uint64_t o = 16;
        while (o + 16 <= have && mu_ld64(h + o) == 0)
            o += 8;
        if (o >= 32 && !(o & 15) && o + 16 <= have && (mu_ld64(h + o) & ~prev_mask) == o &&
            mu_ld64(h + o + 8) == ((total - o - tail) | CHUNK_IS_MMAPPED)) {
            chunk = off + o;
            csize = total - o - tail;
            res->moved++;
        }
        res->found++;
        res->bytes += total;
        if (stored < cap) {
            user[stored] = base + chunk + 16;
            usable[stored] = csize - usable_delta;
            stored++;
        }
        off += total;
    }
    return (int64_t)stored;
}

/* Reads n bytes at addr of an uncopied region (mu_region.uncopied) through its fd: 0, or -1
 * when they cannot all be read. */
static int uncopied_read(const mu_region *r, uint64_t addr, uint8_t *out, uint64_t n)
{
    uint64_t first_bad = 0;
    return mu_read_serial(r->fd, addr, out, n, &first_bad) == 0 ? 0 : -1;
}

/* Index of the record of chunk c in region r's records (mu_region.rec), or -1: searched
 * among its page's (rec_ix). */
static int64_t rec_find(const mu_region *r, uint64_t c)
{
    if (c < r->base || c - r->base >= r->len)
        return -1;
    uint64_t p = (c - r->base) >> 12, lo = r->rec_ix[p], hi = r->rec_ix[p + 1];
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if ((r->rec[4 * mid] & ~(uint64_t)1) < c)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < r->nrec && (r->rec[4 * lo] & ~(uint64_t)1) == c ? (int64_t)lo : -1;
}

/* The word at addr from r's records (a chunk's size word at +8, its words at +16 and +24, as
 * the walk read them): 1 when one holds it. */
static int rec_word(const mu_region *r, uint64_t addr, uint64_t *v)
{
    if (!r->rec || !r->rec_ix || (addr & 7))
        return 0;
    for (uint64_t off = (addr & 15) == 8 ? 8 : 16; off <= 24; off += 16) {
        int64_t k = addr - off < addr ? rec_find(r, addr - off) : -1;
        if (k >= 0) {
            *v = r->rec[4 * k + off / 8];
            return 1;
        }
    }
    return 0;
}

/* The walk's record of chunk c (4 words: c | 1 when it found it free, that is its next
 * chunk's PREV_INUSE clear; its size word; its words at +16 and +24), or NULL. */
static const uint64_t *rec_of(const mu_region *r, uint64_t nr, uint64_t c)
{
    int64_t i = mu_region_find(r, nr, c + 8, 24);
    if (i < 0 || !r[i].rec || !r[i].rec_ix)
        return NULL;
    int64_t k = rec_find(&r[i], c);
    return k >= 0 ? r[i].rec + 4 * k : NULL;
}

static inline int region_word(const mu_region *r, uint64_t nr, uint64_t addr, uint64_t *v)
{
    int64_t i = mu_region_find(r, nr, addr, 8);
    if (i < 0)
        return -1;
    if (r[i].rec && rec_word(&r[i], addr, v))
        return 0;
    if (r[i].uncopied) {
        uint8_t w[8];
        if (uncopied_read(&r[i], addr, w, 8))
            return -1;
        *v = mu_ld64(w);
        return 0;
    }
    *v = mu_ld64(r[i].data + (addr - r[i].base));
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
/* A node of a free list holding chunk sizes [chunk_size, chunk_max]; *floor: in, the size of
 * the node before it (a range list is sorted by ascending size: 2.42+ large tcache bins),
 * out, this node's size. */
static int64_t check_node(const mu_region *regions, uint64_t nregions, const uint64_t *user,
                          const uint64_t *usable, uint64_t n, uint64_t node, uint64_t chunk_size,
                          uint64_t chunk_max, uint64_t *floor, uint32_t arena, uint64_t *link)
{
    if (node & 15)
        return MU_LINK_MISALIGNED;
    /* the walk's record of the chunk, when it made one: whether it is in use, its size and
     * its words, without a search of user[] nor a read (a chain's nodes lie far apart) */
    const uint64_t *rec = rec_of(regions, nregions, node - 16);
    uint64_t size;
    if (rec) {
        if (rec[0] & 1)
            return MU_LINK_NOT_CHUNK;               /* a free chunk: not in user[] */
        size = rec[1] & ~(uint64_t)CHUNK_FLAGS;
    } else {
        int64_t i = find_user(user, n, node);
        if (i < 0)
            return MU_LINK_NOT_CHUNK;
        size = usable[i] + 8;
    }
    if (size < chunk_size || size > chunk_max)
        return MU_LINK_WRONG_SIZE;
    if (size < *floor)
        return MU_LINK_ORDER;
    *floor = size;
    uint64_t sz = rec ? rec[1] : 0;
    if (rec)
        *link = rec[2];
    else if ((arena && region_word(regions, nregions, node - 8, &sz)) ||
             region_word(regions, nregions, node, link))
        return MU_LINK_UNREADABLE;
    if (arena && ((sz & CHUNK_NON_MAIN) != 0) != (arena == 2))
        return MU_LINK_WRONG_ARENA;
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
                      uint32_t mangled, uint64_t chunk_size, uint64_t chunk_max, uint32_t arena,
                      uint64_t max_nodes, uint64_t *out, uint64_t cap, mu_chain_result *res)
{
    if (!regions || !res || (cap && !out) || (n && (!user || !usable)) || arena > 2 ||
        chunk_max < chunk_size)
        return -EINVAL;
    memset(res, 0, sizeof *res);
    uint64_t node = head ? head + bias : 0, k = 0, link = 0, floor = 0;
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
        int64_t why = check_node(regions, nregions, user, usable, n, node, chunk_size, chunk_max,
                                 &floor, arena, &link);
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

int64_t mu_walk_bins(const mu_region *regions, uint64_t nregions, uint64_t first, uint64_t stride,
                     uint64_t nbins, uint64_t max_nodes, uint64_t *out)
{
    if (!regions || !out)
        return -EINVAL;
    out[0] = out[1] = out[2] = out[3] = 0;
    for (uint64_t i = 0; i < nbins; i++) {
        uint64_t nodes, bytes, bit_free, bad_at;
        int64_t rc = mu_walk_bin(regions, nregions, first + i * stride, max_nodes, &nodes, &bytes,
                                 &bit_free, &bad_at);
        if (rc < 0)
            return rc;
        out[0] += (uint64_t)rc;
        out[1] += nodes;
        out[2] += bit_free;
        if (!out[3])
            out[3] = bad_at;
    }
    return 0;
}

#define TWO_WAYS_MIN (1ull << 20)       /* entries: below this one thread does both */

/* mu_walk_tcache_scan's first pass over a part [lo, hi) of usable[]: the indices of the sizes
 * a tcache struct may have (the rest reads no chunk), in hits (grown; err on no memory) */
typedef struct {
    const uint64_t *usable;
    uint64_t lo, hi, struct_usable, struct_slack;
    uint64_t *hits, nhits, cap;
    int err;
} size_hits;

static void *find_size_hits(void *arg)
{
    size_hits *h = arg;
    for (uint64_t i = h->lo; i < h->hi; i++) {
        if (h->usable[i] - h->struct_usable > h->struct_slack)  /* (below: wraps) */
            continue;
        if (h->nhits == h->cap) {
            uint64_t cap = 2 * h->cap + 64, *p = realloc(h->hits, cap * sizeof *p);
            if (!p) {
                h->err = 1;
                return NULL;
            }
            h->hits = p;
            h->cap = cap;
        }
        h->hits[h->nhits++] = i;
    }
    return NULL;
}

int64_t mu_walk_tcache_scan(const mu_region *regions, uint64_t nregions, const uint64_t *user,
                            const uint64_t *usable, uint64_t n, uint64_t struct_usable,
                            uint64_t struct_slack, uint32_t count_width, uint64_t entries_off,
                            uint64_t nbins, uint64_t active_bins, uint64_t max_count,
                            uint32_t remaining,
                            const uint64_t *bin_min, const uint64_t *bin_max, uint64_t key_off,
                            uint64_t want_key, const uint64_t *only, uint64_t nonly,
                            mu_tcache_cand *out, uint64_t cap)
{
    if (!regions || (n && (!user || !usable)) || (cap && !out) || (count_width != 1 && count_width != 2) ||
        entries_off < count_width * nbins || !bin_min || !bin_max || (nonly && !only))
        return -EINVAL;
    uint64_t found = 0;
    const uint64_t span = entries_off + 8 * nbins;
    uint8_t *local = NULL;      /* a candidate's bytes read from an uncopied region */
    /* a big heap: the sizes first, each half of usable[] on a thread (a pass at one thread's
     * bandwidth took 50 ms of 23 M chunks) */
    size_hits part[2] = {{usable, 0, n / 2, struct_usable, struct_slack, NULL, 0, 0, 0},
                         {usable, n / 2, n, struct_usable, struct_slack, NULL, 0, 0, 0}};
    int pre = !only && n >= TWO_WAYS_MIN;
    if (pre) {
        mu_two_ways(find_size_hits, &part[1], &part[0], 1);
        if (part[0].err || part[1].err) {
            free(part[0].hits);
            free(part[1].hits);
            return -ENOMEM;
        }
    }
    for (uint64_t q = 0, end = only ? nonly : pre ? part[0].nhits + part[1].nhits : n; q < end;
         q++) {
        int64_t at = only ? find_user(user, n, only[q])
                   : !pre ? (int64_t)q
                   : (int64_t)(q < part[0].nhits ? part[0].hits[q]
                                                  : part[1].hits[q - part[0].nhits]);
        if (at < 0)
            continue;
        uint64_t i = (uint64_t)at;
        if (usable[i] - struct_usable > struct_slack)      /* (below struct_usable: wraps) */
            continue;
        uint64_t addr = user[i];
        int64_t r = mu_region_find(regions, nregions, addr, span);
        if (r < 0)
            continue;
        const uint8_t *p;
        if (regions[r].uncopied) {
            if (!local && !(local = malloc(span))) {
                found = (uint64_t)-ENOMEM;
                break;
            }
            if (uncopied_read(&regions[r], addr, local, span))
                continue;           /* unreadable: as outside every region */
            p = local;
        } else {
            p = regions[r].data + (addr - regions[r].base);
        }
        int ok = 1;
        for (uint64_t b = 0; b < nbins && ok; b++) {
            uint64_t c = count_width == 1 ? p[b] : (uint64_t)p[2 * b] | ((uint64_t)p[2 * b + 1] << 8);
            if (c > max_count)
                ok = 0;
            else if (remaining)
                c = max_count - c;
            if (b >= active_bins && c)
                ok = 0;
        }
        if (!ok)
            continue;
        mu_tcache_cand cd;
        memset(&cd, 0, sizeof cd);
        cd.addr = addr;
        for (uint64_t b = 0; b < nbins; b++) {
            uint64_t c = count_width == 1 ? p[b] : (uint64_t)p[2 * b] | ((uint64_t)p[2 * b + 1] << 8);
            uint64_t e = mu_ld64(p + entries_off + 8 * b), kv;
            if (remaining)
                c = max_count - c;
            if ((c == 0) != (e == 0))
                cd.mismatched++;
            if (!c)
                continue;
            cd.nonempty++;
            if (!e || (e & 15))
                continue;
            int64_t j = find_user(user, n, e);
            if (j < 0 || usable[j] + 8 < bin_min[b] || usable[j] + 8 > bin_max[b] ||
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
    free(local);
    free(part[0].hits);
    free(part[1].hits);
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
        uint64_t bk, sz, fd, nexthdr;
        /* the walk's record of the chunk (one search: its size, links and whether it is
         * free), else its words read */
        const uint64_t *rec = cur & 15 ? NULL : rec_of(regions, nregions, cur);
        if (rec) {
            sz = rec[1];
            fd = rec[2];
            bk = rec[3];
        }
        if (*nodes >= max_nodes || (cur & 15) ||
            (!rec && region_word(regions, nregions, cur + 24, &bk)) || bk != prev ||
            (!rec && region_word(regions, nregions, cur + 8, &sz)) ||
            (sz & ~(uint64_t)CHUNK_FLAGS) < CHUNK_MINSIZE) {
            *bad_at = cur;
            return 1;
        }
        uint64_t s = sz & ~(uint64_t)CHUNK_FLAGS;
        (*nodes)++;
        *bytes += s;
        if ((rec && (rec[0] & 1)) ||
            (!region_word(regions, nregions, cur + s + 8, &nexthdr) &&
             !(nexthdr & CHUNK_PREV_INUSE)))
            (*bit_free)++;
        prev = cur;
        if (rec)
            cur = fd;
        else if (region_word(regions, nregions, cur + 16, &cur)) {
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

/* mu_walk_subtract's moves for one array: run k's len[k] entries from src[k] down to dst[k] */
typedef struct {
    uint64_t *a;
    const uint64_t *runs;               /* (src, len, dst) each */
    uint64_t nruns;
} subtract_moves;

static void *subtract_move(void *arg)
{
    const subtract_moves *m = arg;
    for (uint64_t k = 0; k < m->nruns; k++) {
        const uint64_t *r = m->runs + 3 * k;
        if (r[2] != r[0] && r[1])
            memmove(m->a + r[2], m->a + r[0], r[1] * sizeof *m->a);
    }
    return NULL;
}

int64_t mu_walk_subtract(uint64_t *user, uint64_t *usable, uint64_t n, uint64_t *drop,
                         uint64_t ndrop, uint64_t *removed, uint64_t *distinct)
{
    if ((n && (!user || !usable)) || (ndrop && !drop) || !removed)
        return -EINVAL;
    *removed = 0;
    if (ndrop > 1)
        qsort(drop, ndrop, sizeof *drop, cmp_u64);
    if (distinct) {
        *distinct = 0;
        for (uint64_t j = 0; j < ndrop; j++)
            *distinct += !j || drop[j] != drop[j - 1];
    }
    /* each dropped entry found by a search; the runs between them move down whole (the
     * entries before the first dropped one stay where they are): first the runs, then their
     * moves, user's and usable's on two threads when the arrays are big */
    uint64_t *runs = malloc(3 * (ndrop + 1) * sizeof *runs);
    if (!runs)
        return -ENOMEM;
    uint64_t w = 0, i = 0, nruns = 0;
    for (uint64_t j = 0; j < ndrop; j++) {
        if (j && drop[j] == drop[j - 1])
            continue;
        uint64_t at = mu_lower_bound(user, i, n, drop[j]);
        if (at == n)
            break;
        if (user[at] != drop[j])
            continue;
        runs[3 * nruns] = i;
        runs[3 * nruns + 1] = at - i;
        runs[3 * nruns++ + 2] = w;
        w += at - i;
        i = at + 1;
        (*removed)++;
    }
    runs[3 * nruns] = i;
    runs[3 * nruns + 1] = n - i;
    runs[3 * nruns++ + 2] = w;
    subtract_moves mu = {user, runs, nruns}, mz = {usable, runs, nruns};
    mu_two_ways(subtract_move, &mu, &mz, nruns > 1 && n - runs[1] >= TWO_WAYS_MIN);
    free(runs);
    return (int64_t)(w + n - i);
}

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4
#endif
int64_t mu_move_down(uint8_t *p, uint64_t dst, uint64_t src, uint64_t n, int pages)
{
    if (!p || dst > src)
        return -EINVAL;
    if (!n || dst == src)
        return 0;
    uint64_t shift = src - dst, big = shift & ~(uint64_t)4095;
    uint64_t len = (n + 4095) & ~(uint64_t)4095;
    if (pages && !(((uintptr_t)p + src) & 4095) && big >= MU_MOVE_MIN_PAGES * 4096ull
        && (len + big - 1) / big <= MU_MOVE_MAX_STEPS) {
        /* ascending steps of at most `big` bytes: a step's destination never overlaps its
         * source, and is the previous step's emptied source (or room below src) */
        uint64_t o = 0;
        while (o < len) {
            uint64_t k = len - o < big ? len - o : big;
            if (mremap(p + src + o, k, k, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP,
                       p + src - big + o) == MAP_FAILED)
                break;
            o += k;
        }
        if (o) {        /* (refused after some steps, not expected: the rest follows them) */
            if (o < len)
                memmove(p + src - big + o, p + src + o, len - o);
            if (shift != big)
                memmove(p + dst, p + src - big, n);
            return 0;
        }
    }
    memmove(p + dst, p + src, n);
    return 0;
}

int64_t mu_move(uint8_t *p, uint64_t dst, uint64_t src, uint64_t n)
{
    if (!p && n)
        return -EINVAL;
    if (n && dst != src)
        memmove(p + dst, p + src, n);
    return 0;
}

/* ---- mu_read_walk: copy and walk in one pass --------------------------------------------- */
#define CAND_PIECE_BYTES (1ull << MU_CAND_PIECE_SHIFT)     /* == RW_PIECE: one piece each */
#define RW_PARALLEL_MIN (4ull << 20)
/* or this many pieces: small reads cost their system call each (a check's 1,000 leaks' runs,
 * read for the report: about 7 us apiece) */
#define RW_PARALLEL_PIECES 64
#define RW_MAX_THREADS 4

typedef struct {
    walk_pos pos;
    uint64_t walked;        /* pieces walked over (a prefix of the job's pieces) */
    uint64_t below;         /* ring jobs: the walk needs no piece numbered below this (atomic) */
    int lock;               /* 1 while a thread walks this job */
    int finished;           /* the run ended */
} rw_state;

typedef struct {
    int fd;
    mu_read_job *jobs;
    uint64_t njobs;
    rw_state *st;
    uint64_t *piece0;       /* job j's pieces are [piece0[j], piece0[j+1]) */
    uint8_t *done;          /* per piece: copied */
    uint64_t npieces;
    uint64_t next;          /* next piece to copy (atomic) */
    /* MU_READ_DROP jobs' pieces, numbered among themselves from ring0[j] for job j: the
     * ring (walk_ring), and for each slot the number + 1 of the one it holds (0: none yet)
     * and its number among all pieces */
    uint8_t *ring;
    uint64_t *ring0;
    uint64_t slot_at[RW_RING], slot_piece[RW_RING];
    pthread_mutex_t ring_mu;
    pthread_cond_t ring_cv;
} rw_ctx;

static uint64_t rw_job_of(const rw_ctx *x, uint64_t piece)
{
    uint64_t lo = 0, hi = x->njobs;     /* last job with piece0[j] <= piece */
    while (hi - lo > 1) {
        uint64_t mid = (lo + hi) >> 1;
        if (x->piece0[mid] <= piece)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* Releases the whole pages of [p, p+n) (p page aligned) that hold only zeros: a private
 * anonymous page reads as zeros after MADV_DONTNEED, without memory behind it. */
static void release_zero_pages(uint8_t *p, uint64_t n)
{
    uint64_t run = 0, at = 0;
    for (uint64_t o = 0; o + 4096 <= n; o += 4096) {
        const uint64_t *w = (const uint64_t *)(p + o);
        uint64_t any = 0;
        for (int k = 0; k < 512 && !any; k += 8)
            any = w[k] | w[k + 1] | w[k + 2] | w[k + 3] | w[k + 4] | w[k + 5] | w[k + 6] | w[k + 7];
        if (!any) {
            if (!run)
                at = o;
            run += 4096;
            continue;
        }
        if (run)
            madvise(p + at, run, MADV_DONTNEED);       /* advisory: errors ignored */
        run = 0;
    }
    if (run)
        madvise(p + at, run, MADV_DONTNEED);
}

/* Whether piece q's slot of the ring may take another piece: q is copied, and its job has
 * no walk or its walk is past q. */
static int rw_slot_free(rw_ctx *x, uint64_t q)
{
    if (!__atomic_load_n(&x->done[q], __ATOMIC_ACQUIRE))
        return 0;
    uint64_t j = rw_job_of(x, q);
    return !x->jobs[j].first || q < __atomic_load_n(&x->st[j].below, __ATOMIC_ACQUIRE);
}

/* The ring slot piece p (ring piece r) is read into: once the slot holds ring piece
 * r - RW_RING (slots are taken in order: a reader slow to get here keeps its place) and the
 * walk no longer needs it. */
static uint8_t *rw_slot(rw_ctx *x, uint64_t p, uint64_t r)
{
    uint64_t k = r % RW_RING, before = r >= RW_RING ? r - RW_RING + 1 : 0;
    pthread_mutex_lock(&x->ring_mu);
    while (x->slot_at[k] != before || (before && !rw_slot_free(x, x->slot_piece[k])))
        pthread_cond_wait(&x->ring_cv, &x->ring_mu);
    x->slot_at[k] = r + 1;
    x->slot_piece[k] = p;
    pthread_mutex_unlock(&x->ring_mu);
    return x->ring + k * RW_PIECE;
}

/* Wakes the readers waiting for a slot (a piece copied, a walk gone on: rw_thread, after
 * each piece of a ring job and its walk's steps). */
static void rw_ring_moved(rw_ctx *x)
{
    pthread_mutex_lock(&x->ring_mu);
    pthread_cond_broadcast(&x->ring_cv);
    pthread_mutex_unlock(&x->ring_mu);
}

/* Job j's ring for walk_steps, filled into *ring, or NULL when the job keeps its copy. */
static const walk_ring *rw_ring_of(const rw_ctx *x, uint64_t j, walk_ring *ring)
{
    *ring = (walk_ring){x->ring, x->ring0[j], x->fd};
    return (x->jobs[j].drop & MU_READ_DROP) ? ring : NULL;
}

/* ix[p] = the index of the first of the n records (ascending, in [base, base+len)) at or
 * past page p of [base, base+len), for p up to (len >> 12) + 1. */
static void rec_index(const uint64_t *rec, uint64_t n, uint64_t base, uint64_t len, uint32_t *ix)
{
    uint64_t k = 0, np = (len >> 12) + 2;
    for (uint64_t p = 0; p < np; p++) {
        while (k < n && ((rec[4 * k] & ~(uint64_t)1) - base) >> 12 < p)
            k++;
        ix[p] = (uint32_t)k;
    }
}

/* Job jb's walk_rec, filled into *wr, or NULL when it keeps no records. */
static const walk_rec *rw_rec_of(const mu_read_job *jb, walk_rec *wr)
{
    *wr = (walk_rec){jb->rec, jb->rec_cap, jb->rec_lo, jb->rec_hi, jb->rec_max, jb->rec_mangled};
    return jb->rec && jb->rec_cap ? wr : NULL;
}

/* Walks job j over the pieces copied so far, unless another thread is at it; then looks
 * again, so that a piece finished during the walk is not left for the final pass. */
static void rw_advance(rw_ctx *x, uint64_t j)
{
    mu_read_job *jb = &x->jobs[j];
    rw_state *st = &x->st[j];
    uint64_t np = x->piece0[j + 1] - x->piece0[j];
    const uint8_t *done = x->done + x->piece0[j];
    walk_ring ring;
    const walk_ring *r = rw_ring_of(x, j, &ring);
    for (;;) {
        if (__atomic_exchange_n(&st->lock, 1, __ATOMIC_SEQ_CST))
            return;
        uint64_t k = st->walked;
        while (k < np && __atomic_load_n(&done[k], __ATOMIC_ACQUIRE))
            k++;
        if (k > st->walked && !st->finished) {
            uint64_t got = k * RW_PIECE < jb->len ? k * RW_PIECE : jb->len;
            int final = k == np;
            walk_rec wr;
            if (!walk_steps(jb->buf, jb->addr, jb->len, jb->addr + got, final, jb->top,
                            jb->non_main, jb->user, jb->usable, jb->cap, &jb->res, &st->pos, r,
                            rw_rec_of(jb, &wr)))
                st->finished = 1;
        }
        st->walked = k;
        if (r)                  /* the readers are woken by the caller (rw_thread) */
            __atomic_store_n(&st->below, x->piece0[j] + (st->finished ? np
                                                         : (st->pos.c - jb->addr) / RW_PIECE),
                             __ATOMIC_RELEASE);
        /* seq_cst: the load of done below is not moved before this store, or a piece done
         * meanwhile by a thread that found the lock still taken would wait for another
         * piece to be walked (a ring's readers waiting for this walk: for ever) */
        __atomic_store_n(&st->lock, 0, __ATOMIC_SEQ_CST);
        if (k >= np || !__atomic_load_n(&done[k], __ATOMIC_SEQ_CST))
            return;
    }
}

static void *rw_thread(void *arg)
{
    rw_ctx *x = arg;
    uint32_t *toff = NULL;      /* mu_cands scratch, allocated at the first piece with cands */
    uint64_t *tval = NULL;
    for (;;) {
        uint64_t p = __atomic_fetch_add(&x->next, 1, __ATOMIC_RELAXED);
        if (p >= x->npieces) {
            free(toff);
            free(tval);
            return NULL;
        }
        uint64_t j = rw_job_of(x, p);
        mu_read_job *jb = &x->jobs[j];
        uint64_t off = (p - x->piece0[j]) * RW_PIECE;
        uint64_t n = jb->len - off < RW_PIECE ? jb->len - off : RW_PIECE;
        uint64_t first_bad = 0;
        int in_ring = (jb->drop & MU_READ_DROP) != 0;
        uint8_t *to = in_ring ? rw_slot(x, p, x->ring0[j] + (p - x->piece0[j])) : jb->buf + off;
        int64_t rc = in_ring ? mu_read_present(x->fd, jb->addr + off, to, n, &first_bad)
                             : mu_read_serial(x->fd, jb->addr + off, to, n, &first_bad);
        if (rc < 0) {
            int64_t zero = 0;       /* the first error wins */
            __atomic_compare_exchange_n(&jb->bad, &zero, rc, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
        } else if (rc > 0) {
            int64_t cur = __atomic_load_n(&jb->bad, __ATOMIC_RELAXED);
            while (cur >= 0 && !__atomic_compare_exchange_n(&jb->bad, &cur, cur + rc, 0,
                                                            __ATOMIC_RELAXED, __ATOMIC_RELAXED))
                ;
            uint64_t fb = __atomic_load_n(&jb->first_bad, __ATOMIC_RELAXED);
            while ((fb == 0 || first_bad < fb) &&
                   !__atomic_compare_exchange_n(&jb->first_bad, &fb, first_bad, 0,
                                                __ATOMIC_RELAXED, __ATOMIC_RELAXED))
                ;
        }
        if (jb->cands) {        /* the piece's reference candidates, while it is in the caches */
            mu_cands *c = jb->cands;
            uint64_t k = p - x->piece0[j];
            if (!toff) {
                toff = malloc((CAND_PIECE_BYTES / 8) * sizeof *toff);
                tval = malloc((CAND_PIECE_BYTES / 8) * sizeof *tval);
            }
            if (rc == 0 && toff && tval)
                mu_cands_fill_piece(c, k, to, n, toff, tval);
            else
                __atomic_store_n(&c->p[k].state, -1, __ATOMIC_RELEASE);
        }
        if (jb->drop & MU_READ_SPARSE)
            release_zero_pages(to, n);
        __atomic_store_n(&x->done[p], 1, __ATOMIC_SEQ_CST);
        if (jb->first)
            rw_advance(x, j);
        /* its slot, or slots its walk went past, may be free now (a walk can be past pieces
         * not copied yet: inside a chunk whose end was read apart) */
        if (in_ring)
            rw_ring_moved(x);
    }
}

int64_t mu_read_walk(int memfd, mu_read_job *jobs, uint64_t njobs)
{
    if (njobs && !jobs)
        return -EINVAL;
    uint64_t total = 0;
    int any_ring = 0;
    for (uint64_t j = 0; j < njobs; j++) {
        mu_read_job *jb = &jobs[j];
        int in_ring = (jb->drop & MU_READ_DROP) != 0;
        if ((jb->len && !jb->buf && !in_ring) ||
            (jb->first && ((jb->cap && (!jb->user || !jb->usable)) ||
                           jb->first < jb->addr || (jb->first & 15))) ||
            (jb->cands && (jb->cands->base != jb->addr || jb->cands->len != jb->len)) ||
            (jb->rec_cap && (!jb->rec || !jb->rec_ix || !jb->first || jb->rec_mangled > 2
                             || jb->rec_cap >= (1ull << 32))) ||
            (jb->drop & ~(uint32_t)(MU_READ_DROP | MU_READ_SPARSE)) ||
            (in_ring && (jb->drop & MU_READ_SPARSE)) ||
            ((jb->drop & MU_READ_SPARSE) && ((uintptr_t)jb->buf & 4095)))
            return -EINVAL;
        memset(&jb->res, 0, sizeof jb->res);
        jb->stored = jb->bad = 0;
        jb->rec_stored = 0;
        jb->first_bad = 0;
        total += jb->len;
        any_ring |= in_ring && jb->len;
    }
    rw_ctx x = {.fd = memfd, .jobs = jobs, .njobs = njobs};
    x.st = calloc(njobs ? njobs : 1, sizeof *x.st);
    x.piece0 = malloc((njobs + 1) * sizeof *x.piece0);
    x.ring0 = malloc((njobs + 1) * sizeof *x.ring0);
    x.ring = any_ring ? malloc(RW_RING * RW_PIECE) : NULL;
    if (!x.st || !x.piece0 || !x.ring0 || (any_ring && !x.ring)) {
        free(x.st);
        free(x.piece0);
        free(x.ring0);
        free(x.ring);
        return -ENOMEM;
    }
    uint64_t nring = 0;
    for (uint64_t j = 0; j < njobs; j++) {
        uint64_t np = (jobs[j].len + RW_PIECE - 1) / RW_PIECE;
        x.piece0[j] = x.npieces;
        x.ring0[j] = nring;
        x.npieces += np;
        if (jobs[j].drop & MU_READ_DROP)
            nring += np;
        x.st[j].pos.c = jobs[j].first;
        x.st[j].below = x.piece0[j] + (jobs[j].first ? (jobs[j].first - jobs[j].addr) / RW_PIECE : 0);
    }
    x.piece0[njobs] = x.npieces;
    if (x.ring)             /* faulted in once: its slots are read into again and again */
        mu_populate(x.ring, RW_RING * RW_PIECE);
    x.done = calloc(x.npieces ? x.npieces : 1, 1);
    if (!x.done) {
        free(x.st);
        free(x.piece0);
        free(x.ring0);
        free(x.ring);
        return -ENOMEM;
    }
    pthread_mutex_init(&x.ring_mu, NULL);
    pthread_cond_init(&x.ring_cv, NULL);
    long ncpu = mu_online_cpus();
    int nt = (total < RW_PARALLEL_MIN && x.npieces < RW_PARALLEL_PIECES) || ncpu < 2 ? 1
           : ncpu > RW_MAX_THREADS ? RW_MAX_THREADS : (int)ncpu;
    pthread_t tids[RW_MAX_THREADS];
    int started[RW_MAX_THREADS] = {0};
    for (int t = 1; t < nt; t++)
        started[t] = pthread_create(&tids[t], NULL, rw_thread, &x) == 0;
    rw_thread(&x);
    for (int t = 1; t < nt; t++)
        if (started[t])
            pthread_join(tids[t], NULL);
    /* every piece is copied: finish the walks a thread left (a job with no piece, or one
     * whose last pieces were finished while another thread walked it); a ring still holds
     * every piece from each walk's position on */
    for (uint64_t j = 0; j < njobs; j++) {
        mu_read_job *jb = &jobs[j];
        if (!jb->first)
            continue;
        walk_ring ring;
        walk_rec wr;
        if (!x.st[j].finished)
            walk_steps(jb->buf, jb->addr, jb->len, jb->addr + jb->len, 1, jb->top, jb->non_main,
                       jb->user, jb->usable, jb->cap, &jb->res, &x.st[j].pos,
                       rw_ring_of(&x, j, &ring), rw_rec_of(jb, &wr));
        jb->stored = (int64_t)(x.st[j].pos.stored < jb->cap ? x.st[j].pos.stored : jb->cap);
        jb->rec_stored = x.st[j].pos.rec_stored;
        if (jb->rec && jb->rec_ix)
            rec_index(jb->rec, jb->rec_stored, jb->addr, jb->len, jb->rec_ix);
    }
    pthread_cond_destroy(&x.ring_cv);
    pthread_mutex_destroy(&x.ring_mu);
    free(x.ring);
    free(x.ring0);
    free(x.st);
    free(x.piece0);
    free(x.done);
    return 0;
}

/* ---- mu_cands: the reference candidates of an uncopied region ---------------------------- */
#define CAND_PIECE (1ull << MU_CAND_PIECE_SHIFT)

int64_t mu_cands_new(uint64_t base, uint64_t len, const uint64_t *ranges, uint64_t nranges,
                     uint64_t max_words, mu_cands **out)
{
    if (!out || (base & 4095) || base + len < base || !nranges || !ranges)
        return -EINVAL;
    for (uint64_t k = 0; k < nranges; k++)
        if (ranges[2 * k] >= ranges[2 * k + 1] || (k && ranges[2 * k] < ranges[2 * k - 1]))
            return -EINVAL;
    mu_cands *c = calloc(1, sizeof *c);
    if (!c)
        return -ENOMEM;
    c->base = base;
    c->len = len;
    c->lo = ranges[0];
    c->hi = ranges[2 * nranges - 1];
    c->max_words = max_words;
    c->nranges = nranges;
    c->ranges = malloc(2 * nranges * sizeof *c->ranges);
    c->npieces = (len + CAND_PIECE - 1) / CAND_PIECE;
    c->p = calloc(c->npieces ? c->npieces : 1, sizeof *c->p);
    if (!c->p || !c->ranges) {
        free(c->p);
        free(c->ranges);
        free(c);
        return -ENOMEM;
    }
    memcpy(c->ranges, ranges, 2 * nranges * sizeof *c->ranges);
    *out = c;
    return 0;
}

/* 1 when v lies in one of c's ranges, that range then at [*lo, *hi). */
static inline int cands_range_of(const mu_cands *c, uint64_t v, uint64_t *lo, uint64_t *hi)
{
    uint64_t a = 0, b = c->nranges;
    while (a < b) {
        uint64_t mid = (a + b) >> 1;
        if (c->ranges[2 * mid + 1] <= v)
            a = mid + 1;
        else
            b = mid;
    }
    if (a == c->nranges || c->ranges[2 * a] > v)
        return 0;
    *lo = c->ranges[2 * a];
    *hi = c->ranges[2 * a + 1];
    return 1;
}

void mu_cands_free(mu_cands *c)
{
    if (!c)
        return;
    for (uint64_t k = 0; k < c->npieces; k++) {
        free(c->p[k].off);
        free(c->p[k].val);
    }
    free(c->p);
    free(c->ranges);
    free(c);
}

/* Whether one of the 8 words at g lies in [lo, lo + span): two 4-word vector compares (the
 * scalar test of each word was the most of this pass over a heap with few candidates). */
typedef uint64_t mu_v4 __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) int group8_any(const uint8_t *g, uint64_t lo,
                                                            uint64_t span)
{
    mu_v4 a, b, l = {lo, lo, lo, lo}, s = {span, span, span, span};
    memcpy(&a, g, 32);
    memcpy(&b, g + 32, 32);
    mu_v4 r = ((a - l) < s) | ((b - l) < s);
    return (r[0] | r[1] | r[2] | r[3]) != 0;
}

static inline __attribute__((always_inline)) void fill_piece(mu_cands *c, uint64_t k,
                                                            const uint8_t *d, uint64_t n,
                                                            uint32_t *toff, uint64_t *tval)
{
    mu_cand_piece *p = &c->p[k];
    const uint64_t lo = c->lo, span = c->hi - c->lo;
    uint64_t nw = n / 8, cnt = 0;
    p->head_tail = (nw && mu_ld64(d) - lo < span
                    && (mu_tail_shape(mu_ld64(d)) || mu_aligned_tail_bytes(mu_ld64(d))))
                   || (nw > 1 && mu_ld64(d + 8) - lo < span
                       && mu_aligned_tail_bytes(mu_ld64(d + 8)));
    const uint64_t per_sub = 1u << (MU_CAND_SUB_SHIFT - 3);
    for (uint64_t s0 = 0; s0 < nw; s0 += per_sub) {
        p->sub[s0 / per_sub] = (uint32_t)cnt;
        uint64_t end = s0 + per_sub < nw ? s0 + per_sub : nw, w = s0;
        /* groups of 8 words: one predictable test for a group with no candidate (most words
         * of most heaps), branch-free stores inside a group with some (pointer-dense ones) */
        for (; w + 8 <= end; w += 8) {
            const uint8_t *g = d + 8 * w;
            if (!group8_any(g, lo, span))
                continue;
            for (int k = 0; k < 8; k++) {
                uint64_t v = mu_ld64(g + 8 * k);
                toff[cnt] = (uint32_t)(8 * (w + k));
                tval[cnt] = v;
                cnt += v - lo < span;  /* the range list is checked below */
            }
        }
        for (; w < end; w++) {
            uint64_t v = mu_ld64(d + 8 * w);
            toff[cnt] = (uint32_t)(8 * w);
            tval[cnt] = v;
            cnt += v - lo < span;
        }
    }
    for (uint64_t s = (nw + (1u << (MU_CAND_SUB_SHIFT - 3)) - 1) >> (MU_CAND_SUB_SHIFT - 3);
         s <= MU_CAND_SUBS; s++)
        p->sub[s] = (uint32_t)cnt;
    for (uint64_t j = 0; j < cnt; j++) {    /* text tails after a word of the piece: bit 0; */
        if (toff[j] && __builtin_expect(mu_tail_shape(tval[j]), 0)   /* 8-aligned after two: 1 */
            && mu_text_runs_on(mu_ld64(d + toff[j] - 8)))
            toff[j] |= 1;
        else if (__builtin_expect(mu_aligned_tail_bytes(tval[j]), 0) && toff[j] >= 16
                 && mu_text_tail_aligned(mu_ld64(d + toff[j] - 16), mu_ld64(d + toff[j] - 8),
                                         tval[j]))
            toff[j] |= 2;
    }
    if (c->nranges > 1) {               /* keep those inside a range; renumber the sub-pages */
        uint64_t kept = 0, s = 0, rlo = 0, rhi = 0;     /* the range the last one hit */
        for (uint64_t j = 0; j < cnt; j++) {
            while (s <= MU_CAND_SUBS && p->sub[s] <= j)
                p->sub[s++] = (uint32_t)kept;
            /* a block's pointers mostly go to one heap: its range is tried first (the
             * search per candidate was most of this loop for 4 KiB arrays of pointers) */
            if (tval[j] - rlo < rhi - rlo || cands_range_of(c, tval[j], &rlo, &rhi)) {
                toff[kept] = toff[j];
                tval[kept] = tval[j];
                kept++;
            }
        }
        while (s <= MU_CAND_SUBS)
            p->sub[s++] = (uint32_t)kept;
        cnt = kept;
    }
    int32_t state = -1;
    if (!c->max_words) {
        ;                                                       /* keep nothing */
    } else if (__atomic_add_fetch(&c->used, cnt, __ATOMIC_RELAXED) > c->max_words) {
        __atomic_sub_fetch(&c->used, cnt, __ATOMIC_RELAXED);   /* over the budget: not kept */
    } else if (cnt == 0 || ((p->off = malloc(cnt * sizeof *p->off)) &&
                            (p->val = malloc(cnt * sizeof *p->val)))) {
        if (cnt) {
            memcpy(p->off, toff, cnt * sizeof *toff);
            memcpy(p->val, tval, cnt * sizeof *tval);
        }
        p->n = (uint32_t)cnt;
        state = 1;
    } else {
        free(p->off);
        p->off = NULL;
        __atomic_sub_fetch(&c->used, cnt, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&p->state, state, __ATOMIC_RELEASE);
}

/* fill_piece built twice (x86-64): for AVX2 and for the baseline, chosen by the CPU unless a
 * test says which (mu_cands_filter) */
#if defined(__x86_64__) && defined(__GNUC__)
#define FILL_AVX2 1
static __attribute__((target("avx2"))) void fill_piece_avx2(mu_cands *c, uint64_t k,
                                                             const uint8_t *d, uint64_t n,
                                                             uint32_t *toff, uint64_t *tval)
{
    fill_piece(c, k, d, n, toff, tval);
}
#endif

static void fill_piece_base(mu_cands *c, uint64_t k, const uint8_t *d, uint64_t n, uint32_t *toff,
                            uint64_t *tval)
{
    fill_piece(c, k, d, n, toff, tval);
}

static int fill_which = -1;     /* mu_cands_filter */

static int fill_avx2_supported(void)
{
#ifdef FILL_AVX2
    return __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

int64_t mu_cands_filter(int64_t which)
{
    if (which < -1 || which > 1)
        return -EINVAL;
    if (which == 1 && !fill_avx2_supported())
        return -ENOTSUP;
    return __atomic_exchange_n(&fill_which, (int)which, __ATOMIC_RELAXED);
}

void mu_cands_fill_piece(mu_cands *c, uint64_t k, const uint8_t *d, uint64_t n, uint32_t *toff,
                         uint64_t *tval)
{
    int which = __atomic_load_n(&fill_which, __ATOMIC_RELAXED);
#ifdef FILL_AVX2
    if (which == 1 || (which < 0 && fill_avx2_supported())) {
        fill_piece_avx2(c, k, d, n, toff, tval);
        return;
    }
#endif
    fill_piece_base(c, k, d, n, toff, tval);
}

int64_t mu_cands_fill(mu_cands *c, const uint8_t *data, uint64_t addr, uint64_t len)
{
    if (!c || (len && !data))
        return -EINVAL;
    uint32_t *toff = malloc((CAND_PIECE / 8) * sizeof *toff);
    uint64_t *tval = malloc((CAND_PIECE / 8) * sizeof *tval);
    int64_t kept = 0;
    if (!toff || !tval) {
        free(toff);
        free(tval);
        return -ENOMEM;
    }
    for (uint64_t k = 0; k < c->npieces; k++) {
        uint64_t pb = c->base + k * CAND_PIECE;
        uint64_t pe = pb + CAND_PIECE < c->base + c->len ? pb + CAND_PIECE : c->base + c->len;
        if (pb < addr || pe > addr + len || c->p[k].state)
            continue;
        mu_cands_fill_piece(c, k, data + (pb - addr), pe - pb, toff, tval);
        kept += c->p[k].state == 1;
    }
    free(toff);
    free(tval);
    return kept;
}

uint64_t mu_cands_words(const mu_cands *c, uint64_t *pieces_kept)
{
    uint64_t kept = 0;
    for (uint64_t k = 0; c && k < c->npieces; k++)
        kept += c->p[k].state == 1;
    if (pieces_kept)
        *pieces_kept = kept;
    return c ? c->used : 0;
}
