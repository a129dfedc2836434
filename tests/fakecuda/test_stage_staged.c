/* Stages with CUDA tensors on any machine, through the test CUDA module
 * (fakecuda.c: no kernels, device memory the host cannot touch): the
 * exchange of tests/support/stage_exchange.h with codecs that go through
 * host staging, so the stage runtime's device buffers, lent tensors and
 * copies are checked here as tests/gpu/test_gpu_stage.cu checks them on a
 * GPU; then that the stage's CUDA stream reaches every staging copy. */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>

#include "stage_exchange.h"

static void *(*last_stream)(unsigned long *);

/* One GPipe step of one micro-batch between two inproc ranks, as the cases
 * below shape it: rank 0 sends `rows` rows from host or device memory,
 * rank 1 receives them where its EPIPE_STAGE_CUDA_DEVICE says. */
typedef struct knob_case {
    const sx_memory *mem;
    const char *act_spec;
    int steps;
    int64_t rows[3];   /* rows of the activation sent in each step */
    int r0_device[3];  /* rank 0's knob before each step (-2: leave it) */
    int r1_device[3];  /* rank 1's */
    int act_on_device; /* rank 0 sends from device memory */
    int rc_knob[2][3]; /* what each knob setting must return */
    int rc_send;       /* what rank 0's first send must return */
    const char *why;   /* ... and its message, or the knob's */
    int recv_type[3];  /* rank 1's received tensor's device type in each step */
} knob_case;

typedef struct knob_rank {
    knob_case *k;
    epipe_comm *comm;
} knob_rank;

static void *knob_rank_main(void *p)
{
    knob_rank *kr = p;
    knob_case *k = kr->k;
    unsigned r = epipe_comm_rank(kr->comm);
    epipe_stage *st;
    SX_CHECK(epipe_stage_create(&st, kr->comm, "gpipe", 1) == EPIPE_OK, "%s", epipe_last_error());
    epipe_stage_set_param(st, EPIPE_STAGE_TIMEOUT_MS, 5000);
    SX_CHECK(epipe_stage_set_codec(st, EPIPE_DIR_ACTIVATION, EPIPE_ALL_BOUNDARIES, k->act_spec) ==
                 EPIPE_OK,
             "%s", epipe_stage_last_error(st));
    float *host = malloc(SX_N * sizeof *host); /* each rank its own */
    SX_CHECK(host != NULL, "host memory");
    if (!host)
        return NULL;
    for (int i = 0; i < SX_N; i++)
        host[i] = (float)(i % 97) / 97.0f - 0.5f;
    void *dev = k->mem->alloc(SX_N * sizeof *host);
    SX_CHECK(dev && k->mem->copy(dev, host, SX_N * sizeof *host) == 0, "device memory");
    for (int step = 0; step < k->steps; step++) {
        int want = (r ? k->r1_device : k->r0_device)[step];
        if (want != -2) {
            int rc = epipe_stage_set_param(st, EPIPE_STAGE_CUDA_DEVICE, want);
            SX_CHECK(rc == k->rc_knob[r][step], "rank %u step %d: knob %d: %d %s", r, step, want,
                     rc, epipe_stage_last_error(st));
            if (rc)
                SX_CHECK(strstr(epipe_stage_last_error(st), k->why) != NULL, "rank %u: %s", r,
                         epipe_stage_last_error(st));
        }
        int64_t shape[2] = {k->rows[step], SX_COLS};
        epipe_op op;
        for (;;) {
            int rc = epipe_stage_next_op(st, &op);
            if (rc || op.kind == EPIPE_OP_NONE) {
                SX_CHECK(rc == EPIPE_OK, "rank %u: %s", r, epipe_stage_last_error(st));
                break;
            }
            DLTensor t = sx_view(kDLCPU, host);
            t.shape = shape;
            const DLTensor *in = NULL;
            if (r == 0 && op.kind == EPIPE_OP_FORWARD) {
                if (k->act_on_device)
                    t.device.device_type = kDLCUDA, t.data = dev;
                rc = epipe_stage_send_activation(st, 0, &t);
                int want_rc = step == 0 ? k->rc_send : EPIPE_OK;
                SX_CHECK(rc == want_rc, "send: %d %s", rc, epipe_stage_last_error(st));
                if (rc) {
                    SX_CHECK(strstr(epipe_stage_last_error(st), k->why) != NULL, "send: %s",
                             epipe_stage_last_error(st));
                    /* the refusal changed nothing: the same tensor from host memory */
                    t.device.device_type = kDLCPU, t.data = host;
                    rc = epipe_stage_send_activation(st, 0, &t);
                }
            } else if (r == 0) {
                rc = epipe_stage_recv_gradient(st, 0, &in);
            } else if (op.kind == EPIPE_OP_FORWARD) {
                rc = epipe_stage_recv_activation(st, 0, &in);
                if (rc == EPIPE_OK)
                    SX_CHECK((int)in->device.device_type == k->recv_type[step],
                             "step %d: received into device type %d, not %d", step,
                             (int)in->device.device_type, k->recv_type[step]);
            } else {
                rc = epipe_stage_send_gradient(st, 0, &t);
            }
            SX_CHECK(rc == EPIPE_OK, "rank %u step %d op %u: %s", r, step, op.kind,
                     epipe_stage_last_error(st));
            if (rc) {
                epipe_comm_abort(kr->comm);
                break;
            }
        }
    }
    k->mem->free(dev);
    free(host);
    epipe_stage_destroy(st);
    return NULL;
}

static void knob_run(knob_case *k, const char *what)
{
    epipe_comm *c[2];
    if (epipe_comm_create_inproc(c, 2) != EPIPE_OK) {
        SX_CHECK(0, "inproc: %s", epipe_last_error());
        return;
    }
    int before = sx_failures;
    knob_rank kr[2] = {{k, c[0]}, {k, c[1]}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&th[i], NULL, knob_rank_main, &kr[i]);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    printf("%s: %s\n", what, sx_failures == before ? "ok" : "FAILED");
}

