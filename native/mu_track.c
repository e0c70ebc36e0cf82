/* mu_track.c: the allocation-tracking library preloaded by `memunreachable run`.
 *
 * Interposes the malloc family and records, per live block, a deduplicated stack of up to
 * MEMUNREACHABLE_STACK_DEPTH (default and max 32) return addresses, plus the Python frames
 * running at allocation time when the program is CPython 3.8-3.15 (3.13+: the offsets the
 * runtime publishes in _PyRuntime.debug_offsets, so patch releases need no table). The table lives in one
 * private anonymous mapping whose layout is native/mu_track.h; the checker reads it from
 * the fork snapshot (memunreachable/stacks/tracking.py). No dependency on Python or cffi.
 *
 * Environment (read once, in the constructor):
 *   MEMUNREACHABLE_TRACK_BUDGET   bytes of the whole table (default 64 MiB; suffix k/m/g)
 *   MEMUNREACHABLE_STACK_DEPTH    native frames per stack (1..32, default 32)
 *   MEMUNREACHABLE_UNWINDER       libunwind | libgcc | fp (default: libunwind if it loads)
 *   MEMUNREACHABLE_PYTHON_FRAMES  0 to skip Python frames
 *   MEMUNREACHABLE_NO_FOLLOW_FORK 1: children (fork) stop tracking, exec'd programs are
 *                                 started without this library in LD_PRELOAD
 *   MEMUNREACHABLE_EXIT_FDS       "W,R" (set by `run --check-at-exit`): at exit, the process
 *   MEMUNREACHABLE_EXIT_PARENT    whose parent is this pid writes a request to fd W and
 *                                 waits for one byte on fd R while `run` checks it
 *
 * Safety rules: a per-thread guard (initial-exec TLS, never allocates) makes every call
 * made while the tracker works on this thread (the unwinder's own allocations, a signal
 * handler that allocates) pass straight to the real allocator; allocations made while
 * dlsym resolves the real functions come from a static bootstrap pool; the user's call
 * never fails because of the tracker (a full table drops detail, never the allocation).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <link.h>
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "mu_track.h"

#define EXPORT __attribute__((visibility("default")))
#define HIDDEN __attribute__((visibility("hidden")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

#ifndef PR_SET_VMA
#define PR_SET_VMA 0x53564d41
#define PR_SET_VMA_ANON_NAME 0
#endif

/* ---- real allocator ------------------------------------------------------------------ */

static void *(*real_malloc)(size_t);
static void (*real_free)(void *);
static void *(*real_calloc)(size_t, size_t);
static void *(*real_realloc)(void *, size_t);
static int (*real_posix_memalign)(void **, size_t, size_t);
static void *(*real_aligned_alloc)(size_t, size_t);
static void *(*real_memalign)(size_t, size_t);
static void *(*real_valloc)(size_t);
static void *(*real_pvalloc)(size_t);
static size_t (*real_usable)(void *);

/* bootstrap pool: serves allocations made while dlsym resolves the real functions */
#define POOL_BYTES (64 * 1024)
static char pool[POOL_BYTES] __attribute__((aligned(16)));
static size_t pool_used;

static int in_pool(const void *p)
{
    return (const char *)p >= pool && (const char *)p < pool + POOL_BYTES;
}

static void *pool_alloc(size_t n)
{
    size_t need = ((n + 15) & ~(size_t)15) + 16;
    size_t off = __atomic_fetch_add(&pool_used, need, __ATOMIC_RELAXED);
    if (off + need > POOL_BYTES)
        return NULL;
    *(size_t *)(pool + off) = n;
    return pool + off + 16;
}

static size_t pool_size(const void *p) { return *(const size_t *)((const char *)p - 16); }

static __thread int resolving __attribute__((tls_model("initial-exec")));

/* Where the real functions are looked up: RTLD_NEXT when preloaded (the next definition
 * after ours), RTLD_DEFAULT when dlopen'ed and routed (see "routing": the global scope's,
 * i.e. libc's or a preloaded allocator's; never ours, which a local load keeps out of it). */
static void *resolve_scope = RTLD_NEXT;

static void resolve(void)
{
    if (real_free)
        return;
    void *in = resolve_scope;
    resolving = 1;
    real_malloc = dlsym(in, "malloc");
    real_calloc = dlsym(in, "calloc");
    real_realloc = dlsym(in, "realloc");
    real_posix_memalign = dlsym(in, "posix_memalign");
    real_aligned_alloc = dlsym(in, "aligned_alloc");
    real_memalign = dlsym(in, "memalign");
    real_valloc = dlsym(in, "valloc");
    real_pvalloc = dlsym(in, "pvalloc");
    real_usable = dlsym(in, "malloc_usable_size");
    __atomic_store_n(&real_free, (void (*)(void *))dlsym(in, "free"), __ATOMIC_RELEASE);
    resolving = 0;
}

/* Wall-clock time in ns (the header's `started`: when recording began). */
static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* ---- state ----------------------------------------------------------------------------- */

static struct mu_track_header *H;       /* NULL until the constructor ran */
static char *base;
static struct mu_track_shard *shards;
static uint64_t *sindex;
static uint64_t sindex_mask;
static int enabled;                     /* recording (read racily: a plain int) */
static unsigned depth = MU_TRACK_MAX_DEPTH;
static unsigned unwinder;
static uintptr_t self_lo, self_hi;      /* our own text: frames there are skipped */
static int no_follow_fork;
static uint32_t freelist_lock;
static uint64_t freelists[40];          /* freed shard tables per log2cap (offsets) */

static __thread int guard __attribute__((tls_model("initial-exec")));

/* The guard is set before the first and cleared after the last step that a signal handler
 * allocating on this thread must not re-enter (a shard lock held, the unwinder running):
 * the signal fences keep the compiler from moving those steps out of the guarded span (a
 * plain store may legally sink past an acquire or rise above a release, and a handler
 * arriving there would spin forever on a lock its own thread holds). */
static inline void guard_on(void)
{
    guard = 1;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
}

static inline void guard_off(void)
{
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    guard = 0;
}

/* ---- unwinders --------------------------------------------------------------------------- */

static int (*unw_backtrace_p)(void **, int);
typedef enum { URC_NO_REASON = 0, URC_END_OF_STACK = 5 } urc_t;
typedef urc_t (*unwind_cb)(void *ctx, void *arg);
static urc_t (*unwind_backtrace_p)(unwind_cb, void *);
static uintptr_t (*unwind_getip_p)(void *);

struct gcc_state { void **buf; int n, max; };

static urc_t gcc_cb(void *ctx, void *arg)
{
    struct gcc_state *s = arg;
    if (s->n >= s->max)
        return URC_END_OF_STACK;
    uintptr_t ip = unwind_getip_p(ctx);
    if (!ip)
        return URC_END_OF_STACK;
    s->buf[s->n++] = (void *)ip;
    return URC_NO_REASON;
}

static __thread uintptr_t stack_lo, stack_hi __attribute__((tls_model("initial-exec")));

static int fp_backtrace(void **buf, int max)
{
    if (!stack_hi) {
        pthread_attr_t a;
        void *addr;
        size_t sz;
        if (pthread_getattr_np(pthread_self(), &a) == 0) {
            if (pthread_attr_getstack(&a, &addr, &sz) == 0) {
                stack_lo = (uintptr_t)addr;
                stack_hi = (uintptr_t)addr + sz;
            }
            pthread_attr_destroy(&a);
        }
        if (!stack_hi)
            return 0;
    }
    uintptr_t fp = (uintptr_t)__builtin_frame_address(0);
    /* only [our frame, stack top) is surely mapped: the stack below SP may not be */
    uintptr_t lo = fp > stack_lo ? fp : stack_lo;
    int n = 0;
    while (n < max && fp >= lo && fp <= stack_hi - 16 && !(fp & 7)) {
        uintptr_t next = ((uintptr_t *)fp)[0], ret = ((uintptr_t *)fp)[1];
        if (!ret)
            break;
        buf[n++] = (void *)ret;
        if (next <= fp)
            break;
        fp = next;
    }
    return n;
}

/* Threads inside an unwinder, counted per stripe (a thread keeps its stripe: the counts stay
 * in cache lines few threads share). An unwinder has locks of its own (libunwind's cache of
 * register states: Debian's build has no per-thread cache, so UNW_CACHE_PER_THREAD falls back
 * to one global lock), which a fork while another thread holds them copies held: the child's
 * first unwind then waits forever (fixtures/track_route_churn.c's forker, 5 of 150 runs under
 * load). fork_prepare closes the gate and waits until no thread unwinds; a thread that meets
 * the closed gate waits for the fork to end (forks are short; unwinds are microseconds). */
#define UNW_STRIPES 64
static struct { unsigned n; char pad[64 - sizeof(unsigned)]; } unwinding[UNW_STRIPES]
    __attribute__((aligned(64)));
static unsigned unw_gate_closed;
static unsigned next_stripe;
static __thread unsigned my_stripe __attribute__((tls_model("initial-exec")));

static inline unsigned *enter_unwinder(void)
{
    if (!my_stripe)
        my_stripe = __atomic_add_fetch(&next_stripe, 1, __ATOMIC_RELAXED) % UNW_STRIPES + 1;
    unsigned *n = &unwinding[my_stripe - 1].n;
    for (;;) {
        __atomic_add_fetch(n, 1, __ATOMIC_SEQ_CST);
        if (!__atomic_load_n(&unw_gate_closed, __ATOMIC_SEQ_CST))
            return n;
        __atomic_sub_fetch(n, 1, __ATOMIC_SEQ_CST);
        while (__atomic_load_n(&unw_gate_closed, __ATOMIC_ACQUIRE))
            sched_yield();
    }
}

/* fork_prepare: no thread is inside an unwinder once this returns, and none enters one until
 * open_unwinders (the Dekker pair: a thread counts itself, then reads the gate; this closes
 * the gate, then reads the counts). */
static void close_unwinders(void)
{
    __atomic_store_n(&unw_gate_closed, 1, __ATOMIC_SEQ_CST);
    for (unsigned i = 0; i < UNW_STRIPES; i++)
        while (__atomic_load_n(&unwinding[i].n, __ATOMIC_SEQ_CST))
            sched_yield();
}

static void open_unwinders(void)
{
    __atomic_store_n(&unw_gate_closed, 0, __ATOMIC_RELEASE);
}

static int capture_any(void **buf, int max)
{
    switch (unwinder) {
    case MU_UNW_LIBUNWIND:
        return unw_backtrace_p(buf, max);
    case MU_UNW_LIBGCC: {
        struct gcc_state s = {buf, 0, max};
        unwind_backtrace_p(gcc_cb, &s);
        return s.n;
    }
    default:
        return fp_backtrace(buf, max);
    }
}

static __attribute__((noinline)) int capture(void **buf, int max)
{
    unsigned *n = enter_unwinder();
    int got = capture_any(buf, max);
    __atomic_sub_fetch(n, 1, __ATOMIC_RELEASE);
    return got;
}

/* Which unwinder (MEMUNREACHABLE_UNWINDER; bench/bench_tracking.py, docs/performance.md):
 * libunwind's unw_backtrace is the default: right through code without frame pointers
 * (15/15 frames of fixtures/track_chain.c built -O2 -fomit-frame-pointer) at +212 ns per
 * malloc/free pair on the churn bench; libgcc's _Unwind_Backtrace is as right but +3.3 us
 * (it re-reads CFI per frame), the fallback when libunwind.so.8 is missing; frame pointers
 * cost +28 ns but get 2/15 frames there (distribution code has none): opt-in only.
 * libunwind is dlopen'ed RTLD_LOCAL: Debian's libunwind.so.8 exports a weak `backtrace`
 * and `_Unwind_Backtrace` that a global load would put in front of the program's. */
