/* mu_ptrace.h: ptrace sequences that must not be interrupted (inject clone, reap).
 *
 * Each call runs on the thread that seized `tid` (ptrace requests only work from the
 * tracer thread), with `tid` already in a ptrace-stop. The injected syscall is driven with
 * PTRACE_SYSCALL (never single-step, ptrace-snapshot.md section 8); on return tid's registers
 * are restored with the syscall-restart emulation of section 6, and tid stays stopped with
 * options PTRACE_O_TRACECLONE. Every wait has a deadline (timeout_ms). */

/* mu_inject.step: the last step reached (for error messages). */
#define MU_STEP_START 0
#define MU_STEP_OPTIONS 1
#define MU_STEP_SETREGS 2
#define MU_STEP_ENTER 3
#define MU_STEP_EVENT 4
#define MU_STEP_EXIT 5
#define MU_STEP_RESTORED 6
#define MU_STEP_PARKED 7
#define MU_MAX_SIGNALS 8

typedef struct {
    int64_t ret;          /* the injected syscall's return (rax at its syscall-exit-stop) */
    int32_t child;        /* clone: pid of the new child, stopped and parked; 0 when none */
    int32_t step;         /* MU_STEP_*: last step reached */
    int32_t restored;     /* 1 when tid's registers and options are back to the saved state */
    int32_t nsignals;     /* signals met at signal-delivery-stops while driving tid; they were */
    int32_t signals[8];   /* suppressed, and the caller must re-deliver them after the detach */
    int64_t t_ns[8];      /* CLOCK_MONOTONIC when each MU_STEP_* was reached (0: not reached) */
    int32_t guarded;      /* 1 when the sigreturn guard was written (restore_rt given, room on
                           * tid's stack): a tracer death cannot harm the target */
    int32_t pad;
} mu_inject;

/* Make stopped thread tid run clone(flags=0) at the `syscall` instruction syscall_insn.
 * restore_rt: 0, or the address of an rt_sigreturn stub (`mov $15, %rax; syscall`) in the
 * target, with syscall_insn the start of a `syscall; ret` pair (0f 05 c3): then the guard
 * (mu_ptrace.c) is written on tid's stack first and a tracer that dies at any step leaves
 * the target running as frozen (out->guarded; the legacy sequence when it does not fit).
 * Options TRACECLONE|TRACEFORK|TRACESYSGOOD while the clone runs, plus EXITKILL unguarded
 * (the child inherits it) or on the child alone once born (guarded); TRACECLONE again after.
 * frozen_regs: NULL, or tid's 27 registers as the freeze captured them (user_regs_struct):
 * when an earlier injection of the same freeze restored tid, the new one starts again from
 * them (the guard's frame issues an interrupted sleep again rather than restart_syscall).
 * The child is left stopped at birth, parked on exit_group(0) (rip = syscall_insn).
 * Returns 0 when the sequence ran (the clone itself may have failed: out->ret < 0, e.g.
 * -EPERM from a seccomp filter, -EAGAIN, -ENOMEM), or -errno when a ptrace step failed
 * (-ESRCH: tid died, -ETIMEDOUT: a stop did not come before the deadline); out->child
 * then names a child that the caller must kill and reap. */
int mu_inject_clone(int tid, uint64_t syscall_insn, uint64_t restore_rt,
                    const uint64_t *frozen_regs, int64_t timeout_ms, mu_inject *out);

/* Make stopped thread tid run wait4(child, NULL, __WALL|WNOHANG, NULL) at syscall_insn:
 * reaps a zombie child of tid's process. Same contract (and guard) as mu_inject_clone;
 * out->ret is the reaped pid, 0 (child not a zombie yet) or -errno (-ECHILD: not our child). */
int mu_inject_wait4(int tid, uint64_t syscall_insn, uint64_t restore_rt,
                    const uint64_t *frozen_regs, int child, int64_t timeout_ms, mu_inject *out);

