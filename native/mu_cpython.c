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
    uint64_t found = 0, g = 0, i = 0;
    while (i < n) {
        uint64_t p = blocks[i] - blocks[i] % pool_size, end = p + pool_size;
        while (g < gn && g_begin[g] < end)              /* g: first beginning at or after end */
            g++;
        if (g && g_begin[g - 1] + (g_size[g - 1] ? g_size[g - 1] : 1) > p) {
            if (found < cap)
                out[found] = p;
            found++;
        }
        /* the next pool's first block: gallop past this pool's blocks, then bisect */
        uint64_t step = 1, lo = i + 1, hi;
        while (i + step < n && blocks[i + step] < end) {
            lo = i + step + 1;
            step <<= 1;
        }
        hi = i + step < n ? i + step : n;
        while (lo < hi) {
            uint64_t mid = lo + (hi - lo) / 2;
            if (blocks[mid] < end)
                lo = mid + 1;
            else
                hi = mid;
        }
        i = lo;
    }
    return (int64_t)found;
}

/* mu_region_find for addresses that never go below the lowest region holding an earlier one
 * (the objects of an ascending pass): *cur moves forward past regions that end at or below
 * addr, so a pass costs O(objects + regions), not a bisection per object. Index of the
 * region holding [addr, addr+n), or -1 (as mu_region_find). */
static int64_t region_from(const mu_region *r, uint64_t nr, uint64_t *cur, uint64_t addr,
                           uint64_t n)
{
    while (*cur < nr && r[*cur].base + r[*cur].len <= addr)
        (*cur)++;
    uint64_t k = *cur;
    if (k < nr && r[k].base <= addr && addr + n <= r[k].base + r[k].len && addr + n >= addr)
        return (int64_t)k;
    return -1;
}

/* How many allocations ahead gc_object prefetches a GC object's first bytes: a pass over the
 * GC objects waits on each one's cache line otherwise (4 M lists: 2/3 of mu_gc_stale_parts'
 * time was the load of the type word) */
#define GC_PREFETCH_AHEAD 64

/* The GC object of allocation i < n (head_word[i] != 0: its address past the GC head) when its
 * first `need` bytes lie inside the allocation and in one heap region (*cur: an ascending pass,
 * region_from), its bytes at *o; 0 otherwise. */
static inline __attribute__((always_inline)) uint64_t
gc_object(const uint64_t *begin, const uint64_t *size, uint64_t n, const uint8_t *head_word,
          const mu_region *heap, uint64_t nheap, uint64_t *cur, uint64_t i, uint64_t need,
          const uint8_t **o)
{
    uint64_t j = i + GC_PREFETCH_AHEAD;
    if (j < n && head_word[j] && *cur < nheap) {
        uint64_t at = begin[j] + 8 * (uint64_t)head_word[j] + 8 - heap[*cur].base;
        if (at < heap[*cur].len)
            __builtin_prefetch(heap[*cur].data + at);
    }
    if (!head_word[i])
        return 0;
    uint64_t obj = begin[i] + 8 * (uint64_t)(head_word[i] - 1) + 16;
    if (obj + need > begin[i] + size[i])
        return 0;
    int64_t r = region_from(heap, nheap, cur, obj, need);
    if (r < 0)
        return 0;
    *o = heap[r].data + (obj - heap[r].base);
    return obj;
}

/* mu_field_blocks' test for object i (its object at obj): the block its field points at. */
static int field_block(const uint64_t *begin, const uint64_t *size, uint64_t n,
                       const mu_region *heap, uint64_t nheap, uint64_t *cur, uint64_t i,
                       uint64_t obj, uint64_t field, uint64_t flag_off, uint64_t flag_mask,
                       uint64_t *k_out)
{
    uint64_t last = (field > flag_off ? field : flag_off) + 8;
    if (obj + last > begin[i] + size[i])
        return 0;
    int64_t r = region_from(heap, nheap, cur, obj, last);
    if (r < 0)
        return 0;
    const uint8_t *o = heap[r].data + (obj - heap[r].base);
    uint64_t flags, ptr;
    memcpy(&flags, o + flag_off, 8);
    memcpy(&ptr, o + field, 8);
    if (!ptr || (flag_mask && !(flags & flag_mask)))
        return 0;
    uint64_t k = mu_find_sorted(begin, n, ptr);
    if (k == n || k == i)
        return 0;
    *k_out = k;
    return 1;
}

static void put_pair(uint64_t *out, uint64_t cap, uint64_t *found, uint64_t b, uint64_t e)
{
    if (b >= e)
        return;
    if (*found < cap) {
        out[2 * *found] = b;
        out[2 * *found + 1] = e;
    }
    (*found)++;
}

/* PySetObject (every version): {head, fill, used, mask, table, hash, finger, smalltable[8],
 * weakreflist}, entries {key, hash} */
