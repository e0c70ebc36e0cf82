/* mu_track.h: layout of the allocation-tracking table (version 2).
 *
 * The tracking library (mu_track.c, built as memunreachable/_track.so and preloaded by
 * `memunreachable run`) keeps, in ONE private anonymous mapping of the target, a table of
 * live blocks (address -> stack id) and a deduplicated table of stacks. The checker finds
 * the mapping without symbols (named "[anon:memunreachable-track]" where the kernel names
 * anonymous mappings, else by the magic at the start of an anonymous mapping), validates
 * this header and reads the table out of the fork snapshot with no lock
 * (memunreachable/stacks/tracking.py mirrors this file: change both, bump MU_TRACK_VERSION).
 *
 * This header is NOT part of cffi's cdef (native/ffi_build.py leaves mu_track.* out): the
 * tracking library depends on neither Python nor cffi.
 *
 * Layout, all integers little-endian, offsets relative to the mapping's start (= header):
 *   header        struct mu_track_header, MU_TRACK_HEADER_BYTES (one page)
 *   shards        nshards x struct mu_track_shard
 *   stack index   sindex_cap x u64 slots: (hash >> 32) << 32 | stack id, 0 = empty
 *   stack arena   records { u32 hash32; u16 nframes; u16 npy; u64 pc[nframes];
 *                           u64 code[npy]; u64 instr_offset[npy] } at 8-byte alignment;
 *                 stack id = (record offset - stack_arena_off) / 8; id 0 is never used
 *   live arena    shard tables: (1 << log2cap) x struct mu_track_entry each
 * Live entries: addr 0 = empty, addr 1 = tombstone (removed). A slot is published by
 * writing stack/size first and addr last, so a snapshot never shows a half-written slot.
 * Python frames: code = address of the PyCodeObject, instr_offset = byte offset of the
 * instruction being executed from the start of the code's bytecode (co_code_adaptive in
 * 3.11+; f_lasti, times 2 in 3.10), negative (as u64) before the first instruction. The
 * line comes from the bytes object at co_linetable, in the format py_linetable says.
 * Version 1 (224-byte header, no py_linetable) recorded 3.11+ frames only: its format is
 * MU_TRACK_LT_LOCATIONS. Versions 1 and 2 have 16-byte live entries (no epoch); the checker
 * reads all three.
 */
#ifndef MU_TRACK_H
#define MU_TRACK_H
#include <stdint.h>

#define MU_TRACK_MAGIC "MUTRACK\0"
#define MU_TRACK_VERSION 3u          /* 2: + py_linetable (CPython 3.8-3.10 frames);
                                      * 3: + epoch (header and each live entry), started */
#define MU_TRACK_HEADER_BYTES 4096u
#define MU_TRACK_MAP_NAME "memunreachable-track"
#define MU_TRACK_NSHARDS 256u
#define MU_TRACK_MAX_DEPTH 32u
#define MU_TRACK_MAX_PY 16u
#define MU_TRACK_STACK_FULL 0xFFFFFFFFu     /* stack id of "[stack table full]" */
#define MU_TRACK_EMPTY 0u
#define MU_TRACK_TOMB 1u

enum mu_track_unwinder { MU_UNW_FP = 1, MU_UNW_LIBGCC = 2, MU_UNW_LIBUNWIND = 3 };

