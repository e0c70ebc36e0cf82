/* mu_libs.h: passes over common libraries' data structures in a copy of target memory. */

/* The addresses of what reads as a GLib hash table header (struct _GHashTable, GLib 2.64+,
 * glib/ghash.c: gsize size; gint mod; guint mask; gint nnodes; gint noccupied; guint
 * have_big_keys:1, have_big_values:1; gpointer keys; guint *hashes; gpointer values;
 * GHashFunc hash_func; ...) at the 8-aligned offsets of data (len bytes of target memory at
 * base): size a power of 2 from 8 to 2^28, mask size - 1, 0 <= nnodes <= noccupied <= size,
 * keys, hashes and values non-zero and 8-aligned, hash_func non-zero (the flags' word is not
 * read whole: g_slice_new leaves the bits after the two flags as they were).
 * Up to cap into out, ascending. Returns how many there are (may exceed cap), or -EINVAL. */
int64_t mu_glib_tables(const uint8_t *data, uint64_t base, uint64_t len, uint64_t *out,
                       uint64_t cap);
