/* bench_tracking.c: workloads for bench/bench_tracking.py (built -O2 without frame pointers,
 * like distribution code).
 *
 *   bench_tracking churn THREADS ITERS   each thread: ITERS x { free(win[k]); win[k] =
 *                                        malloc(16..255) } over a 64-slot window, every
 *                                        malloc made at call depth 5..12 through distinct
 *                                        functions (so stacks differ)
 *   bench_tracking hold N                keep N live blocks of 32 bytes (one stack), print
 *                                        "held", wait for stdin to close
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define KEEP(p) __asm__ volatile("" : "+r"(p) : : "memory")
#define NOINL __attribute__((noinline, noclone))

static NOINL void *alloc_at(int depth, size_t n);

#define LEVEL(name, k)                                 \
    static NOINL void *name(int depth, size_t n)      \
    {                                                  \
        void *p = depth > 0 ? alloc_at(depth - 1, n + k) : malloc(n); \
        KEEP(p);                                       \
        return p;                                      \
    }
LEVEL(l0, 0) LEVEL(l1, 1) LEVEL(l2, 2) LEVEL(l3, 3)

static NOINL void *alloc_at(int depth, size_t n)
{
    void *p;
    switch (depth & 3) {
    case 0: p = l0(depth, n & 255); break;
    case 1: p = l1(depth, n & 255); break;
    case 2: p = l2(depth, n & 255); break;
    default: p = l3(depth, n & 255); break;
    }
    KEEP(p);
    return p;
}

static long iters;

static void *churn(void *arg)
{
    uint64_t x = 88172645463325252ULL ^ (uintptr_t)arg;
    void *win[64] = {0};
    for (long i = 0; i < iters; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        int k = (int)(x & 63);
        free(win[k]);
        /* depth 5..12: alloc_at adds 2 frames per level, plus churn itself */
        win[k] = alloc_at((int)((x >> 8) % 4) + 2, 16 + (x >> 16) % 240);
    }
    for (int k = 0; k < 64; k++)
        free(win[k]);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc == 4 && !strcmp(argv[1], "churn")) {
        int n = atoi(argv[2]);
        iters = atol(argv[3]);
        pthread_t t[64];
        for (int i = 0; i < n && i < 64; i++)
            pthread_create(&t[i], NULL, churn, (void *)(uintptr_t)(i + 1));
        for (int i = 0; i < n && i < 64; i++)
            pthread_join(t[i], NULL);
        return 0;
    }
    if (argc == 3 && !strcmp(argv[1], "hold")) {
        long n = atol(argv[2]);
        void **keep = calloc((size_t)n, sizeof *keep);
        for (long i = 0; i < n; i++)
            keep[i] = malloc(32);
        printf("held\n");
        fflush(stdout);
        char c;
        while (read(0, &c, 1) > 0)
            ;
        return keep[n - 1] == NULL;
    }
    fprintf(stderr, "usage: %s churn THREADS ITERS | hold N\n", argv[0]);
    return 2;
}
