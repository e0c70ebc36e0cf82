/* mu_written.c: userfaultfd asynchronous write-protection and PAGEMAP_SCAN (mu_written.h).
 * The kernel ABI is spelled out here: Debian 12's headers (Linux 6.1) predate it.
 * References: Documentation/admin-guide/mm/userfaultfd.rst and pagemap.rst (Linux 6.7). */
#include "mu_core_impl.h"
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <fcntl.h>

#define MU_UFFD_USER_MODE_ONLY 1                  /* userfaultfd(2) flag, Linux 5.11 */
#define MU_UFFD_API 0xAAull
#define MU_UFFD_FEATURE_WP_UNPOPULATED (1ull << 13)   /* Linux 6.4 */
#define MU_UFFD_FEATURE_WP_ASYNC (1ull << 15)         /* Linux 6.7 */
#define MU_UFFDIO_REGISTER_MODE_WP 2ull

struct mu_uffdio_api { uint64_t api, features, ioctls; };
struct mu_uffdio_range { uint64_t start, len; };
struct mu_uffdio_register { struct mu_uffdio_range range; uint64_t mode, ioctls; };
#define MU_UFFDIO_API _IOWR(0xAA, 0x3F, struct mu_uffdio_api)
#define MU_UFFDIO_REGISTER _IOWR(0xAA, 0x00, struct mu_uffdio_register)

struct mu_page_region { uint64_t start, end, categories; };
struct mu_pm_scan_arg {
    uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages,
             category_inverted, category_mask, category_anyof_mask, return_mask;
};
#define MU_PAGEMAP_SCAN _IOWR('f', 16, struct mu_pm_scan_arg)
#define MU_PAGE_IS_WRITTEN (1ull << 1)
#define MU_PM_SCAN_WP_MATCHING (1ull << 0)
#define MU_PM_SCAN_CHECK_WPASYNC (1ull << 1)

int64_t mu_wt_open(void)
{
#ifdef SYS_userfaultfd
    long fd = syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | MU_UFFD_USER_MODE_ONLY);
    if (fd < 0)
        return -errno;
    /* unpopulated pages are protected too (pte markers): a page first written after a scan is
     * reported, whether or not it was ever touched before */
    struct mu_uffdio_api api = {MU_UFFD_API,
                                MU_UFFD_FEATURE_WP_ASYNC | MU_UFFD_FEATURE_WP_UNPOPULATED, 0};
    if (ioctl((int)fd, MU_UFFDIO_API, &api) != 0) {
        int e = errno;
        close((int)fd);
        return -e;
    }
    return fd;
#else
    return -ENOSYS;
#endif
}

int64_t mu_wt_register(int64_t uffd, uint64_t begin, uint64_t len)
{
    struct mu_uffdio_register reg = {{begin, len}, MU_UFFDIO_REGISTER_MODE_WP, 0};
    if ((begin | len) & 4095 || !len)
        return -EINVAL;
    return ioctl((int)uffd, MU_UFFDIO_REGISTER, &reg) == 0 ? 0 : -errno;
}

#define SCAN_VEC 256

int64_t mu_wt_scan(int64_t pagemap_fd, uint64_t begin, uint64_t end, uint64_t *out, uint64_t cap)
{
    struct mu_page_region vec[SCAN_VEC];
    uint64_t n = 0;
    if ((begin | end) & 4095 || begin > end)
        return -EINVAL;
    while (begin < end) {
        struct mu_pm_scan_arg arg;
        memset(&arg, 0, sizeof arg);
        arg.size = sizeof arg;
        arg.flags = MU_PM_SCAN_WP_MATCHING | MU_PM_SCAN_CHECK_WPASYNC;
        arg.start = begin;
        arg.end = end;
        arg.vec = (uint64_t)(uintptr_t)vec;
        arg.vec_len = SCAN_VEC;
        arg.category_mask = MU_PAGE_IS_WRITTEN;
        arg.return_mask = MU_PAGE_IS_WRITTEN;
        long r = ioctl((int)pagemap_fd, MU_PAGEMAP_SCAN, &arg);
        if (r < 0)
            return -errno;
        for (long k = 0; k < r; k++) {
            if (out && n && out[2 * n - 1] == vec[k].start) {  /* a run the vector's end cut */
                out[2 * n - 1] = vec[k].end;
                continue;
            }
            if (!out) {             /* arming only */
                n++;
                continue;
            }
            if (n == cap)
                return -ENOSPC;
            out[2 * n] = vec[k].start;
            out[2 * n + 1] = vec[k].end;
            n++;
        }
        if (arg.walk_end <= begin)
            return -EIO;        /* no progress: never expected */
        begin = arg.walk_end;
    }
    return (int64_t)n;
}

int64_t mu_wt_fresh(const uint64_t *cur, uint64_t n, const uint64_t *prev, uint64_t m,
                    uint8_t level, uint8_t *out)
{
    uint64_t j = 0, fresh = 0;
    if ((n && (!cur || !out)) || (m && !prev))
        return -EINVAL;
    for (uint64_t i = 0; i < n; i++) {
        if (i && cur[i] <= cur[i - 1])
            return -EINVAL;
        while (j < m && prev[j] < cur[i]) {
            if (j && prev[j] <= prev[j - 1])
                return -EINVAL;
            j++;
        }
        if (!(j < m && prev[j] == cur[i])) {
            out[i] = level;
            fresh++;
        }
    }
    return (int64_t)fresh;
}

int64_t mu_wt_look(int64_t pagemap_fd, const uint64_t *ranges, uint64_t n, uint64_t *out,
                   uint64_t cap, uint8_t *failed)
{
    uint64_t used = 0;
    if (n && (!ranges || !failed))
        return -EINVAL;
    for (uint64_t k = 0; k < n; k++) {
        uint64_t b = ranges[2 * k], e = ranges[2 * k + 1];
        int64_t got = used < cap ? mu_wt_scan(pagemap_fd, b, e, out + 2 * used, cap - used)
                                 : -ENOSPC;
        failed[k] = got < 0;
        if (got < 0) {
            if (got == -ENOSPC)             /* re-arm the rest: the range counts as written */
                mu_wt_scan(pagemap_fd, b, e, NULL, 0);
            if (used == cap)
                return -ENOSPC;
            out[2 * used] = b;
            out[2 * used + 1] = e;
            used++;
            continue;
        }
        used += (uint64_t)got;
    }
    return (int64_t)used;
}

int64_t mu_pairs_subtract(const uint64_t *a, uint64_t na, const uint64_t *b, uint64_t nb,
                          uint64_t *out)
{
    uint64_t j = 0, n = 0;
    for (uint64_t k = 1; k < na; k++)
        if (a[2 * k] < a[2 * k - 1])
            return -EINVAL;
    for (uint64_t k = 1; k < nb; k++)
        if (b[2 * k] < b[2 * k - 1])
            return -EINVAL;
    for (uint64_t i = 0; i < na; i++) {
        uint64_t cur = a[2 * i], end = a[2 * i + 1];
        while (j < nb && b[2 * j + 1] <= cur)
            j++;
        for (uint64_t k = j; k < nb && b[2 * k] < end && cur < end; k++) {
            if (b[2 * k] > cur) {
                out[2 * n] = cur;
                out[2 * n + 1] = b[2 * k];
                n++;
            }
            if (b[2 * k + 1] > cur)
                cur = b[2 * k + 1];
        }
        if (cur < end) {
            out[2 * n] = cur;
            out[2 * n + 1] = end;
            n++;
        }
    }
    return (int64_t)n;
}
