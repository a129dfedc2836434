/* epipe-bench pipeline: the stage runtime's cost. Per-op overhead with empty
 * callbacks, and step time with timed callbacks against the simulator. */
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
    unsigned p, m;
    int steps, json, spin;
    double fwd_ms, bwd_ms; /* 0: empty callbacks (overhead mode) */
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
    busy_for(a->o->bwd_ms, a->o->spin);
    *gin = &a->t;
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
    a->rc = epipe_stage_create(&st, a->comm, o->kind, o->m);
    if (a->rc == EPIPE_OK)
        a->rc = epipe_stage_set_codec(st, EPIPE_DIR_ACTIVATION, EPIPE_ALL_BOUNDARIES, o->codec);
    if (a->rc == EPIPE_OK)
        a->rc = epipe_stage_set_codec(st, EPIPE_DIR_GRADIENT, EPIPE_ALL_BOUNDARIES, o->codec);
    epipe_stage_callbacks cb = EPIPE_STAGE_CALLBACKS_INIT;
    cb.user = a;
    cb.forward = fwd;
    cb.backward = bwd;
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
    if (a->rc) {
        snprintf(a->err, sizeof a->err, "%s", epipe_stage_last_error(st));
        epipe_comm_abort(a->comm);
    }
    epipe_stage_destroy(st);
    epipe_comm_destroy(a->comm);
    free(a->buf);
    return NULL;
}

static int simulated_makespan(const struct bench_opts *o, double *ms)
{
    epipe_schedule *s;
    epipe_sim *sim;
    int rc = epipe_schedule_create(&s, o->kind, o->p, o->m);
    if (rc)
        return rc;
    rc = epipe_sim_create(&sim, s);
    if (!rc)
        rc = epipe_sim_set_cost(sim, EPIPE_SIM_FORWARD, EPIPE_SIM_ALL_STAGES, o->fwd_ms);
    if (!rc)
        rc = epipe_sim_set_cost(sim, EPIPE_SIM_BACKWARD, EPIPE_SIM_ALL_STAGES, o->bwd_ms);
    if (!rc)
        rc = epipe_sim_run(sim);
    if (!rc)
        *ms = epipe_sim_makespan(sim);
    epipe_sim_destroy(sim);
    epipe_schedule_destroy(s);
    return rc;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: epipe-bench pipeline [--kind gpipe|1f1b] [-p STAGES] [-m MICROBATCHES]\n"
               "       [--steps N] [--fwd-ms F --bwd-ms B [--spin]] [--elems N] [--codec SPEC]\n"
               "       [--spin-us US] [--json]\n\n"
               "Runs a pipeline of in-process stages (threads). Without --fwd-ms/--bwd-ms the\n"
               "callbacks do nothing and the result is the runtime's overhead per op\n"
               "(one op = a forward or backward with its receive and send). With them, each\n"
               "callback sleeps that long (standing for device compute; --spin busy-waits\n"
               "instead, standing for CPU compute) and the measured step time is compared\n"
               "with the simulator's makespan for the same costs. --spin-us sets\n"
               "EPIPE_COMM_SPIN_US (receives busy-wait, yielding, before they sleep;\n"
               "inproc default 50).\n");
}

