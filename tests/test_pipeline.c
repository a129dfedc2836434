/* The stage runtime over the in-process transport: codecs train comparably,
 * statistics add up, the trace is written, and bad use gets clear errors
 * (training equal to one process, over every transport: tests/conformance). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "pipeline_host.h"

#define STEPS 6
#define MAX_P 4

struct thread_arg {
    epipe_comm *comm;
    const struct host_config *cfg;
    struct host_result *res;
};

static void *stage_thread(void *p)
{
    struct thread_arg *a = p;
    host_run(a->comm, a->cfg, a->res);
    return NULL;
}

/* Runs a p-stage pipeline as p threads; res[0..p-1] get the results. */
static void run_pipeline(unsigned p, const struct host_config *cfg, struct host_result *res)
{
    epipe_comm *comms[MAX_P];
    pthread_t tid[MAX_P];
    struct thread_arg args[MAX_P];
    assert_int_equal(epipe_comm_create_inproc(comms, p), EPIPE_OK);
    for (unsigned s = 0; s < p; s++) {
        args[s] = (struct thread_arg){comms[s], cfg, &res[s]};
        assert_int_equal(pthread_create(&tid[s], NULL, stage_thread, &args[s]), 0);
    }
    for (unsigned s = 0; s < p; s++)
        pthread_join(tid[s], NULL);
}

static double rel_diff(float a, float b)
{
    double d = fabs((double)a - (double)b), m = fmax(fabs((double)a), fabs((double)b));
    return m > 1e-30 ? d / m : d;
}

static void assert_params_match(const struct host_result *res, unsigned p, const mlp_layer *ref,
                                double tol)
{
    for (unsigned s = 0; s < p; s++)
        for (int l = 0; l < host_nlayers; l++) {
            if (!res[s].owns[l])
                continue;
            const mlp_layer *a = &res[s].layers[l], *b = &ref[l];
            for (int i = 0; i < a->in * a->out; i++)
                if (rel_diff(a->w[i], b->w[i]) > tol)
                    fail_msg("stage %u layer %d w[%d]: %.9g vs %.9g", s, l, i, a->w[i], b->w[i]);
            for (int o = 0; o < a->out; o++)
                if (rel_diff(a->b[o], b->b[o]) > tol)
                    fail_msg("stage %u layer %d b[%d]: %.9g vs %.9g", s, l, o, a->b[o], b->b[o]);
        }
}

static void check_ok(const struct host_result *res, unsigned p, const char *what)
{
    for (unsigned s = 0; s < p; s++)
        if (res[s].rc != EPIPE_OK)
            fail_msg("%s: stage %u failed with %s: %s", what, s, epipe_status_name(res[s].rc),
                     res[s].error);
}

/* With sortquant:bits=8 on activations and gradients, the loss falls about
 * as far as without compression. */
static void sortquant_trains_comparably(void **state)
{
    (void)state;
    struct host_config cfg = {.schedule = "1f1b",
                              .microbatches = 4,
                              .steps = 20,
                              .act_codec = "sortquant:bits=8",
                              .grad_codec = "sortquant:bits=8"};
    struct host_result res[3], plain[3];
    run_pipeline(3, &cfg, res);
    check_ok(res, 3, "sortquant");
    cfg.act_codec = cfg.grad_codec = NULL;
    run_pipeline(3, &cfg, plain);
    check_ok(plain, 3, "none");
    double fell = res[2].first_loss - res[2].last_loss;
    double fell_plain = plain[2].first_loss - plain[2].last_loss;
    print_message("loss %.5f -> %.5f with sortquant:bits=8, %.5f -> %.5f without\n",
                  res[2].first_loss, res[2].last_loss, plain[2].first_loss, plain[2].last_loss);
    assert_true(fell_plain > 0);
    assert_true(fell > 0.9 * fell_plain);
    /* compressed: each message carries its 192 + 16 header bytes, one byte a
     * value (48 of them), the fit word (4) and, for so few values, a
     * one-chunk table (8 bytes: mode=fit keeps its table within an eighth
     * of the codes), against 4 bytes a value raw */
    uint64_t msgs = 20 * 4;
    assert_int_equal(res[0].stats.act_sent_raw, msgs * 48 * 4);
    assert_int_equal(res[0].stats.act_sent_wire, msgs * (192 + 16 + 48 + 4 + 8));
    assert_int_equal(res[1].stats.grad_sent_wire, msgs * (192 + 16 + 48 + 4 + 8));
    for (int s = 0; s < 3; s++)
        host_result_free(&res[s]), host_result_free(&plain[s]);
}

/* A gradient codec with error feedback (quant:bits=4,ef=1) trains as well
 * as without compression; the stage keys its residuals by micro-batch.
 * ef=1 on the activations is refused. */
