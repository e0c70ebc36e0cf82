/* mu_core_impl.h: what every C file of the core includes: libc headers, then the API.
 * The mu_*.h headers are cdef-clean (no includes), so the includes live here. */
#ifndef MU_CORE_IMPL_H
#define MU_CORE_IMPL_H
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include "mu_core.h"
#endif
