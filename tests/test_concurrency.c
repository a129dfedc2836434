/* What the headers promise about threads, done by several threads at once:
 *
 * - epipe_comm_set_param(TIMEOUT_MS, SPIN_US) and epipe_comm_get_param()
 *   from another thread while a pipeline runs over the communicator
 *   (comm.h), over inproc and tcp;
 * - the same pipeline over tcp while its threads take a signal every
 *   300 us without SA_RESTART, as under a profiler's timer: every call
 *   that returns EINTR carries on;
 * - epipe_set_log_callback() from any thread while library threads log:
 *   once it returns, the previous callback is not running and is never
 *   called again (common.h);
 * - one schedule read by many threads, and epipe_plan_create() and codec
 *   handles made and used by many threads at once, give what one thread
 *   gets (schedule.h, plan.h, codec.h);
 * - a log line into a stderr pipe nobody reads raises no SIGPIPE, and
 *   leaves one the host had pending (common.h).
 *
 * Each check holds in any build; CI also runs this program under
 * ThreadSanitizer, which reports a data race on the way. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include <epipe/epipe.h>

#include "clock.h"
#include "log.h"
#include "testutil.h"

#define LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define ADD(p, v) __atomic_add_fetch((p), (v), __ATOMIC_ACQ_REL)

/* ---- knobs changed while a pipeline runs -------------------------------- */

enum { WIDTH = 4096, MICROBATCHES = 4, STEPS = 40 };

struct rank_arg {
    pthread_t th;
    const char *transport;
    unsigned rank, port;
    epipe_comm *comm; /* published once made; destroyed by the test */
    epipe_stage *stage;
    const unsigned *knob_rounds; /* the pipeline starts once knobs turn */
    int rc, bad_values;
    char err[256];
};

static float value_at(unsigned step, unsigned mb, size_t i, int dir)
{
    return (float)(step * 1000 + mb * 10 + dir) + (float)(i % 7);
}

/* Two ranks of 1F1B; every tensor received is checked against what the
 * peer sent. */
static void run_rank(struct rank_arg *a)
{
    a->rc = epipe_stage_create(&a->stage, a->comm, "1f1b", MICROBATCHES);
    if (a->rc)
        return;
    float *x = malloc(WIDTH * sizeof *x);
    int64_t shape[2] = {1, WIDTH};
    DLTensor t = {
        .data = x, .device = {kDLCPU, 0}, .ndim = 2, .dtype = {kDLFloat, 32, 1}, .shape = shape};
    for (unsigned step = 0; a->rc == EPIPE_OK && step < STEPS; step++) {
        epipe_op op;
        while ((a->rc = epipe_stage_next_op(a->stage, &op)) == EPIPE_OK &&
               op.kind != EPIPE_OP_NONE) {
            unsigned mb = op.microbatch;
            int dir = op.kind == EPIPE_OP_FORWARD ? 0 : 1;
            const DLTensor *in = NULL;
            if (dir == 0 && a->rank == 1)
                a->rc = epipe_stage_recv_activation(a->stage, mb, &in);
            else if (dir == 1 && a->rank == 0)
                a->rc = epipe_stage_recv_gradient(a->stage, mb, &in);
            if (a->rc)
                break;
            if (in) {
                const float *y = in->data;
                for (size_t i = 0; i < WIDTH; i += 97)
                    a->bad_values += y[i] != value_at(step, mb, i, dir);
                continue;
            }
            for (size_t i = 0; i < WIDTH; i++)
                x[i] = value_at(step, mb, i, dir);
            a->rc = dir == 0 ? epipe_stage_send_activation(a->stage, mb, &t)
                             : epipe_stage_send_gradient(a->stage, mb, &t);
            if (a->rc)
                break;
        }
    }
    free(x);
}

