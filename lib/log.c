/* Internal logging to stderr or the host's callback, configured once from
 * EPIPE_LOG (level) and EPIPE_LOG_SUBSYS (comma-separated subsystems). */
#define _POSIX_C_SOURCE 200809L
#include "log.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

static pthread_once_t log_once = PTHREAD_ONCE_INIT;
static int log_level = EPIPE_LOG_WARN;
static char log_subsys[256]; /* ",tcp,rendezvous," or "" for all */

/* Every subsystem a log call names: EPIPE_LOG_SUBSYS names from these
 * (common.h lists them too). */
static const char *const log_subsystems[] = {"auth",       "codec", "comm", "inproc", "rdma",
                                             "rendezvous", "stage", "tcp",  "trace"};

/* The host's callback: process-wide by design (epipe/common.h). Callers of
 * it hold the lock for reading, so a new setting waits for calls in flight
 * and the old callback is never called after epipe_set_log_callback(). */
static pthread_rwlock_t log_cb_lock = PTHREAD_RWLOCK_INITIALIZER;
static epipe_log_fn log_cb;
static void *log_cb_user;

EPIPE_API void epipe_set_log_callback(epipe_log_fn fn, void *user)
{
    pthread_rwlock_wrlock(&log_cb_lock);
    log_cb = fn;
    log_cb_user = fn ? user : NULL;
    pthread_rwlock_unlock(&log_cb_lock);
}

/* Writes a line to stderr without SIGPIPE: a host whose stderr is a pipe
 * nobody reads any more (a log collector that went away, `trainer | head`)
 * must not be killed by a library's warning. SIGPIPE is blocked on this
 * thread for the write; one it raised is taken back unless the same signal
 * was already pending for the thread before (then it is the host's). */
static void write_stderr(const char *line, size_t len)
{
    sigset_t pipe_only, old, pending;
    sigemptyset(&pipe_only);
    sigaddset(&pipe_only, SIGPIPE);
    sigemptyset(&pending);
    sigpending(&pending);
    int was_pending = sigismember(&pending, SIGPIPE);
    int blocked = pthread_sigmask(SIG_BLOCK, &pipe_only, &old) == 0;
    ssize_t w = write(STDERR_FILENO, line, len);
    if (blocked && w < 0 && errno == EPIPE && !was_pending) {
        const struct timespec now = {0, 0};
        while (sigtimedwait(&pipe_only, NULL, &now) < 0 && errno == EINTR)
            ;
    }
    if (blocked)
        pthread_sigmask(SIG_SETMASK, &old, NULL);
}

/* A warning about the variables, straight to stderr: it is about the
 * process's environment, and is written inside the first log call, before
 * the filters it concerns exist. */
__attribute__((format(printf, 1, 2))) static void log_init_warn(const char *fmt, ...)
{
    char line[400];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n > 0)
        write_stderr(line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
}

/* EPIPE_LOG_SUBSYS: kept as ",a,b," for the search in epipe_log_enabled().
 * A name no log call uses (a typo, say) would silently hide that
 * subsystem's messages: each is named in a warning. */
static void log_init_subsys(const char *s)
{
    if (strlen(s) + 3 > sizeof log_subsys) {
        log_init_warn("epipe: log: EPIPE_LOG_SUBSYS=%.200s... is too long; logging every "
                      "subsystem\n",
                      s);
        return;
    }
    snprintf(log_subsys, sizeof log_subsys, ",%s,", s);
    char known[128] = "";
    for (size_t i = 0; i < sizeof log_subsystems / sizeof log_subsystems[0]; i++)
        snprintf(known + strlen(known), sizeof known - strlen(known), "%s%s", i ? ", " : "",
                 log_subsystems[i]);
    for (const char *p = s; *p;) {
        size_t n = strcspn(p, ",");
        int found = 0;
        for (size_t i = 0; i < sizeof log_subsystems / sizeof log_subsystems[0]; i++)
            found |= strlen(log_subsystems[i]) == n && !strncmp(log_subsystems[i], p, n);
        if (!found && n) {
            char name[64];
            snprintf(name, sizeof name, "%.*s", (int)(n < 63 ? n : 63), p);
            log_init_warn("epipe: log: EPIPE_LOG_SUBSYS names '%s', which is not a subsystem "
                          "(%s)\n",
                          name, known);
        }
        p += n + (p[n] == ',');
    }
}

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
            log_init_warn("epipe: log: EPIPE_LOG=%.200s is not one of error, warn, info, "
                          "debug; using warn\n",
                          v);
    }
    const char *s = getenv("EPIPE_LOG_SUBSYS");
    if (s && *s)
        log_init_subsys(s);
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
    pthread_rwlock_rdlock(&log_cb_lock);
    if (log_cb) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(line, sizeof line, fmt, ap);
        va_end(ap);
        log_cb(log_cb_user, level, subsys ? subsys : "", rank, line);
        pthread_rwlock_unlock(&log_cb_lock);
        return;
    }
    pthread_rwlock_unlock(&log_cb_lock);
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
    write_stderr(line, len);
}