static int setup_unwinder(const char *want)
{
    if (!want || !*want || !strcmp(want, "libunwind")) {
        void *h = dlopen("libunwind.so.8", RTLD_NOW | RTLD_LOCAL);
        if (h) {
            unw_backtrace_p = dlsym(h, "unw_backtrace");
            int (*policy)(void *, int) = dlsym(h, "_ULx86_64_set_caching_policy");
            void **space = dlsym(h, "_ULx86_64_local_addr_space");
            if (policy && space)
                policy(*space, 2 /* UNW_CACHE_PER_THREAD */);
            if (unw_backtrace_p)
                return MU_UNW_LIBUNWIND;
        }
        if (want && *want)
            return 0;
    }
    if (!want || !*want || !strcmp(want, "libgcc")) {
        void *h = dlopen("libgcc_s.so.1", RTLD_NOW | RTLD_LOCAL);
        if (h) {
            unwind_backtrace_p = dlsym(h, "_Unwind_Backtrace");
            unwind_getip_p = dlsym(h, "_Unwind_GetIP");
            if (unwind_backtrace_p && unwind_getip_p)
                return MU_UNW_LIBGCC;
        }
        if (want && *want)
            return 0;
    }
    if (want && !strcmp(want, "fp"))
        return MU_UNW_FP;
    return want && *want ? 0 : MU_UNW_FP;
}

/* ---- CPython frames ---------------------------------------------------------------------- */

struct pylayout {
    unsigned minor;
    int tstate_cframe;          /* 3.11/3.12: PyThreadState.cframe; -1: none */
    int cframe_current;         /* _PyCFrame.current_frame */
    int tstate_current;         /* 3.13: tstate->current_frame; 3.8-3.10: tstate->frame */
    int f_code, f_instr, f_previous;
    int f_owner, skip_owner;    /* -1: no owner byte / no shim frames; else frames whose
                                 * owner is >= skip_owner are not Python frames */
    uintptr_t code_tag;         /* tag bits of f_code (3.14+: a _PyStackRef) */
    int instr_unit;             /* 0: f_instr points into co_code_adaptive (3.11+);
                                 * N: f_instr is the int f_lasti, counting N-byte units */
    int co_adaptive, co_filename, co_name, co_qualname, co_firstlineno, co_linetable;
    int str_ascii, str_compact, str_state;
    unsigned linetable;         /* MU_TRACK_LT_*: the format at co_linetable */
};

/* 3.8-3.12. Offsets checked with offsetof() against each version's headers (pyenv 3.8.18,
 * 3.9.18, 3.10.13, 3.11.7, 3.12.1 and Debian's 3.11.2); the frame fields of 3.11+ come from
 * internal/pycore_frame.h. str: PyASCIIObject.state at 32 (kind bits 2-4, compact 5, ascii
 * 6 in every version), data after sizeof(PyASCIIObject) / sizeof(PyCompactUnicodeObject).
 * 3.13+: from _Py_DebugOffsets (pydebugs below). */
static const struct pylayout pylayouts[] = {
    /* 3.8, 3.9: PyThreadState.frame 24; PyFrameObject {f_back 24, f_code 32, int f_lasti
     * 104 (bytes; -1 before the first instruction)}; PyCodeObject {co_firstlineno 40,
     * co_filename 104, co_name 112, co_lnotab 120}, no co_qualname */
    {.minor = 8, .tstate_cframe = -1, .tstate_current = 24, .f_code = 32, .f_instr = 104,
     .f_previous = 24, .f_owner = -1, .skip_owner = -1, .instr_unit = 1, .co_filename = 104,
     .co_name = 112, .co_firstlineno = 40, .co_linetable = 120, .str_ascii = 48,
     .str_compact = 72, .str_state = 32, .linetable = MU_TRACK_LT_LNOTAB},
    {.minor = 9, .tstate_cframe = -1, .tstate_current = 24, .f_code = 32, .f_instr = 104,
     .f_previous = 24, .f_owner = -1, .skip_owner = -1, .instr_unit = 1, .co_filename = 104,
     .co_name = 112, .co_firstlineno = 40, .co_linetable = 120, .str_ascii = 48,
     .str_compact = 72, .str_state = 32, .linetable = MU_TRACK_LT_LNOTAB},
    /* 3.10: f_lasti moved to 96 and counts 2-byte code units; co_linetable (PEP 626) 120 */
    {.minor = 10, .tstate_cframe = -1, .tstate_current = 24, .f_code = 32, .f_instr = 96,
     .f_previous = 24, .f_owner = -1, .skip_owner = -1, .instr_unit = 2, .co_filename = 104,
     .co_name = 112, .co_firstlineno = 40, .co_linetable = 120, .str_ascii = 48,
     .str_compact = 72, .str_state = 32, .linetable = MU_TRACK_LT_310},
    /* 3.11: PyThreadState.cframe 56, _PyCFrame.current_frame 8, _PyInterpreterFrame
     * {f_code 32, previous 48, prev_instr 56, owner 69}, no C-stack shim frames */
    {.minor = 11, .tstate_cframe = 56, .cframe_current = 8, .tstate_current = -1,
     .f_code = 32, .f_instr = 56, .f_previous = 48, .f_owner = 69, .skip_owner = -1,
     .co_adaptive = 184, .co_filename = 112, .co_name = 120, .co_qualname = 128,
     .co_firstlineno = 72, .co_linetable = 136, .str_ascii = 48, .str_compact = 72,
     .str_state = 32, .linetable = MU_TRACK_LT_LOCATIONS},
    /* 3.12: cframe 56, current_frame 0, {f_code 0, previous 8, prev_instr 56, owner 70},
     * FRAME_OWNED_BY_CSTACK = 3 marks shim frames */
    {.minor = 12, .tstate_cframe = 56, .cframe_current = 0, .tstate_current = -1,
     .f_code = 0, .f_instr = 56, .f_previous = 8, .f_owner = 70, .skip_owner = 3,
     .co_adaptive = 192, .co_filename = 112, .co_name = 120, .co_qualname = 128,
     .co_firstlineno = 68, .co_linetable = 136, .str_ascii = 40, .str_compact = 56,
     .str_state = 32, .linetable = MU_TRACK_LT_LOCATIONS},
};

/* CPython 3.13+ publishes, as the first member of _PyRuntime, a _Py_DebugOffsets: the cookie
 * "xdebugpy", u64 PY_VERSION_HEX, u64 free_threaded, then blocks of u64 offsets whose order
 * is fixed within a minor version (Include/internal/pycore_runtime.h in 3.13,
 * pycore_debug_offsets.h from 3.14; memunreachable/heaps/cpython/layout.py parses the same).
 * Below: where the fields used here sit inside it, per minor version, checked with
 * offsetof(_Py_DebugOffsets, ...) against the headers of 3.13.0 (pyenv), 3.13.5 (trixie),
 * 3.13.18, 3.14.10 and 3.15.2 (sid): sizeof 584, 584, 584, 760, 888. The values read there
 * are the target's own: for 3.13.x, 3.14.x and 3.15.x they were tstate current_frame 72,
 * frame {f_executable 0, previous 8, instr_ptr 56, owner 70 (3.13) / 74 (3.14+)},
 * co_code_adaptive 200 (3.13) / 208, co_filename 112, co_name 120, co_qualname 128,
 * co_firstlineno 68, co_linetable 136, str state 32, sizeof(PyASCIIObject) 40.
 * What _Py_DebugOffsets lacks is kept here: f_executable's tag bits (3.14+ a _PyStackRef:
 * Py_TAG_BITS 3 in pycore_stackref.h), the first owner that is not a Python frame
 * (FRAME_OWNED_BY_CSTACK 3 in 3.13; FRAME_OWNED_BY_INTERPRETER 3 in 3.14/3.15, CSTACK 4 in
 * 3.14), sizeof(PyCompactUnicodeObject) before 3.15 (PyASCIIObject + 16: 56 measured on all
 * five), and the line table (the 3.11+ location table). */
struct pydebug {
    unsigned minor;
    uint16_t ts_current_frame, fr_previous, fr_executable, fr_instr_ptr, fr_owner;
    uint16_t co_filename, co_name, co_qualname, co_linetable, co_firstlineno, co_adaptive;
    uint16_t str_state, str_ascii_size, str_compact_size;     /* 0: ascii size + 16 */
    uintptr_t code_tag;
    int skip_owner;
};

static const struct pydebug pydebugs[] = {
    {13, 184, 232, 240, 248, 264, 280, 288, 296, 304, 312, 344, 544, 560, 0, 0, 3},
    {14, 208, 256, 264, 272, 288, 320, 328, 336, 344, 352, 384, 624, 640, 0, 3, 3},
    {15, 208, 320, 328, 336, 352, 384, 392, 400, 408, 416, 448, 720, 736, 744, 3, 3},
};

#define PY_DEBUG_COOKIE "xdebugpy"

static struct pylayout pydyn;           /* 3.13+: filled from _Py_DebugOffsets */
static const struct pylayout *py;
static uintptr_t py_code_type;          /* &PyCode_Type: a frame's code must be one */
static int (*py_initialized)(void);
static void *(*py_this_tstate)(void);

/* PY_VERSION_HEX of the interpreter in this process, 0 if none: Py_Version (3.11+), else
 * parsed from Py_GetVersion()'s "3.N.M ..." (3.8-3.10: formatted into a static buffer). */
static uint32_t python_version(void)
{
    const unsigned long *ver = dlsym(RTLD_DEFAULT, "Py_Version");
    if (ver)
        return (uint32_t)*ver;
    const char *(*get)(void) = dlsym(RTLD_DEFAULT, "Py_GetVersion");
    const char *s = get ? get() : NULL;
    if (!s)
        return 0;
    unsigned v[3] = {0, 0, 0};
    for (int i = 0; i < 3; i++) {
        if (*s < '0' || *s > '9')
            return i < 2 ? 0 : v[0] << 24 | v[1] << 16 | 0xf0;
        while (*s >= '0' && *s <= '9')
            v[i] = v[i] * 10 + (unsigned)(*s++ - '0');
        if (i < 2 && *s++ != '.')
            return i < 1 ? 0 : v[0] << 24 | v[1] << 16 | 0xf0;
    }
    return v[0] << 24 | v[1] << 16 | (v[2] & 0xff) << 8 | 0xf0;
}

/* The offset read at byte `at` of _Py_DebugOffsets, if it is below `max` and a multiple of
 * `align`; else -1 (a runtime whose offsets we cannot trust gets no Python frames). */
static int debug_offset(const unsigned char *d, unsigned at, uint64_t max, unsigned align)
{
    uint64_t v;
    memcpy(&v, d + at, 8);
    return v < max && v % align == 0 ? (int)v : -1;
}

/* Fill pydyn from _PyRuntime.debug_offsets of a 3.13+ runtime of version ver; 0 or -errno:
 * -ENOENT no _PyRuntime, -ENOTSUP a minor version without a pydebugs entry or a
 * free-threaded build (thread-local bytecode: instr_ptr is not in co_code_adaptive),
 * -EINVAL a cookie, version or offset that does not fit. */
