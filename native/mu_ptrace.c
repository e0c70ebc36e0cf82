/* mu_ptrace.c: ptrace sequences that must not be interrupted (ptrace-snapshot.md sections 5-8).
 *
 * One C call per injection keeps the windows of section 8 short: between SETREGS(injected)
 * and the syscall-enter-stop, and while the target thread carries EXITKILL.
 * References: ptrace(2); kernel kernel/ptrace.c, kernel/fork.c (kernel_clone: exit_signal
 * != SIGCHLD -> PTRACE_EVENT_CLONE), arch/x86/kernel/signal.c (syscall restart codes). */
#include "mu_core_impl.h"

#include <signal.h>
#include <sched.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/user.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define NR_WAIT4 61
#define NR_CLONE 56
#define NR_EXIT_GROUP 231
#define NR_RESTART_SYSCALL 219
#define ERESTARTSYS 512
#define ERESTARTNOINTR 513
#define ERESTARTNOHAND 514
#define ERESTART_RESTARTBLOCK 516
#define MU_WALL 0x40000000          /* __WALL */
#define CLONE_RETRIES 3

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Wait for tid until deadline_ns. Returns 1 (status set), 0 on timeout, or -errno. */
static int wait_until(int tid, int64_t deadline_ns, int *status)
{
    int spins = 0;
    for (;;) {
        pid_t r = waitpid(tid, status, MU_WALL | WNOHANG);
        if (r == tid)
            return 1;
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (now_ns() >= deadline_ns)
            return 0;
        if (spins++ < 200) {
            sched_yield();
        } else {
            struct timespec ts = {0, 20000};
            nanosleep(&ts, NULL);
        }
    }
}

int mu_wait_tid(int tid, int64_t timeout_ms, int *status)
{
    return wait_until(tid, now_ns() + timeout_ms * 1000000, status);
}

int mu_tgkill(int tgid, int tid, int sig)
{
    return syscall(SYS_tgkill, tgid, tid, sig) < 0 ? -errno : 0;
}

static void record_signal(mu_inject *out, int sig)
{
    if (out->nsignals < MU_MAX_SIGNALS)
        out->signals[out->nsignals++] = sig;
}

enum { K_SYSCALL, K_CLONE, K_EVENT, K_SIGNAL, K_GONE };

static int kind_of(int status)
{
    if (!WIFSTOPPED(status))
        return K_GONE;
    if (WSTOPSIG(status) == (SIGTRAP | 0x80))
        return K_SYSCALL;
    if ((status >> 16) == PTRACE_EVENT_CLONE)
        return K_CLONE;
    if ((status >> 16) != 0)
        return K_EVENT;         /* PTRACE_EVENT_STOP (interrupt, group-stop) and others */
    return K_SIGNAL;
}

/* Resume tid with PTRACE_SYSCALL until a syscall stop or a clone event. Signal-delivery-stops
 * are recorded and suppressed (the thread runs injected registers: a handler must not run
 * now); other event stops are passed over. Returns the kind (K_SYSCALL/K_CLONE) or -errno. */
static int resume_until_syscall(int tid, int64_t deadline, mu_inject *out)
{
    for (;;) {
        int status = 0, rc;
        if (ptrace(PTRACE_SYSCALL, tid, 0, 0) < 0)
            return -errno;
        rc = wait_until(tid, deadline, &status);
        if (rc < 0)
            return rc;
        if (rc == 0)
            return -ETIMEDOUT;
        switch (kind_of(status)) {
        case K_SYSCALL:
            return K_SYSCALL;
        case K_CLONE:
            return K_CLONE;
        case K_SIGNAL:
            record_signal(out, WSTOPSIG(status));
            break;
        case K_EVENT:
            break;
        default:
            return -ESRCH;
        }
    }
}

/* The registers that resume the thread as if nothing was injected (section 6). */
static struct user_regs_struct restored_regs(const struct user_regs_struct *saved)
{
    struct user_regs_struct r = *saved;
    if ((int64_t)saved->orig_rax >= 0) {
        switch ((int64_t)saved->rax) {
        case -ERESTARTSYS:
        case -ERESTARTNOINTR:
        case -ERESTARTNOHAND:
            r.rip = saved->rip - 2;
            r.rax = saved->orig_rax;
            break;
        case -ERESTART_RESTARTBLOCK:
            r.rip = saved->rip - 2;
            r.rax = NR_RESTART_SYSCALL;
            break;
        default:
            break;
        }
    }
    r.orig_rax = (uint64_t)-1;
    return r;
}

/* After a failure while tid may be running: stop it again (interrupt), best effort. */
static int restop(int tid, int64_t deadline)
{
    int status = 0, rc;
    if (ptrace(PTRACE_INTERRUPT, tid, 0, 0) < 0)
        return -errno;
    for (;;) {
        rc = wait_until(tid, deadline, &status);
        if (rc <= 0)
            return rc < 0 ? rc : -ETIMEDOUT;
        if (!WIFSTOPPED(status))
            return -ESRCH;
        return 0;
    }
}

