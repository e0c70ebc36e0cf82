/* mu_walk.h: the glibc chunk walker (our malloc_iterate), glibc-heap.md sections 2, 9, 10.
 * Layout facts that vary by glibc release come from memunreachable/heaps/glibc/layout.py; the chunk
 * format below (16-byte headers, flag bits 1/2/4) is the same in glibc 2.26-2.43 on x86_64
 * (mmapped chunks changed in 2.43: mu_walk_mmapped takes their format). */

/* Why mu_walk_run stopped (mu_walk_result.status). */
enum {
    MU_WALK_TOP = 0,        /* reached the arena's top chunk; end = top + chunksize(top) */
    MU_WALK_FENCE2 = 1,     /* main-arena double fencepost {0x10|1, 0x10|1}; end = after them */
    MU_WALK_FENCE0 = 2,     /* non-main heap end fencepost {0x10|1 or pseudo chunk, 0|1}; end = after it */
    MU_WALK_BAD_SIZE = 3,   /* size not a multiple of 16, below MINSIZE, or beyond the buffer */
    MU_WALK_BAD_FLAGS = 4,  /* IS_MMAPPED set, or NON_MAIN_ARENA wrong on an in-use chunk */
    MU_WALK_PAST_TOP = 5,   /* the chain stepped over top */
    MU_WALK_TRUNCATED = 6   /* the buffer ended before top or a fencepost */
};

typedef struct {
    uint64_t chunks;        /* chunks stepped over (top and fenceposts excluded) */
    uint64_t in_use;        /* chunks whose next header has PREV_INUSE (may exceed cap) */
    uint64_t in_use_bytes;  /* sum of their chunk sizes */
    uint64_t free_chunks;   /* chunks whose next header has PREV_INUSE clear */
    uint64_t free_bytes;    /* sum of their chunk sizes */
    uint64_t end;           /* address where the run ends (see status) */
    uint64_t bad_at;        /* chunk address of the failure (status >= MU_WALK_BAD_SIZE) */
    int64_t status;         /* MU_WALK_* */
} mu_walk_result;

/* Walk the chunks of one run held in data[0 .. len) (a local copy of [base, base+len)),
 * starting at the chunk header `first`, until `top` (0: none in this run) or a fencepost.
 * non_main: 1 for a thread-arena heap (NON_MAIN_ARENA must be set on in-use chunks), else 0.
 * For every in-use chunk c of size S (in address order) stores user = c+16 and usable = S-8
 * while fewer than cap were stored. The chunk right before a size-0 fencepost is never stored.
 * Returns the number stored (min(res->in_use, cap)); -EINVAL on bad arguments. */
int64_t mu_walk_run(const uint8_t *data, uint64_t base, uint64_t len, uint64_t first, uint64_t top,
                    uint32_t non_main, uint64_t *user, uint64_t *usable, uint64_t cap,
                    mu_walk_result *res);

/* One range of the target to copy and, optionally, walk (mu_read_walk). The walk is
 * mu_walk_run(buf, addr, len, first, top, non_main, user, usable, cap, &res). */
