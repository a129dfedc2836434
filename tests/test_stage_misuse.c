/* A refused call changes nothing. Every rank of a pipeline driven by the op
 * stream makes, before each of its calls on the stage, one to three calls
 * that the header says must be refused (out of order, for another
 * micro-batch, a bad tensor, a NULL, a knob that only changes between
 * steps), chosen at random. Each must fail with the status and a message
 * that names the mistake, leave the op in progress as it was, and the
 * training must end bit for bit where the same run without them ends:
 * error-feedback residuals, codec state and the schedule's position
 * included. */
#define _DEFAULT_SOURCE
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "comm/comm_impl.h"
#include "pipeline_host.h"
#include "testutil.h"

#define MAX_P 4
#define STEPS 3

struct misuse_run {
    uint64_t seed;
    /* per rank, written by that rank's thread only */
    unsigned made[MAX_P], kinds_seen[MAX_P][32];
};

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Big enough for any tensor below, so that a check the library forgot
 * shows as a wrong status, not as a read past the end. */
static float scratch[1 << 14];

/* A tensor like `like` (or a plausible activation when NULL), which the
 * caller then spoils. */
static DLTensor tensor_like(const DLTensor *like, int64_t *shape, unsigned m)
{
    DLTensor t = {.data = scratch, .device = {kDLCPU, 0}, .ndim = 2, .dtype = {kDLFloat, 32, 1}};
    shape[0] = HOST_BATCH / m, shape[1] = 12;
    if (like) {
        t.ndim = like->ndim;
        t.dtype = like->dtype;
        memcpy(shape, like->shape, sizeof(int64_t) * (size_t)like->ndim);
    }
    t.shape = shape;
    return t;
}

static const char *call_name(enum host_call_kind k)
{
    static const char *const names[] = {"next_op",       "recv_activation", "send_activation",
                                        "recv_gradient", "send_gradient",   "callback"};
    return names[k];
}

/* A micro-batch other than the op's: another index, or one out of range. */
static unsigned other_mb(const struct host_call *c, uint64_t r)
{
    if (r % 4 == 0 || c->microbatches == 1)
        return (r >> 8) % 2 ? c->microbatches : 0xffffffffu;
    unsigned k = 1 + (unsigned)((r >> 8) % (c->microbatches - 1));
    return (c->microbatch + k) % c->microbatches;
}

/* Callbacks a refused epipe_stage_set_callbacks would have set. */
static int never_forward(void *user, unsigned mb, const DLTensor *in, const DLTensor **out)
{
    return 7;
}

static int never_backward(void *user, unsigned mb, const DLTensor *gout, const DLTensor **gin)
{
    return 7;
}

enum misuse {
    M_RECV_ACT,
    M_RECV_GRAD,
    M_SEND_ACT,
    M_SEND_GRAD,
    M_NEXT_OP,
    M_NEXT_OP_NULL,
    M_RECV_NULL,
    M_STEP,
    M_DRAIN,
    M_SGD,
    M_TRAINING,
    M_CUDA_DEVICE,
    M_SET_CODEC,
    M_SET_CALLBACKS,
    M_BAD_TENSOR,
    M_COUNT
};

/* One refused call fit for the moment c describes; 0 with *rc and *want
 * set, or -1 when this misuse does not fit here (then nothing was called). */