int bench_pipeline_main(int argc, char **argv)
{
    struct bench_opts o = {
        .kind = "1f1b", .codec = "none", .p = 4, .m = 8, .steps = 0, .elems = 4, .spin_us = -1};
    enum { O_JSON = 256, O_SPIN_US, O_SPIN, O_KIND, O_CODEC, O_STEPS, O_FWD, O_BWD, O_ELEMS };
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
        {NULL, 0, NULL, 0},
    };
    opterr = 0;
    int opt;
    while ((opt = getopt_long(argc, argv, ":hp:m:", longopts, NULL)) != -1) {
        switch (opt) {
        case 'h': usage(stdout); return 0;
        case O_JSON: o.json = 1; break;
        case O_SPIN_US: o.spin_us = atol(optarg); break;
        case O_SPIN: o.spin = 1; break;
        case O_KIND: o.kind = optarg; break;
        case O_CODEC: o.codec = optarg; break;
        case 'p': o.p = (unsigned)atoi(optarg); break;
        case 'm': o.m = (unsigned)atoi(optarg); break;
        case O_STEPS: o.steps = atoi(optarg); break;
        case O_FWD: o.fwd_ms = atof(optarg); break;
        case O_BWD: o.bwd_ms = atof(optarg); break;
        case O_ELEMS: o.elems = atoi(optarg); break;
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
    int timed = o.fwd_ms > 0 || o.bwd_ms > 0;
    char spin_text[24] = "null"; /* JSON: null when the communicator's default was kept */
    if (o.spin_us >= 0)
        snprintf(spin_text, sizeof spin_text, "%ld", o.spin_us);
    if (o.p < 1 || o.p > 64 || o.m < 1 || o.elems < 1 || o.fwd_ms < 0 || o.bwd_ms < 0) {
        fprintf(stderr,
                "epipe-bench pipeline: need 1 <= p <= 64, m >= 1, elems >= 1, costs >= 0\n");
        return 2;
    }
    if (o.steps <= 0)
        o.steps = timed ? 20 : 2000;
    epipe_comm *comms[64];
    if (epipe_comm_create_inproc(comms, o.p)) {
        fprintf(stderr, "epipe-bench pipeline: %s\n", epipe_last_error());
        return 1;
    }
    struct stage_arg args[64];
    pthread_t tid[64];
    memset(args, 0, sizeof args);
    for (unsigned s = 0; s < o.p; s++) {
        args[s].comm = comms[s];
        if (o.spin_us >= 0 && epipe_comm_set_param(comms[s], EPIPE_COMM_SPIN_US, o.spin_us)) {
            fprintf(stderr, "epipe-bench pipeline: %s\n", epipe_comm_last_error(comms[s]));
            return 2;
        }
        args[s].o = &o;
        pthread_create(&tid[s], NULL, stage_main, &args[s]);
    }
    double worst = 0, cpu = 0;
    for (unsigned s = 0; s < o.p; s++) {
        pthread_join(tid[s], NULL);
        cpu += args[s].cpu_seconds;
        if (args[s].rc) {
            fprintf(stderr, "epipe-bench pipeline: stage %u: %s\n", s, args[s].err);
            return 1;
        }
        worst = args[s].seconds > worst ? args[s].seconds : worst;
    }
    double step_ms = worst * 1e3 / o.steps;
    if (!timed) {
        double us_per_op = step_ms * 1e3 / (2.0 * o.m); /* per stage: m forwards, m backwards */
        /* CPU the stage threads spent per op, whatever the scheduler did with the waits */
        double cpu_us_per_op = cpu * 1e6 / (2.0 * o.m * o.p * o.steps);
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
    if (simulated_makespan(&o, &sim_ms)) {
        fprintf(stderr, "epipe-bench pipeline: %s\n", epipe_last_error());
        return 1;
    }
    double ideal = (o.m + o.p - 1.0) / o.m * o.m * (o.fwd_ms + o.bwd_ms);
    if (o.json)
        printf(
            "{\"bench\": \"pipeline-step\", \"kind\": \"%s\", \"stages\": %u, "
            "\"microbatches\": %u, \"steps\": %d, \"fwd_ms\": %g, \"bwd_ms\": %g, "
            "\"compute\": \"%s\", \"spin_us\": %s, \"codec\": \"%s\", \"measured_step_ms\": %.3f, "
            "\"simulated_step_ms\": %.3f, \"ratio\": %.4f, \"compute_only_ideal_ms\": %.3f}\n",
            o.kind, o.p, o.m, o.steps, o.fwd_ms, o.bwd_ms, o.spin ? "spin" : "sleep", spin_text,
            o.codec, step_ms, sim_ms, step_ms / sim_ms, ideal);
    else
        printf("%s, %u stages, %u micro-batches, forward %g ms, backward %g ms, codec %s:\n"
               "  measured %.3f ms a step, simulated %.3f ms: ratio %.4f\n",
               o.kind, o.p, o.m, o.fwd_ms, o.bwd_ms, o.codec, step_ms, sim_ms, step_ms / sim_ms);
    return 0;
}