static void *rank_main(void *arg)
{
    struct rank_arg *a = arg;
    /* The ranks and their transports' threads take the signals of
     * signals_interrupt_a_pipeline, not the test's other threads. */
    sigset_t alarm;
    sigemptyset(&alarm);
    sigaddset(&alarm, SIGALRM);
    pthread_sigmask(SIG_UNBLOCK, &alarm, NULL);
    epipe_comm *c;
    a->rc = epipe_comm_create(&c, a->transport, a->rank, 2, "127.0.0.1", a->port,
                              !strcmp(a->transport, "inproc") ? "group=knobs" : NULL);
    if (a->rc == EPIPE_OK) {
        STORE(&a->comm, c);
        while (!LOAD(a->knob_rounds))
            sched_yield();
        run_rank(a);
    }
    if (a->rc)
        snprintf(a->err, sizeof a->err, "%s", epipe_last_error());
    return NULL;
}

struct knob_arg {
    struct rank_arg *ranks;
    int stop;
    unsigned rounds, bad;
};

/* Sets the two knobs any thread may set and reads all four, over and over,
 * on both handles, until the pipeline is done. */
static void *knob_main(void *arg)
{
    struct knob_arg *k = arg;
    epipe_comm *c[2];
    for (unsigned r = 0; r < 2; r++)
        while (!(c[r] = LOAD(&k->ranks[r].comm)) && !LOAD(&k->stop))
            sched_yield();
    for (unsigned n = 0; !LOAD(&k->stop); n++) {
        for (unsigned r = 0; r < 2; r++) {
            if (!c[r])
                continue;
            int64_t v;
            k->bad += epipe_comm_set_param(c[r], EPIPE_COMM_TIMEOUT_MS, n & 1 ? 25000 : 20000) !=
                      EPIPE_OK;
            k->bad += epipe_comm_set_param(c[r], EPIPE_COMM_SPIN_US, n & 2 ? 0 : 200) != EPIPE_OK;
            k->bad += epipe_comm_get_param(c[r], EPIPE_COMM_TIMEOUT_MS, &v) != EPIPE_OK ||
                      (v != 20000 && v != 25000);
            k->bad += epipe_comm_get_param(c[r], EPIPE_COMM_SPIN_US, &v) != EPIPE_OK ||
                      (v != 0 && v != 200);
            k->bad += epipe_comm_get_param(c[r], EPIPE_COMM_MAX_MESSAGE, &v) != EPIPE_OK ||
                      v != INT64_C(1) << 32;
            k->bad += epipe_comm_get_param(c[r], EPIPE_COMM_BUFFER_CACHE, &v) != EPIPE_OK ||
                      v != INT64_C(512) << 20;
        }
        ADD(&k->rounds, 1);
        /* a pause, so that a serialising tool (valgrind) still runs the
         * pipeline */
        nanosleep(&(struct timespec){.tv_nsec = 100000}, NULL);
    }
    return NULL;
}

static void knobs_change_while_running(const char *transport)
{
    unsigned port = strcmp(transport, "tcp") ? 0 : test_free_port();
    struct rank_arg ranks[2];
    struct knob_arg k = {.ranks = ranks};
    for (unsigned r = 0; r < 2; r++)
        ranks[r] = (struct rank_arg){
            .transport = transport, .rank = r, .port = port, .knob_rounds = &k.rounds};
    pthread_t knob;
    assert_int_equal(pthread_create(&knob, NULL, knob_main, &k), 0);
    for (unsigned r = 0; r < 2; r++)
        assert_int_equal(pthread_create(&ranks[r].th, NULL, rank_main, &ranks[r]), 0);
    for (unsigned r = 0; r < 2; r++)
        pthread_join(ranks[r].th, NULL);
    STORE(&k.stop, 1);
    pthread_join(knob, NULL);
    for (unsigned r = 0; r < 2; r++) {
        epipe_stage_destroy(ranks[r].stage);
        epipe_comm_destroy(ranks[r].comm);
    }
    for (unsigned r = 0; r < 2; r++) {
        if (ranks[r].rc)
            fail_msg("%s rank %u: %s: %s", transport, r, epipe_status_name(ranks[r].rc),
                     ranks[r].err);
        assert_int_equal(ranks[r].bad_values, 0);
    }
    assert_int_equal(k.bad, 0);
}

static void knobs_change_while_running_inproc(void **state)
{
    (void)state;
    knobs_change_while_running("inproc");
}

