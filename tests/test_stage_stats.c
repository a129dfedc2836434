/* The stage's statistics: per-boundary bytes equal the totals and what was
 * sent; samples, bubble and step percentiles; the peak rate's window; an
 * older, smaller stats struct left untouched past its end; reads from
 * another thread while the stage runs. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include <epipe/epipe.h>

enum { M = 4, BATCH = 8, ROWS = BATCH / M, COLS = 4 };

struct rank {
    epipe_comm *comm;
    int steps, rc;
    float buf[ROWS * COLS];
    int64_t shape[2];
    DLTensor t;
    epipe_stage *stage; /* set while it runs, for the reader */
    epipe_stage_stats stats;
    epipe_boundary_stats b;
    int b_rc, b1_rc;
    char b1_msg[256];
    int started, finished;  /* atomics: the reader polls them */
    int watched, unwatched; /* a reader reads the stage; it is done (atomic) */
};

static int fwd(void *user, unsigned mb, const DLTensor *in, const DLTensor **out)
{
    struct rank *r = user;
    (void)mb, (void)in;
    *out = &r->t;
    return 0;
}

static void *rank_main(void *p)
{
    struct rank *r = p;
    r->shape[0] = ROWS, r->shape[1] = COLS;
    r->t = (DLTensor){.data = r->buf,
                      .device = {kDLCPU, 0},
                      .ndim = 2,
                      .dtype = {kDLFloat, 32, 1},
                      .shape = r->shape};
    epipe_stage *st;
    r->rc = epipe_stage_create(&st, r->comm, "1f1b", M);
    epipe_stage_callbacks cb = EPIPE_STAGE_CALLBACKS_INIT;
    cb.user = r;
    cb.forward = fwd;
    cb.backward = fwd;
    if (!r->rc)
        r->rc = epipe_stage_set_callbacks(st, &cb);
    if (!r->rc)
        r->rc = epipe_stage_set_param(st, EPIPE_STAGE_BATCH_SIZE, BATCH);
    __atomic_store_n(&r->stage, r->rc ? NULL : st, __ATOMIC_RELEASE);
    __atomic_store_n(&r->started, 1, __ATOMIC_RELEASE);
    for (int i = 0; !r->rc && i < r->steps; i++)
        r->rc = epipe_stage_step(st);
    __atomic_store_n(&r->finished, 1, __ATOMIC_RELEASE);
    /* The reader may be inside a getter still: the stage outlives it. */
    while (r->watched && !__atomic_load_n(&r->unwatched, __ATOMIC_ACQUIRE))
        sched_yield();
    r->stats.struct_size = sizeof r->stats;
    epipe_stage_get_stats(st, &r->stats);
    r->b.struct_size = sizeof r->b;
    r->b_rc = epipe_stage_get_boundary_stats(st, 0, &r->b);
    epipe_boundary_stats b1 = {.struct_size = sizeof b1};
    r->b1_rc = epipe_stage_get_boundary_stats(st, 1, &b1);
    snprintf(r->b1_msg, sizeof r->b1_msg, "%s", epipe_last_error());
    epipe_stage_destroy(st);
    epipe_comm_destroy(r->comm);
    return NULL;
}

static void run(struct rank *r, int steps, void *(*reader)(void *), void *reader_arg)
{
    epipe_comm *c[2];
    pthread_t tid[3];
    assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
    for (int i = 0; i < 2; i++) {
        memset(&r[i], 0, sizeof r[i]);
        r[i].comm = c[i], r[i].steps = steps;
        r[i].watched = i == 0 && reader; /* the reader reads rank 0 */
        assert_int_equal(pthread_create(&tid[i], NULL, rank_main, &r[i]), 0);
    }
    if (reader)
        assert_int_equal(pthread_create(&tid[2], NULL, reader, reader_arg), 0);
    for (int i = 0; i < 2; i++)
        pthread_join(tid[i], NULL);
    if (reader)
        pthread_join(tid[2], NULL);
    for (int i = 0; i < 2; i++)
        assert_int_equal(r[i].rc, EPIPE_OK);
}

