/* mu_ptrace.c: ptrace sequences that must not be interrupted (ptrace-snapshot.md sections 5-8).
 *
 * The guard (docs/how-it-works.md, "Tracer death"): before an injection, two sigreturn
 * frames are written below the thread's red zone, and the syscall runs at a `syscall; ret`
 * instruction pair with rsp at the first frame. If the tracer dies at any moment, the thread
 * finishes the syscall, returns into rt_sigreturn and resumes exactly where it was frozen;
 * a clone child (its rsp is clone's stack argument: the second frame) returns into a
 * sigreturn that runs exit_group(0). Nothing else is left in the target than the frames'
 * bytes in its dead stack (as a signal leaves), and, at worst, a zombie that the next check
 * reaps. Without the gadgets (or with a shadow stack) the legacy windows of section 8 stay.
 * References: ptrace(2); kernel kernel/ptrace.c, kernel/fork.c (kernel_clone: exit_signal
 * != SIGCHLD -> PTRACE_EVENT_CLONE), arch/x86/kernel/signal.c (syscall restart codes,
 * rt_sigreturn), arch/x86/kernel/fpu/signal.c (the xstate frame), kernel/signal.c
 * (restore_altstack ignores every error but EFAULT). */
#include "mu_core_impl.h"
#include <cpuid.h>

#include <signal.h>
#include <sched.h>
#include <sys/ptrace.h>
#include <stddef.h>
#include <sys/syscall.h>
#include <sys/uio.h>
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
#ifndef PTRACE_GETSIGMASK
#define PTRACE_GETSIGMASK 0x420a
#endif
#ifndef NT_X86_XSTATE
#define NT_X86_XSTATE 0x202
#endif

/* fault injection for the tests (mu_test_die_at): when an injection of syscall g_die_nr
 * reaches step g_die_step, SIGKILL the tracer itself, or (g_die_child) the new child once */
static int64_t g_die_nr = -1;
static int g_die_step = -1, g_die_child;

void mu_test_die_at(int64_t nr, int step, int child)
{
    g_die_nr = nr;
    g_die_step = step;
    g_die_child = child;
}

static int64_t now_ns(void);

static void reached(mu_inject *out, uint64_t nr, int step)
{
    out->step = step;
    out->t_ns[step] = now_ns();
    if ((int64_t)nr != g_die_nr || step != g_die_step)
        return;
    if (!g_die_child) {
        kill(getpid(), SIGKILL);
    } else if (out->child > 0) {
        kill(out->child, SIGKILL);
        g_die_nr = -1;
    }
}

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

/* The registers that resume the thread as if nothing was injected (section 6). A frame for
 * rt_sigreturn (via_sigreturn) issues a syscall that would go through restart_syscall again
 * whole instead: sigreturn makes restart_syscall answer -EINTR, and a sleep that starts over
 * is allowed to last longer where an EINTR would be an error the program sees. */
static struct user_regs_struct restored_regs(const struct user_regs_struct *saved,
                                             int via_sigreturn)
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
            r.rax = via_sigreturn ? saved->orig_rax : NR_RESTART_SYSCALL;
            break;
        default:
            break;
        }
    }
    r.orig_rax = (uint64_t)-1;
    return r;
}

/* ---- the guard: sigreturn frames (see the top of this file) ---- */

#define UC_FP_XSTATE 0x1
#define UC_SIGCONTEXT_SS 0x2
#define UC_STRICT_RESTORE_SS 0x4
#define FP_XSTATE_MAGIC1 0x46505853U
#define FP_XSTATE_MAGIC2 0x46505845U
#define FX_SIZE 512
#define FX_SW_BYTES 464           /* fxregs_state.sw_reserved: struct _fpx_sw_bytes */
#define RED_ZONE 128
#define SS_KEEP 3                 /* not 0, SS_ONSTACK or SS_DISABLE: -EINVAL, which
                                   * restore_altstack ignores: the alternate stack stays */

typedef struct {                  /* the kernel's struct rt_sigframe, x86_64 */
    uint64_t pretcode;            /* where the gadget's `ret` goes: rt_sigreturn */
    uint64_t uc_flags, uc_link;
    uint64_t ss_sp;
    int32_t ss_flags, ss_pad;
    uint64_t ss_size;
    uint64_t gregs[18];           /* struct sigcontext: r8-r15 rdi rsi rbp rbx rdx rax rcx rsp
                                   * rip eflags */
    uint16_t cs, gs, fs, ss;
    uint64_t err, trapno, oldmask, cr2, fpstate, reserved[8];
    uint64_t sigmask;             /* uc_sigmask */
    uint8_t siginfo[128];
} mu_sigframe;

