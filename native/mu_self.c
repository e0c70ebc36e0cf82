/* mu_self.c: helpers for the in-process check. */
#include "mu_core_impl.h"
#include <alloca.h>
#include <poll.h>
#include <time.h>
#include <unistd.h>

__attribute__((noinline)) int64_t mu_scrub_stack(uint64_t size)
{
    if (size > (1u << 20))
        size = 1u << 20;
    uint8_t *buf = alloca(size);
    memset(buf, 0, size);
    __asm__ volatile("" : : "r"(buf) : "memory");   /* the stores must happen */
    return (int64_t)size;
}

/* The request's write and the wait for its reply, with the stack below this frame zeroed
 * first and nothing but the two system calls' wrappers running after that: the helper freezes
 * this thread in the wait (or in the write) and scans its stack from SP up, so no call made
 * between the zeroing and the freeze may leave a stale pointer where it would be scanned. */
int64_t mu_request_wait(int wfd, const uint8_t *line, uint64_t len, int rfd, int64_t timeout_ms,
                        uint64_t scrub)
{
    struct timespec start, now;
    mu_scrub_stack(scrub);
    while (len) {
        ssize_t k = write(wfd, line, len);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return -errno;
        line += k;
        len -= (uint64_t)k;
    }
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        int64_t spent = (int64_t)(now.tv_sec - start.tv_sec) * 1000
                        + (now.tv_nsec - start.tv_nsec) / 1000000;
        if (spent >= timeout_ms)
            return -ETIMEDOUT;
        struct pollfd p = {.fd = rfd, .events = POLLIN};
        int64_t left = timeout_ms - spent;
        int r = poll(&p, 1, left > INT32_MAX ? INT32_MAX : (int)left);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -errno;
        if (r > 0)
            return 0;           /* readable, or the writer went away (POLLHUP) */
    }
}