/* EPIPE_STAGE_CUDA_DEVICE's rules (stage.h). */
static void knob_cases(const sx_memory *mem)
{
    /* Moved after tensors were received on the host: refused by name (the
     * decoders keep to host memory), and the stage goes on there. */
    knob_case moved = {mem,
                       "quant:bits=8",
                       2,
                       {SX_ROWS, SX_ROWS},
                       {-2, -2},
                       {-2, 0},
                       0,
                       {{0, 0}, {0, EPIPE_ESTATE}},
                       EPIPE_OK,
                       "this stage's codecs already write received tensors into host memory",
                       {kDLCPU, kDLCPU}};
    knob_run(&moved, "the device knob moved after the first receive: refused");
    /* Set before the first step: both steps receive on the device, the
     * first of them an empty tensor (lent on the device too, not the host). */
    knob_case empty = {mem, "quant:bits=8",   2,        {0, SX_ROWS}, {-2, -2},          {0, -2},
                       0,   {{0, 0}, {0, 0}}, EPIPE_OK, "",           {kDLCUDA, kDLCUDA}};
    knob_run(&empty, "an empty first receive on a CUDA stage");
    /* A trainable codec back-propagates into the memory received tensors go
     * to: a CUDA activation sent while they go to the host is refused by
     * name (it used to fail at the gradient's receive), and the same
     * activation from the host then crosses. */
    epipe_codec *probe;
    if (epipe_codec_create(&probe, "insert:kind=linear,out=100") != EPIPE_OK) {
        printf("SKIP the trainable case: %s\n", epipe_last_error());
        return;
    }
    epipe_codec_destroy(probe);
    knob_case trainable = {mem,
                           "insert:kind=linear,out=100",
                           1,
                           {SX_ROWS},
                           {-2},
                           {-2},
                           1,
                           {{0}, {0}},
                           EPIPE_EINVAL,
                           "is in CUDA device 0, but the trainable codec",
                           {kDLCPU}};
    knob_run(&trainable, "a trainable codec's CUDA activation with received tensors on the host");
}

/* ---- message buffers of CUDA stages are pinned ------------------------- */

static void (*fences)(unsigned long *made, unsigned long *waited, long *live);
static void (*fail_next_fence)(int status);
static void (*no_memory_next_fence)(void);
static void (*marks)(unsigned long *recorded, unsigned long *passed, long *live);
static void (*marks_lag)(long lag);
static void (*fail_mark_at)(unsigned long k, int status);
static unsigned long (*early_frees)(void);
static unsigned long (*host_allocs)(void);
static long (*host_live)(void);
static unsigned long (*dev_allocs)(void);
static long (*dev_live)(void);

/* 70,000 values: a message the communicator's buffer cache keeps */
enum { PIN_ROWS = 70, PIN_N = PIN_ROWS * SX_COLS };

typedef struct pin_rank {
    epipe_comm *comm;
    const sx_memory *mem;
    int steps;
    int nan;                  /* rank 0 sends a NaN through quant: its send must fail */
    int moved;                /* rank 1 is put on device 0, then back on the host */
    int ordered;              /* EPIPE_STAGE_CUDA_STREAM_ORDERED; 2: rank 1 also destroys
                                 its stage mid-step, after its first receive; 3: the
                                 first fence says its encode failed */
    pthread_barrier_t *ready; /* both ranks have set their knobs */
    int knob_rc;
    char why[256];
    unsigned long waited0; /* fences waited for before the run */
    int end_rc;            /* ordered 3: how the first step ended, and why */
    char end_why[256];
} pin_rank;

