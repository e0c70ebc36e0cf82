/* mu_mem.c: bulk reads of another process's memory through /proc/<pid>/mem.
 * pread on an fd opened by the tracer (the access check happens at open, so a forked
 * sweeper can read through the inherited fd even under Yama ptrace_scope=1). */
#include "mu_core_impl.h"
#include <unistd.h>

#define MU_CHUNK (1u << 20)
#define MU_PAGE 4096u

static int64_t read_pages(int fd, uint64_t addr, uint8_t *buf, uint64_t len)
{
    /* Slow path: page by page, zero-filling what cannot be read. */
    uint64_t bad = 0, off = 0;
    while (off < len) {
        uint64_t page_end = ((addr + off) / MU_PAGE + 1) * MU_PAGE;
        uint64_t n = page_end - (addr + off);
        if (n > len - off)
            n = len - off;
        uint64_t got = 0;
        while (got < n) {
            ssize_t r = pread(fd, buf + off + got, n - got, (off_t)(addr + off + got));
            if (r > 0) {
                got += (uint64_t)r;
                continue;
            }
            if (r < 0 && errno == EINTR)
                continue;
            if (r == 0 || errno == EIO || errno == EFAULT || errno == ENOMEM) {
                memset(buf + off + got, 0, n - got);
                bad += n - got;
                break;
            }
            return -errno;
        }
        off += n;
    }
    return (int64_t)bad;
}

int64_t mu_read(int memfd, uint64_t addr, uint8_t *buf, uint64_t len)
{
    uint64_t bad = 0, off = 0;
    while (off < len) {
        uint64_t n = len - off > MU_CHUNK ? MU_CHUNK : len - off;
        ssize_t r = pread(memfd, buf + off, n, (off_t)(addr + off));
        if (r == (ssize_t)n) {
            off += n;
            continue;
        }
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && errno != EIO && errno != EFAULT && errno != ENOMEM)
            return -errno;
        /* short or failed read: finish this chunk page by page */
        uint64_t done = r > 0 ? (uint64_t)r : 0;
        int64_t b = read_pages(memfd, addr + off + done, buf + off + done, n - done);
        if (b < 0)
            return b;
        bad += (uint64_t)b;
        off += n;
    }
    return (int64_t)bad;
}