_Static_assert(offsetof(mu_sigframe, gregs) == 48, "sigcontext at 8 + 40");
_Static_assert(offsetof(mu_sigframe, fpstate) == 232, "sigcontext.fpstate");
_Static_assert(offsetof(mu_sigframe, sigmask) == 304, "uc_sigmask");
_Static_assert(sizeof(mu_sigframe) == 440, "rt_sigframe");

#define XFEATURE_XTILE_DATA (1ull << 18)

/* The end of the standard-format XSAVE image holding the features of xcr0: the highest
 * offset + size that CPUID leaf 0xd gives for them (at least the legacy area and header). */
static uint32_t xstate_end(uint64_t xcr0)
{
    uint32_t end = FX_SIZE + 64;
    for (unsigned i = 2; i < 64; i++) {
        unsigned a, b, c, d;
        if (!(xcr0 >> i & 1))
            continue;
        __cpuid_count(0xd, i, a, b, c, d);
        if (a && b + a > end)
            end = b + a;
    }
    return end;
}

static void frame_regs(mu_sigframe *f, const struct user_regs_struct *r)
{
    const uint64_t g[18] = {r->r8, r->r9, r->r10, r->r11, r->r12, r->r13, r->r14, r->r15,
                            r->rdi, r->rsi, r->rbp, r->rbx, r->rdx, r->rax, r->rcx, r->rsp,
                            r->rip, r->eflags};
    memcpy(f->gregs, g, sizeof g);
    f->cs = (uint16_t)r->cs;
    f->ss = (uint16_t)r->ss;
    f->uc_flags |= UC_SIGCONTEXT_SS | UC_STRICT_RESTORE_SS;
    f->ss_flags = SS_KEEP;
}

/* Write the guard below top (tid's stack below its red zone, and below any data a call
 * passes there): at *psp the frame that resumes tid as frozen (its registers, signal mask
 * and FP/SIMD state), and for a clone at *csp the child's frame, which runs exit_group(0)
 * at insn with every signal blocked. Returns 0, or -errno (no room in the stack's mapping:
 * -EFAULT); nothing is written then, *psp and *csp untouched. */