static void error_feedback_on_gradients(void **state)
{
    (void)state;
    struct host_config cfg = {.schedule = "1f1b",
                              .microbatches = 4,
                              .steps = 20,
                              .act_codec = "sortquant:bits=8",
                              .grad_codec = "quant:bits=4,ef=1"};
    struct host_result res[3], plain[3];
    run_pipeline(3, &cfg, res);
    check_ok(res, 3, "quant:bits=4,ef=1");
    cfg.act_codec = cfg.grad_codec = NULL;
    run_pipeline(3, &cfg, plain);
    check_ok(plain, 3, "none");
    double fell = res[2].first_loss - res[2].last_loss;
    double fell_plain = plain[2].first_loss - plain[2].last_loss;
    print_message("loss %.5f -> %.5f with quant:bits=4,ef=1 gradients, %.5f -> %.5f without\n",
                  res[2].first_loss, res[2].last_loss, plain[2].first_loss, plain[2].last_loss);
    assert_true(fell_plain > 0);
    assert_true(fell > 0.9 * fell_plain);
    for (int s = 0; s < 3; s++)
        host_result_free(&res[s]), host_result_free(&plain[s]);
    epipe_comm *comms[2];
    epipe_stage *st;
    assert_int_equal(epipe_comm_create_inproc(comms, 2), EPIPE_OK);
    assert_int_equal(epipe_stage_create(&st, comms[0], "gpipe", 2), EPIPE_OK);
    assert_int_equal(epipe_stage_set_codec(st, EPIPE_DIR_ACTIVATION, 0, "quant:bits=4,ef=1"),
                     EPIPE_EINVAL);
    assert_non_null(strstr(epipe_stage_last_error(st), "ef=1 (error feedback) is for gradients"));
    assert_int_equal(epipe_stage_set_codec(st, EPIPE_DIR_GRADIENT, 0, "quant:bits=4,ef=1"),
                     EPIPE_OK);
    epipe_stage_destroy(st);
    epipe_comm_destroy(comms[0]);
    epipe_comm_destroy(comms[1]);
}

/* Relative squared error of a boundary's restored activations against the
 * ones sent, over one step (k = 0: first, 1: last). */
static double recon_error(const struct host_result *sender, const struct host_result *receiver,
                          int k, size_t n)
{
    double e = 0, ref = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)sender->act_sent[k][i] - receiver->act_recv[k][i];
        e += d * d;
        ref += (double)sender->act_sent[k][i] * sender->act_sent[k][i];
    }
    return e / ref;
}

/* The insert codec needs the blas feature; without it its tests report a
 * skip with the reason (the codec itself answers EPIPE_ENOTSUP). */
#ifdef EPIPE_HAVE_BLAS
#define SKIP_WITHOUT_BLAS() ((void)0)
#else
#define SKIP_WITHOUT_BLAS()                                                                        \
    do {                                                                                           \
        print_message("insert needs OpenBLAS/LAPACKE: built with -Dblas=disabled\n");              \
        skip();                                                                                    \
    } while (0)
#endif

/* A trainable codec on the boundaries, wired through the stage. First, a
 * square insert (12 -> 12, frozen): its compress is orthogonal and its
 * restore the transpose, so the pipeline must train like the reference to
 * rounding; a wrong transpose anywhere in the two backwards would not. */
static void square_insert_trains_like_the_reference(void **state)
{
    (void)state;
    SKIP_WITHOUT_BLAS();
    struct host_config cfg = {.schedule = "1f1b",
                              .microbatches = 4,
                              .steps = STEPS,
                              .act_codec = "insert:kind=linear,out=12"};
    struct host_result res[3];
    mlp_layer ref[HOST_MAX_LAYERS];
    double f, l;
    host_reference(4, STEPS, ref, &f, &l);
    run_pipeline(3, &cfg, res);
    check_ok(res, 3, "insert out=12");
    assert_params_match(res, 3, ref, 2e-3);
    assert_true(fabs(res[2].last_loss - l) < 1e-4 * fabs(l) + 1e-7);
    for (int s = 0; s < 3; s++)
        host_result_free(&res[s]);
    for (int i = 0; i < host_nlayers; i++)
        mlp_layer_free(&ref[i]);
}

/* Then a compressing one (12 -> 8) that trains with the model through the
 * built-in SGD: the loss falls, and ends lower than with the same codec
 * frozen at its initial projection, so the codec's own gradients help. The
 * gradients that cross are the code's: 8 values a row, not 12.
 *
 * The boundaries' reconstruction error |x - restore(compress(x))|^2/|x|^2
 * is printed, not asserted: nothing in task-loss training asks for it to
 * fall, and on this model it does not everywhere (docs/runtime.md). */