static int python_debug_layout(uint32_t ver)
{
    const unsigned char *d = dlsym(RTLD_DEFAULT, "_PyRuntime");
    if (!d)
        return -ENOENT;
    const struct pydebug *t = NULL;
    for (size_t i = 0; i < sizeof pydebugs / sizeof *pydebugs; i++)
        if (pydebugs[i].minor == ((ver >> 16) & 0xff))
            t = &pydebugs[i];
    if (!t)
        return -ENOTSUP;
    uint64_t dver, ft;
    memcpy(&dver, d + 8, 8);
    memcpy(&ft, d + 16, 8);
    if (memcmp(d, PY_DEBUG_COOKIE, 8) || (dver >> 16) != (ver >> 16))
        return -EINVAL;
    if (ft)
        return -ENOTSUP;
    struct pylayout l = {.minor = t->minor, .tstate_cframe = -1, .skip_owner = t->skip_owner,
                         .code_tag = t->code_tag, .linetable = MU_TRACK_LT_LOCATIONS};
    l.tstate_current = debug_offset(d, t->ts_current_frame, 4096, 8);
    l.f_previous = debug_offset(d, t->fr_previous, 256, 8);
    l.f_code = debug_offset(d, t->fr_executable, 256, 8);
    l.f_instr = debug_offset(d, t->fr_instr_ptr, 256, 8);
    l.f_owner = debug_offset(d, t->fr_owner, 256, 1);
    l.co_filename = debug_offset(d, t->co_filename, 1024, 8);
    l.co_name = debug_offset(d, t->co_name, 1024, 8);
    l.co_qualname = debug_offset(d, t->co_qualname, 1024, 8);
    l.co_linetable = debug_offset(d, t->co_linetable, 1024, 8);
    l.co_firstlineno = debug_offset(d, t->co_firstlineno, 1024, 4);
    l.co_adaptive = debug_offset(d, t->co_adaptive, 1024, 2);
    l.str_state = debug_offset(d, t->str_state, 256, 4);
    l.str_ascii = debug_offset(d, t->str_ascii_size, 256, 8);
    l.str_compact = t->str_compact_size ? debug_offset(d, t->str_compact_size, 256, 8)
                                        : (l.str_ascii < 0 ? -1 : l.str_ascii + 16);
    const int *all[] = {&l.tstate_current, &l.f_previous, &l.f_code, &l.f_instr, &l.f_owner,
                        &l.co_filename, &l.co_name, &l.co_qualname, &l.co_linetable,
                        &l.co_firstlineno, &l.co_adaptive, &l.str_state, &l.str_ascii,
                        &l.str_compact};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        if (*all[i] < 0)
            return -EINVAL;
    if (l.str_ascii < 32 || l.str_compact <= l.str_ascii || l.co_adaptive < 64)
        return -EINVAL;
    pydyn = l;
    return 0;
}

static void setup_python(void)
{
    const char *e = getenv("MEMUNREACHABLE_PYTHON_FRAMES");
    if (e && !strcmp(e, "0"))
        return;
    py_initialized = dlsym(RTLD_DEFAULT, "Py_IsInitialized");
    py_this_tstate = dlsym(RTLD_DEFAULT, "PyGILState_GetThisThreadState");
    if (!py_initialized || !py_this_tstate)
        return;
    uint32_t ver = python_version();
    if (((ver >> 24) & 0xff) != 3)
        return;
    unsigned minor = (ver >> 16) & 0xff;
    if (minor >= 13) {
        if (python_debug_layout(ver) == 0)
            py = &pydyn;
    } else {
        for (size_t i = 0; i < sizeof pylayouts / sizeof *pylayouts; i++)
            if (pylayouts[i].minor == minor)
                py = &pylayouts[i];
    }
    py_code_type = (uintptr_t)dlsym(RTLD_DEFAULT, "PyCode_Type");
    if (!py || !py_code_type) {
        py = NULL;
        return;
    }
    H->py_version = ver;
    H->co_filename = py->co_filename;
    H->co_name = py->co_name;
    H->co_qualname = py->co_qualname;
    H->co_firstlineno = py->co_firstlineno;
    H->co_linetable = py->co_linetable;
    H->str_ascii_data = py->str_ascii;
    H->str_compact_data = py->str_compact;
    H->str_state = py->str_state;
    H->py_linetable = py->linetable;
    H->flags |= MU_TRACK_F_PYTHON;
}

static int readable_ptr(uintptr_t p) { return p >= 4096 && !(p & 7); }

/* The Python frames of this thread, innermost first, as (code, instruction offset) pairs.
 * Reads only this thread's own frame chain (safe while it is not running Python code, and
 * it is not: it is in malloc), with the GIL held or not. */
static int python_frames(uint64_t *code, uint64_t *off, int max)
{
    if (!py || !py_initialized())
        return 0;
    uintptr_t ts = (uintptr_t)py_this_tstate();
    if (!readable_ptr(ts))
        return 0;
    uintptr_t f;
    if (py->tstate_cframe >= 0) {
        uintptr_t cf = *(uintptr_t *)(ts + py->tstate_cframe);
        if (!readable_ptr(cf))
            return 0;
        f = *(uintptr_t *)(cf + py->cframe_current);
    } else {
        f = *(uintptr_t *)(ts + py->tstate_current);
    }
    int n = 0;
    for (int guard_steps = 0; readable_ptr(f) && n < max && guard_steps < 4096; guard_steps++) {
        uintptr_t co = *(uintptr_t *)(f + py->f_code) & ~py->code_tag;
        int keep = 1;
        if (py->f_owner >= 0 && py->skip_owner >= 0)
            keep = *(unsigned char *)(f + py->f_owner) < py->skip_owner;
        /* a code object (3.13+ f_executable may be None or another callable; a shim
         * frame's may be anything): its type is PyCode_Type, read at PyObject.ob_type */
        keep = keep && readable_ptr(co) && *(uintptr_t *)(co + 8) == py_code_type;
        if (keep) {
            code[n] = co;
            if (py->instr_unit)         /* int f_lasti; -1 before the first instruction */
                off[n] = (uint64_t)((int64_t)*(int32_t *)(f + py->f_instr) * py->instr_unit);
            else
                off[n] = *(uintptr_t *)(f + py->f_instr) - (co + py->co_adaptive);
            n++;
        }
        f = *(uintptr_t *)(f + py->f_previous);
    }
    return n;
}

/* ---- spinlocks ----------------------------------------------------------------------------- */

static void lock(uint32_t *l)
{
    for (unsigned spins = 0;; spins++) {
        if (!__atomic_exchange_n(l, 1, __ATOMIC_ACQUIRE))
            return;
        while (__atomic_load_n(l, __ATOMIC_RELAXED)) {
            if (++spins > 64)
                sched_yield();
            else
                __builtin_ia32_pause();
        }
    }
}

static void unlock(uint32_t *l) { __atomic_store_n(l, 0, __ATOMIC_RELEASE); }

/* ---- stack table ------------------------------------------------------------------------------ */

/* Four independent lanes, mixed at the end: a stack of 16 Python frames is 32 words, and one
 * multiply-shift chain over them was most of the cost of recording an object (perf: 70% of
 * record() in the hash loop, each step waiting on the one before). */
static uint64_t hash_words(const uint64_t *w, int n)
{
    const uint64_t k = 0xff51afd7ed558ccdULL;
    uint64_t a = 0x9E3779B97F4A7C15ULL ^ (uint64_t)n, b = 0xC2B2AE3D27D4EB4FULL,
             c = 0x165667B19E3779F9ULL, d = 0x27D4EB2F165667C5ULL;
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        a = (a ^ w[i]) * k;
        b = (b ^ w[i + 1]) * k;
        c = (c ^ w[i + 2]) * k;
        d = (d ^ w[i + 3]) * k;
    }
    for (; i < n; i++)
        a = (a ^ w[i]) * k;
    uint64_t h = a;
    h = (h ^ (h >> 29) ^ b) * k;
    h = (h ^ (h >> 29) ^ c) * k;
    h = (h ^ (h >> 29) ^ d) * k;
    return h ^ (h >> 32);
}

/* Stack id of words[0..nf+2*npy) (pcs, then code pointers, then offsets), interned;
 * MU_TRACK_STACK_FULL when the stack table has no room for a new one. */
static uint32_t intern(const uint64_t *words, int nf, int npy)
{
    int nw = nf + 2 * npy;
    uint64_t h = hash_words(words, nw);
    uint32_t hi = (uint32_t)(h >> 32) | 1;    /* never 0: a slot is never all-zero */
    uint64_t pos = h & sindex_mask;
    char *arena = base + H->stack_arena_off;
    for (uint64_t probes = 0; probes <= sindex_mask; probes++, pos = (pos + 1) & sindex_mask) {
        uint64_t slot = __atomic_load_n(&sindex[pos], __ATOMIC_ACQUIRE);
        while (slot == 0) {
            if (__atomic_load_n(&H->stacks, __ATOMIC_RELAXED) * 4 >= (sindex_mask + 1) * 3)
                return MU_TRACK_STACK_FULL;
            uint64_t bytes = 8 + 8 * (uint64_t)nw;
            uint64_t off = __atomic_fetch_add(&H->stack_arena_used, bytes, __ATOMIC_RELAXED);
            if (off + bytes > H->stack_arena_size)
                return MU_TRACK_STACK_FULL;
            uint32_t *rec = (uint32_t *)(arena + off);
            rec[0] = hi;
            ((uint16_t *)rec)[2] = (uint16_t)nf;
            ((uint16_t *)rec)[3] = (uint16_t)npy;
            memcpy(rec + 2, words, 8 * (size_t)nw);
            uint32_t id = (uint32_t)(off / 8);
            uint64_t want = ((uint64_t)hi << 32) | id;
            if (__atomic_compare_exchange_n(&sindex[pos], &slot, want, 0, __ATOMIC_RELEASE,
                                            __ATOMIC_ACQUIRE)) {
                __atomic_fetch_add(&H->stacks, 1, __ATOMIC_RELAXED);
                return id;
            }
            /* lost the race: slot now holds the winner, compare it below (our record is
             * wasted space, counted in stack_arena_used) */
        }
        if ((uint32_t)(slot >> 32) != hi)
            continue;
        const uint32_t *rec = (const uint32_t *)(arena + (slot & 0xffffffffu) * 8);
        if (((const uint16_t *)rec)[2] == nf && ((const uint16_t *)rec)[3] == npy &&
            !memcmp(rec + 2, words, 8 * (size_t)nw))
            return (uint32_t)slot;
    }
    return MU_TRACK_STACK_FULL;
}

/* ---- live table ------------------------------------------------------------------------------- */

static struct mu_track_entry *shard_table(const struct mu_track_shard *s)
{
    return (struct mu_track_entry *)(base + s->table_off);
}

/* A zeroed table of 1 << log2 entries from the live arena (or a freed one); 0 if full. */
static uint64_t table_alloc(unsigned log2)
{
    uint64_t bytes = (uint64_t)sizeof(struct mu_track_entry) << log2, off = 0;
    lock(&freelist_lock);
    if (freelists[log2]) {
        off = freelists[log2];
        freelists[log2] = *(uint64_t *)(base + off);
    }
    unlock(&freelist_lock);
    if (off) {
        memset(base + off, 0, bytes);
        return off;
    }
    off = __atomic_fetch_add(&H->live_arena_used, bytes, __ATOMIC_RELAXED);
    if (off + bytes > H->live_arena_size) {
        __atomic_fetch_sub(&H->live_arena_used, bytes, __ATOMIC_RELAXED);
        return 0;
    }
    return H->live_arena_off + off;      /* fresh pages of the mapping are zero */
}

static void table_free(uint64_t off, unsigned log2)
{
    /* give the pages back (a shard table that grew is rarely reused soon: the shards grow
     * together); the first word stays mapped for the free list */
    uint64_t bytes = (uint64_t)sizeof(struct mu_track_entry) << log2;
    uintptr_t lo = ((uintptr_t)(base + off) + 4095 + 8) & ~(uintptr_t)4095;
    uintptr_t hi = (uintptr_t)(base + off + bytes) & ~(uintptr_t)4095;
    if (hi > lo)
        madvise((void *)lo, hi - lo, MADV_DONTNEED);
    lock(&freelist_lock);
    *(uint64_t *)(base + off) = freelists[log2];
    freelists[log2] = off;
    unlock(&freelist_lock);
}

/* Rebuild shard s into a table of 1 << log2 entries (copy, then publish): a snapshot sees
 * either the old table or the new one, both complete. Returns 0 or -ENOMEM. */