static int write_guard(int tid, const struct user_regs_struct *saved, uint64_t insn,
                       uint64_t restore_rt, int is_clone, uint64_t top, uint64_t *psp,
                       uint64_t *csp)
{
    static int xcap;
    uint64_t sigmask = 0, fp_at, pf, cf;
    uint32_t xsize = FX_SIZE;
    uint8_t *xs, *buf;
    mu_sigframe *f;
    struct iovec iov, local, remote;
    struct user_regs_struct child;
    ssize_t done;
    int rc = 0;

    if (!xcap)
        xcap = mu_xstate_size();
    if (ptrace(PTRACE_GETSIGMASK, tid, sizeof sigmask, &sigmask) < 0)
        return -errno;
    xs = calloc(1, (size_t)xcap);           /* xcap >= FX_SIZE: GETFPREGS fits too */
    if (!xs)
        return -ENOMEM;
    iov.iov_base = xs;
    iov.iov_len = (size_t)xcap;
    if (ptrace(PTRACE_GETREGSET, tid, NT_X86_XSTATE, &iov) < 0) {
        if (ptrace(PTRACE_GETFPREGS, tid, 0, xs) < 0) {
            free(xs);
            return -errno;
        }
        iov.iov_len = FX_SIZE;
    }
    if (iov.iov_len > FX_SIZE + 64) {
        /* an XSAVE image: ptrace puts XCR0 in the first 8 bytes of sw_reserved; a signal
         * frame carries struct _fpx_sw_bytes there instead, and MAGIC2 after the image */
        uint64_t xcr0, bv;
        memcpy(&xcr0, xs + FX_SW_BYTES, 8);
        memcpy(&bv, xs + FX_SIZE, 8);           /* the XSAVE header's XSTATE_BV */
        /* the frame holds what the kernel's own signal frame would: not AMX's tile data
         * (a dynamic feature: a thread that never asked for it has a smaller user xstate,
         * and rt_sigreturn restores only the legacy part of a frame that claims more) */
        if (!(bv & XFEATURE_XTILE_DATA))
            xcr0 &= ~XFEATURE_XTILE_DATA;
        bv &= xcr0;
        memcpy(xs + FX_SIZE, &bv, 8);
        uint32_t size = xstate_end(xcr0);
        if (size > iov.iov_len)
            size = (uint32_t)iov.iov_len;
        if (xcr0 & 0x3) {
            const uint32_t magic1 = FP_XSTATE_MAGIC1, extended = size + 4;
            memset(xs + FX_SW_BYTES, 0, FX_SIZE - FX_SW_BYTES);
            memcpy(xs + FX_SW_BYTES, &magic1, 4);
            memcpy(xs + FX_SW_BYTES + 4, &extended, 4);
            memcpy(xs + FX_SW_BYTES + 8, &xcr0, 8);
            memcpy(xs + FX_SW_BYTES + 16, &size, 4);
            xsize = size;
        }
    }
    /* from the top: the FP image, the child's frame, the thread's frame at the new rsp. A
     * signal handled at the gadget (the tracer gone, before the syscall) puts its own frame
     * below that rsp: it can touch neither the child's frame nor the FP image */
    fp_at = (top - xsize - 4) & ~(uint64_t)63;
    cf = is_clone ? ((fp_at - sizeof(mu_sigframe)) & ~(uint64_t)15) - 8 : fp_at;
    pf = ((cf - sizeof(mu_sigframe)) & ~(uint64_t)15) - 8;      /* as at a function entry */
    buf = calloc(1, top - pf);
    if (!buf) {
        free(xs);
        return -ENOMEM;
    }
    memcpy(buf + (fp_at - pf), xs, xsize);
    if (xsize > FX_SIZE) {
        const uint32_t magic2 = FP_XSTATE_MAGIC2;
        memcpy(buf + (fp_at - pf) + xsize, &magic2, 4);
    }
    f = (mu_sigframe *)buf;
    f->pretcode = restore_rt;
    f->uc_flags = xsize > FX_SIZE ? UC_FP_XSTATE : 0;
    {
        struct user_regs_struct resume = restored_regs(saved, 1);
        frame_regs(f, &resume);
    }
    f->fpstate = fp_at;
    f->sigmask = sigmask;
    if (is_clone) {
        f = (mu_sigframe *)(buf + (cf - pf));
        child = *saved;
        child.rip = insn;
        child.rax = NR_EXIT_GROUP;
        child.rdi = 0;
        child.rsp = cf;
        f->pretcode = restore_rt;
        frame_regs(f, &child);
        f->fpstate = 0;                 /* the kernel resets the FP state: it only exits */
        f->sigmask = ~(uint64_t)0;
    }
    local.iov_base = buf;
    local.iov_len = top - pf;
    remote.iov_base = (void *)pf;
    remote.iov_len = top - pf;
    done = process_vm_writev(tid, &local, 1, &remote, 1, 0);
    if (done != (ssize_t)(top - pf))
        rc = done < 0 ? -errno : -EFAULT;
    free(buf);
    free(xs);
    if (rc == 0) {
        *psp = pf;
        *csp = cf;
    }
    return rc;
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

/* tid's registers as the injection saves them (its current ones; the frozen ones when an
 * earlier injection of this freeze restored tid, see mu_inject_clone). 0 or -errno. */
static int saved_regs(int tid, const uint64_t *frozen, struct user_regs_struct *saved)
{
    if (ptrace(PTRACE_GETREGS, tid, 0, saved) < 0)
        return -errno;
    if (frozen) {
        /* an earlier injection of this freeze restored tid (it has not run since: its
         * registers are exactly those restored): start again from the frozen state, which
         * still knows the interrupted syscall (a frame must issue it again, section 6) */
        struct user_regs_struct f, again;
        memcpy(&f, frozen, sizeof f);
        again = restored_regs(&f, 0);
        if (memcmp(&again, saved, sizeof *saved) == 0)
            *saved = f;
    }
    return 0;
}

static int inject(int tid, uint64_t insn, uint64_t restore_rt, const uint64_t *frozen,
                  uint64_t nr, const uint64_t args_in[6], int is_clone, int64_t timeout_ms,
                  mu_inject *out)
{
    struct user_regs_struct saved, regs;
    int64_t deadline = now_ns() + timeout_ms * 1000000;
    long opts = PTRACE_O_TRACECLONE | PTRACE_O_TRACESYSGOOD;
    uint64_t args[6], psp, csp = 0;
    int rc = 0, kind, attempt, running = 0;

    memset(out, 0, sizeof *out);
    memcpy(args, args_in, sizeof args);
    out->t_ns[MU_STEP_START] = now_ns();
    rc = saved_regs(tid, frozen, &saved);
    if (rc < 0)
        return rc;
    psp = saved.rsp;
    if (restore_rt && write_guard(tid, &saved, insn, restore_rt, is_clone,
                                  saved.rsp - RED_ZONE, &psp, &csp) == 0) {
        out->guarded = 1;
        if (is_clone)
            args[1] = csp;              /* clone's stack argument: the child's rsp */
    }
    /* Unguarded: EXITKILL from before the injected registers are set until the clone
     * event: the child inherits it at birth, so it can never run untraced as a duplicate of
     * the target; if the tracer dies between SETREGS and the syscall entry, the target is
     * killed rather than left running the clone untraced from corrupted registers
     * (section 8). Guarded, the child's own frame ends it, and the target never carries it. */
    if (is_clone)
        opts |= PTRACE_O_TRACEFORK | (out->guarded ? 0 : PTRACE_O_EXITKILL);
    if (ptrace(PTRACE_SETOPTIONS, tid, 0, opts) < 0)
        return -errno;
    reached(out, nr, MU_STEP_OPTIONS);

    for (attempt = 0; attempt < CLONE_RETRIES; attempt++) {
        regs = saved;
        regs.rip = insn;
        regs.rsp = psp;
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
        running = 1;
        reached(out, nr, MU_STEP_SETREGS);
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
        reached(out, nr, MU_STEP_ENTER);
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
                /* unguarded, EXITKILL stays on in the child only: drop it from the target
                 * thread at once, before waiting for the child's birth stop */
                if (!out->guarded && ptrace(PTRACE_SETOPTIONS, tid, 0,
                                            PTRACE_O_TRACECLONE | PTRACE_O_TRACESYSGOOD) < 0) {
                    rc = -errno;
                    goto restore;
                }
                if (ptrace(PTRACE_GETEVENTMSG, tid, 0, &msg) < 0) {
                    rc = -errno;
                    goto restore;
                }
                out->child = (int32_t)msg;
                reached(out, nr, MU_STEP_EVENT);
                w = wait_until(out->child, deadline, &status);
                if (w <= 0) {
                    rc = w < 0 ? w : -ETIMEDOUT;
                    goto restore;
                }
                /* guarded, the child gets EXITKILL now (its frame would end it anyway);
                 * best effort: a child killed meanwhile (ESRCH) must not pass for tid's
                 * death, which skips the restore: parking it fails later, after it */
                if (out->guarded)
                    (void)ptrace(PTRACE_SETOPTIONS, out->child, 0,
                                 PTRACE_O_TRACECLONE | PTRACE_O_EXITKILL);
            }
        }
        reached(out, nr, MU_STEP_EXIT);
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
    regs = restored_regs(&saved, 0);
    if (ptrace(PTRACE_SETREGS, tid, 0, &regs) < 0)
        return rc ? rc : -errno;
    if (ptrace(PTRACE_SETOPTIONS, tid, 0, PTRACE_O_TRACECLONE) < 0)
        return rc ? rc : -errno;
    out->restored = 1;
    out->t_ns[MU_STEP_RESTORED] = now_ns();
    if (rc == 0)
        reached(out, nr, MU_STEP_RESTORED);     /* else step names where it failed */
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
        reached(out, nr, MU_STEP_PARKED);
    }
    return rc;
}