#define MU_SET_MASK 32
#define MU_SET_TABLE 40
#define MU_SET_SMALLTABLE 64
#define MU_SET_SMALLTABLE_END 192
#define MU_SET_MAX_MASK (1ull << 40)

/* The set rule of mu_gc_dead_ranges for the set at obj (its bytes at so, MU_SET_SMALLTABLE_END
 * of them; allocation i): its table's hashes. Returns how many pairs it put. */
static uint64_t set_hashes(const uint64_t *begin, const uint64_t *size, uint64_t n,
                           const uint8_t *head_word, uint64_t i, uint64_t obj, const uint8_t *so,
                           uint32_t *live_end, uint64_t *out, uint64_t cap, uint64_t *found,
                           uint64_t *tables)
{
    uint64_t mask, table, put = 0;
    memcpy(&mask, so + MU_SET_MASK, 8);
    memcpy(&table, so + MU_SET_TABLE, 8);
    if (table == obj + MU_SET_SMALLTABLE) {
        /* in the object: a pair per hash that could be an address (the span of the heap's
         * allocations, 8-aligned; a str's hash seldom is, a small int's never) */
        uint64_t lo = begin[0], hi = begin[n - 1] + size[n - 1];
        for (uint64_t k = 0; k < 8; k++) {
            uint64_t h, at = MU_SET_SMALLTABLE + MU_SET_ENTRY * k + 8;
            memcpy(&h, so + at, 8);
            if (h - lo < hi - lo && !(h & 7)) {
                put_pair(out, cap, found, obj + at, obj + at + 8);
                put++;
            }
        }
        return put;
    }
    /* its own table: an allocation whose entries' hashes the mark skips (live_end) */
    if (!live_end || mask < 7 || mask >= MU_SET_MAX_MASK || ((mask + 1) & mask) || (table & 7))
        return 0;
    for (uint64_t off = 0; off <= 16; off += 16) {      /* the debug hooks' prefix before it */
        uint64_t k = mu_find_sorted(begin, n, table - off);
        if (k == n || k == i || head_word[k] || size[k] < off + MU_SET_ENTRY * (mask + 1))
            continue;
        if (live_end[k] && !(live_end[k] & MU_LIVE_SET_TABLE))
            return 0;                   /* a list's item array: never a set's table too */
        live_end[k] = MU_LIVE_SET_TABLE | (uint32_t)off;
        (*tables)++;
        return 0;
    }
    return 0;
}

/* A set no GC list holds (3.15 untracks frozensets) in allocation i, whose size is that of a
 * set object's allocation (its GC head, the debug hooks' prefix and tail, a subclass's few
 * slots): its object 16 or 32 bytes in, of a type in sets[] with a plausible reference count
 * (then set_hashes, with its consistency checks). Returns what set_hashes does. */
#define MU_SET_UNTRACKED_MIN (16 + MU_SET_SMALLTABLE_END + 8)
#define MU_SET_UNTRACKED_MAX 512
static uint64_t untracked_set(const uint64_t *begin, const uint64_t *size, uint64_t n,
                              const mu_region *heap, uint64_t nheap, uint64_t *cur,
                              const uint8_t *head_word, uint64_t i, const uint64_t *sets,
                              uint64_t nsets, uint32_t *live_end, uint64_t *out, uint64_t cap,
                              uint64_t *found, uint64_t *tables)
{
    for (uint64_t off = 16; off <= 32; off += 16) {
        uint64_t obj = begin[i] + off, rc, tp;
        if (obj + MU_SET_SMALLTABLE_END > begin[i] + size[i])
            break;
        int64_t q = region_from(heap, nheap, cur, obj, MU_SET_SMALLTABLE_END);
        if (q < 0)
            break;
        const uint8_t *so = heap[q].data + (obj - heap[q].base);
        memcpy(&rc, so, 8);
        memcpy(&tp, so + 8, 8);
        if (mu_plausible_refcnt(rc) && mu_find_sorted(sets, nsets, tp) < nsets)
            return set_hashes(begin, size, n, head_word, i, obj, so, live_end, out, cap, found,
                              tables);
    }
    return 0;
}

