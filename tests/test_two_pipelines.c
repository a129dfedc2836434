/* Two independent pipelines in one process share no mutable state: each
 * writes its own trace file, uses its own buffer caches, and both reach the
 * one process-wide log callback with their group and rank in the text. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include <epipe/epipe.h>

#include "comm/comm_impl.h"
#include "testutil.h"

/* ---- the log callback: every message, kept for the checks ---------------- */

#define MAX_LINES 4096
static pthread_mutex_t lines_lock = PTHREAD_MUTEX_INITIALIZER;
static char *lines[MAX_LINES];
static unsigned nlines;

static void keep_line(void *user, int level, const char *subsys, int rank, const char *message)
{
    char buf[512];
    snprintf(buf, sizeof buf, "%s|%d|%d|%s", (const char *)user, level, rank, subsys);
    size_t n = strlen(buf);
    snprintf(buf + n, sizeof buf - n, "|%s", message);
    pthread_mutex_lock(&lines_lock);
    if (nlines < MAX_LINES)
        lines[nlines++] = strdup(buf);
    pthread_mutex_unlock(&lines_lock);
}

/* 1 when some kept line holds both strings. */
static int logged(const char *a, const char *b)
{
    int found = 0;
    pthread_mutex_lock(&lines_lock);
    for (unsigned i = 0; i < nlines && !found; i++)
        found = lines[i] && strstr(lines[i], a) && strstr(lines[i], b);
    pthread_mutex_unlock(&lines_lock);
    return found;
}

/* ---- one stage of a pipeline, driven by the op stream ------------------- */

enum { WIDTH = 1 << 17 }; /* 512 KiB of fp32 per message: large enough to be cached */

struct stage_arg {
    pthread_t th;
    unsigned rank, size, microbatches;
    int steps;
    char options[256];
    int rc;
    char err[256];
    uint64_t hits, misses, bytes;
};

static int stage_run(struct stage_arg *a, epipe_comm *c)
{
    epipe_stage *st;
    int rc = epipe_stage_create(&st, c, "1f1b", a->microbatches);
    if (rc)
        return rc;
    float *x = calloc(WIDTH, sizeof *x);
    int64_t shape[2] = {1, WIDTH};
    DLTensor t = {
        .data = x, .device = {kDLCPU, 0}, .ndim = 2, .dtype = {kDLFloat, 32, 1}, .shape = shape};
    for (int step = 0; rc == EPIPE_OK && step < a->steps; step++) {
        epipe_op op;
        while (rc == EPIPE_OK && (rc = epipe_stage_next_op(st, &op)) == EPIPE_OK &&
               op.kind != EPIPE_OP_NONE) {
            const DLTensor *in;
            unsigned mb = op.microbatch;
            if (op.kind == EPIPE_OP_FORWARD) {
                if (a->rank > 0)
                    rc = epipe_stage_recv_activation(st, mb, &in);
                if (rc == EPIPE_OK && a->rank + 1 < a->size)
                    rc = epipe_stage_send_activation(st, mb, &t);
            } else {
                if (a->rank + 1 < a->size)
                    rc = epipe_stage_recv_gradient(st, mb, &in);
                if (rc == EPIPE_OK && a->rank > 0)
                    rc = epipe_stage_send_gradient(st, mb, &t);
            }
        }
    }
    if (rc)
        snprintf(a->err, sizeof a->err, "%s", epipe_stage_last_error(st));
    epipe_stage_destroy(st);
    free(x);
    return rc;
}

