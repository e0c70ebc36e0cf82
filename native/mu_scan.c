/* mu_scan.c: the conservative mark (libmemunreachable.md section 3): word scan, sorted-range
 * lookup and an iterative LIFO worklist. Policy (which ranges are roots) lives in Python. */
#include "mu_core_impl.h"
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#define SCAN_MIN_SHIFT 4u        /* smallest page-table granule: 16 bytes */
#define SCAN_MAX_SHIFT 40u
#define SCAN_NONE UINT32_MAX
#define SCAN_ALLOCS_PER_PAGE 4u  /* allocations per page-table entry, about (mu_scan_index) */
#define SCAN_PREFETCH_BYTES 512u /* of a newly marked allocation, fetched ahead of its scan */
#define SCAN_POP 16u             /* allocations popped and fetched together */
#define SCAN_BATCH 32u           /* lookups in flight together (memory-level parallelism) */
#define SCAN_SEEN_BITS 10u       /* values remembered per mark thread (8 KiB: stays in L1) */
#define SCAN_UNCOPIED_OK (1u << 31) /* index flag (mu_mark only): uncopied regions allowed */
#define SCAN_LEAVES (1u << 30)      /* index flag (mu_mark only): find the leaves (ix->leaf) */
/* The low-memory mark (uncopied regions): the marked allocations of a wave, sorted by address,
 * are read in runs: neighbours closer than WAVE_GAP bytes share one read, a read is at most
 * WAVE_READ bytes (one buffer per mark thread), and a thread takes WAVE_BATCH bytes of the
 * wave at a time. */
#define WAVE_GAP (4u << 10)
#define WAVE_READ (1u << 20)
#define WAVE_BATCH (4u << 20)

/* malloc for the large lookup arrays: 2 MiB-aligned and advised MADV_HUGEPAGE (THP is
 * "madvise" on many distributions), since every lookup is a random access and 4 KiB pages
 * would add a TLB miss to each. Returns NULL on failure; release with free(). */
static void *big_alloc(uint64_t bytes)
{
    const uint64_t huge = 2u << 20;
    if (bytes < 2 * huge)
        return malloc(bytes ? bytes : 1);
    void *p = NULL;
    if (posix_memalign(&p, huge, bytes))
        return NULL;
    madvise(p, (bytes + 4095) & ~(uint64_t)4095, MADV_HUGEPAGE);   /* advisory: errors ignored */
    return p;
}

static inline uint64_t pages_of(uint64_t len, uint32_t shift)
{
    return (len >> shift) + ((len & ((1ull << shift) - 1)) != 0);
}

static inline uint64_t alloc_len(uint64_t size)
{
    return size ? size : 1;
}

/* Allocation i of the index: its first byte and the end of its span. */
static inline uint64_t ix_begin(const mu_scan_index *ix, uint64_t i)
{
    return ix->begin[i];
}

static inline uint64_t ix_end(const mu_scan_index *ix, uint64_t i)
{
    return ix->begin[i] + alloc_len(ix->size[i]);
}

void mu_scan_index_free(mu_scan_index *ix)
{
    free(ix->leaf);
    free(ix->first_alloc);
    free(ix->page_off);
    free(ix->page);
    free(ix->rmap);
    memset(ix, 0, sizeof *ix);
}

/* The argument checks mu_scan_index_init and mu_scan_index_check share: 0, -EINVAL (missing
 * arrays; regions unsorted, overlapping, wrapping or without data) or -EOVERFLOW. */
static int64_t check_args(const uint64_t *begin, const uint64_t *size, uint64_t n,
                          const mu_region *heap, uint64_t nheap, uint32_t flags)
{
    if ((n && (!begin || !size)) || (nheap && !heap) || (n && !nheap))
        return -EINVAL;
    if (n >= SCAN_NONE)
        return -EOVERFLOW;
    for (uint64_t r = 0; r < nheap; r++) {
        int uncopied = (flags & SCAN_UNCOPIED_OK) && heap[r].uncopied && heap[r].fd >= 0;
        if (heap[r].base + heap[r].len < heap[r].base || (heap[r].len && !heap[r].data && !uncopied)
            || (heap[r].uncopied && !uncopied))
            return -EINVAL;
        if (r && heap[r].base < heap[r - 1].base + heap[r - 1].len)
            return -EINVAL;
    }
    return 0;
}

int64_t mu_scan_index_check(const uint64_t *begin, const uint64_t *size, uint64_t n,
                            const mu_region *heap, uint64_t nheap)
{
    int64_t rc = check_args(begin, size, n, heap, nheap, 0);
    if (rc)
        return rc;
    uint64_t r = 0, prev_end = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t b = begin[i], e = b + alloc_len(size[i]);
        if (e < b || (i && b < prev_end))
            return -EINVAL;
        while (r < nheap && heap[r].base + heap[r].len <= b)
            r++;
        if (r == nheap || b < heap[r].base || e > heap[r].base + heap[r].len)
            return -EINVAL;
        prev_end = e;
    }
    return 0;
}

/* The region map: slot (v >> RMAP_SHIFT) & rmask holds 1 + the region holding granule v >> 16
 * when only one region has a granule on that slot, RMAP_MULTI when several do (or the index does
 * not fit), 0 when none does: then v is in no region. Sized at about 2 slots per granule of the
 * regions (at least RMAP_MIN_BITS: 16 KiB, in L1, for a small process), at most RMAP_MAX_BITS;
 * a region of more granules than slots fills every slot. Returns 0 or -ENOMEM (ix freed). */
#define RMAP_SHIFT 16u
#define RMAP_MIN_BITS 13u
#define RMAP_MAX_BITS 20u
#define RMAP_MULTI UINT16_MAX

static int64_t rmap_init(mu_scan_index *ix)
{
    uint64_t granules = 0;
    for (uint64_t r = 0; r < ix->nheap; r++)
        if (ix->heap[r].len)
            granules += ((ix->heap[r].base + ix->heap[r].len - 1) >> RMAP_SHIFT)
                        - (ix->heap[r].base >> RMAP_SHIFT) + 1;
    uint32_t bits = RMAP_MIN_BITS;
    while (bits < RMAP_MAX_BITS && (1ull << bits) < 2 * granules)
        bits++;
    uint64_t slots = 1ull << bits;
    ix->rmask = slots - 1;
    ix->rmap = calloc(slots, sizeof *ix->rmap);
    if (!ix->rmap) {
        mu_scan_index_free(ix);
        return -ENOMEM;
    }
    for (uint64_t r = 0; r < ix->nheap; r++) {
        const mu_region *h = &ix->heap[r];
        if (!h->len)
            continue;
        uint64_t g0 = h->base >> RMAP_SHIFT, g1 = (h->base + h->len - 1) >> RMAP_SHIFT;
        uint16_t val = r + 1 < RMAP_MULTI ? (uint16_t)(r + 1) : RMAP_MULTI;
        for (uint64_t g = g0; g <= g1 && g - g0 < slots; g++) {
            uint16_t *e = &ix->rmap[g & ix->rmask];
            *e = *e == 0 || *e == val ? val : RMAP_MULTI;
        }
    }
    return 0;
}

/* The kept candidates of region h when its allocations can be leaves (an uncopied region with
 * candidate pieces), else NULL. */
static inline const mu_cands *leaf_cands(const mu_region *h)
{
    return h->uncopied && h->cands && h->cands->npieces ? h->cands : NULL;
}

/* A cursor over the kept candidates of an uncopied region c, for its allocations in ascending
 * order (leaf_of): piece k spans [pb, pe), ok when its candidates were kept; j is the index
 * of candidate at (address nc; UINT64_MAX past the piece's last) in it. */
typedef struct {
    const mu_cands *c;
    uint64_t k, j, pb, pe, nc;
    int ok;
} leaf_cursor;

static void leaf_seek(leaf_cursor *q, uint64_t k)
{
    const mu_cand_piece *p = &q->c->p[k];
    q->k = k;
    q->j = 0;
    q->pb = q->c->base + (k << MU_CAND_PIECE_SHIFT);
    q->pe = q->pb + (1ull << MU_CAND_PIECE_SHIFT);
    q->ok = p->state == 1;
    q->nc = q->ok && p->n ? q->pb + (p->off[0] & ~3u) : UINT64_MAX;
}

/* Whether the allocation [b, b + len) is a leaf: the mark would scan it from its region's
 * kept candidates (scan_cands: 8-aligned, inside the region's candidates, every piece it meets
 * kept, none after the first with a text tail's shape at its start) and none lies in it, so
 * that scan finds nothing. */
static inline int leaf_of(leaf_cursor *q, uint64_t b, uint64_t len)
{
    const mu_cands *c = q->c;
    if (!len)
        return 1;                       /* no words (scan_cands' zero-size case) */
    uint64_t e = b + len;
    if ((b & 7) || (len & 7) || b < c->base || e > c->base + c->len)
        return 0;
    if (b >= q->pe || b < q->pb)
        leaf_seek(q, (b - c->base) >> MU_CAND_PIECE_SHIFT);
    for (;;) {
        const mu_cand_piece *p = &c->p[q->k];
        if (!q->ok)
            return 0;
        while (q->nc < b)               /* the first candidate at b or after */
            q->nc = ++q->j < p->n ? q->pb + (p->off[q->j] & ~3u) : UINT64_MAX;
        if (e <= q->pe || q->nc < q->pe)
            return q->nc >= e;
        /* none left in this piece and the block goes on into the next */
        if (q->k + 1 >= c->npieces || c->p[q->k + 1].head_tail)
            return 0;
        leaf_seek(q, q->k + 1);
        b = q->pb;
    }
}

/* Regions [k0, k1) of an index being built: their page tables (at ix->page_off), their
 * allocations validated (each region's strictly ascending, non-overlapping and inside it; the
 * regions are ascending and disjoint: check_args), the sum of their sizes and their leaves. */
typedef struct {
    mu_scan_index *ix;
    uint64_t k0, k1;
    uint64_t size_total;
    int rc;                 /* -EINVAL: invalid allocations */
} index_part;

#define INDEX_PARALLEL_MIN (1u << 20)   /* allocations from which two threads build an index */

static void index_regions(index_part *part)
{
    mu_scan_index *ix = part->ix;
    const uint64_t *begin = ix->begin, *size = ix->size;
    const uint64_t n = ix->n, shift = ix->shift;
    for (uint64_t k = part->k0; k < part->k1; k++) {
        const mu_region *h = &ix->heap[k];
        uint64_t np = pages_of(h->len, (uint32_t)shift), off = ix->page_off[k];
        uint64_t i = ix->first_alloc[k], end_i = ix->first_alloc[k + 1];
        uint64_t rb = h->base, re = rb + h->len, prev_end = rb, total = 0;
        leaf_cursor q = {ix->leaf ? leaf_cands(h) : NULL, 0, 0, 0, 0, 0, 0};
        uint64_t acc = 0, accw = i >> 6;    /* leaf bits of word accw, stored once complete (a
                                             * word at a part's edge is shared: atomic OR) */
        /* every allocation is passed: the last page starts at or past the region's end, which
         * a valid allocation's end never passes */
        for (uint64_t p = 0; p <= np; p++) {
            uint64_t start = rb + (p << shift);
            for (; i < end_i; i++) {
                uint64_t b = begin[i], e = b + alloc_len(size[i]);
                if (e > start)
                    break;
                if (e < b || b < prev_end || e > re) {
                    part->rc = -EINVAL;
                    return;
                }
                prev_end = e;
                total += size[i];
                if (q.c) {
                    if (i >> 6 != accw) {
                        __atomic_fetch_or(&ix->leaf[accw], acc, __ATOMIC_RELAXED);
                        acc = 0;
                        accw = i >> 6;
                    }
                    acc |= (uint64_t)leaf_of(&q, b, size[i]) << (i & 63);
                }
            }
            /* n (none ends after start) is stored as n - 1, which ends before v: not taken */
            ix->page[off + p] = (uint32_t)(i == n && n ? n - 1 : i);
        }
        if (q.c && acc)
            __atomic_fetch_or(&ix->leaf[accw], acc, __ATOMIC_RELAXED);
        part->size_total += total;
        if (i != end_i) {
            part->rc = -EINVAL;
            return;
        }
    }
}