typedef struct {
    uint64_t addr;          /* in: the range [addr, addr+len) of the target, copied to buf */
    uint64_t len;
    uint8_t *buf;
    uint64_t first;         /* in: the first chunk header to walk from; 0: copy only */
    uint64_t top;
    uint32_t non_main;
    uint32_t drop;          /* in: MU_READ_DROP: the copy is not kept: buf is not written
                             * (may be NULL); each 1 MiB piece is read into a ring of a few
                             * pieces, walked and its candidates kept from there.
                             * MU_READ_SPARSE (not with DROP): every page read as all zeros is
                             * released (it still reads as zeros, and costs no memory:
                             * untouched thread stacks); buf must be a private anonymous
                             * mapping, page aligned. */
    uint64_t *user;
    uint64_t *usable;
    uint64_t cap;
    mu_cands *cands;        /* in: NULL, or candidates over exactly [addr, addr+len): filled
                             * from each piece as it is read (mu_cands_new) */
    /* in: NULL, or room for rec_cap records of the words the free-list walks read, so that
     * they need no read of an uncopied region (mu_region.rec): for every chunk the walk finds
     * free, and every in-use chunk of at most rec_max bytes whose first word is a free-list
     * link (0, or an address in [rec_lo, rec_hi) that is 16-aligned, decoded with
     * safe-linking's (address >> 12) when rec_mangled is 1, either way when 2): its address
     * (| 1 when free: its next chunk's PREV_INUSE is clear), its size word and its words at
     * +16 and +24, in address order; past rec_cap no more are kept. */
    uint64_t *rec;
    uint32_t *rec_ix;       /* in: room for (len >> 12) + 2 entries (with rec): out, for each
                             * 4 KiB page of [addr, addr+len) the index of its first record,
                             * then rec_stored */
    uint64_t rec_cap;
    uint64_t rec_lo, rec_hi, rec_max;
    uint32_t rec_mangled;
    uint32_t rec_pad;
    uint64_t rec_stored;    /* out: records kept */
    mu_walk_result res;     /* out: as mu_walk_run's */
    int64_t stored;         /* out: what mu_walk_run returns (0 without a walk) */
    int64_t bad;            /* out: unreadable bytes (zero-filled, as mu_read), or -errno */
    uint64_t first_bad;     /* out: the lowest unreadable address, 0 when none */
} mu_read_job;

#define MU_READ_DROP 1
#define MU_READ_SPARSE 2

/* Copy every job's range through the /proc/<pid>/mem fd memfd and walk it, on up to one
 * thread per CPU (4 at most): the ranges are read in 1 MiB pieces, in job order, and a
 * job's chunks are walked while its pieces arrive (still in the CPU caches), so each byte is
 * read once. The results equal mu_read then mu_walk_run on each job. Returns 0, or -EINVAL
 * on bad arguments (a job's own failure is in its bad/res fields). */
int64_t mu_read_walk(int memfd, mu_read_job *jobs, uint64_t njobs);

/* Positions p in [base, base+len) with p % step == 0 (step a power of two >= 16) where the
 * words at p and p+8 satisfy: prev_size == 0, (size & 7) == flags, chunksize >= min_size and
 * chunksize % align == 0 (align a power of two). Candidate run starts (step 16 after a foreign
 * sbrk, 4096 for NONCONTIGUOUS runs). Stores up to cap positions; returns the number found. */
int64_t mu_walk_find_headers(const uint8_t *data, uint64_t base, uint64_t len, uint64_t step,
                             uint64_t flags, uint64_t min_size, uint64_t align,
                             uint64_t *out, uint64_t cap);

typedef struct {
    uint64_t found;         /* mmapped chunks found (may exceed cap) */
    uint64_t bytes;         /* sum of prev_size + size (what mp_.mmapped_mem counts) */
    uint64_t moved;         /* chunks found behind a stale memalign header */
} mu_mmap_result;

/* Scan data[0 .. len) (a copy of [base, base+len), base page aligned) page by page for mmapped
 * chunk headers {P, S|IS_MMAPPED} with P & ~prev_mask == 0 whose mapping (S + tail bytes:
 * tail 0 up to glibc 2.42, 16 from 2.43, where the chunk keeps a next header's room) is a
 * multiple of 4096, >= 4096, ending within limit bytes of base (limit >= len: the memory past
 * the copy, up to limit, is pages never touched, all zeros, which a chunk may span). A stale
 * memalign header at m is followed by zeros and the real header {o, (S+tail-o-tail)|IS_MMAPPED}
 * at m+o (o >= 32, o % 16 == 0, inside the copy; prev_size bits in prev_mask ignored, 2.43's
 * MMAP_HP): the chunk is then m+o. After a hit the scan continues at m + S + tail. Stores
 * user = chunk+16, usable = size - usable_delta (16 up to 2.42, 8 from 2.43) (ascending)
 * while fewer than cap were stored; res->bytes sums the mappings. Returns the number stored;
 * -EINVAL on bad arguments. */
