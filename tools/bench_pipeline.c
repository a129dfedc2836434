/* epipe-bench pipeline: the stage runtime's cost. Per-op overhead with empty
 * callbacks, step time with timed callbacks against the simulator, and
 * (--compare) the schedules' step times relative to 1f1b, measured and simulated. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <epipe/epipe.h>

#include "bench.h"
#include "cli.h"

struct bench_opts {
    const char *kind, *codec;
    unsigned p, m, chunks; /* chunks: per rank, 0 = the kind's default */
    int steps, json, spin, compare;
    double fwd_ms, bwd_ms; /* 0: empty callbacks (overhead mode) */
    double w_ms;           /* weight-gradient part: its own op when the kind splits the
                    backward, else added to the backward */
    int elems;
    long spin_us; /* EPIPE_COMM_SPIN_US on every stage's communicator; -1: the default */
};

struct stage_arg {
    epipe_comm *comm;
    const struct bench_opts *o;
    double seconds;     /* wall time of the timed steps */
    double cpu_seconds; /* this stage thread's CPU time (user + system) in them */
    int rc;
    char err[256];
    float *buf;
    int64_t shape[2];
    DLTensor t;
};

/* Stands for compute until an absolute deadline. By default it sleeps (like
 * a host waiting on a device), so two cores can host four stages without
 * the stages' "compute" competing for them, and spins only the last 100 us
 * so that the op takes its time and no more; with --spin it busy-waits on
 * the clock all the way, as CPU compute would, and the stages share the
 * cores. */
static long long ns_until(const struct timespec *ts)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (long long)(ts->tv_sec - now.tv_sec) * 1000000000LL + (ts->tv_nsec - now.tv_nsec);
}

static void busy_for(double ms, int spin)
{
    if (ms <= 0)
        return;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    long long ns = (long long)ts.tv_nsec + (long long)(ms * 1e6);
    ts.tv_sec += (time_t)(ns / 1000000000);
    ts.tv_nsec = (long)(ns % 1000000000);
    /* Sleep to 100 us before the deadline (timer wake-ups are late by tens
     * of microseconds), then spin on the clock to the deadline itself. */
    long long left = ns_until(&ts);
    if (!spin && left > 100000) {
        struct timespec early = ts;
        early.tv_nsec -= 100000;
        if (early.tv_nsec < 0) {
            early.tv_nsec += 1000000000;
            early.tv_sec--;
        }
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &early, NULL) != 0)
            ;
    }
    while (ns_until(&ts) > 0)
        ;
}