static void insert_trains_with_the_model(void **state)
{
    (void)state;
    SKIP_WITHOUT_BLAS();
    const int steps = 60;
    for (int op_stream = 0; op_stream < 2; op_stream++) {
        struct host_config cfg = {.schedule = op_stream ? "gpipe" : "1f1b",
                                  .microbatches = 4,
                                  .steps = steps,
                                  .act_codec = "insert:kind=linear,out=8",
                                  .grad_codec = NULL,
                                  .use_op_stream = op_stream,
                                  .codec_lr = 0.1,
                                  .codec_momentum = 0.9};
        struct host_result res[3], frozen[3];
        run_pipeline(3, &cfg, res);
        check_ok(res, 3, "insert");
        cfg.codec_lr = 0;
        run_pipeline(3, &cfg, frozen);
        check_ok(frozen, 3, "insert, frozen");
        size_t n = HOST_BATCH * 12;
        double e0[2], e1[2];
        for (int k = 0; k < 2; k++) {
            e0[k] = recon_error(&res[0], &res[1], k, n);
            e1[k] = recon_error(&res[1], &res[2], k, n);
        }
        print_message("insert (%s): loss %.5f -> %.5f (frozen codec: %.5f); reconstruction "
                      "error %.4f -> %.4f (boundary 0), %.4f -> %.4f (boundary 1)\n",
                      cfg.schedule, res[2].first_loss, res[2].last_loss, frozen[2].last_loss, e0[0],
                      e0[1], e1[0], e1[1]);
        assert_true(res[2].last_loss < 0.75 * res[2].first_loss);
        assert_true(res[2].last_loss < frozen[2].last_loss);
        assert_true(e0[1] < 1 && e1[1] < 1); /* the restore still restores */
        uint64_t msgs = (uint64_t)steps * 4, rows = HOST_BATCH / 4;
        assert_int_equal(res[0].stats.act_sent_raw, msgs * rows * 12 * 4);
        assert_int_equal(res[0].stats.act_sent_wire, msgs * (192 + 16 + rows * 8 * 4));
        /* Raw bytes are the host's gradient (12 wide); the wire carries the
         * code's (8 wide). */
        assert_int_equal(res[1].stats.grad_sent_raw, msgs * rows * 12 * 4);
        assert_int_equal(res[0].stats.grad_recv_raw, msgs * rows * 12 * 4);
        assert_int_equal(res[1].stats.grad_sent_wire, msgs * (192 + 16 + rows * 8 * 4));
        assert_int_equal(res[0].stats.grad_recv_wire, res[1].stats.grad_sent_wire);
        for (int s = 0; s < 3; s++)
            host_result_free(&res[s]), host_result_free(&frozen[s]);
    }
}

/* A chain on the activations (the code quantized to 8 bits) and sortquant
 * on the code's gradient: the model still trains. */
static void insert_chain_trains(void **state)
{
    (void)state;
    SKIP_WITHOUT_BLAS();
    struct host_config cfg = {.schedule = "1f1b",
                              .microbatches = 4,
                              .steps = 60,
                              .act_codec = "insert:kind=linear,out=8|sortquant:bits=8",
                              .grad_codec = "sortquant:bits=8",
                              .codec_lr = 0.1,
                              .codec_momentum = 0.9};
    struct host_result res[3];
    run_pipeline(3, &cfg, res);
    check_ok(res, 3, "insert|sortquant");
    print_message("insert|sortquant: loss %.5f -> %.5f, activation wire %llu of %llu raw bytes\n",
                  res[2].first_loss, res[2].last_loss,
                  (unsigned long long)res[0].stats.act_sent_wire,
                  (unsigned long long)res[0].stats.act_sent_raw);
    assert_true(res[2].last_loss < 0.75 * res[2].first_loss);
    for (int s = 0; s < 3; s++)
        host_result_free(&res[s]);
}

/* The stage API around trainable codecs: each side's codec, parameters for
 * the host's optimizer, and what is refused. */
static void stage_exposes_its_codecs(void **state)
{
    (void)state;
    SKIP_WITHOUT_BLAS();
    epipe_comm *comms[2];
    epipe_stage *st[2];
    assert_int_equal(epipe_comm_create_inproc(comms, 2), EPIPE_OK);
    for (int s = 0; s < 2; s++) {
        assert_int_equal(epipe_stage_create(&st[s], comms[s], "gpipe", 2), EPIPE_OK);
        assert_int_equal(
            epipe_stage_set_codec(st[s], EPIPE_DIR_ACTIVATION, 0, "insert:kind=linear,out=8,in=12"),
            EPIPE_OK);
        assert_int_equal(
            epipe_stage_set_codec(st[s], EPIPE_DIR_GRADIENT, 0, "insert:kind=linear,out=8"),
            EPIPE_ENOTSUP);
        assert_non_null(strstr(epipe_stage_last_error(st[s]), "trainable"));
    }
    assert_null(epipe_stage_codec(st[0], EPIPE_DIR_ACTIVATION, EPIPE_SIDE_UP));
    assert_null(epipe_stage_codec(st[1], EPIPE_DIR_ACTIVATION, EPIPE_SIDE_DOWN));
    epipe_codec *enc = epipe_stage_codec(st[0], EPIPE_DIR_ACTIVATION, EPIPE_SIDE_DOWN);
    epipe_codec *dec = epipe_stage_codec(st[1], EPIPE_DIR_ACTIVATION, EPIPE_SIDE_UP);
    assert_true(epipe_codec_trainable(enc) && epipe_codec_trainable(dec));
    assert_string_equal(
        epipe_codec_name(epipe_stage_codec(st[0], EPIPE_DIR_GRADIENT, EPIPE_SIDE_DOWN)), "none");
    DLTensor *w, *g;
    assert_int_equal(epipe_codec_tensor(enc, 0, NULL, &w, &g), EPIPE_OK);
    assert_true(w->ndim == 2 && w->shape[0] == 8 && w->shape[1] == 12);
    /* The built-in step with zero gradients changes nothing. */
    float w0 = ((float *)w->data)[3];
    assert_int_equal(epipe_stage_codec_sgd_step(st[0], 0.1, 0.9), EPIPE_OK);
    assert_true(((float *)w->data)[3] == w0);
    assert_int_equal(epipe_stage_codec_sgd_step(st[0], -0.1, 0.9), EPIPE_EINVAL);
    for (int s = 0; s < 2; s++) {
        epipe_stage_destroy(st[s]);
        epipe_comm_destroy(comms[s]);
    }
}