int64_t mu_walk_mmapped(const uint8_t *data, uint64_t base, uint64_t len, uint64_t limit,
                        uint64_t page, uint64_t tail, uint64_t usable_delta, uint64_t prev_mask,
                        uint64_t *user, uint64_t *usable, uint64_t cap, mu_mmap_result *res);

/* Why mu_walk_chain stopped (mu_chain_result.status). */
enum {
    MU_CHAIN_NULL = 0,      /* the chain ended in NULL */
    MU_CHAIN_BAD = 1,       /* a link led to no in-use chunk of the list's size (reason says why) */
    MU_CHAIN_LONG = 2,      /* more than max_nodes distinct nodes (a count off, or garbage) */
    MU_CHAIN_CYCLE = 3      /* a link led back to a node already on the chain */
};

/* Why a link was refused (mu_chain_result.reason, with MU_CHAIN_BAD). */
enum {
    MU_LINK_OK = 0,
    MU_LINK_MISALIGNED = 1, /* not 16-aligned */
    MU_LINK_NOT_CHUNK = 2,  /* not the user pointer of any in-use chunk the walk found */
    MU_LINK_WRONG_SIZE = 3, /* an in-use chunk of another size */
    MU_LINK_WRONG_ARENA = 4,/* NON_MAIN_ARENA bit says another arena (fastbins) */
    MU_LINK_UNREADABLE = 5, /* its link word is in no region */
    MU_LINK_ORDER = 6       /* smaller than the node before it (a sorted range list) */
};

typedef struct {
    uint64_t nodes;         /* distinct valid nodes: the verified prefix */
    int64_t status;         /* MU_CHAIN_* */
    int64_t reason;         /* MU_LINK_* when status == MU_CHAIN_BAD */
    uint64_t last;          /* user pointer of the last valid node (0: the head itself failed) */
    uint64_t bad;           /* the decoded link that failed or closed the cycle (user pointer) */
} mu_chain_result;

/* Follow a singly linked free list. A node is valid only if it is the user pointer of an
 * in-use chunk the walk found: an entry of the ascending user[] (n entries) whose usable[] + 8
 * lies in [chunk_size, chunk_max] (equal: one size; a range: glibc 2.42+'s large tcache bins,
 * whose chains are sorted by ascending size, so a node smaller than the one before it is
 * refused, MU_LINK_ORDER). arena: 0 any, 1 main arena (NON_MAIN_ARENA clear), 2 a thread arena
 * (set). The first node is head + bias; the link of node L is the word at L (read through the
 * sorted, disjoint regions), unmangled as (L >> 12) ^ word when mangled != 0 (glibc >= 2.32
 * safe-linking), and the next node is link + bias (bias 0: tcache entries are user pointers;
 * 16: fastbin fd values are chunk pointers). Cycles are found exactly (Brent), in O(length).
 * Stores the verified prefix's user pointers (up to cap, chain order); fills *res.
 * Returns res->nodes (at most max_nodes + 1); -EINVAL on bad arguments. */
int64_t mu_walk_chain(const mu_region *regions, uint64_t nregions, const uint64_t *user,
                      const uint64_t *usable, uint64_t n, uint64_t head, uint64_t bias,
                      uint32_t mangled, uint64_t chunk_size, uint64_t chunk_max, uint32_t arena,
                      uint64_t max_nodes, uint64_t *out, uint64_t cap, mu_chain_result *res);

