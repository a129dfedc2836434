/* Internal logging to stderr, configured once from EPIPE_LOG (level) and
 * EPIPE_LOG_SUBSYS (comma-separated subsystems; unset means all). */
#define _POSIX_C_SOURCE 200809L
#include "log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

static pthread_once_t log_once = PTHREAD_ONCE_INIT;
static int log_level = EPIPE_LOG_WARN;
static char log_subsys[256]; /* ",tcp,rendezvous," or "" for all */

static void log_init(void)
{
    const char *v = getenv("EPIPE_LOG");
    if (v && *v) {
        static const char *names[] = {"error", "warn", "info", "debug"};
        int found = 0;
        for (int i = 0; i < 4; i++)
            if (!strcasecmp(v, names[i]))
                log_level = i, found = 1;
        if (!found && !strcasecmp(v, "warning"))
            log_level = EPIPE_LOG_WARN, found = 1;
        if (!found)
            fprintf(stderr, "epipe: log: EPIPE_LOG=%s is not one of error, warn, info, debug; "
                            "using warn\n", v);
    }
    const char *s = getenv("EPIPE_LOG_SUBSYS");
    if (s && *s && strlen(s) + 3 < sizeof log_subsys)
        snprintf(log_subsys, sizeof log_subsys, ",%s,", s);
}

int epipe_log_enabled(int level, const char *subsys)
{
    pthread_once(&log_once, log_init);
    if (level > log_level)
        return 0;
    if (!log_subsys[0] || level <= EPIPE_LOG_WARN || !subsys)
        return 1; /* warnings and errors are never filtered out */
    size_t n = strlen(subsys);
    for (const char *p = log_subsys; (p = strstr(p, subsys)); p++)
        if (p[-1] == ',' && p[n] == ',')
            return 1;
    return 0;
}

void epipe_log_msg(int level, int rank, const char *subsys, const char *fmt, ...)
{
    if (!epipe_log_enabled(level, subsys))
        return;
    char line[1024];
    int n = rank >= 0 ? snprintf(line, sizeof line, "epipe[rank %d] %s: ", rank, subsys)
                      : snprintf(line, sizeof line, "epipe %s: ", subsys);
    if (n < 0 || (size_t)n >= sizeof line)
        return;
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    size_t len = m < 0 ? (size_t)n : (size_t)n + (size_t)m;
    if (len > sizeof line - 2)
        len = sizeof line - 2;
    line[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, len);
    (void)w;
}
