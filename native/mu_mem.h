/* mu_mem.h: bulk reads of another process's memory. */

/* Read [addr, addr+len) through an open /proc/<pid>/mem fd into buf (pread in large chunks).
 * Pages that cannot be read (EIO/EFAULT: PROT_NONE, unmapped, MADV_DONTFORK) are zero-filled.
 * Returns the number of unreadable bytes (>= 0), or -errno on any other failure; when
 * first_bad is not NULL it receives the lowest unreadable address (0 when none). */
int64_t mu_read(int memfd, uint64_t addr, uint8_t *buf, uint64_t len, uint64_t *first_bad);
