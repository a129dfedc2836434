/* epipe-bench schedule: simulates a pipeline schedule and prints it as a
 * per-rank timeline with its makespan, bubble and peak live activations. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <epipe/epipe.h>

#include "../lib/parse.h"
#include "bench.h"
#include "cli.h"

#define MAX_PLACEMENT EPIPE_SCHEDULE_MAX_STAGES

struct sopts {
    const char *kind;
    unsigned stages, mbs, chunks;
    int stages_set;
    double fwd, bwd, wgt, comm, codec;
    unsigned placement[MAX_PLACEMENT], placement_len;
    int json;
};

static void usage(FILE *f)
{
    fprintf(f, "usage: epipe-bench schedule [--kind KIND] [-p RANKS] [-m MICROBATCHES]\n"
               "       [--chunks V] [--placement R,R,...] [--forward-cost X] [--backward-cost X]\n"
               "       [--weight-cost X] [--comm-cost X] [--codec-cost X] [--json]\n\n"
               "Simulates one training step of the schedule (default 1f1b, p=4, m=8; kinds:\n"
               "gpipe, 1f1b, interleaved, zb-h1, zb-v; 1f1b-async and 1f1b-2bw run 4 steps\n"
               "back to back and their drain) and prints each rank's compute ops on a\n"
               "timeline (F3 / B3 / Bi3 / W3: forward / backward / input-gradient / weight-\n"
               "gradient backward of micro-batch 3, F3.1 on chunk 1; dots: idle), the makespan,\n"
               "the bubble (idle over the step, and idle over the ideal compute beside the\n"
               "published formula), and the peak live activations per rank.\n"
               "--chunks: model chunks per rank (round-robin; a V for zb-v); --placement: the\n"
               "rank of each pipeline stage, e.g. 0,1,0 (then -p defaults to the ranks named).\n"
               "Costs are per op of one chunk: forward 1, backward 1, weight 0 (a schedule that\n"
               "does not split the backward pays backward + weight), links 0 (--comm-cost sets\n"
               "both directions of every link between ranks; chunks on one rank hand over for\n"
               "free), codec 0 (encode and decode of each message between ranks).\n"
               "--json prints one JSON object instead.\n");
}

/* Reads a placement "0,1,0": up to MAX_PLACEMENT ranks, each a whole number
 * below MAX_PLACEMENT. 0, or -1 for anything else (empty entries included). */
static int parse_placement(const char *s, unsigned *out, unsigned *len)
{
    unsigned n = 0;
    const char *p = s;
    for (;;) {
        const char *comma = strchr(p, ',');
        size_t l = comma ? (size_t)(comma - p) : strlen(p);
        char item[16];
        int64_t v;
        if (l == 0 || l >= sizeof item || n == MAX_PLACEMENT)
            return -1;
        memcpy(item, p, l);
        item[l] = '\0';
        if (item[0] == '+' || item[0] == ' ' ||
            epipe_parse_i64(item, 0, MAX_PLACEMENT - 1, &v) != 0)
            return -1;
        out[n++] = (unsigned)v;
        if (!comma)
            break;
        p = comma + 1;
    }
    *len = n;
    return 0;
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
    enum { O_FWD = 256, O_BWD, O_COMM, O_WGT, O_CODEC, O_CHUNKS, O_PLACE };
    static const struct option longopts[] = {
        {"help", no_argument, NULL, 'h'},
        {"json", no_argument, NULL, 'j'},
        {"kind", required_argument, NULL, 'k'},
        {"stages", required_argument, NULL, 'p'},
        {"microbatches", required_argument, NULL, 'm'},
        {"forward-cost", required_argument, NULL, O_FWD},
        {"backward-cost", required_argument, NULL, O_BWD},
        {"comm-cost", required_argument, NULL, O_COMM},
        {"weight-cost", required_argument, NULL, O_WGT},
        {"codec-cost", required_argument, NULL, O_CODEC},
        {"chunks", required_argument, NULL, O_CHUNKS},
        {"placement", required_argument, NULL, O_PLACE},
        {NULL, 0, NULL, 0},
    };
    memset(o, 0, sizeof *o);
    o->kind = "1f1b", o->stages = 4, o->mbs = 8, o->fwd = 1, o->bwd = 1;
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
        case 'p':
            bad = parse_unsigned(optarg, &o->stages), want = "a whole number";
            o->stages_set = 1;
            break;
        case O_CHUNKS: bad = parse_unsigned(optarg, &o->chunks), want = "a whole number"; break;
        case O_PLACE:
            bad = parse_placement(optarg, o->placement, &o->placement_len);
            want = "a list of ranks like 0,1,0";
            break;
        case 'm': bad = parse_unsigned(optarg, &o->mbs), want = "a whole number"; break;
        case O_FWD: bad = parse_cost(optarg, &o->fwd); break;
        case O_BWD: bad = parse_cost(optarg, &o->bwd); break;
        case O_COMM: bad = parse_cost(optarg, &o->comm); break;
        case O_WGT: bad = parse_cost(optarg, &o->wgt); break;
        case O_CODEC: bad = parse_cost(optarg, &o->codec); break;
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
    if (o->placement_len && !o->stages_set) {
        o->stages = 0;
        for (unsigned i = 0; i < o->placement_len; i++)
            if (o->placement[i] + 1 > o->stages)
                o->stages = o->placement[i] + 1;
    }
    return 0;
}