/* What one stage sends, its neighbour receives, byte for byte, and every
 * time counter moves. */
static void statistics_add_up(void **state)
{
    (void)state;
    struct host_config cfg = {
        .schedule = "1f1b", .microbatches = 4, .steps = 3, .act_codec = "cast:dtype=bf16"};
    struct host_result res[3];
    run_pipeline(3, &cfg, res);
    check_ok(res, 3, "stats");
    for (int s = 0; s < 2; s++) {
        const epipe_stage_stats *a = &res[s].stats, *b = &res[s + 1].stats;
        assert_int_equal(a->act_sent_raw, b->act_recv_raw);
        assert_int_equal(a->act_sent_wire, b->act_recv_wire);
        assert_int_equal(a->grad_recv_raw, b->grad_sent_raw);
        assert_int_equal(a->grad_recv_wire, b->grad_sent_wire);
        /* 3 steps x 4 micro-batches x 4 rows x 12 floats */
        assert_int_equal(a->act_sent_raw, 3 * 4 * 4 * 12 * 4);
        /* per message: the 192-byte wire header, the 16-byte codec header, and
         * the body: bf16 halves the activations, none sends the gradients whole */
        assert_int_equal(a->act_sent_wire, 3 * 4 * (192 + 16 + 4 * 12 * 2));
        assert_int_equal(a->grad_recv_wire, 3 * 4 * (192 + 16 + 4 * 12 * 4));
    }
    for (int s = 0; s < 3; s++) {
        assert_int_equal(res[s].stats.steps, 3);
        assert_true(res[s].stats.step_seconds > 0);
        assert_true(res[s].stats.compute_seconds > 0);
        assert_true(res[s].stats.compute_seconds <= res[s].stats.step_seconds);
        /* codec time where there is a boundary, waits never negative, and
         * compute + codec + wait inside the step (sends complete async) */
        const epipe_stage_stats *t = &res[s].stats;
        assert_true(t->encode_seconds > 0 && t->decode_seconds > 0);
        assert_true(t->wait_seconds >= 0);
        assert_true(t->compute_seconds + t->encode_seconds + t->decode_seconds + t->wait_seconds <=
                    t->step_seconds * 1.01 + 1e-3);
    }
    assert_int_equal(res[2].stats.loss_count, 12);
    assert_true(res[2].stats.loss_sum > 0);
    for (int s = 0; s < 3; s++)
        host_result_free(&res[s]);
}

/* 1 when some line of the trace holds an event with this name on stage
 * `stage` (process id stage + 1). */
static int trace_has(const char *text, const char *name, unsigned stage)
{
    char want_name[64], want_pid[32];
    snprintf(want_name, sizeof want_name, "\"name\": \"%s\"", name);
    snprintf(want_pid, sizeof want_pid, "\"pid\": %u,", stage + 1);
    for (const char *line = text; line && *line;) {
        const char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line) : strlen(line);
        char buf[512];
        if (len < sizeof buf) {
            memcpy(buf, line, len);
            buf[len] = '\0';
            if (strstr(buf, want_name) && strstr(buf, want_pid) && strstr(buf, "\"ph\": \"X\""))
                return 1;
        }
        line = end ? end + 1 : NULL;
    }
    return 0;
}

/* Every op of every stage is in the trace, on that stage's own track, with
 * the codec and wait spans around them. */
static void trace_file_is_written(void **state)
{
    (void)state;
    char path[] = "/tmp/epipe-trace-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    setenv("EPIPE_TRACE", path, 1);
    enum { P = 3, M = 4 };
    struct host_config cfg = {.schedule = "1f1b", .microbatches = M, .steps = 1};
    struct host_result res[P];
    run_pipeline(P, &cfg, res);
    unsetenv("EPIPE_TRACE");
    check_ok(res, P, "trace");
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    static char text[1 << 18];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    unlink(path);
    text[n] = '\0';
    assert_non_null(strstr(text, "\"traceEvents\""));
    for (unsigned s = 0; s < P; s++) {
        char track[32];
        snprintf(track, sizeof track, "\"stage %u\"", s);
        assert_non_null(strstr(text, track));
        for (unsigned mb = 0; mb < M; mb++) {
            char op[16];
            snprintf(op, sizeof op, "F%u", mb);
            if (!trace_has(text, op, s))
                fail_msg("trace: no %s on stage %u", op, s);
            snprintf(op, sizeof op, "B%u", mb);
            if (!trace_has(text, op, s))
                fail_msg("trace: no %s on stage %u", op, s);
        }
        if (s + 1 < P && (!trace_has(text, "encode", s) || !trace_has(text, "wait-grad", s)))
            fail_msg("trace: stage %u lacks its encode or wait-grad spans", s);
        if (s > 0 && (!trace_has(text, "decode", s) || !trace_has(text, "wait-act", s)))
            fail_msg("trace: stage %u lacks its decode or wait-act spans", s);
    }
    for (int s = 0; s < P; s++)
        host_result_free(&res[s]);
}

