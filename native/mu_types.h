/* mu_types.h: plain structs shared by the stages of the C core (cdef-clean). */

/* A copy of target memory held by the sweeper: bytes [base, base+len) live at data. */
typedef struct {
    uint64_t base;
    uint64_t len;
    uint8_t *data;
} mu_region;