static int inject(int tid, uint64_t insn, uint64_t nr, const uint64_t args[6], int is_clone,
                  int64_t timeout_ms, mu_inject *out)
{
    struct user_regs_struct saved, regs;
    int64_t deadline = now_ns() + timeout_ms * 1000000;
    long opts = PTRACE_O_TRACECLONE | PTRACE_O_TRACESYSGOOD;
    int rc = 0, kind, attempt, running = 0;

    memset(out, 0, sizeof *out);
    if (ptrace(PTRACE_GETREGS, tid, 0, &saved) < 0)
        return -errno;
    /* EXITKILL from before the injected registers are set until the clone event: the child
     * inherits it at birth, so it can never run untraced as a duplicate of the target; if
     * the tracer dies between SETREGS and the syscall entry, the target is killed rather
     * than left running the clone untraced from corrupted registers (section 8) */
    if (is_clone)
        opts |= PTRACE_O_TRACEFORK | PTRACE_O_EXITKILL;
    if (ptrace(PTRACE_SETOPTIONS, tid, 0, opts) < 0)
        return -errno;
    out->step = MU_STEP_OPTIONS;

    for (attempt = 0; attempt < CLONE_RETRIES; attempt++) {
        regs = saved;
        regs.rip = insn;
        regs.rax = nr;
        regs.rdi = args[0];
        regs.rsi = args[1];
        regs.rdx = args[2];
        regs.r10 = args[3];
        regs.r8 = args[4];
        regs.r9 = args[5];
        regs.orig_rax = (uint64_t)-1;       /* no kernel restart on the way out */
        if (ptrace(PTRACE_SETREGS, tid, 0, &regs) < 0) {
            rc = -errno;
            goto restore;
        }
        out->step = MU_STEP_SETREGS;
        running = 1;
        kind = resume_until_syscall(tid, deadline, out);
        if (kind < 0) {
            rc = kind;
            goto restore;
        }
        running = 0;
        if (kind != K_SYSCALL) {
            rc = -EPROTO;                   /* a clone event before the syscall entry */
            goto restore;
        }
        out->step = MU_STEP_ENTER;
        for (;;) {
            running = 1;
            kind = resume_until_syscall(tid, deadline, out);
            if (kind < 0) {
                rc = kind;
                goto restore;
            }
            running = 0;
            if (kind == K_SYSCALL)
                break;
            /* K_CLONE: the child is auto-attached; wait for its own birth stop too */
            if (is_clone && out->child == 0) {
                unsigned long msg = 0;
                int status = 0, w;
                /* EXITKILL stays on in the child only: drop it from the target thread
                 * at once, before waiting for the child's birth stop */
                if (ptrace(PTRACE_SETOPTIONS, tid, 0,
                           PTRACE_O_TRACECLONE | PTRACE_O_TRACESYSGOOD) < 0) {
                    rc = -errno;
                    goto restore;
                }
                if (ptrace(PTRACE_GETEVENTMSG, tid, 0, &msg) < 0) {
                    rc = -errno;
                    goto restore;
                }
                out->child = (int32_t)msg;
                out->step = MU_STEP_EVENT;
                w = wait_until(out->child, deadline, &status);
                if (w <= 0) {
                    rc = w < 0 ? w : -ETIMEDOUT;
                    goto restore;
                }
            }
        }
        out->step = MU_STEP_EXIT;
        if (ptrace(PTRACE_GETREGS, tid, 0, &regs) < 0) {
            rc = -errno;
            goto restore;
        }
        out->ret = (int64_t)regs.rax;
        /* clone answers -ERESTARTNOINTR when a signal arrived meanwhile: run it again */
        if (!(is_clone && out->ret == -ERESTARTNOINTR))
            break;
    }

restore:
    if (running && rc != -ESRCH) {
        if (restop(tid, now_ns() + 1000000000LL) < 0)
            return rc;
    }
    if (rc == -ESRCH)
        return rc;
    regs = restored_regs(&saved);
    if (ptrace(PTRACE_SETREGS, tid, 0, &regs) < 0)
        return rc ? rc : -errno;
    if (ptrace(PTRACE_SETOPTIONS, tid, 0, PTRACE_O_TRACECLONE) < 0)
        return rc ? rc : -errno;
    out->restored = 1;
    if (rc == 0)
        out->step = MU_STEP_RESTORED;
    if (rc == 0 && out->child > 0) {
        struct user_regs_struct c;
        if (ptrace(PTRACE_GETREGS, out->child, 0, &c) < 0)
            return -errno;
        c.rip = insn;
        c.rax = NR_EXIT_GROUP;
        c.rdi = 0;
        c.orig_rax = (uint64_t)-1;
        if (ptrace(PTRACE_SETREGS, out->child, 0, &c) < 0)
            return -errno;
        out->step = MU_STEP_PARKED;
    }
    return rc;
}

int mu_inject_clone(int tid, uint64_t syscall_insn, int64_t timeout_ms, mu_inject *out)
{
    const uint64_t args[6] = {0, 0, 0, 0, 0, 0};   /* flags 0: no sharing, exit_signal 0 */
    return inject(tid, syscall_insn, NR_CLONE, args, 1, timeout_ms, out);
}

int mu_inject_wait4(int tid, uint64_t syscall_insn, int child, int64_t timeout_ms, mu_inject *out)
{
    const uint64_t args[6] = {(uint64_t)(int64_t)child, 0, MU_WALL | WNOHANG, 0, 0, 0};
    return inject(tid, syscall_insn, NR_WAIT4, args, 0, timeout_ms, out);
}
