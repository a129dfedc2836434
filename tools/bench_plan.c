/* epipe-bench plan: how long the planner takes on a synthetic profile of
 * the size its target names (100 layers, 8 stages, 10 codecs), against
 * one run of the schedule simulator on the plan it finds. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <epipe/epipe.h>

#include "bench.h"
#include "cli.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: epipe-bench plan [--layers N] [--stages P] [--codecs C]\n"
               "       [--microbatches M] [--bandwidth BYTES_PER_S] [--reps R]\n\n"
               "Plans a synthetic chain of N layers (default 100: varied compute, output\n"
               "sizes from 64 KB to 8 MB) on P stages (default 8) with C codec candidates\n"
               "per boundary and direction (default 10), best of R runs (default 3), and\n"
               "prints the time it took beside one simulator run of the chosen plan.\n");
}

int bench_plan_main(int argc, char **argv)
{
    unsigned L = 100, P = 8, C = 10, M = 8, reps = 3;
    double bw = 12.5e6; /* 100 Mbit/s */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        unsigned *u = !strcmp(a, "--layers")         ? &L
                      : !strcmp(a, "--stages")       ? &P
                      : !strcmp(a, "--codecs")       ? &C
                      : !strcmp(a, "--microbatches") ? &M
                      : !strcmp(a, "--reps")         ? &reps
                                                     : NULL;
        if ((u || !strcmp(a, "--bandwidth")) && v) {
            char *end;
            double d = strtod(v, &end);
            if (*end || !(d > 0) || d > 1e15) {
                fprintf(stderr, "epipe-bench plan: bad value '%s' for %s\n", v, a);
                return 2;
            }
            if (u)
                *u = (unsigned)d;
            else
                bw = d;
            i++;
            continue;
        }
        fprintf(stderr, "epipe-bench plan: unknown option '%s'\n", a);
        usage(stderr);
        return 2;
    }
    if (L < 2 || P < 1 || P > L || reps < 1) {
        fprintf(stderr, "epipe-bench plan: need 2 <= layers, 1 <= stages <= layers\n");
        return 2;
    }
    epipe_plan_layer *l = calloc(L, sizeof *l);
    epipe_plan_codec *c = calloc((size_t)(L - 1) * 2 * C, sizeof *c);
    char(*specs)[32] = calloc(C, sizeof *specs);
    if (!l || !c || !specs) {
        fprintf(stderr, "epipe-bench plan: out of memory\n");
        return 1;
    }
    for (unsigned i = 0; i < L; i++) {
        double f = 1e-3 * (1 + (i * 37 % 11)) / 4;
        l[i] = (epipe_plan_layer){f, 2 * f, f, 65536.0 * (1u << (i * 13 % 8)), 4e6, 1e6, 0};
    }
    for (unsigned k = 0; k < C; k++)
        snprintf(specs[k], sizeof specs[k], "codec-%u", k);
    size_t nc = 0;
    for (unsigned b = 0; b + 1 < L; b++)
        for (unsigned d = 0; d < 2; d++)
            for (unsigned k = 0; k < C; k++) {
                double ratio = 1.0 / (2 + k), bytes = l[b].out_bytes;
                c[nc++] = (epipe_plan_codec){
                    specs[k],      b, d, bytes * (1 + k) * 1e-10, bytes * (1 + k) * 5e-11, ratio,
                    1e-4 * (k + 1)};
            }
    epipe_plan_options o = EPIPE_PLAN_OPTIONS_INIT;
    o.stages = P;
    o.microbatches = M;
    o.bandwidth = bw;
    double best = INFINITY;
    epipe_plan *p = NULL;
    for (unsigned r = 0; r < reps; r++) {
        epipe_plan_destroy(p);
        double t0 = bench_now();
        if (epipe_plan_create(&p, l, L, c, nc, &o)) {
            fprintf(stderr, "epipe-bench plan: %s\n", epipe_last_error());
            return 1;
        }
        double t = bench_now() - t0;
        best = t < best ? t : best;
    }
    /* one simulator run of the same size, for scale */
    epipe_schedule *s = NULL;
    epipe_sim *sim = NULL;
    double ts = NAN;
    if (!epipe_schedule_create(&s, epipe_plan_schedule(p), P, M) && !epipe_sim_create(&sim, s)) {
        double t0 = bench_now();
        epipe_sim_run(sim);
        ts = bench_now() - t0;
    }
    printf("plan: %u layers, %u stages, %u codecs a boundary and direction, %u micro-batches, "
           "%.3g MB/s links\n",
           L, P, C, M, bw / 1e6);
    printf("planning  %.4f s (best of %u)   one simulator run %.2e s\n", best, reps, ts);
    printf("chosen    schedule %s, step %.4f s; compression-blind %.4f s (%.2fx)\n",
           epipe_plan_schedule(p), epipe_plan_step_seconds(p), epipe_plan_blind_step_seconds(p),
           epipe_plan_blind_step_seconds(p) / epipe_plan_step_seconds(p));
    epipe_sim_destroy(sim);
    epipe_schedule_destroy(s);
    epipe_plan_destroy(p);
    free(l);
    free(c);
    free(specs);
    return 0;
}