static int misuse(struct host_call *c, enum misuse which, uint64_t r, int *rc, int *want,
                  const char **needle, char *what, size_t cap)
{
    epipe_stage *st = c->stage;
    enum host_call_kind k = c->kind;
    int64_t shape[20];
    DLTensor t = tensor_like(c->tensor, shape, c->microbatches);
    const DLTensor *got;
    epipe_op op;
    unsigned mb = (unsigned)(r >> 16) % c->microbatches;
    *want = EPIPE_ESTATE;
    *needle = NULL;
    switch (which) {
    case M_RECV_ACT:
    case M_RECV_GRAD: {
        int act = which == M_RECV_ACT;
        /* the same micro-batch is the call about to be made */
        if (k == (act ? HOST_RECV_ACTIVATION : HOST_RECV_GRADIENT))
            mb = other_mb(c, r);
        snprintf(what, cap, "recv_%s(%u)", act ? "activation" : "gradient", mb);
        *rc = act ? epipe_stage_recv_activation(st, mb, &got)
                  : epipe_stage_recv_gradient(st, mb, &got);
        return 0;
    }
    case M_SEND_ACT:
    case M_SEND_GRAD: {
        int act = which == M_SEND_ACT;
        /* sending before receiving is allowed; sending what is about to be
         * sent is the call itself */
        if (k == (act ? HOST_RECV_ACTIVATION : HOST_RECV_GRADIENT) ||
            k == (act ? HOST_SEND_ACTIVATION : HOST_SEND_GRADIENT))
            mb = other_mb(c, r);
        snprintf(what, cap, "send_%s(%u)", act ? "activation" : "gradient", mb);
        *rc = act ? epipe_stage_send_activation(st, mb, &t) : epipe_stage_send_gradient(st, mb, &t);
        return 0;
    }
    case M_NEXT_OP:
        if (k == HOST_NEXT_OP)
            return -1;
        snprintf(what, cap, "next_op");
        *needle = k == HOST_RECV_ACTIVATION || k == HOST_RECV_GRADIENT ? "without receiving"
                                                                       : "without sending";
        *rc = epipe_stage_next_op(st, &op);
        return 0;
    case M_NEXT_OP_NULL:
        snprintf(what, cap, "next_op(NULL)");
        *want = EPIPE_EINVAL, *needle = "NULL";
        *rc = epipe_stage_next_op(st, NULL);
        return 0;
    case M_RECV_NULL:
        snprintf(what, cap, "recv_%s(%u, NULL)", r & 1 ? "activation" : "gradient", mb);
        *want = EPIPE_EINVAL, *needle = "NULL";
        *rc = r & 1 ? epipe_stage_recv_activation(st, mb, NULL)
                    : epipe_stage_recv_gradient(st, mb, NULL);
        return 0;
    case M_STEP:
        snprintf(what, cap, "epipe_stage_step");
        *needle = "callbacks";
        *rc = epipe_stage_step(st);
        return 0;
    case M_DRAIN:
        if (!c->in_step)
            return -1; /* between steps it is allowed */
        snprintf(what, cap, "epipe_stage_drain");
        *needle = "middle of a step";
        *rc = epipe_stage_drain(st);
        return 0;
    case M_SGD:
        if (!c->in_step)
            return -1;
        snprintf(what, cap, "epipe_stage_codec_sgd_step");
        *needle = "between steps";
        *rc = epipe_stage_codec_sgd_step(st, 0.01, 0);
        return 0;
    case M_TRAINING:
    case M_CUDA_DEVICE:
        if (!c->in_step)
            return -1;
        snprintf(what, cap, "set_param(%s)",
                 which == M_TRAINING ? "EPIPE_STAGE_TRAINING" : "EPIPE_STAGE_CUDA_DEVICE");
        *needle = "between steps";
        *rc = epipe_stage_set_param(
            st, which == M_TRAINING ? EPIPE_STAGE_TRAINING : EPIPE_STAGE_CUDA_DEVICE,
            which == M_TRAINING ? 1 : -1);
        return 0;
    case M_SET_CODEC:
        if (!c->started)
            return -1;
        snprintf(what, cap, "set_codec");
        *needle = "before the first step";
        *rc = epipe_stage_set_codec(st, r & 1 ? EPIPE_DIR_ACTIVATION : EPIPE_DIR_GRADIENT,
                                    EPIPE_ALL_BOUNDARIES, "quant:bits=8");
        return 0;
    case M_SET_CALLBACKS: {
        if (!c->in_step)
            return -1;
        epipe_stage_callbacks cb = EPIPE_STAGE_CALLBACKS_INIT;
        cb.forward = never_forward;
        cb.backward = never_backward;
        snprintf(what, cap, "set_callbacks");
        *needle = "between steps";
        *rc = epipe_stage_set_callbacks(st, &cb);
        return 0;
    }
    case M_BAD_TENSOR: {
        int act = k == HOST_SEND_ACTIVATION;
        if (!act && k != HOST_SEND_GRADIENT)
            return -1;
        mb = c->microbatch;
        *want = EPIPE_EINVAL;
        const DLTensor *arg = &t;
        switch ((r >> 24) % (act ? 10 : 12)) {
        case 0:
            arg = NULL, *needle = "NULL";
            snprintf(what, cap, "a NULL tensor");
            break;
        case 1:
            t.dtype.code = kDLInt, *needle = "dtype int32";
            snprintf(what, cap, "an int32 tensor");
            break;
        case 2:
            t.dtype.bits = 64, *needle = "dtype fp64";
            snprintf(what, cap, "a float64 tensor");
            break;
        case 3:
            t.dtype.lanes = 2, *needle = "lanes";
            snprintf(what, cap, "a tensor of 2 lanes");
            break;
        case 4:
            shape[0]++, *needle = act ? "rows" : "shape";
            snprintf(what, cap, "a tensor with one row too many");
            break;
        case 5:
            t.ndim = 0;
            snprintf(what, cap, "a tensor of no dimension");
            break;
        case 6:
            shape[t.ndim - 1] = -3;
            snprintf(what, cap, "a tensor with a dimension of -3");
            break;
        case 7:
            t.ndim = 17;
            for (int d = 2; d < 17; d++)
                shape[d] = 1;
            snprintf(what, cap, "a tensor of 17 dimensions");
            break;
        case 8:
            t.data = NULL, *needle = "NULL";
            snprintf(what, cap, "a tensor with no data");
            break;
        case 9:
            shape[t.ndim - 1] = INT64_MAX / 2;
            *want = EPIPE_EOVERFLOW;
            snprintf(what, cap, "a tensor of 2^62 columns");
            break;
        case 10: /* gradients only: unlike the activation received */
            shape[t.ndim - 1]++, *needle = "shape";
            snprintf(what, cap, "a gradient one column wider than its activation");
            break;
        default:
            t.dtype.code = kDLBfloat, t.dtype.bits = 16, *needle = "dtype";
            snprintf(what, cap, "a bf16 gradient of an fp32 activation");
            break;
        }
        size_t n = strlen(what);
        snprintf(what + n, cap - n, " to send_%s(%u)", act ? "activation" : "gradient", mb);
        *rc = act ? epipe_stage_send_activation(st, mb, arg)
                  : epipe_stage_send_gradient(st, mb, arg);
        return 0;
    }
    case M_COUNT: break;
    }
    return -1;
}

