/* mu_gc.c: walk CPython's GC generation lists over the allocations (cpython-memory.md section
 * 4), to tell the sweep which words are GC links rather than references. */
#include "mu_core_impl.h"

#define GC_NEXT_MASK (~(uint64_t)1)     /* NEXT_MASK_UNREACHABLE, set only during a collection */
#define GC_PREV_MASK (~(uint64_t)3)     /* _PyGC_PREV_MASK_FINALIZED | _PyGC_PREV_MASK_COLLECTING */
#define GC_MAX_WORD 254u                /* head_word holds 1 + word offset in a uint8_t */

typedef struct {
    uint64_t *v;
    uint64_t len, cap;
} vec64;

/* Returns 0 or -ENOMEM. Consecutive duplicates are dropped at once (objects of a type often
 * follow each other). */
static int vec_add(vec64 *a, uint64_t x)
{
    if (a->len && a->v[a->len - 1] == x)
        return 0;
    if (a->len == a->cap) {
        uint64_t cap = a->cap ? 2 * a->cap : 1024;
        uint64_t *nv = realloc(a->v, cap * sizeof *nv);
        if (!nv)
            return -ENOMEM;
        a->v = nv;
        a->cap = cap;
    }
    a->v[a->len++] = x;
    return 0;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

#define GC_NEAR 8

int64_t mu_gc_walk(const uint64_t *begin, const uint64_t *size, uint64_t n,
                   const mu_region *heap, uint64_t nheap,
                   const uint64_t *heads, uint64_t nheads, uint64_t max_nodes,
                   uint8_t *head_word, uint64_t *types, uint64_t types_cap,
                   mu_gc_walk_stats *stats)
{
    if ((nheads && !heads) || (n && !head_word) || !stats || (types_cap && !types))
        return -EINVAL;
    memset(stats, 0, sizeof *stats);
    mu_scan_index ix;
    int64_t rc = mu_scan_index_init(&ix, begin, size, n, heap, nheap, 0);
    if (rc < 0)
        return rc;
    if (n)
        memset(head_word, 0, n);
    uint64_t total = 0;
    vec64 tv = {0};
    /* the types met lately, direct-mapped: most objects have a type met just before, so the
     * list sorted below holds a few entries per type, not one per object (4 M lists: 4 M
     * entries and a qsort of them were half of the walk) */
    uint64_t seen[256];
    memset(seen, 0xff, sizeof seen);
    rc = 0;
    /* the last node's allocation: a list's next node is most often a few allocations further
     * (objects made one after another: from one pool, the next allocation; from glibc's heap,
     * past the blocks made with each), looked for there before a lookup */
    uint64_t last = UINT64_MAX, last_r = 0;
    for (uint64_t h = 0; h < nheads && rc == 0; h++) {
        uint64_t head = heads[3 * h], prev = head;
        uint64_t node = heads[3 * h + 1] & GC_NEXT_MASK;
        stats->bad_list = h;
        while (node != head) {
            stats->bad_node = node;
            if (++total > max_nodes) {
                rc = -ELOOP;
                break;
            }
            int64_t a = -1;
            uint64_t r = last_r;
            if (last < n && node > begin[last] && node - heap[last_r].base < heap[last_r].len)
                for (uint64_t k = last + 1; k < n && k <= last + GC_NEAR && begin[k] <= node; k++)
                    if (node - begin[k] < size[k]) {
                        a = (int64_t)k;
                        break;
                    }
            if (a < 0) {
                a = (node & 7) ? -1 : mu_scan_index_find(&ix, node);
                r = a < 0 || nheap == 1 ? 0 : mu_scan_index_region_of(&ix, (uint64_t)a);
            }
            uint64_t b = a >= 0 ? begin[a] : 0;
            if (a < 0 || node & 7 || node + 16 > b + (size[a] ? size[a] : 1)
                    || (node - b) / 8 > GC_MAX_WORD - 1) {
                rc = -EFAULT;
                break;
            }
            if (head_word[a]) {
                rc = -ELOOP;
                break;
            }
            last = (uint64_t)a;
            last_r = r;
            /* the next nodes, as objects made one after another lie: read ahead, since each
             * node's address is known only once the one before is read (glibc's blocks of
             * 4 M lists, each beside its item array and bytes: one cache miss a node) */
            for (uint64_t k = last + GC_NEAR / 2; k < n && k < last + GC_NEAR + GC_NEAR / 2; k++)
                if (begin[k] - heap[r].base < heap[r].len)
                    __builtin_prefetch(heap[r].data + (begin[k] - heap[r].base));
            const uint8_t *p = heap[r].data + (node - heap[r].base);
            uint64_t next, back;
            memcpy(&next, p, 8);
            memcpy(&back, p + 8, 8);
            if ((back & GC_PREV_MASK) != prev) {
                rc = -EPROTO;
                break;
            }
            head_word[a] = (uint8_t)((node - b) / 8 + 1);
            if (node + 32 <= b + size[a]) {
                uint64_t tp;
                memcpy(&tp, p + 24, 8);
                uint64_t *slot = &seen[(tp >> 4 ^ tp >> 12) & 255];
                if (*slot != tp || tp == UINT64_MAX) {
                    *slot = tp;
                    if (vec_add(&tv, tp) < 0) {
                        rc = -ENOMEM;
                        break;
                    }
                }
            }
            prev = node;
            node = next & GC_NEXT_MASK;
        }
        if (rc == 0 && (heads[3 * h + 2] & GC_PREV_MASK) != prev) {
            stats->bad_node = head;
            rc = -EPROTO;
        }
    }
    stats->nodes = total;
    mu_scan_index_free(&ix);
    if (rc == 0) {
        qsort(tv.v, tv.len, sizeof *tv.v, cmp_u64);
        uint64_t k = 0;
        for (uint64_t j = 0; j < tv.len; j++) {
            if (j && tv.v[j] == tv.v[j - 1])
                continue;
            if (k < types_cap)
                types[k] = tv.v[j];
            k++;
        }
        stats->ntypes = k;
    }
    free(tv.v);
    return rc < 0 ? rc : (int64_t)total;
}

int64_t mu_list_slack(const uint64_t *begin, const uint64_t *size, uint64_t n,
                      const mu_region *heap, uint64_t nheap, const uint8_t *head_word,
                      uint64_t list_type, uint64_t *out, uint64_t cap)
{
    if ((n && (!begin || !size || !head_word)) || (nheap && !heap) || (cap && !out))
        return -EINVAL;
    uint64_t found = 0, hint = 0;
    for (uint64_t i = 0; i < n; i++) {
        if (!head_word[i])
            continue;
        uint64_t obj = begin[i] + 8 * (uint64_t)(head_word[i] - 1) + 16;
        int64_t r = obj + 40 <= begin[i] + size[i] ? mu_region_find(heap, nheap, obj + 8, 32) : -1;
        if (r < 0)
            continue;
        const uint8_t *o = heap[r].data + (obj - heap[r].base);
        uint64_t tp, n_size, item, alloc;
        memcpy(&tp, o + 8, 8);
        memcpy(&n_size, o + 16, 8);
        memcpy(&item, o + 24, 8);
        memcpy(&alloc, o + 32, 8);
        uint64_t end = tp == list_type ? mu_list_dead_end(begin, size, n, n_size, item, alloc, &hint) : 0;
        if (!end)
            continue;
        if (found < cap) {
            out[2 * found] = item + 8 * n_size;
            out[2 * found + 1] = end;
        }
        found++;
    }
    return (int64_t)found;
}

#define TPFLAGS_HEAPTYPE (1ull << 9)

int64_t mu_field_blocks(const uint64_t *begin, const uint64_t *size, uint64_t n,
                        const mu_region *heap, uint64_t nheap, const uint8_t *head_word,
                        const uint64_t *types, uint64_t ntypes, uint64_t field,
                        uint64_t flag_off, uint64_t flag_mask, uint64_t *out, uint64_t cap)
{
    if ((n && (!begin || !size || !head_word)) || (nheap && !heap) || (cap && !out)
        || (ntypes && !types) || field < 16 || (field & 7) || (flag_off & 7) || field > 4096
        || flag_off > 4096)
        return -EINVAL;
    uint64_t found = 0, last = (field > flag_off ? field : flag_off) + 8;
    for (uint64_t i = 0; i < n && ntypes; i++) {
        if (!head_word[i])
            continue;
        uint64_t obj = begin[i] + 8 * (uint64_t)(head_word[i] - 1) + 16;
        if (obj + last > begin[i] + size[i])
            continue;
        int64_t r = mu_region_find(heap, nheap, obj, last);
        if (r < 0)
            continue;
        const uint8_t *o = heap[r].data + (obj - heap[r].base);
        uint64_t tp, flags, ptr;
        memcpy(&tp, o + 8, 8);
        memcpy(&flags, o + flag_off, 8);
        memcpy(&ptr, o + field, 8);
        if (!ptr || (flag_mask && !(flags & flag_mask)) || mu_find_sorted(types, ntypes, tp) == ntypes)
            continue;
        uint64_t k = mu_find_sorted(begin, n, ptr);     /* the block starting at the pointer */
        if (k == n || k == i)
            continue;
        if (found < cap) {
            out[2 * found] = begin[k];
            out[2 * found + 1] = begin[k] + size[k];
        }
        found++;
    }
    return (int64_t)found;
}