static int shard_rebuild(struct mu_track_shard *s, unsigned log2)
{
    uint64_t off = table_alloc(log2);
    if (!off)
        return -ENOMEM;
    struct mu_track_entry *nt = (struct mu_track_entry *)(base + off);
    uint64_t mask = (1ULL << log2) - 1;
    if (s->table_off) {
        struct mu_track_entry *ot = shard_table(s);
        uint64_t cap = 1ULL << s->log2cap;
        for (uint64_t i = 0; i < cap; i++) {
            uint64_t a = ot[i].addr;
            if (a <= MU_TRACK_TOMB)
                continue;
            uint64_t p = mu_track_first_slot(a, mu_track_addr_hash(a), mask);
            while (nt[p].addr)
                p = (p + 1) & mask;
            nt[p] = ot[i];
        }
    }
    uint64_t old = s->table_off;
    unsigned oldlog = s->log2cap;
    __atomic_store_n(&s->table_off, 0, __ATOMIC_RELEASE);   /* no torn pair in a snapshot */
    s->log2cap = log2;
    __atomic_store_n(&s->table_off, off, __ATOMIC_RELEASE);
    s->tombs = 0;
    if (old)
        table_free(old, oldlog);
    return 0;
}

static void live_insert(uint64_t addr, uint32_t stack, size_t size)
{
    uint32_t epoch = __atomic_load_n(&H->epoch, __ATOMIC_RELAXED);
    uint64_t h = mu_track_addr_hash(addr);
    struct mu_track_shard *s = &shards[h & (MU_TRACK_NSHARDS - 1)];
    lock(&s->lock);
    __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELAXED);
    uint64_t cap = s->table_off ? 1ULL << s->log2cap : 0;
    if ((uint64_t)(s->used + s->tombs + 1) * 8 > cap * 5) {
        unsigned log2 = !cap ? 6 : (s->tombs > s->used / 2 ? s->log2cap : s->log2cap + 1);
        if (shard_rebuild(s, log2) < 0 && (!cap || (uint64_t)(s->used + s->tombs + 1) * 20 > cap * 19)) {
            __atomic_fetch_add(&H->dropped_blocks, 1, __ATOMIC_RELAXED);
            goto out;
        }
        cap = 1ULL << s->log2cap;
    }
    struct mu_track_entry *t = shard_table(s);
    uint64_t mask = cap - 1, p = mu_track_first_slot(addr, h, mask), tomb = UINT64_MAX;
    for (;;) {
        uint64_t a = t[p].addr;
        if (a == addr) {                    /* a stale entry (a free we did not see) */
            t[p].stack = stack;
            t[p].size = size > UINT32_MAX ? UINT32_MAX : (uint32_t)size;
            t[p].epoch = epoch;
            goto counted;
        }
        if (a == MU_TRACK_TOMB && tomb == UINT64_MAX)
            tomb = p;
        if (a == MU_TRACK_EMPTY)
            break;
        p = (p + 1) & mask;
    }
    if (tomb != UINT64_MAX) {
        p = tomb;
        s->tombs--;
    }
    t[p].stack = stack;
    t[p].size = size > UINT32_MAX ? UINT32_MAX : (uint32_t)size;
    t[p].epoch = epoch;
    __atomic_store_n(&t[p].addr, addr, __ATOMIC_RELEASE);
    s->used++;
counted:
    __atomic_fetch_add(&H->inserts, 1, __ATOMIC_RELAXED);
out:
    __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELEASE);
    unlock(&s->lock);
}

static void live_remove(uint64_t addr)
{
    uint64_t h = mu_track_addr_hash(addr);
    struct mu_track_shard *s = &shards[h & (MU_TRACK_NSHARDS - 1)];
    if (!__atomic_load_n(&s->table_off, __ATOMIC_RELAXED))
        return;
    lock(&s->lock);
    __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELAXED);
    struct mu_track_entry *t = shard_table(s);
    uint64_t mask = (1ULL << s->log2cap) - 1, p = mu_track_first_slot(addr, h, mask);
    for (uint64_t n = 0; n <= mask; n++, p = (p + 1) & mask) {
        uint64_t a = t[p].addr;
        if (a == MU_TRACK_EMPTY)
            break;
        if (a == addr) {
            __atomic_store_n(&t[p].addr, (uint64_t)MU_TRACK_TOMB, __ATOMIC_RELEASE);
            s->used--;
            s->tombs++;
            __atomic_fetch_add(&H->removes, 1, __ATOMIC_RELAXED);
            break;
        }
    }
    __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELEASE);
    unlock(&s->lock);
}

/* ---- recording -------------------------------------------------------------------------------- */

/* Records block p with up to `want` native frames and `want_py` Python frames. */
static __attribute__((noinline)) void record(void *p, size_t size, unsigned want, int want_py)
{
    void *raw[MU_TRACK_MAX_DEPTH + 8];
    uint64_t words[MU_TRACK_MAX_DEPTH + 2 * MU_TRACK_MAX_PY];
    guard_on();
    int n = want ? capture(raw, (int)want + 8) : 0;
    /* drop the leading frames in this library (record, the wrapper, the unwinder's caller) */
    int first = 0;
    for (int i = 0; i < n && i < 8; i++)
        if ((uintptr_t)raw[i] >= self_lo && (uintptr_t)raw[i] < self_hi)
            first = i + 1;
    int nf = n - first;
    if (nf > (int)want)
        nf = (int)want;
    if (nf < 0)
        nf = 0;
    for (int i = 0; i < nf; i++)
        words[i] = (uint64_t)(uintptr_t)raw[first + i];
    uint64_t code[MU_TRACK_MAX_PY], off[MU_TRACK_MAX_PY];
    int npy = python_frames(code, off, want_py);
    for (int i = 0; i < npy; i++) {
        words[nf + i] = code[i];
        words[nf + npy + i] = off[i];
    }
    uint32_t id = intern(words, nf, npy);
    if (id == MU_TRACK_STACK_FULL)
        __atomic_fetch_add(&H->table_full_blocks, 1, __ATOMIC_RELAXED);
    live_insert((uint64_t)(uintptr_t)p, id, size);
    guard_off();
}

static inline void track(void *p, size_t size)
{
    if (LIKELY(p != NULL) && LIKELY(enabled) && !guard)
        record(p, size, depth, MU_TRACK_MAX_PY);
}

/* Native frames kept for a block of CPython's MEM and OBJ domains: MEMUNREACHABLE_PY_STACK_DEPTH
 * (0..32, default 0: the Python frames alone), read by mu_track_route_python. A Python program
 * allocates objects far more often than it calls malloc, and unwinding is the cost: 300,000
 * rounds of a list, a dict and a str under pytest-deep recursion took 42 ms untracked, 68 ms
 * with the table alone, 180 ms with the Python frames, 364 ms with 8 native frames too. With
 * native frames, a leaked object shows which C function made it. */
static unsigned py_depth = 0;

/* Python frames kept for such a block: the innermost ones, where the object was made (every
 * frame more is one more step of the walk and two more words to hash and compare: 16 frames
 * cost a quarter more than 8 per object). */
#define PY_DOMAIN_FRAMES 8

static inline void track_py(void *p, size_t size)
{
    if (LIKELY(p != NULL) && LIKELY(enabled) && !guard)
        record(p, size, py_depth, PY_DOMAIN_FRAMES);
}

static inline void untrack(void *p)
{
    if (LIKELY(enabled) && !guard) {
        guard_on();
        live_remove((uint64_t)(uintptr_t)p);
        guard_off();
    }
}

/* ---- the interposed functions ----------------------------------------------------------------- */

EXPORT void *malloc(size_t n)
{
    if (UNLIKELY(!real_free)) {
        if (resolving)
            return pool_alloc(n);
        resolve();
    }
    void *p = real_malloc(n);
    track(p, n);
    return p;
}

EXPORT void free(void *p)
{
    if (!p || UNLIKELY(in_pool(p)))
        return;
    if (UNLIKELY(!real_free))
        resolve();
    untrack(p);
    real_free(p);
}

EXPORT void *calloc(size_t n, size_t m)
{
    if (UNLIKELY(!real_free)) {
        if (resolving) {
            if (m && n > SIZE_MAX / m)
                return NULL;
            return pool_alloc(n * m);      /* static memory: already zero */
        }
        resolve();
    }
    void *p = real_calloc(n, m);
    track(p, n * m);
    return p;
}

EXPORT void *realloc(void *old, size_t n)
{
    if (UNLIKELY(!real_free)) {
        if (resolving) {
            void *p = pool_alloc(n);
            if (p && old)
                memcpy(p, old, pool_size(old) < n ? pool_size(old) : n);
            return p;
        }
        resolve();
    }
    if (old && UNLIKELY(in_pool(old))) {
        void *p = malloc(n);
        if (p)
            memcpy(p, old, pool_size(old) < n ? pool_size(old) : n);
        return p;
    }
    if (old)
        untrack(old);       /* before: once realloc returns, another thread may get `old` */
    void *p = real_realloc(old, n);
    if (p)
        track(p, n);
    else if (old && n)
        track(old, n);      /* failed: the old block lives on */
    return p;
}

/* Our wrapper under a hidden name: a call of (or the address of) `realloc` from here goes
 * through our own GOT, which binds to libc's when this library is dlopen'ed (routing).
 * The alias drops the target's declared attributes (leaf, malloc): it is not called as
 * an allocator but as our function. */
