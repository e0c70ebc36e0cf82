/* mu_walk.h: the glibc chunk walker (our malloc_iterate). */