/* ---- bad use ------------------------------------------------------------- */

static float data8[64];

static DLTensor tensor2d(int64_t *shape, int64_t rows, int64_t cols)
{
    shape[0] = rows, shape[1] = cols;
    DLTensor t = {.data = data8,
                  .device = {kDLCPU, 0},
                  .ndim = 2,
                  .dtype = {kDLFloat, 32, 1},
                  .shape = shape};
    return t;
}

static void expect_error(epipe_stage *st, int rc, int want, const char *needle)
{
    if (rc != want || !strstr(epipe_stage_last_error(st), needle))
        fail_msg("got %s '%s', wanted %s mentioning '%s'", epipe_status_name(rc),
                 epipe_stage_last_error(st), epipe_status_name(want), needle);
}

static void wrong_op_order_is_refused(void **state)
{
    (void)state;
    epipe_comm *c[2];
    epipe_stage *st;
    epipe_op op;
    int64_t shape[2];
    DLTensor t = tensor2d(shape, 2, 4);
    const DLTensor *in;
    assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
    assert_int_equal(epipe_stage_create(&st, c[0], "1f1b", 2), EPIPE_OK);
    expect_error(st, epipe_stage_send_activation(st, 0, &t), EPIPE_ESTATE, "call next_op first");
    assert_int_equal(epipe_stage_next_op(st, &op), EPIPE_OK);
    assert_int_equal(op.kind, EPIPE_OP_FORWARD);
    assert_int_equal(op.microbatch, 0);
    expect_error(st, epipe_stage_recv_activation(st, 0, &in), EPIPE_ESTATE, "nothing to receive");
    expect_error(st, epipe_stage_send_activation(st, 1, &t), EPIPE_ESTATE,
                 "during the forward of micro-batch 0");
    expect_error(st, epipe_stage_send_gradient(st, 0, &t), EPIPE_ESTATE, "during the forward");
    expect_error(st, epipe_stage_next_op(st, &op), EPIPE_ESTATE, "without sending its activation");
    assert_int_equal(epipe_stage_send_activation(st, 0, &t), EPIPE_OK);
    expect_error(st, epipe_stage_send_activation(st, 0, &t), EPIPE_ESTATE, "called twice");
    assert_int_equal(epipe_stage_next_op(st, &op), EPIPE_OK);
    assert_int_equal(op.kind, EPIPE_OP_FORWARD);
    int64_t shape2[2];
    DLTensor bad = tensor2d(shape2, 2, 4);
    bad.dtype.code = kDLInt;
    expect_error(st, epipe_stage_send_activation(st, 1, &bad), EPIPE_EINVAL, "dtype");
    /* micro-batch 1 may send another shape than micro-batch 0 did */
    DLTensor t2 = tensor2d(shape2, 3, 4);
    assert_int_equal(epipe_stage_send_activation(st, 1, &t2), EPIPE_OK);
    expect_error(st, epipe_stage_step(st), EPIPE_ESTATE, "callbacks");
    epipe_stage_destroy(st);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
}

/* A gradient handed back must have the shape and dtype of the activation it
 * is the gradient of: the stage that sends it says so, before the wire. */
static void gradient_shape_must_match_activation(void **state)
{
    (void)state;
    epipe_comm *c[2];
    epipe_stage *s0, *s1;
    epipe_op op;
    int64_t shape[2], shape_bad[2];
    DLTensor t = tensor2d(shape, 2, 4);
    const DLTensor *in;
    assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
    assert_int_equal(epipe_stage_create(&s0, c[0], "gpipe", 1), EPIPE_OK);
    assert_int_equal(epipe_stage_create(&s1, c[1], "gpipe", 1), EPIPE_OK);
    assert_int_equal(epipe_stage_next_op(s0, &op), EPIPE_OK);
    assert_int_equal(op.kind, EPIPE_OP_FORWARD);
    assert_int_equal(epipe_stage_send_activation(s0, 0, &t), EPIPE_OK);
    assert_int_equal(epipe_stage_next_op(s1, &op), EPIPE_OK);
    assert_int_equal(op.kind, EPIPE_OP_FORWARD);
    assert_int_equal(epipe_stage_recv_activation(s1, 0, &in), EPIPE_OK);
    assert_int_equal(in->shape[0], 2);
    assert_int_equal(in->shape[1], 4);
    assert_int_equal(epipe_stage_next_op(s1, &op), EPIPE_OK);
    assert_int_equal(op.kind, EPIPE_OP_BACKWARD);
    DLTensor bad = tensor2d(shape_bad, 2, 5);
    expect_error(s1, epipe_stage_send_gradient(s1, 0, &bad), EPIPE_EINVAL, "shape");
    DLTensor badt = tensor2d(shape_bad, 2, 4);
    badt.dtype.bits = 16;
    expect_error(s1, epipe_stage_send_gradient(s1, 0, &badt), EPIPE_EINVAL, "dtype");
    epipe_stage_destroy(s0);
    epipe_stage_destroy(s1);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
}

