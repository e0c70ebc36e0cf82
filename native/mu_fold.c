/* mu_fold.c: leak folding (libmemunreachable.md section 5): the leak graph among unmarked
 * allocations in CSR form, an iterative Tarjan SCC, the condensation, and per head SCC the
 * count/size of everything it reaches. O(V+E) memory; no recursion anywhere. */
#include "mu_core_impl.h"

#define FOLD_NONE UINT32_MAX
#define FOLD_HUBS 8u             /* shared sub-DAGs whose reach is precomputed (see heads_sum) */

typedef struct {                 /* growable uint32_t vector */
    uint32_t *v;
    uint64_t len, cap;
} vec32;

/* Returns 0 or -ENOMEM. */
/* The word before p (a text tail's test, mu_text_tail). */
static inline uint64_t prev_word(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p - 8, 8);
    return v;
}

static int vec_push(vec32 *a, uint32_t x)
{
    if (a->len == a->cap) {
        uint64_t cap = a->cap ? 2 * a->cap : 1024;
        uint32_t *nv = realloc(a->v, cap * sizeof *nv);
        if (!nv)
            return -ENOMEM;
        a->v = nv;
        a->cap = cap;
    }
    a->v[a->len++] = x;
    return 0;
}

#define FOLD_BATCH 256u

typedef struct {                 /* candidate words waiting for a batched lookup */
    uint32_t src[FOLD_BATCH];
    uint64_t val[FOLD_BATCH];
    uint64_t n;
} edge_batch;

/* Adds the deduplicated edges src[k] -> leak containing val[k] (src ascending), counting
 * them in off[src+1]; empties the batch. Returns 0 or -ENOMEM. */
static int add_edges(mu_scan_index *ix, const uint8_t *marked, const uint32_t *node_of,
                     uint32_t *stamp, vec32 *adj, uint64_t *off, edge_batch *eb)
{
    int64_t hit[FOLD_BATCH];
    mu_scan_index_find_many(ix, eb->val, eb->n, hit);
    uint64_t n = eb->n;
    eb->n = 0;
    for (uint64_t k = 0; k < n; k++) {
        int64_t a = hit[k];
        if (a < 0 || (node_of && marked[a]))
            continue;
        /* node_of NULL: the index holds the leaks alone, a hit is a node number */
        uint32_t u = eb->src[k], t = node_of ? node_of[a] : (uint32_t)a;
        if (stamp[t] == u + 1)
            continue;
        stamp[t] = u + 1;
        if (vec_push(adj, t) < 0)
            return -ENOMEM;
        off[u + 1]++;
    }
    return 0;
}

typedef struct {                 /* the condensation and what the head walks need */
    uint64_t ncomp;
    uint64_t *coff;              /* ncomp+1: SCC edges of c are cadj[coff[c] .. coff[c+1]) */
    vec32 cadj;
    uint64_t *ccount, *csize;
    uint8_t *mask;               /* bit j: the SCC is reachable from hub j */
    uint8_t *hub_bit;            /* bit of the hub this SCC is, or 0 */
    uint64_t ucount[256], usize[256];   /* sums over SCCs whose mask meets the index */
    uint64_t *seen;              /* visit stamp per SCC */
    uint64_t epoch;
    uint32_t *stack, *deferred;
} cond;

/* Plain DFS from c over the condensation; adds reached counts/sizes (or marks hub bit). */
static void walk_all(cond *g, uint32_t c, uint64_t *cnt, uint64_t *sz, uint8_t set_mask)
{
    uint64_t sp = 0, ep = ++g->epoch;
    g->seen[c] = ep;
    g->stack[sp++] = c;
    while (sp) {
        uint32_t x = g->stack[--sp];
        if (set_mask)
            g->mask[x] |= set_mask;
        *cnt += g->ccount[x];
        *sz += g->csize[x];
        for (uint64_t e = g->coff[x]; e < g->coff[x + 1]; e++) {
            uint32_t d = g->cadj.v[e];
            if (g->seen[d] != ep) {
                g->seen[d] = ep;
                g->stack[sp++] = d;
            }
        }
    }
}

/* Sums over every SCC reachable from head h. Descent stops at SCCs inside a hub's reach: if
 * every such SCC met lies in the reach of a hub that is itself met, the hub sums (precomputed
 * per set of hubs) are exact; otherwise the head is walked again without shortcuts. This keeps
 * many heads that share one large leaked structure linear instead of quadratic. */