static void *pin_rank_main(void *p)
{
    pin_rank *pr = p;
    unsigned r = epipe_comm_rank(pr->comm);
    epipe_stage *st;
    SX_CHECK(epipe_stage_create(&st, pr->comm, "gpipe", 1) == EPIPE_OK, "%s", epipe_last_error());
    epipe_stage_set_param(st, EPIPE_STAGE_TIMEOUT_MS, 5000);
    if (pr->nan)
        SX_CHECK(epipe_stage_set_codec(st, EPIPE_DIR_ACTIVATION, EPIPE_ALL_BOUNDARIES,
                                       "quant:bits=8") == EPIPE_OK,
                 "%s", epipe_stage_last_error(st));
    if (pr->ordered)
        SX_CHECK(epipe_stage_set_param(st, EPIPE_STAGE_CUDA_STREAM_ORDERED, 1) == EPIPE_OK, "%s",
                 epipe_stage_last_error(st));
    pr->knob_rc = epipe_stage_set_param(st, EPIPE_STAGE_CUDA_DEVICE, 0);
    snprintf(pr->why, sizeof pr->why, "%s", epipe_stage_last_error(st));
    int on_host = pr->moved && r == 1;
    if (on_host && !pr->knob_rc)
        SX_CHECK(epipe_stage_set_param(st, EPIPE_STAGE_CUDA_DEVICE, -1) == EPIPE_OK, "%s",
                 epipe_stage_last_error(st));
    /* a message sent before the peer is on its device goes through the host */
    pthread_barrier_wait(pr->ready);
    float *host = malloc(PIN_N * sizeof *host);
    void *dev = pr->mem->alloc(PIN_N * sizeof *host);
    SX_CHECK(host && dev, "memory");
    if (pr->knob_rc || !host || !dev) {
        epipe_comm_abort(pr->comm);
        pr->steps = 0;
    } else {
        for (int i = 0; i < PIN_N; i++)
            host[i] = (float)(i % 89) / 89.0f - 0.5f;
        if (pr->nan)
            host[PIN_N / 2] = NAN;
        SX_CHECK(pr->mem->copy(dev, host, PIN_N * sizeof *host) == 0, "copy to the device");
    }
    int64_t shape[2] = {PIN_ROWS, SX_COLS};
    DLTensor t = sx_view(kDLCUDA, dev);
    t.shape = shape;
    for (int step = 0; step < pr->steps; step++) {
        epipe_op op;
        int rc;
        while ((rc = epipe_stage_next_op(st, &op)) == EPIPE_OK && op.kind != EPIPE_OP_NONE) {
            const DLTensor *in = NULL;
            if (op.kind == EPIPE_OP_FORWARD && r == 0 && pr->nan) {
                rc = epipe_stage_send_activation(st, 0, &t);
                SX_CHECK(rc == EPIPE_EINVAL && strstr(epipe_stage_last_error(st), "finite"),
                         "a NaN sent: %d %s", rc, epipe_stage_last_error(st));
                epipe_comm_abort(pr->comm);
                rc = EPIPE_OK;
                break;
            }
            if ((rc = sx_chain_op(st, r, 2, &op, &t, &in)))
                break;
            if (in && on_host) {
                SX_CHECK(in->device.device_type == kDLCPU &&
                             memcmp(in->data, host, PIN_N * sizeof *host) == 0,
                         "rank %u step %d: the tensor received on the host", r, step);
            } else if (in) {
                float got[4];
                SX_CHECK(in->device.device_type == kDLCUDA &&
                             pr->mem->copy(got, in->data, sizeof got) == 0 && got[1] == host[1],
                         "rank %u step %d: the tensor received", r, step);
            }
            if (in && pr->ordered) { /* held, with its fence, at least until the next hold */
                unsigned long made, waited;
                long live;
                fences(&made, &waited, &live);
                SX_CHECK(live >= 1 && waited > pr->waited0,
                         "rank %u step %d: %ld fences alive, %lu waited", r, step, live,
                         waited - pr->waited0);
            }
            if (in && pr->ordered == 2 && r == 1) { /* abandoned with a message held */
                epipe_comm_abort(pr->comm);
                rc = EPIPE_ECALLBACK;
                break;
            }
        }
        if (rc == EPIPE_ECALLBACK && pr->ordered == 2)
            break;
        if (pr->ordered == 3 && step == 0) {
            pr->end_rc = rc;
            snprintf(pr->end_why, sizeof pr->end_why, "%s", epipe_stage_last_error(st));
        }
        SX_CHECK(rc == EPIPE_OK || pr->nan || pr->ordered >= 2, "rank %u step %d: %s", r, step,
                 epipe_stage_last_error(st));
        if (rc || pr->nan) {
            epipe_comm_abort(pr->comm);
            break;
        }
    }
    pr->mem->free(dev);
    free(host);
    epipe_stage_destroy(st);
    return NULL;
}

static void set_env(const char *name, const char *value)
{
    if (value)
        setenv(name, value, 1);
    else
        unsetenv(name);
}

/* What a pin_run() asked of the module: pinned and device allocations. */
typedef struct allocs {
    unsigned long pinned, dev;
} allocs;

/* Two ranks of `steps` GPipe steps with CUDA tensors of PIN_N values
 * under EPIPE_CUDA_PINNED_MESSAGES = pin_env and EPIPE_CUDA_DEVICE_MESSAGES
 * = dev_env (NULL: unset); the allocations they made (every one must be
 * given back), and each rank's knob status and message. */
static allocs pin_run_ordered(const sx_memory *mem, const char *pin_env, const char *dev_env,
                              int steps, int nan, int moved, int ordered, pin_rank pr[2])
{
    set_env("EPIPE_CUDA_PINNED_MESSAGES", pin_env);
    set_env("EPIPE_CUDA_DEVICE_MESSAGES", dev_env);
    allocs a = {0, 0};
    epipe_comm *c[2];
    if (epipe_comm_create_inproc(c, 2) != EPIPE_OK) {
        SX_CHECK(0, "inproc: %s", epipe_last_error());
        return a;
    }
    long live = host_live(), dlive = dev_live(), flive;
    unsigned long before = host_allocs(), dbefore = dev_allocs(), made, waited0;
    fences(&made, &waited0, &flive);
    if (ordered == 3)
        fail_next_fence(EPIPE_EINVAL);
    pthread_t th[2];
    pthread_barrier_t ready;
    pthread_barrier_init(&ready, NULL, 2);
    for (int i = 0; i < 2; i++) {
        pr[i] = (pin_rank){.comm = c[i],
                           .mem = mem,
                           .steps = steps,
                           .nan = nan,
                           .moved = moved,
                           .ordered = ordered,
                           .ready = &ready,
                           .waited0 = waited0};
        pthread_create(&th[i], NULL, pin_rank_main, &pr[i]);
    }
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    pthread_barrier_destroy(&ready);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    unsetenv("EPIPE_CUDA_PINNED_MESSAGES");
    unsetenv("EPIPE_CUDA_DEVICE_MESSAGES");
    SX_CHECK(host_live() == live, "%ld pinned buffers not given back to the module",
             host_live() - live);
    SX_CHECK(dev_live() == dlive, "%ld device buffers not given back to the module",
             dev_live() - dlive);
    a.pinned = host_allocs() - before;
    a.dev = dev_allocs() - dbefore;
    return a;
}

static allocs pin_run(const sx_memory *mem, const char *pin_env, const char *dev_env, int steps,
                      int nan, int moved, pin_rank pr[2])
{
    return pin_run_ordered(mem, pin_env, dev_env, steps, nan, moved, 0, pr);
}

/* A bad value of either switch of a CUDA stage's messages: both ranks'
 * EPIPE_STAGE_CUDA_DEVICE refused, naming it (`says`). */
static void bad_switch_refused(const sx_memory *mem, const char *pin_env, const char *dev_env,
                               const char *says)
{
    int before = sx_failures;
    pin_rank pr[2];
    pin_run(mem, pin_env, dev_env, 1, 0, 0, pr);
    for (int r = 0; r < 2; r++)
        SX_CHECK(pr[r].knob_rc == EPIPE_EINVAL && strstr(pr[r].why, says) != NULL, "rank %d: %d %s",
                 r, pr[r].knob_rc, pr[r].why);
    printf("a bad switch refused by name (%s): %s\n", says,
           sx_failures == before ? "ok" : "FAILED");
}

