"""collect: stages 1-2, what the target is and what it holds, read while it is stopped.

preflight/diagnose (can we attach, and why not), procfs (/proc parsing), freeze (ptrace the
threads: registers, stacks), seccomp (the filters a thread runs under), snapshot (the
injected clone), leftovers (a crashed checker's remains), memory (reading the target's or the
snapshot's memory), inject (function calls injected into a frozen thread, for `track PID`).
"""