static void *index_thread(void *arg)
{
    index_regions(arg);
    return NULL;
}

/* Returns 0, -EINVAL (unsorted, overlapping or outside every region), -EOVERFLOW or -ENOMEM. */
int64_t mu_scan_index_init(mu_scan_index *ix, const uint64_t *begin, const uint64_t *size,
                           uint64_t n, const mu_region *heap, uint64_t nheap, uint32_t flags)
{
    memset(ix, 0, sizeof *ix);
    int64_t rc = check_args(begin, size, n, heap, nheap, flags);
    if (rc)
        return rc;
    ix->n = n;
    ix->heap = heap;
    ix->nheap = nheap;
    ix->begin = begin;
    ix->size = size;
    ix->first_alloc = malloc((nheap + 1) * sizeof(uint64_t));
    ix->page_off = malloc((nheap ? nheap : 1) * sizeof(uint64_t));
    if (!ix->first_alloc || !ix->page_off) {
        mu_scan_index_free(ix);
        return -ENOMEM;
    }
    /* Allocations of region k: [first_alloc[k], first_alloc[k+1]), the first whose begin is at
     * or above the region's base (a binary search: the page tables' pass below validates them) */
    for (uint64_t k = 0; k < nheap; k++)
        ix->first_alloc[k] = mu_lower_bound(begin, k ? ix->first_alloc[k - 1] : 0, n,
                                            heap[k].base);
    ix->first_alloc[nheap] = n;
    if (nheap && ix->first_alloc[0])
        goto invalid;               /* allocations below the first region */
    ix->lo = n ? begin[0] : 0;
    ix->hi = n ? ix_end(ix, n - 1) : 0;

    /* Page tables: the granule is the smallest power of two >= 16 bytes giving at most about
     * one page per SCAN_ALLOCS_PER_PAGE allocations (a lookup is one table load and a search
     * of a few begins in one or two cache lines). One page per allocation was 4 bytes a block
     * to fault in and zero (300 MB for a 4 GiB heap of small nodes) for the same lookups. */
    uint32_t shift = SCAN_MIN_SHIFT;
    uint64_t total;
    for (;;) {
        total = 0;
        for (uint64_t k = 0; k < nheap; k++)
            total += pages_of(heap[k].len, shift) + 1;
        if (total <= n / SCAN_ALLOCS_PER_PAGE + 65536 + nheap || shift >= SCAN_MAX_SHIFT)
            break;
        shift++;
    }
    ix->shift = shift;
    ix->page = big_alloc(total * sizeof(uint32_t));
    int leaves = 0;
    for (uint64_t k = 0; k < nheap && (flags & SCAN_LEAVES); k++)
        leaves |= leaf_cands(&heap[k]) != NULL;
    if (leaves)
        ix->leaf = calloc(n / 64 + 1, sizeof *ix->leaf);
    if (!ix->page || (leaves && !ix->leaf)) {
        mu_scan_index_free(ix);
        return -ENOMEM;
    }
    /* One pass over the allocations fills the tables and validates them (index_regions), on
     * two threads for a large heap of several regions */
    uint64_t off = 0;
    for (uint64_t k = 0; k < nheap; k++) {
        ix->page_off[k] = off;
        off += pages_of(heap[k].len, shift) + 1;
    }
    index_part part[2] = {{ix, 0, nheap, 0, 0}, {ix, nheap, nheap, 0, 0}};
    int two = n >= INDEX_PARALLEL_MIN && nheap > 1;
    if (two) {
        uint64_t ks = 1;            /* the regions of the second part: from the middle allocation */
        while (ks + 1 < nheap && ix->first_alloc[ks] < n / 2)
            ks++;
        part[0].k1 = part[1].k0 = ks;
    }
    mu_two_ways(index_thread, &part[1], &part[0], two);
    if (part[0].rc || part[1].rc)
        goto invalid;
    ix->size_total = part[0].size_total + part[1].size_total;
    return rmap_init(ix) ? -ENOMEM : 0;
invalid:
    mu_scan_index_free(ix);
    return -EINVAL;
}

/* Returns the region containing v, or nheap. */
static inline uint64_t region_find(mu_scan_index *ix, uint64_t v)
{
    const mu_region *h = ix->heap;
    uint16_t e = ix->rmap[(v >> RMAP_SHIFT) & ix->rmask];
    if (e != RMAP_MULTI)
        return e && v - h[e - 1].base < h[e - 1].len ? (uint64_t)e - 1 : ix->nheap;
    uint64_t c = ix->last_region;
    if (c < ix->nheap && v - h[c].base < h[c].len)
        return c;
    uint64_t lo = 0, hi = ix->nheap;    /* first region with base > v */
    while (lo < hi) {
        uint64_t mid = (lo + hi) >> 1;
        if (h[mid].base <= v)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0 || v - h[lo - 1].base >= h[lo - 1].len)
        return ix->nheap;
    ix->last_region = lo - 1;
    return lo - 1;
}

/* Finishes a lookup of v (inside a heap region) once its page entry pg is (about to be) cached:
 * returns the allocation containing v, or -1. The answer is among pg[0] .. pg[1] (allocations of
 * the next regions begin above v, so they are never taken).
 * hw: the dead words' head_word or NULL. Any word into [begin, end) is a
 * reference, a block's last 8 bytes included (a struct linked through its last member): glibc's
 * own pointers to the next chunk's header (top, bins) lie in its metadata, which is never
 * scanned (glibc-heap.md section 12). */
static inline int64_t hit_rules(const mu_scan_index *ix, const uint8_t *hw, uint64_t lo,
                                uint64_t v);

static inline int64_t page_search(const mu_scan_index *ix, const uint8_t *hw,
                                  const uint32_t *pg, uint64_t v)
{
    uint64_t lo = pg[0];
    /* last k in [lo, pg[1]] with begin[k] <= v (lo itself when none: then begin[lo] > v), by
     * branch-free halving: which half holds it is a coin toss */
    for (uint64_t n = pg[1] - lo + 1; n > 1;) {
        uint64_t half = n >> 1;
        lo = ix->begin[lo + half] <= v ? lo + half : lo;
        n -= half;
    }
    return hit_rules(ix, hw, lo, v);
}

/* The lookup of v whose last allocation beginning at or below it is lo (or lo begins above
 * it): lo when v lies inside it and is a reference there, else -1. */
static inline int64_t hit_rules(const mu_scan_index *ix, const uint8_t *hw, uint64_t lo,
                                uint64_t v)
{
    uint64_t b = ix->begin[lo], end = b + alloc_len(ix->size[lo]);
    if (b > v || v >= end)
        return -1;
    if ((uint32_t)v < MU_PAIR_LOW_MAX && (v & ~0xffffffffull) > b && v - b >= MU_PAIR_NEAR)
        return -1;                      /* an int32 pair past a 4 GiB boundary (mu_types.h) */
    if (hw && hw[lo] && v < b + 8 * (uint64_t)hw[lo] + 8)
        return -1;                      /* into a PyGC_Head (or before it): a GC link or a stale
                                         * copy of one; references point at the object after it */
    return (int64_t)lo;
}

/* The lookup of v (page_search's answer) when v lies between the allocations g - 1 and g + 2
 * (g: the last one hit; a block's pointers and its neighbours' often go to the blocks next to
 * it: an array's to the nodes allocated after it, a list's to the block before), else
 * NEAR_MISS: it must be looked up. */
#define NEAR_MISS (-2)
#define NEAR_RUN 8

static inline int64_t near_search(const mu_scan_index *ix, const uint8_t *hw, uint64_t g,
                                  uint64_t v)
{
    uint64_t a = g ? g - 1 : 0, e = g + 3 < ix->n ? g + 3 : ix->n;
    if (v < ix->begin[a] || (e < ix->n && v >= ix->begin[e]))
        return NEAR_MISS;
    uint64_t lo = a;
    while (lo + 1 < e && ix->begin[lo + 1] <= v)
        lo++;
    return hit_rules(ix, hw, lo, v);
}

static inline const uint8_t *head_words(const mu_scan_index *ix)
{
    return ix->dead ? ix->dead->head_word : NULL;
}

static inline const uint32_t *page_of(const mu_scan_index *ix, uint64_t r, uint64_t v)
{
    return ix->page + ix->page_off[r] + ((v - ix->heap[r].base) >> ix->shift);
}

/* Looks up nv <= SCAN_BATCH values that passed the [lo, hi) filter, in stages so that their
 * cache misses overlap: page entries, then begin and size entries, then the searches.
 * out[k] = allocation index or -1. */
static inline void find_batch(mu_scan_index *ix, const uint64_t *vals, uint64_t nv, int64_t *out)
{
    const uint32_t *pg[SCAN_BATCH];
    const uint64_t nheap = ix->nheap;
    const uint8_t *hw = head_words(ix);
    for (uint64_t k = 0; k < nv; k++) {
        uint64_t r = region_find(ix, vals[k]);
        pg[k] = r == nheap ? NULL : page_of(ix, r, vals[k]);
        __builtin_prefetch(pg[k]);      /* (a prefetch of NULL is harmless) */
    }
    for (uint64_t k = 0; k < nv; k++) {
        if (pg[k]) {
            __builtin_prefetch(&ix->begin[pg[k][0]]);
            __builtin_prefetch(&ix->size[pg[k][0]]);
            if (hw)
                __builtin_prefetch(&hw[pg[k][0]]);
        }
    }
    for (uint64_t k = 0; k < nv; k++)
        out[k] = pg[k] ? page_search(ix, hw, pg[k], vals[k]) : -1;
}

int64_t mu_scan_index_find(mu_scan_index *ix, uint64_t v)
{
    if (v - ix->lo >= ix->hi - ix->lo)
        return -1;
    uint64_t r = region_find(ix, v);
    if (r == ix->nheap)
        return -1;
    return page_search(ix, head_words(ix), page_of(ix, r, v), v);
}

int mu_value_target_native(mu_scan_index *ix, const mu_dead *d, uint64_t v)
{
    if (v - ix->lo >= ix->hi - ix->lo || !ix->rmap[(v >> RMAP_SHIFT) & ix->rmask])
        return 0;
    int64_t a = mu_scan_index_find(ix, v);
    if (a < 0)
        return 0;
    if (d->head_word && d->head_word[a])
        return 0;               /* a GC object */
    uint64_t b = ix_begin(ix, a), len = ix_end(ix, a) - b;
    if (v - b > MU_HANDLE_SLACK)
        return 0;               /* deep inside a block: a number, no handle (mu_types.h) */
    const mu_region *reg = &ix->heap[region_find(ix, b)];
    uint8_t buf[64];
    const uint8_t *p = buf;
    uint64_t have = len < sizeof buf ? len : sizeof buf;
    if (reg->uncopied) {        /* the low-memory mark: its header read on demand */
        if (pread(reg->fd, buf, have, (off_t)b) != (ssize_t)have)
            return 1;           /* unreadable: a reference, as a word would be */
    } else {
        p = reg->data + (b - reg->base);
    }
    mu_rules r;
    mu_rules_search(d, p, have, &r);
    for (uint32_t f = r.found; f; f &= f - 1)
        if (mu_plausible_refcnt(r.rc[__builtin_ctz(f)]))
            return 0;           /* an object of a known type */
    return 1;
}

/* Stores in out[k] the allocation containing vals[k], or -1 (any nv; batched lookups). */
void mu_scan_index_find_many(mu_scan_index *ix, const uint64_t *vals, uint64_t nv, int64_t *out)
{
    uint64_t cand[SCAN_BATCH], pos[SCAN_BATCH];
    int64_t res[SCAN_BATCH];
    uint64_t nc = 0;
    for (uint64_t k = 0; k <= nv; k++) {
        if (k < nv) {
            out[k] = -1;
            if (vals[k] - ix->lo < ix->hi - ix->lo) {
                cand[nc] = vals[k];
                pos[nc++] = k;
            }
        }
        if (nc == SCAN_BATCH || (k == nv && nc)) {
            find_batch(ix, cand, nc, res);
            for (uint64_t j = 0; j < nc; j++)
                out[pos[j]] = res[j];
            nc = 0;
        }
    }
}