int64_t mu_gc_dead_ranges(const uint64_t *begin, const uint64_t *size, uint64_t n,
                          const mu_region *heap, uint64_t nheap, const uint8_t *head_word,
                          uint64_t list_type, const uint64_t *metas, uint64_t nmetas,
                          uint64_t doc_field, uint64_t flag_off, uint64_t flag_mask,
                          const uint64_t *buffered, uint64_t nbuffered, uint64_t buf_field,
                          const uint64_t *sets, uint64_t nsets,
                          uint64_t *out, uint64_t cap, uint64_t *counts, uint32_t *live_end)
{
    if ((n && (!begin || !size || !head_word)) || (nheap && !heap) || (cap && !out) || !counts
        || (nmetas && !metas) || (nbuffered && !buffered) || (nsets && !sets)
        || doc_field < 16 || (doc_field & 7) || doc_field > 4096 || (flag_off & 7)
        || flag_off > 4096 || buf_field < 16 || (buf_field & 7) || buf_field > 4096)
        return -EINVAL;
    uint64_t found = 0, cur = 0, hint = 0, set_tp[2] = {0, 0};  /* the last type, a set's? */
    counts[0] = counts[1] = counts[2] = counts[3] = counts[4] = counts[5] = 0;
    for (uint64_t i = 0; i < n; i++) {
        const uint8_t *o;
        uint64_t obj = gc_object(begin, size, n, head_word, heap, nheap, &cur, i, 16, &o);
        if (!obj) {
            if (nsets && !head_word[i] && size[i] >= MU_SET_UNTRACKED_MIN
                && size[i] <= MU_SET_UNTRACKED_MAX)
                counts[4] += untracked_set(begin, size, n, heap, nheap, &cur, head_word, i,
                                           sets, nsets, live_end, out, cap, &found, &counts[5]);
            continue;
        }
        uint64_t tp, k, pair[4][2];
        memcpy(&tp, o + 8, 8);
        int hit[4] = {0, 0, 0, 0};
        if (list_type && tp == list_type) {         /* mu_list_slack */
            int64_t q = obj + 40 <= begin[i] + size[i] ? region_from(heap, nheap, &cur, obj, 40)
                                                       : -1;
            if (q >= 0) {
                uint64_t n_size, item, alloc;
                memcpy(&n_size, o + 16, 8);
                memcpy(&item, o + 24, 8);
                memcpy(&alloc, o + 32, 8);
                uint64_t end = mu_list_dead_end(begin, size, n, n_size, item, alloc, &hint);
                if (end && live_end && hint < n && begin[hint] == item
                    && end == begin[hint] + size[hint] && 8 * n_size < MU_LIVE_SET_TABLE - 1) {
                    uint32_t live = (uint32_t)(8 * n_size + 1);     /* (mu_list_dead_end: hint) */
                    if (!live_end[hint]
                        || (!(live_end[hint] & MU_LIVE_SET_TABLE) && live < live_end[hint]))
                        live_end[hint] = live;
                    counts[0]++;
                } else if (end) {
                    pair[0][0] = item + 8 * n_size;
                    pair[0][1] = end;
                    hit[0] = 1;
                }
            }
        }
        if (nsets && tp != set_tp[0]) {     /* objects come in runs of one type */
            set_tp[0] = tp;
            set_tp[1] = mu_find_sorted(sets, nsets, tp) < nsets;
        }
        if (nsets && set_tp[1] && obj + MU_SET_SMALLTABLE_END <= begin[i] + size[i]) {
            int64_t q = region_from(heap, nheap, &cur, obj, MU_SET_SMALLTABLE_END);
            if (q >= 0)
                counts[4] += set_hashes(begin, size, n, head_word, i, obj,
                                        heap[q].data + (obj - heap[q].base), live_end, out, cap,
                                        &found, &counts[5]);
        }
        int meta = nmetas && mu_find_sorted(metas, nmetas, tp) < nmetas;
        if (meta && field_block(begin, size, n, heap, nheap, &cur, i, obj, doc_field, flag_off,
                                flag_mask, &k)) {
            pair[1][0] = begin[k];
            pair[1][1] = begin[k] + size[k];
            hit[1] = 1;
        }
        if (nbuffered && mu_find_sorted(buffered, nbuffered, tp) < nbuffered
            && field_block(begin, size, n, heap, nheap, &cur, i, obj, buf_field, 0, 0, &k)) {
            pair[2][0] = begin[k];
            pair[2][1] = begin[k] + size[k];
            hit[2] = 1;
        }
        if (meta && flag_off >= 16 && obj + flag_off + 8 <= begin[i] + size[i]) {
            pair[3][0] = obj + flag_off;            /* a number, no reference */
            pair[3][1] = obj + flag_off + 8;
            hit[3] = 1;
        }
        for (int rule = 0; rule < 4; rule++) {
            if (!hit[rule])
                continue;
            if (found < cap) {
                out[2 * found] = pair[rule][0];
                out[2 * found + 1] = pair[rule][1];
            }
            found++;
            counts[rule]++;
        }
    }
    return (int64_t)found;
}

int64_t mu_gc_objects_of(const uint64_t *begin, const uint64_t *size, uint64_t n,
                         const mu_region *heap, uint64_t nheap, const uint8_t *head_word,
                         const uint64_t *types, uint64_t ntypes, uint64_t flag_off,
                         uint64_t flag_mask, uint64_t flag_want, uint64_t *out, uint64_t cap)
{
    if ((n && (!begin || !size || !head_word)) || (nheap && !heap) || (cap && !out)
        || (ntypes && !types) || (flag_off & 7) || flag_off < 16 || flag_off > 4096)
        return -EINVAL;
    uint64_t found = 0, cur = 0;
    for (uint64_t i = 0; i < n && ntypes; i++) {
        const uint8_t *o;
        uint64_t obj = gc_object(begin, size, n, head_word, heap, nheap, &cur, i, flag_off + 8, &o);
        if (!obj)
            continue;
        uint64_t tp, flags;
        memcpy(&tp, o + 8, 8);
        memcpy(&flags, o + flag_off, 8);
        if (mu_find_sorted(types, ntypes, tp) == ntypes || (flags & flag_mask) != flag_want)
            continue;
        if (found < cap)
            out[found] = obj;
        found++;
    }
    return (int64_t)found;
}