static double thread_cpu(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int fwd(void *user, unsigned mb, const DLTensor *in, const DLTensor **out)
{
    struct stage_arg *a = user;
    (void)mb, (void)in;
    busy_for(a->o->fwd_ms, a->o->spin);
    *out = &a->t;
    return 0;
}

static int bwd(void *user, unsigned mb, const DLTensor *g, const DLTensor **gin)
{
    struct stage_arg *a = user;
    (void)mb, (void)g;
    busy_for(a->o->bwd_ms + a->o->w_ms, a->o->spin);
    *gin = &a->t;
    return 0;
}

static int bwd_input(void *user, unsigned mb, const DLTensor *g, const DLTensor **gin)
{
    struct stage_arg *a = user;
    (void)mb, (void)g;
    busy_for(a->o->bwd_ms, a->o->spin);
    *gin = &a->t;
    return 0;
}

static int bwd_weight(void *user, unsigned mb)
{
    struct stage_arg *a = user;
    (void)mb;
    busy_for(a->o->w_ms, a->o->spin);
    return 0;
}

static void *stage_main(void *p)
{
    struct stage_arg *a = p;
    const struct bench_opts *o = a->o;
    epipe_stage *st;
    a->buf = calloc((size_t)o->elems, sizeof(float));
    a->shape[0] = 1, a->shape[1] = o->elems;
    a->t = (DLTensor){.data = a->buf,
                      .device = {kDLCPU, 0},
                      .ndim = 2,
                      .dtype = {kDLFloat, 32, 1},
                      .shape = a->shape};
    epipe_schedule_layout layout = EPIPE_SCHEDULE_LAYOUT_INIT;
    layout.chunks = o->chunks;
    a->rc = epipe_stage_create_layout(&st, a->comm, o->kind, o->m, &layout);
    if (a->rc == EPIPE_OK)
        a->rc = epipe_stage_set_codec(st, EPIPE_DIR_ACTIVATION, EPIPE_ALL_BOUNDARIES, o->codec);
    if (a->rc == EPIPE_OK)
        a->rc = epipe_stage_set_codec(st, EPIPE_DIR_GRADIENT, EPIPE_ALL_BOUNDARIES, o->codec);
    epipe_stage_callbacks cb = EPIPE_STAGE_CALLBACKS_INIT;
    cb.user = a;
    cb.forward = fwd;
    if (a->rc == EPIPE_OK && epipe_schedule_splits_backward(epipe_stage_schedule(st)) == 1) {
        cb.backward_input = bwd_input;
        cb.backward_weight = bwd_weight;
    } else {
        cb.backward = bwd;
    }
    if (a->rc == EPIPE_OK)
        a->rc = epipe_stage_set_callbacks(st, &cb);
    int warmup = o->steps / 10 + 1;
    double t0 = 0, c0 = 0;
    for (int s = 0; a->rc == EPIPE_OK && s < warmup + o->steps; s++) {
        if (s == warmup)
            t0 = bench_now(), c0 = thread_cpu();
        a->rc = epipe_stage_step(st);
    }
    a->seconds = bench_now() - t0;
    a->cpu_seconds = thread_cpu() - c0;
    if (a->rc == EPIPE_OK) /* schedules without a flush: the backwards in flight */
        a->rc = epipe_stage_drain(st);
    if (a->rc) {
        snprintf(a->err, sizeof a->err, "%s", st ? epipe_stage_last_error(st) : epipe_last_error());
        epipe_comm_abort(a->comm);
    }
    epipe_stage_destroy(st);
    epipe_comm_destroy(a->comm);
    free(a->buf);
    return NULL;
}

/* The simulator's makespan for the same schedule and costs, and the
 * compute ops of rank 0's list (for the overhead per op). */
static int simulate(const struct bench_opts *o, double *ms, size_t *ops_per_rank)
{
    epipe_schedule *s;
    epipe_sim *sim;
    epipe_schedule_layout layout = EPIPE_SCHEDULE_LAYOUT_INIT;
    layout.chunks = o->chunks;
    int rc = epipe_schedule_create_layout(&s, o->kind, o->p, o->m, &layout);
    if (rc)
        return rc;
    const epipe_op *ops;
    size_t n;
    *ops_per_rank = 0;
    if (epipe_schedule_ops(s, 0, &ops, &n) == EPIPE_OK)
        for (size_t i = 0; i < n; i++)
            *ops_per_rank += ops[i].kind == EPIPE_OP_FORWARD || ops[i].kind == EPIPE_OP_BACKWARD ||
                             ops[i].kind == EPIPE_OP_BACKWARD_INPUT ||
                             ops[i].kind == EPIPE_OP_BACKWARD_WEIGHT;
    /* a backward that is not split costs B + W in the simulator too */
    rc = epipe_sim_create(&sim, s);
    if (!rc)
        rc = epipe_sim_set_cost(sim, EPIPE_SIM_FORWARD, EPIPE_SIM_ALL_STAGES, o->fwd_ms);
    if (!rc)
        rc = epipe_sim_set_cost(sim, EPIPE_SIM_BACKWARD, EPIPE_SIM_ALL_STAGES, o->bwd_ms);
    if (!rc)
        rc = epipe_sim_set_cost(sim, EPIPE_SIM_WEIGHT, EPIPE_SIM_ALL_STAGES, o->w_ms);
    if (!rc)
        rc = epipe_sim_run(sim);
    if (!rc)
        *ms = epipe_sim_makespan(sim);
    /* Without a flush the steps run back to back: a step takes, in the
     * steady state, what the simulated run spends between the ends of its
     * third and fourth lists (the slowest rank's). */
    if (!rc && epipe_schedule_weights(s) != EPIPE_WEIGHTS_FLUSH) {
        *ms = 0;
        for (unsigned r = 0; r < o->p; r++) {
            const epipe_op *f, *st;
            size_t nf, nst;
            double e2, e3;
            epipe_schedule_phase_ops(s, r, EPIPE_PHASE_FIRST, &f, &nf);
            epipe_schedule_phase_ops(s, r, EPIPE_PHASE_STEADY, &st, &nst);
            if (epipe_sim_op_time(sim, r, nf + 2 * nst - 1, NULL, &e2) ||
                epipe_sim_op_time(sim, r, nf + 3 * nst - 1, NULL, &e3))
                break;
            *ms = e3 - e2 > *ms ? e3 - e2 : *ms;
        }
    }
    epipe_sim_destroy(sim);
    epipe_schedule_destroy(s);
    return rc;
}

/* Runs the pipeline as threads; the slowest stage's step time in *step_ms
 * and the stage threads' CPU time in *cpu. Returns 0, or 1 after printing
 * the error. */
static int run_pipeline(const struct bench_opts *o, double *step_ms, double *cpu)
{
    epipe_comm *comms[64];
    if (epipe_comm_create_inproc(comms, o->p)) {
        fprintf(stderr, "epipe-bench pipeline: %s\n", epipe_last_error());
        return 1;
    }
    struct stage_arg args[64];
    pthread_t tid[64];
    memset(args, 0, sizeof args);
    for (unsigned s = 0; s < o->p; s++) {
        args[s].comm = comms[s];
        if (o->spin_us >= 0 && epipe_comm_set_param(comms[s], EPIPE_COMM_SPIN_US, o->spin_us)) {
            fprintf(stderr, "epipe-bench pipeline: %s\n", epipe_comm_last_error(comms[s]));
            return 1;
        }
        args[s].o = o;
        pthread_create(&tid[s], NULL, stage_main, &args[s]);
    }
    double worst = 0;
    int failed = 0;
    *cpu = 0;
    for (unsigned s = 0; s < o->p; s++) {
        pthread_join(tid[s], NULL);
        *cpu += args[s].cpu_seconds;
        if (args[s].rc && !failed) {
            fprintf(stderr, "epipe-bench pipeline: %s, stage %u: %s\n", o->kind, s, args[s].err);
            failed = 1;
        }
        worst = args[s].seconds > worst ? args[s].seconds : worst;
    }
    *step_ms = worst * 1e3 / o->steps;
    return failed;
}

/* --compare: 1f1b, zb-h1, interleaved and zb-v on the same model. A rank's
 * compute per micro-batch stays F + B + W whatever its chunk count: a chunk
 * of a rank with v chunks takes F/v, B/v, W/v. */
static int compare(const struct bench_opts *base)
{
    static const struct {
        const char *kind;
        unsigned chunks;
    } kinds[] = {{"1f1b", 1}, {"zb-h1", 1}, {"interleaved", 2}, {"zb-v", 2}, {"1f1b-2bw", 1}};
    enum { NK = sizeof kinds / sizeof kinds[0] };
    double meas[NK], sim[NK], over[NK], over_cpu[NK];
    if (!base->json)
        printf("%u ranks, %u micro-batches; per micro-batch and rank F %g ms, B %g ms, W %g ms "
               "(%s; a rank with v chunks takes 1/v of each per chunk):\n"
               "%-12s %6s %12s %12s %9s %10s %10s %8s %9s %9s\n",
               base->p, base->m, base->fwd_ms, base->bwd_ms, base->w_ms,
               base->spin ? "spin" : "sleep", "schedule", "chunks", "measured ms", "simulated ms",
               "meas/sim", "meas/1f1b", "sim/1f1b", "diff", "us/op", "cpu us/op");
    for (int k = 0; k < NK; k++) {
        struct bench_opts o = *base;
        o.kind = kinds[k].kind;
        o.chunks = kinds[k].chunks;
        o.fwd_ms = base->fwd_ms / o.chunks;
        o.bwd_ms = base->bwd_ms / o.chunks;
        o.w_ms = base->w_ms / o.chunks;
        size_t ops;
        double cpu;
        if (simulate(&o, &sim[k], &ops)) {
            fprintf(stderr, "epipe-bench pipeline: %s: %s\n", o.kind, epipe_last_error());
            return 1;
        }
        if (run_pipeline(&o, &meas[k], &cpu))
            return 1;
        /* the runtime's own cost: the same schedule with empty callbacks */
        struct bench_opts e = o;
        e.fwd_ms = e.bwd_ms = e.w_ms = 0;
        e.steps = 500;
        double empty_ms;
        if (run_pipeline(&e, &empty_ms, &cpu))
            return 1;
        over[k] = ops ? empty_ms * 1e3 / (double)ops : 0;
        over_cpu[k] = ops ? cpu * 1e6 / ((double)ops * o.p * e.steps) : 0;
        double mr = meas[k] / meas[0], sr = sim[k] / sim[0];
        if (base->json)
            printf("{\"bench\": \"pipeline-compare\", \"kind\": \"%s\", \"chunks\": %u, "
                   "\"ranks\": %u, \"microbatches\": %u, \"fwd_ms\": %g, \"bwd_ms\": %g, "
                   "\"w_ms\": %g, \"compute\": \"%s\", \"steps\": %d, \"measured_step_ms\": %.3f, "
                   "\"simulated_step_ms\": %.3f, \"measured_vs_1f1b\": %.4f, "
                   "\"simulated_vs_1f1b\": %.4f, \"overhead_us_per_op\": %.3f, "
                   "\"overhead_cpu_us_per_op\": %.3f}\n",
                   o.kind, o.chunks, o.p, o.m, base->fwd_ms, base->bwd_ms, base->w_ms,
                   o.spin ? "spin" : "sleep", o.steps, meas[k], sim[k], mr, sr, over[k],
                   over_cpu[k]);
        else
            printf("%-12s %6u %12.3f %12.3f %9.4f %10.4f %10.4f %+7.1f%% %9.2f %9.2f\n", o.kind,
                   o.chunks, meas[k], sim[k], meas[k] / sim[k], mr, sr, 100 * (mr / sr - 1),
                   over[k], over_cpu[k]);
        fflush(stdout);
    }
    if (!base->json)
        printf("diff: the measured ratio to 1f1b against the simulated one. The runtime's\n"
               "overhead, from the same schedule with empty callbacks: us/op, its step time\n"
               "over rank 0's compute ops (fill and drain included); cpu us/op, the stage\n"
               "threads' CPU time over all their ops. 1f1b-2bw runs its steps without a flush:\n"
               "its simulated step is the steady state's (the 4-step run between the ends\n"
               "of its third and fourth lists).\n");
    return 0;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: epipe-bench pipeline [--kind KIND] [--chunks V] [-p RANKS] [-m MICROBATCHES]\n"
            "       [--steps N] [--fwd-ms F --bwd-ms B [--w-ms W] [--spin]] [--elems N]\n"
            "       [--codec SPEC] [--spin-us US] [--compare] [--json]\n\n"
            "Runs a pipeline of in-process stages (threads). Without --fwd-ms/--bwd-ms the\n"
            "callbacks do nothing and the result is the runtime's overhead per op\n"
            "(one op = a forward or backward with its receive and send). With them, each\n"
            "callback sleeps that long (standing for device compute; --spin busy-waits\n"
            "instead, standing for CPU compute) and the measured step time is compared\n"
            "with the simulator's makespan for the same costs. --spin-us sets\n"
            "EPIPE_COMM_SPIN_US (receives busy-wait, yielding, before they sleep;\n"
            "inproc default 50). --w-ms is the weight-gradient part of the backward:\n"
            "an op of its own on kinds that split the backward (zb-h1, zb-v), else\n"
            "added to the backward. Costs are per op of one chunk.\n"
            "--compare runs 1f1b, zb-h1, interleaved (2 chunks), zb-v and 1f1b-2bw with the\n"
            "given costs per micro-batch and rank (default F = B = W = 2 ms; a rank\n"
            "with v chunks takes 1/v of each per chunk), and prints each step time\n"
            "relative to 1f1b beside the simulator's, and the runtime's overhead per op.\n");
}

