/* epipe-bench schedule: simulates a pipeline schedule and prints it as a
 * per-stage timeline with its makespan, bubble and peak live activations. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <epipe/epipe.h>

#include "bench.h"
#include "cli.h"

struct sopts {
    const char *kind;
    unsigned stages, mbs;
    double fwd, bwd, comm;
    int json;
};

static void usage(FILE *f)
{
    fprintf(f, "usage: epipe-bench schedule [--kind gpipe|1f1b] [-p STAGES] [-m MICROBATCHES]\n"
               "       [--forward-cost X] [--backward-cost X] [--comm-cost X] [--json]\n\n"
               "Simulates one training step of the schedule (default 1f1b, p=4, m=8) and prints\n"
               "each stage's compute ops on a timeline (F3 / B3: forward / backward of\n"
               "micro-batch 3; dots: idle), the makespan, the bubble fraction beside the\n"
               "uniform-cost formula (p-1)/(m+p-1), and the peak live activations per stage.\n"
               "Costs default to forward 1, backward 1, links 0 (--comm-cost sets both\n"
               "directions of every link). --json prints one JSON object instead.\n");
}

static int parse_unsigned(const char *s, unsigned *out)
{
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (!*s || *end || errno || s[0] == '-' || v > 0xffffffffu)
        return -1;
    *out = (unsigned)v;
    return 0;
}

static int parse_cost(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (!*s || *end || errno || !isfinite(v) || v < 0)
        return -1;
    *out = v;
    return 0;
}

static int parse_args(int argc, char **argv, struct sopts *o)
{
    enum { O_FWD = 256, O_BWD, O_COMM };
    static const struct option longopts[] = {
        {"help", no_argument, NULL, 'h'},
        {"json", no_argument, NULL, 'j'},
        {"kind", required_argument, NULL, 'k'},
        {"stages", required_argument, NULL, 'p'},
        {"microbatches", required_argument, NULL, 'm'},
        {"forward-cost", required_argument, NULL, O_FWD},
        {"backward-cost", required_argument, NULL, O_BWD},
        {"comm-cost", required_argument, NULL, O_COMM},
        {NULL, 0, NULL, 0},
    };
    *o = (struct sopts){.kind = "1f1b", .stages = 4, .mbs = 8, .fwd = 1, .bwd = 1};
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, ":hk:p:m:", longopts, NULL)) != -1) {
        char a[64];
        int bad = 0;
        const char *want = "a finite cost >= 0";
        switch (c) {
        case 'h': usage(stdout); return 1;
        case 'j': o->json = 1; break;
        case 'k': o->kind = optarg; break;
        case 'p': bad = parse_unsigned(optarg, &o->stages), want = "a whole number"; break;
        case 'm': bad = parse_unsigned(optarg, &o->mbs), want = "a whole number"; break;
        case O_FWD: bad = parse_cost(optarg, &o->fwd); break;
        case O_BWD: bad = parse_cost(optarg, &o->bwd); break;
        case O_COMM: bad = parse_cost(optarg, &o->comm); break;
        default: /* ':' or '?' */
            epipe_cli_bad_option("epipe-bench schedule", argv, c);
            usage(stderr);
            return -1;
        }
        if (bad) {
            fprintf(stderr, "epipe-bench schedule: option '%s' needs %s, not '%s'\n",
                    epipe_cli_optname(argv, a, sizeof a), want, optarg);
            return -1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "epipe-bench schedule: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return -1;
    }
    return 0;
}

static void print_json(const epipe_schedule *sc, const epipe_sim *sim)
{
    unsigned p = epipe_schedule_stages(sc);
    printf("{\"kind\": \"%s\", \"stages\": %u, \"microbatches\": %u, \"makespan\": %.15g, "
           "\"bubble_fraction\": %.15g, \"peak_live\": [",
           epipe_schedule_kind(sc), p, epipe_schedule_microbatches(sc), epipe_sim_makespan(sim),
           epipe_sim_bubble_fraction(sim));
    for (unsigned s = 0; s < p; s++) {
        unsigned peak = 0;
        epipe_sim_peak_live(sim, s, &peak);
        printf("%s%u", s ? ", " : "", peak);
    }
    printf("], \"ops\": [");
    for (unsigned s = 0; s < p; s++) {
        const epipe_op *ops;
        size_t n, j = 0;
        epipe_schedule_ops(sc, s, &ops, &n);
        printf("%s[", s ? ", " : "");
        for (size_t k = 0; k < n; k++)
            if (ops[k].kind == EPIPE_OP_FORWARD || ops[k].kind == EPIPE_OP_BACKWARD)
                printf("%s\"%s%u\"", j++ ? ", " : "", epipe_op_kind_name(ops[k].kind),
                       ops[k].microbatch);
        printf("]");
    }
    printf("]}\n");
}

/* Column of time t at `scale` columns per time unit. */
static size_t col(double t, double scale)
{
    return (size_t)llround(t * scale);
}

#define MAX_TIMELINE_COLS 400