static int same_op(const epipe_op *a, int rca, const epipe_op *b, int rcb)
{
    return rca == rcb && a->kind == b->kind && a->microbatch == b->microbatch &&
           a->chunk == b->chunk && a->weight_version == b->weight_version;
}

/* host_config.before_call: one to three refused calls. */
static int refuse_some(struct host_call *c)
{
    struct misuse_run *run = c->arg;
    uint64_t r = mix(run->seed ^ ((uint64_t)c->rank << 40) ^ c->serial);
    int count = 1 + (int)(r % 3);
    for (int i = 0; i < count; i++) {
        r = mix(r);
        epipe_op before, after;
        int rcb = epipe_stage_current_op(c->stage, &before);
        int rc, want;
        const char *needle;
        char what[160];
        enum misuse which = (enum misuse)((r >> 4) % M_COUNT);
        if (misuse(c, which, r, &rc, &want, &needle, what, sizeof what))
            continue;
        /* inside a callback the stage is mid-op: everything that drives it
         * is refused, naming the callback */
        if (c->kind == HOST_IN_CALLBACK && want == EPIPE_ESTATE)
            needle = "from inside the";
        run->made[c->rank]++;
        run->kinds_seen[c->rank][which]++;
        char msg[200];
        snprintf(msg, sizeof msg, "%s", epipe_last_error());
        int rca = epipe_stage_current_op(c->stage, &after);
        if (rc != want || (needle && !strstr(msg, needle)) || !msg[0])
            snprintf(c->error, sizeof c->error,
                     "rank %u, before its %s: %s gave %s '%s'; wanted %s naming '%s'", c->rank,
                     call_name(c->kind), what, epipe_status_name(rc), msg, epipe_status_name(want),
                     needle ? needle : "");
        else if (!same_op(&before, rcb, &after, rca))
            snprintf(c->error, sizeof c->error,
                     "rank %u, before its %s: the refused %s changed the op in progress", c->rank,
                     call_name(c->kind), what);
        else
            continue;
        return 1;
    }
    return 0;
}