static void heads_sum(cond *g, uint32_t h, uint64_t *cnt, uint64_t *sz)
{
    uint64_t sp = 0, nd = 0, ep = ++g->epoch, c0 = 0, s0 = 0;
    uint8_t reached = 0;
    g->seen[h] = ep;
    g->stack[sp++] = h;
    while (sp) {
        uint32_t x = g->stack[--sp];
        c0 += g->ccount[x];
        s0 += g->csize[x];
        for (uint64_t e = g->coff[x]; e < g->coff[x + 1]; e++) {
            uint32_t d = g->cadj.v[e];
            if (g->seen[d] == ep)
                continue;
            g->seen[d] = ep;
            if (g->mask[d]) {
                if (g->hub_bit[d])
                    reached |= g->hub_bit[d];
                else
                    g->deferred[nd++] = d;
            } else {
                g->stack[sp++] = d;
            }
        }
    }
    for (uint64_t k = 0; k < nd; k++) {
        if (!(g->mask[g->deferred[k]] & reached)) {
            *cnt = 0;
            *sz = 0;
            walk_all(g, h, cnt, sz, 0);
            return;
        }
    }
    *cnt = c0 + g->ucount[reached];
    *sz = s0 + g->usize[reached];
}

/* Claims for entry k every unclaimed SCC reachable from c (c itself included). */
static void claim_reach(cond *g, uint32_t *claim, uint32_t c, uint32_t k)
{
    uint64_t sp = 0;
    claim[c] = k;
    g->stack[sp++] = c;
    while (sp) {
        uint32_t x = g->stack[--sp];
        for (uint64_t e = g->coff[x]; e < g->coff[x + 1]; e++) {
            uint32_t d = g->cadj.v[e];
            if (claim[d] == FOLD_NONE) {
                claim[d] = k;
                g->stack[sp++] = d;
            }
        }
    }
}