int bench_pipeline_main(int argc, char **argv)
{
    struct bench_opts o = {
        .kind = "1f1b", .codec = "none", .p = 4, .m = 8, .steps = 0, .elems = 4, .spin_us = -1};
    enum {
        O_JSON = 256,
        O_SPIN_US,
        O_SPIN,
        O_KIND,
        O_CODEC,
        O_STEPS,
        O_FWD,
        O_BWD,
        O_ELEMS,
        O_W,
        O_CHUNKS,
        O_COMPARE
    };
    static const struct option longopts[] = {
        {"help", no_argument, NULL, 'h'},
        {"json", no_argument, NULL, O_JSON},
        {"spin-us", required_argument, NULL, O_SPIN_US},
        {"spin", no_argument, NULL, O_SPIN},
        {"kind", required_argument, NULL, O_KIND},
        {"codec", required_argument, NULL, O_CODEC},
        {"stages", required_argument, NULL, 'p'},
        {"microbatches", required_argument, NULL, 'm'},
        {"steps", required_argument, NULL, O_STEPS},
        {"fwd-ms", required_argument, NULL, O_FWD},
        {"bwd-ms", required_argument, NULL, O_BWD},
        {"elems", required_argument, NULL, O_ELEMS},
        {"w-ms", required_argument, NULL, O_W},
        {"chunks", required_argument, NULL, O_CHUNKS},
        {"compare", no_argument, NULL, O_COMPARE},
        {NULL, 0, NULL, 0},
    };
    opterr = 0;
    int opt;
    while ((opt = getopt_long(argc, argv, ":hp:m:", longopts, NULL)) != -1) {
        switch (opt) {
        case 'h': usage(stdout); return 0;
        case O_JSON: o.json = 1; break;
        case O_SPIN_US:
            EPIPE_CLI_INT("epipe-bench pipeline", "--spin-us", 0, 1000000, o.spin_us);
            break;
        case O_SPIN: o.spin = 1; break;
        case O_KIND: o.kind = optarg; break;
        case O_CODEC: o.codec = optarg; break;
        case 'p': EPIPE_CLI_INT("epipe-bench pipeline", "-p", 1, 64, o.p); break;
        case 'm': EPIPE_CLI_INT("epipe-bench pipeline", "-m", 1, 4096, o.m); break;
        case O_STEPS: EPIPE_CLI_INT("epipe-bench pipeline", "--steps", 1, 1000000, o.steps); break;
        case O_FWD: EPIPE_CLI_REAL("epipe-bench pipeline", "--fwd-ms", 0, 10000, o.fwd_ms); break;
        case O_BWD: EPIPE_CLI_REAL("epipe-bench pipeline", "--bwd-ms", 0, 10000, o.bwd_ms); break;
        case O_ELEMS: EPIPE_CLI_INT("epipe-bench pipeline", "--elems", 1, 1 << 28, o.elems); break;
        case O_W: EPIPE_CLI_REAL("epipe-bench pipeline", "--w-ms", 0, 10000, o.w_ms); break;
        case O_CHUNKS: EPIPE_CLI_INT("epipe-bench pipeline", "--chunks", 1, 8, o.chunks); break;
        case O_COMPARE: o.compare = 1; break;
        default: /* ':' or '?' */
            epipe_cli_bad_option("epipe-bench pipeline", argv, opt);
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "epipe-bench pipeline: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return 2;
    }
    if (o.compare && o.fwd_ms == 0 && o.bwd_ms == 0 && o.w_ms == 0)
        o.fwd_ms = o.bwd_ms = o.w_ms = 2;
    int timed = o.fwd_ms > 0 || o.bwd_ms > 0 || o.w_ms > 0;
    char spin_text[24] = "null"; /* JSON: null when the communicator's default was kept */
    if (o.spin_us >= 0)
        snprintf(spin_text, sizeof spin_text, "%ld", o.spin_us);
    if (o.p < 1 || o.p > 64 || o.m < 1 || o.elems < 1 || o.fwd_ms < 0 || o.bwd_ms < 0 ||
        o.w_ms < 0 || o.chunks > 8) {
        fprintf(stderr, "epipe-bench pipeline: need 1 <= p <= 64, m >= 1, elems >= 1, chunks "
                        "<= 8, costs >= 0\n");
        return 2;
    }
    if (o.steps <= 0)
        o.steps = timed ? 20 : 2000;
    if (o.compare)
        return compare(&o);
    double step_ms, cpu;
    if (run_pipeline(&o, &step_ms, &cpu))
        return 1;
    if (!timed) {
        double sim_unused;
        size_t ops;
        if (simulate(&o, &sim_unused, &ops) || !ops)
            ops = 2 * o.m;                              /* one chunk: m forwards, m backwards */
        double us_per_op = step_ms * 1e3 / (double)ops; /* rank 0's compute ops */
        /* CPU the stage threads spent per op, whatever the scheduler did with the waits */
        double cpu_us_per_op = cpu * 1e6 / ((double)ops * o.p * o.steps);
        if (o.json)
            printf("{\"bench\": \"pipeline-overhead\", \"kind\": \"%s\", \"stages\": %u, "
                   "\"microbatches\": %u, \"steps\": %d, \"elems\": %d, \"codec\": \"%s\", "
                   "\"spin_us\": %s, \"step_us\": %.2f, \"us_per_op\": %.3f, "
                   "\"cpu_us_per_op\": %.3f}\n",
                   o.kind, o.p, o.m, o.steps, o.elems, o.codec, spin_text, step_ms * 1e3, us_per_op,
                   cpu_us_per_op);
        else
            printf(
                "%s, %u stages, %u micro-batches, %d-value tensors, codec %s, empty callbacks:\n"
                "  %.1f us a step, %.2f us an op (forward or backward with its receive and send),\n"
                "  %.2f us of CPU an op (stage threads, user + system)\n",
                o.kind, o.p, o.m, o.elems, o.codec, step_ms * 1e3, us_per_op, cpu_us_per_op);
        return 0;
    }
    double sim_ms;
    size_t ops;
    if (simulate(&o, &sim_ms, &ops)) {
        fprintf(stderr, "epipe-bench pipeline: %s\n", epipe_last_error());
        return 1;
    }
    double ideal = (o.m + o.p - 1.0) / o.m * o.m * (o.fwd_ms + o.bwd_ms + o.w_ms);
    if (o.json)
        printf("{\"bench\": \"pipeline-step\", \"kind\": \"%s\", \"stages\": %u, "
               "\"microbatches\": %u, \"steps\": %d, \"fwd_ms\": %g, \"bwd_ms\": %g, "
               "\"w_ms\": %g, \"chunks\": %u, \"compute\": \"%s\", \"spin_us\": %s, \"codec\": "
               "\"%s\", \"measured_step_ms\": %.3f, "
               "\"simulated_step_ms\": %.3f, \"ratio\": %.4f, \"compute_only_ideal_ms\": %.3f}\n",
               o.kind, o.p, o.m, o.steps, o.fwd_ms, o.bwd_ms, o.w_ms, o.chunks,
               o.spin ? "spin" : "sleep", spin_text, o.codec, step_ms, sim_ms, step_ms / sim_ms,
               ideal);
    else
        printf("%s, %u ranks, %u micro-batches, forward %g ms, backward %g ms, weight %g ms, "
               "codec %s:\n"
               "  measured %.3f ms a step, simulated %.3f ms: ratio %.4f\n",
               o.kind, o.p, o.m, o.fwd_ms, o.bwd_ms, o.w_ms, o.codec, step_ms, sim_ms,
               step_ms / sim_ms);
    return 0;
}