static void run_ranks(unsigned p, const struct host_config *cfg, struct host_rank *a)
{
    assert_int_equal(host_run_threads(p, cfg, a), 0);
    int failed = 0;
    for (unsigned r = 0; r < p; r++)
        if (a[r].res.rc) {
            print_error("%s on %u ranks, rank %u: %s: %s\n", cfg->schedule, p, r,
                        epipe_status_name(a[r].res.rc), a[r].res.error);
            failed = 1;
        }
    if (failed)
        fail();
}

/* Bit for bit: the refusals left no trace in the training. */
static void assert_same_training(const struct host_rank *x, const struct host_rank *y, unsigned p,
                                 const char *what)
{
    for (unsigned r = 0; r < p; r++) {
        for (int l = 0; l < host_nlayers; l++) {
            if (!x[r].res.owns[l])
                continue;
            const mlp_layer *u = &x[r].res.layers[l], *v = &y[r].res.layers[l];
            if (memcmp(u->w, v->w, sizeof(float) * (size_t)(u->in * u->out)) ||
                memcmp(u->b, v->b, sizeof(float) * (size_t)u->out))
                fail_msg("%s: rank %u layer %d differs from the run without misuse", what, r, l);
        }
        if (x[r].res.last_loss != y[r].res.last_loss)
            fail_msg("%s: rank %u's last loss %.17g, %.17g without misuse", what, r,
                     x[r].res.last_loss, y[r].res.last_loss);
        assert_true(x[r].res.stats.act_sent_wire == y[r].res.stats.act_sent_wire);
        assert_true(x[r].res.stats.grad_sent_wire == y[r].res.stats.grad_sent_wire);
    }
}

/* Each configuration trained with and without the refused calls, by the
 * op stream (stream = 1) or by callbacks that make them from inside. */