#pragma GCC diagnostic ignored "-Wmissing-attributes"
#define WRAPPER_ALIAS(name, hidden_name) \
    extern __typeof(name) hidden_name __attribute__((alias(#name), visibility("hidden")));

WRAPPER_ALIAS(realloc, mu_w_realloc)

EXPORT void *reallocarray(void *old, size_t n, size_t m)
{
    if (m && n > SIZE_MAX / m) {
        errno = ENOMEM;
        return NULL;
    }
    return mu_w_realloc(old, n * m);
}

EXPORT int posix_memalign(void **out, size_t align, size_t n)
{
    if (UNLIKELY(!real_free))
        resolve();
    int r = real_posix_memalign(out, align, n);
    if (!r)
        track(*out, n);
    return r;
}

EXPORT void *aligned_alloc(size_t align, size_t n)
{
    if (UNLIKELY(!real_free))
        resolve();
    void *p = real_aligned_alloc(align, n);
    track(p, n);
    return p;
}

EXPORT void *memalign(size_t align, size_t n)
{
    if (UNLIKELY(!real_free))
        resolve();
    void *p = real_memalign(align, n);
    track(p, n);
    return p;
}

EXPORT void *valloc(size_t n)
{
    if (UNLIKELY(!real_free))
        resolve();
    void *p = real_valloc(n);
    track(p, n);
    return p;
}

EXPORT void *pvalloc(size_t n)
{
    if (UNLIKELY(!real_free))
        resolve();
    void *p = real_pvalloc(n);
    track(p, n);
    return p;
}

EXPORT size_t malloc_usable_size(void *p)
{
    if (!p)
        return 0;
    if (in_pool(p))
        return pool_size(p);
    if (UNLIKELY(!real_free))
        resolve();
    return real_usable(p);
}

/* ---- CPython's allocator domains ------------------------------------------------------------- */

/* PyMemAllocatorEx (CPython 3.5+, the same in 3.8-3.15). The MEM and OBJ domains are pymalloc
 * (objects up to 512 bytes come from its arenas, never from malloc): routed through these
 * wrappers, each of their blocks is recorded like a malloc'd one. The RAW domain is malloc
 * itself. The wrapped allocator runs under the guard, so that a block it takes from malloc
 * (a large object) is recorded once, here, with this call's stack. */
struct py_alloc {
    void *ctx;
    void *(*malloc)(void *, size_t);
    void *(*calloc)(void *, size_t, size_t);
    void *(*realloc)(void *, void *, size_t);
    void (*free)(void *, void *);
};
enum { PY_DOMAIN_MEM = 1, PY_DOMAIN_OBJ = 2, PY_DOMAINS = 3 };
static struct py_alloc py_under[PY_DOMAINS], py_ours[PY_DOMAINS];

static void *py_malloc(void *ctx, size_t n)
{
    const struct py_alloc *u = ctx;
    if (guard)
        return u->malloc(u->ctx, n);
    guard_on();
    void *p = u->malloc(u->ctx, n);
    guard_off();
    track_py(p, n);
    return p;
}

static void *py_calloc(void *ctx, size_t n, size_t m)
{
    const struct py_alloc *u = ctx;
    if (guard)
        return u->calloc(u->ctx, n, m);
    guard_on();
    void *p = u->calloc(u->ctx, n, m);
    guard_off();
    track_py(p, n * m);
    return p;
}

static void *py_realloc(void *ctx, void *old, size_t n)
{
    const struct py_alloc *u = ctx;
    if (guard)
        return u->realloc(u->ctx, old, n);
    guard_on();
    void *p = u->realloc(u->ctx, old, n);
    guard_off();
    if (p) {
        if (old)
            untrack(old);
        track_py(p, n);
    }
    return p;
}

static void py_free(void *ctx, void *p)
{
    const struct py_alloc *u = ctx;
    if (p)
        untrack(p);
    u->free(u->ctx, p);
}

typedef void (*py_allocator_fn)(int, struct py_alloc *);

/* Routes CPython's MEM and OBJ domains through the wrappers above (idempotent). The caller
 * holds the GIL (PyMem_SetAllocator's rule; ctypes.PyDLL keeps it). Blocks allocated before
 * pass through untracked. 0, -ENOENT (no CPython runtime here) or -EINVAL (no table: the
 * library is neither preloaded nor routed). */
EXPORT int mu_track_route_python(void)
{
    py_allocator_fn get = (py_allocator_fn)dlsym(RTLD_DEFAULT, "PyMem_GetAllocator");
    py_allocator_fn set = (py_allocator_fn)dlsym(RTLD_DEFAULT, "PyMem_SetAllocator");
    if (!get || !set)
        return -ENOENT;
    if (!H)
        return -EINVAL;
    const char *e = getenv("MEMUNREACHABLE_PY_STACK_DEPTH");
    if (e && *e) {
        long v = strtol(e, NULL, 10);
        py_depth = v < 0 ? 0 : v > (long)MU_TRACK_MAX_DEPTH ? MU_TRACK_MAX_DEPTH : (unsigned)v;
    }
    for (int d = PY_DOMAIN_MEM; d <= PY_DOMAIN_OBJ; d++) {
        struct py_alloc cur;
        get(d, &cur);
        if (cur.malloc == py_malloc)
            continue;
        py_under[d] = cur;
        py_ours[d] = (struct py_alloc){&py_under[d], py_malloc, py_calloc, py_realloc, py_free};
        set(d, &py_ours[d]);
    }
    return 0;
}

extern int mu_track_last_rc;

static int route_python_pending(void *unused)
{
    (void)unused;
    mu_track_route_python();
    return 0;                   /* never an exception in the program: routing is best effort */
}

/* For a caller without the GIL (`track PID`'s injected call): asks the interpreter to route
 * its domains itself, with the GIL, at its next check of pending calls (the main thread, within
 * milliseconds while it runs Python code; when it next does, if it waits). 0, -ENOENT (no
 * CPython here), -EAGAIN (its pending-call queue is full: try again). */
static int unroute_python_pending(void *unused)
{
    (void)unused;
    mu_track_unroute_python();
    return 0;
}

/* Py_AddPendingCall(fn): 0, -ENOENT (no CPython in this process) or -EAGAIN (queue full).
 * The result is also left in mu_track_last_rc (an injected call's return value is not). */
static int python_later(int (*fn)(void *))
{
    int (*add)(int (*)(void *), void *) =
        (int (*)(int (*)(void *), void *))dlsym(RTLD_DEFAULT, "Py_AddPendingCall");
    if (!add || !dlsym(RTLD_DEFAULT, "PyMem_SetAllocator"))
        return mu_track_last_rc = -ENOENT;
    return mu_track_last_rc = add(fn, NULL) == 0 ? 0 : -EAGAIN;
}

EXPORT int mu_track_route_python_later(void)
{
    return python_later(route_python_pending);
}

/* The same for mu_track_unroute_python (`track --stop`): meanwhile the wrappers pass every
 * call through, recording nothing. */
EXPORT int mu_track_unroute_python_later(void)
{
    return python_later(unroute_python_pending);
}

/* Gives each domain routed above its own allocator back, where it is still ours (the GIL
 * held). Blocks recorded meanwhile keep their (now stale) entries: harmless, a later insert at
 * the same address replaces one. 0 or -ENOENT. */
EXPORT int mu_track_unroute_python(void)
{
    py_allocator_fn get = (py_allocator_fn)dlsym(RTLD_DEFAULT, "PyMem_GetAllocator");
    py_allocator_fn set = (py_allocator_fn)dlsym(RTLD_DEFAULT, "PyMem_SetAllocator");
    if (!get || !set)
        return -ENOENT;
    for (int d = PY_DOMAIN_MEM; d <= PY_DOMAIN_OBJ; d++) {
        struct py_alloc cur;
        get(d, &cur);
        if (cur.malloc == py_malloc && cur.ctx == &py_under[d])
            set(d, &py_under[d]);
    }
    return 0;
}

/* The epoch stored with every block recorded from now on (the pytest plugin: the number of
 * the test that runs). 0, or -EINVAL when there is no table. */
EXPORT int mu_track_set_epoch(uint32_t epoch)
{
    if (!H)
        return -EINVAL;
    __atomic_store_n(&H->epoch, epoch, __ATOMIC_RELAXED);
    return 0;
}

/* ---- fork -------------------------------------------------------------------------------------- */

static int fork_locked;

static void fork_prepare(void)
{
    fork_locked = 0;
    if (!H || guard)        /* fork from a signal handler that interrupted the tracker */
        return;
    fork_locked = 1;
    guard_on();             /* a handler allocating now must not wait for our locks */
    close_unwinders();      /* no unwinder's lock is held across the fork */
    for (unsigned i = 0; i < MU_TRACK_NSHARDS; i++)
        lock(&shards[i].lock);
    lock(&freelist_lock);
}

static void fork_parent(void)
{
    if (!H || !fork_locked)
        return;
    unlock(&freelist_lock);
    for (unsigned i = 0; i < MU_TRACK_NSHARDS; i++)
        unlock(&shards[i].lock);
    open_unwinders();
    guard_off();
}

static void fork_child(void)
{
    if (!H)
        return;
    fork_parent();
    H->pid = (uint64_t)getpid();
    H->generation++;
    if (no_follow_fork) {
        /* this child is not tracked: nothing may find a table that stops being updated */
        enabled = 0;
        struct mu_track_header *h = H;
        H = NULL;
        memset(h->magic, 0, sizeof h->magic);
        munmap(h, h->map_size);
    }
}

/* ---- routing ------------------------------------------------------------------------------------- */

/* A process that did not preload this library (it was dlopen'ed, RTLD_LOCAL: by
 * memunreachable/track_here.py, or injected by `track PID`) routes its malloc family through
 * the wrappers above by rewriting GOT entries: mu_track_route() points, in every loaded
 * object but this library and ld.so (which allocates through its own __rtld_malloc
 * pointers), each JUMP_SLOT (DT_JMPREL), GLOB_DAT and addend-0 R_X86_64_64 (DT_RELA) entry
 * of the names in route_names at our wrapper; mu_track_unroute() puts back every entry that
 * still holds our value. libc is routed too (strdup, fopen, getline call malloc@plt);
 * operator new/delete reach malloc/free/aligned_alloc through libstdc++'s PLT
 * (shared/notes/allocation-tracking.md section 1), so routing libstdc++ covers C++.
 *
 * An entry is changed only when it holds what the global scope resolves the name to (the
 * allocator the wrappers forward to, or a non-PIE program's canonical PLT entry for it:
 * see definition()) or, for a JUMP_SLOT, the object's own lazy-binding stub; an entry
 * bound elsewhere (an object with an allocator of its own, RTLD_DEEPBIND) is left alone:
 * sending its blocks to another allocator would corrupt both. dlsym is routed too, so a
 * pointer looked up while routed (ctypes' libc.malloc) is the wrapper. Each store is
 * one aligned 8-byte compare-and-swap, so a thread calling through the entry meanwhile
 * reaches either function; a page of the object's PT_GNU_RELRO range is made writable for
 * the stores and read-only again after (the protection ld.so gave it, elf/dl-reloc.c
 * _dl_protect_relro). Every change is kept (slot, old, new) in memory of our own (mmap), by
 * object, so it can be undone; objects are walked with dl_iterate_phdr, which holds the
 * loader's lock: an object cannot be unmapped while its entries are read or written.
 *
 * Objects loaded later: the dlopen wrapper routes the objects that appeared (dlpi_adds)
 * once the real dlopen returned, so an extension module is tracked from its first
 * allocation after dlopen returns; what its constructors allocate during dlopen is not.
 * The real dlopen would then see this library as its caller, so when the caller matters
 * (dlopen_needs_caller) the wrapper jumps to it instead. Not routed: calls of
 * __libc_malloc & co., lazy bindings that ld.so completes on another thread between our
 * read and store of a JUMP_SLOT (it then writes the real function over ours), and until
 * the next route or routed dlopen, objects loaded by such a jump or by a dlopen that did
 * not go through a routed entry. */

WRAPPER_ALIAS(malloc, mu_w_malloc)
WRAPPER_ALIAS(free, mu_w_free)
WRAPPER_ALIAS(calloc, mu_w_calloc)
WRAPPER_ALIAS(posix_memalign, mu_w_posix_memalign)
WRAPPER_ALIAS(aligned_alloc, mu_w_aligned_alloc)
WRAPPER_ALIAS(memalign, mu_w_memalign)
WRAPPER_ALIAS(valloc, mu_w_valloc)
WRAPPER_ALIAS(pvalloc, mu_w_pvalloc)
WRAPPER_ALIAS(reallocarray, mu_w_reallocarray)
WRAPPER_ALIAS(malloc_usable_size, mu_w_usable)

extern void *mu_wrap_dlopen(const char *file, int mode) __attribute__((visibility("hidden")));
static int wrap_dlclose(void *handle);
extern void *mu_wrap_dlsym(void *handle, const char *name) __attribute__((visibility("hidden")));

enum { R_MALLOC, R_FREE, R_CALLOC, R_REALLOC, R_POSIX_MEMALIGN, R_ALIGNED_ALLOC, R_MEMALIGN,
       R_VALLOC, R_PVALLOC, R_REALLOCARRAY, R_USABLE, R_DLOPEN, R_DLCLOSE, R_DLSYM, NROUTES };
static const struct { const char *name; void *wrapper; int needed; } route_names[NROUTES] = {
    [R_MALLOC] = {"malloc", (void *)mu_w_malloc, 1},
    [R_FREE] = {"free", (void *)mu_w_free, 1},
    [R_CALLOC] = {"calloc", (void *)mu_w_calloc, 1},
    [R_REALLOC] = {"realloc", (void *)mu_w_realloc, 1},
    [R_POSIX_MEMALIGN] = {"posix_memalign", (void *)mu_w_posix_memalign, 0},
    [R_ALIGNED_ALLOC] = {"aligned_alloc", (void *)mu_w_aligned_alloc, 0},
    [R_MEMALIGN] = {"memalign", (void *)mu_w_memalign, 0},
    [R_VALLOC] = {"valloc", (void *)mu_w_valloc, 0},
    [R_PVALLOC] = {"pvalloc", (void *)mu_w_pvalloc, 0},
    [R_REALLOCARRAY] = {"reallocarray", (void *)mu_w_reallocarray, 0},
    [R_USABLE] = {"malloc_usable_size", (void *)mu_w_usable, 0},
    [R_DLOPEN] = {"dlopen", (void *)mu_wrap_dlopen, 1},
    [R_DLCLOSE] = {"dlclose", (void *)wrap_dlclose, 1},
    [R_DLSYM] = {"dlsym", (void *)mu_wrap_dlsym, 1},
};
static void *route_canon[NROUTES];      /* each name in the global scope (dlsym): what GOTs hold */
static void *route_real[NROUTES];       /* its definition: what the wrappers forward to */

struct patch { uint64_t *slot; uint64_t old, new; uintptr_t object; };

#define MAX_PATCHES 65536               /* 2 MiB reserved, touched as used */
#define MAX_OBJECTS 16384
#define OBJECT_PATCHES 256              /* entries changed in one object, at most */
static struct patch *patches;
static size_t npatches;
static uintptr_t *objects;              /* routed objects, by their PT_DYNAMIC address */
static size_t nobjects;
static pthread_mutex_t route_lock = PTHREAD_MUTEX_INITIALIZER;
static int routed;                      /* GOT entries point here (read racily by wrappers) */
static int preloaded;                   /* set by the constructor: the loader interposed us */
static int unrouted_once;               /* the live table may hold entries of missed frees */
static unsigned long long seen_adds, seen_subs;

/* Whether addr lies in one of info's PT_LOAD segments (with all of `flags`). */
static int in_object(const struct dl_phdr_info *info, uintptr_t addr, unsigned flags)
{
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        uintptr_t lo = info->dlpi_addr + ph->p_vaddr;
        if (ph->p_type == PT_LOAD && (ph->p_flags & flags) == flags && addr >= lo &&
            addr < lo + ph->p_memsz)
            return 1;
    }
    return 0;
}

/* What an object's relocation tables say, its PT_DYNAMIC address (its key: unique among
 * the objects loaded at one time) and the pages ld.so made read-only after relocation. */
struct object_view {
    uintptr_t key, relro_lo, relro_hi;
    const ElfW(Sym) *symtab;
    const char *strtab;
    const ElfW(Rela) *rel[2];
    size_t nrel[2];
};

/* 0 and *v filled, or -1: nothing of ours in this object (no dynamic section, ld.so, us). */
static int object_view(const struct dl_phdr_info *info, struct object_view *v)
{
    if (in_object(info, (uintptr_t)object_view, 0) || in_object(info, (uintptr_t)&_r_debug, 0))
        return -1;
    memset(v, 0, sizeof *v);
    uintptr_t base = info->dlpi_addr;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type == PT_DYNAMIC)
            v->key = base + ph->p_vaddr;
        else if (ph->p_type == PT_GNU_RELRO) {
            v->relro_lo = (base + ph->p_vaddr) & ~(uintptr_t)4095;
            v->relro_hi = (base + ph->p_vaddr + ph->p_memsz) & ~(uintptr_t)4095;
        }
    }
    if (!v->key)
        return -1;
    size_t relsz[2] = {0, 0};
    int plt_rela = 1;
    for (const ElfW(Dyn) *d = (const ElfW(Dyn) *)v->key; d->d_tag != DT_NULL; d++) {
        /* ld.so relocates these d_ptr in place, except in a read-only dynamic section (the
         * vDSO's): a value below the load address is still file-relative */
        uintptr_t p = d->d_un.d_ptr < base ? d->d_un.d_ptr + base : d->d_un.d_ptr;
        switch (d->d_tag) {
        case DT_SYMTAB: v->symtab = (const ElfW(Sym) *)p; break;
        case DT_STRTAB: v->strtab = (const char *)p; break;
        case DT_JMPREL: v->rel[0] = (const ElfW(Rela) *)p; break;
        case DT_PLTRELSZ: relsz[0] = d->d_un.d_val; break;
        case DT_PLTREL: plt_rela = d->d_un.d_val == DT_RELA; break;
        case DT_RELA: v->rel[1] = (const ElfW(Rela) *)p; break;
        case DT_RELASZ: relsz[1] = d->d_un.d_val; break;
        default: break;
        }
    }
    if (!v->symtab || !v->strtab || !plt_rela)
        v->rel[0] = v->rel[1] = NULL;
    for (int k = 0; k < 2; k++)
        v->nrel[k] = v->rel[k] ? relsz[k] / sizeof(ElfW(Rela)) : 0;
    return 0;
}