int mu_inject_clone(int tid, uint64_t syscall_insn, uint64_t restore_rt,
                    const uint64_t *frozen_regs, int64_t timeout_ms, mu_inject *out)
{
    const uint64_t args[6] = {0, 0, 0, 0, 0, 0};   /* flags 0: no sharing, exit_signal 0 */
    return inject(tid, syscall_insn, restore_rt, frozen_regs, NR_CLONE, args, 1, timeout_ms,
                  out);
}

int mu_inject_wait4(int tid, uint64_t syscall_insn, uint64_t restore_rt,
                    const uint64_t *frozen_regs, int child, int64_t timeout_ms, mu_inject *out)
{
    const uint64_t args[6] = {(uint64_t)(int64_t)child, 0, MU_WALL | WNOHANG, 0, 0, 0};
    return inject(tid, syscall_insn, restore_rt, frozen_regs, NR_WAIT4, args, 0, timeout_ms,
                  out);
}

/* ---- injected function calls (`track PID`, memunreachable/collect/inject.py) ----
 * The call runs on tid's own stack below the guard's frame, whose return address is the
 * rt_sigreturn stub: when the function returns, the stub's rt_sigreturn puts tid back as it
 * was frozen (registers, FP/SIMD state, signal mask), tracer or not. The tracer drives it
 * with PTRACE_SYSCALL and knows the call returned at the stub's syscall-entry stop (rip
 * after the stub, rsp just above the frame's return address). */

