/* bench_target: the benchmark target of bench/bench_check.py.
 *
 * NTHREADS threads each allocate NBLOCKS/NTHREADS blocks of 24..400 bytes (about 1 GiB in
 * 5 million blocks with the defaults), link every block to a random earlier block of its
 * thread (pointer-heavy heap), keep them in a per-thread table, then leak NLEAKS of them by
 * hiding the table entries. Prints the usual fixture lines, then parks every thread.
 * Usage: bench_target [nblocks] [nthreads] [nleaks]
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
void **g_tables[64];          /* extern linkage: -O2 must keep these stores */
uintptr_t *g_hidden;
static pthread_barrier_t g_built, g_done;
static unsigned long g_thread_leak_bytes[64];

static unsigned long rnd(unsigned long *s) { *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17; return *s; }

/* Build this thread's blocks and leak the last ones; noinline so that its dead frame
 * (which held leaked pointers) is wiped by clean_stack() afterwards. */
static __attribute__((noinline)) void build(long id)
{
    long n = g_nblocks / g_nthreads;
    unsigned long seed = 0x9e3779b97f4a7c15ul * (id + 1);
    void **table = malloc(n * sizeof(void *));
    for (long i = 0; i < n; i++) {
        size_t sz = 24 + rnd(&seed) % 377;
        void **b = malloc(sz);
        memset(b, 0, sz);
        b[0] = i ? table[rnd(&seed) % i] : NULL;     /* a pointer into the heap */
        b[1] = (void *)(uintptr_t)rnd(&seed);          /* noise */
        /* dense: every word points into an earlier block (at its start or inside it) */
        for (size_t w = 1; g_dense && i && w < sz / sizeof(void *); w++)
            b[w] = (char *)table[rnd(&seed) % i] + (rnd(&seed) % 3) * 8;
        table[i] = b;
    }
    /* leak the last nleaks/nthreads blocks: nothing else points at them (links only go back) */
    long nl = g_nleaks / g_nthreads;
    for (long i = n - nl; i < n; i++) {
        g_thread_leak_bytes[id] += malloc_usable_size(table[i]);
        g_hidden[id * nl + (i - (n - nl))] = hide(table[i]);
        table[i] = NULL;
    }
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
    if (argc > 1) g_nblocks = atol(argv[1]);
    if (argc > 2) g_nthreads = atol(argv[2]);
    if (argc > 3) g_nleaks = atol(argv[3]);
    if (argc > 4) g_dense = atol(argv[4]);
    g_hidden = calloc(g_nleaks + 1, sizeof *g_hidden);
    pthread_barrier_init(&g_built, NULL, g_nthreads + 1);
    pthread_barrier_init(&g_done, NULL, g_nthreads + 1);
    pthread_t t[64];
    for (long i = 0; i < g_nthreads; i++)
        pthread_create(&t[i], NULL, worker, (void *)i);
    pthread_barrier_wait(&g_built);
    unsigned long lb = 0;
    for (long i = 0; i < g_nthreads; i++)
        lb += g_thread_leak_bytes[i];
    print_expect("num_leaks", (g_nleaks / g_nthreads) * g_nthreads);
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