static void pinned_message_cases(const sx_memory *mem)
{
    int before = sx_failures;
    pin_rank pr[2];
    /* payloads through host messages: EPIPE_CUDA_DEVICE_MESSAGES=0 */
    unsigned long pageable = pin_run(mem, "0", "0", 1, 0, 0, pr).pinned;
    unsigned long pinned = pin_run(mem, NULL, "0", 1, 0, 0, pr).pinned;
    unsigned long pinned3 = pin_run(mem, "1", "0", 3, 0, 0, pr).pinned;
    unsigned long pageable3 = pin_run(mem, "0", "0", 3, 0, 0, pr).pinned;
    /* each rank's one message buffer: pinned, and drawn from the cache again
     * in later steps (host staging's own buffers are in both counts) */
    SX_CHECK(pinned >= pageable + 2, "pinned: %lu allocations, pageable: %lu", pinned, pageable);
    SX_CHECK(pinned3 == pinned && pageable3 == pageable,
             "3 steps made %lu and %lu pinned allocations, 1 step %lu and %lu", pinned3, pageable3,
             pinned, pageable);
    printf("CUDA stages' message buffers pinned and cached: %s\n",
           sx_failures == before ? "ok" : "FAILED");
    bad_switch_refused(mem, "yes", "0", "EPIPE_CUDA_PINNED_MESSAGES = 'yes'");
    /* a failed encode into a pinned message: refused by name, and its
     * buffer goes back (pin_run counts). That the stage waits for the
     * stream first (opstream.c, settle()) no test here can see: this
     * module's copies, and the emulator's, are done when they return. */
    before = sx_failures;
    pin_run(mem, NULL, "0", 1, 1, 0, pr);
    printf("a failed CUDA send of a pinned message: %s\n", sx_failures == before ? "ok" : "FAILED");
}

/* Between ranks of one process on one device the payload stays in device
 * memory (the module's): the sender encodes there, the receiver decodes
 * from there, and the buffers are cached from step to step and all given
 * back; a receiver moved back to the host gets its payload copied out. */
static void device_message_cases(const sx_memory *mem)
{
    int before = sx_failures;
    pin_rank pr[2];
    allocs host = pin_run(mem, NULL, "0", 1, 0, 0, pr);
    allocs dev = pin_run(mem, NULL, NULL, 1, 0, 0, pr);
    allocs dev3 = pin_run(mem, NULL, "1", 3, 0, 0, pr);
    /* an activation and a gradient message in device buffers (the host
     * staging of this module's codecs pins buffers of its own either way) */
    SX_CHECK(dev.dev == host.dev + 2, "device messages: %lu device allocations, host ones %lu",
             dev.dev, host.dev);
    SX_CHECK(dev3.dev == dev.dev && dev3.pinned == dev.pinned,
             "3 steps made %lu device and %lu pinned allocations, 1 step %lu and %lu", dev3.dev,
             dev3.pinned, dev.dev, dev.pinned);
    printf("CUDA stages' payloads stay on the device over inproc: %s\n",
           sx_failures == before ? "ok" : "FAILED");
    bad_switch_refused(mem, NULL, "on", "EPIPE_CUDA_DEVICE_MESSAGES = 'on'");
    before = sx_failures;
    pin_run(mem, NULL, NULL, 1, 1, 0, pr); /* pin_run counts what goes back */
    printf("a failed CUDA send of a device message: %s\n", sx_failures == before ? "ok" : "FAILED");
    before = sx_failures;
    allocs moved = pin_run(mem, NULL, NULL, 2, 0, 1, pr);
    /* both messages in device buffers; one received tensor on the host */
    SX_CHECK(moved.dev + 1 == dev.dev,
             "a receiver on the host: %lu device allocations, %lu on "
             "the device",
             moved.dev, dev.dev);
    printf("a device payload for a stage moved to the host: %s\n",
           sx_failures == before ? "ok" : "FAILED");
}

/* Three stream-ordered ranks, the first fence (rank 0's activation) saying
 * its encode failed: rank 1 must fail its step for that payload, and rank
 * 2, which got rank 1's well-encoded activation, for what rank 1 passed
 * on; ends[] says how each step ended. */
typedef struct chain_rank {
    epipe_comm *comm;
    const sx_memory *mem;
    pthread_barrier_t *ready;
    unsigned ranks, m; /* of the chain; micro-batches a step */
    const char *kind;  /* the schedule */
    int cpu;           /* host tensors and a host stage: the knob changes nothing */
    int rc;
    char why[256];
} chain_rank;