#define NR_RT_SIGRETURN 15
#define RESTORE_RT_LEN 9                /* mov $15, %rax; syscall */
#define EFLAGS_DF 0x400                 /* the ABI wants the direction flag clear at a call */

static int is_fault(int sig)
{
    return sig == SIGSEGV || sig == SIGBUS || sig == SIGILL || sig == SIGFPE;
}

int mu_inject_call(int tid, uint64_t func, uint64_t restore_rt, const uint64_t *frozen_regs,
                   const uint64_t *args, const uint8_t *data, uint64_t data_len,
                   int64_t timeout_ms, mu_inject *out)
{
    struct user_regs_struct saved, regs;
    int64_t deadline = now_ns() + timeout_ms * 1000000;
    uint64_t top, psp = 0, csp = 0, nr = (uint64_t)MU_CALL_NR;
    int rc, status, kind, faulted = 0;

    memset(out, 0, sizeof *out);
    out->t_ns[MU_STEP_START] = now_ns();
    if (!restore_rt)
        return -EINVAL;
    rc = saved_regs(tid, frozen_regs, &saved);
    if (rc < 0)
        return rc;
    out->restored = 1;                  /* untouched until the call's registers are set */
    top = saved.rsp - RED_ZONE;
    if (data_len) {
        struct iovec local = {(void *)data, data_len}, remote;
        top = (top - data_len) & ~(uint64_t)15;
        remote.iov_base = (void *)top;
        remote.iov_len = data_len;
        if (process_vm_writev(tid, &local, 1, &remote, 1, 0) != (ssize_t)data_len)
            return -EFAULT;
    }
    rc = write_guard(tid, &saved, 0, restore_rt, 0, top, &psp, &csp);
    if (rc < 0)
        return rc;
    out->guarded = 1;
    /* no TRACECLONE while the call runs: a thread it creates is not ours to stop */
    if (ptrace(PTRACE_SETOPTIONS, tid, 0, PTRACE_O_TRACESYSGOOD) < 0)
        return -errno;
    reached(out, nr, MU_STEP_OPTIONS);
    regs = saved;
    regs.rip = func;
    regs.rsp = psp;
    regs.rdi = data_len ? top : args[0];
    regs.rsi = args[1];
    regs.rdx = args[2];
    regs.rcx = args[3];
    regs.r8 = args[4];
    regs.r9 = args[5];
    regs.rax = 0;                       /* no vector registers for a variadic callee */
    regs.orig_rax = (uint64_t)-1;
    regs.eflags &= ~(uint64_t)EFLAGS_DF;
    out->restored = 0;
    if (ptrace(PTRACE_SETREGS, tid, 0, &regs) < 0) {
        rc = -errno;
        goto restore;
    }
    reached(out, nr, MU_STEP_SETREGS);
    for (;;) {
        int sig = 0, w;
        if (ptrace(PTRACE_SYSCALL, tid, 0, 0) < 0)
            return -errno;
        w = wait_until(tid, deadline, &status);
        if (w < 0)
            return w;
        if (w == 0) {
            /* the call goes on (waiting for a lock?): leave it stopped where it is; the
             * thaw's detach lets it finish, and its frame then resumes tid as frozen */
            if (restop(tid, now_ns() + 1000000000LL) == 0)
                (void)ptrace(PTRACE_SETOPTIONS, tid, 0, PTRACE_O_TRACECLONE);
            return -ETIMEDOUT;
        }
        kind = kind_of(status);
        if (kind == K_GONE)
            return -ESRCH;
        if (kind == K_SIGNAL) {
            sig = WSTOPSIG(status);
            if (is_fault(sig) && !faulted) {
                /* the function crashed: return at once, through the frame */
                faulted = 1;
                if (ptrace(PTRACE_GETREGS, tid, 0, &regs) < 0)
                    return -errno;
                regs.rip = restore_rt;
                regs.rsp = psp + 8;
                if (ptrace(PTRACE_SETREGS, tid, 0, &regs) < 0)
                    return -errno;
            } else {
                record_signal(out, sig);
            }
            continue;
        }
        if (kind != K_SYSCALL)
            continue;
        if (ptrace(PTRACE_GETREGS, tid, 0, &regs) < 0)
            return -errno;
        if (regs.orig_rax == NR_RT_SIGRETURN && regs.rip == restore_rt + RESTORE_RT_LEN &&
            regs.rsp == psp + 8)
            break;
    }
    reached(out, nr, MU_STEP_ENTER);
    /* let the frame's rt_sigreturn run: it restores the FP/SIMD state and signal mask */
    kind = resume_until_syscall(tid, deadline, out);
    if (kind < 0)
        return kind;
    reached(out, nr, MU_STEP_EXIT);
    if (faulted)
        rc = -EFAULT;
restore:
    /* after the frame's rt_sigreturn, restart_syscall would answer -EINTR: an interrupted
     * sleep is issued again whole, as the frame itself does (restored_regs) */
    regs = restored_regs(&saved, out->step >= MU_STEP_EXIT);
    if (ptrace(PTRACE_SETREGS, tid, 0, &regs) < 0)
        return rc ? rc : -errno;
    if (ptrace(PTRACE_SETOPTIONS, tid, 0, PTRACE_O_TRACECLONE) < 0)
        return rc ? rc : -errno;
    out->restored = 1;
    out->t_ns[MU_STEP_RESTORED] = now_ns();
    if (rc == 0)
        reached(out, nr, MU_STEP_RESTORED);
    return rc;
}