struct mu_track_header {
    char magic[8];              /*   0 MU_TRACK_MAGIC */
    uint32_t version;           /*   8 MU_TRACK_VERSION */
    uint32_t header_size;       /*  12 sizeof(struct mu_track_header) */
    uint64_t self;              /*  16 address of this header in the target */
    uint64_t map_size;          /*  24 bytes of the mapping */
    uint64_t budget;            /*  32 MEMUNREACHABLE_TRACK_BUDGET */
    uint32_t max_depth;         /*  40 native frames kept per stack */
    uint32_t max_py;            /*  44 Python frames kept per stack */
    uint32_t nshards;           /*  48 */
    uint32_t flags;             /*  52 MU_TRACK_F_* */
    uint64_t shards_off;        /*  56 */
    uint64_t sindex_off;        /*  64 */
    uint64_t sindex_cap;        /*  72 slots (power of two) */
    uint64_t stack_arena_off;   /*  80 */
    uint64_t stack_arena_size;  /*  88 */
    uint64_t stack_arena_used;  /*  96 bytes handed out (atomic) */
    uint64_t live_arena_off;    /* 104 */
    uint64_t live_arena_size;   /* 112 */
    uint64_t live_arena_used;   /* 120 */
    uint64_t stacks;            /* 128 interned stacks */
    uint64_t table_full_blocks; /* 136 blocks given the "[stack table full]" stack */
    uint64_t dropped_blocks;    /* 144 blocks not recorded: the live table was full */
    uint64_t inserts;           /* 152 blocks recorded (cumulative) */
    uint64_t removes;           /* 160 blocks removed (cumulative) */
    uint32_t py_version;        /* 168 Py_Version of a CPython target, else 0 */
    uint32_t unwinder;          /* 172 enum mu_track_unwinder */
    /* where the checker finds a code object's name, file and line table (CPython) */
    uint32_t co_filename;       /* 176 */
    uint32_t co_name;           /* 180 */
    uint32_t co_qualname;       /* 184 */
    uint32_t co_firstlineno;    /* 188 */
    uint32_t co_linetable;      /* 192 */
    uint32_t str_ascii_data;    /* 196 data offset of a compact ASCII str */
    uint32_t str_compact_data;  /* 200 data offset of a compact non-ASCII str */
    uint32_t str_state;         /* 204 offset of the str state bits */
    uint64_t pid;               /* 208 process that owns this copy (updated after fork) */
    uint64_t generation;        /* 216 bumped on every fork child */
    uint32_t py_linetable;      /* 224 MU_TRACK_LT_*: format of co_linetable's bytes */
    uint32_t epoch;             /* 228 stored in each new live entry: set by whoever drives
                                 *     the process (the pytest plugin: the running test's number) */
    uint64_t started;           /* 232 when recording last began (CLOCK_REALTIME, ns) */
};

#define MU_TRACK_F_ENABLED 1u       /* recording */
#define MU_TRACK_F_PYTHON 2u        /* Python frames recorded */

/* line table formats (py_linetable) */
#define MU_TRACK_LT_LNOTAB 1u       /* 3.8, 3.9 co_lnotab: (byte delta u8, line delta s8) */
#define MU_TRACK_LT_310 2u          /* 3.10 co_linetable (PEP 626): (byte delta u8, line
                                     * delta s8, -128 = no line) */
#define MU_TRACK_LT_LOCATIONS 3u    /* 3.11+ co_linetable (Objects/locations.md) */

struct mu_track_shard {
    uint64_t table_off;         /* 0: no table yet */
    uint32_t log2cap;
    uint32_t used;              /* live entries */
    uint32_t tombs;             /* tombstones */
    uint32_t lock;              /* spinlock (never read by the checker) */
    uint64_t seq;               /* odd while a writer is inside */
};

struct mu_track_entry {
    uint64_t addr;
    uint32_t stack;
    uint32_t size;              /* requested size, saturated at 2^32-1 */
    uint32_t epoch;             /* the header's epoch when the block was recorded */
    uint32_t reserved;          /* 0 */
};

/* Hash of a block address. Blocks in one 1 KiB window of memory share the hash and sit
 * side by side in one table: malloc hands out neighbouring addresses one after another, so
 * consecutive inserts and removes touch the same cache lines (the first probe is the cost
 * of the whole table: a cache miss). shard = h & (nshards-1); first probe =
 * mu_track_first_slot(); linear probing. Mirrored in tracking.py. */
static inline uint64_t mu_track_addr_hash(uint64_t addr)
{
    uint64_t h = addr >> 10;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

static inline uint64_t mu_track_first_slot(uint64_t addr, uint64_t h, uint64_t mask)
{
    return (((h >> 8) << 6) | ((addr >> 4) & 63)) & mask;
}

#endif