/* A compute op (the ones a timeline shows)? */
static int is_compute(uint32_t kind)
{
    return kind == EPIPE_OP_FORWARD || kind == EPIPE_OP_BACKWARD ||
           kind == EPIPE_OP_BACKWARD_INPUT || kind == EPIPE_OP_BACKWARD_WEIGHT;
}

/* "F3", or "F3.1" (chunk 1) when some rank holds several chunks. */
static int op_label(char *buf, size_t cap, const epipe_op *op, int chunked)
{
    if (chunked)
        return snprintf(buf, cap, "%s%u.%u", epipe_op_kind_name(op->kind), op->microbatch,
                        op->chunk);
    return snprintf(buf, cap, "%s%u", epipe_op_kind_name(op->kind), op->microbatch);
}

static int chunked(const epipe_schedule *sc)
{
    return epipe_schedule_pipeline_stages(sc) != epipe_schedule_stages(sc);
}

/* The ops the simulator ran for a rank: the one list, or for a schedule
 * without a flush its EPIPE_SIM_ASYNC_STEPS steps and the drain, in order
 * (micro-batch ids stay those of each step). Caller frees; NULL on error. */
static epipe_op *run_ops(const epipe_schedule *sc, unsigned rank, size_t *n)
{
    int async = epipe_schedule_weights(sc) != EPIPE_WEIGHTS_FLUSH;
    unsigned steps = async ? EPIPE_SIM_ASYNC_STEPS : 1;
    size_t total = 0;
    for (unsigned t = 0; t <= steps; t++) {
        const epipe_op *ops;
        size_t c;
        int ph = t == 0 ? EPIPE_PHASE_FIRST : t < steps ? EPIPE_PHASE_STEADY : EPIPE_PHASE_DRAIN;
        if (epipe_schedule_phase_ops(sc, rank, ph, &ops, &c))
            return NULL;
        total += c;
    }
    epipe_op *out = malloc(sizeof *out * (total ? total : 1));
    if (!out)
        return NULL;
    *n = 0;
    for (unsigned t = 0; t <= steps; t++) {
        const epipe_op *ops;
        size_t c;
        int ph = t == 0 ? EPIPE_PHASE_FIRST : t < steps ? EPIPE_PHASE_STEADY : EPIPE_PHASE_DRAIN;
        epipe_schedule_phase_ops(sc, rank, ph, &ops, &c);
        memcpy(out + *n, ops, sizeof *ops * c);
        *n += c;
    }
    return out;
}

/* The published bubble (idle over ideal compute, at equal costs) of the
 * kind on its default layout, its formula in words, or NAN when none. */