int64_t mu_fold(const uint64_t *begin, const uint64_t *size, uint64_t n,
                const mu_region *heap, uint64_t nheap, const uint8_t *marked,
                uint64_t *rep, uint64_t *ref_count, uint64_t *ref_size, uint64_t cap,
                const mu_dead *dead, uint64_t *owner)
{
    if ((n && !marked) || (cap && (!rep || !ref_count || !ref_size)))
        return -EINVAL;
    /* The lookup index: over the leaks alone when they are few and nothing is indexed by
     * allocation number (no PyGC_Head table): building it over every allocation was most of
     * a fold of 1,000 leaks among 5 M blocks. A word into a reachable block then finds no
     * leak, as a reachable hit was skipped before. */
    uint64_t nleak = 0;
    for (uint64_t i = 0; i < n; i++)
        nleak += !marked[i];
    if (!nleak)     /* nothing to fold (the mark checked the same input: 0.03 s at 12 M blocks) */
        return 0;
    int sub = nleak * 4 < n && !(dead && dead->head_word);
    mu_scan_index ix;
    int64_t rc;
    uint64_t *sub_begin = NULL, *sub_size = NULL;
    if (sub) {
        rc = mu_scan_index_check(begin, size, n, heap, nheap);
        if (rc < 0)
            return rc;
        uint64_t *lb = malloc((nleak ? nleak : 1) * sizeof *lb);
        uint64_t *ls = malloc((nleak ? nleak : 1) * sizeof *ls);
        if (!lb || !ls) {
            free(lb);
            free(ls);
            return -ENOMEM;
        }
        for (uint64_t i = 0, k = 0; i < n; i++)
            if (!marked[i]) {
                lb[k] = begin[i];
                ls[k++] = size[i];
            }
        rc = mu_scan_index_init(&ix, lb, ls, nleak, heap, nheap, 0);
        if (rc < 0) {
            free(lb);
            free(ls);
        } else {
            sub_begin = lb;             /* the index reads them: freed with it */
            sub_size = ls;
        }
    } else {
        rc = mu_scan_index_init(&ix, begin, size, n, heap, nheap, 0);
    }
    if (rc < 0)
        return rc;
    rc = mu_scan_index_set_dead(&ix, dead);
    if (rc < 0) {
        mu_scan_index_free(&ix);
        free(sub_begin);
        free(sub_size);
        return rc;
    }

    uint32_t *node_of = NULL, *alloc_of = NULL, *stamp = NULL, *idx = NULL, *low = NULL;
    uint32_t *comp = NULL, *tstack = NULL, *cstack = NULL, *cstart = NULL, *members = NULL;
    uint32_t *indeg = NULL, *claim = NULL;
    uint64_t *off = NULL, *cursor = NULL;
    vec32 adj = {0};
    cond g;
    memset(&g, 0, sizeof g);
    int64_t out = 0;
    uint64_t V = 0;

    /* 1. Leak nodes, in address order. */
    node_of = malloc((n ? n : 1) * sizeof *node_of);
    if (!node_of)
        goto nomem;
    for (uint64_t i = 0; i < n; i++)
        node_of[i] = marked[i] ? FOLD_NONE : (uint32_t)V++;
    if (V == 0)
        goto done;
    alloc_of = malloc(V * sizeof *alloc_of);
    off = malloc((V + 1) * sizeof *off);
    stamp = calloc(V, sizeof *stamp);
    if (!alloc_of || !off || !stamp)
        goto nomem;
    for (uint64_t i = 0; i < n; i++)
        if (!marked[i])
            alloc_of[node_of[i]] = (uint32_t)i;

    /* 2. Leak graph (CSR): words of each leak that point into another (or the same) leak.
     * Candidate words of consecutive leaks are looked up in batches; pairs stay in u order,
     * so adj fills in CSR order and off[u+1] first counts u's edges. */
    memset(off, 0, (V + 1) * sizeof *off);
    {
        edge_batch eb = { .n = 0 };
        for (uint32_t u = 0; u < V; u++) {
            uint64_t i = alloc_of[u], b = begin[i], len = size[i];
            uint64_t r = nheap == 1 ? 0 : mu_scan_index_region_of(&ix, sub ? u : i);
            uint64_t avail = heap[r].base + heap[r].len - b;
            uint64_t skip = (8 - (b & 7)) & 7;
            if (skip >= len)
                continue;
            const uint8_t *base = heap[r].data + (b - heap[r].base);
            mu_rules rules, *rr = NULL;
            if (dead && dead->ntypes) {
                rr = &rules;
                mu_rules_search(dead, base, len < avail ? len : avail, rr);
            }
            if (rr && mu_dead_object_r(rr, base)) {   /* a dead object: its words are stale */
                uint64_t v[MU_VALUE_WORDS], at[MU_VALUE_WORDS];
                uint64_t nv = mu_value_handles(&ix, dead, rr, base, b, v, at);
                for (uint64_t k = 0; k < nv; k++) {     /* or a value: native blocks' handles */
                    eb.src[eb.n] = u;
                    eb.val[eb.n++] = v[k];
                    if (eb.n == FOLD_BATCH && add_edges(&ix, marked, sub ? NULL : node_of, stamp, &adj, off, &eb) < 0)
                        goto nomem;
                }
                continue;
            }
            uint64_t whole = len, hb, he, zb, ze, zs, rb, re;
            len = mu_live_end(dead, i, mu_live_len_r(dead, rr, base, b, len, avail));
            mu_live_head(dead, rr, i, b, base, whole, avail, &hb, &he, &zb, &ze, &zs);
            mu_live_iter it;
            mu_live_init(&it, dead, b + skip, b + len, hb, he);
            mu_live_strided(&it, zb, ze, zs);
            while (mu_live_next(&it, &rb, &re)) {
              for (uint64_t s = rb; s < re; s += 8) {
                uint64_t v = 0;
                if (s + 8 <= b + len) {
                    memcpy(&v, base + (s - b), 8);
                } else {                /* a last word starting before the end: read whole */
                    uint64_t have = avail - (s - b);
                    memcpy(&v, base + (s - b), have < 8 ? have : 8);
                }
                if (v - ix.lo >= ix.hi - ix.lo
                    || (s >= b + 8 && s + 8 <= b + len
                        && mu_text_tail(prev_word(base + (s - b)), v))
                    || (s >= b + 16 && s + 8 <= b + len
                        && mu_text_tail_aligned(prev_word(base + (s - b) - 8),
                                                prev_word(base + (s - b)), v)))
                    continue;
                eb.src[eb.n] = u;
                eb.val[eb.n++] = v;
                if (eb.n == FOLD_BATCH && add_edges(&ix, marked, sub ? NULL : node_of, stamp, &adj, off, &eb) < 0)
                    goto nomem;
              }
            }
        }
        if (eb.n && add_edges(&ix, marked, sub ? NULL : node_of, stamp, &adj, off, &eb) < 0)
            goto nomem;
    }
    for (uint32_t u = 0; u < V; u++)
        off[u + 1] += off[u];
    free(stamp);
    stamp = NULL;
    free(node_of);
    node_of = NULL;

    /* 3. Iterative Tarjan: comp[] numbers SCCs in reverse topological order. A visited node
     * without a component is exactly a node on the Tarjan stack. */
    idx = malloc(V * sizeof *idx);
    low = malloc(V * sizeof *low);
    comp = malloc(V * sizeof *comp);
    tstack = malloc(V * sizeof *tstack);
    cstack = malloc(V * sizeof *cstack);
    cursor = malloc(V * sizeof *cursor);
    if (!idx || !low || !comp || !tstack || !cstack || !cursor)
        goto nomem;
    memset(idx, 0xff, V * sizeof *idx);
    memset(comp, 0xff, V * sizeof *comp);
    uint32_t counter = 0, ncomp = 0;
    uint64_t tsp = 0, csp = 0;
    for (uint32_t s = 0; s < V; s++) {
        if (idx[s] != FOLD_NONE)
            continue;
        idx[s] = low[s] = counter++;
        tstack[tsp++] = s;
        cstack[csp++] = s;
        cursor[s] = off[s];
        while (csp) {
            uint32_t u = cstack[csp - 1];
            if (cursor[u] < off[u + 1]) {
                uint32_t v = adj.v[cursor[u]++];
                if (idx[v] == FOLD_NONE) {
                    idx[v] = low[v] = counter++;
                    tstack[tsp++] = v;
                    cstack[csp++] = v;
                    cursor[v] = off[v];
                } else if (comp[v] == FOLD_NONE && idx[v] < low[u]) {
                    low[u] = idx[v];
                }
                continue;
            }
            csp--;
            if (low[u] == idx[u]) {
                uint32_t w;
                do {
                    w = tstack[--tsp];
                    comp[w] = ncomp;
                } while (w != u);
                ncomp++;
            }
            if (csp && low[u] < low[cstack[csp - 1]])
                low[cstack[csp - 1]] = low[u];
        }
    }
    free(idx);
    idx = NULL;
    free(low);
    low = NULL;
    free(tstack);
    tstack = NULL;
    free(cstack);
    cstack = NULL;
    free(cursor);
    cursor = NULL;

    /* 4. Condensation: members grouped by SCC (ascending inside each), counts, sizes, and
     * deduplicated SCC edges with in-degrees. */
    g.ncomp = ncomp;
    cstart = calloc((uint64_t)ncomp + 1, sizeof *cstart);
    members = malloc(V * sizeof *members);
    g.coff = malloc(((uint64_t)ncomp + 1) * sizeof *g.coff);
    g.ccount = calloc(ncomp, sizeof *g.ccount);
    g.csize = calloc(ncomp, sizeof *g.csize);
    indeg = calloc(ncomp, sizeof *indeg);
    stamp = calloc(ncomp, sizeof *stamp);
    if (!cstart || !members || !g.coff || !g.ccount || !g.csize || !indeg || !stamp)
        goto nomem;
    for (uint32_t u = 0; u < V; u++) {
        cstart[comp[u] + 1]++;
        g.ccount[comp[u]]++;
        g.csize[comp[u]] += size[alloc_of[u]];
    }
    for (uint32_t c = 0; c < ncomp; c++)
        cstart[c + 1] += cstart[c];
    for (uint32_t u = 0; u < V; u++)     /* uses stamp as a fill cursor, then resets it */
        members[cstart[comp[u]] + stamp[comp[u]]++] = u;
    memset(stamp, 0, ncomp * sizeof *stamp);
    g.coff[0] = 0;
    for (uint32_t c = 0; c < ncomp; c++) {
        for (uint32_t m = cstart[c]; m < cstart[c + 1]; m++) {
            uint32_t u = members[m];
            for (uint64_t e = off[u]; e < off[u + 1]; e++) {
                uint32_t d = comp[adj.v[e]];
                if (d == c || stamp[d] == c + 1)
                    continue;
                stamp[d] = c + 1;
                indeg[d]++;
                if (vec_push(&g.cadj, d) < 0)
                    goto nomem;
            }
        }
        g.coff[c + 1] = g.cadj.len;
    }
    free(stamp);
    stamp = NULL;
    free(off);
    off = NULL;
    free(adj.v);
    adj.v = NULL;

    /* 5. Hubs: the SCCs with the most incoming SCC edges (at least 2); mask[] gets bit j on
     * every SCC that hub j reaches, and ucount/usize[set] the sums over the union of the
     * reaches of a set of hubs. */
    g.mask = calloc(ncomp, 1);
    g.hub_bit = calloc(ncomp, 1);
    g.seen = calloc(ncomp, sizeof *g.seen);
    g.stack = malloc((uint64_t)ncomp * sizeof *g.stack);
    g.deferred = malloc((uint64_t)ncomp * sizeof *g.deferred);
    if (!g.mask || !g.hub_bit || !g.seen || !g.stack || !g.deferred)
        goto nomem;
    uint32_t hubs[FOLD_HUBS];
    unsigned nhubs = 0;
    for (uint32_t c = 0; c < ncomp; c++) {
        if (indeg[c] < 2)
            continue;
        unsigned pos = nhubs < FOLD_HUBS ? nhubs++ : FOLD_HUBS;
        if (pos == FOLD_HUBS) {
            if (indeg[c] <= indeg[hubs[FOLD_HUBS - 1]])
                continue;
            pos = FOLD_HUBS - 1;
        }
        while (pos > 0 && indeg[hubs[pos - 1]] < indeg[c]) {
            hubs[pos] = hubs[pos - 1];
            pos--;
        }
        hubs[pos] = c;
    }
    for (unsigned j = 0; j < nhubs; j++) {
        uint64_t cnt = 0, sz = 0;
        g.hub_bit[hubs[j]] = (uint8_t)(1u << j);
        walk_all(&g, hubs[j], &cnt, &sz, (uint8_t)(1u << j));
    }
    if (nhubs) {
        uint64_t bcount[256] = {0}, bsize[256] = {0};
        for (uint32_t c = 0; c < ncomp; c++) {
            bcount[g.mask[c]] += g.ccount[c];
            bsize[g.mask[c]] += g.csize[c];
        }
        for (unsigned set = 1; set < 256; set++)
            for (unsigned m = 1; m < 256; m++)
                if (set & m) {
                    g.ucount[set] += bcount[m];
                    g.usize[set] += bsize[m];
                }
    }

    /* 6. One entry per head SCC (no incoming SCC edge), in order of its lowest member; with
     * owner, each SCC is claimed by the first entry that reaches it (an SCC reached through
     * a claimed one is claimed already: one walk over the condensation in all). */
    if (owner) {
        claim = malloc((uint64_t)ncomp * sizeof *claim);
        if (!claim)
            goto nomem;
        memset(claim, 0xff, (uint64_t)ncomp * sizeof *claim);
    }
    for (uint32_t u = 0; u < V; u++) {
        uint32_t c = comp[u];
        if (indeg[c] || members[cstart[c]] != u)
            continue;
        if ((uint64_t)out >= cap) {
            out = -ENOSPC;
            goto done;
        }
        uint64_t cnt = 0, sz = 0;
        heads_sum(&g, c, &cnt, &sz);
        rep[out] = alloc_of[u];
        ref_count[out] = cnt - 1;
        ref_size[out] = sz - size[alloc_of[u]];
        if (claim)
            claim_reach(&g, claim, c, (uint32_t)out);
        out++;
    }
    if (owner) {
        for (uint64_t i = 0; i < n; i++)
            owner[i] = UINT64_MAX;
        for (uint32_t u = 0; u < V; u++)
            owner[alloc_of[u]] = claim[comp[u]];
    }
    goto done;
nomem:
    out = -ENOMEM;
done:
    free(node_of);
    free(alloc_of);
    free(stamp);
    free(idx);
    free(low);
    free(comp);
    free(tstack);
    free(cstack);
    free(cursor);
    free(cstart);
    free(members);
    free(indeg);
    free(claim);
    free(off);
    free(adj.v);
    free(g.coff);
    free(g.cadj.v);
    free(g.ccount);
    free(g.csize);
    free(g.mask);
    free(g.hub_bit);
    free(g.seen);
    free(g.stack);
    free(g.deferred);
    mu_scan_index_free(&ix);
    free(sub_begin);
    free(sub_size);
    return out;
}

int64_t mu_sum_sizes(const uint64_t *size, const uint8_t *mask, uint64_t n, uint32_t zero,
                     uint64_t *selected)
{
    if ((n && (!size || !mask)) || !selected)
        return -EINVAL;
    /* eight mask bytes a step, their sizes read only when some of the eight is selected (a
     * few leaks among millions of blocks: the pass reads n bytes, not 9 n) */
    const uint64_t ones = 0x0101010101010101ull;
    uint64_t s = 0, k = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, mask + i, 8);
        if (zero)       /* non-zero when some byte is zero (which ones: tested below) */
            w = (w - ones) & ~w & 0x8080808080808080ull;
        if (w)
            for (uint64_t q = i; q < i + 8; q++)
                if (!mask[q] == !!zero) {
                    s += size[q];
                    k++;
                }
    }
    for (; i < n; i++)
        if (!mask[i] == !!zero) {
            s += size[i];
            k++;
        }
    *selected = s;
    return (int64_t)k;
}