uint64_t mu_scan_index_region_of(const mu_scan_index *ix, uint64_t i)
{
    /* last region with first_alloc[r] <= i < first_alloc[r+1]: branch-free halving over a
     * table that stays in L1 (called once per scanned allocation) */
    const uint64_t *fa = ix->first_alloc;
    uint64_t lo = 0, len = ix->nheap;
    while (len > 1) {
        uint64_t half = len >> 1;
        lo = fa[lo + half] <= i ? lo + half : lo;
        len -= half;
    }
    return lo;
}

/* An exact hash of mu_dead's types, for the type rules of every scanned block (up to four
 * object offsets a block): slot[h] = 1 + the type's index in d->types, 0 empty; linear probing,
 * at most a quarter full, so most probes (no type: an empty slot) cost one load. The same
 * answers as mu_rules_search's binary search, in a fraction of its time (a Python heap's blocks
 * nearly all start with a listed type's neighbours, which no cheaper filter tells apart). */
typedef struct {
    uint32_t *slot;
    uint32_t bits;
    uint32_t offsets;       /* bit k: some type's object offset is 16k (the others need no probe) */
    const uint64_t *types;  /* d->types: (type, code) pairs */
} type_hash;

static inline uint64_t type_slot(uint64_t tp, uint32_t bits)
{
    return (tp * 0x9E3779B97F4A7C15ull) >> (64 - bits);
}

/* Builds th over d's types. Returns 0 or -ENOMEM (release with free(th->slot)). */
static int64_t type_hash_init(type_hash *th, const mu_dead *d)
{
    if (d->ntypes >= (1ull << 28))
        return -ENOMEM;
    uint32_t bits = 6;
    while ((1ull << bits) < 4 * d->ntypes)
        bits++;
    th->bits = bits;
    th->offsets = 0;
    th->types = d->types;
    th->slot = calloc(1ull << bits, sizeof *th->slot);
    if (!th->slot)
        return -ENOMEM;
    uint64_t mask = (1ull << bits) - 1;
    for (uint64_t k = 0; k < d->ntypes; k++) {
        uint64_t h = type_slot(d->types[2 * k], bits);
        while (th->slot[h])
            h = (h + 1) & mask;
        th->slot[h] = (uint32_t)(k + 1);
        uint64_t off = d->types[2 * k + 1] & 0xff;
        if (off <= 48 && !(off & 15))
            th->offsets |= 1u << (off >> 4);
    }
    return 0;
}

/* mu_rules_search's result for the block at p (have readable bytes), through th. */
static inline void rules_hash(const type_hash *th, const uint8_t *p, uint64_t have, mu_rules *r)
{
    uint64_t mask = (1ull << th->bits) - 1, nk = have >= 64 ? 4 : have >> 4;
    r->found = 0;
    r->have = have;
    for (uint64_t k = 0; k < nk; k++) {     /* the object offsets 0, 16, 32, 48 */
        if (!(th->offsets >> k & 1))
            continue;
        uint64_t tp = mu_ld64(p + 16 * k + 8), h = type_slot(tp, th->bits);
        for (uint32_t s; (s = th->slot[h]) != 0; h = (h + 1) & mask) {
            if (th->types[2 * (uint64_t)(s - 1)] != tp)
                continue;
            uint64_t code = th->types[2 * (uint64_t)(s - 1) + 1];
            if ((code & 0xff) == 16 * k) {
                r->found |= 1u << k;
                r->rc[k] = mu_ld64(p + 16 * k);
                r->code[k] = code;
            }
            break;
        }
    }
}

/* The allocations of uncopied regions that pend for the next wave of the low-memory mark: a
 * bit per allocation and a summary bit per 64 of them, so that a wave visits them in ascending
 * order (their address order) in time proportional to their number, without a sort and at
 * n / 8 bytes (a list of them and its sort took 12 bytes per pending allocation: 69 MB of the
 * sweeper's peak for 5.7 M pending nodes of 4 KiB pointer arrays). */
typedef struct {
    uint64_t *bit;          /* (n + 63) / 64 words */
    uint64_t *sum;          /* bit w: bit[w] may be nonzero */
    uint64_t nsum;
} pend_set;

static int pend_init(pend_set *s, uint64_t n)
{
    uint64_t nw = (n + 63) / 64;
    s->nsum = (nw + 63) / 64;
    s->bit = calloc(nw ? nw : 1, sizeof *s->bit);
    s->sum = calloc(s->nsum ? s->nsum : 1, sizeof *s->sum);
    return s->bit && s->sum ? 0 : -ENOMEM;
}

static void pend_free(pend_set *s)
{
    free(s->bit);
    free(s->sum);
}

/* Adds allocation i (atomic: several mark threads add at once). */
static inline void pend_add(pend_set *s, uint64_t i)
{
    uint64_t w = i >> 6;
    __atomic_fetch_or(&s->bit[w], 1ull << (i & 63), __ATOMIC_RELAXED);
    __atomic_fetch_or(&s->sum[w >> 6], 1ull << (w & 63), __ATOMIC_RELAXED);
}

/* The first member >= i and < end, or end (nobody adds meanwhile). */
static uint64_t pend_next(const pend_set *s, uint64_t i, uint64_t end)
{
    if (i >= end)
        return end;
    uint64_t w = i >> 6, m = s->bit[w] >> (i & 63);
    if (m)
        return i + __builtin_ctzll(m) < end ? i + __builtin_ctzll(m) : end;
    uint64_t last = (end - 1) >> 6;     /* the last word that may hold a member below end */
    for (w++; w <= last;) {
        uint64_t sm = s->sum[w >> 6] >> (w & 63);
        if (!sm) {
            w = (w | 63) + 1;
            continue;
        }
        w += __builtin_ctzll(sm);
        if (w > last)
            break;
        if (s->bit[w]) {
            uint64_t j = 64 * w + __builtin_ctzll(s->bit[w]);
            return j < end ? j : end;
        }
        w++;
    }
    return end;
}

static inline int pend_has(const pend_set *s, uint64_t i)
{
    return s->bit[i >> 6] >> (i & 63) & 1;
}

/* Empties s (the words its summary names). */
static void pend_clear(pend_set *s)
{
    for (uint64_t k = 0; k < s->nsum; k++) {
        for (uint64_t sm = s->sum[k]; sm; sm &= sm - 1)
            s->bit[64 * k + __builtin_ctzll(sm)] = 0;
        s->sum[k] = 0;
    }
}

/* Work shared by the mark threads: a pool of allocations to scan (under mu), fed by a thread
 * whose own stack is deep while another waits for work. The mark ends when every thread waits
 * and the pool is empty. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint32_t *pool;
    uint64_t npool;
    int nthreads;           /* threads taking part */
    int idle;               /* threads waiting for work */
    int waiting;            /* idle, read without the lock as a hint */
    int done;
} mark_shared;

/* The kept candidates of an uncopied region's pieces, looked up (mu_cands): per piece, the
 * allocation each candidate hits (PIECE_NO_HIT: none), found for the whole piece at the first
 * scan of one of its blocks, in full batches. A mark that follows a linked list meets one or
 * two candidates a step: looked up as they came, each waited for its own lookup (a list of
 * 5 M blocks in 8 chains: 115 ns a step). */
#define PIECE_NO_HIT UINT32_MAX
#define PIECE_MET_BITS 10
#define PIECE_MET (1u << PIECE_MET_BITS)
enum { TARGETS_NONE = 0, TARGETS_FINDING = 1, TARGETS_READY = 2, TARGETS_FAILED = 3 };
typedef struct {
    uint32_t **hit;         /* per piece: its candidates' allocations, or NULL */
    int32_t *state;         /* per piece: TARGETS_* (atomic) */
} piece_targets;

typedef struct {
    mu_scan_index *ix;      /* this thread's copy: its lookup cache (last_region) is private */
    mu_scan_index ix_own;
    mark_shared *sh;
    const uint64_t *size;
    const mu_dead *dead;
    const type_hash *th;        /* dead's types (NULL when dead has none) */
    uint8_t *marked;
    uint32_t *stack;
    uint64_t sp;
    uint64_t marks;
    uint64_t words;
    uint64_t heap_bytes;
    uint64_t cand[SCAN_BATCH];  /* filtered values waiting for a batched lookup */
    /* Values looked up (or queued) lately, direct-mapped by a hash: a value met again is
     * skipped, since its lookup's outcome cannot change (a hit stays marked; a miss depends on
     * the value alone). A Python heap repeats values heavily (ob_type, None, small ints, a
     * module's dict): about half the lookups are repeats. Empty slots hold UINT64_MAX, which
     * never passes the [lo, hi) filter. */
    uint64_t seen[1u << SCAN_SEEN_BITS];
    uint64_t nc;
    pthread_t tid;
    int running;            /* tid was started and must be joined */
    /* low-memory mark: allocations of uncopied regions marked, scanned in the next wave */
    pend_set *pend;         /* the next wave (shared by the threads) */
    uint64_t npend;         /* allocations this thread added to it */
    uint8_t *rbuf;          /* WAVE_READ bytes: one read of a wave */
    int64_t err;            /* the first read error (-errno; -EIO: bytes unreadable) */
    struct wave_shared_s *ws;
    const struct mark_copy_s *copy;     /* nheap entries once the mark copied (else NULL) */
    uint64_t reads;         /* reads of the waves, and their bytes */
    uint64_t read_bytes;
    uint64_t copied_bytes;  /* bytes read into the copy */
    int plain_rules;        /* dead has no object rules (types, dict_keys, debug_hooks,
                             * head_word) */
    int shared_marks;       /* other threads mark too: marked[] is set by atomic exchange */
    const uint64_t *dead_in;    /* bit i: a dead range meets allocation i (NULL: no ranges) */
    /* the fresh rule (mu_dead.fresh): each candidate's word address (0: a register) */
    uint64_t cand_at[SCAN_BATCH];
    const mu_dead *fr;          /* dead when it has the rule, else NULL */
    uint8_t *rejected;          /* allocations a stale word pointed at (n bytes) */
    uint64_t nodedup;           /* 1: every word is looked up (no cache of values met) */
    uint64_t stale;             /* hits ignored by the rule */
    piece_targets *targets;     /* nheap entries (uncopied regions with candidates), or NULL */
} mark_ctx;

/* Whether a dead range may meet allocation i: its bit in dead_in (always when there is no
 * bitmap). A block without it is scanned without a search of the ranges. */
static inline int dead_may_meet(const mark_ctx *m, uint64_t i)
{
    return !m->dead_in || (m->dead_in[i >> 6] >> (i & 63) & 1);
}

/* Whether scan_cands must search the dead ranges for allocation i (and may leave it to the
 * byte scan): there are ranges and one may meet it. A leaf is counted unscanned only when not. */
static inline int dead_ranges_meet(const mark_ctx *m, uint64_t i)
{
    return m->dead && m->dead->nranges && dead_may_meet(m, i);
}

/* The slot of the cache of values met (mark_ctx.seen) that value v maps to. */
static inline uint64_t *seen_slot(uint64_t *seen, uint64_t v)
{
    return &seen[(v * 0x9E3779B97F4A7C15ull) >> (64 - SCAN_SEEN_BITS)];
}

/* Moves half of m's stack to the pool when another thread waits for work and the stack holds
 * at least `least` allocations. */
static void share_work_from(mark_ctx *m, uint64_t least)
{
    mark_shared *sh = m->sh;
    if (!__atomic_load_n(&sh->waiting, __ATOMIC_RELAXED) || m->sp < least)
        return;
    pthread_mutex_lock(&sh->mu);
    uint64_t give = m->sp / 2;
    memcpy(sh->pool + sh->npool, m->stack + (m->sp - give), give * sizeof(uint32_t));
    sh->npool += give;
    m->sp -= give;
    pthread_cond_broadcast(&sh->cv);
    pthread_mutex_unlock(&sh->mu);
}

