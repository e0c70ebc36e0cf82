/* mu_self.h: helpers for checking the calling process itself (in-process API). */

/* Zero `size` bytes of dead stack below the caller's frame, so that stale copies of pointers
 * left by returned functions cannot keep leaks alive when this thread's stack is scanned.
 * Returns size. */
int64_t mu_scrub_stack(uint64_t size);

/* Zero `scrub` bytes of stack below this frame, write `len` bytes of `line` to wfd, then wait
 * until rfd is readable (or its writer is gone). 0, -ETIMEDOUT after timeout_ms, or -errno of
 * the write or the poll. */
int64_t mu_request_wait(int wfd, const uint8_t *line, uint64_t len, int rfd, int64_t timeout_ms,
                        uint64_t scrub);