/* One in-use chunk shaped like a tcache_perthread_struct (mu_walk_tcache_scan). */
typedef struct {
    uint64_t addr;          /* its user address */
    uint64_t key;           /* the word at key_off in its first valid head (0: no valid head) */
    uint32_t nonempty;      /* bins with counts[i] != 0 */
    uint32_t heads;         /* non-empty bins whose head is an in-use chunk of the bin's size */
    uint32_t want_key;      /* of those heads, how many hold the caller's want_key */
    uint32_t self_key;      /* of those heads, how many hold addr (glibc 2.29-2.33's key) */
    uint32_t mismatched;    /* bins where (counts[i] == 0) != (entries[i] == 0) */
    uint32_t pad;
} mu_tcache_cand;

/* Cheap prefilter for tcache structs, linear in the heap: every in-use chunk of usable size
 * struct_usable to struct_usable + struct_slack (malloc hands out a whole free chunk when the
 * rest would be below MINSIZE: a tcache struct taken from a bin may be 16 bytes larger; glibc
 * 2.43 allocates it at the first free, often from a bin) (user[]/usable[] ascending, n
 * entries) whose counts[] (count_width 1 or 2
 * bytes, nbins of them) are all <= max_count, with at least one non-empty bin whose head
 * entries[i] (at entries_off) is an in-use chunk of a chunk size in [bin_min[i], bin_max[i]]
 * (bin sizes never change), and whose bins from active_bins on are empty. remaining != 0:
 * counts[] is glibc 2.42+'s num_slots, the room left: a bin holds max_count - num_slots
 * chunks. The memory is read through the regions. A head's key is the word at head + key_off.
 * want_key != 0: only candidates with a head holding want_key pass (counted in want_key).
 * only != NULL: only the in-use chunks at the nonly user addresses there (ascending) are
 * tested, not every one: a scan for want_key over an earlier scan's candidates.
 * Stores up to cap candidates in address order; returns the number that passed (or -ENOMEM).
 * A big heap's sizes are tested on two threads first. */
int64_t mu_walk_tcache_scan(const mu_region *regions, uint64_t nregions, const uint64_t *user,
                            const uint64_t *usable, uint64_t n, uint64_t struct_usable,
                            uint64_t struct_slack, uint32_t count_width, uint64_t entries_off,
                            uint64_t nbins, uint64_t active_bins, uint64_t max_count,
                            uint32_t remaining,
                            const uint64_t *bin_min, const uint64_t *bin_max, uint64_t key_off,
                            uint64_t want_key, const uint64_t *only, uint64_t nonly,
                            mu_tcache_cand *out, uint64_t cap);

/* Walk a doubly linked bin list from the bin's fake chunk `bin` (its fd at bin+16, bk at
 * bin+24) through the regions: each node n needs n->bk == previous node, a readable header,
 * chunksize >= 32, and (counted separately) the PREV_INUSE bit clear in the next header.
 * Stops back at `bin`, or after max_nodes nodes. Writes nodes, bytes and bit-free nodes;
 * *bad_at gets the first node that failed (the bin itself if its fd is unreadable), else 0.
 * Returns 0 when the list closed correctly, 1 if it is broken or too long. */
int64_t mu_walk_bin(const mu_region *regions, uint64_t nregions, uint64_t bin, uint64_t max_nodes,
                    uint64_t *nodes, uint64_t *bytes, uint64_t *bit_free, uint64_t *bad_at);

/* mu_walk_bin over nbins bins whose fake chunks lie stride bytes apart from first (an arena's
 * bins 1 .. nbins): their sums. out[0] the bins broken or too long (mu_walk_bin's 1), out[1]
 * the nodes, out[2] the bit-free nodes, out[3] the first bad node of any (0: none). One call
 * an arena: a Python loop over 126 bins cost 1.7 ms of a small check. Returns 0 or -EINVAL. */
int64_t mu_walk_bins(const mu_region *regions, uint64_t nregions, uint64_t first, uint64_t stride,
                     uint64_t nbins, uint64_t max_nodes, uint64_t *out);

