/* mu_libs.c: passes over common libraries' data structures (see mu_libs.h). */
#include "mu_core_impl.h"

#define GLIB_TABLE_BYTES 64u        /* the header through hash_func */
#define GLIB_TABLE_MAX_SIZE (1ull << 28)

int64_t mu_glib_tables(const uint8_t *data, uint64_t base, uint64_t len, uint64_t *out,
                       uint64_t cap)
{
    if ((len && !data) || (cap && !out) || (base & 7))
        return -EINVAL;
    uint64_t found = 0;
    for (uint64_t o = 0; len >= GLIB_TABLE_BYTES && o <= len - GLIB_TABLE_BYTES; o += 8) {
        const uint8_t *p = data + o;
        uint64_t size = mu_ld64(p);
        /* the rare test first: a power of 2 with its mask after it */
        if (size < 8 || size > GLIB_TABLE_MAX_SIZE || (size & (size - 1))
            || mu_ld32(p + 12) != size - 1)
            continue;
        int32_t nnodes = (int32_t)mu_ld32(p + 16), nocc = (int32_t)mu_ld32(p + 20);
        uint64_t keys = mu_ld64(p + 32), hashes = mu_ld64(p + 40), values = mu_ld64(p + 48);
        if (nnodes < 0 || nnodes > nocc || (uint64_t)nocc > size || !keys || !hashes || !values
            || ((keys | hashes | values) & 7) || !mu_ld64(p + 56))
            continue;
        if (found < cap)
            out[found] = base + o;
        found++;
    }
    return (int64_t)found;
}
