/* mu_core_impl.h: what every C file of the core includes: libc headers, then the API.
 * The mu_*.h headers are cdef-clean (no includes), so the includes live here. */
#ifndef MU_CORE_IMPL_H
#define MU_CORE_IMPL_H
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <pthread.h>
#include "mu_core.h"

/* The 8 (4) bytes of target memory's copy at p, whatever its alignment. */
static inline uint64_t mu_ld64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline uint32_t mu_ld32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Internal to the C core. mu_mem.c: one thread's read of [addr, addr+len) into buf (as
 * mu_read, without its threads). */
int64_t mu_read_serial(int memfd, uint64_t addr, uint8_t *buf, uint64_t len, uint64_t *first_bad);
/* mu_read_serial into a buffer whose pages are present (reused): no populate first */
int64_t mu_read_present(int memfd, uint64_t addr, uint8_t *buf, uint64_t len, uint64_t *first_bad);
/* Fault in the whole pages of [p, p+n) for writing (advisory; from 64 KiB) */
void mu_populate(uint8_t *p, uint64_t n);

/* mu_scan.c: 1 when v lies in an allocation of ix that holds no Python object d's rules know
 * (no PyGC_Head in d's head_word, no type rule with a plausible ob_refcnt at its start): a
 * value object's words (MU_TYPE_INT, FLOAT, BYTES) refer to such native blocks only. An int
 * equal to an object's address is its id(), which keeps nothing alive (memo dicts keyed by
 * id()). */
int mu_value_target_native(mu_scan_index *ix, const mu_dead *d, uint64_t v);   /* ix: this thread's */

/* mu_cands (mu_walk.h): per 1 MiB piece, the candidates' offsets (from the piece start) and
 * values, ascending, and for each 4 KiB sub-page the index of its first candidate. */
#define MU_CAND_PIECE_SHIFT 20
#define MU_CAND_SUB_SHIFT 12
#define MU_CAND_SUBS (1u << (MU_CAND_PIECE_SHIFT - MU_CAND_SUB_SHIFT))
typedef struct {
    uint32_t *off;              /* bit 0: a text tail after a word of the piece (mu_text_tail) */
    uint64_t *val;
    uint32_t n;
    int32_t state;              /* 0 not filled, 1 kept, -1 not kept (atomic) */
    int32_t head_tail;          /* its first two words may be text tails (the words before are
                                 * unknown) */
    uint32_t sub[MU_CAND_SUBS + 1];
} mu_cand_piece;

struct mu_cands {
    uint64_t base, len, lo, hi, max_words;
    uint64_t *ranges;           /* (begin, end) pairs inside [lo, hi) */
    uint64_t nranges;
    uint64_t used;              /* candidates kept (atomic) */
    uint64_t npieces;
    mu_cand_piece *p;
};

/* mu_walk.c: fills piece k of c from its bytes d (n of them); toff/tval: scratch of
 * (1 << MU_CAND_PIECE_SHIFT) / 8 entries. */
void mu_cands_fill_piece(mu_cands *c, uint64_t k, const uint8_t *d, uint64_t n, uint32_t *toff,
                         uint64_t *tval);

#define MU_DICT_ENTRY 24         /* a dict key table's entry with its hash: {hash, key, value} */
#define MU_SET_ENTRY 16          /* a set's table entry: {key, hash} */

/* Live words of a scanned range (mu_dead): yields runs of word start addresses, skipping the
 * dead ones. Shared by mu_mark (mu_scan.c) and mu_fold (mu_fold.c). */
typedef struct {
    uint64_t w, end;             /* next word start; word starts stay below end */
    uint64_t hb, he;             /* GC-link words of this allocation: starts in [hb, he) */
    uint64_t zb, ze, zs;         /* hashes in a table: starts zb + zs * k below ze (a dict key
                                  * table's, mu_dict_hashes; a set's table), 0, 0 for none */
    const uint64_t *sk;          /* dead range pairs */
    uint64_t nsk, k;             /* count; first pair that may still matter */
} mu_live_iter;

/* The first of n (begin, end, ...) records of `stride` words at v (ascending, disjoint) whose
 * end lies after a; n when none does. */
