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

#endif