/* Make stopped thread tid call func(args[0..5]) (rdi = the copy of data instead, when
 * data_len > 0: data is copied onto tid's stack below its red zone) and return: the guard's
 * frame is written first (restore_rt required: the rt_sigreturn stub), and it is the
 * function's return address, so that a tracer that dies at any step leaves tid resuming as
 * frozen once the function returns. The function's return value is lost (the stub loads
 * rax): the callee leaves its result in memory. Signals met meanwhile are suppressed and
 * listed in out (re-deliver them); a fault (SIGSEGV, SIGBUS, SIGILL, SIGFPE) ends the call
 * through the frame: -EFAULT. Steps: MU_STEP_SETREGS the call started, MU_STEP_ENTER it
 * returned, MU_STEP_EXIT the frame's rt_sigreturn ran, MU_STEP_RESTORED.
 * Returns 0 (out->restored: tid resumes as frozen, its FP/SIMD state and signal mask
 * restored by the frame; an interrupted sleep is issued again whole, as after the guard;
 * options PTRACE_O_TRACECLONE), -ETIMEDOUT (the call had not returned by timeout_ms: tid is
 * stopped inside it, out->restored 0; a detach lets it finish and resume through the
 * frame), -ESRCH (tid died), or another -errno (nothing was started: restored 1). */
#define MU_CALL_NR -2         /* mu_test_die_at's nr for mu_inject_call */
int mu_inject_call(int tid, uint64_t func, uint64_t restore_rt, const uint64_t *frozen_regs,
                   const uint64_t *args, const uint8_t *data, uint64_t data_len,
                   int64_t timeout_ms, mu_inject *out);

/* Tests only (fault injection): when an injection of syscall number nr (56 clone, 61 wait4,
 * MU_CALL_NR a function call)
 * reaches MU_STEP_* step, SIGKILL the calling process (child 0), or the clone's new child
 * (child 1, once: the hook then turns itself off); nr -1 turns it off. */
void mu_test_die_at(int64_t nr, int step, int child);

/* Wait up to timeout_ms for a status change of tid (waitpid(tid, __WALL)); never reaps
 * anything else. Returns 1 and sets *status, 0 on timeout, or -errno (-ECHILD). */
int mu_wait_tid(int tid, int64_t timeout_ms, int *status);

/* tgkill(tgid, tid, sig). Returns 0 or -errno. */
int mu_tgkill(int tgid, int tid, int sig);

/* ---- freeze and thaw of a whole thread group in one call (issue 10: the pause) ----
 * mu_thread.state: */
#define MU_T_NEW 0            /* listed, not seized yet */
#define MU_T_SKIP 1           /* never seized (a zombie leader: it never stops) */
#define MU_T_SEIZED 2         /* seized and interrupted; its stop not collected yet */
#define MU_T_STOPPED 3        /* in a ptrace-stop (status), registers captured */
#define MU_T_GONE 4           /* exited (SEIZE/INTERRUPT/GETREGS answered ESRCH, or waitpid) */
#define MU_T_SEIZE_FAILED 5   /* PTRACE_SEIZE failed with err (not ESRCH): the caller decides */
#define MU_T_CAPTURE_FAILED 6 /* stopped (status), but reading its registers failed with err */
#define MU_T_DETACHED 7       /* mu_thaw detached it */
#define MU_T_DETACH_FAILED 8  /* mu_thaw: PTRACE_DETACH failed with err (not in a stop) */
/* mu_freeze_args.flags: */
#define MU_FREEZE_NO_RELIST 1 /* seize only the given threads (no /proc/PID/task listing) */
/* mu_freeze_args.result: */
#define MU_FREEZE_DONE 0      /* every thread is STOPPED, GONE, SKIP; a listing found no new one */
#define MU_FREEZE_WAITING 1   /* wait_ms ran out with threads still SEIZED */
#define MU_FREEZE_OVERFLOW 2  /* a new thread did not fit in cap records */
#define MU_FREEZE_FAILED 3    /* a SEIZE_FAILED or CAPTURE_FAILED record needs the caller */
#define MU_FREEZE_HOOK 4      /* on_attach returned non-zero: stopped after that thread */
#define MU_FREEZE_LISTING 5   /* listing /proc/PID/task failed (list_err): the caller lists */
#define MU_NREGS 27

typedef struct {
    int32_t tid;
    int32_t state;        /* MU_T_* */
    int32_t status;       /* waitpid status of its stop (STOPPED, CAPTURE_FAILED) */
    int32_t err;          /* errno of the failed step (SEIZE_FAILED, CAPTURE_FAILED, DETACH_FAILED) */
    int32_t sig;          /* signal re-delivered by mu_thaw (set for a signal-delivery-stop) */
    int32_t fplen;        /* bytes of FP/SIMD state at fp + index * fp_stride */
    uint64_t event_msg;   /* PTRACE_EVENT_CLONE stop: the new thread's tid */
    uint64_t regs[27];    /* user_regs_struct */
} mu_thread;

