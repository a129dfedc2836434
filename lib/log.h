/* Internal logging: EPIPE_LOG=warn|info|debug (default warn) and an optional
 * EPIPE_LOG_SUBSYS=tcp,rendezvous filter; lines go to stderr or to the
 * host's callback (epipe_set_log_callback, epipe/common.h). */
#ifndef EPIPE_LIB_LOG_H
#define EPIPE_LIB_LOG_H

#include <epipe/common.h> /* epipe_log_level */

/* Whether a message of this level and subsystem would be printed; cheap. */
int epipe_log_enabled(int level, const char *subsys);

/* Prints one line "epipe[rank N] subsys: message" (rank < 0 omits the
 * rank) if the level and subsystem are enabled, or hands the message to the
 * host's log callback. Thread-safe: a line is written with one write()
 * call, so lines of threads never interleave. */
void epipe_log_msg(int level, int rank, const char *subsys, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define epipe_log_warn(rank, sub, ...) epipe_log_msg(EPIPE_LOG_WARN, rank, sub, __VA_ARGS__)
#define epipe_log_info(rank, sub, ...) epipe_log_msg(EPIPE_LOG_INFO, rank, sub, __VA_ARGS__)
#define epipe_log_debug(rank, sub, ...) epipe_log_msg(EPIPE_LOG_DEBUG, rank, sub, __VA_ARGS__)

#endif