static void *chain_rank_main(void *p)
{
    chain_rank *a = p;
    unsigned r = epipe_comm_rank(a->comm);
    epipe_stage *st = NULL;
    float *host = malloc(PIN_N * sizeof *host);
    void *dev = a->mem->alloc(PIN_N * sizeof *host);
    int ok = host && dev && epipe_stage_create(&st, a->comm, a->kind, a->m) == EPIPE_OK &&
             epipe_stage_set_param(st, EPIPE_STAGE_CUDA_DEVICE, a->cpu ? -1 : 0) == EPIPE_OK &&
             epipe_stage_set_param(st, EPIPE_STAGE_CUDA_STREAM_ORDERED, 1) == EPIPE_OK;
    SX_CHECK(ok, "rank %u set-up: %s", r, st ? epipe_stage_last_error(st) : epipe_last_error());
    pthread_barrier_wait(a->ready);
    int64_t shape[2] = {PIN_ROWS, SX_COLS};
    DLTensor t = a->cpu ? sx_view(kDLCPU, host) : sx_view(kDLCUDA, dev);
    t.shape = shape;
    for (int i = 0; ok && i < PIN_N; i++)
        host[i] = (float)(i % 89) / 89.0f - 0.5f;
    int rc = ok && a->mem->copy(dev, host, PIN_N * sizeof *host) == 0 ? EPIPE_OK : EPIPE_EIO;
    epipe_op op;
    while (!rc && (rc = epipe_stage_next_op(st, &op)) == EPIPE_OK && op.kind != EPIPE_OP_NONE) {
        const DLTensor *in = NULL;
        rc = sx_chain_op(st, r, a->ranks, &op, &t, &in);
        /* a call that succeeds leaves no error text: not of a verdict
         * it took for the step's end, nor of a failed mark, nor of a fence
         * it could do without; nor do these become a codec's last error */
        epipe_codec *all[4] = {epipe_stage_codec(st, EPIPE_DIR_ACTIVATION, EPIPE_SIDE_UP),
                               epipe_stage_codec(st, EPIPE_DIR_GRADIENT, EPIPE_SIDE_DOWN),
                               epipe_stage_codec(st, EPIPE_DIR_ACTIVATION, EPIPE_SIDE_DOWN),
                               epipe_stage_codec(st, EPIPE_DIR_GRADIENT, EPIPE_SIDE_UP)};
        for (int k = 0; k < 4; k++)
            SX_CHECK(rc || (!*epipe_last_error() && (!all[k] || !*epipe_codec_last_error(all[k]))),
                     "rank %u mb %u: a successful op left '%s' / '%s'", r, op.microbatch,
                     epipe_last_error(), all[k] ? epipe_codec_last_error(all[k]) : "");
        if (!rc && in && a->cpu) /* what was sent, through none */
            SX_CHECK(in->device.device_type == kDLCPU &&
                         memcmp(in->data, host, PIN_N * sizeof *host) == 0,
                     "rank %u: a host tensor received", r);
        float got[4];
        if (!rc && in && !a->cpu)
            SX_CHECK(in->device.device_type == kDLCUDA &&
                         a->mem->copy(got, in->data, sizeof got) == 0 && got[1] == host[1],
                     "rank %u mb %u: the tensor received", r, op.microbatch);
    }
    a->rc = rc;
    snprintf(a->why, sizeof a->why, "%s", st ? epipe_stage_last_error(st) : "");
    if (rc)
        epipe_comm_abort(a->comm);
    epipe_stage_destroy(st);
    a->mem->free(dev);
    free(host);
    return NULL;
}

/* One step of `kind` (chain_rank_main) on `ranks` fresh inproc ranks
 * (a[0..ranks), which it fills): 0 when it ran. */
static int chain_run(const sx_memory *mem, const char *kind, unsigned ranks, unsigned m, int cpu,
                     chain_rank *a)
{
    epipe_comm *c[3];
    if (epipe_comm_create_inproc(c, ranks) != EPIPE_OK) {
        SX_CHECK(0, "inproc: %s", epipe_last_error());
        return -1;
    }
    pthread_barrier_t ready;
    pthread_barrier_init(&ready, NULL, ranks);
    pthread_t th[3];
    for (unsigned i = 0; i < ranks; i++) {
        a[i] = (chain_rank){.comm = c[i],
                            .mem = mem,
                            .ready = &ready,
                            .ranks = ranks,
                            .m = m,
                            .kind = kind,
                            .cpu = cpu};
        pthread_create(&th[i], NULL, chain_rank_main, &a[i]);
    }
    for (unsigned i = 0; i < ranks; i++)
        pthread_join(th[i], NULL);
    pthread_barrier_destroy(&ready);
    for (unsigned i = 0; i < ranks; i++)
        epipe_comm_destroy(c[i]);
    return 0;
}

static void chain_verdict_case(const sx_memory *mem)
{
    int before = sx_failures;
    long dlive = dev_live();
    chain_rank a[3];
    fail_next_fence(EPIPE_EINVAL); /* the first fence made: rank 0's activation */
    if (chain_run(mem, "gpipe", 3, 1, 0, a))
        return;
    SX_CHECK(a[1].rc == EPIPE_EINVAL && strstr(a[1].why, "fakecuda: its encode failed") &&
                 strstr(a[1].why, "activation of micro-batch 0 from rank 0"),
             "rank 1: %d %s", a[1].rc, a[1].why);
    SX_CHECK(a[2].rc == EPIPE_EINVAL &&
                 strstr(a[2].why, "fakecuda: an earlier stage's encode failed") &&
                 strstr(a[2].why, "activation of micro-batch 0 from rank 1"),
             "rank 2: %d %s", a[2].rc, a[2].why);
    SX_CHECK(dev_live() == dlive, "%ld device buffers not given back", dev_live() - dlive);
    printf("a refused encode fails every later stream-ordered stage's step: %s\n",
           sx_failures == before ? "ok" : "FAILED");

    /* a fence that cannot be made for lack of memory: that send waits
     * for its encode instead, and every step is good, with no error text
     * left (chain_rank_main checks each call) */
    before = sx_failures;
    no_memory_next_fence();
    if (chain_run(mem, "gpipe", 3, 1, 0, a))
        return;
    for (int i = 0; i < 3; i++)
        SX_CHECK(a[i].rc == EPIPE_OK, "rank %d, a fence without memory: %s", i, a[i].why);
    printf("a send whose fence has no memory waits instead: %s\n",
           sx_failures == before ? "ok" : "FAILED");

    /* on the host, the knob changes nothing: no fence, every step good */
    before = sx_failures;
    unsigned long made0, made, waited;
    long live;
    fences(&made0, &waited, &live);
    if (chain_run(mem, "gpipe", 3, 1, 1, a))
        return;
    for (int i = 0; i < 3; i++)
        SX_CHECK(a[i].rc == EPIPE_OK, "rank %d on the host: %s", i, a[i].why);
    fences(&made, &waited, &live);
    SX_CHECK(made == made0, "%lu fences made for host tensors", made - made0);
    printf("stream-ordered stages with host tensors: %s\n",
           sx_failures == before ? "ok" : "FAILED");
}

/* 40 micro-batches a step, two ranks, as `kind`, the module's marks
 * passing `lag` records after they are made (-1: never), the k-th failing
 * (fail_at, 0: none): every rank's step good, every tensor right,
 * everything given back, and no message given back before its decode was
 * known done; what was made meanwhile. */
