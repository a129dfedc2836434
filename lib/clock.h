/* The library's one monotonic clock, in milliseconds, for deadlines and
 * timeouts (never wall-clock time). */
#ifndef EPIPE_CLOCK_H
#define EPIPE_CLOCK_H

#include <stdint.h>
#include <time.h>

/* Milliseconds on CLOCK_MONOTONIC: only differences mean anything. */
static inline int64_t epipe_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

#endif
