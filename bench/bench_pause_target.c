/* bench_pause_target: the target of bench/bench_pause.py (issue 10: the pause).
 *
 * NTHREADS threads (the main thread included) each allocate HEAP_MB/NTHREADS MiB in blocks
 * of 64..1024 bytes (touched, so resident), then park reading a pipe that is never
 * written. The main thread prints `ready`, then answers commands on stdin, one per line:
 *   fork   time one glibc fork() and one raw clone(SIGCHLD) syscall of this process, in
 *          the parent (call to return), and print `fork_us <fork> <raw clone>`; the
 *          children _exit(0) at once and are reaped
 *   quit   print `bye` and exit 0
 * Usage: bench_pause_target [heap_mb] [nthreads]
 */
#include "fixture.h"
#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>

static long g_heap_mb = 50, g_nthreads = 32;
void **g_tables[256];         /* extern linkage: the blocks stay reachable */
static pthread_barrier_t g_built;

static unsigned long rnd(unsigned long *s) { *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17; return *s; }

static void build(long id)
{
    size_t bytes = (size_t)g_heap_mb * 1048576 / g_nthreads, used = 0;
    unsigned long seed = 0x9e3779b97f4a7c15ul * (id + 1);
    long cap = bytes / 64 + 1, n = 0;
    void **table = malloc(cap * sizeof(void *));
    while (used < bytes && n < cap) {
        size_t sz = 64 + rnd(&seed) % 961;
        void *b = blk(sz);
        table[n++] = b;
        used += sz;
    }
    g_tables[id] = table;
}

static void *worker(void *arg)
{
    build((long)arg);
    pthread_barrier_wait(&g_built);
    block_forever();
    return NULL;
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static double time_fork(int raw)
{
    double t0 = now_us(), t1;
    pid_t child = raw ? (pid_t)syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0) : fork();
    if (child == 0)
        _exit(0);
    t1 = now_us();
    if (child < 0) {
        fprintf(stderr, "bench_pause_target: fork failed (errno %d)\n", errno);
        exit(2);
    }
    waitpid(child, NULL, 0);
    return t1 - t0;
}

int main(int argc, char **argv)
{
    char line[64];
    if (argc > 1) g_heap_mb = atol(argv[1]);
    if (argc > 2) g_nthreads = atol(argv[2]);
    if (g_nthreads < 1 || g_nthreads > 256) {
        fprintf(stderr, "bench_pause_target: 1..256 threads\n");
        return 2;
    }
    if (pipe(g_pipe) < 0)
        return 2;
    pthread_barrier_init(&g_built, NULL, g_nthreads);
    pthread_t t;
    for (long i = 1; i < g_nthreads; i++)
        pthread_create(&t, NULL, worker, (void *)i);
    build(0);
    pthread_barrier_wait(&g_built);
    announce_ready();
    while (fgets(line, sizeof line, stdin)) {
        if (strncmp(line, "fork", 4) == 0) {
            double f = time_fork(0);
            double r = time_fork(1);
            printf("fork_us %.1f %.1f\n", f, r);
            fflush(stdout);
        } else if (strncmp(line, "quit", 4) == 0) {
            finish();
        }
    }
    return 4;
}
