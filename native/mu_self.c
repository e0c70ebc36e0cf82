/* mu_self.c: helpers for the in-process check. */
#include "mu_core_impl.h"
#include <alloca.h>

__attribute__((noinline)) int64_t mu_scrub_stack(uint64_t size)
{
    if (size > (1u << 20))
        size = 1u << 20;
    uint8_t *buf = alloca(size);
    memset(buf, 0, size);
    __asm__ volatile("" : : "r"(buf) : "memory");   /* the stores must happen */
    return (int64_t)size;
}