typedef int (*mu_attach_fn)(int tid);

typedef struct {
    int32_t pid;
    int32_t flags;        /* MU_FREEZE_* */
    int32_t cap;          /* records available in threads[] */
    int32_t n;            /* in: records already filled (NEW or SKIP); out: records in use */
    int64_t wait_ms;      /* how long to wait for stops before returning MU_FREEZE_WAITING */
    int32_t task_fd;      /* open /proc/PID/task directory (listing), -1 with NO_RELIST */
    int32_t maps_fd;      /* open /proc/PID/maps, read once every thread stopped; -1: not read */
    uint8_t *maps_buf;    /* where the maps text goes */
    int64_t maps_cap;
    const uint8_t *maps_before; /* the text read before the freeze, compared with the new one */
    int64_t maps_before_len;
    uint8_t *fp;          /* FP/SIMD areas, fp_stride bytes per record */
    int64_t fp_stride;
    mu_attach_fn on_attach; /* NULL, or called between each SEIZE and INTERRUPT (tests) */
    int32_t *order;       /* NULL, or cap entries: out, the indexes of the STOPPED records */
    int32_t norder;       /* out: how many, in tid order */
    int32_t candidate;    /* out: index of the first (tid order) record at an interrupt stop
                           * inside a syscall (orig_rax >= 0) whose two bytes before rip are a
                           * `syscall` instruction (0f 05): where an injection can run; -1 */
    /* out */
    int32_t result;       /* MU_FREEZE_* */
    int32_t list_err;     /* errno of a failed listing (MU_FREEZE_LISTING) */
    int32_t passes;       /* listings of /proc/PID/task */
    int64_t maps_len;     /* bytes of maps text read while stopped, or -errno; maps_cap: too long */
    int32_t maps_changed; /* 1 when that text differs from maps_before */
    int32_t stopped;      /* records STOPPED */
    int64_t t_seize_ns;   /* CLOCK_MONOTONIC at the first PTRACE_SEIZE */
    int64_t t_interrupted_ns; /* CLOCK_MONOTONIC once the last INTERRUPTs were sent */
    int64_t t_stopped_ns; /* CLOCK_MONOTONIC when the last stop was collected */
    int64_t t_maps_ns;    /* CLOCK_MONOTONIC once the maps were read again */
    int32_t rounds;       /* waitpid rounds over the seized threads */
} mu_freeze_args;

/* Seize (PTRACE_O_TRACECLONE) and interrupt every NEW record, then every thread of
 * /proc/PID/task not in the records (until a listing finds none), collect their stops with
 * waitpid(tid, __WALL|WNOHANG) (a PTRACE_EVENT_CLONE stop adds the new thread, which the
 * kernel attached), and read each stopped thread's registers: GETREGS, then
 * GETREGSET(NT_X86_XSTATE) into its fp slot (GETFPREGS when the kernel refuses it). Then,
 * once every thread stopped (MU_FREEZE_DONE), reads maps_fd into maps_buf and compares it
 * with maps_before. Policy stays with the caller: it looks at a->result and the records
 * (SEIZE_FAILED, CAPTURE_FAILED, SEIZED stragglers) and continues from there.
 * Returns a->n (records in use) or -errno for bad arguments. Never blocks past wait_ms. */
int mu_freeze(mu_thread *threads, mu_freeze_args *a);   /* after any seize: always a->n */

/* PTRACE_DETACH every STOPPED record with its sig: DETACHED, or DETACH_FAILED with err.
 * Returns how many were detached. */
int mu_thaw(mu_thread *threads, int n);

/* Bytes of the largest XSAVE area this CPU can use (CPUID 0xD.0 ECX), 512 without XSAVE. */
int mu_xstate_size(void);

/* ptrace(request, tid, addr, data) for the Python state machine (no python-ptrace on the
 * check's path). Returns the call's result (>= 0; not for PEEK requests) or -errno. */
int64_t mu_ptrace(int64_t request, int tid, uint64_t addr, uint64_t data);

/* The 8-byte word at addr of stopped tracee tid (PTRACE_PEEKDATA): 0 and *word, or -errno. */
int mu_peek(int tid, uint64_t addr, uint64_t *word);