static void knobs_change_while_running_tcp(void **state)
{
    (void)state;
    knobs_change_while_running("tcp");
}

/* A host whose threads take signals without SA_RESTART (a profiler's
 * timer): every blocking call that returns EINTR must carry on. */
static unsigned alarms;
static void on_alarm(int sig)
{
    (void)sig;
    ADD(&alarms, 1);
}

static void signals_interrupt_a_pipeline(const char *transport)
{
    struct sigaction sa = {.sa_handler = on_alarm};
    sigemptyset(&sa.sa_mask);
    assert_int_equal(sigaction(SIGALRM, &sa, NULL), 0);
    sigset_t alarm, mask;
    sigemptyset(&alarm);
    sigaddset(&alarm, SIGALRM);
    pthread_sigmask(SIG_BLOCK, &alarm, &mask); /* the ranks unblock it */
    struct itimerval every = {{0, 300}, {0, 300}}, off = {{0, 0}, {0, 0}};
    assert_int_equal(setitimer(ITIMER_REAL, &every, NULL), 0);
    knobs_change_while_running(transport);
    setitimer(ITIMER_REAL, &off, NULL);
    /* The handler stays: a signal still pending (valgrind delivers late)
     * would exit the program under the default disposition. */
    pthread_sigmask(SIG_SETMASK, &mask, NULL);
    assert_true(LOAD(&alarms) > 0);
}

static void signals_interrupt_a_pipeline_tcp(void **state)
{
    (void)state;
    signals_interrupt_a_pipeline("tcp");
}

/* ---- the log callback replaced while other threads log ------------------- */

enum { SINKS = 2000 };

struct sink {
    int active;  /* calls running now */
    int retired; /* replaced: must never be called again */
    unsigned calls;
};

static struct sink sinks[SINKS];
static unsigned late_calls; /* calls to a retired sink */

static void sink_fn(void *user, int level, const char *subsys, int rank, const char *message)
{
    (void)level, (void)subsys, (void)rank, (void)message;
    struct sink *s = user;
    ADD(&s->active, 1);
    if (LOAD(&s->retired))
        ADD(&late_calls, 1);
    ADD(&s->calls, 1);
    ADD(&s->active, -1);
}

struct logger_arg {
    pthread_t th;
    int *stop;
    unsigned made;
};

/* A tcp communicator refused for an unknown option logs "init failed" at
 * info: a message from this thread, each time. */
static void *logger_main(void *arg)
{
    struct logger_arg *l = arg;
    while (!LOAD(l->stop)) {
        epipe_comm *c;
        if (epipe_comm_create(&c, "tcp", 0, 1, NULL, 0, "no_such_option=1") == EPIPE_OK)
            epipe_comm_destroy(c);
        else
            l->made++;
    }
    return NULL;
}

static void log_callback_replaced_while_logging(void **state)
{
    (void)state;
    int stop = 0;
    struct logger_arg loggers[3];
    epipe_set_log_callback(sink_fn, &sinks[0]); /* every refusal goes to a sink */
    for (unsigned i = 0; i < 3; i++) {
        loggers[i] = (struct logger_arg){.stop = &stop};
        assert_int_equal(pthread_create(&loggers[i].th, NULL, logger_main, &loggers[i]), 0);
    }
    /* SINKS swaps, or as many as 2 s allow (under valgrind, say). */
    unsigned busy_at_swap = 0, used = SINKS;
    int64_t start = epipe_now_ms();
    for (unsigned i = 0; i < SINKS; i++) {
        if (i > 0) { /* once replaced, the previous sink is not running: retired */
            epipe_set_log_callback(sink_fn, &sinks[i]);
            busy_at_swap += LOAD(&sinks[i - 1].active) != 0;
            STORE(&sinks[i - 1].retired, 1);
        }
        /* Until a logger has called the current sink (a second at most). */
        for (int64_t t0 = epipe_now_ms(); !LOAD(&sinks[i].calls) && epipe_now_ms() - t0 < 1000;)
            nanosleep(&(struct timespec){.tv_nsec = 20000}, NULL);
        if (epipe_now_ms() - start > 2000) {
            used = i + 1;
            break;
        }
    }
    STORE(&stop, 1);
    for (unsigned i = 0; i < 3; i++)
        pthread_join(loggers[i].th, NULL);
    epipe_set_log_callback(NULL, NULL);
    STORE(&sinks[used - 1].retired, 1);

    unsigned heard = 0, refused = 0;
    for (unsigned i = 0; i < used; i++)
        heard += sinks[i].calls;
    for (unsigned i = 0; i < 3; i++)
        refused += loggers[i].made;
    assert_int_equal(busy_at_swap, 0);
    assert_int_equal(late_calls, 0);
    /* every refusal logged once, to some sink, and every sink heard some */
    assert_true(heard >= refused);
    for (unsigned i = 0; i < used; i++)
        assert_true(sinks[i].calls > 0);
    assert_true(used > 1);
}