/* ---- freeze / thaw (ptrace-snapshot.md sections 2, 3, 9) ---- */

#include <dirent.h>
#include <elf.h>

int mu_xstate_size(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_XSAVE))
        return 512;
    __cpuid_count(0xd, 0, a, b, c, d);
    return c > 512 ? (int)c : 512;
}

static int find_tid(const mu_thread *t, int n, int tid)
{
    for (int i = n - 1; i >= 0; i--)
        if (t[i].tid == tid)
            return i;
    return -1;
}

/* Add tid as a new record in state; returns its index, or -1 when threads[] is full. */
static int add_tid(mu_thread *t, mu_freeze_args *a, int tid, int state)
{
    if (a->n >= a->cap)
        return -1;
    memset(&t[a->n], 0, sizeof t[a->n]);
    t[a->n].tid = tid;
    t[a->n].state = state;
    return a->n++;
}

static int seize(mu_thread *r, mu_freeze_args *a)
{
    if (a->t_seize_ns == 0)
        a->t_seize_ns = now_ns();
    if (ptrace(PTRACE_SEIZE, r->tid, 0, (void *)(long)PTRACE_O_TRACECLONE) < 0) {
        r->err = errno;
        r->state = errno == ESRCH ? MU_T_GONE : MU_T_SEIZE_FAILED;
        return 0;
    }
    r->state = MU_T_SEIZED;
    if (a->on_attach && a->on_attach(r->tid) != 0)
        return -1;              /* the hook asks to stop here (it raised) */
    ptrace(PTRACE_INTERRUPT, r->tid, 0, 0);     /* ESRCH: it exited; waitpid says so */
    return 0;
}

static void capture(mu_thread *r, uint8_t *fp, int64_t stride)
{
    struct iovec iov = {fp, (size_t)stride};
    if (ptrace(PTRACE_GETREGS, r->tid, 0, r->regs) < 0)
        goto failed;
    if (ptrace(PTRACE_GETREGSET, r->tid, (void *)(long)NT_X86_XSTATE, &iov) == 0) {
        r->fplen = (int32_t)iov.iov_len;
        r->state = MU_T_STOPPED;
        return;
    }
    if (errno == ESRCH || stride < 512)
        goto failed;
    if (ptrace(PTRACE_GETFPREGS, r->tid, 0, fp) < 0)
        goto failed;
    r->fplen = 512;
    r->state = MU_T_STOPPED;
    return;
failed:
    r->err = errno;
    r->state = errno == ESRCH ? MU_T_GONE : MU_T_CAPTURE_FAILED;  /* SIGKILL ends any stop */
}