typedef struct many_run {
    unsigned long fences, marks, passed, dev_allocs;
} many_run;

static many_run many_microbatches(const sx_memory *mem, const char *kind, long lag,
                                  unsigned long fail_at)
{
    many_run d = {0, 0, 0, 0};
    chain_rank a[2];
    unsigned long made0, made, waited, rec0, rec, passed0, passed, dev0 = dev_allocs();
    unsigned long early0 = early_frees();
    long dlive = dev_live(), flive0, flive, mlive;
    fences(&made0, &waited, &flive0);
    marks(&rec0, &passed0, &mlive);
    marks_lag(lag);
    if (fail_at)
        fail_mark_at(fail_at, EPIPE_EIO);
    int ran = chain_run(mem, kind, 2, 40, 0, a) == 0;
    marks_lag(0);
    fail_mark_at(0, 0);
    if (!ran)
        return d;
    for (int i = 0; i < 2; i++)
        SX_CHECK(a[i].rc == EPIPE_OK, "rank %d of 40 micro-batches (%s): %s", i, kind, a[i].why);
    fences(&made, &waited, &flive);
    marks(&rec, &passed, &mlive);
    SX_CHECK(flive == flive0 && mlive == 0 && dev_live() == dlive,
             "%ld fences, %ld marks, %ld device buffers not given back", flive - flive0, mlive,
             dev_live() - dlive);
    SX_CHECK(early_frees() == early0,
             "%s, lag %ld: %lu messages given back while their decodes could run", kind, lag,
             early_frees() - early0);
    d = (many_run){made - made0, rec - rec0, passed - passed0, dev_allocs() - dev0};
    return d;
}

/* A stream-ordered receiver gives each held message back once a mark
 * after its decode has passed, so that its sender's device buffers go
 * back to work; where the marks have not passed it holds 32, then waits. */
static void many_microbatch_cases(const sx_memory *mem)
{
    /* GPipe, the marks never passing: the receiver holds 32, then waits
     * and gives them back; the sender, out of device buffers meanwhile,
     * sends the 33rd activation through host memory (no fence) */
    int before = sx_failures;
    many_run g = many_microbatches(mem, "gpipe", -1, 0);
    SX_CHECK(g.fences > 0 && g.fences < 80 && g.passed == 0,
             "GPipe, marks pending: %lu fences, %lu marks passed", g.fences, g.passed);
    printf("a stream-ordered step of 40 micro-batches (past the 32 held): %s\n",
           sx_failures == before ? "ok" : "FAILED");
    /* 1F1B: each rank holds a message until its next receive finds the
     * mark after its decode passed, so every send, gradients and
     * activations, stays on the device; with the marks never passing it
     * does not (the 33rd activation finds the sender's 32 buffers held) */
    before = sx_failures;
    many_run on = many_microbatches(mem, "1f1b", 0, 0);
    many_run off = many_microbatches(mem, "1f1b", -1, 0);
    SX_CHECK(on.fences == 80 && on.marks == 80 && on.passed == 78,
             "1F1B: %lu fences, %lu marks, %lu passed (80, 80, 78)", on.fences, on.marks,
             on.passed);
    SX_CHECK(off.fences < 80 && off.marks == on.marks && off.passed == 0,
             "1F1B, marks pending: %lu fences, %lu marks, %lu passed", off.fences, off.marks,
             off.passed);
    /* (the sender's 32 buffers all held, where buffers given back serve) */
    SX_CHECK(off.dev_allocs >= on.dev_allocs + 32,
             "device allocations: %lu, %lu with the marks pending", on.dev_allocs, off.dev_allocs);
    /* the first mark cannot be made: that message is held to the step's
     * end (given back early, it would count in early_frees), the others
     * given back */
    many_run failed = many_microbatches(mem, "1f1b", 0, 1);
    SX_CHECK(failed.fences == 80 && failed.marks == 79 && failed.passed == 77,
             "a failed mark: %lu fences, %lu marks, %lu passed (80, 79, 77)", failed.fences,
             failed.marks, failed.passed);
    /* a GPU behind its host: marks pass three records late, and the 10th
     * fails, so that the messages given back are some of those held,
     * around one that is kept, and the rest move up */
    many_run late = many_microbatches(mem, "1f1b", 3, 10);
    SX_CHECK(late.fences == 80 && late.marks == 79 && late.passed > 0 && late.passed < 77,
             "marks passing late: %lu fences, %lu marks, %lu passed", late.fences, late.marks,
             late.passed);
    printf("stream-ordered messages given back as their decodes pass (40 micro-batches): %s\n",
           sx_failures == before ? "ok" : "FAILED");

    /* Of several failed verdicts, the first received is reported, though a
     * later one was given back first: rank 0's first activation is refused
     * (its fence says so) and the mark after its decode cannot be made, so
     * it is held to the step's end; its third comes after rank 0 was
     * passed that verdict back, and goes back early, failed too. */
    before = sx_failures;
    chain_rank a[2];
    fail_next_fence(EPIPE_EINVAL);
    fail_mark_at(1, EPIPE_EIO); /* rank 1's first hold: the first activation */
    int ran = chain_run(mem, "1f1b", 2, 4, 0, a) == 0;
    fail_mark_at(0, 0);
    SX_CHECK(ran && a[1].rc == EPIPE_EINVAL && strstr(a[1].why, "fakecuda: its encode failed") &&
                 strstr(a[1].why, "activation of micro-batch 0 from rank 0"),
             "rank 1: %d %s", a[1].rc, a[1].why);
    printf("of failed verdicts, the first received is reported: %s\n",
           sx_failures == before ? "ok" : "FAILED");
}

/* A failed step forgets the verdicts it was given: rank 1 (callbacks)
 * gives back early, with a failed verdict, rank 0's first activation, then
 * fails its step on a bad gradient of its own (not a callback error: the
 * communicator stays up); rank 0 times out waiting for it. Both run the
 * step again, and it must succeed: the dropped verdict is not reported. */
