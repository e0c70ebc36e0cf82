/* scrub.h: scrub() for the test extensions (stale.c, debugslack.c): zeroes 16 KiB of the stack
 * below the caller and the registers a call may clobber, so that no copy of an address a
 * fixture forgot is left where a check scans (a waiting thread's registers are roots). */
#ifndef MU_TEST_SCRUB_H
#define MU_TEST_SCRUB_H
#include <string.h>

static __attribute__((noinline)) void scrub(void)
{
    volatile char junk[16384];
    memset((char *)junk, 0, sizeof junk);
#if defined(__x86_64__)
    __asm__ volatile("xor %%eax, %%eax\n\txor %%ecx, %%ecx\n\txor %%edx, %%edx\n\t"
                     "xor %%esi, %%esi\n\txor %%edi, %%edi\n\txor %%r8d, %%r8d\n\t"
                     "xor %%r9d, %%r9d\n\txor %%r10d, %%r10d\n\txor %%r11d, %%r11d\n\t"
                     "vzeroall"
                     ::: "rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11", "memory");
#endif
}
#endif
