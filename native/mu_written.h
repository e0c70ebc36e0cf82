/* mu_written.h: the pages a process wrote since the last look: userfaultfd write-protection in
 * its asynchronous mode (a write clears a page's protection in the kernel, nobody waits),
 * read and re-armed with the PAGEMAP_SCAN ioctl of /proc/PID/pagemap (Linux 6.7, 2024). */

/* In the process to watch: a userfaultfd of this process (user-mode faults only, close-on-exec,
 * non-blocking) set up for asynchronous write-protection. Returns its fd, or -errno: -ENOSYS
 * or -EPERM (no userfaultfd here), -EINVAL (a kernel without asynchronous write-protection). */
int64_t mu_wt_open(void);

/* Registers the mapping [begin, begin + len) (page-aligned) of the fd's process for
 * write-protection; any process holding the fd may. Its pages count as written until the next
 * mu_wt_scan of them. Returns 0 or -errno (-EINVAL: a mapping that cannot be; -EBUSY: another
 * userfaultfd has it). */
int64_t mu_wt_register(int64_t uffd, uint64_t begin, uint64_t len);

/* The pages of [begin, end) (page-aligned) written since the last scan of them, as ascending
 * (begin, end) pairs in out (2 * cap words; out NULL: none stored, the count returned), each
 * written page protected again. pagemap_fd:
 * /proc/PID/pagemap of the fd's process. Returns the number of pairs; -ENOSPC when they are
 * more than cap (the pages scanned so far are protected again: the caller treats the range as
 * written); -EPERM when some mapping in the range is not registered (it was unmapped and
 * mapped anew); or -errno. */
int64_t mu_wt_scan(int64_t pagemap_fd, uint64_t begin, uint64_t end, uint64_t *out, uint64_t cap);

/* The fresh allocations of a sweep against an earlier one: out[i] = level when cur[i] (n
 * begins, ascending) is none of prev[] (m begins of the earlier sweep, ascending); other
 * entries are left as they are (called for the earlier sweeps oldest first, the latest one in
 * which cur[i] was no allocation's begin wins: mu_dead.fresh). Returns the number of those
 * allocations, or -EINVAL (unsorted input). */
int64_t mu_wt_fresh(const uint64_t *cur, uint64_t n, const uint64_t *prev, uint64_t m,
                    uint8_t level, uint8_t *out);

/* One look over the tracked memory: mu_wt_scan of each of the n (begin, end) pairs of ranges
 * (ascending, disjoint), the written pages of all in out (2 * cap words, ascending pairs). A
 * range whose scan fails (-EPERM: a mapping replaced under it; -ENOSPC) gets failed[k] = 1 and
 * counts whole as written (its pages scanned before the failure were re-armed: their list is
 * lost). Returns the number of pairs, or -ENOSPC when out is too small (cap >= the pages of all
 * ranges / 2 + n always suffices). */
int64_t mu_wt_look(int64_t pagemap_fd, const uint64_t *ranges, uint64_t n, uint64_t *out,
                   uint64_t cap, uint8_t *failed);

/* The parts of the na ascending disjoint (begin, end) pairs of a that none of the nb pairs of
 * b (ascending, disjoint) covers, into out (2 * (na + nb) words). Returns their count, or
 * -EINVAL (unsorted input). */
int64_t mu_pairs_subtract(const uint64_t *a, uint64_t na, const uint64_t *b, uint64_t nb,
                          uint64_t *out);
