/* Internal error reporting: every failing call records a detailed message
 * per thread (epipe_last_error) and, where there is one, on its handle. */
#ifndef EPIPE_LIB_ERROR_H
#define EPIPE_LIB_ERROR_H

#include <stdarg.h>
#include <stddef.h>

#define EPIPE_ERRMSG_MAX 256

/* Records a message for the calling thread and returns status, so callers
 * can write `return epipe_fail(EPIPE_EINVAL, "...", ...)`. */
int epipe_fail(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The same, and copies the message into a handle's buffer too. */
int epipe_fail_into(char *handle_msg, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int epipe_vfail_into(char *handle_msg, int status, const char *fmt, va_list ap);

/* Clears the calling thread's message; public entry points call it first so
 * the message always belongs to the latest call. */
void epipe_clear_error(void);

/* The calling thread's message and a handle's, kept across a step whose
 * failure is not the call's (a best-effort one, whose loss costs only
 * speed): epipe_errors_keep() before it, epipe_errors_restore() after a
 * failure, so that a call that succeeds leaves no error text behind. */
typedef struct epipe_errors_kept {
    char *handle_msg; /* NULL: none */
    char thread[EPIPE_ERRMSG_MAX], handle[EPIPE_ERRMSG_MAX];
} epipe_errors_kept;
void epipe_errors_keep(epipe_errors_kept *k, char *handle_msg);
void epipe_errors_restore(const epipe_errors_kept *k);

#endif