static void print_timeline(const epipe_schedule *sc, const epipe_sim *sim, const struct sopts *o)
{
    unsigned p = epipe_schedule_stages(sc), m = epipe_schedule_microbatches(sc);
    double makespan = epipe_sim_makespan(sim);
    char label[16];
    int lw = snprintf(label, sizeof label, "F%u", m - 1);
    /* The cheapest compute op gets its label and one space. */
    double unit = o->fwd > 0 && (o->fwd < o->bwd || o->bwd == 0) ? o->fwd : o->bwd;
    double scale = unit > 0 ? (lw + 1) / unit : 1;
    size_t width = col(makespan, scale);

    printf("%s schedule, %u stages, %u micro-batches (costs: forward %g, backward %g, link %g)\n\n",
           epipe_schedule_kind(sc), p, m, o->fwd, o->bwd, o->comm);
    if (width > MAX_TIMELINE_COLS || unit <= 0) {
        printf("(timeline of %zu columns not drawn; --json lists every op)\n\n", width);
    } else {
        char *row = malloc(width + 16);
        if (!row)
            return;
        /* A ruler: a time mark where the numbers do not collide. */
        static const double steps[] = {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000};
        double step = unit;
        for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++)
            if ((step = steps[i] * unit) * scale >= 6)
                break;
        memset(row, ' ', width + 8);
        for (unsigned i = 0; i * step <= makespan + 1e-9; i++) {
            double t = i * step;
            char num[24];
            int len = snprintf(num, sizeof num, "%g", t);
            size_t c = col(t, scale);
            if (c + (size_t)len <= width + 8)
                memcpy(row + c, num, (size_t)len);
        }
        size_t end = width + 8;
        while (end > 0 && row[end - 1] == ' ')
            end--;
        row[end] = '\0';
        printf("time    %s\n", row);
        for (unsigned s = 0; s < p; s++) {
            const epipe_op *ops;
            size_t n;
            epipe_schedule_ops(sc, s, &ops, &n);
            memset(row, '.', width);
            row[width] = '\0';
            for (size_t k = 0; k < n; k++) {
                if (ops[k].kind != EPIPE_OP_FORWARD && ops[k].kind != EPIPE_OP_BACKWARD)
                    continue;
                double t0, t1;
                epipe_sim_op_time(sim, s, k, &t0, &t1);
                size_t a = col(t0, scale), b = col(t1, scale);
                if (b > width)
                    b = width;
                if (a >= b)
                    continue;
                int len = snprintf(label, sizeof label, "%s%u", epipe_op_kind_name(ops[k].kind),
                                   ops[k].microbatch);
                memset(row + a, ' ', b - a);
                memcpy(row + a, label, (size_t)len < b - a ? (size_t)len : b - a);
            }
            printf("stage %-2u%s\n", s, row);
        }
        printf("\n");
        free(row);
    }

    double formula = (double)(p - 1) / (double)(m + p - 1);
    printf("makespan         %g  (compute per stage %g)\n", makespan, m * (o->fwd + o->bwd));
    printf("bubble fraction  %.4f  (uniform-cost formula (p-1)/(m+p-1) = %u/%u = %.4f)\n",
           epipe_sim_bubble_fraction(sim), p - 1, m + p - 1, formula);
    printf("peak live        ");
    for (unsigned s = 0; s < p; s++) {
        if (p > 16 && s == 8) {
            printf(" ...");
            s = p - 4;
        }
        unsigned peak = 0;
        epipe_sim_peak_live(sim, s, &peak);
        printf("%s%u", s ? " " : "", peak);
    }
    printf("  (activations alive at once on stages 0..%u", p - 1);
    if (!strcmp(epipe_schedule_kind(sc), "1f1b"))
        printf("; 1f1b bound min(p-s,m)");
    else if (!strcmp(epipe_schedule_kind(sc), "gpipe"))
        printf("; gpipe holds all m");
    printf(")\n");
}

int bench_schedule_main(int argc, char **argv)
{
    struct sopts o;
    int rc = parse_args(argc, argv, &o);
    if (rc)
        return rc > 0 ? 0 : 2;
    epipe_schedule *sc;
    if (epipe_schedule_create(&sc, o.kind, o.stages, o.mbs) != EPIPE_OK) {
        fprintf(stderr, "epipe-bench schedule: %s\n", epipe_last_error());
        return 2;
    }
    epipe_sim *sim;
    rc = epipe_sim_create(&sim, sc);
    if (rc == EPIPE_OK)
        rc = epipe_sim_set_cost(sim, EPIPE_SIM_FORWARD, EPIPE_SIM_ALL_STAGES, o.fwd);
    if (rc == EPIPE_OK)
        rc = epipe_sim_set_cost(sim, EPIPE_SIM_BACKWARD, EPIPE_SIM_ALL_STAGES, o.bwd);
    if (rc == EPIPE_OK)
        rc = epipe_sim_set_cost(sim, EPIPE_SIM_SEND_ACT, EPIPE_SIM_ALL_STAGES, o.comm);
    if (rc == EPIPE_OK)
        rc = epipe_sim_set_cost(sim, EPIPE_SIM_SEND_GRAD, EPIPE_SIM_ALL_STAGES, o.comm);
    if (rc == EPIPE_OK)
        rc = epipe_sim_run(sim);
    if (rc != EPIPE_OK) {
        fprintf(stderr, "epipe-bench schedule: %s\n", epipe_last_error());
        epipe_sim_destroy(sim);
        epipe_schedule_destroy(sc);
        return 1;
    }
    if (o.json)
        print_json(sc, sim);
    else
        print_timeline(sc, sim, &o);
    epipe_sim_destroy(sim);
    epipe_schedule_destroy(sc);
    return 0;
}
