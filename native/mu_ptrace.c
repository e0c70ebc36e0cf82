/* mu_ptrace.c: ptrace sequences. */
#include "mu_core_impl.h"