typedef struct cb_rank {
    epipe_comm *comm;
    const sx_memory *mem;
    DLTensor t, bad;
    int attempt;
    int rc[2];
    char why[2][256];
} cb_rank;

static int cb_forward(void *user, unsigned mb, const DLTensor *in, const DLTensor **out)
{
    cb_rank *a = user;
    (void)mb;
    (void)in;
    *out = epipe_comm_rank(a->comm) == 0 ? &a->t : NULL;
    return 0;
}

static int cb_backward(void *user, unsigned mb, const DLTensor *g, const DLTensor **g_in)
{
    cb_rank *a = user;
    (void)g;
    int first = epipe_comm_rank(a->comm) == 0;
    *g_in = first ? NULL : a->attempt == 0 && mb == 1 ? &a->bad : &a->t;
    return 0;
}

static void *cb_rank_main(void *p)
{
    cb_rank *a = p;
    unsigned r = epipe_comm_rank(a->comm);
    epipe_stage *st = NULL;
    epipe_stage_callbacks cb = EPIPE_STAGE_CALLBACKS_INIT;
    cb.user = a;
    cb.forward = cb_forward;
    cb.backward = cb_backward;
    int ok = epipe_stage_create(&st, a->comm, "gpipe", 2) == EPIPE_OK &&
             epipe_stage_set_param(st, EPIPE_STAGE_CUDA_DEVICE, 0) == EPIPE_OK &&
             epipe_stage_set_param(st, EPIPE_STAGE_CUDA_STREAM_ORDERED, 1) == EPIPE_OK &&
             epipe_stage_set_param(st, EPIPE_STAGE_TIMEOUT_MS, r == 0 ? 500 : 5000) == EPIPE_OK &&
             epipe_stage_set_callbacks(st, &cb) == EPIPE_OK;
    SX_CHECK(ok, "rank %u set-up: %s", r, st ? epipe_stage_last_error(st) : epipe_last_error());
    for (a->attempt = 0; ok && a->attempt < 2; a->attempt++) {
        if (a->attempt == 1) /* the step again: no timeout meant, however slow the run */
            epipe_stage_set_param(st, EPIPE_STAGE_TIMEOUT_MS, 60000);
        a->rc[a->attempt] = epipe_stage_step(st);
        snprintf(a->why[a->attempt], sizeof a->why[0], "%s", epipe_stage_last_error(st));
    }
    epipe_stage_destroy(st);
    return NULL;
}

static void failed_step_forgets_verdict(const sx_memory *mem)
{
    int before = sx_failures;
    epipe_comm *c[2];
    if (epipe_comm_create_inproc(c, 2) != EPIPE_OK) {
        SX_CHECK(0, "inproc: %s", epipe_last_error());
        return;
    }
    static int64_t shape[2] = {PIN_ROWS, SX_COLS}, bad_shape[2] = {1, SX_COLS};
    void *dev = mem->alloc(PIN_N * sizeof(float));
    float *host = calloc(PIN_N, sizeof *host);
    SX_CHECK(dev && host && mem->copy(dev, host, PIN_N * sizeof *host) == 0, "memory");
    cb_rank a[2];
    for (int i = 0; i < 2; i++) {
        a[i] = (cb_rank){.comm = c[i], .mem = mem};
        a[i].t = sx_view(kDLCUDA, dev);
        a[i].t.shape = shape;
        a[i].bad = a[i].t;
        a[i].bad.shape = bad_shape;
    }
    fail_next_fence(EPIPE_EINVAL); /* rank 0's first activation */
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&th[i], NULL, cb_rank_main, &a[i]);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    SX_CHECK(a[1].rc[0] == EPIPE_EINVAL && a[0].rc[0] == EPIPE_ETIMEDOUT,
             "the failed step: %d (%s), %d (%s)", a[0].rc[0], a[0].why[0], a[1].rc[0], a[1].why[0]);
    SX_CHECK(a[0].rc[1] == EPIPE_OK && a[1].rc[1] == EPIPE_OK, "the next step: %s / %s",
             a[0].why[1], a[1].why[1]);
    mem->free(dev);
    free(host);
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    printf("a failed stream-ordered step's verdicts are not the next step's: %s\n",
           sx_failures == before ? "ok" : "FAILED");
}

/* Stream-ordered stages: each device payload carries a fence its
 * receiver waits for on the device, and the message (fence and buffer)
 * is held until its decode is known done, at the latest the step's end; a
 * stage destroyed mid-step gives what it holds back. The knob itself: 0 or 1, between steps only. */