static void refuse_while_training(int stream)
{
    static const struct {
        const char *kind;
        unsigned ranks, chunks, m;
        int split;
        const char *act, *grad;
    } runs[] = {
        {"gpipe", 2, 0, 4, 0, NULL, NULL},
        {"1f1b", 3, 0, 4, 0, "quant:bits=8", "sortquant:bits=4,ef=1"},
        {"1f1b", 4, 0, 8, 0, "sortquant:bits=6", "quant:bits=4,ef=1"},
        {"interleaved", 2, 2, 4, 0, "cast:dtype=bf16", NULL},
        {"zb-h1", 3, 0, 4, 1, NULL, "quant:bits=8,ef=1"},
        {"1f1b-async", 3, 0, 4, 0, NULL, NULL},
        {"1f1b-2bw", 2, 0, 4, 0, "quant:bits=8", NULL},
    };
    unsigned total = 0, seen[M_COUNT] = {0};
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        for (uint64_t seed = 1; seed <= 3; seed++) {
            struct host_config cfg = {.schedule = runs[i].kind,
                                      .microbatches = runs[i].m,
                                      .steps = STEPS,
                                      .use_op_stream = stream,
                                      .split = runs[i].split,
                                      .chunks = runs[i].chunks,
                                      .act_codec = runs[i].act,
                                      .grad_codec = runs[i].grad};
            struct host_rank clean[MAX_P], dirty[MAX_P];
            run_ranks(runs[i].ranks, &cfg, clean);
            struct misuse_run mr = {.seed = seed * 1000003 + i};
            cfg.before_call = refuse_some;
            cfg.hook_arg = &mr;
            run_ranks(runs[i].ranks, &cfg, dirty);
            char what[96];
            snprintf(what, sizeof what, "%s on %u ranks, seed %llu", runs[i].kind, runs[i].ranks,
                     (unsigned long long)seed);
            assert_same_training(dirty, clean, runs[i].ranks, what);
            for (unsigned r = 0; r < runs[i].ranks; r++) {
                assert_true(mr.made[r] > 0);
                total += mr.made[r];
                for (int w = 0; w < M_COUNT; w++)
                    seen[w] += mr.kinds_seen[r][w];
                host_result_free(&clean[r].res);
                host_result_free(&dirty[r].res);
            }
        }
    }
    unsigned least = ~0u;
    for (int w = 0; w < M_COUNT; w++) {
        if (!stream && w == M_BAD_TENSOR)
            continue; /* callbacks do not send: their sends are refused as calls */
        least = seen[w] < least ? seen[w] : least;
        if (!seen[w])
            fail_msg("misuse %d was never made", w);
    }
    print_message("%u refused calls, each kind of misuse at least %u times\n", total, least);
}

static void refused_calls_change_nothing(void **state)
{
    (void)state;
    refuse_while_training(1);
}

/* The calls that drive the stage, made from inside its callbacks while
 * epipe_stage_step runs them, are refused and change nothing either; they
 * used to run (a next_op there skipped the op the step was in). */
static void calls_from_inside_a_callback_are_refused(void **state)
{
    (void)state;
    refuse_while_training(0);
}

/* epipe_stage_destroy from inside a callback is not carried out (it would
 * free the stage under the step that called it): an error is logged, the
 * step goes on, and the stage is freed by the host's later destroy. */
static struct {
    epipe_stage *st;
    int called, logged;
} self_destroy;

static void count_destroy_line(void *user, int level, const char *subsys, int rank,
                               const char *message)
{
    (void)user, (void)subsys, (void)rank;
    if (level == EPIPE_LOG_ERROR && strstr(message, "epipe_stage_destroy called from inside"))
        self_destroy.logged++;
}

static int destroying_forward(void *user, unsigned mb, const DLTensor *in, const DLTensor **out)
{
    self_destroy.called++;
    epipe_stage_destroy(self_destroy.st);
    return 0;
}

static int plain_backward(void *user, unsigned mb, const DLTensor *gout, const DLTensor **gin)
{
    return 0;
}

static void destroy_from_inside_a_callback_is_refused(void **state)
{
    (void)state;
    epipe_comm *c[1];
    assert_int_equal(epipe_comm_create_inproc(c, 1), EPIPE_OK);
    assert_int_equal(epipe_stage_create(&self_destroy.st, c[0], "1f1b", 2), EPIPE_OK);
    epipe_stage_callbacks cb = EPIPE_STAGE_CALLBACKS_INIT;
    cb.forward = destroying_forward;
    cb.backward = plain_backward;
    assert_int_equal(epipe_stage_set_callbacks(self_destroy.st, &cb), EPIPE_OK);
    epipe_set_log_callback(count_destroy_line, NULL);
    assert_int_equal(epipe_stage_step(self_destroy.st), EPIPE_OK);
    epipe_set_log_callback(NULL, NULL);
    assert_int_equal(self_destroy.called, 2);
    assert_int_equal(self_destroy.logged, 2);
    epipe_stage_stats s = {.struct_size = sizeof s};
    assert_int_equal(epipe_stage_get_stats(self_destroy.st, &s), EPIPE_OK);
    assert_int_equal(s.steps, 1);
    epipe_stage_destroy(self_destroy.st);
    epipe_comm_destroy(c[0]);
}