#define MU_DEQUE_LEN 64          /* BLOCKLEN */
#define MU_DEQUE_BLOCK 528       /* sizeof(block) */
#define MU_DEQUE_MAXFREE 16      /* MAXFREEBLOCKS */

/* The index of the image allocation that begins at b and holds a whole deque block, or n. */
static uint64_t deque_block(const uint64_t *begin, const uint64_t *size, uint64_t n, uint64_t b)
{
    uint64_t k = b ? mu_find_sorted(begin, n, b) : n;
    return k < n && size[k] >= MU_DEQUE_BLOCK ? k : n;
}

int64_t mu_deque_dead_ranges(const uint64_t *begin, const uint64_t *size, uint64_t n,
                             const mu_region *heap, uint64_t nheap, const uint8_t *head_word,
                             const uint64_t *deques, uint64_t ndeques, uint64_t free_off,
                             uint64_t *out, uint64_t cap, uint64_t *counts)
{
    if ((n && (!begin || !size || !head_word)) || (nheap && !heap) || (cap && !out) || !counts
        || (ndeques && !deques)
        || (free_off && (free_off < 72 || (free_off & 7) || free_off > 1024)))
        return -EINVAL;
    uint64_t found = 0, cur = 0, need = free_off ? free_off + 8 + 8 * MU_DEQUE_MAXFREE : 56;
    counts[0] = 0;
    for (uint64_t i = 0; i < n && ndeques; i++) {
        const uint8_t *o;
        uint64_t obj = gc_object(begin, size, n, head_word, heap, nheap, &cur, i, need, &o);
        if (!obj)
            continue;
        uint64_t tp, lb, rb;
        int64_t len, li, ri;
        memcpy(&tp, o + 8, 8);
        if (mu_find_sorted(deques, ndeques, tp) == ndeques)
            continue;
        memcpy(&len, o + 16, 8);
        memcpy(&lb, o + 24, 8);
        memcpy(&rb, o + 32, 8);
        memcpy(&li, o + 40, 8);
        memcpy(&ri, o + 48, 8);
        if (len < 0 || li < 0 || li >= MU_DEQUE_LEN || ri < 0 || ri >= MU_DEQUE_LEN
            || len > (int64_t)1 << 40 || li + len - 1 - ri < 0
            || (li + len - 1 - ri) % MU_DEQUE_LEN)
            continue;
        uint64_t nblocks = (uint64_t)(li + len - 1 - ri) / MU_DEQUE_LEN + 1, b = lb, k = n, j;
        for (j = 0; j < nblocks; j++) {         /* the chain must end at rightblock */
            if ((k = deque_block(begin, size, n, b)) == n)
                break;
            if (j + 1 == nblocks)
                break;
            int64_t q = mu_region_find(heap, nheap, b + MU_DEQUE_BLOCK - 8, 8);
            if (q < 0)
                break;
            memcpy(&b, heap[q].data + (b + MU_DEQUE_BLOCK - 8 - heap[q].base), 8);
        }
        if (j + 1 != nblocks || k == n || b != rb)
            continue;
        uint64_t nfree = 0;
        if (free_off) {
            memcpy(&nfree, o + free_off, 8);
            if (nfree > MU_DEQUE_MAXFREE)
                continue;
        }
        counts[0]++;
        put_pair(out, cap, &found, lb, lb + 8 + 8 * (uint64_t)li);
        put_pair(out, cap, &found, rb + 16 + 8 * (uint64_t)ri, rb + MU_DEQUE_BLOCK);
        for (b = lb, j = 0; j < nblocks; j++) {
            k = deque_block(begin, size, n, b);
            put_pair(out, cap, &found, b + MU_DEQUE_BLOCK, b + size[k]);
            if (j + 1 < nblocks) {
                int64_t q = mu_region_find(heap, nheap, b + MU_DEQUE_BLOCK - 8, 8);
                memcpy(&b, heap[q].data + (b + MU_DEQUE_BLOCK - 8 - heap[q].base), 8);
            }
        }
        for (j = 0; j < nfree; j++) {           /* cached free blocks: stale whole */
            uint64_t fb;
            memcpy(&fb, o + free_off + 8 + 8 * j, 8);
            if ((k = deque_block(begin, size, n, fb)) < n)
                put_pair(out, cap, &found, fb, fb + size[k]);
        }
        if (free_off)
            put_pair(out, cap, &found, obj + free_off + 8 + 8 * nfree,
                     obj + free_off + 8 + 8 * MU_DEQUE_MAXFREE);
    }
    return (int64_t)found;
}

