/* bench_target: the benchmark target of bench/bench_check.py.
 *
 * NTHREADS threads each allocate NBLOCKS/NTHREADS blocks of 24..400 bytes (about 1 GiB in
 * 5 million blocks with the defaults), link every block to a random earlier block of its
 * thread (pointer-heavy heap), keep them in a per-thread table, and leak NLEAKS/NTHREADS
 * extra blocks each (one every 1,000 allocations, their addresses hidden). Prints the usual
 * fixture lines, then parks every thread.
 * Usage: bench_target [nblocks] [nthreads] [nleaks] [dense] [shape]
 * nblocks "256M": blocks until the threads' heap holds 256 MiB (usable bytes) instead.
 * shape (bench/bench_shapes.py; the leaks are extra blocks of noise, one every 1,000, hidden):
 *   random1   each block -> a random earlier block; every block held from the thread's table
 *             (the default: bench_check.py's heap)
 *   random2   each block -> two random earlier blocks; held from the table
 *   list2     one doubly linked list per thread (next: the block before, prev: the block
 *             after), only its head held
 *   list1     the same, next pointer only
 *   tree      one balanced binary tree per thread (block i -> 2i+1, 2i+2), only its root held
 *   flat      pointer-free blocks held from the table
 *   vectors   4 KiB arrays of 500 pointers to small nodes (24-40 bytes), the arrays held from
 *             the table
 *   holes     random2, then every other block freed (its table slot cleared): half the heap
 *             free chunks in tcaches, fastbins and the unsorted bin, and stale pointers to them
 * Built with -fsanitize=leak -DBENCH_LSAN (bench_check.py --lsan), it times LeakSanitizer's
 * in-process check of the same heap instead: LSAN_RUNS calls of
 * __lsan_do_recoverable_leak_check(), one "lsan_seconds S" line each, then exits.
 */
#include "fixture.h"
#include <pthread.h>
#ifdef BENCH_LSAN
#include <sanitizer/lsan_interface.h>
#include <time.h>
#endif

static long g_nblocks = 5000000, g_nthreads = 8, g_nleaks = 1000, g_dense;
static unsigned long g_bytes;           /* nblocks "<N>M": heap bytes instead of a count */
static const char *g_shape = "random1";
void **g_tables[64];          /* extern linkage: -O2 must keep these stores (the roots) */
uintptr_t *g_hidden;
static pthread_barrier_t g_built, g_done;
static unsigned long g_thread_leak_bytes[64], g_thread_leaks[64];

static unsigned long rnd(unsigned long *s) { *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17; return *s; }

static int shape_is(const char *name) { return strcmp(g_shape, name) == 0; }

/* Build this thread's blocks and leak some; noinline so that its dead frame (which held
 * leaked pointers) is wiped by clean_stack() afterwards. */