/* One thread at a time (epipe/stage.h): while one thread waits inside a
 * receive, every call that drives the stage from another thread is
 * refused with EPIPE_ESTATE naming the call inside, and changes nothing:
 * the step then ends as it would have. */
struct waiter {
    epipe_stage *st;
    int ready, rc[4];
    float got[4];
};

static void *wait_in_receive(void *p)
{
    struct waiter *w = p;
    epipe_op op;
    const DLTensor *in = NULL;
    w->rc[0] = epipe_stage_next_op(w->st, &op);
    __atomic_store_n(&w->ready, 1, __ATOMIC_RELEASE);
    do /* this thread's claim may meet the other's probe: then again */
        w->rc[1] = epipe_stage_recv_activation(w->st, 0, &in);
    while (w->rc[1] == EPIPE_ESTATE && strstr(epipe_last_error(), "another thread is inside"));
    if (w->rc[1] == EPIPE_OK)
        memcpy(w->got, in->data, sizeof w->got);
    float g[4] = {1, 1, 1, 1};
    int64_t shape;
    DLTensor t = test_view_f32(g, &shape, 4);
    w->rc[2] = epipe_stage_next_op(w->st, &op) ||
               epipe_stage_send_gradient(w->st, op.microbatch, &t);
    w->rc[3] = epipe_stage_next_op(w->st, &op) || op.kind != EPIPE_OP_NONE;
    return NULL;
}

static void a_second_thread_is_refused(void **state)
{
    (void)state;
    epipe_comm *comms[2];
    epipe_stage *st[2];
    assert_int_equal(epipe_comm_create_inproc(comms, 2), EPIPE_OK);
    for (int r = 0; r < 2; r++)
        assert_int_equal(epipe_stage_create(&st[r], comms[r], "gpipe", 1), EPIPE_OK);
    struct waiter w = {.st = st[1]};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, wait_in_receive, &w), 0);
    while (!__atomic_load_n(&w.ready, __ATOMIC_ACQUIRE))
        usleep(1000);
    /* A harmless probe (the timeout it has) until the receive holds the
     * stage: rank 0 has sent nothing, so it waits there. */
    int probe;
    while ((probe = epipe_stage_set_param(st[1], EPIPE_STAGE_TIMEOUT_MS, 30000)) == EPIPE_OK)
        usleep(1000);
    assert_int_equal(probe, EPIPE_ESTATE);
    assert_non_null(strstr(epipe_last_error(), "epipe_stage_set_param: another thread is inside "
                                               "epipe_stage_recv_activation"));
    epipe_op op;
    float x[4] = {7, 7, 7, 7};
    int64_t shape;
    DLTensor t = test_view_f32(x, &shape, 4);
    assert_int_equal(epipe_stage_next_op(st[1], &op), EPIPE_ESTATE);
    assert_non_null(strstr(epipe_last_error(), "epipe_stage_next_op: another thread is inside "
                                               "epipe_stage_recv_activation on stage 1"));
    assert_int_equal(epipe_stage_send_activation(st[1], 0, &t), EPIPE_ESTATE);
    assert_int_equal(epipe_stage_set_param(st[1], EPIPE_STAGE_TIMEOUT_MS, 10), EPIPE_ESTATE);
    assert_int_equal(epipe_stage_set_codec(st[1], EPIPE_DIR_ACTIVATION, 0, "quant:bits=4"),
                     EPIPE_ESTATE);
    assert_int_equal(epipe_stage_step(st[1]), EPIPE_ESTATE);
    epipe_stage_reset_stats(st[1]);
    assert_non_null(strstr(epipe_last_error(), "epipe_stage_reset_stats: another thread"));
    epipe_stage_destroy(st[1]); /* refused and logged: the stage stays */
    assert_null(strstr(epipe_stage_last_error(st[1]), "another thread"));
    /* Rank 0 sends: the waiting receive and the rest of the step go on. */
    const DLTensor *g = NULL;
    assert_int_equal(epipe_stage_next_op(st[0], &op), EPIPE_OK);
    assert_int_equal(epipe_stage_send_activation(st[0], 0, &t), EPIPE_OK);
    assert_int_equal(epipe_stage_next_op(st[0], &op), EPIPE_OK);
    assert_int_equal(epipe_stage_recv_gradient(st[0], 0, &g), EPIPE_OK);
    assert_int_equal(epipe_stage_next_op(st[0], &op), EPIPE_OK);
    assert_int_equal(op.kind, EPIPE_OP_NONE);
    pthread_join(th, NULL);
    for (int i = 0; i < 4; i++)
        assert_int_equal(w.rc[i], EPIPE_OK);
    assert_memory_equal(w.got, x, sizeof x);
    /* The stage is free again: this thread may drive it now. */
    assert_int_equal(epipe_stage_set_param(st[1], EPIPE_STAGE_TIMEOUT_MS, 5000), EPIPE_OK);
    for (int r = 0; r < 2; r++) {
        epipe_stage_destroy(st[r]);
        epipe_comm_destroy(comms[r]);
    }
}