static inline uint64_t mu_first_ending_after(const uint64_t *v, uint64_t n, uint64_t stride,
                                             uint64_t a)
{
    uint64_t lo = 0, hi = n;
    while (lo < hi) {
        uint64_t mid = (lo + hi) >> 1;
        if (v[stride * mid + 1] <= a)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static inline void mu_live_init(mu_live_iter *it, const mu_dead *d, uint64_t w, uint64_t end,
                                uint64_t hb, uint64_t he)
{
    it->w = w;
    it->end = end;
    it->hb = hb;
    it->he = he;
    it->zb = it->ze = 0;
    it->zs = MU_DICT_ENTRY;
    it->k = 0;
    it->nsk = 0;
    it->sk = NULL;
    if (!d || !d->nranges)
        return;
    const uint64_t *sk = d->ranges;
    uint64_t n = d->nranges;
    if (end <= sk[0] || w >= sk[2 * n - 1])
        return;                 /* no dead range meets [w, end) */
    it->sk = sk;
    it->nsk = n;
    it->k = mu_first_ending_after(sk, n, 2, w);
}

/* Skips the words zb + zs * k below ze too (a table's hashes; zs a multiple of 8). */
static inline void mu_live_strided(mu_live_iter *it, uint64_t zb, uint64_t ze, uint64_t zs)
{
    it->zb = zb;
    it->ze = ze;
    it->zs = zs;
}

static inline uint64_t mu_live_past(uint64_t w, uint64_t e)
{
    return w + ((e - w + 7) & ~(uint64_t)7);
}

/* Next run of live word starts [*b, *e) (8-byte steps; *e may pass end by a partial word).
 * Returns 0 when the range is exhausted. */
static inline int mu_live_next(mu_live_iter *it, uint64_t *b, uint64_t *e)
{
    for (;;) {
        uint64_t w = it->w;
        if (w >= it->end)
            return 0;
        if (w >= it->hb && w < it->he) {
            it->w = mu_live_past(w, it->he);
            continue;
        }
        if (w >= it->zb && w < it->ze && (w - it->zb) % it->zs == 0) {
            it->w = w + 8;      /* an entry's hash */
            continue;
        }
        while (it->k < it->nsk && it->sk[2 * it->k + 1] <= w)
            it->k++;
        if (it->k < it->nsk && it->sk[2 * it->k] <= w) {
            it->w = mu_live_past(w, it->sk[2 * it->k + 1]);
            continue;
        }
        uint64_t stop = it->end;
        if (it->hb > w && it->hb < stop)
            stop = it->hb;
        if (it->k < it->nsk && it->sk[2 * it->k] < stop)
            stop = it->sk[2 * it->k];
        if (w < it->ze) {       /* up to the next entry's hash */
            uint64_t nh = w < it->zb ? it->zb
                        : it->zb + ((w - it->zb) / it->zs + 1) * it->zs;
            if (nh < stop)
                stop = nh;
        }
        *b = w;
        *e = it->w = mu_live_past(w, stop);
        return 1;
    }
}


/* Text tails. A C string's last word holds its last 1-7 characters, the NUL, and whatever the
 * memory held before in its other bytes: the high bytes of an old pointer read with the text as
 * an address (an OpenSSL name "AES-128-ECB", a name "version" after an int in a 24-byte
 * struct, an environment string, a type's docstring: each kept a leaked block of the same
 * process "reachable"). An 8-aligned pointer field cannot begin inside a char array, so a word
 * that starts with 1-7 printable bytes then a NUL, right after a word whose 4 high bytes are
 * printable (0x20-0x7e: the string's first characters), is text and never a reference, unless
 * it is 8-aligned (mu_tail_shape: the text's first byte is one of 12 of the 95 printable). A
 * pointer's two high bytes are 0, so the word before cannot be one; a NUL in byte 0 (a
 * 256-aligned address) does not match. mu_mark (both of its paths), mu_fold and explain.py
 * apply it to words whose previous word lies in the same allocation or root range. */
#define MU_ONES 0x0101010101010101ull
#define MU_HIGHS 0x8080808080808080ull

static inline int mu_printable8(uint64_t x)
{
    return !((((x - 0x20 * MU_ONES) & ~x) | ((x + MU_ONES) | x)) & MU_HIGHS);
}

/* The index of v's first NUL byte (0-7), 8 when it has none. */
static inline unsigned mu_first_nul(uint64_t v)
{
    uint64_t z = (v - MU_ONES) & ~v & MU_HIGHS;     /* its lowest bit: the first NUL byte */
    return z ? (unsigned)__builtin_ctzll(z) >> 3 : 8;
}

/* mu_tail_bytes: 1 when v could end a string: 1-7 printable bytes, then a NUL. mu_tail_shape:
 * and is no 8-aligned address (an object's, a field's: dict entries, list items and struct
 * fields point at those, and a random hash before one reads as text in 2% of entries; a low
 * non-PIE heap's addresses, 4 bytes then zeros, have the shape in 1 of 7). */
static inline int mu_tail_bytes(uint64_t v)
{
    unsigned k = mu_first_nul(v);
    if (k == 0 || k == 8)
        return 0;
    uint64_t keep = (1ull << (8 * k)) - 1;
    return mu_printable8((v & keep) | (0x4141414141414141ull & ~keep));
}

static inline int mu_tail_shape(uint64_t v)
{
    return (v & 7) && mu_tail_bytes(v);
}

/* 1 when some byte after v's first NUL is not 0: what the memory held before the string (an
 * old pointer's high bytes). A pointer below 4 GiB (a non-PIE interpreter's heap) has 4
 * bytes, then zeros: in 1 of 50 those 4 read as text. */
static inline int mu_old_bytes_after_nul(uint64_t v)
{
    unsigned k = mu_first_nul(v);
    return k < 7 && (v >> (8 * k + 8)) != 0;
}

/* 1 when the 4 high bytes of prev are printable: a string runs on into the next word. */
static inline int mu_text_runs_on(uint64_t prev)
{
    return mu_printable8((prev & 0xffffffff00000000ull) | 0x41414141ull);
}

static inline int mu_text_tail(uint64_t prev, uint64_t v)
{
    return mu_text_runs_on(prev) && mu_tail_shape(v);
}

/* An 8-aligned word with a tail's bytes and old bytes after its NUL (the test the callers make
 * first: most pointer words fail it on their own bytes). */
static inline int mu_aligned_tail_bytes(uint64_t v)
{
    return !(v & 7) && mu_tail_bytes(v) && mu_old_bytes_after_nul(v);
}

/* Such a word ends a string too when the two words before it are 8 printable bytes each: a
 * string of 16 characters or more runs on into it (glibc's setenv keeps every
 * "PYTEST_CURRENT_TEST=... (setup)" it was given; its last word "p)" and a NUL glued to an old
 * pointer's high bytes kept a leaked 34 MB block in each run of a suite). An 8-aligned pointer
 * after a hash (a dict entry's key) follows the previous entry's value, never text; after one
 * word of text, as in a struct's pointer field after a short inline name, it stays a
 * reference. mu_mark (both of its paths), mu_fold and explain.py apply it to words whose two
 * previous words lie in the same allocation or root range. */
static inline int mu_text_tail_aligned(uint64_t prev2, uint64_t prev, uint64_t v)
{
    return mu_aligned_tail_bytes(v) && mu_printable8(prev) && mu_printable8(prev2);
}

/* The online CPUs (sysconf(_SC_NPROCESSORS_ONLN)), read once a process: glibc opens
 * /sys/devices/system/cpu/online at each call, 12 times in a pytest process's check. */
long mu_online_cpus(void);

/* Runs fn(a) on a second thread and fn(b) on this one when `parallel` (and a thread starts
 * on a machine of more than one CPU), else both here: for a pass over memory, which this
 * machine reads or writes at one thread's bandwidth (two threads moved two arrays in about
 * 0.4x the time of one thread moving both). */
static inline void mu_two_ways(void *(*fn)(void *), void *a, void *b, int parallel)
{
    pthread_t tid;
    int two = parallel && mu_online_cpus() > 1 && pthread_create(&tid, NULL, fn, a) == 0;
    if (!two)
        fn(a);
    fn(b);
    if (two)
        pthread_join(tid, NULL);
}

/* The first index in [lo, hi) of the ascending array a whose value is >= v, or hi. */
static inline uint64_t mu_lower_bound(const uint64_t *a, uint64_t lo, uint64_t hi, uint64_t v)
{
    while (lo < hi) {
        uint64_t mid = (lo + hi) >> 1;
        if (a[mid] < v)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* The index of v in the ascending array a[0..n), or n. */
static inline uint64_t mu_find_sorted(const uint64_t *a, uint64_t n, uint64_t v)
{
    uint64_t lo = mu_lower_bound(a, 0, n, v);
    return lo < n && a[lo] == v ? lo : n;
}

/* mu_find_sorted from a finger: gallops from *hint towards v, then bisects the bracket;
 * *hint becomes where v is or would go. A pass whose values mostly ascend (the item arrays
 * of lists made one after the other) pays a few steps a lookup instead of a bisection of
 * the whole array (4 M lists of a Python process: 0.5 s of cache misses). */
static inline uint64_t mu_find_sorted_near(const uint64_t *a, uint64_t n, uint64_t v,
                                           uint64_t *hint)
{
    if (!n)
        return 0;
    uint64_t h = *hint < n ? *hint : n - 1, lo, hi, step = 1;
    if (a[h] < v) {                 /* the answer (first a[x] >= v) lies above h */
        lo = h + 1;
        while (h + step < n && a[h + step] < v) {
            lo = h + step + 1;
            step <<= 1;
        }
        hi = h + step < n ? h + step + 1 : n;
    } else {                        /* at h or below */
        hi = h + 1;
        while (step <= h && a[h - step] >= v) {
            hi = h - step + 1;
            step <<= 1;
        }
        lo = step <= h ? h - step + 1 : 0;
    }
    lo = mu_lower_bound(a, lo, hi, v);
    *hint = lo;
    return lo < n && a[lo] == v ? lo : n;
}

/* A list's dead item slots (mu_list_slack): from item + 8 * ob_size to the end of the item
 * array's allocation (its `allocated` slots, and the allocator's slack after them, when the
 * image has an allocation starting at item that holds them); 0 when the fields do not agree.
 * *hint: mu_find_sorted_near's finger, carried from list to list. */
static inline uint64_t mu_list_dead_end(const uint64_t *begin, const uint64_t *size, uint64_t n,
                                        uint64_t n_size, uint64_t item, uint64_t alloc,
                                        uint64_t *hint)
{
    if (!item || (item & 7) || (int64_t)n_size < 0 || n_size > alloc || alloc > (1ull << 40))
        return 0;
    uint64_t end = item + 8 * alloc, k = mu_find_sorted_near(begin, n, item, hint);
    if (k < n && 8 * alloc <= size[k])
        end = begin[k] + size[k];
    return end > item + 8 * n_size ? end : 0;
}

/* Index of the region holding [addr, addr+n), or -1. */
static inline int64_t mu_region_find(const mu_region *r, uint64_t nr, uint64_t addr, uint64_t n)
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

#define MU_REFCNT_SMALL (1ull << 24)

/* 1 when d has a rule for the object header at p + off (ob_refcnt, ob_type) at that offset:
 * *code receives it (offset | kind << 8 | parameter << 16), *rc the ob_refcnt; else 0. */
static inline int mu_type_rule(const mu_dead *d, const uint8_t *p, uint64_t off, uint64_t *rc,
                               uint64_t *code)
{
    uint64_t tp;
    memcpy(rc, p + off, 8);
    memcpy(&tp, p + off + 8, 8);
    uint64_t lo = 0, hi = d->ntypes;
    while (lo < hi) {
        uint64_t mid = (lo + hi) >> 1;
        if (d->types[2 * mid] < tp)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == d->ntypes || d->types[2 * lo] != tp || (d->types[2 * lo + 1] & 0xff) != off)
        return 0;
    *code = d->types[2 * lo + 1];
    return 1;
}

/* A plausible ob_refcnt, not a pointer (an item array holding the type object at index 1
 * looks the same otherwise): small, or an immortal's: 3.12/3.13 0xFFFFFFFF; 3.14+ a 32-bit
 * count of at least 1 << 31 (3 << 30 at first), ob_overflow 0 and ob_flags set (1 immortal,
 * 4 static: 0x0005_0000_C000_0000 for a static immortal; interned strings, a .pyc's
 * constants are immortal): no user-space address has bits 48-63 set, while one of a non-PIE
 * heap past 2 GiB could read as a bare count. */
static inline int mu_plausible_refcnt(uint64_t rc)
{
    return (rc >= 1 && rc < MU_REFCNT_SMALL) || rc == 0xFFFFFFFFull
           || ((rc & 0xFFFFFFFFull) >= 0x80000000ull && ((rc >> 32) & 0xFFFF) == 0
               && (rc >> 48) >= 1 && (rc >> 48) < 0x100);
}

/* 1 when the two words before the object at offset off of the block at p are the PyGC_Head of
 * an untracked object: gc_next 0, gc_prev 0 or its finalized bit (_PyObject_GC_UNTRACK; a
 * fresh object's head is zeroed). A dead GC object (free-listed, a zombie frame) always has
 * one; an item array whose stale slack happens to hold 0 then a type's address (a live list's
 * items, seen on 3.9 and 3.10) does not, and must not be taken for a dead object. */
static inline int mu_untracked_head(const uint8_t *p, uint64_t off)
{
    uint64_t head[2];
    if (off < 16)
        return 0;
    memcpy(head, p + off - 16, 16);
    return head[0] == 0 && (head[1] & ~1ull) == 0;
}

/* The type rules met in a block (bytes at p, have = min(len, avail) of them readable): bit k of
 * found when the object header at offset 16k (k = 0..3, its 16 bytes within have) has a rule
 * of d at that offset (mu_type_rule); rc[k] and code[k] are then its ob_refcnt and code. Filled
 * by mu_rules_search (a binary search over d's types) or by a faster lookup of the same
 * answers (mu_scan.c's hash of the types); mu_dead_object_r and mu_live_len_r decide from it. */
typedef struct {
    uint32_t found;
    uint64_t have;
    uint64_t rc[4], code[4];
} mu_rules;

static inline void mu_rules_search(const mu_dead *d, const uint8_t *p, uint64_t have, mu_rules *r)
{
    r->found = 0;
    r->have = have;
    for (uint64_t off = 0; off + 16 <= have && off <= 48; off += 16)
        if (mu_type_rule(d, p, off, &r->rc[off >> 4], &r->code[off >> 4]))
            r->found |= 1u << (off >> 4);
}

/* The value of the int whose header is at p + off (have bytes readable at p), when it can
 * hold an address (mu_types.h, MU_TYPE_INT; param: MU_INT_OB_SIZE or MU_INT_LV_TAG): 1 and *v
 * for a positive int of 1-3 30-bit digits below 2**64 whose digits lie within the have bytes;
 * else 0 (zero, negative, larger, or not an int's digits). */
#define MU_INT_SIZE 16            /* the object offsets of ob_size / lv_tag and of the digits */
#define MU_INT_DIGITS 24
#define MU_INT_DIGIT_BITS 30

static inline int mu_int_value(uint64_t param, const uint8_t *p, uint64_t off, uint64_t have,
                               uint64_t *v)
{
    uint64_t tag, nd;
    uint32_t d[3] = {0, 0, 0};
    if (off + MU_INT_DIGITS > have)
        return 0;
    memcpy(&tag, p + off + MU_INT_SIZE, 8);
    if (param == MU_INT_LV_TAG) {
        if (tag & 3)
            return 0;               /* zero (1) or negative (2) */
        nd = tag >> 3;
    } else {
        nd = (int64_t)tag > 0 ? tag : 0;
    }
    if (nd < 1 || nd > 3 || off + MU_INT_DIGITS + 4 * nd > have)
        return 0;
    memcpy(d, p + off + MU_INT_DIGITS, 4 * nd);
    if ((d[0] | d[1] | d[2]) >> MU_INT_DIGIT_BITS || d[2] >> (64 - 2 * MU_INT_DIGIT_BITS))
        return 0;
    *v = d[0] | (uint64_t)d[1] << MU_INT_DIGIT_BITS | (uint64_t)d[2] << (2 * MU_INT_DIGIT_BITS);
    return 1;
}

/* The words of a value object that may be native blocks' addresses (mu_types.h: MU_TYPE_INT,
 * MU_TYPE_FLOAT, MU_TYPE_BYTES) in the block at b (rules r, bytes at p): stores up to
 * MU_VALUE_WORDS values in v and the addresses they were read from in at; returns how many. */
#define MU_VALUE_WORDS 8          /* a bytes object's data of up to 64 bytes */
#define MU_FLOAT_VALUE 16         /* PyFloatObject.ob_fval */
#define MU_BYTES_SIZE 16          /* PyBytesObject.ob_size */

static inline uint64_t mu_value_words_r(const mu_rules *r, const uint8_t *p, uint64_t b,
                                        uint64_t *v, uint64_t *at)
{
    for (uint32_t f = r->found; f; f &= f - 1) {
        uint64_t k = (uint64_t)__builtin_ctz(f), off = 16 * k, code = r->code[k];
        uint64_t kind = (code >> 8) & 0xff, param = (code >> 16) & 0xffffffffull;
        if (!mu_plausible_refcnt(r->rc[k]))
            continue;
        if (kind == MU_TYPE_INT) {
            at[0] = b + off + MU_INT_DIGITS;
            return (uint64_t)mu_int_value(param, p, off, r->have, v);
        }
        if (kind == MU_TYPE_FLOAT) {
            if (off + MU_FLOAT_VALUE + 8 > r->have)
                return 0;
            at[0] = b + off + MU_FLOAT_VALUE;
            memcpy(v, p + off + MU_FLOAT_VALUE, 8);
            return 1;
        }
        if (kind == MU_TYPE_BYTES) {
            int64_t count;
            if (off + MU_BYTES_SIZE + 8 > r->have)
                return 0;
            memcpy(&count, p + off + MU_BYTES_SIZE, 8);
            if (count < 8 || count > 8 * MU_VALUE_WORDS || off + param + (uint64_t)count >= r->have)
                return 0;           /* no whole word, more than a packed struct, or no NUL */
            uint64_t n = (uint64_t)count / 8;
            for (uint64_t j = 0; j < n; j++) {
                at[j] = b + off + param + 8 * j;
                memcpy(&v[j], p + off + param + 8 * j, 8);
            }
            return n;
        }
    }
    return 0;
}

/* The handles of a value object (mu_value_words_r) that are native blocks'
 * (mu_value_target_native), kept in v and at in their order; returns how many. What mark
 * follows and fold draws edges to (ix: this thread's). */
static inline uint64_t mu_value_handles(mu_scan_index *ix, const mu_dead *d, const mu_rules *r,
                                        const uint8_t *p, uint64_t b, uint64_t *v, uint64_t *at)
{
    uint64_t n = mu_value_words_r(r, p, b, v, at), kept = 0;
    for (uint64_t j = 0; j < n; j++)
        if (mu_value_target_native(ix, d, v[j])) {
            v[kept] = v[j];
            at[kept++] = at[j];
        }
    return kept;
}

/* mu_dead_object over the rules r of the block (d has types). */
static inline int mu_dead_object_r(const mu_rules *r, const uint8_t *p)
{
    for (uint32_t f = r->found; f; f &= f - 1) {
        uint64_t k = (uint64_t)__builtin_ctz(f), off = 16 * k, rc = r->rc[k], code = r->code[k];
        uint64_t kind = (code >> 8) & 0xff;
        if ((kind == MU_TYPE_DEAD_AT_ZERO || kind == MU_TYPE_VARSIZED || kind == MU_TYPE_DICT)
            && rc == 0 && mu_untracked_head(p, off))
            return 1;
        if (!mu_plausible_refcnt(rc))
            continue;
        if (kind == MU_TYPE_OPAQUE || kind == MU_TYPE_INT || kind == MU_TYPE_FLOAT
            || kind == MU_TYPE_BYTES)
            return 1;               /* (a value's words: mu_value_words_r) */
        if (kind == MU_TYPE_STR && off + 36 <= r->have) {
            uint32_t state;
            memcpy(&state, p + off + 32, 4);
            if ((state & 0x60) == 0x60)     /* compact and ASCII: the text follows, inline */
                return 1;
        }
    }
    return 0;
}

/* 1 when allocation [b, b+len) (bytes at p, avail readable) holds a dead object or an object
 * that holds no references (mu_dead types). */
static inline int mu_dead_object(const mu_dead *d, const uint8_t *p, uint64_t len, uint64_t avail)
{
    if (!d || !d->ntypes)
        return 0;
    mu_rules r;
    mu_rules_search(d, p, len < avail ? len : avail, &r);
    return mu_dead_object_r(&r, p);
}

/* The live length of allocation [b, b+len) (bytes at p, avail readable): len, or less when it
 * holds an object whose words past some point are dead (mu_dead kinds MU_TYPE_FRAME,
 * GEN_FRAME, SIZED, VARSIZED). */
#define MU_FRAME_STACKTOP 64      /* 3.11-3.13: int stacktop; 3.14+: _PyStackRef *stackpointer */

/* The block offset where frame data at block offset fo (of flavour fl, MU_FRAME_FLAVOUR_*)
 * begins its slots. */
static inline uint64_t mu_frame_slots(uint64_t fo, unsigned fl)
{
    return fo + (fl == MU_FRAME_FLAVOUR_311 ? 72 : 80);
}

/* The block offset where the live slots of the frame data at block offset fo end (its stack
 * top), in allocation [b, b+len) (bytes at p, fo + 80 readable); 0 when the top is not one to
 * trust. */
static inline uint64_t mu_frame_top(const uint8_t *p, uint64_t b, uint64_t fo, uint64_t len,
                                    unsigned fl)
{
    uint64_t slots = mu_frame_slots(fo, fl), end;
    if (fl == MU_FRAME_FLAVOUR_311) {
        int32_t top;
        memcpy(&top, p + fo + MU_FRAME_STACKTOP, 4);
        if (top < 0)
            return 0;
        end = slots + 8 * (uint64_t)top;
    } else {
        uint64_t sp;
        memcpy(&sp, p + fo + MU_FRAME_STACKTOP, 8);
        if (sp < b + slots || (sp - b - slots) % 8)
            return 0;
        end = sp - b;
    }
    return end <= len ? end : 0;
}

/* The size of the dict key table at p (len bytes, avail readable) as new_keys_object allocated
 * it, when every header field is consistent and the allocation exceeds it by 0-31 bytes (an
 * allocator's rounding: pymalloc's size class, under 16 bytes; glibc's, under 24, or a free
 * chunk 16 bytes larger than asked, which it hands out whole: sid's 3.13 kept a 208-byte
 * table in a 232-byte block, its slack holding a stale copy of a leaked block's address);
 * else 0. */
static inline uint64_t mu_dict_keys_len(uint32_t layout, const uint8_t *p, uint64_t len,
                                        uint64_t avail)
{
    uint64_t h[5], total;
    if (len < 48 || avail < 40)
        return 0;
    memcpy(h, p, 40);
    if (h[0] < 1 || h[0] >= MU_REFCNT_SMALL)
        return 0;
    if (layout == MU_DICT_KEYS_38) {
        uint64_t size = h[1], frac = (size << 1) / 3;
        if (size < 8 || size > (1ull << 30) || (size & (size - 1)) || h[2] < 4096
            || h[3] > frac || h[4] > frac || h[3] + h[4] > frac)
            return 0;
        uint64_t ix = size <= 0xff ? 1 : size <= 0xffff ? 2 : 4;
        total = 40 + ix * size + 24 * frac;
    } else if (layout == MU_DICT_KEYS_311) {
        uint8_t log2 = p[8], log2ib = p[9], kind = p[10];
        if (log2 < 3 || log2 > 30 || kind > 2)
            return 0;
        uint8_t want = log2 < 8 ? log2 : log2 < 16 ? log2 + 1 : log2 + 2;
        uint64_t frac = ((1ull << log2) << 1) / 3;
        if (log2ib != want || h[2] > frac || h[3] > frac || h[2] + h[3] > frac)
            return 0;
        total = 32 + (1ull << log2ib) + (kind == 0 ? 24 : 16) * frac;
    } else {
        return 0;
    }
    return total <= len && len - total < 32 ? total : 0;
}

/* The entries [*zb, *ze) of the dict key table at p (allocation b; total: its size as
 * mu_dict_keys_len found it consistent) when each starts with its key's hash: 3.8-3.10 every
 * table, 3.11+ a general one (dk_kind 0; a table of str keys holds no hashes). A hash is no
 * reference: an int key's hash is its value, so a dict keyed by id() (a base type's
 * tp_subclasses) held every object whose address is a key. 0, 0 for none. */
static inline void mu_dict_hashes(uint32_t layout, const uint8_t *p, uint64_t b, uint64_t total,
                                  uint64_t *zb, uint64_t *ze)
{
    uint64_t entries, n;
    *zb = *ze = 0;
    if (layout == MU_DICT_KEYS_38) {
        uint64_t size;
        memcpy(&size, p + 8, 8);
        entries = 40 + (size <= 0xff ? 1 : size <= 0xffff ? 2 : 4) * size;
        n = (size << 1) / 3;
    } else {
        if (p[10] != 0)
            return;
        entries = 32 + (1ull << p[9]);
        n = ((1ull << p[8]) << 1) / 3;
    }
    if (entries + MU_DICT_ENTRY * n > total)
        return;
    *zb = b + entries;
    *ze = *zb + MU_DICT_ENTRY * n;
}

#define MU_DEBUG_PREFIX 16
#define MU_DEBUG_TAIL 8
#define MU_FORBIDDEN 0xfd         /* PYMEM_FORBIDDENBYTE */

/* The end of the requested bytes (rounded up to a word) of the allocation at p (len bytes,
 * avail readable) when it carries CPython's debug-hook prefix and tail (mu_dead debug_hooks),
 * else 0. */
static inline uint64_t mu_debug_hooks_end(const uint8_t *p, uint64_t len, uint64_t avail)
{
    if (len < MU_DEBUG_PREFIX + MU_DEBUG_TAIL || avail < MU_DEBUG_PREFIX)
        return 0;
    uint64_t n = 0;
    for (int k = 0; k < 8; k++)
        n = n << 8 | p[k];
    if ((p[8] != 'r' && p[8] != 'm' && p[8] != 'o') || n > len - MU_DEBUG_PREFIX - MU_DEBUG_TAIL
        || avail < MU_DEBUG_PREFIX + n + MU_DEBUG_TAIL)
        return 0;
    for (int k = 9; k < MU_DEBUG_PREFIX; k++)
        if (p[k] != MU_FORBIDDEN)
            return 0;
    for (int k = 0; k < MU_DEBUG_TAIL; k++)
        if (p[MU_DEBUG_PREFIX + n + k] != MU_FORBIDDEN)
            return 0;
    return (MU_DEBUG_PREFIX + n + 7) & ~7ull;
}

/* The dict key table in the allocation at p (len bytes, avail readable) when d has the rule:
 * its size (mu_dict_keys_len) and in *at its offset in the allocation, 0 or, under the debug
 * hooks, their prefix's 16 bytes (the table then ends at the requested bytes, end: the
 * allocation's mu_debug_hooks_end, which the caller may have found already; UINT64_MAX: not
 * yet); 0 for none. */
static inline uint64_t mu_dict_keys_in(const mu_dead *d, const uint8_t *p, uint64_t len,
                                       uint64_t avail, uint64_t end, uint64_t *at)
{
    *at = 0;
    if (!d || !d->dict_keys)
        return 0;
    if (!d->debug_hooks)
        return mu_dict_keys_len(d->dict_keys, p, len, avail);
    if (end == UINT64_MAX)
        end = mu_debug_hooks_end(p, len, avail);
    if (!end)
        return 0;
    *at = MU_DEBUG_PREFIX;
    return mu_dict_keys_len(d->dict_keys, p + MU_DEBUG_PREFIX, end - MU_DEBUG_PREFIX,
                            avail - MU_DEBUG_PREFIX);
}

/* mu_live_len with the rules r of the block (NULL when d has no types). */
static inline uint64_t mu_live_len_r(const mu_dead *d, const mu_rules *r, const uint8_t *p,
                                     uint64_t b, uint64_t len, uint64_t avail)
{
    uint64_t end = d && d->debug_hooks ? mu_debug_hooks_end(p, len, avail) : 0;
    uint64_t at, keys = mu_dict_keys_in(d, p, len, avail, end, &at);
    if (keys)
        return at + keys;
    if (end)                        /* the object rules below then see the requested bytes */
        len = end;
    if (!r)
        return len;
    uint64_t have = r->have;
    for (uint32_t f = r->found; f; f &= f - 1) {
        uint64_t k = (uint64_t)__builtin_ctz(f), off = 16 * k, rc = r->rc[k], code = r->code[k], fr;
        if (!mu_plausible_refcnt(rc))
            continue;
        uint64_t kind = (code >> 8) & 0xff;
        if (kind == MU_TYPE_CDATA) {    /* its size, unless its data follows it inline */
            uint64_t head = (code >> 16) & 0xffffffffull, data;
            if (off + 32 > have)
                continue;
            memcpy(&data, p + off + 24, 8);
            if (data - (b + off + head) < len - off - head)
                continue;           /* its value inline, after the header (aligned) */
            uint64_t end = b + off + ((head + 7) & ~7ull);
            return end < b + len ? end - b : len;
        }
        if (kind == MU_TYPE_SIZED || kind == MU_TYPE_DICT) {    /* the header (16 bytes) only */
            uint64_t end = b + off + ((((code >> 16) & 0xffffffffull) + 7) & ~7ull);
            return end < b + len ? end - b : len;
        }
        if (kind == MU_TYPE_VARSIZED) {
            int64_t count = 0;      /* no items: a fixed-size type with the dead-at-zero rule */
            uint64_t head = (code >> 16) & 0xffffffffull, item = (code >> 48) & 0xff;
            if (item && off + 24 > have)
                continue;
            if (item)
                memcpy(&count, p + off + 16, 8);
            if (item && (count < 0 || (uint64_t)count > len))
                continue;           /* not a count we can trust: scan it all */
            uint64_t end = b + off + ((head + item * (uint64_t)count + 7) & ~7ull);
            return end < b + len ? end - b : len;
        }
        if (kind == MU_TYPE_MEMORYVIEW) {
            uint64_t head = (code >> 16) & 0xffffffffull, sub;
            int64_t count;
            if (off + 24 > have || head < 24 || off + head > have)
                continue;
            memcpy(&count, p + off + 16, 8);
            memcpy(&sub, p + off + head - 24, 8);
            if (count < 0 || count % 3 || count > 3 * 64)
                continue;           /* not a memoryview's count: scan it all */
            uint64_t end = off + head + 8 * (uint64_t)(sub ? count : count / 3 * 2);
            return end < len ? end : len;
        }
        if (kind == MU_TYPE_GEN_FRAME || kind == MU_TYPE_FRAME) {
            uint64_t fo = off + ((code >> 16) & 0xffff), end;
            unsigned fl = (unsigned)(code >> 32) & 0xff;
            if (fo < off + 32 || mu_frame_slots(fo, fl) > have)
                continue;           /* unreadable: scan it all */
            if (kind == MU_TYPE_FRAME) {
                memcpy(&fr, p + off + 24, 8);
                if (fr != b + fo)   /* the frame runs elsewhere: its inline data is unwritten */
                    return fo;
            } else {
                int8_t state = (int8_t)p[fo - 5];
                int suspended = fl == MU_FRAME_FLAVOUR_315 ? state >= 0 && state <= 3 : state < 0;
                if (state == (fl == MU_FRAME_FLAVOUR_315 ? 5 : 4))
                    return mu_frame_slots(fo, fl);  /* cleared: slots released, not zeroed */
                if (!suspended) {   /* running or completing: 3.11-3.13 its slots (ob_size),
                                     * not the slack; 3.14+ scanned whole */
                    int64_t slots;
                    if (fl != MU_FRAME_FLAVOUR_311)
                        continue;
                    memcpy(&slots, p + off + 16, 8);
                    end = mu_frame_slots(fo, fl) + 8 * (uint64_t)slots;
                    if (slots < 0 || end > len)
                        continue;
                    return end;
                }
            }
            end = mu_frame_top(p, b, fo, len, fl);
            if (!end)
                continue;           /* not a stack top we can trust: scan it all */
            return end;
        }
    }
    return len;
}

/* len, or less when d's live_end limits allocation i (a list's item array: its used slots;
 * not a set's table, MU_LIVE_SET_TABLE). */
static inline uint64_t mu_live_end(const mu_dead *d, uint64_t i, uint64_t len)
{
    uint32_t e = (d && d->live_end) ? d->live_end[i] : 0;
    return e && !(e & MU_LIVE_SET_TABLE) && e - 1 < len ? e - 1 : len;
}

static inline uint64_t mu_live_len(const mu_dead *d, const uint8_t *p, uint64_t b, uint64_t len,
                                   uint64_t avail)
{
    if (!d || !d->ntypes)
        return mu_live_len_r(d, NULL, p, b, len, avail);
    mu_rules r;
    mu_rules_search(d, p, len < avail ? len : avail, &r);
    return mu_live_len_r(d, &r, p, b, len, avail);
}

/* The GC-link words of allocation i (0, 0 when none), and with rules r (NULL: none) a dict's
 * header words after them (MU_TYPE_DICT at object offset 16 with the GC head, or 0 without),
 * or the words a MU_TYPE_SIZED rule names (bits 48-55 of its code: the first word's index from
 * the object's start, bits 56-63: how many; an object without GC links);
 * or, for an allocation that is a dict key table (mu_dict_keys_len over its p, len, avail),
 * the table's header: counts, sizes and, 3.11+, a padding byte (0x40 seen: 0x40010606, a
 * number inside a non-PIE interpreter's heap), 3.8-3.10 its lookup function, and in [*zb, *ze)
 * its entries' hashes (mu_dict_hashes; 0, 0 for none: mu_live_strided), *zs apart;
 * for an allocation holding a set's table (live_end: MU_LIVE_SET_TABLE), its entries' hashes. */
static inline void mu_live_head(const mu_dead *d, const mu_rules *r, uint64_t i, uint64_t b,
                                const uint8_t *p, uint64_t len, uint64_t avail,
                                uint64_t *hb, uint64_t *he, uint64_t *zb, uint64_t *ze,
                                uint64_t *zs)
{
    uint8_t hw = (d && d->head_word) ? d->head_word[i] : 0;
    *hb = hw ? b + 8 * (uint64_t)(hw - 1) : 0;
    *he = hw ? *hb + 16 : 0;
    *zb = *ze = 0;
    *zs = MU_DICT_ENTRY;
    uint32_t e = (d && d->live_end) ? d->live_end[i] : 0;
    if (!hw && (e & MU_LIVE_SET_TABLE)) {
        *zb = b + (e & 0xff) + 8;       /* each entry's second word */
        *ze = b + len;
        *zs = MU_SET_ENTRY;
        return;
    }
    uint64_t at = 0, keys = !hw ? mu_dict_keys_in(d, p, len, avail, UINT64_MAX, &at) : 0;
    if (keys) {
        *hb = b + at;       /* a dict key table's header: counts, sizes, a padding byte */
        *he = *hb + (d->dict_keys == MU_DICT_KEYS_38 ? 40 : 32);
        mu_dict_hashes(d->dict_keys, p + at, b + at, keys, zb, ze);  /* and its entries' hashes */
        return;
    }
    for (uint32_t f = r ? r->found : 0; f; f &= f - 1) {
        uint64_t k = (uint64_t)__builtin_ctz(f), off = 16 * k, code = r->code[k];
        uint64_t first = (code >> 48) & 0xff, count = code >> 56;
        if (((code >> 8) & 0xff) == MU_TYPE_SIZED && count && !hw
            && mu_plausible_refcnt(r->rc[k]) && off + 8 * (first + count) <= len) {
            *hb = b + off + 8 * first;      /* words no build of the type writes */
            *he = *hb + 8 * count;
            return;
        }
        if (((code >> 8) & 0xff) != MU_TYPE_DICT || !mu_plausible_refcnt(r->rc[k])
            || (hw && *he != b + off) || off + 32 > r->have)
            continue;
        if (!hw)
            *hb = b + off;
        *he = b + off + 32;
        return;
    }
}
#endif
