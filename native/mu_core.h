/* mu_core.h: the whole C API of memunreachable's core.
 * Every function returns 0 or a count >= 0 on success and -errno on failure.
 * Nothing here prints, allocates Python objects or decides policy. */
#ifndef MU_CORE_H
#define MU_CORE_H
#include <stdint.h>
#include "mu_types.h"
#include "mu_mem.h"
#include "mu_walk.h"
#include "mu_pymalloc.h"
#include "mu_cpython.h"
#include "mu_scan.h"
#include "mu_fold.h"
#include "mu_ptrace.h"
#include "mu_self.h"
#include "mu_written.h"
#include "mu_libs.h"
#endif