/* A receive inside epipe_stage_step that the host's interrupt check stops
 * (Ctrl-C) ends the step with EPIPE_ECALLBACK and aborts the communicator,
 * as a failing callback does: the peer waiting for this rank hears of it
 * at once, not at its timeout. */
static int stop_at_once(void *arg)
{
    (void)arg;
    return 1;
}

static int no_forward(void *user, unsigned mb, const DLTensor *in, const DLTensor **out)
{
    (void)user, (void)mb, (void)in, (void)out;
    return 1; /* never reached: the receive before it is stopped */
}

static int no_backward(void *user, unsigned mb, const DLTensor *g, const DLTensor **out)
{
    (void)user, (void)mb, (void)g, (void)out;
    return 1;
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void *wait_for_gradient(void *p)
{
    epipe_msg *m = NULL;
    epipe_comm *c = p;
    double t0 = now_s();
    int rc = epipe_comm_recv(c, 1, EPIPE_WIRE_GRADIENT, 0, 0, 20000, &m);
    return (void *)(intptr_t)(rc == EPIPE_EPEER && now_s() - t0 < 10 ? 1 : 0);
}

static void an_interrupted_step_aborts(void **state)
{
    (void)state;
    epipe_comm *comms[2];
    epipe_stage *st;
    assert_int_equal(epipe_comm_create_inproc(comms, 2), EPIPE_OK);
    assert_int_equal(epipe_stage_create(&st, comms[1], "gpipe", 1), EPIPE_OK);
    epipe_stage_callbacks cb = {
        .struct_size = sizeof cb, .forward = no_forward, .backward = no_backward};
    assert_int_equal(epipe_stage_set_callbacks(st, &cb), EPIPE_OK);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, wait_for_gradient, comms[0]), 0);
    assert_int_equal(epipe_comm_set_interrupt(comms[1], stop_at_once, NULL), EPIPE_OK);
    assert_int_equal(epipe_stage_step(st), EPIPE_ECALLBACK);
    assert_non_null(strstr(epipe_stage_last_error(st), "interrupt check stopped the wait"));
    void *heard;
    pthread_join(th, &heard);
    assert_true(heard != NULL); /* EPIPE_EPEER, well before its timeout */
    epipe_stage_destroy(st);
    epipe_comm_destroy(comms[0]);
    epipe_comm_destroy(comms[1]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(refused_calls_change_nothing),
        cmocka_unit_test(calls_from_inside_a_callback_are_refused),
        cmocka_unit_test(destroy_from_inside_a_callback_is_refused),
        cmocka_unit_test(a_second_thread_is_refused),
        cmocka_unit_test(an_interrupted_step_aborts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
