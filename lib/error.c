/* Status strings and the per-thread last-error message. */
#include "error.h"

#include <stdio.h>
#include <string.h>

#include <epipe/common.h>

static _Thread_local char thread_msg[EPIPE_ERRMSG_MAX];

static const struct {
    int status;
    const char *name;
    const char *text;
} status_table[] = {
    {EPIPE_OK, "EPIPE_OK", "success"},
    {EPIPE_EINVAL, "EPIPE_EINVAL", "invalid argument"},
    {EPIPE_ENOMEM, "EPIPE_ENOMEM", "out of memory"},
    {EPIPE_ENOTSUP, "EPIPE_ENOTSUP", "not supported in this build or on this machine"},
    {EPIPE_ENOSPC, "EPIPE_ENOSPC", "output buffer too small"},
    {EPIPE_ETRUNC, "EPIPE_ETRUNC", "truncated message"},
    {EPIPE_ETOOBIG, "EPIPE_ETOOBIG", "message larger than the limit"},
    {EPIPE_EVERSION, "EPIPE_EVERSION", "unsupported wire version"},
    {EPIPE_ECHECKSUM, "EPIPE_ECHECKSUM", "checksum mismatch"},
    {EPIPE_EOVERFLOW, "EPIPE_EOVERFLOW", "size or shape overflow"},
    {EPIPE_EPROTO, "EPIPE_EPROTO", "malformed message"},
    {EPIPE_ESTATE, "EPIPE_ESTATE", "call not valid in the current state"},
    {EPIPE_EPEER, "EPIPE_EPEER", "peer failed or disconnected"},
    {EPIPE_ETIMEDOUT, "EPIPE_ETIMEDOUT", "timed out"},
    {EPIPE_EIO, "EPIPE_EIO", "I/O error"},
    {EPIPE_EAUTH, "EPIPE_EAUTH", "authentication failed"},
    {EPIPE_EINTERNAL, "EPIPE_EINTERNAL", "internal error"},
    {EPIPE_ECALLBACK, "EPIPE_ECALLBACK", "a host callback failed"},
};

EPIPE_API const char *epipe_strerror(int status)
{
    for (size_t i = 0; i < sizeof status_table / sizeof status_table[0]; i++)
        if (status_table[i].status == status)
            return status_table[i].text;
    return "unknown status";
}

EPIPE_API const char *epipe_status_name(int status)
{
    for (size_t i = 0; i < sizeof status_table / sizeof status_table[0]; i++)
        if (status_table[i].status == status)
            return status_table[i].name;
    return "EPIPE_UNKNOWN";
}

EPIPE_API const char *epipe_last_error(void)
{
    return thread_msg;
}

void epipe_clear_error(void)
{
    thread_msg[0] = '\0';
}

int epipe_vfail_into(char *handle_msg, int status, const char *fmt, va_list ap)
{
    vsnprintf(thread_msg, sizeof thread_msg, fmt, ap);
    if (handle_msg)
        memcpy(handle_msg, thread_msg, sizeof thread_msg);
    return status;
}

int epipe_fail_into(char *handle_msg, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    epipe_vfail_into(handle_msg, status, fmt, ap);
    va_end(ap);
    return status;
}

int epipe_fail(int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    epipe_vfail_into(NULL, status, fmt, ap);
    va_end(ap);
    return status;
}

void epipe_errors_keep(epipe_errors_kept *k, char *handle_msg)
{
    k->handle_msg = handle_msg;
    memcpy(k->thread, thread_msg, sizeof k->thread);
    if (handle_msg)
        memcpy(k->handle, handle_msg, sizeof k->handle);
}

void epipe_errors_restore(const epipe_errors_kept *k)
{
    memcpy(thread_msg, k->thread, sizeof thread_msg);
    if (k->handle_msg)
        memcpy(k->handle_msg, k->handle, sizeof k->handle);
}