static int known_object(uintptr_t key)
{
    for (size_t i = 0; i < nobjects; i++)
        if (objects[i] == key)
            return 1;
    return 0;
}

static int route_index(const char *name)
{
    for (int i = 0; i < NROUTES; i++)
        if (name[0] == route_names[i].name[0] && !strcmp(name, route_names[i].name))
            return i;
    return -1;
}

/* Make [lo, hi) writable (prot PROT_READ | PROT_WRITE) or read-only again; 0 or -errno. */
static int relro_protect(uintptr_t lo, uintptr_t hi, int prot)
{
    if (lo >= hi)
        return 0;
    return mprotect((void *)lo, hi - lo, prot) ? -errno : 0;
}

static int in_relro(const struct object_view *v, const uint64_t *slot)
{
    return (uintptr_t)slot >= v->relro_lo && (uintptr_t)slot < v->relro_hi;
}

/* Point info's entries of route_names at our wrappers and remember them; 0 or -errno
 * (nothing of this object changed then). */
static int route_object(const struct dl_phdr_info *info)
{
    struct object_view v;
    if (object_view(info, &v) < 0 || known_object(v.key))
        return 0;
    if (nobjects == MAX_OBJECTS)
        return -ENOSPC;
    struct patch todo[OBJECT_PATCHES];
    int n = 0, relro = 0;
    for (int k = 0; k < 2; k++) {
        for (size_t i = 0; i < v.nrel[k]; i++) {
            const ElfW(Rela) *r = &v.rel[k][i];
            unsigned type = ELF64_R_TYPE(r->r_info);
            if (!(type == R_X86_64_JUMP_SLOT || type == R_X86_64_GLOB_DAT ||
                  (type == R_X86_64_64 && r->r_addend == 0)))
                continue;
            const ElfW(Sym) *sym = &v.symtab[ELF64_R_SYM(r->r_info)];
            int at = route_index(v.strtab + sym->st_name);
            if (at < 0 || !route_real[at])
                continue;       /* not ours, or nothing to forward to */
            uint64_t *slot = (uint64_t *)(info->dlpi_addr + r->r_offset);
            if (!in_object(info, (uintptr_t)slot, PF_W) || ((uintptr_t)slot & 7))
                continue;
            uint64_t cur = __atomic_load_n(slot, __ATOMIC_RELAXED);
            uint64_t own = sym->st_shndx == SHN_UNDEF ? 0 : info->dlpi_addr + sym->st_value;
            int lazy = type == R_X86_64_JUMP_SLOT && cur != own && in_object(info, cur, PF_X);
            if (cur != (uint64_t)(uintptr_t)route_canon[at] &&
                cur != (uint64_t)(uintptr_t)route_real[at] && !lazy)
                continue;       /* ours already, or bound to another allocator */
            if (n == OBJECT_PATCHES || npatches + n == MAX_PATCHES)
                return -ENOSPC;
            todo[n++] = (struct patch){slot, cur, (uint64_t)(uintptr_t)route_names[at].wrapper, v.key};
            relro |= in_relro(&v, slot);
        }
    }
    if (relro) {
        int r = relro_protect(v.relro_lo, v.relro_hi, PROT_READ | PROT_WRITE);
        if (r < 0)
            return r;
    }
    for (int i = 0; i < n; i++) {
        uint64_t want = todo[i].old;
        if (__atomic_compare_exchange_n(todo[i].slot, &want, todo[i].new, 0, __ATOMIC_RELEASE,
                                        __ATOMIC_RELAXED))
            patches[npatches++] = todo[i];
    }
    if (relro)
        relro_protect(v.relro_lo, v.relro_hi, PROT_READ);
    objects[nobjects++] = v.key;
    return 0;
}

/* Put back info's entries that still hold our value (one someone changed since is left). */
static void unroute_object(const struct dl_phdr_info *info)
{
    struct object_view v;
    if (object_view(info, &v) < 0)
        return;
    int relro = 0;
    for (size_t i = 0; i < npatches; i++)
        relro |= patches[i].object == v.key && in_relro(&v, patches[i].slot);
    if (relro && relro_protect(v.relro_lo, v.relro_hi, PROT_READ | PROT_WRITE) < 0)
        return;     /* cannot happen: the same call succeeded when routing */
    for (size_t i = 0; i < npatches; i++) {
        struct patch *p = &patches[i];
        uint64_t want = p->new;
        if (p->object == v.key)
            __atomic_compare_exchange_n(p->slot, &want, p->old, 0, __ATOMIC_RELEASE,
                                        __ATOMIC_RELAXED);
    }
    if (relro)
        relro_protect(v.relro_lo, v.relro_hi, PROT_READ);
}

enum walk_op { WALK_ROUTE, WALK_UNROUTE, WALK_KEEP };
struct walk { enum walk_op op; int err; size_t kept; };

static int walk_cb(struct dl_phdr_info *info, size_t size, void *arg)
{
    struct walk *w = arg;
    (void)size;
    if (w->op == WALK_ROUTE) {
        int r = route_object(info);
        if (r < 0 && !w->err)
            w->err = r;
    } else if (w->op == WALK_UNROUTE) {
        unroute_object(info);
    } else {                    /* move the keys of loaded objects to the front */
        struct object_view v;
        if (object_view(info, &v) == 0)
            for (size_t i = w->kept; i < nobjects; i++)
                if (objects[i] == v.key) {
                    objects[i] = objects[w->kept];
                    objects[w->kept++] = v.key;
                    break;
                }
    }
    return 0;
}

static int counts_cb(struct dl_phdr_info *info, size_t size, void *arg)
{
    unsigned long long *c = arg;
    if (size < offsetof(struct dl_phdr_info, dlpi_subs) + sizeof info->dlpi_subs)
        return -1;
    c[0] = info->dlpi_adds;
    c[1] = info->dlpi_subs;
    return 1;
}

/* dl_iterate_phdr's counts of objects loaded and unloaded so far: {adds, subs}. */
static void load_counts(unsigned long long c[2])
{
    c[0] = c[1] = 0;
    dl_iterate_phdr(counts_cb, c);
}

/* Forget the objects unloaded since the last walk, and their entries (route_lock held). */
static void prune_unloaded(void)
{
    struct walk w = {WALK_KEEP, 0, 0};
    dl_iterate_phdr(walk_cb, &w);
    size_t keep = 0;
    for (size_t i = 0; i < npatches; i++) {
        int alive = 0;
        for (size_t j = 0; j < w.kept && !alive; j++)
            alive = objects[j] == patches[i].object;
        if (alive)
            patches[keep++] = patches[i];
    }
    npatches = keep;
    nobjects = w.kept;
}

/* Route every loaded object not routed yet; 0 or the first -errno (route_lock held). */
static int route_all(void)
{
    unsigned long long c[2];
    load_counts(c);
    if (c[1] != seen_subs)
        prune_unloaded();
    struct walk w = {WALK_ROUTE, 0, 0};
    dl_iterate_phdr(walk_cb, &w);
    seen_adds = c[0];
    seen_subs = c[1];
    return w.err;
}

static void unroute_all(void)
{
    __atomic_store_n(&routed, 0, __ATOMIC_RELAXED);
    struct walk w = {WALK_UNROUTE, 0, 0};
    dl_iterate_phdr(walk_cb, &w);
    npatches = nobjects = 0;
    enabled = 0;
    if (H)
        H->flags &= ~MU_TRACK_F_ENABLED;
    unrouted_once = 1;
}

__attribute__((used)) static void *wrap_dlopen_c(const char *file, int mode)
{
    void *h = ((void *(*)(const char *, int))route_real[R_DLOPEN])(file, mode);
    if (h && __atomic_load_n(&routed, __ATOMIC_RELAXED)) {
        /* every walk of the loaded objects under route_lock: no fork meanwhile (route_setup) */
        unsigned long long c[2];
        pthread_mutex_lock(&route_lock);
        load_counts(c);
        if (routed && c[0] != seen_adds)
            route_all();        /* an object we cannot route stays untracked */
        pthread_mutex_unlock(&route_lock);
    }
    return h;
}