/* Three steps of [2,4] float tensors, codec none. */
static void counts_and_derived_figures(void **state)
{
    (void)state;
    struct rank r[2];
    run(r, 3, NULL, NULL);
    const uint64_t raw = 3 * M * ROWS * COLS * 4; /* each way */
    for (int i = 0; i < 2; i++) {
        const epipe_stage_stats *s = &r[i].stats;
        const epipe_boundary_stats *b = &r[i].b;
        assert_int_equal(s->boundaries, 1);
        assert_int_equal(r[i].b_rc, EPIPE_OK);
        assert_int_equal(b->boundary, 0);
        assert_int_equal(b->peer, 1 - i);
        assert_int_equal(b->sends_activations, i == 0);
        assert_int_equal(b->act_raw, raw);
        assert_int_equal(b->grad_raw, raw);
        assert_int_equal(b->act_wire, i ? s->act_recv_wire : s->act_sent_wire);
        assert_int_equal(b->grad_wire, i ? s->grad_sent_wire : s->grad_recv_wire);
        assert_true(b->act_wire > b->act_raw); /* headers */
        assert_int_equal(s->samples, 3 * BATCH);
        assert_true(s->samples_per_second > 0);
        assert_true(s->bubble_fraction >= 0 && s->bubble_fraction <= 1);
        assert_true(s->step_p50_seconds > 0 && s->step_p50_seconds <= s->step_p99_seconds);
        assert_true(s->step_p99_seconds <= s->step_seconds);
        /* the run is far shorter than the one-second window: the peak is
         * every byte in one second; the average over the steps' time */
        assert_true(s->step_seconds < 0.5);
        assert_true(b->act_peak_mbps == (double)b->act_wire / 1e6);
        assert_true(b->act_mbps >= b->act_peak_mbps);
        /* one record only */
        assert_int_equal(r[i].b1_rc, EPIPE_EINVAL);
        assert_non_null(strstr(r[i].b1_msg, "has 1 boundaries"));
    }
}

/* A host built against the header before these fields passes the older,
 * smaller size: nothing past it is written. */
static void older_struct_size(void **state)
{
    (void)state;
    epipe_comm *c[2];
    assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
    epipe_stage *st;
    assert_int_equal(epipe_stage_create(&st, c[0], "gpipe", 2), EPIPE_OK);
    unsigned char buf[sizeof(epipe_stage_stats) + 16];
    memset(buf, 0xab, sizeof buf);
    size_t old = offsetof(epipe_stage_stats, samples);
    memcpy(buf, &old, sizeof old);
    assert_int_equal(epipe_stage_get_stats(st, (epipe_stage_stats *)(void *)buf), EPIPE_OK);
    for (size_t i = old; i < sizeof buf; i++)
        assert_int_equal(buf[i], 0xab);
    size_t tiny = 2;
    memcpy(buf, &tiny, sizeof tiny);
    assert_int_equal(epipe_stage_get_stats(st, (epipe_stage_stats *)(void *)buf), EPIPE_EINVAL);
    epipe_boundary_stats b = {.struct_size = sizeof b};
    assert_int_equal(epipe_stage_get_boundary_stats(NULL, 0, &b), EPIPE_EINVAL);
    epipe_stage_destroy(st);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
}

/* Another thread reads rank 0's statistics all through 300 steps: every
 * total it sees is a whole number of messages and never goes back. */
struct reader_arg {
    struct rank *r;
    int bad, reads;
};

static void *reader(void *p)
{
    struct reader_arg *a = p;
    struct rank *r = a->r;
    while (!__atomic_load_n(&r->started, __ATOMIC_ACQUIRE))
        ;
    epipe_stage *st = __atomic_load_n(&r->stage, __ATOMIC_ACQUIRE);
    uint64_t last = 0;
    const uint64_t msg = ROWS * COLS * 4;
    while (st && !__atomic_load_n(&r->finished, __ATOMIC_ACQUIRE)) {
        epipe_stage_stats s = {.struct_size = sizeof s};
        epipe_boundary_stats b = {.struct_size = sizeof b};
        if (epipe_stage_get_stats(st, &s) || epipe_stage_get_boundary_stats(st, 0, &b)) {
            a->bad = 1;
            break;
        }
        if (s.act_sent_raw % msg || b.act_raw % msg || s.act_sent_raw < last || s.boundaries != 1)
            a->bad = 1;
        last = s.act_sent_raw;
        a->reads++;
        sched_yield(); /* a monitor, not a spinner: let the stages run */
    }
    __atomic_store_n(&r->unwatched, 1, __ATOMIC_RELEASE);
    return NULL;
}

static void live_reads_from_another_thread(void **state)
{
    (void)state;
    static struct rank r[2];
    struct reader_arg a = {.r = &r[0]};
    run(r, 300, reader, &a);
    print_message("%d reads while the stage ran\n", a.reads);
    assert_false(a.bad);
    assert_int_equal(r[0].stats.act_sent_raw, 300u * M * ROWS * COLS * 4);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(counts_and_derived_figures),
        cmocka_unit_test(older_struct_size),
        cmocka_unit_test(live_reads_from_another_thread),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