/* One round of waitpid over the SEIZED records. Returns how many changed, or -1 when a
 * clone event's new thread did not fit (OVERFLOW). */
static int collect_round(mu_thread *t, mu_freeze_args *a)
{
    int changed = 0, overflow = 0;
    for (int i = 0; i < a->n; i++) {
        mu_thread *r = &t[i];
        int status = 0;
        pid_t w;
        if (r->state != MU_T_SEIZED)
            continue;
        w = waitpid(r->tid, &status, MU_WALL | WNOHANG);
        if (w == 0)
            continue;
        changed++;
        if (w < 0 || !WIFSTOPPED(status)) {     /* ECHILD: not ours any more, or exited */
            r->state = MU_T_GONE;
            continue;
        }
        r->status = status;
        if ((status >> 16) == PTRACE_EVENT_CLONE) {
            unsigned long msg = 0;
            if (ptrace(PTRACE_GETEVENTMSG, r->tid, 0, &msg) == 0 && msg) {
                r->event_msg = msg;
                /* auto-attached by TRACECLONE: it reports its own PTRACE_EVENT_STOP */
                if (find_tid(t, a->n, (int)msg) < 0 && add_tid(t, a, (int)msg, MU_T_SEIZED) < 0)
                    overflow = 1;
            }
        } else if ((status >> 16) == 0) {
            r->sig = WSTOPSIG(status);          /* signal-delivery-stop: re-deliver it */
        }
        capture(r, a->fp + (int64_t)i * a->fp_stride, a->fp_stride);
    }
    return overflow ? -1 : changed;
}

/* List /proc/PID/task; add every tid not in the records as NEW. Returns how many were
 * added, -1 when one did not fit, or -errno. */
static int relist(mu_thread *t, mu_freeze_args *a)
{
    char buf[4096];
    int added = 0;
    a->passes++;
    if (lseek(a->task_fd, 0, SEEK_SET) < 0)
        return -errno;
    for (;;) {
        long nread = syscall(SYS_getdents64, a->task_fd, buf, sizeof buf);
        if (nread < 0)
            return -errno;
        if (nread == 0)
            return added;
        for (long off = 0; off < nread;) {
            struct dirent64 *d = (struct dirent64 *)(buf + off);
            int tid = 0;
            const char *c = d->d_name;
            off += d->d_reclen;
            if (*c < '0' || *c > '9')
                continue;
            while (*c >= '0' && *c <= '9')
                tid = tid * 10 + (*c++ - '0');
            if (find_tid(t, a->n, tid) >= 0)
                continue;
            if (add_tid(t, a, tid, MU_T_NEW) < 0)
                return -1;
            added++;
        }
    }
}

static int seize_new(mu_thread *t, mu_freeze_args *a)
{
    for (int i = 0; i < a->n; i++)
        if (t[i].state == MU_T_NEW && seize(&t[i], a) < 0)
            return -1;
    return 0;
}

static int any_seized(const mu_thread *t, int n)
{
    for (int i = 0; i < n; i++)
        if (t[i].state == MU_T_SEIZED)
            return 1;
    return 0;
}

static void read_maps(mu_freeze_args *a)
{
    int64_t len = 0;
    if (a->maps_fd < 0)
        return;
    while (len < a->maps_cap) {
        ssize_t got = pread(a->maps_fd, a->maps_buf + len, a->maps_cap - len, len);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0) {
            a->maps_len = -errno;
            a->maps_changed = 1;
            return;
        }
        if (got == 0)
            break;
        len += got;
    }
    a->maps_len = len;
    a->maps_changed = len != a->maps_before_len || !a->maps_before ||
                      memcmp(a->maps_buf, a->maps_before, len) != 0;
}

static int by_tid(const void *x, const void *y, void *arg)
{
    const mu_thread *t = arg;
    int a = t[*(const int32_t *)x].tid, b = t[*(const int32_t *)y].tid;
    return (a > b) - (a < b);
}