/* share_work_from with a stack deep enough to keep full batches on both sides. */
static void share_work(mark_ctx *m)
{
    share_work_from(m, 2 * SCAN_POP);
}

/* The level of the unwritten range holding address a (mu_dead), 0 when none does. */
static uint64_t unwritten_level(const mu_dead *d, uint64_t a)
{
    const uint64_t *u = d->unwritten;
    uint64_t k = mu_first_ending_after(u, d->nunwritten, 3, a);
    return k < d->nunwritten && u[3 * k] <= a ? u[3 * k + 2] : 0;
}

/* The fresh rule over a batch's hits: a hit on a fresh allocation from an unwritten word (not
 * a register's: address 0) is dropped, its allocation noted, and the value forgotten by the
 * cache of values met (a later copy of it elsewhere is looked up again). */
static void drop_stale(mark_ctx *m, int64_t *hit)
{
    const mu_dead *d = m->fr;
    for (uint64_t k = 0; k < m->nc; k++) {
        int64_t a = hit[k];
        if (a < 0 || !d->fresh[a] || !m->cand_at[k])
            continue;
        uint64_t u = unwritten_level(d, m->cand_at[k]);
        if (!u || u > d->fresh[a])
            continue;
        hit[k] = -1;
        __atomic_store_n(&m->rejected[a], 1, __ATOMIC_RELAXED);
        m->stale++;
        uint64_t v = m->cand[k];
        uint64_t *slot = seen_slot(m->seen, v);
        if (*slot == v)
            *slot = UINT64_MAX;
    }
}

/* Pushes allocation a, just marked, to be scanned; unless it is a leaf (mu_scan_index.leaf)
 * that scan_cands would scan without a dead range in the way: a scan that would find nothing,
 * of which only the statistics are counted (an array's 500 small nodes: 40% of its mark went
 * to popping and scanning them). */
static inline void push_marked(mark_ctx *m, uint64_t a)
{
    m->marks++;
    const uint64_t *leaf = m->ix->leaf;
    if (leaf && (leaf[a >> 6] >> (a & 63) & 1) && m->plain_rules && !m->copy
        && !dead_ranges_meet(m, a)) {
        m->words += m->size[a] / 8;
        m->heap_bytes += m->size[a];
        return;
    }
    m->stack[m->sp++] = (uint32_t)a;
}

/* Looks up the pending candidates; marks and pushes the allocations newly hit. */
static void flush(mark_ctx *m)
{
    int64_t hit[SCAN_BATCH];
    find_batch(m->ix, m->cand, m->nc, hit);
    if (m->fr)
        drop_stale(m, hit);
    for (uint64_t k = 0; k < m->nc; k++)
        if (hit[k] >= 0)
            __builtin_prefetch(&m->marked[hit[k]]);
    if (!m->shared_marks) {             /* the only mark thread: plain loads and stores */
        for (uint64_t k = 0; k < m->nc; k++) {
            int64_t a = hit[k];
            if (a < 0 || m->marked[a])
                continue;
            m->marked[a] = 1;
            push_marked(m, (uint64_t)a);
        }
        m->nc = 0;
        return;
    }
    for (uint64_t k = 0; k < m->nc; k++) {
        int64_t a = hit[k];
        if (a < 0 || __atomic_load_n(&m->marked[a], __ATOMIC_RELAXED))
            continue;
        if (__atomic_exchange_n(&m->marked[a], 1, __ATOMIC_RELAXED))
            continue;                   /* another mark thread took it first */
        push_marked(m, (uint64_t)a);
    }
    m->nc = 0;
    if (m->sh)
        share_work(m);      /* inside a long scan too (a table of a million pointers) */
}

/* Marks allocation a and pushes it, unless it is marked (as flush does for a hit). */
static inline void mark_hit(mark_ctx *m, uint32_t a)
{
    if (!m->shared_marks) {
        if (m->marked[a])
            return;
        m->marked[a] = 1;
    } else if (__atomic_load_n(&m->marked[a], __ATOMIC_RELAXED)
               || __atomic_exchange_n(&m->marked[a], 1, __ATOMIC_RELAXED)) {
        return;
    }
    push_marked(m, a);
}

/* Marks the allocations whose marked[] bytes are the lanes of mask (bit 0 of each byte) in the
 * aligned 8-byte word w of marked[] and pushes those newly marked: one atomic OR for up to 8
 * neighbouring allocations (a 4 KiB array's 500 pointers to the small blocks after it: an
 * exchange per block was a quarter of that mark), none when all are marked. */
static void mark_word(mark_ctx *m, uint64_t *w, uint64_t mask)
{
    uint64_t old = __atomic_load_n(w, __ATOMIC_RELAXED);
    if ((old & mask) == mask)
        return;
    if (!m->shared_marks)
        *w = old | mask;
    else
        old = __atomic_fetch_or(w, mask, __ATOMIC_RELAXED);
    uint64_t first = (uint64_t)((uint8_t *)w - m->marked);
    for (uint64_t fresh = mask & ~old; fresh; fresh &= fresh - 1)
        push_marked(m, first + ((uint64_t)__builtin_ctzll(fresh) >> 3));
}

/* The aligned 8-byte word of marked[] holding allocation a's byte (NULL when it reaches past
 * marked[]), and a's lane in it (bit 0 of its byte). */
static inline uint64_t *mark_word_of(const mark_ctx *m, uint32_t a, uint64_t *lane)
{
    uint8_t *at = m->marked + a;
    uint64_t *w = (uint64_t *)((uintptr_t)at & ~(uintptr_t)7);
    *lane = 1ull << (8 * ((uintptr_t)at & 7));
    return (uint8_t *)w < m->marked || (uint8_t *)w + 8 > m->marked + m->ix->n ? NULL : w;
}

/* The allocations piece k of region r's candidates hit (piece_targets), found now when no
 * thread did; NULL while another thread finds them, or out of memory (the caller looks its
 * candidates up as they come). */