static void ordered_cases(const sx_memory *mem)
{
    int before = sx_failures;
    pin_rank pr[2];
    unsigned long made0, waited0, made, waited;
    long live;
    fences(&made0, &waited0, &live);
    allocs dev = pin_run(mem, NULL, NULL, 3, 0, 0, pr);
    allocs ordered = pin_run_ordered(mem, NULL, NULL, 3, 0, 0, 1, pr);
    fences(&made, &waited, &live);
    /* an activation and a gradient a step, as device messages */
    SX_CHECK(made - made0 == 6 && waited - waited0 == 6 && live == 0,
             "%lu fences made, %lu waited, %ld alive", made - made0, waited - waited0, live);
    /* and each stage's taint, made once (pin_run checks it is given back) */
    SX_CHECK(ordered.dev == dev.dev + 2, "ordered: %lu device allocations, else %lu", ordered.dev,
             dev.dev);
    printf("stream-ordered stages fence their device payloads: %s\n",
           sx_failures == before ? "ok" : "FAILED");
    before = sx_failures;
    pin_run_ordered(mem, NULL, NULL, 2, 0, 0, 2, pr); /* pin_run counts what goes back */
    fences(&made, &waited, &live);
    SX_CHECK(live == 0, "%ld fences alive after a stage destroyed mid-step", live);
    printf("a stream-ordered stage destroyed with a message held: %s\n",
           sx_failures == before ? "ok" : "FAILED");
    /* the verdict a fence carries: the receiver of a payload whose encode
     * failed must not end its step as if it had not */
    before = sx_failures;
    pin_run_ordered(mem, NULL, NULL, 1, 0, 0, 3, pr);
    SX_CHECK(pr[1].end_rc == EPIPE_EINVAL && strstr(pr[1].end_why, "its encode failed") &&
                 strstr(pr[1].end_why, "activation of micro-batch 0 from rank 0") &&
                 strstr(pr[1].end_why, "communicator aborted"),
             "the receiver's step: %d %s", pr[1].end_rc, pr[1].end_why);
    printf("a stream-ordered receiver of a payload whose encode failed: %s\n",
           sx_failures == before ? "ok" : "FAILED");
    chain_verdict_case(mem);
    many_microbatch_cases(mem);
    failed_step_forgets_verdict(mem);

    before = sx_failures;
    epipe_comm *c[2];
    epipe_stage *st = NULL;
    SX_CHECK(epipe_comm_create_inproc(c, 2) == EPIPE_OK &&
                 epipe_stage_create(&st, c[0], "gpipe", 1) == EPIPE_OK,
             "%s", epipe_last_error());
    if (st) {
        int64_t v = -1;
        SX_CHECK(epipe_stage_set_param(st, EPIPE_STAGE_CUDA_STREAM_ORDERED, 2) == EPIPE_EINVAL &&
                     strstr(epipe_stage_last_error(st), "EPIPE_STAGE_CUDA_STREAM_ORDERED = 2"),
                 "2: %s", epipe_stage_last_error(st));
        SX_CHECK(epipe_stage_get_param(st, EPIPE_STAGE_CUDA_STREAM_ORDERED, &v) == EPIPE_OK &&
                     v == 0,
                 "the default: %lld", (long long)v);
        SX_CHECK(epipe_stage_set_param(st, EPIPE_STAGE_CUDA_STREAM_ORDERED, 1) == EPIPE_OK &&
                     epipe_stage_get_param(st, EPIPE_STAGE_CUDA_STREAM_ORDERED, &v) == EPIPE_OK &&
                     v == 1,
                 "1: %lld", (long long)v);
        epipe_op op;
        SX_CHECK(epipe_stage_next_op(st, &op) == EPIPE_OK && op.kind == EPIPE_OP_FORWARD,
                 "the first op");
        SX_CHECK(epipe_stage_set_param(st, EPIPE_STAGE_CUDA_STREAM_ORDERED, 0) == EPIPE_ESTATE,
                 "mid-step: %s", epipe_stage_last_error(st));
        epipe_stage_destroy(st);
        epipe_comm_destroy(c[0]);
        epipe_comm_destroy(c[1]);
    }
    printf("the stream-ordered knob checked: %s\n", sx_failures == before ? "ok" : "FAILED");
}

int main(void)
{
    const char *path = getenv("EPIPE_CUDA_MODULE");
    void *so = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
    sx_memory mem = {0};
    if (so) {
        *(void **)&mem.alloc = dlsym(so, "fakecuda_alloc");
        *(void **)&mem.free = dlsym(so, "fakecuda_free");
        *(void **)&mem.copy = dlsym(so, "fakecuda_copy");
        *(void **)&last_stream = dlsym(so, "fakecuda_last_stream");
        *(void **)&host_allocs = dlsym(so, "fakecuda_host_allocs");
        *(void **)&host_live = dlsym(so, "fakecuda_host_live");
        *(void **)&dev_allocs = dlsym(so, "fakecuda_dev_allocs");
        *(void **)&dev_live = dlsym(so, "fakecuda_dev_live");
        *(void **)&fences = dlsym(so, "fakecuda_fences");
        *(void **)&fail_next_fence = dlsym(so, "fakecuda_fail_next_fence");
        *(void **)&no_memory_next_fence = dlsym(so, "fakecuda_no_memory_next_fence");
        *(void **)&marks = dlsym(so, "fakecuda_marks");
        *(void **)&marks_lag = dlsym(so, "fakecuda_marks_lag");
        *(void **)&fail_mark_at = dlsym(so, "fakecuda_fail_mark_at");
        *(void **)&early_frees = dlsym(so, "fakecuda_early_frees");
    }
    if (!mem.alloc || !mem.free || !mem.copy || !last_stream || !host_allocs || !host_live ||
        !dev_allocs || !dev_live || !fences || !fail_next_fence || !no_memory_next_fence ||
        !marks || !marks_lag || !fail_mark_at || !early_frees) {
        fprintf(stderr, "EPIPE_CUDA_MODULE must name the test module (fakecuda)\n");
        return 1;
    }
    /* The test module has one device and stages every codec. */
    const char *act = "quant:bits=8", *grad = "sortquant:bits=8,mode=sample";
    sx_run_all(&mem, act, grad, 1);
    knob_cases(&mem);
    pinned_message_cases(&mem);
    device_message_cases(&mem);
    ordered_cases(&mem);

    void *stream = (void *)(uintptr_t)0xbeef;
    unsigned long before = 0, after = 0;
    SX_CHECK(last_stream(&before) != stream, "the stream was not used yet");
    epipe_comm *c[2];
    if (epipe_comm_create_inproc(c, 2) != EPIPE_OK)
        return fprintf(stderr, "inproc: %s\n", epipe_last_error()), 1;
    sx_run_pair(&mem, c[0], c[1], "1f1b", act, grad, 1, stream, 0);
    SX_CHECK(last_stream(&after) == stream, "the last staging copy was not on the stage's stream");
    SX_CHECK(after > before, "no staging copies");
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    /* and the hand-over between two chunks of one rank (ZB-V) */
    void *v_stream = (void *)(uintptr_t)0xfeed;
    sx_run_v(&mem, v_stream, 0);
    SX_CHECK(last_stream(NULL) == v_stream, "the ZB-V copies were not on the stage's stream");
    if (sx_failures)
        return fprintf(stderr, "%d failures\n", sx_failures), 1;
    printf("ok\n");
    return 0;
}