static __attribute__((noinline)) void build(long id)
{
    long cap = 1024, n = 0, nl = g_nleaks / g_nthreads, leaked = 0;
    unsigned long seed = 0x9e3779b97f4a7c15ul * (id + 1), bytes = 0;
    unsigned long quota = g_bytes / g_nthreads;
    long count = g_nblocks / g_nthreads;
    void **table = malloc(cap * sizeof(void *));
    int holes = shape_is("holes");
    int vectors = shape_is("vectors"), random2 = shape_is("random2") || holes;
    int flat = shape_is("flat");
    int list = shape_is("list1") || shape_is("list2");
    for (long allocs = 0; quota ? bytes < quota : n < count; allocs++) {
        if (leaked < nl && allocs >= 1000 * (leaked + 1)) {    /* a leak: noise only, nothing
                                                                 * points at it */
            size_t sz = 24 + rnd(&seed) % 377;
            void *b = malloc(sz);
            memset(b, 0x5a, sz);
            g_thread_leak_bytes[id] += malloc_usable_size(b);
            g_hidden[id * nl + leaked++] = hide(b);
            g_thread_leaks[id]++;
            continue;
        }
        if (n == cap)
            table = realloc(table, (cap *= 2) * sizeof(void *));
        size_t sz = vectors ? 4000 : 24 + rnd(&seed) % 377;
        void **b = malloc(sz);
        memset(b, 0, sz);
        bytes += malloc_usable_size(b);
        if (vectors)                                /* 500 small nodes right after it */
            for (int w = 0; w < 500; w++) {
                b[w] = malloc(24 + rnd(&seed) % 17);
                memset(b[w], 0, 24);
                bytes += malloc_usable_size(b[w]);
                allocs++;
            }
        else if (list) {
            b[0] = n ? table[n - 1] : NULL;         /* next: the block before */
            if (n && shape_is("list2"))
                ((void **)table[n - 1])[1] = b;     /* prev: the block after */
        } else if (!flat && !shape_is("tree")) {    /* random1, random2 */
            b[0] = n ? table[rnd(&seed) % n] : NULL;
            b[1] = random2 && n ? table[rnd(&seed) % n] : (void *)(uintptr_t)rnd(&seed);
            /* dense: every word points into an earlier block (at its start or inside it) */
            for (size_t w = 2 - !random2; g_dense && n && w < sz / sizeof(void *); w++)
                b[w] = (char *)table[rnd(&seed) % n] + (rnd(&seed) % 3) * 8;
        } else if (flat)
            b[1] = (void *)(uintptr_t)(rnd(&seed) & 0xffff);    /* small values: no pointers */
        table[n++] = b;
    }
    if (shape_is("tree"))
        for (long i = 0; i < n; i++) {
            void **b = table[i];
            b[0] = 2 * i + 1 < n ? table[2 * i + 1] : NULL;
            b[1] = 2 * i + 2 < n ? table[2 * i + 2] : NULL;
        }
    for (long i = 1; holes && i < n; i += 2) {     /* the heap's quota is its size before */
        long k = getenv("HOLES_RANDOM") ? (long)(rnd(&seed) % n) : i;
        free(table[k]);
        table[k] = NULL;
    }
    if (list || shape_is("tree")) {                 /* only the head or the root is held */
        g_tables[id] = list ? table[n - 1] : table[0];
        free(table);
    } else
        g_tables[id] = table;
}

static void *worker(void *arg)
{
    build((long)arg);
    clean_stack();
    pthread_barrier_wait(&g_built);
    pthread_barrier_wait(&g_done);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strchr(argv[1], 'M'))
        g_bytes = (unsigned long)atol(argv[1]) << 20;
    else if (argc > 1) g_nblocks = atol(argv[1]);
    if (argc > 2) g_nthreads = atol(argv[2]);
    if (argc > 3) g_nleaks = atol(argv[3]);
    if (argc > 4) g_dense = atol(argv[4]);
    if (argc > 5) g_shape = argv[5];
    g_hidden = calloc(g_nleaks + 1, sizeof *g_hidden);
    pthread_barrier_init(&g_built, NULL, g_nthreads + 1);
    pthread_barrier_init(&g_done, NULL, g_nthreads + 1);
    pthread_t t[64];
    for (long i = 0; i < g_nthreads; i++)
        pthread_create(&t[i], NULL, worker, (void *)i);
    pthread_barrier_wait(&g_built);
    unsigned long lb = 0, nl = 0;
    for (long i = 0; i < g_nthreads; i++) {
        lb += g_thread_leak_bytes[i];
        nl += g_thread_leaks[i];
    }
    print_expect("num_leaks", nl);
    print_expect("leak_bytes", lb);
#ifdef BENCH_LSAN
    int runs = getenv("LSAN_RUNS") ? atoi(getenv("LSAN_RUNS")) : 3;
    for (int r = 0; r < runs; r++) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        int leaks = __lsan_do_recoverable_leak_check();
        clock_gettime(CLOCK_MONOTONIC, &b);
        printf("lsan_seconds %.3f leaks_found %d\n", (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9, leaks);
        fflush(stdout);
    }
    return 0;
#endif
    ready();
}