/* Codecs are independent per boundary and per direction: over three stages,
 * bf16 activations on boundary 0, fp16 gradients on boundary 1, none on
 * the other two; the wire bytes of each say which codec carried them. */
static void codecs_per_boundary_and_direction(void **state)
{
    (void)state;
    enum { P = 3 };
    epipe_comm *c[P];
    epipe_stage *st[P];
    epipe_op op;
    int64_t shape[2];
    DLTensor t = tensor2d(shape, 2, 4); /* 8 floats */
    const DLTensor *in;
    assert_int_equal(epipe_comm_create_inproc(c, P), EPIPE_OK);
    for (int s = 0; s < P; s++) {
        assert_int_equal(epipe_stage_create(&st[s], c[s], "gpipe", 1), EPIPE_OK);
        assert_int_equal(epipe_stage_set_codec(st[s], EPIPE_DIR_ACTIVATION, 0, "cast:dtype=bf16"),
                         EPIPE_OK);
        assert_int_equal(epipe_stage_set_codec(st[s], EPIPE_DIR_GRADIENT, 1, "cast:dtype=fp16"),
                         EPIPE_OK);
    }
    /* forwards, in pipeline order (sends do not block) */
    for (int s = 0; s < P; s++) {
        assert_int_equal(epipe_stage_next_op(st[s], &op), EPIPE_OK);
        assert_int_equal(op.kind, EPIPE_OP_FORWARD);
        if (s > 0) {
            assert_int_equal(epipe_stage_recv_activation(st[s], 0, &in), EPIPE_OK);
            assert_int_equal(in->shape[1], 4);
        }
        if (s < P - 1)
            assert_int_equal(epipe_stage_send_activation(st[s], 0, &t), EPIPE_OK);
    }
    /* backwards, in reverse order */
    for (int s = P - 1; s >= 0; s--) {
        assert_int_equal(epipe_stage_next_op(st[s], &op), EPIPE_OK);
        assert_int_equal(op.kind, EPIPE_OP_BACKWARD);
        if (s < P - 1)
            assert_int_equal(epipe_stage_recv_gradient(st[s], 0, &in), EPIPE_OK);
        if (s > 0)
            assert_int_equal(epipe_stage_send_gradient(st[s], 0, &t), EPIPE_OK);
    }
    for (int s = 0; s < P; s++) {
        assert_int_equal(epipe_stage_next_op(st[s], &op), EPIPE_OK);
        assert_int_equal(op.kind, EPIPE_OP_NONE);
    }
    epipe_stage_stats a[P];
    for (int s = 0; s < P; s++) {
        memset(&a[s], 0, sizeof a[s]);
        a[s].struct_size = sizeof a[s];
        assert_int_equal(epipe_stage_get_stats(st[s], &a[s]), EPIPE_OK);
    }
    /* header 192 + codec header 16 + body: 2 bytes a value for bf16/fp16 */
    assert_int_equal(a[0].act_sent_wire, 192 + 16 + 8 * 2);  /* boundary 0 down: bf16 */
    assert_int_equal(a[1].act_sent_wire, 192 + 16 + 8 * 4);  /* boundary 1 down: none */
    assert_int_equal(a[1].grad_sent_wire, 192 + 16 + 8 * 4); /* boundary 0 up: none */
    assert_int_equal(a[2].grad_sent_wire, 192 + 16 + 8 * 2); /* boundary 1 up: fp16 */
    assert_int_equal(a[1].act_recv_wire, a[0].act_sent_wire);
    assert_int_equal(a[0].grad_recv_wire, a[1].grad_sent_wire);
    for (int s = 0; s < P; s++) {
        epipe_stage_destroy(st[s]);
        epipe_comm_destroy(c[s]);
    }
}