static double published(const epipe_schedule *sc, char *what, size_t cap)
{
    const char *k = epipe_schedule_kind(sc);
    unsigned p = epipe_schedule_stages(sc), m = epipe_schedule_microbatches(sc);
    unsigned v = epipe_schedule_pipeline_stages(sc) / p;
    int uniform = epipe_schedule_pipeline_stages(sc) == v * p;
    for (unsigned s = 0; uniform && s < epipe_schedule_pipeline_stages(sc); s++) {
        unsigned r;
        epipe_schedule_placement(sc, s, &r, NULL);
        uniform = !strcmp(k, "zb-v") || r == s % p;
    }
    if (!uniform) {
        snprintf(what, cap, "no published formula for this placement");
        return NAN;
    }
    if ((!strcmp(k, "1f1b") || !strcmp(k, "gpipe")) && v == 1) {
        snprintf(what, cap, "published (p-1)/m = %u/%u", p - 1, m);
        return (double)(p - 1) / m;
    }
    if (!strcmp(k, "interleaved") && m >= p) {
        snprintf(what, cap, "published (p-1)/(v*m) = %u/%u", p - 1, v * m);
        return (double)(p - 1) / (v * m);
    }
    if (!strcmp(k, "zb-h1") && m >= p) {
        snprintf(what, cap, "published, at F = B = W, (p-1)/(3m) = %u/%u", p - 1, 3 * m);
        return (double)(p - 1) / (3 * m);
    }
    snprintf(what, cap, "no published formula for %s at these sizes", k);
    return NAN;
}

