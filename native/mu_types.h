/* mu_types.h: plain structs shared by the stages of the C core (cdef-clean). */

/* A copy of target memory held by the sweeper: bytes [base, base+len) live at data. */
typedef struct {
    uint64_t base;
    uint64_t len;
    uint8_t *data;
} mu_region;

/* Words that are not references (GC links, dead free-list slots): mark and fold ignore every
 * 8-byte word whose start address is
 *   - inside one of the nranges pairs ranges[2k] .. ranges[2k+1] (sorted, disjoint, 8-aligned;
 *     they may lie in roots or inside allocations), or
 *   - inside allocation i at [begin[i] + 8*(head_word[i]-1), +16) when head_word[i] != 0
 *     (head_word: n bytes or NULL; a PyGC_Head's two link words).
 * A word pointing into allocation i below the end of its PyGC_Head (head_word[i] != 0) is no
 * reference either: references to a GC object point at the object, after its head.
 * Pass NULL for none. */
/* Dead objects: types holds ntypes pairs (type address, object offset in its block), sorted
 * by address. An allocation whose word at an offset off is 0 (ob_refcnt) and whose next word
 * (ob_type) is a type listed with that offset holds a dead object (a zombie or free-listed
 * frame, a free-listed tuple, cpython-memory.md section 6): none of its words is scanned. */
typedef struct {
    const uint64_t *ranges;
    uint64_t nranges;
    const uint8_t *head_word;
    const uint64_t *types;
    uint64_t ntypes;
} mu_dead;