int mu_freeze(mu_thread *t, mu_freeze_args *a)
{
    int64_t deadline;
    int spins = 0, rc;
    if (a->n < 0 || a->n > a->cap || a->fp_stride < 0 || (a->fp_stride && !a->fp))
        return -EINVAL;
    a->result = MU_FREEZE_DONE;
    a->list_err = 0;
    a->passes = 0;
    a->stopped = 0;
    a->maps_len = 0;
    a->maps_changed = 0;
    a->t_seize_ns = 0;
    a->rounds = 0;
    if (seize_new(t, a) < 0) {
        a->result = MU_FREEZE_HOOK;
        return a->n;
    }
    a->t_interrupted_ns = now_ns();
    deadline = now_ns() + a->wait_ms * 1000000;
    for (;;) {
        /* collect every stop of this pass */
        while (any_seized(t, a->n)) {
            rc = collect_round(t, a);
            a->rounds++;
            if (rc < 0) {
                a->result = MU_FREEZE_OVERFLOW;
                goto out;
            }
            if (rc > 0) {
                spins = 0;
                continue;
            }
            if (now_ns() >= deadline) {
                a->result = MU_FREEZE_WAITING;
                goto out;
            }
            if (spins++ < 200) {
                sched_yield();
            } else {
                struct timespec ts = {0, 20000};
                nanosleep(&ts, NULL);
            }
        }
        if (a->flags & MU_FREEZE_NO_RELIST)
            break;
        /* threads created by threads not seized yet show up in the listing */
        rc = relist(t, a);
        if (rc == -1) {
            a->result = MU_FREEZE_OVERFLOW;
            goto out;
        }
        if (rc < 0) {
            a->list_err = -rc;          /* the records stay valid: the caller goes on */
            a->result = MU_FREEZE_LISTING;
            goto out;
        }
        if (rc == 0)
            break;
        if (seize_new(t, a) < 0) {
            a->result = MU_FREEZE_HOOK;
            goto out;
        }
        a->t_interrupted_ns = now_ns();
    }
    a->t_stopped_ns = now_ns();
    for (int i = 0; i < a->n; i++)
        if (t[i].state == MU_T_SEIZE_FAILED || t[i].state == MU_T_CAPTURE_FAILED)
            a->result = MU_FREEZE_FAILED;
    if (a->result == MU_FREEZE_DONE)
        read_maps(a);
    a->t_maps_ns = now_ns();
out:
    a->norder = 0;
    for (int i = 0; i < a->n; i++) {
        if (t[i].state != MU_T_STOPPED)
            continue;
        a->stopped++;
        if (a->order)
            a->order[a->norder++] = i;
    }
    if (a->order)
        qsort_r(a->order, a->norder, sizeof *a->order, by_tid, t);
    a->candidate = -1;
    for (int k = 0; a->order && k < a->norder; k++) {
        mu_thread *r = &t[a->order[k]];
        long word;
        if ((r->status >> 8) != ((PTRACE_EVENT_STOP << 8) | SIGTRAP) || (int64_t)r->regs[15] < 0)
            continue;
        errno = 0;
        word = ptrace(PTRACE_PEEKDATA, r->tid, (void *)(r->regs[16] - 2), 0);
        if (word == -1 && errno)
            break;              /* rip-2 near the end of a mapping: the caller looks itself */
        if ((word & 0xffff) == 0x050f) {
            a->candidate = a->order[k];
            break;
        }
    }
    return a->n;
}

int mu_thaw(mu_thread *t, int n)
{
    int done = 0;
    for (int i = 0; i < n; i++) {
        if (t[i].state != MU_T_STOPPED)
            continue;
        if (ptrace(PTRACE_DETACH, t[i].tid, 0, (void *)(long)t[i].sig) < 0) {
            t[i].err = errno;
            t[i].state = MU_T_DETACH_FAILED;
            continue;
        }
        t[i].state = MU_T_DETACHED;
        done++;
    }
    return done;
}

int64_t mu_ptrace(int64_t request, int tid, uint64_t addr, uint64_t data)
{
    long rc = ptrace((enum __ptrace_request)request, tid, (void *)addr, (void *)data);
    return rc < 0 ? -errno : rc;
}

int mu_peek(int tid, uint64_t addr, uint64_t *word)
{
    long v;
    errno = 0;
    v = ptrace(PTRACE_PEEKDATA, tid, (void *)addr, 0);
    if (v == -1 && errno)
        return -errno;
    *word = (uint64_t)v;
    return 0;
}