/* ---- read-only and independent handles shared by threads ------------------ */

enum { READERS = 4 };

static const char *const specs[] = {"quant:bits=4", "sortquant:bits=8", "topk:ratio=0.1",
                                    "cast:dtype=fp16", "kmeans:bits=3"};
enum { NSPECS = sizeof specs / sizeof specs[0], N = 3000 };

struct reader_arg {
    pthread_t th;
    const epipe_schedule *sched;
    uint64_t ops_digest;
    double makespan_of_plan;
    char plan_schedule[16];
    size_t payload_len[NSPECS];
    uint64_t payload_digest[NSPECS];
    int rc;
};

static uint64_t digest(const void *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ ((const uint8_t *)p)[i]) * 0x100000001b3ull;
    return h;
}

static uint64_t schedule_digest(const epipe_schedule *s)
{
    uint64_t h = 0;
    for (unsigned st = 0; st < epipe_schedule_stages(s); st++) {
        const epipe_op *ops;
        size_t n;
        if (epipe_schedule_ops(s, st, &ops, &n) != EPIPE_OK)
            return 0;
        h = h * 31 + digest(ops, n * sizeof *ops);
    }
    return h;
}

static int plan_once(double *step_s, char *schedule)
{
    epipe_plan_layer l[6];
    for (unsigned i = 0; i < 6; i++)
        l[i] = (epipe_plan_layer){.forward_s = 1e-3 * (1 + i % 3),
                                  .backward_s = 2e-3 * (1 + i % 3),
                                  .out_bytes = 4e6 / (1 + i)};
    epipe_plan_codec c[2] = {{.spec = "sortquant:bits=8",
                              .layer = 1,
                              .encode_s = 1e-4,
                              .decode_s = 1e-4,
                              .wire_ratio = 0.26,
                              .error = 1e-4},
                             {.spec = "quant:bits=4",
                              .layer = 2,
                              .dir = 1,
                              .encode_s = 1e-4,
                              .decode_s = 1e-4,
                              .wire_ratio = 0.13,
                              .error = 1e-3}};
    epipe_plan_options o = EPIPE_PLAN_OPTIONS_INIT;
    o.stages = 3;
    o.microbatches = 8;
    o.bandwidth = 1.25e7;
    epipe_plan *p;
    int rc = epipe_plan_create(&p, l, 6, c, 2, &o);
    if (rc)
        return rc;
    *step_s = epipe_plan_step_seconds(p);
    snprintf(schedule, 16, "%s", epipe_plan_schedule(p));
    epipe_plan_destroy(p);
    return EPIPE_OK;
}

static void *reader_main(void *arg)
{
    struct reader_arg *r = arg;
    r->ops_digest = schedule_digest(r->sched);
    if ((r->rc = plan_once(&r->makespan_of_plan, r->plan_schedule)))
        return NULL;
    float *x = malloc(N * sizeof *x);
    test_fill(x, N, DIST_NORMAL, 7);
    int64_t shape[1] = {N};
    DLTensor t = test_view_f32(x, shape, N);
    for (unsigned i = 0; i < NSPECS && r->rc == EPIPE_OK; i++) {
        epipe_codec *c;
        if ((r->rc = epipe_codec_create(&c, specs[i])))
            break;
        size_t cap = 0, len = 0;
        uint8_t *buf = NULL;
        if ((r->rc = epipe_codec_max_encoded_size(c, &t, &cap)) == EPIPE_OK && !(buf = malloc(cap)))
            r->rc = EPIPE_ENOMEM;
        if (r->rc == EPIPE_OK)
            r->rc = epipe_codec_encode(c, &t, buf, cap, &len);
        r->payload_len[i] = len;
        r->payload_digest[i] = digest(buf, len);
        free(buf);
        epipe_codec_destroy(c);
    }
    free(x);
    return NULL;
}

