/* mu_walk.c: the glibc chunk walker. */
#include "mu_core_impl.h"