static void *stage_thread(void *arg)
{
    struct stage_arg *a = arg;
    epipe_comm *c;
    a->rc = epipe_comm_create(&c, "inproc", a->rank, a->size, NULL, 0, a->options);
    if (a->rc) {
        snprintf(a->err, sizeof a->err, "%s", epipe_last_error());
        return NULL;
    }
    a->rc = stage_run(a, c);
    epipe_comm_cache_stats(c, &a->hits, &a->misses, &a->bytes);
    epipe_comm_destroy(c);
    return NULL;
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return NULL;
    static char text[2][1 << 20];
    static int which;
    char *buf = text[which++ & 1];
    size_t n = fread(buf, 1, sizeof text[0] - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

static unsigned count(const char *text, const char *needle)
{
    unsigned n = 0;
    for (const char *p = text; (p = strstr(p, needle)); p++)
        n++;
    return n;
}

static void two_pipelines_share_nothing(void **state)
{
    (void)state;
    char dir[] = "/tmp/epipe-two-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path_a[64], path_b[64], path_env[64];
    snprintf(path_a, sizeof path_a, "%s/a.json", dir);
    snprintf(path_b, sizeof path_b, "%s/b.json", dir);
    snprintf(path_env, sizeof path_env, "%s/env.json", dir);
    /* trace= in the options wins over EPIPE_TRACE: nothing goes here */
    setenv("EPIPE_TRACE", path_env, 1);
    epipe_set_log_callback(keep_line, "cb1");

    /* A: 2 stages, 2 micro-batches, the default cache. B: 3 stages, 4
     * micro-batches, no cache at all. Both run at once. */
    enum { PA = 2, PB = 3, N = PA + PB };
    struct stage_arg args[N];
    for (unsigned i = 0; i < N; i++) {
        int in_a = i < PA;
        args[i] = (struct stage_arg){.rank = in_a ? i : i - PA,
                                     .size = in_a ? PA : PB,
                                     .microbatches = in_a ? 2 : 4,
                                     .steps = 3};
        snprintf(args[i].options, sizeof args[i].options, "group=%s,trace=%s%s",
                 in_a ? "pipeA" : "pipeB", in_a ? path_a : path_b, in_a ? "" : ",buffer_cache=0");
    }
    for (unsigned i = 0; i < N; i++)
        assert_int_equal(pthread_create(&args[i].th, NULL, stage_thread, &args[i]), 0);
    for (unsigned i = 0; i < N; i++)
        pthread_join(args[i].th, NULL);
    for (unsigned i = 0; i < N; i++)
        if (args[i].rc)
            fail_msg("pipeline %c rank %u: %s: %s", i < PA ? 'A' : 'B', args[i].rank,
                     epipe_status_name(args[i].rc), args[i].err);
    unsetenv("EPIPE_TRACE");

    /* Each trace file holds its own pipeline's stages and micro-batches. */
    assert_int_equal(access(path_env, F_OK), -1);
    const char *a = slurp(path_a), *b = slurp(path_b);
    assert_non_null(a);
    assert_non_null(b);
    assert_non_null(strstr(a, "\"stage 1\""));
    assert_null(strstr(a, "\"stage 2\""));      /* A has no third stage */
    assert_null(strstr(a, "\"name\": \"F2\"")); /* nor a third micro-batch */
    assert_non_null(strstr(b, "\"stage 2\""));
    assert_non_null(strstr(b, "\"name\": \"F3\""));
    /* every forward of every step, no more: stages x micro-batches x steps */
    assert_int_equal(count(a, "\"name\": \"F"), PA * 2 * 3);
    assert_int_equal(count(b, "\"name\": \"F"), PB * 4 * 3);

    /* Each handle used its own cache: A's reused its buffers; B's, capped
     * at 0, never held one and never served one, though A's cached buffers
     * of the very size B asked for all along (a shared cache would have
     * served B from them). */
    for (unsigned i = 0; i < N; i++) {
        if (i < PA) {
            assert_true(args[i].hits > 0);
        } else {
            assert_int_equal(args[i].hits, 0);
            assert_int_equal(args[i].bytes, 0);
            assert_true(args[i].misses > 0);
        }
    }

    /* The one log callback heard both pipelines, each naming its group and
     * rank. */
    assert_true(logged("|inproc|", "group 'pipeA': rank 0 of 2"));
    assert_true(logged("|inproc|", "group 'pipeA': rank 1 of 2"));
    assert_true(logged("|inproc|", "group 'pipeB': rank 2 of 3"));
    assert_true(logged("|comm|", "group 'pipeA': rank 1 leaves"));
    assert_true(logged("|comm|", "group 'pipeB': rank 0 leaves"));

    /* NULL restores stderr; the old callback is not called again. */
    epipe_set_log_callback(NULL, NULL);
    unsigned before = nlines;
    epipe_comm *c;
    assert_int_equal(epipe_comm_create(&c, "inproc", 0, 1, NULL, 0, "group=quiet"), EPIPE_OK);
    epipe_comm_destroy(c);
    assert_int_equal(nlines, before);

    for (unsigned i = 0; i < nlines; i++)
        free(lines[i]);
    nlines = 0;
    unlink(path_a);
    unlink(path_b);
    rmdir(dir);
}

/* A trace path naming a FIFO: the stage's destruction once waited for a
 * reader for ever (and a reader that left would have killed the process
 * with SIGPIPE). Now the trace is refused in the log, naming why. Also a
 * trace into a directory, refused with the system's reason. */
static void trace_into_a_fifo_or_a_directory(void **state)
{
    (void)state;
    char dir[] = "/tmp/epipe-fifo-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char fifo[64], opts[160];
    snprintf(fifo, sizeof fifo, "%s/trace.json", dir);
    assert_int_equal(mkfifo(fifo, 0600), 0);
    epipe_set_log_callback(keep_line, "fifo");
    const char *paths[2] = {fifo, dir};
    for (int i = 0; i < 2; i++) {
        snprintf(opts, sizeof opts, "trace=%s", paths[i]);
        epipe_comm *c;
        epipe_stage *st;
        assert_int_equal(epipe_comm_create(&c, "inproc", 0, 1, NULL, 0, opts), EPIPE_OK);
        assert_int_equal(epipe_stage_create(&st, c, "gpipe", 2), EPIPE_OK);
        epipe_op op;
        while (epipe_stage_next_op(st, &op) == EPIPE_OK && op.kind != EPIPE_OP_NONE)
            ;                    /* one step of a single stage: compute spans only */
        epipe_stage_destroy(st); /* writes the trace: must not wait */
        epipe_comm_destroy(c);
    }
    epipe_set_log_callback(NULL, NULL);
    assert_true(logged("|trace|", "it is a FIFO with no reader"));
    assert_true(logged("|trace|", strerror(EISDIR)));
    assert_true(logged("|trace|", "give the path of a regular file"));
    unlink(fifo);
    rmdir(dir);
}

/* A trace that cannot be written whole (the disk full; here the file-size
 * limit, which fails the same write() with EFBIG) is removed, and the log
 * says why: a cut-off JSON file is no trace. In a child, whose limit the
 * test's own output does not share. */
static int child_writes_a_trace_too_large(const void *arg)
{
    const char *path = arg;
    signal(SIGXFSZ, SIG_IGN); /* the write fails instead of killing */
    struct rlimit lim = {512, 512};
    if (setrlimit(RLIMIT_FSIZE, &lim))
        return 3;
    char opts[160];
    snprintf(opts, sizeof opts, "trace=%s", path);
    epipe_set_log_callback(keep_line, "fsize");
    epipe_comm *c;
    epipe_stage *st;
    if (epipe_comm_create(&c, "inproc", 0, 1, NULL, 0, opts) ||
        epipe_stage_create(&st, c, "gpipe", 8))
        return 4;
    epipe_op op;
    for (int step = 0; step < 4; step++) /* a few kB of spans */
        while (epipe_stage_next_op(st, &op) == EPIPE_OK && op.kind != EPIPE_OP_NONE)
            ;
    epipe_stage_destroy(st);
    epipe_comm_destroy(c);
    epipe_set_log_callback(NULL, NULL);
    if (!logged("|trace|", strerror(EFBIG)) || !logged("|trace|", "the partial file is removed"))
        return 5;
    return access(path, F_OK) == 0 ? 6 : 0;
}

static void a_trace_that_cannot_be_written_whole_is_removed(void **state)
{
    (void)state;
    char dir[] = "/tmp/epipe-fsize-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[64];
    snprintf(path, sizeof path, "%s/trace.json", dir);
    int st = test_in_child(child_writes_a_trace_too_large, path);
    unlink(path);
    rmdir(dir);
    if (st)
        fail_msg("the child ended with %d (5: no log line naming EFBIG and the removal; 6: the "
                 "partial trace was left; below 0: killed by that signal)",
                 st);
}

int main(void)
{
    /* Read once, at the first message: set before anything logs. */
    setenv("EPIPE_LOG", "debug", 1);
    unsetenv("EPIPE_LOG_SUBSYS");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(two_pipelines_share_nothing),
        cmocka_unit_test(trace_into_a_fifo_or_a_directory),
        cmocka_unit_test(a_trace_that_cannot_be_written_whole_is_removed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