#define MU_DICT_VALUES 40
#define MU_STR_STATE 32         /* PyASCIIObject.state (every version) */
#define MU_TP_NAME 24           /* PyTypeObject.tp_name */
#define MU_BLOCKSTACK 240       /* 3.8-3.10 PyFrameObject.f_blockstack: 20 PyTryBlock (3 ints) */
#define MU_F_VALUESTACK 64      /* 3.8-3.10 PyFrameObject.f_valuestack */
#define MU_F_STACKTOP 72        /* 3.8/3.9 f_stacktop (PyObject **, NULL while running) */
#define MU_F_STACKDEPTH 80      /* 3.10 f_stackdepth (int) */
#define MU_F_STATE 108          /* 3.10 f_state (int8: created -2, suspended -1) */
#define MU_TP_FLAGS 168         /* PyTypeObject.tp_flags */
#define MU_TPFLAGS_HEAPTYPE (1ull << 9)
#define MU_STR_COMPACT 0x20     /* its compact bit: the text follows the object inline */

/* Reads the word at addr of the heap regions into *w. Returns 1, or 0 when unreadable. */
static inline int read_word(const mu_region *heap, uint64_t nheap, uint64_t addr, uint64_t *w)
{
    int64_t r = mu_region_find(heap, nheap, addr, 8);
    if (r < 0)
        return 0;
    memcpy(w, heap[r].data + (addr - heap[r].base), 8);
    return 1;
}

/* A type's home slot in a table of cap (a power of two) slots. */
static inline uint64_t type_slot(uint64_t t, uint64_t cap)
{
    return ((t >> 4) * 0x9E3779B97F4A7C15ull >> 32) & (cap - 1);
}

/* The dead parts of the PyDictValues array at values: pairs[0..1] (prefix, then the slots past
 * the last one in use when there are any). Returns how many pairs (0: not a consistent array). */
static int values_parts(const uint64_t *begin, const uint64_t *size, uint64_t n,
                        const mu_region *heap, uint64_t nheap, uint64_t values, uint64_t pairs[2][2])
{
    if (!values || (values & 7))
        return 0;
    int64_t r = mu_region_find(heap, nheap, values - 2, 2);
    if (r < 0)
        return 0;
    const uint8_t *v = heap[r].data + (values - heap[r].base);
    uint64_t prefix = v[-1], count = v[-2];
    if (prefix < 8 || prefix > 248 || (prefix & 7) || count + 2 > prefix)
        return 0;
    uint64_t block = values - prefix, k = mu_find_sorted(begin, n, block);
    if (k == n || block < heap[r].base || size[k] <= prefix)
        return 0;
    uint64_t slots = (size[k] - prefix) / 8, used = 0;
    for (uint64_t j = 0; j < count; j++) {
        uint64_t ix = v[-3 - (int64_t)j];
        if (ix >= slots)
            return 0;
        if (ix + 1 > used)
            used = ix + 1;
    }
    pairs[0][0] = block;
    pairs[0][1] = values;
    if (values + 8 * used >= block + size[k])
        return 1;
    pairs[1][0] = values + 8 * used;
    pairs[1][1] = block + size[k];
    return 2;
}

/* The dead parts of a 3.13 PyDictValues at values, inside the allocation [blk, blk + blk_size)
 * (blk_size 0: the allocation must start at values): pairs[0] its header word (capacity,
 * size, embedded, valid: bytes), pairs[1] from the slot past the highest index of its order
 * bytes (after the capacity slots) to the allocation's end. Returns how many pairs (0: not a
 * consistent array). */
static int values_parts_313(const uint64_t *begin, const uint64_t *size, uint64_t n,
                            const mu_region *heap, uint64_t nheap, uint64_t values, uint64_t blk,
                            uint64_t blk_size, uint64_t pairs[2][2])
{
    if (!values || (values & 7))
        return 0;
    if (!blk_size) {
        uint64_t k = mu_find_sorted(begin, n, values);
        if (k == n)
            return 0;
        blk = begin[k];
        blk_size = size[k];
    }
    int64_t r = mu_region_find(heap, nheap, values, 8);
    if (r < 0)
        return 0;
    const uint8_t *v = heap[r].data + (values - heap[r].base);
    uint64_t cap = v[0], count = v[1], order_at = values + 8 + 8 * cap, used = 0;
    if (!cap || count > cap || values < blk || order_at + cap > blk + blk_size)
        return 0;
    int64_t q = mu_region_find(heap, nheap, order_at, cap);
    if (q < 0)
        return 0;
    const uint8_t *order = heap[q].data + (order_at - heap[q].base);
    for (uint64_t j = 0; j < count; j++) {
        if (order[j] >= cap)
            return 0;
        if (order[j] + 1u > used)
            used = order[j] + 1u;
    }
    pairs[0][0] = values;
    pairs[0][1] = values + 8;
    pairs[1][0] = values + 8 + 8 * used;
    pairs[1][1] = (blk + blk_size) & ~7ull;
    return pairs[1][0] < pairs[1][1] ? 2 : 1;
}