/* Whether a dlopen(file) made from ret would find another object if this library were the
 * caller (glibc's dlopen takes its caller from its return address): a bare name is searched
 * with the caller's DT_RUNPATH, or its DT_RPATH (the program's DT_RPATH applies to every
 * caller), and a caller in a dlmopen namespace loads into its own. */
__attribute__((used)) static int dlopen_needs_caller(const char *file, void *ret)
{
    Dl_info di;
    struct link_map *lm = NULL;
    if (!dladdr1(ret, &di, (void **)&lm, RTLD_DL_LINKMAP) || !lm)
        return 0;
    Lmid_t ns = LM_ID_BASE;
    if (dlinfo(lm, RTLD_DI_LMID, &ns) == 0 && ns != LM_ID_BASE)
        return 1;
    if (!file || strchr(file, '/'))
        return 0;
    for (const ElfW(Dyn) *d = lm->l_ld; d && d->d_tag != DT_NULL; d++)
        if (d->d_tag == DT_RUNPATH || (d->d_tag == DT_RPATH && lm != _r_debug.r_map))
            return 1;
    return 0;
}

/* The routed dlopen: when the caller matters (above), a jump to the real dlopen, which then
 * sees the caller's return address (the object it loads is routed by the next routed
 * dlopen or mu_track_route); else wrap_dlopen_c. */
__asm__(".text\n"
        ".p2align 4\n"
        ".globl mu_wrap_dlopen\n"
        ".hidden mu_wrap_dlopen\n"
        ".type mu_wrap_dlopen, @function\n"
        "mu_wrap_dlopen:\n"
        "    endbr64\n"
        "    pushq %rdi\n"
        "    pushq %rsi\n"
        "    subq $8, %rsp\n"                 /* 16-byte aligned for the call */
        "    movq 24(%rsp), %rsi\n"           /* our return address: the caller's */
        "    call dlopen_needs_caller\n"
        "    addq $8, %rsp\n"
        "    popq %rsi\n"
        "    popq %rdi\n"
        "    testl %eax, %eax\n"
        "    jne 1f\n"
        "    jmp wrap_dlopen_c\n"
        "1:  jmp *real_dlopen(%rip)\n"
        ".size mu_wrap_dlopen, .-mu_wrap_dlopen\n");

static int wrap_dlclose(void *handle)
{
    int r = ((int (*)(void *))route_real[R_DLCLOSE])(handle);
    if (__atomic_load_n(&routed, __ATOMIC_RELAXED)) {
        unsigned long long c[2];
        pthread_mutex_lock(&route_lock);
        load_counts(c);
        if (c[1] != seen_subs) {
            prune_unloaded();
            seen_subs = c[1];
        }
        pthread_mutex_unlock(&route_lock);
    }
    return r;
}

/* dlsym(handle, "malloc") & co. hand out our wrapper while routed: a pointer looked up
 * this way (ctypes' libc.malloc) calls no GOT entry. RTLD_NEXT and RTLD_DEFAULT depend on
 * the caller (the object after it; its scope), which the real dlsym reads from its return
 * address: those go to it by a jump, unchanged. A pointer looked up before routing stays
 * the real function. */
static void *real_dlsym __attribute__((used));
static void *real_dlopen __attribute__((used));     /* for mu_wrap_dlopen's jump */

__attribute__((used)) static void *wrap_dlsym_c(void *handle, const char *name)
{
    void *p = ((void *(*)(void *, const char *))real_dlsym)(handle, name);
    if (p && __atomic_load_n(&routed, __ATOMIC_RELAXED))
        for (int i = 0; i < R_DLOPEN; i++)
            if (route_real[i] && (p == route_canon[i] || p == route_real[i]))
                return route_names[i].wrapper;
    return p;
}

__asm__(".text\n"
        ".p2align 4\n"
        ".globl mu_wrap_dlsym\n"
        ".hidden mu_wrap_dlsym\n"
        ".type mu_wrap_dlsym, @function\n"
        "mu_wrap_dlsym:\n"
        "    endbr64\n"
        "    cmpq $-1, %rdi\n"            /* RTLD_NEXT */
        "    je 1f\n"
        "    testq %rdi, %rdi\n"          /* RTLD_DEFAULT */
        "    je 1f\n"
        "    jmp wrap_dlsym_c\n"
        "1:  jmp *real_dlsym(%rip)\n"
        ".size mu_wrap_dlsym, .-mu_wrap_dlsym\n");

/* Empty the live table: after an unroute, frees went past us and entries may be stale. */
static void live_reset(void)
{
    for (unsigned i = 0; i < MU_TRACK_NSHARDS; i++) {
        struct mu_track_shard *s = &shards[i];
        lock(&s->lock);
        __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELAXED);
        uint64_t off = s->table_off;
        __atomic_store_n(&s->table_off, 0, __ATOMIC_RELEASE);
        s->used = s->tombs = 0;
        if (off)
            table_free(off, s->log2cap);
        __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELEASE);
        unlock(&s->lock);
    }
}

/* Whether addr is the program's canonical PLT entry for name: a non-PIE program that takes
 * a function's address defines the symbol as its PLT stub (SHN_UNDEF, st_value set), which
 * dlsym and every other object's GOT then give; the stub jumps through the program's own
 * JUMP_SLOT, which PLT-class lookups bind to the real definition (glibc elf/dl-lookup.c
 * do_lookup_x skips undefined symbols for ELF_RTYPE_CLASS_PLT). Debian's python3.11. */
static int first_object_cb(struct dl_phdr_info *info, size_t size, void *arg)
{
    (void)size;
    *(struct dl_phdr_info *)arg = *info;
    return 1;
}

static int canonical_plt(const char *name, uintptr_t addr)
{
    struct dl_phdr_info info = {0};
    dl_iterate_phdr(first_object_cb, &info);        /* the program comes first */
    struct object_view v;
    if (object_view(&info, &v) < 0)
        return 0;
    for (int k = 0; k < 2; k++)
        for (size_t i = 0; i < v.nrel[k]; i++) {
            const ElfW(Sym) *sym = &v.symtab[ELF64_R_SYM(v.rel[k][i].r_info)];
            if (sym->st_shndx == SHN_UNDEF && sym->st_value &&
                info.dlpi_addr + sym->st_value == addr && !strcmp(v.strtab + sym->st_name, name))
                return 1;
        }
    return 0;
}

/* The definition name binds to, given canon = dlsym(RTLD_DEFAULT, name): canon itself, or
 * when that is the program's canonical PLT entry, the first definition among the objects
 * loaded after the program (in link-map order: preloads, then its dependencies). */
static void *definition(const char *name, void *canon)
{
    if (!canon || !canonical_plt(name, (uintptr_t)canon))
        return canon;
    for (struct link_map *l = _r_debug.r_map->l_next; l; l = l->l_next) {
        void *h = l->l_name && *l->l_name ? dlopen(l->l_name, RTLD_LAZY | RTLD_NOLOAD) : NULL;
        void *p = h ? dlsym(h, name) : NULL;
        if (h)
            dlclose(h);
        if (p && p != canon && !canonical_plt(name, (uintptr_t)p))
            return p;
    }
    return NULL;
}

static int setup_table(void);
static void mu_track_init(void);

/* fork while another thread routes: the child must not inherit route_lock held */
static void route_fork_prepare(void) { pthread_mutex_lock(&route_lock); }
static void route_fork_release(void) { pthread_mutex_unlock(&route_lock); }

static pthread_once_t route_once = PTHREAD_ONCE_INIT;
static int route_setup_rc;

/* route_setup's part under route_lock (below). */
static void route_setup_locked(void)
{
    void *m = mmap(NULL, MAX_PATCHES * sizeof *patches + MAX_OBJECTS * sizeof *objects,
                   PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
        route_setup_rc = -errno;
        return;
    }
    patches = m;
    objects = (uintptr_t *)(patches + MAX_PATCHES);
    /* never unloaded from here on: routed entries and atfork handlers point into us */
    Dl_info di;
    if (dladdr((void *)route_setup_locked, &di) && di.dli_fname)
        dlopen(di.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
    guard = 1;
    route_setup_rc = setup_table();
    guard = 0;
    if (route_setup_rc < 0)
        return;
    H->flags &= ~MU_TRACK_F_ENABLED;
}

/* Once: the fork handlers, then under route_lock the patch records, this library pinned and
 * the table (recording flagged off until routed).
 * - The handlers come first, outside route_lock: pthread_atfork takes glibc's atfork lock,
 *   which fork holds while it runs the prepare handlers, route_fork_prepare among them.
 * - The rest runs under route_lock, so no fork happens meanwhile: it walks and loads objects
 *   (dl_iterate_phdr, dlopen of the unwinder), which hold the loader's write lock, and fork
 *   does not reset that lock in the child. A fork from another thread then left a child whose
 *   first dlopen waited forever (fixtures/track_route_churn.c: 2 of about 3,000 runs under
 *   load; every run with those walks slowed). */
static void route_setup(void)
{
    pthread_atfork(fork_prepare, fork_parent, fork_child);
    pthread_atfork(route_fork_prepare, route_fork_release, route_fork_release);
    pthread_mutex_lock(&route_lock);
    route_setup_locked();
    pthread_mutex_unlock(&route_lock);
}

/* What the last mu_track_route or mu_track_unroute returned (1: neither ran yet): `track
 * PID` calls them by injection (memunreachable/collect/inject.py), where a return value is lost. */
EXPORT int mu_track_last_rc = 1;

/* The first call builds the table (as the constructor does when preloaded); every call
 * routes the objects not routed yet, so a second call changes nothing. 0 or -errno:
 * -ENOENT the malloc family is not in the global scope, -ELOOP this library is (it was
 * loaded RTLD_GLOBAL ahead of libc?), -ENOMEM no table, -ENOSPC too many entries, an
 * mprotect error (then nothing stays routed). When preloaded: 0, nothing to do. */
EXPORT int mu_track_route(void)
{
    if (preloaded)
        return mu_track_last_rc = 0;
    pthread_once(&route_once, route_setup);
    if (route_setup_rc < 0)
        return mu_track_last_rc = route_setup_rc;
    pthread_mutex_lock(&route_lock);
    int r = 0;
    for (int i = 0; i < NROUTES; i++) {
        route_canon[i] = dlsym(RTLD_DEFAULT, route_names[i].name);
        route_real[i] = definition(route_names[i].name, route_canon[i]);
        if (route_canon[i] == route_names[i].wrapper || route_real[i] == route_names[i].wrapper) {
            r = -ELOOP;
            goto out;
        }
        if (!route_real[i] && route_names[i].needed) {
            r = -ENOENT;
            goto out;
        }
    }
    /* the definitions, never a canonical PLT entry (which would jump back to us) */
    real_malloc = route_real[R_MALLOC];
    real_calloc = route_real[R_CALLOC];
    real_realloc = route_real[R_REALLOC];
    real_posix_memalign = route_real[R_POSIX_MEMALIGN];
    real_aligned_alloc = route_real[R_ALIGNED_ALLOC];
    real_memalign = route_real[R_MEMALIGN];
    real_valloc = route_real[R_VALLOC];
    real_pvalloc = route_real[R_PVALLOC];
    real_usable = route_real[R_USABLE];
    __atomic_store_n(&real_free, (void (*)(void *))route_real[R_FREE], __ATOMIC_RELEASE);
    real_dlsym = route_real[R_DLSYM];
    real_dlopen = route_real[R_DLOPEN];
    if (!routed) {
        if (unrouted_once)
            live_reset();
        H->started = now_ns();
        H->flags |= MU_TRACK_F_ENABLED;
        enabled = 1;
        __atomic_store_n(&routed, 1, __ATOMIC_RELAXED);
    }
    r = route_all();
    if (r < 0)
        unroute_all();
out:
    pthread_mutex_unlock(&route_lock);
    return mu_track_last_rc = r;
}

/* Put back every entry mu_track_route changed that still holds our value and stop
 * recording; the library stays loaded and its wrappers forward (a function pointer taken
 * while routed keeps working). Blocks allocated while routed and freed later are freed by
 * the real allocator directly; the table keeps their entries until the next route. 0 (also
 * when preloaded: the loader's interposition cannot be undone). */
EXPORT int mu_track_unroute(void)
{
    if (preloaded)
        return mu_track_last_rc = 0;
    pthread_mutex_lock(&route_lock);
    if (routed)
        unroute_all();
    pthread_mutex_unlock(&route_lock);
    return mu_track_last_rc = 0;
}

/* ---- setup --------------------------------------------------------------------------------------- */

static uint64_t parse_size(const char *s, uint64_t dflt)
{
    if (!s || !*s)
        return dflt;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    switch (*end) {
    case 'k': case 'K': v <<= 10; break;
    case 'm': case 'M': v <<= 20; break;
    case 'g': case 'G': v <<= 30; break;
    default: break;
    }
    return v ? v : dflt;
}

static int find_self(struct dl_phdr_info *info, size_t size, void *arg)
{
    (void)size;
    uintptr_t me = (uintptr_t)arg;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_LOAD || !(ph->p_flags & PF_X))
            continue;
        uintptr_t lo = info->dlpi_addr + ph->p_vaddr, hi = lo + ph->p_memsz;
        if (me >= lo && me < hi) {
            self_lo = lo;
            self_hi = hi;
            return 1;
        }
    }
    return 0;
}