static void bad_configuration_is_refused(void **state)
{
    (void)state;
    epipe_comm *c[3];
    epipe_stage *st = NULL;
    assert_int_equal(epipe_comm_create_inproc(c, 3), EPIPE_OK);
    assert_int_equal(epipe_stage_create(&st, c[1], "zigzag", 4), EPIPE_EINVAL);
    assert_null(st);
    assert_non_null(strstr(epipe_last_error(), "zigzag"));
    assert_int_equal(epipe_stage_create(&st, c[1], "1f1b", 0), EPIPE_EINVAL);
    assert_int_equal(epipe_stage_create(&st, c[1], "1f1b", 4), EPIPE_OK);
    expect_error(st, epipe_stage_set_param(st, EPIPE_STAGE_BATCH_SIZE, 10), EPIPE_EINVAL,
                 "does not divide into 4 micro-batches");
    expect_error(st, epipe_stage_set_codec(st, EPIPE_DIR_ACTIVATION, 0, "quant:bits=99"),
                 EPIPE_EINVAL, "bits");
    expect_error(st, epipe_stage_set_codec(st, EPIPE_DIR_GRADIENT, 2, "none"), EPIPE_EINVAL,
                 "boundary 2 does not exist");
    assert_int_equal(epipe_stage_set_codec(st, EPIPE_DIR_GRADIENT, 1, "cast:dtype=bf16"), EPIPE_OK);
    epipe_stage_callbacks cb = EPIPE_STAGE_CALLBACKS_INIT;
    expect_error(st, epipe_stage_set_callbacks(st, &cb), EPIPE_EINVAL, "required");
    cb.struct_size = 4096;
    expect_error(st, epipe_stage_set_callbacks(st, &cb), EPIPE_EINVAL, "struct_size");
    epipe_stage_stats stats = {0};
    assert_int_equal(epipe_stage_get_stats(st, &stats), EPIPE_EINVAL);
    epipe_stage_destroy(st);
    for (int i = 0; i < 3; i++)
        epipe_comm_destroy(c[i]);
}

/* A receive with no sender times out; one from a rank that left or was
 * aborted fails at once with EPIPE_EPEER. */
static void dead_or_silent_peers(void **state)
{
    (void)state;
    epipe_comm *c[2];
    epipe_stage *st;
    epipe_op op;
    const DLTensor *in;
    assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
    assert_int_equal(epipe_stage_create(&st, c[1], "gpipe", 1), EPIPE_OK);
    assert_int_equal(epipe_stage_set_param(st, EPIPE_STAGE_TIMEOUT_MS, 50), EPIPE_OK);
    assert_int_equal(epipe_stage_next_op(st, &op), EPIPE_OK);
    expect_error(st, epipe_stage_recv_activation(st, 0, &in), EPIPE_ETIMEDOUT, "within 50 ms");
    epipe_comm_abort(c[0]);
    expect_error(st, epipe_stage_recv_activation(st, 0, &in), EPIPE_EPEER, "rank 0 failed");
    epipe_comm_destroy(c[0]);
    epipe_stage_destroy(st);
    epipe_comm_destroy(c[1]);

    assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
    assert_int_equal(epipe_stage_create(&st, c[1], "gpipe", 1), EPIPE_OK);
    epipe_comm_destroy(c[0]);
    assert_int_equal(epipe_stage_next_op(st, &op), EPIPE_OK);
    expect_error(st, epipe_stage_recv_activation(st, 0, &in), EPIPE_EPEER, "rank 0 left");
    epipe_stage_destroy(st);
    epipe_comm_destroy(c[1]);
}

static int failing_forward(void *user, unsigned mb, const DLTensor *in, const DLTensor **out)
{
    (void)user, (void)in, (void)out;
    return mb == 1 ? 42 : 0;
}

static int noop_backward(void *user, unsigned mb, const DLTensor *g, const DLTensor **gin)
{
    (void)user, (void)mb, (void)g, (void)gin;
    return 0;
}

static void failing_callback_stops_the_pipeline(void **state)
{
    (void)state;
    epipe_comm *c[1];
    epipe_stage *st;
    assert_int_equal(epipe_comm_create_inproc(c, 1), EPIPE_OK);
    assert_int_equal(epipe_stage_create(&st, c[0], "1f1b", 2), EPIPE_OK);
    epipe_stage_callbacks cb = EPIPE_STAGE_CALLBACKS_INIT;
    cb.forward = failing_forward;
    cb.backward = noop_backward;
    assert_int_equal(epipe_stage_set_callbacks(st, &cb), EPIPE_OK);
    expect_error(st, epipe_stage_step(st), EPIPE_ECALLBACK,
                 "forward callback of micro-batch 1 returned 42");
    epipe_stage_destroy(st);
    epipe_comm_destroy(c[0]);
}

/* Stages configured with different codecs for one boundary: the receiver
 * refuses the payload instead of misreading it. */
static void mismatched_codecs_are_caught(void **state)
{
    (void)state;
    epipe_comm *c[2];
    epipe_stage *a, *b;
    epipe_op op;
    int64_t shape[2];
    DLTensor t = tensor2d(shape, 2, 4);
    const DLTensor *in;
    assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
    assert_int_equal(epipe_stage_create(&a, c[0], "gpipe", 1), EPIPE_OK);
    assert_int_equal(epipe_stage_create(&b, c[1], "gpipe", 1), EPIPE_OK);
    assert_int_equal(epipe_stage_set_codec(a, EPIPE_DIR_ACTIVATION, 0, "cast:dtype=fp16"),
                     EPIPE_OK);
    assert_int_equal(epipe_stage_next_op(a, &op), EPIPE_OK);
    assert_int_equal(epipe_stage_send_activation(a, 0, &t), EPIPE_OK);
    assert_int_equal(epipe_stage_next_op(b, &op), EPIPE_OK);
    expect_error(b, epipe_stage_recv_activation(b, 0, &in), EPIPE_EPROTO, "codec id 2 (cast)");
    epipe_stage_destroy(a);
    epipe_stage_destroy(b);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
}