static void print_json(const epipe_schedule *sc, const epipe_sim *sim)
{
    unsigned p = epipe_schedule_stages(sc), P = epipe_schedule_pipeline_stages(sc);
    double bub = epipe_sim_bubble_fraction(sim);
    char what[96];
    double pub = published(sc, what, sizeof what);
    printf("{\"kind\": \"%s\", \"stages\": %u, \"pipeline_stages\": %u, \"microbatches\": %u, "
           "\"splits_backward\": %s, \"makespan\": %.15g, \"bubble_fraction\": %.15g, "
           "\"bubble_over_ideal\": %.15g, \"published_bubble\": ",
           epipe_schedule_kind(sc), p, P, epipe_schedule_microbatches(sc),
           epipe_schedule_splits_backward(sc) ? "true" : "false", epipe_sim_makespan(sim), bub,
           bub < 1 ? bub / (1 - bub) : 0.0);
    if (isnan(pub))
        printf("null");
    else
        printf("%.15g", pub);
    printf(", \"placement\": [");
    for (unsigned s = 0; s < P; s++) {
        unsigned r = 0;
        epipe_schedule_placement(sc, s, &r, NULL);
        printf("%s%u", s ? ", " : "", r);
    }
    printf("], \"peak_live\": [");
    for (unsigned s = 0; s < p; s++) {
        unsigned peak = 0;
        epipe_sim_peak_live(sim, s, &peak);
        printf("%s%u", s ? ", " : "", peak);
    }
    printf("], \"ops\": [");
    for (unsigned s = 0; s < p; s++) {
        size_t n = 0, j = 0;
        epipe_op *ops = run_ops(sc, s, &n);
        printf("%s[", s ? ", " : "");
        for (size_t k = 0; ops && k < n; k++)
            if (is_compute(ops[k].kind)) {
                char label[48];
                op_label(label, sizeof label, &ops[k], chunked(sc));
                printf("%s\"%s\"", j++ ? ", " : "", label);
            }
        printf("]");
        free(ops);
    }
    printf("], \"steps\": %u, \"weight_versions\": [",
           epipe_schedule_weights(sc) != EPIPE_WEIGHTS_FLUSH ? EPIPE_SIM_ASYNC_STEPS : 1);
    for (unsigned s = 0; s < p; s++)
        printf("%s%u", s ? ", " : "", epipe_schedule_weight_versions(sc, s));
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
    unsigned P = epipe_schedule_pipeline_stages(sc);
    int split = epipe_schedule_splits_backward(sc), ch = chunked(sc);
    double makespan = epipe_sim_makespan(sim);
    char label[48];
    epipe_op widest = {.kind = split ? EPIPE_OP_BACKWARD_INPUT : EPIPE_OP_FORWARD,
                       .microbatch = m - 1,
                       .chunk = P / p};
    int lw = op_label(label, sizeof label, &widest, ch);
    /* The cheapest compute op gets its label and one space. */
    double costs[3] = {o->fwd, split ? o->bwd : o->bwd + o->wgt, split ? o->wgt : 0}, unit = 0;
    for (int i = 0; i < 3; i++)
        if (costs[i] > 0 && (unit == 0 || costs[i] < unit))
            unit = costs[i];
    double scale = unit > 0 ? (lw + 1) / unit : 1;
    size_t width = col(makespan, scale);

    printf("%s schedule, %u ranks, %u pipeline stages, %u micro-batches\n(costs: forward %g, "
           "backward %g, weight %g, link %g, codec %g)\n\n",
           epipe_schedule_kind(sc), p, P, m, o->fwd, o->bwd, o->wgt, o->comm, o->codec);
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
            size_t n = 0;
            epipe_op *ops = run_ops(sc, s, &n);
            memset(row, '.', width);
            row[width] = '\0';
            for (size_t k = 0; ops && k < n; k++) {
                if (!is_compute(ops[k].kind))
                    continue;
                double t0, t1;
                epipe_sim_op_time(sim, s, k, &t0, &t1);
                size_t a = col(t0, scale), b = col(t1, scale);
                if (b > width)
                    b = width;
                if (a >= b)
                    continue;
                int len = op_label(label, sizeof label, &ops[k], ch);
                memset(row + a, ' ', b - a);
                memcpy(row + a, label, (size_t)len < b - a ? (size_t)len : b - a);
            }
            free(ops);
            printf("rank %-3u%s\n", s, row);
        }
        printf("\n");
        free(row);
    }

    double bub = epipe_sim_bubble_fraction(sim), ideal = bub < 1 ? bub / (1 - bub) : 0;
    char what[96];
    double pub = published(sc, what, sizeof what);
    if (epipe_schedule_weights(sc) != EPIPE_WEIGHTS_FLUSH) {
        printf("steps            %u back to back, no flush, then the drain (micro-batch ids "
               "per step)\n",
               EPIPE_SIM_ASYNC_STEPS);
        printf("makespan         %g  (%g a step over the run)\n", makespan,
               makespan / EPIPE_SIM_ASYNC_STEPS);
        printf("weight versions ");
        for (unsigned s = 0; s < p; s++)
            printf(" %u", epipe_schedule_weight_versions(sc, s));
        printf("  (held at once on ranks 0..%u: %s)\n", p - 1,
               epipe_schedule_weights(sc) == EPIPE_WEIGHTS_STASHED
                   ? "an update after every backward, one version per in-flight micro-batch"
                   : "an update after every step, double-buffered");
    } else {
        printf("makespan         %g\n", makespan);
    }
    printf("bubble fraction  %.4f  (idle over ranks x makespan)\n", bub);
    if (isnan(pub))
        printf("bubble / ideal   %.4f  (idle over compute; %s)\n", ideal, what);
    else
        printf("bubble / ideal   %.4f  (idle over compute; %s = %.4f)\n", ideal, what, pub);
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
    printf("  (chunk activations alive at once on ranks 0..%u", p - 1);
    if (!strcmp(epipe_schedule_kind(sc), "1f1b") && !ch)
        printf("; 1f1b bound min(p-s,m)");
    else if (!strcmp(epipe_schedule_kind(sc), "gpipe") && !ch)
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
    epipe_schedule_layout lay = EPIPE_SCHEDULE_LAYOUT_INIT;
    lay.chunks = o.chunks;
    if (o.placement_len) {
        lay.placement = o.placement;
        lay.placement_len = o.placement_len;
    }
    if (epipe_schedule_create_layout(&sc, o.kind, o.stages, o.mbs, &lay) != EPIPE_OK) {
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
        rc = epipe_sim_set_cost(sim, EPIPE_SIM_WEIGHT, EPIPE_SIM_ALL_STAGES, o.wgt);
    if (rc == EPIPE_OK)
        rc = epipe_sim_set_cost(sim, EPIPE_SIM_CODEC, EPIPE_SIM_ALL_STAGES, o.codec);
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