int64_t mu_gc_stale_parts(const uint64_t *begin, const uint64_t *size, uint64_t n,
                          const mu_region *heap, uint64_t nheap, const uint8_t *head_word,
                          const uint64_t *sets, uint64_t nsets,
                          const uint64_t *managed, uint64_t nmanaged, int64_t values_field,
                          uint32_t values_tag, const uint64_t *inline_types, uint64_t ninline,
                          const uint64_t *dicts, uint64_t ndicts,
                          const uint64_t *strs, uint64_t nstrs, uint64_t str_utf8,
                          uint64_t str_data, uint64_t gen_type, uint64_t gen_dead,
                          const uint64_t *metas, uint64_t nmetas, uint64_t frame_type,
                          uint64_t frame_blocks, uint32_t frame_stack,
                          uint64_t *out, uint64_t cap, uint64_t *counts)
{
    if ((n && (!begin || !size || !head_word)) || (nheap && !heap) || (cap && !out) || !counts
        || (nsets && !sets) || (nmanaged && !managed) || (ndicts && !dicts) || (nstrs && !strs)
        || (ninline && !inline_types) || (nmetas && !metas) || frame_stack > MU_FRAME_310
        || (frame_type && (frame_blocks < 112 || (frame_blocks & 7) || frame_blocks > 1024))
        || values_tag > MU_VALUES_313 || (values_field & 7) || values_field < -64
        || values_field > 4096 || (str_utf8 & 7) || (str_data & 7) || str_utf8 < 40
        || str_data < 40 || str_utf8 > 256 || str_data > 256
        || (gen_type && (gen_dead < 16 || (gen_dead & 7) || gen_dead > 4096)))
        return -EINVAL;
    /* every listed type once in an open-addressing table: one probe per object */
    uint64_t ntypes = nsets + nmanaged + ndicts + nstrs + ninline + nmetas, cap2 = 16;
    while (cap2 < 2 * ntypes)
        cap2 <<= 1;
    uint64_t *keys = calloc(cap2, sizeof *keys);
    uint8_t *bits = calloc(cap2, 1);
    if (!keys || !bits) {
        free(keys);
        free(bits);
        return -ENOMEM;
    }
    const uint64_t *lists[6] = {sets, managed, dicts, strs, inline_types, metas};
    uint64_t lens[6] = {nsets, nmanaged, ndicts, nstrs, ninline, nmetas};
    for (int l = 0; l < 6; l++)
        for (uint64_t j = 0; j < lens[l]; j++) {
            uint64_t t = lists[l][j], h = type_slot(t, cap2);
            while (keys[h] && keys[h] != t)
                h = (h + 1) & (cap2 - 1);
            keys[h] = t;
            bits[h] |= (uint8_t)(1u << l);
        }
    uint64_t found = 0, cur = 0;
    counts[0] = counts[1] = counts[2] = counts[3] = counts[4] = counts[5] = 0;
    for (uint64_t i = 0; i < n; i++) {
        const uint8_t *o;
        uint64_t obj = gc_object(begin, size, n, head_word, heap, nheap, &cur, i, 16, &o);
        if (!obj)
            continue;
        uint64_t end = begin[i] + size[i], tp, word, pairs[12][2];
        int64_t r;
        memcpy(&tp, o + 8, 8);
        int np = 0, hit[6] = {0, 0, 0, 0, 0, 0};
        if (frame_type && tp == frame_type && obj + frame_blocks + MU_BLOCKSTACK <= end) {
            /* 3.8-3.10 frame objects: the ints and chars before the try-block stack (the
             * word 32 bytes before it: trace flags, padding; the 16 bytes before it: f_lasti,
             * f_lineno, f_iblock, f_executing or f_state, padding) and the stack itself hold
             * no pointers; the value stack above its top (f_stacktop, or f_valuestack +
             * f_stackdepth while not running) is dead */
            pairs[np][0] = obj + frame_blocks - 32;
            pairs[np][1] = obj + frame_blocks - 24;
            pairs[np + 1][0] = obj + frame_blocks - 16;
            pairs[np + 1][1] = obj + frame_blocks + MU_BLOCKSTACK;
            np += 2;
            hit[5] = 1;
            uint64_t vs = 0, top = 0, w2 = 0;
            if (frame_stack && read_word(heap, nheap, obj + MU_F_VALUESTACK, &vs)
                && read_word(heap, nheap, obj + (frame_stack == MU_FRAME_310 ? MU_F_STACKDEPTH
                                                                             : MU_F_STACKTOP),
                             &top)) {
                if (frame_stack == MU_FRAME_310) {
                    int32_t depth = (int32_t)top;       /* f_stackdepth, then f_state */
                    top = 0;
                    if (read_word(heap, nheap, obj + MU_F_STATE, &w2) && (int8_t)w2 < 0
                        && depth >= 0)
                        top = vs + 8 * (uint64_t)depth;
                }
                uint64_t stop = end & ~7ull;
                if (top && !(top & 7) && vs >= obj + frame_blocks + MU_BLOCKSTACK
                    && top >= vs && top < stop) {
                    pairs[np][0] = top;
                    pairs[np][1] = stop;
                    np++;
                }
            }
        }
        uint8_t tb = 0;
        if (tp) {
            uint64_t h = type_slot(tp, cap2);
            while (keys[h] && keys[h] != tp)
                h = (h + 1) & (cap2 - 1);
            tb = keys[h] == tp ? bits[h] : 0;
        }
        if (gen_type && tp == gen_type && obj + gen_dead + 16 <= end) {
            pairs[0][0] = obj + gen_dead;
            pairs[0][1] = obj + gen_dead + 16;
            np = hit[3] = 1;
        }
        if ((tb & 1) && obj + MU_SET_SMALLTABLE_END <= end
            && (r = region_from(heap, nheap, &cur, obj, MU_SET_SMALLTABLE_END)) >= 0) {
            memcpy(&word, heap[r].data + (obj + MU_SET_TABLE - heap[r].base), 8);
            if (word != obj + MU_SET_SMALLTABLE) {
                pairs[np][0] = obj + MU_SET_SMALLTABLE;
                pairs[np][1] = obj + MU_SET_SMALLTABLE_END;
                np++;
                hit[0] = 1;
            }
        }
        if (values_tag) {
            int got = 0;
            uint64_t word = 0;
            if ((tb & 2) && obj >= begin[i] + 24) {
                /* a managed dict's own values: before the object (3.11, 3.12 tagged) or
                 * inline after its header (3.13, types with inline values: tb & 16) */
                if (values_tag == MU_VALUES_313) {
                    uint64_t at = (uint64_t)values_field, bs = 0;
                    if ((tb & 16) && !values_field      /* 3.14+: at the type's tp_basicsize */
                        && read_word(heap, nheap, tp + MU_TP_BASICSIZE, &bs) && bs >= 16
                        && !(bs & 7) && bs <= 4096)
                        at = bs;
                    if ((tb & 16) && at)
                        got += values_parts_313(begin, size, n, heap, nheap, obj + at,
                                                begin[i], size[i], pairs + np);
                } else if (obj + values_field >= begin[i]
                           && read_word(heap, nheap, obj + values_field, &word)) {
                    uint64_t values = values_tag == MU_VALUES_TAGGED
                        ? ((word & 1) ? word + 1 : 0) : word;
                    got += values_parts(begin, size, n, heap, nheap, values, pairs + np);
                }
                /* a materialized dict (MANAGED_DICT_OFFSET, -24 in every version; 3.12: an
                 * even word), untracked or not: its ma_values */
                uint64_t dict = 0, values = 0;
                if (read_word(heap, nheap, obj - 24, &dict) && dict && !(dict & 7)
                    && read_word(heap, nheap, dict + MU_DICT_VALUES, &values) && values)
                    got += values_tag == MU_VALUES_313
                        ? values_parts_313(begin, size, n, heap, nheap, values, 0, 0,
                                           pairs + np + got)
                        : values_parts(begin, size, n, heap, nheap, values, pairs + np + got);
            } else if ((tb & 4) && obj + MU_DICT_VALUES + 8 <= end
                       && read_word(heap, nheap, obj + MU_DICT_VALUES, &word) && word) {
                got += values_tag == MU_VALUES_313
                    ? values_parts_313(begin, size, n, heap, nheap, word, 0, 0, pairs + np)
                    : values_parts(begin, size, n, heap, nheap, word, pairs + np);
            }
            np += got;
            hit[1] = got > 0;
        }
        uint64_t last = (str_utf8 > str_data ? str_utf8 : str_data) + 8;
        if ((tb & 8) && obj + last <= end
            && (r = region_from(heap, nheap, &cur, obj, last)) >= 0) {
            const uint8_t *so = heap[r].data + (obj - heap[r].base);
            uint32_t state;
            uint64_t buf[2];
            memcpy(&state, so + MU_STR_STATE, 4);
            memcpy(&buf[0], so + str_data, 8);
            memcpy(&buf[1], so + str_utf8, 8);
            for (int b = 0; b < 2 && !(state & MU_STR_COMPACT); b++) {
                uint64_t k = buf[b] ? mu_find_sorted(begin, n, buf[b]) : n;
                if (k == n || k == i || (b == 1 && buf[1] == buf[0]))
                    continue;
                pairs[np][0] = begin[k];
                pairs[np][1] = begin[k] + size[k];
                np++;
                hit[2] = 1;
            }
        }
        uint64_t flags, name, k;
        if ((tb & 32) && obj + MU_TP_FLAGS + 8 <= end
            && read_word(heap, nheap, obj + MU_TP_FLAGS, &flags) && (flags & MU_TPFLAGS_HEAPTYPE)
            && read_word(heap, nheap, obj + MU_TP_NAME, &name) && name
            && (k = mu_find_sorted(begin, n, name)) < n && k != i) {
            pairs[np][0] = begin[k];
            pairs[np][1] = begin[k] + size[k];
            np++;
            hit[4] = 1;
        }
        for (int p = 0; p < np; p++, found++)
            if (found < cap) {
                out[2 * found] = pairs[p][0];
                out[2 * found + 1] = pairs[p][1];
            }
        counts[4] += hit[4];
        counts[5] += hit[5];
        counts[0] += hit[0];
        counts[1] += hit[1];
        counts[2] += hit[2];
        counts[3] += hit[3];
    }
    free(keys);
    free(bits);
    return (int64_t)found;
}