/* Strip our library from LD_PRELOAD, so that programs exec'd from here run untracked. */
static void strip_preload(void)
{
    Dl_info di;
    const char *pre = getenv("LD_PRELOAD");
    if (!pre || !dladdr((void *)strip_preload, &di) || !di.dli_fname)
        return;
    char buf[4096];
    size_t used = 0;
    const char *p = pre;
    while (*p) {
        size_t len = strcspn(p, ": ");
        if (len && !(len == strlen(di.dli_fname) && !memcmp(p, di.dli_fname, len)) &&
            used + len + 2 < sizeof buf) {
            if (used)
                buf[used++] = ':';
            memcpy(buf + used, p, len);
            used += len;
        }
        p += len;
        while (*p == ':' || *p == ' ')
            p++;
    }
    buf[used] = 0;
    if (used)
        setenv("LD_PRELOAD", buf, 1);
    else
        unsetenv("LD_PRELOAD");
}

static int exit_w = -1, exit_r = -1;
static pid_t exit_pid;
static uintptr_t exit_lo, exit_hi;      /* libc's exit(): [address, + st_size) */
static uintptr_t (*unwind_getcfa_p)(void *);

static void setup_exit_check(void)
{
    const char *fds = getenv("MEMUNREACHABLE_EXIT_FDS");
    const char *parent = getenv("MEMUNREACHABLE_EXIT_PARENT");
    if (!fds || !parent || (pid_t)strtol(parent, NULL, 10) != getppid())
        return;
    char *end;
    exit_w = (int)strtol(fds, &end, 10);
    exit_r = *end == ',' ? (int)strtol(end + 1, NULL, 10) : -1;
    exit_pid = getpid();
    /* what exit_frames() needs, resolved now: nothing is loaded at exit */
    Dl_info di;
    const ElfW(Sym) *sym = NULL;
    void (*ex)(int) = exit;
    if (dladdr1((void *)ex, &di, (void **)&sym, RTLD_DL_SYMENT) && sym && sym->st_size) {
        exit_lo = (uintptr_t)di.dli_saddr;
        exit_hi = exit_lo + sym->st_size;
    }
    void *h = dlopen("libgcc_s.so.1", RTLD_NOW | RTLD_LOCAL);
    if (h) {
        if (!unwind_backtrace_p || !unwind_getip_p) {
            unwind_backtrace_p = dlsym(h, "_Unwind_Backtrace");
            unwind_getip_p = dlsym(h, "_Unwind_GetIP");
        }
        unwind_getcfa_p = dlsym(h, "_Unwind_GetCFA");
    }
}

struct exit_walk { uintptr_t cfa; int n; };

static urc_t exit_cb(void *ctx, void *arg)
{
    struct exit_walk *w = arg;
    uintptr_t ip = unwind_getip_p(ctx);
    if (!ip || ++w->n > 64)
        return URC_END_OF_STACK;
    if (ip - 1 >= exit_lo && ip - 1 < exit_hi) {
        w->cfa = unwind_getcfa_p(ctx);      /* exit()'s frame ends here: its caller's begins */
        return URC_END_OF_STACK;
    }
    return URC_NO_REASON;
}

/* The top of exit()'s frame on this thread's stack (its caller's SP at the call), or 0
 * when exit() is not on the stack or cannot be found. Issue 23: below it lie only the
 * frames of exit() itself, __run_exit_handlers, _dl_fini and this destructor, and their
 * unwritten slots keep what main's callees left there: a C++ program's leaked vector was
 * held by such a word (SP+0x108, __run_exit_handlers' frame; SP+0xc8, _dl_fini's) in about
 * half the runs, in every run under `setarch -R`. */
static uintptr_t exit_frames_top(void)
{
    if (!exit_lo || !unwind_backtrace_p || !unwind_getip_p || !unwind_getcfa_p)
        return 0;
    struct exit_walk w = {0, 0};
    unwind_backtrace_p(exit_cb, &w);
    return w.cfa;
}

/* The table (sized by MEMUNREACHABLE_TRACK_BUDGET), the unwinder and the Python layout; the
 * header is published (magic) with recording flagged on. Called once, with guard set: by the
 * constructor when preloaded, by the first mu_track_route otherwise (which registered the
 * fork handlers before). 0 or -errno. */
static int setup_table(void)
{
    uint64_t budget = parse_size(getenv("MEMUNREACHABLE_TRACK_BUDGET"), 64ULL << 20);
    if (budget < (1ULL << 20))
        budget = 1ULL << 20;
    budget = (budget + 4095) & ~4095ULL;
    const char *d = getenv("MEMUNREACHABLE_STACK_DEPTH");
    if (d && *d) {
        long v = strtol(d, NULL, 10);
        depth = v < 1 ? 1 : v > (long)MU_TRACK_MAX_DEPTH ? MU_TRACK_MAX_DEPTH : (unsigned)v;
    }
    /* a PROT_NONE page on each side: the table is a mapping of its own (never merged with
     * a neighbour), so the checker finds the header at the start of a mapping */
    char *g = mmap(NULL, budget + 8192, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (g == MAP_FAILED)
        return -errno;
    void *m = g + 4096;
    if (mprotect(m, budget, PROT_READ | PROT_WRITE) != 0) {
        int e = -errno;
        munmap(g, budget + 8192);
        return e;
    }
    prctl(PR_SET_VMA, PR_SET_VMA_ANON_NAME, (unsigned long)m, budget,
          (unsigned long)MU_TRACK_MAP_NAME);
    base = m;
    struct mu_track_header *h = m;
    h->version = MU_TRACK_VERSION;
    h->header_size = sizeof *h;
    h->self = (uint64_t)(uintptr_t)m;
    h->map_size = budget;
    h->budget = budget;
    h->max_depth = depth;
    h->max_py = MU_TRACK_MAX_PY;
    h->nshards = MU_TRACK_NSHARDS;
    h->shards_off = MU_TRACK_HEADER_BYTES;
    uint64_t off = h->shards_off + MU_TRACK_NSHARDS * sizeof(struct mu_track_shard);
    uint64_t cap = 1;
    while (cap * 8 * 2 <= budget / 32)     /* index: at most 1/32 of the budget */
        cap <<= 1;
    h->sindex_off = off;
    h->sindex_cap = cap;
    off += cap * 8;
    uint64_t rest = budget - off;
    h->stack_arena_off = off;
    h->stack_arena_size = (rest / 4) & ~7ULL;      /* the rest: live-block tables */
    h->stack_arena_used = 8;              /* stack id 0 is never handed out */
    h->live_arena_off = (off + h->stack_arena_size + 4095) & ~4095ULL;
    h->live_arena_size = budget - h->live_arena_off;
    h->pid = (uint64_t)getpid();
    h->started = now_ns();
    shards = (struct mu_track_shard *)((char *)m + h->shards_off);
    sindex = (uint64_t *)((char *)m + h->sindex_off);
    sindex_mask = cap - 1;
    H = h;
    unwinder = (unsigned)setup_unwinder(getenv("MEMUNREACHABLE_UNWINDER"));
    if (!unwinder)
        unwinder = (unsigned)setup_unwinder(NULL);
    h->unwinder = unwinder;
    setup_python();
    dl_iterate_phdr(find_self, (void *)(uintptr_t)mu_track_init);
    void *warm[4];
    capture(warm, 4);                     /* lazy unwinder setup happens here, untracked */
    h->flags |= MU_TRACK_F_ENABLED;
    __atomic_store_n((uint64_t *)h->magic, *(const uint64_t *)MU_TRACK_MAGIC, __ATOMIC_RELEASE);
    return 0;
}

/* Preloaded (`run`), the loader made our exports the program's malloc family: record from
 * here on. Loaded by dlopen (RTLD_LOCAL: track_here.py, an injector), nothing calls us yet:
 * change nothing until mu_track_route. The test is the property itself: the global scope
 * binds "malloc" to ours only when we were loaded ahead of libc, i.e. preloaded (a path
 * in LD_PRELOAD may be spelled differently, stripped, or name a copy; "before main" is
 * also true of a dlopen from another preloaded library's constructor). definition() looks
 * through a non-PIE program's canonical PLT entry (Debian's python3 under `run`). A program
 * or earlier preload defining malloc itself wins the lookup: our wrappers are never called
 * then, and staying inert is right. */
__attribute__((constructor(101))) static void mu_track_init(void)
{
    if (definition("malloc", dlsym(RTLD_DEFAULT, "malloc")) != (void *)mu_w_malloc) {
        resolve_scope = RTLD_DEFAULT;
        return;
    }
    preloaded = 1;
    resolve();
    guard = 1;
    const char *nf = getenv("MEMUNREACHABLE_NO_FOLLOW_FORK");
    no_follow_fork = nf && *nf && strcmp(nf, "0");
    if (setup_table() == 0) {
        pthread_atfork(fork_prepare, fork_parent, fork_child);
        if (no_follow_fork)
            strip_preload();
        setup_exit_check();
        enabled = 1;
    }
    guard = 0;
}

/* --check-at-exit: the last destructor to run asks `run` to check this process while it
 * waits (blocked in read(): no thread of ours is inside the allocator). The request says
 * which stack range holds only the exit path's frames: [below this frame, exit()'s top),
 * "X" then u64 tid, low, high (all 0 when exit() was not found: the whole stack is
 * scanned). */
__attribute__((destructor(101))) static void mu_track_fini(void)
{
    if (exit_w < 0 || getpid() != exit_pid)
        return;
    guard = 1;              /* the unwinder may allocate: no new table entries now */
    uint64_t req[4] = {0, 0, 0, 0};
    uintptr_t top = exit_frames_top();
    uintptr_t here = (uintptr_t)__builtin_frame_address(0);
    if (top > here) {
        req[1] = (uint64_t)syscall(SYS_gettid);
        req[2] = here - 4096;                     /* the dead stack below too: no roots */
        req[3] = top;
    }
    char msg[1 + 3 * 8];
    msg[0] = 'X';
    memcpy(msg + 1, req + 1, 3 * 8);
    char c;
    if (write(exit_w, msg, sizeof msg) == (ssize_t)sizeof msg) {
        while (read(exit_r, &c, 1) < 0 && errno == EINTR)
            ;
    }
    close(exit_w);
    close(exit_r);
    exit_w = exit_r = -1;
    guard = 0;
}
