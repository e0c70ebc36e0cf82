/* mu_ptrace.h: ptrace sequences that must not be interrupted (inject clone, reap). */