/* Remove from the ascending user[]/usable[] (n entries) every address listed in drop[]
 * (ndrop entries, any order; sorted in place). Returns the new length (or -ENOMEM); *removed
 * gets the number of drop[] entries that matched (duplicates in drop count once), and
 * *distinct (unless NULL) the number of distinct drop[] entries. Big arrays move on two
 * threads, one each. */
int64_t mu_walk_subtract(uint64_t *user, uint64_t *usable, uint64_t n, uint64_t *drop,
                         uint64_t ndrop, uint64_t *removed, uint64_t *distinct);

/* Moves n bytes from p + src down to p + dst (dst < src) inside one private anonymous mapping
 * of ours (pages: 1 to move its whole pages with mremap, else 0: a plain memmove). The
 * source's whole pages go down by the shift's page multiple (MREMAP_DONTUNMAP: no fresh page
 * is faulted in and zeroed under the destination, and no hole opens in the mapping), then the
 * bytes by the rest of the shift (less than a page) with memmove. Needs src page aligned and
 * a shift of at least MU_MOVE_MIN_PAGES pages in at most MU_MOVE_MAX_STEPS mremaps; otherwise,
 * or when mremap refuses (before Linux 5.7), memmove alone. The bytes of the source past
 * src + n up to its page end move too (they are the caller's unused room); every byte below
 * dst and in [dst, src) outside the result is left or zero. Returns 0 or -EINVAL. */
#define MU_MOVE_MIN_PAGES 16
#define MU_MOVE_MAX_STEPS 64
int64_t mu_move_down(uint8_t *p, uint64_t dst, uint64_t src, uint64_t n, int pages);

/* memmove(p + dst, p + src, n), either way: a move a caller runs on two threads at once (the
 * core's calls let go of Python's lock, cffi's ffi.memmove keeps it). Returns 0 or -EINVAL. */
int64_t mu_move(uint8_t *p, uint64_t dst, uint64_t src, uint64_t n);

/* Reference candidates of an uncopied region [base, base+len) (base 4096-aligned): for each
 * 1 MiB piece (from base) the (offset, value) of every 8-byte word whose value lies in one of
 * the nranges (begin, end) pairs of ranges (sorted, disjoint: the memory that may hold
 * allocations), in address order, kept while the region holds at most max_words of them in all
 * (a piece that would pass the budget keeps none: it is read again when needed; max_words
 * 0 keeps no piece). Filled by
 * mu_read_walk (mu_read_job.cands) or mu_cands_fill. mu_mark scans an allocation of an
 * uncopied region from them, without reading it, when its pieces were all kept and no dead
 * word or type rule applies: every value a scan of its bytes gives that can hit an allocation,
 * in the same order, when the ranges hold every allocation (the others hit nothing). Returns 0,
 * -EINVAL (unaligned base, no or unsorted ranges) or -ENOMEM; *out gets the object (release
 * with mu_cands_free). */
int64_t mu_cands_new(uint64_t base, uint64_t len, const uint64_t *ranges, uint64_t nranges,
                     uint64_t max_words, mu_cands **out);
void mu_cands_free(mu_cands *c);
/* Fills every piece of c that lies wholly inside [addr, addr+len), whose bytes are at data
 * (a piece at the region's end may be shorter). Returns the number of pieces kept. */
int64_t mu_cands_fill(mu_cands *c, const uint8_t *data, uint64_t addr, uint64_t len);
/* The candidates c keeps (*pieces_kept: its pieces kept, may be NULL). */
uint64_t mu_cands_words(const mu_cands *c, uint64_t *pieces_kept);
/* Which build of the candidate filter mu_cands_fill and mu_read_walk use from now on: 1 the
 * AVX2 one (x86-64), 0 the baseline one, -1 the CPU's (AVX2 where it has it: the default).
 * Returns the previous setting; -ENOTSUP for 1 where there is no AVX2 build or CPU support,
 * -EINVAL for another value.
 * Both fill the same candidates (the unit tests compare them). */
int64_t mu_cands_filter(int64_t which);