/* The region of r[] (sorted by base) serving [addr, addr + 8): the last one beginning at or
 * below addr, when it holds the whole word; NULL otherwise. */
static const uint8_t *chain_word(const mu_region *r, uint64_t nr, uint64_t addr)
{
    uint64_t lo = 0, hi = nr;
    while (lo < hi) {                   /* first region with base > addr */
        uint64_t mid = lo + (hi - lo) / 2;
        if (r[mid].base <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0)
        return NULL;
    const mu_region *g = &r[lo - 1];
    if (!g->data || g->uncopied || addr - g->base > g->len || g->len - (addr - g->base) < 8)
        return NULL;
    return g->data + (addr - g->base);
}

int64_t mu_follow_chain(const mu_region *r, uint64_t nr, uint64_t first, uint64_t n,
                        uint64_t link_off, uint64_t check_off, uint64_t *out, uint64_t *done)
{
    if ((nr && !r) || (n && !out) || !done)
        return -EINVAL;
    uint64_t o = first;
    for (uint64_t k = 0; k < n; k++) {
        *done = k;
        if (o == 0)
            return -ENOENT;
        if (o % 8)
            return -EPROTO;
        const uint8_t *c = check_off == MU_CHAIN_NO_CHECK ? NULL : chain_word(r, nr, o + check_off);
        const uint8_t *l = chain_word(r, nr, o + link_off);
        if ((!c && check_off != MU_CHAIN_NO_CHECK) || !l)
            return -EFAULT;
        uint64_t refcnt = 0, next;
        if (c)
            memcpy(&refcnt, c, 8);
        memcpy(&next, l, 8);
        if (refcnt != 0)
            return -EPROTO;
        out[k] = o;
        o = next;
    }
    *done = n;
    return (int64_t)n;
}

/* Whether v lies in one of the n sorted, disjoint (begin, end) pairs of r. */
static int in_pairs(const uint64_t *r, uint64_t n, uint64_t v)
{
    uint64_t lo = 0, hi = n;
    while (lo < hi) {               /* the first pair whose end is above v */
        uint64_t mid = lo + (hi - lo) / 2;
        if (r[2 * mid + 1] <= v)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && r[2 * lo] <= v;
}

int64_t mu_words_equal(const uint64_t *words, uint64_t n, const uint64_t *vals, uint64_t nvals,
                       uint64_t *idx, uint64_t cap)
{
    if ((n && !words) || (nvals && !vals) || (cap && !idx))
        return -EINVAL;
    for (uint64_t j = 1; j < nvals; j++)
        if (vals[j - 1] >= vals[j])
            return -EINVAL;
    uint64_t found = 0;
    if (!nvals)
        return 0;
    uint64_t lo = vals[0], hi = vals[nvals - 1];
    for (uint64_t k = 0; k < n; k++) {
        uint64_t w = words[k];
        if (w - lo > hi - lo || mu_find_sorted(vals, nvals, w) == nvals)
            continue;
        if (found < cap)
            idx[found] = k;
        found++;
    }
    return (int64_t)found;
}

int64_t mu_words_into(const uint64_t *words, uint64_t n, const uint64_t *in, uint64_t nin,
                      const uint64_t *ex, uint64_t nex, uint64_t *idx, uint64_t cap)
{
    if ((n && !words) || (nin && !in) || (nex && !ex) || (cap && !idx))
        return -EINVAL;
    uint64_t found = 0;
    for (uint64_t k = 0; k < n; k++) {
        uint64_t w = words[k];
        if (!w || (w & 15) || !in_pairs(in, nin, w) || in_pairs(ex, nex, w))
            continue;
        if (found < cap)
            idx[found] = k;
        found++;
    }
    return (int64_t)found;
}