static const uint32_t *piece_hits(mark_ctx *m, uint64_t r, uint64_t k, const mu_cand_piece *p)
{
    piece_targets *pt = &m->targets[r];
    int32_t st = __atomic_load_n(&pt->state[k], __ATOMIC_ACQUIRE), none = TARGETS_NONE;
    if (st == TARGETS_READY)
        return pt->hit[k];
    if (st != TARGETS_NONE || !__atomic_compare_exchange_n(&pt->state[k], &none, TARGETS_FINDING,
                                                           0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return NULL;
    uint32_t *hit = malloc((p->n ? p->n : 1) * sizeof *hit);
    if (!hit) {
        __atomic_store_n(&pt->state[k], TARGETS_FAILED, __ATOMIC_RELEASE);
        return NULL;
    }
    /* a value met before in the piece (a block's fill, a shared target) is looked up once:
     * its first candidate's index, direct-mapped; a repeat of a value still in the batch
     * waits for its lookup. A value between the neighbours of the last allocation hit is
     * found there (near_search); after NEAR_RUN such finds in a row, a value that is not is
     * looked up at once, so that the next ones are searched near it too (an array's first
     * pointer after the last one's node); else it waits for a batch (a block's pointers to the
     * one before it and to a random one: a lookup at once of every random one made that mark
     * a third slower) */
    const mu_scan_index *ix = m->ix;
    const uint8_t *hw = head_words(ix);
    uint64_t vals[SCAN_BATCH], pos[SCAN_BATCH], nv = 0, again[SCAN_BATCH][2], na = 0;
    uint64_t met_v[PIECE_MET], done = 0;        /* hit[] is final below done */
    uint64_t g = UINT64_MAX;                    /* the last allocation hit (none yet) */
    uint64_t near = NEAR_RUN;                   /* near finds in a row */
    int try_near = 0;                           /* g is the last lookup's (or a batch's) */
    uint32_t met_j[PIECE_MET];
    int64_t res[SCAN_BATCH];
    memset(met_v, 0xff, sizeof met_v);
    for (uint64_t j = 0; j <= p->n; j++) {
        if (j < p->n) {
            uint64_t v = p->val[j];
            hit[j] = PIECE_NO_HIT;
            uint64_t h = (v * 0x9E3779B97F4A7C15ull) >> (64 - PIECE_MET_BITS);
            int64_t r = NEAR_MISS;
            if (v - ix->lo >= ix->hi - ix->lo) {
                /* no allocation: PIECE_NO_HIT */
            } else if (met_v[h] == v && met_j[h] < done) {
                hit[j] = hit[met_j[h]];
            } else if (met_v[h] == v) {
                again[na][0] = j;
                again[na++][1] = met_j[h];
            } else {
                met_v[h] = v;
                met_j[h] = (uint32_t)j;
                if ((try_near && (r = near_search(ix, hw, g, v)) != NEAR_MISS)
                    || near >= NEAR_RUN) {          /* final now: a repeat waits for done */
                    int found_near = r != NEAR_MISS;
                    if (!found_near)
                        find_batch(m->ix, &v, 1, &r);       /* at once */
                    near = found_near && r >= 0 ? near + 1 : 0;
                    try_near = r >= 0;
                    if (r >= 0)
                        hit[j] = (uint32_t)(g = (uint64_t)r);
                } else {
                    near = try_near = 0;    /* g is not this value's neighbour's: no near
                                             * search until a batch finds another */
                    vals[nv] = v;
                    pos[nv++] = j;
                }
            }
        }
        if (nv == SCAN_BATCH || na == SCAN_BATCH || (j == p->n && (nv || na))) {
            find_batch(m->ix, vals, nv, res);
            for (uint64_t q = 0; q < nv; q++)
                if (res[q] >= 0)
                    hit[pos[q]] = (uint32_t)(g = (uint64_t)res[q]);
            try_near = g != UINT64_MAX;
            for (uint64_t q = 0; q < na; q++)
                hit[again[q][0]] = hit[again[q][1]];
            nv = na = 0;
            done = j + 1;
        }
    }
    pt->hit[k] = hit;
    __atomic_store_n(&pt->state[k], TARGETS_READY, __ATOMIC_RELEASE);
    return hit;
}

/* Queues v for a lookup when it may be in a heap region ([lo, hi) and the region map) and was
 * not met lately. Branch-free but for a full batch: whether a word of a Python heap passes is
 * close to a coin toss, which a branch would mispredict. */
static inline __attribute__((always_inline)) void consider(mark_ctx *m, uint64_t v, uint64_t at)
{
    const mu_scan_index *ix = m->ix;
    uint64_t *slot = seen_slot(m->seen, v);
    uint64_t old = *slot;
    uint64_t in = (uint64_t)(v - ix->lo < ix->hi - ix->lo)
                  & (uint64_t)(ix->rmap[(v >> RMAP_SHIFT) & ix->rmask] != 0);
    *slot = old ^ ((old ^ v) & (0 - in));
    m->cand[m->nc] = v;
    m->cand_at[m->nc] = at;
    m->nc += in & ((uint64_t)(old != v) | m->nodedup);
    if (m->nc == SCAN_BATCH)
        flush(m);
}

/* consider() over the nw words at p, in two passes per chunk of SCAN_CHUNK words: the
 * [lo, hi) filter alone (most words of a heap are no address in it), then the region map and
 * the cache of values met lately for the words that passed. The same candidates, in the same
 * order. */
#define SCAN_CHUNK 64u

/* before: how many words before p[0] (0-2) lie in the same allocation or range, for the text
 * tails' tests. */
static inline void consider_words(mark_ctx *m, const uint8_t *p, uint64_t nw, uint64_t before,
                                  uint64_t a0)
{
    const mu_scan_index *ix = m->ix;
    const uint64_t lo = ix->lo, span = ix->hi - ix->lo, rmask = ix->rmask;
    const uint16_t *rmap = ix->rmap;
    uint64_t *seen = m->seen, *cand = m->cand, *cand_at = m->cand_at, nodedup = m->nodedup;
    uint64_t buf[SCAN_CHUNK];
    uint32_t at[SCAN_CHUNK];
    for (uint64_t w0 = 0; w0 < nw; w0 += SCAN_CHUNK) {
        uint64_t w1 = nw - w0 < SCAN_CHUNK ? nw : w0 + SCAN_CHUNK, k = 0;
        for (uint64_t w = w0; w < w1; w++) {
            uint64_t v = mu_ld64(p + 8 * w);
            buf[k] = v;
            at[k] = (uint32_t)(w - w0);
            k += v - lo < span;
        }
        uint64_t nc = m->nc;
        for (uint64_t j = 0; j < k; j++) {
            uint64_t v = buf[j], w = w0 + at[j];
            if (__builtin_expect(mu_tail_shape(v), 0)
                && w + before && mu_text_runs_on(mu_ld64(p + 8 * w - 8)))
                continue;                   /* a text tail (mu_text_tail) */
            if (__builtin_expect(mu_aligned_tail_bytes(v), 0) && w + before >= 2
                && mu_text_tail_aligned(mu_ld64(p + 8 * w - 16), mu_ld64(p + 8 * w - 8), v))
                continue;                   /* an 8-aligned text tail */
            uint64_t *slot = seen_slot(seen, v);
            uint64_t old = *slot;
            uint64_t in = rmap[(v >> RMAP_SHIFT) & rmask] != 0;
            *slot = old ^ ((old ^ v) & (0 - in));
            cand[nc] = v;
            cand_at[nc] = a0 + 8 * w;
            nc += in & ((uint64_t)(old != v) | nodedup);
            if (__builtin_expect(nc == SCAN_BATCH, 0)) {
                m->nc = nc;
                flush(m);
                nc = m->nc;
            }
        }
        m->nc = nc;
    }
}

/* Scans [addr, addr+len) whose bytes are at data; avail (>= len) bytes are readable there.
 * hb/he: GC-link words to ignore (0, 0: none); dead's ranges are ignored too (dead: the index's,
 * or NULL when none of them meets the range). */
static void scan_range(mark_ctx *m, const uint8_t *data, uint64_t addr, uint64_t len, uint64_t avail,
                       uint64_t hb, uint64_t he, uint64_t zb, uint64_t ze, uint64_t zs,
                       const mu_dead *dead)
{
    uint64_t skip = (8 - (addr & 7)) & 7;
    if (skip >= len)
        return;
    uint64_t end = addr + len;
    if (!dead && !hb && !ze) {      /* one run: the words from addr + skip to the end */
        uint64_t nw = (len - skip) >> 3;
        consider_words(m, data + skip, nw, 0, addr + skip);
        m->words += nw;
        if ((len - skip) & 7) {     /* a last word starting before the end: read whole */
            uint64_t v = 0, have = avail - skip - 8 * nw;
            memcpy(&v, data + skip + 8 * nw, have < 8 ? have : 8);
            consider(m, v, addr + skip + 8 * nw);
            m->words++;
        }
        return;
    }
    mu_live_iter it;
    mu_live_init(&it, dead, addr + skip, end, hb, he);
    mu_live_strided(&it, zb, ze, zs);
    uint64_t b, e;
    while (mu_live_next(&it, &b, &e)) {
        const uint8_t *p = data + (b - addr);
        uint64_t nw = (e - b) >> 3;
        if (e > end)
            nw--;                       /* the last word is partial */
        consider_words(m, p, nw, b >= addr + 16 ? 2 : (b - addr) / 8, b);
        m->words += nw;
        if (e > end) {                  /* a last word starting before the end: read whole */
            uint64_t v = 0, have = avail - (e - 8 - addr);
            memcpy(&v, p + 8 * nw, have < 8 ? have : 8);
            consider(m, v, e - 8);
            m->words++;
        }
    }
}

int64_t mu_scan_index_set_dead(mu_scan_index *ix, const mu_dead *dead)
{
    ix->dead = NULL;
    if (!dead)
        return 0;
    if (dead->nranges && !dead->ranges)
        return -EINVAL;
    for (uint64_t k = 0; k < dead->nranges; k++) {
        uint64_t b = dead->ranges[2 * k], e = dead->ranges[2 * k + 1];
        if (b >= e || (b & 7) || (e & 7) || (k && b < dead->ranges[2 * k - 1]))
            return -EINVAL;
    }
    if (dead->ntypes && !dead->types)
        return -EINVAL;
    for (uint64_t k = 0; k < dead->ntypes; k++)
        if ((k && dead->types[2 * k] <= dead->types[2 * k - 2])
            || (dead->types[2 * k + 1] & 0xff) > 48 || (dead->types[2 * k + 1] & 7)
            || ((dead->types[2 * k + 1] >> 8) & 0xff) > MU_TYPE_LAST)
            return -EINVAL;
    ix->dead = dead;
    return 0;
}

/* Refills m's empty stack from the pool, waiting while other threads work. Returns 0 when
 * the mark is over (every thread idle, nothing pooled). */
static int take_work(mark_ctx *m)
{
    mark_shared *sh = m->sh;
    pthread_mutex_lock(&sh->mu);
    sh->idle++;
    __atomic_store_n(&sh->waiting, sh->idle, __ATOMIC_RELAXED);
    while (!sh->npool && !sh->done) {
        if (sh->idle == sh->nthreads) {
            sh->done = 1;
            pthread_cond_broadcast(&sh->cv);
            break;
        }
        pthread_cond_wait(&sh->cv, &sh->mu);
    }
    int more = 0;
    if (sh->npool && !sh->done) {
        uint64_t take = (sh->npool + 1) / 2;
        memcpy(m->stack, sh->pool + (sh->npool - take), take * sizeof(uint32_t));
        sh->npool -= take;
        m->sp = take;
        more = 1;
    }
    sh->idle--;
    __atomic_store_n(&sh->waiting, sh->idle, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&sh->mu);
    return more;
}

/* Scans allocation i, whose bytes are at d (avail readable there). */
static inline void scan_block(mark_ctx *m, uint64_t i, const uint8_t *d, uint64_t avail)
{
    const mu_scan_index *ix = m->ix;
    const mu_dead *dead = m->dead;
    uint64_t b = ix_begin(ix, i), len = ix_end(ix, i) - b;
    if (len == 1)
        len = m->size[i];       /* 0 or 1: a zero-size allocation has no words */
    uint64_t hb, he;
    mu_rules rules, *r = NULL;
    if (m->th) {
        r = &rules;
        rules_hash(m->th, d, len < avail ? len : avail, r);
        if (mu_dead_object_r(r, d)) {   /* a dead object: its words are stale */
            uint64_t v[MU_VALUE_WORDS], at[MU_VALUE_WORDS];
            uint64_t nv = mu_value_handles(m->ix, dead, r, d, b, v, at);
            for (uint64_t k = 0; k < nv; k++)   /* or a value: native blocks' handles */
                consider(m, v[k], at[k]);
            return;
        }
    }
    uint64_t whole = len, zb, ze, zs;
    len = mu_live_end(dead, i, mu_live_len_r(dead, r, d, b, len, avail));
    mu_live_head(dead, r, i, b, d, whole, avail, &hb, &he, &zb, &ze, &zs);
    const mu_dead *dr = dead_may_meet(m, i) ? ix->dead : NULL;
    scan_range(m, d, b, len, avail, hb, he, zb, ze, zs, dr);
    m->heap_bytes += len;
}

/* Where a wave's read of allocation i (in region r) ends: its span and the next word (a last
 * partial word is read whole, as from a copy), within the region. */
static inline uint64_t wave_end(const mu_scan_index *ix, uint64_t r, uint64_t i)
{
    uint64_t e = ix_end(ix, i) + 8, re = ix->heap[r].base + ix->heap[r].len;
    return e < re ? e : re;
}

/* Whether the mark scans the bytes at address a of region reg from kept candidates (its
 * piece's were kept, and no object rule needs the bytes). */
static int cands_kept(const mark_ctx *m, const mu_region *reg, uint64_t a)
{
    const mu_cands *c = reg->cands;
    return c && m->plain_rules && a >= c->base && a < c->base + c->len
           && __atomic_load_n(&c->p[(a - c->base) >> MU_CAND_PIECE_SHIFT].state, __ATOMIC_ACQUIRE) == 1;
}

/* The copy the low-memory mark makes once its waves get small (mu_mark_policy): per uncopied
 * region, a private anonymous mapping of its length, filled a 1 MiB piece (MU_CAND_PIECE_SHIFT,
 * from the region's base) at a time when a wave first needs a block there, and each piece
 * released once every block touching it that was still to scan at the switch was scanned: a
 * list walked in address order holds about one piece per list. Pieces whose candidates were
 * kept are never copied (their blocks are scanned from the candidates). */
enum { PIECE_KEPT = -1, PIECE_TODO = 0, PIECE_READY = 1, PIECE_READING = 2, PIECE_FREED = 3 };
typedef struct mark_copy_s {
    uint8_t *data;          /* NULL: not an uncopied region */
    int32_t *state;         /* per piece: PIECE_* (atomic) */
    uint32_t *left;         /* per piece: blocks touching it still to scan (atomic) */
} mark_copy;

/* The pieces [*p0, *p1] that a wave's read of allocation i (region r) touches. */
static inline void pieces_of(const mu_scan_index *ix, uint64_t r, uint64_t i, uint64_t *p0,
                             uint64_t *p1)
{
    uint64_t base = ix->heap[r].base;
    *p0 = (ix_begin(ix, i) - base) >> MU_CAND_PIECE_SHIFT;
    *p1 = (wave_end(ix, r, i) - 1 - base) >> MU_CAND_PIECE_SHIFT;
}

/* The bytes of allocation i of uncopied region r in the mark's copy, from its start to the end
 * of the pieces it touches (*avail bytes, at least up to wave_end), or NULL when not copied. */
static const uint8_t *copied_at(const mark_ctx *m, uint64_t r, uint64_t i, uint64_t *avail)
{
    const mark_copy *c = m->copy ? &m->copy[r] : NULL;
    if (!c || !c->data)
        return NULL;
    const mu_region *reg = &m->ix->heap[r];
    uint64_t p0, p1;
    pieces_of(m->ix, r, i, &p0, &p1);
    for (uint64_t p = p0; p <= p1; p++)
        if (__atomic_load_n(&c->state[p], __ATOMIC_ACQUIRE) != PIECE_READY)
            return NULL;
    uint64_t b = ix_begin(m->ix, i);
    uint64_t pe = reg->base + ((p1 + 1) << MU_CAND_PIECE_SHIFT), re = reg->base + reg->len;
    *avail = (pe < re ? pe : re) - b;
    return c->data + (b - reg->base);
}

/* Reads into the copy the pieces allocation i (region r) touches that nobody read yet.
 * Returns 1 when they are all ready, 0 when one is kept, freed or being read by another
 * thread (the caller reads the block itself), or when a read failed (m->err). */
static int copy_fetch(mark_ctx *m, uint64_t r, uint64_t i)
{
    const mark_copy *c = &m->copy[r];
    const mu_region *reg = &m->ix->heap[r];
    uint64_t p0, p1;
    if (!c->data)
        return 0;
    pieces_of(m->ix, r, i, &p0, &p1);
    for (uint64_t p = p0; p <= p1; p++) {
        int32_t st = __atomic_load_n(&c->state[p], __ATOMIC_ACQUIRE), todo = PIECE_TODO;
        if (st == PIECE_READY)
            continue;
        if (st != PIECE_TODO || !__atomic_compare_exchange_n(&c->state[p], &todo, PIECE_READING, 0,
                                                             __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return 0;
        uint64_t off = p << MU_CAND_PIECE_SHIFT, first_bad = 0;
        uint64_t len = reg->len - off < (1ull << MU_CAND_PIECE_SHIFT) ? reg->len - off : 1ull << MU_CAND_PIECE_SHIFT;
        int64_t rc = mu_read_serial(reg->fd, reg->base + off, c->data + off, len, &first_bad);
        if (rc != 0) {
            m->err = rc < 0 ? rc : -EIO;
            return 0;
        }
        m->copied_bytes += len;
        __atomic_store_n(&c->state[p], PIECE_READY, __ATOMIC_RELEASE);
    }
    return 1;
}

/* Allocation i of uncopied region r was scanned after the switch: the pieces it touches that
 * no block still needs are released. */
static void copy_done(const mark_ctx *m, uint64_t r, uint64_t i)
{
    const mark_copy *c = &m->copy[r];
    const mu_region *reg = &m->ix->heap[r];
    uint64_t p0, p1;
    if (!c->data)
        return;
    pieces_of(m->ix, r, i, &p0, &p1);
    for (uint64_t p = p0; p <= p1; p++) {
        int32_t ready = PIECE_READY;
        if (__atomic_load_n(&c->state[p], __ATOMIC_ACQUIRE) == PIECE_KEPT
            || __atomic_sub_fetch(&c->left[p], 1, __ATOMIC_ACQ_REL) != 0
            || !__atomic_compare_exchange_n(&c->state[p], &ready, PIECE_FREED, 0,
                                            __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;
        uint64_t off = p << MU_CAND_PIECE_SHIFT;
        uint64_t len = reg->len - off < (1ull << MU_CAND_PIECE_SHIFT) ? reg->len - off : 1ull << MU_CAND_PIECE_SHIFT;
        madvise(c->data + off, len, MADV_DONTNEED);     /* advisory: an error keeps the pages */
    }
}

/* Scans allocation i of the uncopied region reg from its kept candidates (mu_cands): returns
 * 1 when done, 0 when it must be read (a piece not kept, a dead word or an object rule that may
 * apply, an unaligned or partial word). The candidates are the words of a byte scan that can
 * hit an allocation, in the same order; the others would hit nothing (and consider's cache of
 * values only skips repeats): the result and the statistics are the same. */
static int scan_cands(mark_ctx *m, uint64_t i, const mu_region *reg)
{
    const mu_cands *c = reg->cands;
    if (!c || !m->plain_rules)
        return 0;
    const mu_scan_index *ix = m->ix;
    uint64_t b = ix_begin(ix, i), len = ix_end(ix, i) - b;
    if (len == 1)
        len = m->size[i];
    if (!len)
        return 1;                       /* a zero-size allocation has no words */
    uint64_t e = b + len;
    if ((b & 7) || (len & 7) || b < c->base || e > c->base + c->len)
        return 0;
    if (dead_ranges_meet(m, i)) {      /* the byte scan decides */
        mu_live_iter it;
        uint64_t rb, re;
        mu_live_init(&it, m->dead, b, e, 0, 0);
        if (!mu_live_next(&it, &rb, &re) || rb != b || re < e)
            return 0;
    }
    uint64_t k0 = (b - c->base) >> MU_CAND_PIECE_SHIFT, k1 = (e - 1 - c->base) >> MU_CAND_PIECE_SHIFT;
    for (uint64_t k = k0; k <= k1; k++)
        if (__atomic_load_n(&c->p[k].state, __ATOMIC_ACQUIRE) != 1 || (k > k0 && c->p[k].head_tail))
            return 0;   /* not kept, or a piece starting inside it with a text tail's shape */
    for (uint64_t k = k0; k <= k1; k++) {
        const mu_cand_piece *p = &c->p[k];
        const uint32_t *hit = m->targets && m->targets[reg - m->ix->heap].hit
                              ? piece_hits(m, (uint64_t)(reg - m->ix->heap), k, p) : NULL;
        uint64_t pb = c->base + (k << MU_CAND_PIECE_SHIFT);
        uint64_t lo = b > pb ? b - pb : 0;
        uint64_t hi = e - pb < (1ull << MU_CAND_PIECE_SHIFT) ? e - pb : (1ull << MU_CAND_PIECE_SHIFT);
        /* the first candidate at lo or after, by halving inside lo's sub-page (a 4 KiB
         * array of 500 pointers has as many candidates in one: a walk through them for each
         * of the small blocks after it was most of a mark of such arrays) */
        uint64_t j = p->sub[lo >> MU_CAND_SUB_SHIFT], je = p->sub[(lo >> MU_CAND_SUB_SHIFT) + 1];
        while (j < je) {
            uint64_t mid = (j + je) >> 1;
            if (p->off[mid] < lo)
                j = mid + 1;
            else
                je = mid;
        }
        for (; j < p->n && p->off[j] < hi; j++) {
            uint32_t o = p->off[j];
            uint64_t at = pb + (o & ~3u);
            if (((o & 1) && at != b) || ((o & 2) && at >= b + 16))
                continue;   /* a text tail after a word (bit 0) or two (bit 1) of this block */
            if (hit) {
                uint32_t a = hit[j];
                if (a == PIECE_NO_HIT)
                    continue;
                if (!(j + 1 < p->n && hit[j + 1] == a + 1)) {
                    mark_hit(m, a);
                    continue;
                }
                /* hits of the allocations after a by the next candidates (an array of
                 * pointers to the nodes after it), inside a's word of marked[]: one
                 * mark_word for them all */
                uint64_t lane, mask, *w = mark_word_of(m, a, &mask);
                for (; w && j + 1 < p->n && hit[j + 1] == a + 1 && p->off[j + 1] < hi
                       && !(p->off[j + 1] & 3) && mark_word_of(m, a + 1, &lane) == w; j++, a++)
                    mask |= lane;
                if (w)
                    mark_word(m, w, mask);
                else
                    mark_hit(m, a);
            } else {
                consider(m, p->val[j], at);
            }
        }
    }
    m->words += len / 8;
    m->heap_bytes += len;
    if (m->sh)          /* a tree or a list scanned from resolved candidates goes depth first:
                         * its stack holds a few allocations, which an idle thread shares */
        share_work_from(m, 2);
    return 1;
}

/* The allocations that some dead range of d meets, as a bitmap of n bits (calloc'ed; NULL when d
 * has no ranges, or out of memory: *err -ENOMEM): a block without its bit is scanned without
 * a search of the ranges (most blocks, which made that search a tenth of a small mark). */
static uint64_t *dead_in_init(const mu_scan_index *ix, const mu_dead *d, int64_t *err)
{
    *err = 0;
    if (!d || !d->nranges || !ix->n)
        return NULL;
    uint64_t *bits = calloc((ix->n + 63) / 64, sizeof *bits);
    if (!bits) {
        *err = -ENOMEM;
        return NULL;
    }
    for (uint64_t k = 0; k < d->nranges; k++) {
        uint64_t rb = d->ranges[2 * k], re = d->ranges[2 * k + 1];
        uint64_t lo = 0, hi = ix->n;        /* the first allocation ending after rb */
        while (lo < hi) {
            uint64_t mid = (lo + hi) >> 1;
            if (ix_end(ix, mid) <= rb)
                lo = mid + 1;
            else
                hi = mid;
        }
        for (uint64_t i = lo; i < ix->n && ix_begin(ix, i) < re; i++)
            bits[i >> 6] |= 1ull << (i & 63);
    }
    return bits;
}

/* Worklist: pop up to SCAN_POP allocations, fetch their words together, scan them; look the
 * candidates up in batches. Each allocation is marked when pushed (by one thread: the atomic
 * exchange decides), so it is scanned at most once. */
static void mark_loop(mark_ctx *m)
{
    mu_scan_index *ix = m->ix;
    const mu_region *heap = ix->heap;
    uint64_t nheap = ix->nheap;
    for (;;) {
        if (m->sp == 0) {
            if (m->nc) {
                flush(m);
                continue;
            }
            if (!m->sh || !take_work(m))
                break;
            continue;
        }
        if (m->sh)
            share_work(m);
        uint32_t batch[SCAN_POP];
        const uint8_t *bdata[SCAN_POP];
        uint64_t bavail[SCAN_POP];     /* bytes readable from bdata[] */
        uint64_t bunc[SCAN_POP];       /* the block's region when uncopied, else UINT64_MAX */
        uint64_t nb = 0;
        while (nb < SCAN_POP && m->sp) {
            uint64_t i = batch[nb] = m->stack[--m->sp];
            uint64_t r = nheap == 1 ? 0 : region_find(ix, ix_begin(ix, i));
            uint64_t b = ix_begin(ix, i), len = ix_end(ix, i) - b;
            const uint8_t *d;
            bunc[nb] = heap[r].uncopied ? r : UINT64_MAX;
            if (heap[r].uncopied) {
                if (scan_cands(m, i, &heap[r])) {
                    if (m->copy)
                        copy_done(m, r, i);
                    continue;
                }
                if (!(d = copied_at(m, r, i, &bavail[nb]))) {
                    pend_add(m->pend, i);   /* read and scanned in the next wave */
                    m->npend++;
                    continue;
                }
            } else {
                d = heap[r].data + (b - heap[r].base);
                bavail[nb] = heap[r].base + heap[r].len - b;
            }
            bdata[nb++] = d;
            if (len > SCAN_PREFETCH_BYTES)
                len = SCAN_PREFETCH_BYTES;
            for (uint64_t o = 0; o < len; o += 64)
                __builtin_prefetch(d + o);
            __builtin_prefetch(d + len - 1);
        }
        for (uint64_t k = 0; k < nb; k++) {
            scan_block(m, batch[k], bdata[k], bavail[k]);
            if (bunc[k] != UINT64_MAX)
                copy_done(m, bunc[k], batch[k]);
        }
    }
}

static void *mark_thread(void *arg)
{
    mark_loop(arg);
    return NULL;
}

/* ---- the low-memory mark: waves over uncopied regions ------------------------------------
 * Allocations of uncopied regions are not scanned when popped: they pend. When the worklist
 * is empty, the pending allocations of every thread form a wave: sorted by address, cut into
 * batches, read in runs through the region's fd and scanned; what they reach is scanned at
 * once (copied regions) or pends for the next wave. Each allocation is still marked once and
 * scanned once, with the same bytes: the marked set and the statistics equal mu_mark's over
 * copies. */
typedef struct wave_shared_s {
    const pend_set *wave;
    const uint64_t *bstart;     /* batch b: the wave's allocations in [bstart[b], bstart[b + 1]) */
    uint64_t nbatch;
    uint64_t next;              /* next batch to take (atomic) */
} wave_shared;

/* Reads and scans the wave's allocations in [j0, j1) (ascending), then what they reach;
 * m->err on a failed read. */
static void wave_batch(mark_ctx *m, const pend_set *wave, uint64_t j0, uint64_t j1)
{
    mu_scan_index *ix = m->ix;
    uint64_t i = pend_next(wave, j0, j1);
    while (i < j1 && !m->err) {
        uint64_t r = mu_scan_index_region_of(ix, i), avail;
        const uint8_t *d = copied_at(m, r, i, &avail);
        if (!d && m->copy && copy_fetch(m, r, i))
            d = copied_at(m, r, i, &avail);
        if (m->err)
            return;
        if (d) {                /* in the copy (mu_mark_policy) */
            scan_block(m, i, d, avail);
            copy_done(m, r, i);
            mark_loop(m);
            i = pend_next(wave, i + 1, j1);
            continue;
        }
        const mu_region *reg = &ix->heap[r];
        uint64_t rb = ix_begin(ix, i), re = wave_end(ix, r, i);
        uint64_t i2 = pend_next(wave, i + 1, j1);      /* the first one not in this read */
        while (i2 < j1) {       /* one read for neighbours closer than WAVE_GAP */
            uint64_t b2 = ix_begin(ix, i2);
            if (b2 >= reg->base + reg->len || b2 > re + WAVE_GAP)
                break;
            uint64_t e2 = wave_end(ix, r, i2);
            if (e2 - rb > WAVE_READ)
                break;
            re = e2 > re ? e2 : re;
            i2 = pend_next(wave, i2 + 1, j1);
        }
        uint8_t *buf = m->rbuf, *own = NULL;
        if (re - rb > WAVE_READ) {      /* one allocation larger than the buffer */
            if (!(buf = own = malloc(re - rb))) {
                m->err = -ENOMEM;
                return;
            }
        }
        uint64_t first_bad = 0;
        int64_t rc = own ? mu_read_serial(reg->fd, rb, buf, re - rb, &first_bad)
                         : mu_read_present(reg->fd, rb, buf, re - rb, &first_bad);
        m->reads++;
        m->read_bytes += re - rb;
        if (rc != 0) {
            m->err = rc < 0 ? rc : -EIO;
            free(own);
            return;
        }
        for (uint64_t k = i; k < i2; k = pend_next(wave, k + 1, i2)) {
            uint64_t b2 = ix_begin(ix, k);
            scan_block(m, k, buf + (b2 - rb), re - b2);
            if (m->copy)
                copy_done(m, r, k);
        }
        free(own);
        mark_loop(m);           /* what they reach: copied ones now, uncopied ones pend */
        i = i2;
    }
}

static void *wave_thread(void *arg)
{
    mark_ctx *m = arg;
    wave_shared *ws = m->ws;
    for (;;) {
        uint64_t b = __atomic_fetch_add(&ws->next, 1, __ATOMIC_RELAXED);
        if (b >= ws->nbatch)
            return NULL;
        wave_batch(m, ws->wave, ws->bstart[b], ws->bstart[b + 1]);
    }
}

/* The bytes a copy of the uncopied regions would read: their pieces whose candidates were not
 * kept (all of them without candidates, or when object rules make candidates unusable). */
static uint64_t copy_budget(const mark_ctx *m)
{
    const mu_scan_index *ix = m->ix;
    uint64_t bytes = 0;
    for (uint64_t r = 0; r < ix->nheap; r++) {
        const mu_region *reg = &ix->heap[r];
        if (!reg->uncopied)
            continue;
        for (uint64_t pb = reg->base; pb < reg->base + reg->len; pb += 1ull << MU_CAND_PIECE_SHIFT) {
            uint64_t pe = pb + (1ull << MU_CAND_PIECE_SHIFT);
            if (!cands_kept(m, reg, pb))
                bytes += (pe < reg->base + reg->len ? pe : reg->base + reg->len) - pb;
        }
    }
    return bytes;
}

static void copy_free(mark_copy *cp, uint64_t nheap, const mu_region *heap)
{
    for (uint64_t r = 0; cp && r < nheap; r++) {
        if (cp[r].data)
            munmap(cp[r].data, heap[r].len);
        free(cp[r].state);
        free(cp[r].left);
    }
    free(cp);
}

/* The copy at the switch (mark_copy): nothing read yet; each piece not kept counts the blocks
 * touching it that are still to scan: the wave's (pending) and every unmarked one. Returns
 * it, or NULL on -ENOMEM. */
static mark_copy *copy_init(const mark_ctx *m, const pend_set *wave)
{
    const mu_scan_index *ix = m->ix;
    mark_copy *cp = calloc(ix->nheap ? ix->nheap : 1, sizeof *cp);
    for (uint64_t r = 0; cp && r < ix->nheap; r++) {
        const mu_region *reg = &ix->heap[r];
        if (!reg->uncopied || !reg->len)
            continue;
        uint64_t np = ((reg->len - 1) >> MU_CAND_PIECE_SHIFT) + 1;
        void *a = mmap(NULL, reg->len, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        cp[r].state = calloc(np, sizeof *cp[r].state);
        cp[r].left = calloc(np, sizeof *cp[r].left);
        cp[r].data = a == MAP_FAILED ? NULL : a;
        if (!cp[r].data || !cp[r].state || !cp[r].left) {
            copy_free(cp, ix->nheap, ix->heap);
            return NULL;
        }
        for (uint64_t p = 0; p < np; p++)
            if (cands_kept(m, reg, reg->base + (p << MU_CAND_PIECE_SHIFT)))
                cp[r].state[p] = PIECE_KEPT;
    }
    for (uint64_t i = 0; cp && i < ix->n; i++) {
        if (m->marked[i] && !pend_has(wave, i))
            continue;
        uint64_t r = mu_scan_index_region_of(ix, i), p0, p1;
        if (!cp[r].data)
            continue;
        pieces_of(ix, r, i, &p0, &p1);
        for (uint64_t p = p0; p <= p1; p++)
            cp[r].left[p] += cp[r].state[p] != PIECE_KEPT;
    }
    return cp;
}

/* Runs the waves until nothing pends (in ms[0].pend, which every thread adds to; spare: an
 * empty set, the one they add to during a wave). Returns 0 or the first error (-errno).
 * policy: when to copy the rest (mu_mark_policy; NULL: never); stats: the waves' figures. */
static int64_t mark_waves(mark_ctx *ms, int nt, uint64_t n, pend_set *spare,
                          const mu_mark_policy *policy, mu_mark_stats *st)
{
    uint64_t *bstart = big_alloc((n + 1) * sizeof(uint64_t));   /* touched: one per batch */
    int64_t err = 0;
    if (!bstart)
        err = -ENOMEM;
    for (int t = 0; !err && t < nt; t++) {
        ms[t].sh = NULL;
        if (!(ms[t].rbuf = malloc(WAVE_READ)))
            err = -ENOMEM;
    }
    mark_copy *cp = NULL;
    st->copy_budget = copy_budget(&ms[0]);
    while (!err) {
        uint64_t k = 0;
        pend_set *wave = ms[0].pend;
        for (int t = 0; t < nt; t++) {
            k += ms[t].npend;
            ms[t].npend = 0;
            ms[t].pend = spare;         /* what this wave reaches pends for the next */
        }
        if (!k)
            break;
        /* the charges so far and this wave's: past the copy's bytes, copy the rest */
        uint64_t reads = 0;
        for (int t = 0; t < nt; t++)
            reads += ms[t].reads;
        if (policy && !cp && st->copy_budget) {
            unsigned __int128 o = (unsigned __int128)(st->waves + 1) * policy->wave_cost
                                  + (unsigned __int128)reads * policy->read_cost;
            st->overhead = o > UINT64_MAX ? UINT64_MAX : (uint64_t)o;
            if (st->overhead >= st->copy_budget && (policy->wave_cost || policy->read_cost)) {
                if (!(cp = copy_init(&ms[0], wave))) {
                    err = -ENOMEM;
                    break;
                }
                st->switch_wave = st->waves + 1;
                for (int t = 0; t < nt; t++)
                    ms[t].copy = cp;
            }
        }
        st->waves++;
        /* batches of about WAVE_BATCH bytes of address space */
        const mu_scan_index *ix = ms[0].ix;
        uint64_t nb = 0, a0 = 0;
        for (uint64_t i = pend_next(wave, 0, n); i < n; i = pend_next(wave, i + 1, n)) {
            uint64_t b = ix_begin(ix, i);
            if (nb == 0 || b - a0 > WAVE_BATCH) {
                bstart[nb++] = i;
                a0 = b;
            }
        }
        bstart[nb] = n;
        wave_shared ws = {wave, bstart, nb, 0};
        int run = nb > 1 ? nt : 1;
        for (int t = 0; t < run; t++)
            ms[t].ws = &ws;
        for (int t = 1; t < run; t++)
            ms[t].running = pthread_create(&ms[t].tid, NULL, wave_thread, &ms[t]) == 0;
        wave_thread(&ms[0]);
        for (int t = 1; t < run; t++)
            if (ms[t].running) {
                pthread_join(ms[t].tid, NULL);
                ms[t].running = 0;
            }
        for (int t = 0; t < nt; t++)
            if (ms[t].err && !err)
                err = ms[t].err;
        pend_clear(wave);
        spare = wave;
    }
    for (int t = 0; t < nt; t++) {
        free(ms[t].rbuf);
        ms[t].rbuf = NULL;
        ms[t].copy = NULL;
        st->reads += ms[t].reads;
        st->read_bytes += ms[t].read_bytes;
        st->copied_bytes += ms[t].copied_bytes;
    }
    copy_free(cp, ms[0].ix->nheap, ms[0].ix->heap);
    free(bstart);
    return err;
}

/* Marks of more allocations than this run on up to MARK_MAX_THREADS threads (one per CPU):
 * the mark waits on memory (a lookup and a block fetch per reference), so a second core
 * nearly halves a large one; smaller heaps stay on one thread. A pytest process's heap
 * (136,000 blocks, 14 MB scanned) marked in 15.3-16.5 ms on one thread against 18.9-19.9 ms
 * on two (medians of 20, four alternating rounds, 2 vCPUs shared with other work; two threads
 * reached 10.2 ms only when the second vCPU was idle): sharing work and bouncing the marked
 * bytes' cache lines cost more than the second core gives at that size, and twice the CPU. */
#define MARK_PARALLEL_MIN (1u << 18)
#define MARK_MAX_THREADS 4

/* One mark (mu_mark). fr: dead when it has the fresh rule, else NULL; rejected: n bytes, the
 * allocations whose hits the rule dropped; nodedup: look every word up. */
static int64_t mark_once(const uint64_t *begin, const uint64_t *size, uint64_t n,
                         const mu_region *heap, uint64_t nheap,
                         const mu_region *roots, uint64_t nroots,
                         const uint64_t *words, uint64_t nwords,
                         uint8_t *marked, mu_mark_stats *stats, uint32_t flags,
                         const mu_dead *dead, const mu_dead *fr, uint8_t *rejected,
                         uint64_t nodedup, const mu_mark_policy *policy)
{
    if ((n && !marked) || (nroots && !roots) || (nwords && !words))
        return -EINVAL;
    for (uint64_t r = 0; r < nroots; r++)
        if (roots[r].len && !roots[r].data)
            return -EINVAL;
    int lazy = 0;               /* some region is uncopied: the low-memory mark */
    for (uint64_t r = 0; r < nheap && heap; r++)
        lazy |= heap[r].uncopied != 0;
    mu_scan_index ix;
    int64_t rc = mu_scan_index_init(&ix, begin, size, n, heap, nheap,
                                    SCAN_UNCOPIED_OK | SCAN_LEAVES);
    if (rc < 0)
        return rc;
    rc = mu_scan_index_set_dead(&ix, dead);
    if (rc < 0) {
        mu_scan_index_free(&ix);
        return rc;
    }
    int nt = 1;
    if (n >= MARK_PARALLEL_MIN || (flags & MU_MARK_PARALLEL)) {
        long ncpu = mu_online_cpus();
        nt = ncpu < 1 ? 1 : ncpu > MARK_MAX_THREADS ? MARK_MAX_THREADS : (int)ncpu;
    }
    mark_ctx *ms = calloc((size_t)nt, sizeof *ms);
    mark_shared sh;
    memset(&sh, 0, sizeof sh);
    type_hash th = {NULL, 0, 0, NULL};
    int64_t dead_err;
    uint64_t *dead_in = dead_in_init(&ix, ix.dead, &dead_err);
    int ok = ms != NULL && !dead_err && (!dead || !dead->ntypes || type_hash_init(&th, dead) == 0);
    /* a thread's stack and the pool each hold at most n entries (each allocation is pushed
     * once); pages never touched cost nothing */
    pend_set pend[2];           /* the low-memory mark's waves: the next one and a spare */
    memset(pend, 0, sizeof pend);
    for (int t = 0; ok && t < nt; t++)
        ok = (ms[t].stack = big_alloc(n * sizeof(uint32_t))) != NULL;
    if (ok && nt > 1)
        ok = (sh.pool = big_alloc(n * sizeof(uint32_t))) != NULL;
    if (ok && lazy)
        ok = pend_init(&pend[0], n) == 0 && pend_init(&pend[1], n) == 0;
    if (!ok) {
        for (int t = 0; ms && t < nt; t++)
            free(ms[t].stack);
        pend_free(&pend[0]);
        pend_free(&pend[1]);
        free(ms);
        free(sh.pool);
        free(th.slot);
        free(dead_in);
        mu_scan_index_free(&ix);
        return -ENOMEM;
    }
    if (n)
        memset(marked, 0, n);
    /* the kept candidates' allocations, found a piece at a time (without the fresh rule,
     * which needs each word's address at its lookup); none when out of memory */
    piece_targets *targets = !fr && lazy ? calloc(nheap, sizeof *targets) : NULL;
    for (uint64_t r = 0; targets && r < nheap; r++) {
        const mu_cands *c = heap[r].uncopied ? heap[r].cands : NULL;
        if (!c || !c->npieces)
            continue;
        targets[r].hit = calloc(c->npieces, sizeof *targets[r].hit);
        targets[r].state = calloc(c->npieces, sizeof *targets[r].state);
        if (!targets[r].hit || !targets[r].state) {
            free(targets[r].hit);
            free(targets[r].state);
            targets[r].hit = NULL;
            targets[r].state = NULL;
        }
    }
    for (int t = 0; t < nt; t++) {
        ms[t].targets = targets;
        ms[t].ix_own = ix;
        ms[t].ix = &ms[t].ix_own;
        ms[t].sh = nt > 1 ? &sh : NULL;
        ms[t].shared_marks = nt > 1;
        ms[t].size = size;
        ms[t].dead = dead;
        ms[t].th = dead && dead->ntypes ? &th : NULL;
        ms[t].dead_in = dead_in;
        ms[t].marked = marked;
        ms[t].plain_rules = !dead || (!dead->ntypes && !dead->dict_keys && !dead->debug_hooks
                                        && !dead->head_word);
        ms[t].fr = fr;
        ms[t].rejected = rejected;
        ms[t].nodedup = nodedup;
        ms[t].pend = &pend[0];
        memset(ms[t].seen, 0xff, sizeof ms[t].seen);
    }
    if (nt > 1) {
        pthread_mutex_init(&sh.mu, NULL);
        pthread_cond_init(&sh.cv, NULL);
        sh.nthreads = nt;
        for (int t = 1; t < nt; t++) {
            if (pthread_create(&ms[t].tid, NULL, mark_thread, &ms[t]) == 0) {
                ms[t].running = 1;
                continue;
            }
            pthread_mutex_lock(&sh.mu);     /* one taker fewer: the others must not wait for it */
            sh.nthreads--;
            pthread_mutex_unlock(&sh.mu);
        }
    }
    /* Roots and root words on this thread; the other threads take work from its stack. */
    mark_ctx *m = &ms[0];
    uint64_t root_bytes = 0;
    for (uint64_t r = 0; r < nroots; r++) {
        scan_range(m, roots[r].data, roots[r].base, roots[r].len, roots[r].len, 0, 0, 0, 0,
                   MU_DICT_ENTRY, ix.dead);
        root_bytes += roots[r].len;
    }
    for (uint64_t w = 0; w < nwords; w++)
        consider(m, words[w], 0);
    m->words += nwords;
    mark_loop(m);
    for (int t = 0; t < nt; t++)
        if (ms[t].running) {
            pthread_join(ms[t].tid, NULL);
            ms[t].running = 0;
        }
    mu_mark_stats ws;
    memset(&ws, 0, sizeof ws);
    int64_t err = lazy ? mark_waves(ms, nt, n, &pend[1], policy, &ws) : 0;
    uint64_t heap_bytes = 0, nwords_all = 0, marks = 0, stale = 0;
    for (int t = 0; t < nt; t++) {
        heap_bytes += ms[t].heap_bytes;
        nwords_all += ms[t].words;
        marks += ms[t].marks;
        stale += ms[t].stale;
        free(ms[t].stack);
    }
    pend_free(&pend[0]);
    pend_free(&pend[1]);
    if (nt > 1) {
        pthread_cond_destroy(&sh.cv);
        pthread_mutex_destroy(&sh.mu);
    }
    if (stats) {
        *stats = ws;
        stats->root_bytes = root_bytes;
        stats->heap_bytes = heap_bytes;
        stats->words = nwords_all;
        stats->marked = marks;
        stats->stale = stale;
        stats->size_total = ix.size_total;
    }
    for (uint64_t r = 0; targets && r < nheap; r++) {
        for (uint64_t k = 0; targets[r].hit && k < heap[r].cands->npieces; k++)
            free(targets[r].hit[k]);
        free(targets[r].hit);
        free(targets[r].state);
    }
    free(targets);
    free(ms);
    free(sh.pool);
    free(th.slot);
    free(dead_in);
    mu_scan_index_free(&ix);
    return err ? err : (int64_t)marks;
}

/* The fresh rule (mu_dead.fresh) is exact only without the cache of values met: a value first
 * met in an unwritten word and again, in the same batch of lookups, in a written one is looked
 * up once. So a mark whose rule dropped a hit on an allocation left unmarked is redone with
 * every word looked up (the rare case: a leak that a stale word would have hidden). */
int64_t mu_mark(const uint64_t *begin, const uint64_t *size, uint64_t n,
                const mu_region *heap, uint64_t nheap,
                const mu_region *roots, uint64_t nroots,
                const uint64_t *words, uint64_t nwords,
                uint8_t *marked, mu_mark_stats *stats, uint32_t flags, const mu_dead *dead,
                const mu_mark_policy *policy)
{
    const mu_dead *fr = dead && dead->fresh && dead->nunwritten && n ? dead : NULL;
    if (dead && dead->nunwritten) {
        if (!dead->unwritten)
            return -EINVAL;
        for (uint64_t k = 0; k < dead->nunwritten; k++)
            if (dead->unwritten[3 * k] >= dead->unwritten[3 * k + 1]
                || (k && dead->unwritten[3 * k] < dead->unwritten[3 * k - 2]))
                return -EINVAL;
    }
    if (!fr)
        return mark_once(begin, size, n, heap, nheap, roots, nroots, words, nwords, marked,
                         stats, flags, dead, NULL, NULL, 0, policy);
    uint8_t *rejected = calloc(n, 1);
    if (!rejected)
        return -ENOMEM;
    int64_t rc = mark_once(begin, size, n, heap, nheap, roots, nroots, words, nwords, marked,
                           stats, flags, dead, fr, rejected, 0, policy);
    int again = 0;
    for (uint64_t i = 0; rc >= 0 && i < n && !again; i++)
        again = rejected[i] && !marked[i];
    if (again) {
        memset(rejected, 0, n);
        rc = mark_once(begin, size, n, heap, nheap, roots, nroots, words, nwords, marked,
                       stats, flags, dead, fr, rejected, 1, policy);
    }
    free(rejected);
    return rc;
}

uint64_t mu_scanned_len(const mu_dead *dead, const uint8_t *p, uint64_t b, uint64_t len,
                        uint64_t avail)
{
    if (mu_dead_object(dead, p, len, avail))
        return 0;
    return mu_live_len(dead, p, b, len, avail);
}

void mu_scanned_head(const mu_dead *dead, uint64_t i, const uint8_t *p, uint64_t b, uint64_t len,
                     uint64_t avail, uint64_t *hb, uint64_t *he, uint64_t *zb, uint64_t *ze,
                     uint64_t *zs)
{
    mu_rules r;
    if (dead && dead->ntypes)
        mu_rules_search(dead, p, len < avail ? len : avail, &r);
    mu_live_head(dead, dead && dead->ntypes ? &r : NULL, i, b, p, len, avail, hb, he, zb, ze,
                 zs);
}

uint64_t mu_value_words(const mu_dead *dead, const uint8_t *p, uint64_t b, uint64_t len,
                        uint64_t avail, uint64_t *vals, uint64_t *at)
{
    if (!dead || !dead->ntypes)
        return 0;
    mu_rules r;
    mu_rules_search(dead, p, len < avail ? len : avail, &r);
    return mu_dead_object_r(&r, p) ? mu_value_words_r(&r, p, b, vals, at) : 0;
}

static int cmp_pair(const void *a, const void *b)
{
    const uint64_t *x = a, *y = b;
    if (x[0] != y[0])
        return x[0] < y[0] ? -1 : 1;
    return x[1] < y[1] ? -1 : x[1] > y[1];
}

#define RADIX_BITS 11
#define RADIX_MIN 4096          /* fewer pairs: qsort */

/* Sorts the n pairs by begin (their order among equal begins is free: the merge below
 * does not need it) with an LSD radix sort of 11-bit digits, skipping each digit that all
 * begins share (the high bits of addresses): 4 M list-slack ranges of a Python process
 * took 0.42 s in qsort. Falls back to qsort when the scratch cannot be had. */
static void sort_pairs(uint64_t *pairs, uint64_t n)
{
    if (n < 2)
        return;
    uint64_t *tmp = n >= RADIX_MIN ? malloc(n * 2 * sizeof *tmp) : NULL;
    if (!tmp) {
        qsort(pairs, n, 2 * sizeof *pairs, cmp_pair);
        return;
    }
    uint64_t run = 1;                           /* the sorted prefix */
    while (run < n && pairs[2 * run] >= pairs[2 * run - 2])
        run++;
    if (run == n) {
        free(tmp);
        return;
    }
    if (n - run <= n / 8) {
        /* a sorted array with a few pairs added at its end (a sweep's dead ranges and an
         * in-process check's own): sort the tail, then merge the two runs */
        uint64_t *t = pairs + 2 * run, nt = n - run, j = 0, k = 0;
        sort_pairs(t, nt);
        uint64_t lo = 0, hi = run;      /* the prefix before the tail's first begin stays */
        while (lo < hi) {
            uint64_t mid = (lo + hi) >> 1;
            if (pairs[2 * mid] <= t[0])
                lo = mid + 1;
            else
                hi = mid;
        }
        uint64_t i = lo;
        while (i < run || j < nt) {
            const uint64_t *from = j >= nt || (i < run && pairs[2 * i] <= t[2 * j])
                                   ? &pairs[2 * i++] : &t[2 * j++];
            tmp[2 * k] = from[0];
            tmp[2 * k + 1] = from[1];
            k++;
        }
        memcpy(pairs + 2 * lo, tmp, k * 2 * sizeof *pairs);
        free(tmp);
        return;
    }
    uint64_t lo = pairs[0], hi = pairs[0];
    for (uint64_t i = 1; i < n; i++) {
        uint64_t b = pairs[2 * i];
        lo = b < lo ? b : lo;
        hi = b > hi ? b : hi;
    }
    uint64_t count[1u << RADIX_BITS];          /* 16 KiB */
    uint64_t *src = pairs, *dst = tmp;
    for (unsigned shift = 0; shift < 64; shift += RADIX_BITS) {
        const uint64_t mask = (1u << RADIX_BITS) - 1;
        if (((lo ^ hi) >> shift) == 0)
            break;                              /* every begin shares the digits left */
        memset(count, 0, sizeof count);
        for (uint64_t i = 0; i < n; i++)
            count[(src[2 * i] >> shift) & mask]++;
        if (count[(lo >> shift) & mask] == n)
            continue;                           /* one digit for all: nothing moves */
        uint64_t at = 0;
        for (uint64_t d = 0; d <= mask; d++) {
            uint64_t c = count[d];
            count[d] = at;
            at += c;
        }
        for (uint64_t i = 0; i < n; i++) {
            uint64_t k = count[(src[2 * i] >> shift) & mask]++;
            dst[2 * k] = src[2 * i];
            dst[2 * k + 1] = src[2 * i + 1];
        }
        uint64_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != pairs)
        memcpy(pairs, src, n * 2 * sizeof *pairs);
    free(tmp);
}

int64_t mu_merge_pairs(uint64_t *pairs, uint64_t n)
{
    if (n && !pairs)
        return -EINVAL;
    sort_pairs(pairs, n);
    uint64_t k = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t b = pairs[2 * i], e = pairs[2 * i + 1];
        if (b >= e)
            continue;
        if (k && b <= pairs[2 * k - 1]) {
            if (e > pairs[2 * k - 1])
                pairs[2 * k - 1] = e;
        } else {
            pairs[2 * k] = b;
            pairs[2 * k + 1] = e;
            k++;
        }
    }
    return (int64_t)k;
}
