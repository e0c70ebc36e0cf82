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
} mu_inject;

/* Make stopped thread tid run clone(flags=0) at the `syscall` instruction syscall_insn.
 * Options TRACECLONE|TRACEFORK|TRACESYSGOOD|EXITKILL while the clone runs (the child
 * inherits EXITKILL), TRACECLONE again once the child reported its birth stop.
 * The child is left stopped at birth, parked on exit_group(0) (rip = syscall_insn).
 * Returns 0 when the sequence ran (the clone itself may have failed: out->ret < 0, e.g.
 * -EPERM from a seccomp filter, -EAGAIN, -ENOMEM), or -errno when a ptrace step failed
 * (-ESRCH: tid died, -ETIMEDOUT: a stop did not come before the deadline); out->child
 * then names a child that the caller must kill and reap. */
int mu_inject_clone(int tid, uint64_t syscall_insn, int64_t timeout_ms, mu_inject *out);

/* Make stopped thread tid run wait4(child, NULL, __WALL|WNOHANG, NULL) at syscall_insn:
 * reaps a zombie child of tid's process. Same contract as mu_inject_clone; out->ret is
 * the reaped pid, 0 (child not a zombie yet) or -errno (-ECHILD: not our child). */
int mu_inject_wait4(int tid, uint64_t syscall_insn, int child, int64_t timeout_ms, mu_inject *out);

/* Wait up to timeout_ms for a status change of tid (waitpid(tid, __WALL)); never reaps
 * anything else. Returns 1 and sets *status, 0 on timeout, or -errno (-ECHILD). */
int mu_wait_tid(int tid, int64_t timeout_ms, int *status);

/* tgkill(tgid, tid, sig). Returns 0 or -errno. */
int mu_tgkill(int tgid, int tid, int sig);