static void shared_schedule_plans_and_codecs(void **state)
{
    (void)state;
    epipe_schedule *s;
    assert_int_equal(epipe_schedule_create(&s, "zb-h1", 4, 8), EPIPE_OK);
    struct reader_arg one = {.sched = s}, r[READERS];
    reader_main(&one); /* what one thread gets */
    assert_int_equal(one.rc, EPIPE_OK);
    for (unsigned i = 0; i < READERS; i++) {
        r[i] = (struct reader_arg){.sched = s};
        assert_int_equal(pthread_create(&r[i].th, NULL, reader_main, &r[i]), 0);
    }
    for (unsigned i = 0; i < READERS; i++)
        pthread_join(r[i].th, NULL);
    for (unsigned i = 0; i < READERS; i++) {
        assert_int_equal(r[i].rc, EPIPE_OK);
        assert_true(r[i].ops_digest == one.ops_digest);
        assert_true(r[i].makespan_of_plan == one.makespan_of_plan);
        assert_string_equal(r[i].plan_schedule, one.plan_schedule);
        for (unsigned k = 0; k < NSPECS; k++) {
            assert_int_equal(r[i].payload_len[k], one.payload_len[k]);
            assert_true(r[i].payload_digest[k] == one.payload_digest[k]);
        }
    }
    epipe_schedule_destroy(s);
}

/* A log line to a stderr that is a pipe nobody reads any more does not
 * kill the host with SIGPIPE (the default action), and a SIGPIPE the host
 * had already pending, blocked, stays pending for it. In a child: the
 * parent checks how it ended. */
static int child_logs_into_a_closed_pipe(const void *arg)
{
    int host_pipe_pending = *(const int *)arg;
    int p[2];
    if (pipe(p) || dup2(p[1], STDERR_FILENO) < 0)
        return 3;
    close(p[0]), close(p[1]);
    signal(SIGPIPE, SIG_DFL);
    sigset_t pipe_only;
    sigemptyset(&pipe_only);
    sigaddset(&pipe_only, SIGPIPE);
    if (host_pipe_pending) {
        pthread_sigmask(SIG_BLOCK, &pipe_only, NULL);
        raise(SIGPIPE);
    }
    epipe_set_log_callback(NULL, NULL);
    for (int i = 0; i < 3; i++)
        epipe_log_msg(EPIPE_LOG_ERROR, 0, "test", "a line nobody reads (%d)", i);
    if (host_pipe_pending) {
        sigset_t pending;
        sigpending(&pending);
        return sigismember(&pending, SIGPIPE) ? 0 : 4; /* the host's is still there */
    }
    return 0;
}

static void log_lines_into_a_closed_pipe(void **state)
{
    (void)state;
    for (int pending = 0; pending < 2; pending++) {
        int st = test_in_child(child_logs_into_a_closed_pipe, &pending);
        if (st < 0)
            fail_msg("the child was killed by signal %d (SIGPIPE is %d)", -st, SIGPIPE);
        if (st)
            fail_msg("pending %d: the child exited %d", pending, st);
    }
}

int main(void)
{
    /* Read once, at the first message: set before anything logs. */
    setenv("EPIPE_LOG", "info", 1);
    unsetenv("EPIPE_LOG_SUBSYS");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(knobs_change_while_running_inproc),
        cmocka_unit_test(knobs_change_while_running_tcp),
        cmocka_unit_test(signals_interrupt_a_pipeline_tcp),
        cmocka_unit_test(log_lines_into_a_closed_pipe),
        cmocka_unit_test(log_callback_replaced_while_logging),
        cmocka_unit_test(shared_schedule_plans_and_codecs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