/* Forward-only steps (evaluation): forwards run and activations cross,
 * no backward is called and no gradient is sent. */
struct count_host {
    int fwd, bwd;
    float buf[8];
    int64_t shape[2];
    DLTensor t;
};

static int count_forward(void *user, unsigned mb, const DLTensor *in, const DLTensor **out)
{
    struct count_host *h = user;
    (void)mb, (void)in;
    h->fwd++;
    *out = &h->t;
    return 0;
}

static int count_backward(void *user, unsigned mb, const DLTensor *g, const DLTensor **gin)
{
    struct count_host *h = user;
    (void)mb, (void)g;
    h->bwd++;
    *gin = &h->t;
    return 0;
}

struct count_arg {
    epipe_comm *comm;
    struct count_host host;
    epipe_stage_stats stats;
    int rc, mid_step_rc;
    pthread_barrier_t *done; /* neither rank leaves before both are done */
};

static void *count_thread(void *p)
{
    struct count_arg *a = p;
    epipe_stage *st;
    a->host.shape[0] = 2, a->host.shape[1] = 4;
    a->host.t = (DLTensor){.data = a->host.buf,
                           .device = {kDLCPU, 0},
                           .ndim = 2,
                           .dtype = {kDLFloat, 32, 1},
                           .shape = a->host.shape};
    a->rc = epipe_stage_create(&st, a->comm, "1f1b", 4);
    epipe_stage_callbacks cb = EPIPE_STAGE_CALLBACKS_INIT;
    cb.user = &a->host;
    cb.forward = count_forward;
    cb.backward = count_backward;
    if (!a->rc)
        a->rc = epipe_stage_set_callbacks(st, &cb);
    if (!a->rc)
        a->rc = epipe_stage_step(st); /* one training step */
    if (!a->rc)
        a->rc = epipe_stage_set_param(st, EPIPE_STAGE_TRAINING, 0);
    for (int i = 0; !a->rc && i < 2; i++)
        a->rc = epipe_stage_step(st); /* two forward-only steps */
    epipe_op op;
    if (!a->rc && !(a->rc = epipe_stage_next_op(st, &op))) {
        a->mid_step_rc = epipe_stage_set_param(st, EPIPE_STAGE_TRAINING, 1);
        a->rc = epipe_comm_rank(a->comm) == 0 ? epipe_stage_send_activation(st, 0, &a->host.t)
                                              : EPIPE_OK;
    }
    a->stats.struct_size = sizeof a->stats;
    epipe_stage_get_stats(st, &a->stats);
    /* Rank 0's mid-step send must find rank 1 still there: a send to a
     * rank that has left is EPIPE_EPEER, as it should be. */
    pthread_barrier_wait(a->done);
    epipe_stage_destroy(st);
    epipe_comm_destroy(a->comm);
    return NULL;
}

static void forward_only_steps(void **state)
{
    (void)state;
    epipe_comm *c[2];
    struct count_arg a[2];
    pthread_t tid[2];
    pthread_barrier_t done;
    memset(a, 0, sizeof a);
    pthread_barrier_init(&done, NULL, 2);
    assert_int_equal(epipe_comm_create_inproc(c, 2), EPIPE_OK);
    for (int s = 0; s < 2; s++) {
        a[s].comm = c[s];
        a[s].done = &done;
        pthread_create(&tid[s], NULL, count_thread, &a[s]);
    }
    for (int s = 0; s < 2; s++)
        pthread_join(tid[s], NULL);
    pthread_barrier_destroy(&done);
    for (int s = 0; s < 2; s++) {
        assert_int_equal(a[s].rc, EPIPE_OK);
        assert_int_equal(a[s].host.fwd, 4 + 2 * 4);
        assert_int_equal(a[s].host.bwd, 4);
        assert_int_equal(a[s].mid_step_rc, EPIPE_ESTATE);
    }
    /* 4 + 8 activations crossed (and one more sent mid-step), 4 gradients */
    assert_int_equal(a[0].stats.act_sent_raw, 13 * 8 * 4);
    assert_int_equal(a[0].stats.grad_recv_raw, 4 * 8 * 4);
    assert_int_equal(a[1].stats.act_recv_raw, 12 * 8 * 4);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(sortquant_trains_comparably),
        cmocka_unit_test(error_feedback_on_gradients),
        cmocka_unit_test(statistics_add_up),
        cmocka_unit_test(trace_file_is_written),
        cmocka_unit_test(wrong_op_order_is_refused),
        cmocka_unit_test(gradient_shape_must_match_activation),
        cmocka_unit_test(codecs_per_boundary_and_direction),
        cmocka_unit_test(bad_configuration_is_refused),
        cmocka_unit_test(dead_or_silent_peers),
        cmocka_unit_test(failing_callback_stops_the_pipeline),
        cmocka_unit_test(mismatched_codecs_are_caught),
        cmocka_unit_test(forward_only_steps),
        cmocka_unit_test(square_insert_trains_like_the_reference),
        cmocka_unit_test(insert_trains_with_the_model),
        cmocka_unit_test(stage_exposes_its_codecs),
        cmocka_unit_test(insert_chain_trains),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
