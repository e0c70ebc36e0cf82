/* mu_self.h: helpers for checking the calling process itself (in-process API). */

/* Zero `size` bytes of dead stack below the caller's frame, so that stale copies of pointers
 * left by returned functions cannot keep leaks alive when this thread's stack is scanned.
 * Returns size. */
int64_t mu_scrub_stack(uint64_t size);
