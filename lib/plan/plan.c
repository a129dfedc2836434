/* The compression-aware planner (include/epipe/plan.h, docs/planner.md).
 *
 * A dynamic programme over (stages, layers consumed, option at the last
 * cut) proposes splits; the schedule simulator judges them. An option is
 * a pair of codecs for one boundary (activation, gradient), with what it
 * costs the stage before it (encode the activation, decode the gradient),
 * the stage after it (the reverse) and the link (wire bytes each way).
 *
 * The simulated step of a pipeline is about one micro-batch's way through
 * it (the sum of the stage and link times) plus (M - 1) times its slowest
 * part (the largest stage or link time). The programme minimises the sum
 * with every stage and link held under a threshold, for a few thresholds
 * from the smallest feasible bottleneck up; each distinct split it finds
 * is simulated with each candidate schedule, and the fastest wins. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <epipe/plan.h>
#include <epipe/schedule.h>

#include "../error.h"

/* Bytes a message carries besides its body: the wire header and the
 * codec's payload header (docs/wire.md, docs/codecs.md). */
#define PLAN_MSG_OVERHEAD 208.0

enum { PLAN_MAX_SCHEDULES = 3 };
static const char *const plan_kinds[PLAN_MAX_SCHEDULES] = {"gpipe", "1f1b", "zb-h1"};

/* One candidate codec of a boundary and direction. */
struct cand {
    const char *spec; /* owned by the plan's string pool */
    double enc, dec, ratio, error;
};

/* One option of a boundary: an activation and a gradient codec. */
struct option {
    unsigned a, g;              /* indices into the boundary's candidates */
    double out_cost;            /* on the stage before: encode act + decode grad */
    double in_cost;             /* on the stage after: decode act + encode grad */
    double act_wire, grad_wire; /* bytes on the link each way */
};

struct boundary {
    struct cand *act, *grad;
    unsigned nact, ngrad;
    struct option *opt;
    unsigned nopt;
    struct option none_opt; /* none both ways: what a compression-blind plan sends */
};

/* A split and its codecs: first[s] for s = 0..P, option[b] for b < P-1. */
struct split {
    unsigned *first;
    unsigned *option;
};

/* Cells of the programme's tables (24 bytes each) a plan may have. */
#define PLAN_MAX_CELLS ((size_t)1 << 25)

struct epipe_plan {
    unsigned L, P, M;
    epipe_plan_layer *layers;
    struct boundary *bnd;                   /* [L-1] */
    double *pre_fb, *pre_param, *pre_stash; /* prefix sums, [L+1] */
    epipe_plan_options o;
    double *bw, *lat; /* [P*P] */
    /* results */
    struct split best, blind;
    int kind, blind_kind;
    double step, blind_step;
    char **pool; /* the codec specs the candidates point to */
    size_t npool, pool_cap;
    /* the first simulation that failed (not for memory: out of memory, a
     * bug): the plan fails with it rather than skip the candidate */
    int sim_err;
    char sim_why[EPIPE_ERRMSG_MAX];
};

/* ---- inputs -------------------------------------------------------------- */

static int finite_nonneg(double v)
{
    return isfinite(v) && v >= 0;
}

/* A copy of s in the plan's pool (grown by doubling: a profile may hold a
 * million layers). */
static char *keep(epipe_plan *p, const char *s)
{
    if (p->npool == p->pool_cap) {
        size_t cap = p->pool_cap ? 2 * p->pool_cap : 16;
        char **grown = realloc(p->pool, cap * sizeof *grown);
        if (!grown)
            return NULL;
        p->pool = grown;
        p->pool_cap = cap;
    }
    size_t n = strlen(s) + 1;
    char *c = malloc(n);
    if (c) {
        memcpy(c, s, n);
        p->pool[p->npool++] = c;
    }
    return c;
}

static int check_layers(const epipe_plan_layer *ls, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const epipe_plan_layer *l = &ls[i];
        const double v[7] = {l->forward_s,   l->backward_s,  l->weight_s, l->out_bytes,
                             l->param_bytes, l->stash_bytes, l->update_s};
        static const char *const what[7] = {"forward_s",   "backward_s",  "weight_s", "out_bytes",
                                            "param_bytes", "stash_bytes", "update_s"};
        for (int k = 0; k < 7; k++)
            if (!finite_nonneg(v[k]))
                return epipe_fail(EPIPE_EINVAL,
                                  "epipe_plan_create: layer %zu has %s = %g; it must be finite "
                                  "and >= 0",
                                  i, what[k], v[k]);
        if (l->weight_s > l->backward_s)
            return epipe_fail(EPIPE_EINVAL,
                              "epipe_plan_create: layer %zu has weight_s %g > backward_s %g (the "
                              "weight gradient is part of the backward)",
                              i, l->weight_s, l->backward_s);
    }
    return EPIPE_OK;
}

static int check_codec(const epipe_plan_codec *c, size_t i, size_t nlayers)
{
    if (!c->spec || !*c->spec)
        return epipe_fail(EPIPE_EINVAL, "epipe_plan_create: codec entry %zu has no spec", i);
    if (nlayers < 2 || c->layer > nlayers - 2)
        return epipe_fail(EPIPE_EINVAL,
                          "epipe_plan_create: codec entry %zu ('%s') is for the boundary after "
                          "layer %u; the %zu layers have boundaries after layers 0..%zu",
                          i, c->spec, c->layer, nlayers, nlayers < 2 ? (size_t)0 : nlayers - 2);
    if (c->dir > 1)
        return epipe_fail(EPIPE_EINVAL,
                          "epipe_plan_create: codec entry %zu ('%s') has direction %u; use 0 "
                          "(activation) or 1 (gradient)",
                          i, c->spec, c->dir);
    if (!finite_nonneg(c->encode_s) || !finite_nonneg(c->decode_s) || !finite_nonneg(c->error) ||
        !(isfinite(c->wire_ratio) && c->wire_ratio > 0))
        return epipe_fail(EPIPE_EINVAL,
                          "epipe_plan_create: codec entry %zu ('%s', boundary %u) has encode_s "
                          "%g, decode_s %g, wire_ratio %g, error %g: times and error must be "
                          "finite and >= 0, the ratio finite and > 0",
                          i, c->spec, c->layer, c->encode_s, c->decode_s, c->wire_ratio, c->error);
    return EPIPE_OK;
}

static int parse_schedules(const char *list, int *use)
{
    for (int k = 0; k < PLAN_MAX_SCHEDULES; k++)
        use[k] = !list;
    if (!list)
        return EPIPE_OK;
    const char *s = list;
    int any = 0;
    while (*s) {
        size_t n = strcspn(s, ",");
        int found = 0;
        for (int k = 0; k < PLAN_MAX_SCHEDULES; k++)
            if (strlen(plan_kinds[k]) == n && !strncmp(s, plan_kinds[k], n))
                use[k] = found = any = 1;
        if (!found)
            return epipe_fail(EPIPE_EINVAL,
                              "epipe_plan_create: schedule '%.*s' in '%s' is not one the planner "
                              "knows (gpipe, 1f1b, zb-h1)",
                              (int)n, s, list);
        s += n;
        if (*s == ',')
            s++;
    }
    return any ? EPIPE_OK
               : epipe_fail(EPIPE_EINVAL, "epipe_plan_create: schedules '%s' names none", list);
}

/* ---- options per boundary ------------------------------------------------- */

static int dominated(const struct option *a, const struct option *b)
{
    /* b at least as good everywhere, strictly somewhere: a is useless */
    int le = b->out_cost <= a->out_cost && b->in_cost <= a->in_cost && b->act_wire <= a->act_wire &&
             b->grad_wire <= a->grad_wire;
    int lt = b->out_cost < a->out_cost || b->in_cost < a->in_cost || b->act_wire < a->act_wire ||
             b->grad_wire < a->grad_wire;
    return le && lt;
}

/* The boundary's options: every pair of codecs within the error budgets,
 * less those another pair beats in every respect. */
static int build_options(epipe_plan *p, unsigned k)
{
    struct boundary *b = &p->bnd[k];
    double bytes = p->layers[k].out_bytes;
    size_t n = (size_t)b->nact * b->ngrad;
    b->opt = malloc(n * sizeof *b->opt);
    if (!b->opt)
        return epipe_fail(EPIPE_ENOMEM, "epipe_plan_create: out of memory");
    unsigned m = 0;
    for (unsigned a = 0; a < b->nact; a++)
        for (unsigned g = 0; g < b->ngrad; g++) {
            const struct cand *ca = &b->act[a], *cg = &b->grad[g];
            struct option o = {a,
                               g,
                               ca->enc + cg->dec,
                               ca->dec + cg->enc,
                               bytes * ca->ratio + PLAN_MSG_OVERHEAD,
                               bytes * cg->ratio + PLAN_MSG_OVERHEAD};
            b->opt[m++] = o;
        }
    unsigned kept = 0;
    for (unsigned i = 0; i < m; i++) {
        int useless = 0;
        for (unsigned j = 0; j < m && !useless; j++)
            useless = j != i && dominated(&b->opt[i], &b->opt[j]);
        /* equal options: keep the first */
        for (unsigned j = 0; j < kept && !useless; j++)
            useless = !memcmp(&b->opt[j].out_cost, &b->opt[i].out_cost, 4 * sizeof(double));
        if (!useless)
            b->opt[kept++] = b->opt[i];
    }
    b->nopt = kept;
    b->none_opt = (struct option){0, 0, 0, 0, bytes + PLAN_MSG_OVERHEAD, bytes + PLAN_MSG_OVERHEAD};
    return EPIPE_OK;
}

static int add_cand(struct cand **v, unsigned *n, const char *spec, double enc, double dec,
                    double ratio, double error)
{
    struct cand *g = realloc(*v, (*n + 1) * sizeof *g);
    if (!g)
        return epipe_fail(EPIPE_ENOMEM, "epipe_plan_create: out of memory");
    *v = g;
    g[(*n)++] = (struct cand){spec, enc, dec, ratio, error};
    return EPIPE_OK;
}

/* ---- the cost model -------------------------------------------------------- */

static double link_time(const epipe_plan *p, unsigned from, unsigned to, double bytes)
{
    return p->lat[from * p->P + to] + bytes / p->bw[from * p->P + to];
}

/* Micro-batches stage s keeps in flight under schedule kind k. */
static double inflight(const epipe_plan *p, int kind, unsigned s)
{
    if (kind == 0) /* gpipe: every forward before any backward */
        return p->M;
    double f = (double)(p->P - s);
    return f < p->M ? f : p->M;
}

static double stage_memory(const epipe_plan *p, int kind, unsigned s, unsigned i, unsigned j)
{
    return (p->pre_param[j] - p->pre_param[i]) * p->o.param_copies +
           (p->pre_stash[j] - p->pre_stash[i]) * inflight(p, kind, s);
}

static int memory_ok(const epipe_plan *p, int kind, unsigned s, unsigned i, unsigned j)
{
    return p->o.memory_bytes <= 0 || stage_memory(p, kind, s, i, j) <= p->o.memory_bytes;
}

/* ---- the dynamic programme ------------------------------------------------- */

/* The cells of a programme: (stages s, cut j, option o at the cut), the
 * value, and the argmin (the previous cut i and its option). */
struct dp {
    double *f;          /* [(P+1) * (L+1) * O] the sum of stage and link times */
    double *g;          /* the same cells: the largest stage or link time */
    unsigned *from;     /* argmin: the previous cut i ... */
    unsigned *from_opt; /* ... and its option */
    unsigned O;
    /* per cut i: its options' indices sorted by in_cost, and per run the
     * envelope over them: best[k], the option reaching it */
    unsigned *order; /* [(L+1) * O] */
    double *env, *envb;
    unsigned *envo;
    struct keyed_opt *keyed; /* [O]: dp_sort's work */
};

/* An option and its in_cost, sorted by cost and then index (so ties keep
 * their order): the key travels with the option, where a comparator
 * looking it up would need a context qsort cannot pass, and a global one
 * would race with another thread's plan. */
struct keyed_opt {
    double cost;
    unsigned opt;
};

static size_t at(const epipe_plan *p, const struct dp *d, unsigned s, unsigned j, unsigned o)
{
    return ((size_t)s * (p->L + 1) + j) * d->O + o;
}

static unsigned nopt(const epipe_plan *p, unsigned j, int blind)
{
    /* the cut after layer j-1 is boundary j-1; j == L is the end */
    return j == 0 || j >= p->L ? 1 : blind ? 1 : p->bnd[j - 1].nopt;
}

/* The option at the cut after layer j-1 (boundary j-1); the ends of the
 * chain have none. A blind plan has none/none everywhere. */
static const struct option *opt_of(const epipe_plan *p, unsigned j, unsigned o, int blind)
{
    static const struct option end = {0, 0, 0, 0, 0, 0};
    if (j == 0 || j >= p->L)
        return &end;
    return blind ? &p->bnd[j - 1].none_opt : &p->bnd[j - 1].opt[o];
}

static int by_in_cost(const void *x, const void *y)
{
    const struct keyed_opt *a = x, *b = y;
    if (a->cost != b->cost)
        return a->cost < b->cost ? -1 : 1;
    return (a->opt > b->opt) - (a->opt < b->opt);
}

/* Sorts each cut's options by in_cost (what they cost the stage after). */
static void dp_sort(const epipe_plan *p, struct dp *d)
{
    for (unsigned i = 0; i <= p->L; i++) {
        unsigned *ord = d->order + (size_t)i * d->O, n = nopt(p, i, 0);
        for (unsigned q = 0; q < n; q++)
            d->keyed[q] = (struct keyed_opt){opt_of(p, i, q, 0)->in_cost, q};
        qsort(d->keyed, n, sizeof *d->keyed, by_in_cost);
        for (unsigned q = 0; q < n; q++)
            ord[q] = d->keyed[q].opt;
    }
}

/* Two programmes share one loop.
 *
 * mode MINMAX: g = the smallest possible largest stage or link time
 * (ties: the smaller sum f). The stage before cut j, on layers i..j-1 with
 * option q at cut i, costs base + in_cost(q); over q sorted by in_cost the
 * running minimum of g(s-1, i, q) only falls while base + in_cost rises, so
 * the best q is where they cross: a binary search.
 *
 * mode SUM: f = the smallest sum with every stage and link time <= thr;
 * over q sorted by in_cost, the running minimum of f + in_cost, searched
 * up to the largest in_cost the threshold allows.
 *
 * The blind programme (one option, none) counts compute only: that is
 * what compression-blind planners do; the simulation that times its split
 * charges the links for the raw bytes. */
enum { DP_MINMAX, DP_SUM };

static int dp_run(const epipe_plan *p, struct dp *d, int kind, int mode, double thr, int blind)
{
    unsigned L = p->L, P = p->P;
    size_t cells = (size_t)(P + 1) * (L + 1) * d->O;
    for (size_t c = 0; c < cells; c++)
        d->f[c] = d->g[c] = INFINITY;
    d->f[at(p, d, 0, 0, 0)] = d->g[at(p, d, 0, 0, 0)] = 0;
    for (unsigned s = 1; s <= P; s++) {
        /* the envelopes of the cuts the stage may start at */
        for (unsigned i = s - 1; i + (P - s) < L; i++) {
            unsigned n = nopt(p, i, blind);
            const unsigned *ord = d->order + (size_t)i * d->O;
            double *env = d->env + (size_t)i * d->O, *envb = d->envb + (size_t)i * d->O;
            unsigned *envo = d->envo + (size_t)i * d->O;
            double run = INFINITY;
            unsigned arg = 0;
            for (unsigned k = 0; k < n; k++) {
                unsigned q = blind ? 0 : ord[k];
                double in = opt_of(p, i, q, blind)->in_cost;
                size_t c = at(p, d, s - 1, i, q);
                double v = mode == DP_SUM ? d->f[c] + in : d->g[c];
                if (v < run ||
                    (mode == DP_MINMAX && v == run && d->f[c] < d->f[at(p, d, s - 1, i, arg)]))
                    run = v, arg = q;
                env[k] = run;
                envb[k] = in;
                envo[k] = arg;
            }
        }
        unsigned jmin = s, jmax = L - (P - s);
        for (unsigned j = jmin; j <= jmax; j++) {
            unsigned no = s == P ? 1 : nopt(p, j, blind);
            for (unsigned o = 0; o < no; o++) {
                const struct option *out = opt_of(p, s == P ? L : j, o, blind);
                double link = 0, lmax = 0;
                if (s < P && !blind) {
                    double la = link_time(p, s - 1, s, out->act_wire),
                           lg = link_time(p, s, s - 1, out->grad_wire);
                    lmax = la > lg ? la : lg;
                    link = la + lg;
                    if (mode == DP_SUM && lmax > thr)
                        continue;
                }
                double bestf = INFINITY, bestg = INFINITY;
                unsigned bi = 0, bo = 0;
                for (unsigned i = s - 1; i < j; i++) {
                    if (!memory_ok(p, kind, s - 1, i, j))
                        continue;
                    double base = p->pre_fb[j] - p->pre_fb[i] + out->out_cost;
                    unsigned n = nopt(p, i, blind);
                    const double *env = d->env + (size_t)i * d->O,
                                 *envb = d->envb + (size_t)i * d->O;
                    const unsigned *envo = d->envo + (size_t)i * d->O;
                    unsigned k;
                    if (mode == DP_SUM) {
                        /* the last k with base + in_cost(k) <= thr */
                        unsigned lo = 0, hi = n;
                        while (lo < hi) {
                            unsigned mid = (lo + hi) / 2;
                            if (base + envb[mid] <= thr)
                                lo = mid + 1;
                            else
                                hi = mid;
                        }
                        if (lo == 0 || env[lo - 1] == INFINITY)
                            continue;
                        k = lo - 1;
                    } else {
                        /* the first k where base + in_cost(k) >= env[k]; or the one before */
                        unsigned lo = 0, hi = n;
                        while (lo < hi) {
                            unsigned mid = (lo + hi) / 2;
                            if (base + envb[mid] >= env[mid])
                                hi = mid;
                            else
                                lo = mid + 1;
                        }
                        k = lo < n ? lo : n - 1;
                        if (k > 0) {
                            double a = fmax(env[k], base + envb[k]),
                                   b = fmax(env[k - 1], base + envb[k - 1]);
                            if (b <= a)
                                k--;
                        }
                        if (env[k] == INFINITY)
                            continue;
                    }
                    unsigned q = envo[k];
                    size_t pc = at(p, d, s - 1, i, q);
                    double cost = base + opt_of(p, i, q, blind)->in_cost;
                    double f = d->f[pc] + cost + link;
                    double g = fmax(d->g[pc], fmax(cost, lmax));
                    int better = mode == DP_SUM ? f < bestf
                                                : (g < bestg || (g == bestg && f < bestf));
                    if (better)
                        bestf = f, bestg = g, bi = i, bo = q;
                }
                size_t c = at(p, d, s, j, o);
                d->f[c] = bestf;
                d->g[c] = bestg;
                d->from[c] = bi;
                d->from_opt[c] = bo;
            }
        }
    }
    return d->f[at(p, d, P, L, 0)] < INFINITY;
}

static void dp_read(const epipe_plan *p, const struct dp *d, struct split *sp, int blind)
{
    unsigned j = p->L, o = 0;
    sp->first[p->P] = p->L;
    for (unsigned s = p->P; s > 0; s--) {
        size_t c = at(p, d, s, j, o);
        unsigned i = d->from[c], q = d->from_opt[c];
        sp->first[s - 1] = i;
        if (s - 1 > 0)
            sp->option[s - 2] = blind ? 0 : q;
        j = i, o = q;
    }
}

/* ---- judging a split with the simulator ------------------------------------ */

static const struct option *split_opt(const epipe_plan *p, const struct split *sp, unsigned b,
                                      int blind)
{
    return opt_of(p, sp->first[b + 1], sp->option[b], blind);
}

/* The simulated step time of a split under schedule kind `kind`; NAN if it
 * breaks the memory limit, or if the simulation failed (p->sim_err says
 * so, and the plan fails with it). */
static double simulate(epipe_plan *p, const struct split *sp, int kind, int blind)
{
    unsigned P = p->P;
    for (unsigned s = 0; s < P; s++)
        if (!memory_ok(p, kind, s, sp->first[s], sp->first[s + 1]))
            return NAN;
    epipe_schedule *sch = NULL;
    epipe_sim *sim = NULL;
    double t = NAN;
    int rc = EPIPE_OK;
    if (p->sim_err || (rc = epipe_schedule_create(&sch, plan_kinds[kind], P, p->M)) ||
        (rc = epipe_sim_create(&sim, sch)))
        goto out;
    int split_bw = epipe_schedule_splits_backward(sch) == 1;
    for (unsigned s = 0; s < P; s++) {
        unsigned i = sp->first[s], j = sp->first[s + 1];
        double f = 0, b = 0, w = 0;
        for (unsigned l = i; l < j; l++) {
            f += p->layers[l].forward_s;
            b += p->layers[l].backward_s;
            w += p->layers[l].weight_s;
        }
        epipe_sim_set_cost(sim, EPIPE_SIM_FORWARD, s, f);
        epipe_sim_set_cost(sim, EPIPE_SIM_BACKWARD, s, split_bw ? b - w : b);
        epipe_sim_set_cost(sim, EPIPE_SIM_WEIGHT, s, split_bw ? w : 0);
        if (s + 1 < P) { /* boundary s: this stage sends the activation; a blind
                          * split's option is none/none, which costs no codec time */
            const struct option *o = split_opt(p, sp, s, blind);
            const struct boundary *bd = &p->bnd[j - 1];
            const struct cand *a = &bd->act[o->a], *g = &bd->grad[o->g];
            epipe_sim_set_cost(sim, EPIPE_SIM_SEND_ACT, s, link_time(p, s, s + 1, o->act_wire));
            epipe_sim_set_cost(sim, EPIPE_SIM_ENCODE_ACT, s, a->enc);
            epipe_sim_set_cost(sim, EPIPE_SIM_DECODE_ACT, s, a->dec);
            epipe_sim_set_cost(sim, EPIPE_SIM_SEND_GRAD, s + 1,
                               link_time(p, s + 1, s, o->grad_wire));
            epipe_sim_set_cost(sim, EPIPE_SIM_ENCODE_GRAD, s + 1, g->enc);
            epipe_sim_set_cost(sim, EPIPE_SIM_DECODE_GRAD, s + 1, g->dec);
        }
    }
    /* after the pipeline drains every stage updates its parameters, all
     * at once: the slowest update ends the step */
    double update = 0;
    for (unsigned s = 0; s < P; s++) {
        double u = 0;
        for (unsigned l = sp->first[s]; l < sp->first[s + 1]; l++)
            u += p->layers[l].update_s;
        update = u > update ? u : update;
    }
    if ((rc = epipe_sim_run(sim)) == EPIPE_OK)
        t = epipe_sim_makespan(sim) + update;
out:
    if (isnan(t) && !p->sim_err && rc) {
        p->sim_err = rc;
        snprintf(p->sim_why, sizeof p->sim_why, "%s", epipe_last_error());
    }
    epipe_sim_destroy(sim);
    epipe_schedule_destroy(sch);
    return t;
}

/* ---- create ---------------------------------------------------------------- */

static int alloc_split(struct split *sp, unsigned P)
{
    sp->first = calloc(P + 1, sizeof *sp->first);
    sp->option = calloc(P ? P : 1, sizeof *sp->option);
    return sp->first && sp->option ? EPIPE_OK
                                   : epipe_fail(EPIPE_ENOMEM, "epipe_plan_create: out of memory");
}

static void copy_split(const epipe_plan *p, struct split *to, const struct split *from)
{
    memcpy(to->first, from->first, (p->P + 1) * sizeof *to->first);
    memcpy(to->option, from->option, (p->P ? p->P : 1) * sizeof *to->option);
}

static int setup(epipe_plan *p, const epipe_plan_layer *layers, size_t nlayers,
                 const epipe_plan_codec *codecs, size_t ncodecs, const epipe_plan_options *opts)
{
    int rc;
    p->L = (unsigned)nlayers;
    p->P = opts->stages;
    p->M = opts->microbatches;
    p->o = *opts;
    if (p->o.param_copies <= 0)
        p->o.param_copies = 3;
    if (!(p->layers = malloc(nlayers * sizeof *p->layers)))
        return epipe_fail(EPIPE_ENOMEM, "epipe_plan_create: out of memory");
    memcpy(p->layers, layers, nlayers * sizeof *layers);
    p->pre_fb = calloc(nlayers + 1, sizeof(double));
    p->pre_param = calloc(nlayers + 1, sizeof(double));
    p->pre_stash = calloc(nlayers + 1, sizeof(double));
    p->bw = malloc((size_t)p->P * p->P * sizeof(double));
    p->lat = malloc((size_t)p->P * p->P * sizeof(double));
    p->bnd = calloc(nlayers > 1 ? nlayers - 1 : 1, sizeof *p->bnd);
    if (!p->pre_fb || !p->pre_param || !p->pre_stash || !p->bw || !p->lat || !p->bnd)
        return epipe_fail(EPIPE_ENOMEM, "epipe_plan_create: out of memory");
    for (size_t i = 0; i < nlayers; i++) {
        p->pre_fb[i + 1] = p->pre_fb[i] + layers[i].forward_s + layers[i].backward_s;
        p->pre_param[i + 1] = p->pre_param[i] + layers[i].param_bytes;
        p->pre_stash[i + 1] = p->pre_stash[i] + layers[i].stash_bytes;
    }
    for (size_t k = 0; k < (size_t)p->P * p->P; k++) {
        p->bw[k] = opts->pair_bandwidth ? opts->pair_bandwidth[k] : opts->bandwidth;
        p->lat[k] = opts->pair_latency_s ? opts->pair_latency_s[k] : opts->latency_s;
    }
    for (unsigned a = 0; a + 1 < p->P; a++)
        for (int way = 0; way < 2; way++) { /* neighbours, both ways */
            unsigned x = way ? a + 1 : a, y = way ? a : a + 1;
            double bw = p->bw[x * p->P + y], lat = p->lat[x * p->P + y];
            if (!(isfinite(bw) && bw > 0) || !finite_nonneg(lat))
                return epipe_fail(EPIPE_EINVAL,
                                  "epipe_plan_create: the link from device %u to %u has "
                                  "bandwidth %g and latency %g; the bandwidth must be finite "
                                  "and > 0, the latency finite and >= 0",
                                  x, y, bw, lat);
        }
    /* candidates: "none" first, then the entries within the budgets */
    const char *none = keep(p, "none");
    if (!none)
        return epipe_fail(EPIPE_ENOMEM, "epipe_plan_create: out of memory");
    for (unsigned k = 0; k + 1 < p->L; k++) {
        struct boundary *b = &p->bnd[k];
        if (add_cand(&b->act, &b->nact, none, 0, 0, 1, 0) ||
            add_cand(&b->grad, &b->ngrad, none, 0, 0, 1, 0))
            return epipe_fail(EPIPE_ENOMEM, "epipe_plan_create: out of memory");
    }
    for (size_t i = 0; i < ncodecs; i++) {
        const epipe_plan_codec *c = &codecs[i];
        double budget = c->dir ? opts->grad_error_budget : opts->act_error_budget;
        if (budget >= 0 && c->error > budget)
            continue;
        struct boundary *b = &p->bnd[c->layer];
        const char *spec = keep(p, c->spec);
        if (!spec)
            return epipe_fail(EPIPE_ENOMEM, "epipe_plan_create: out of memory");
        if ((rc = c->dir ? add_cand(&b->grad, &b->ngrad, spec, c->encode_s, c->decode_s,
                                    c->wire_ratio, c->error)
                         : add_cand(&b->act, &b->nact, spec, c->encode_s, c->decode_s,
                                    c->wire_ratio, c->error)))
            return rc;
    }
    for (unsigned k = 0; k + 1 < p->L; k++)
        if ((rc = build_options(p, k)))
            return rc;
    if ((rc = alloc_split(&p->best, p->P)) || (rc = alloc_split(&p->blind, p->P)))
        return rc;
    return EPIPE_OK;
}

/* Proposes splits for schedule kind `kind` and keeps the fastest by the
 * simulator in p->best. */
/* Simulates split tmp under every candidate schedule whose memory it
 * fits, keeping the fastest in p->best (or p->blind). */
static void judge(epipe_plan *p, const struct split *tmp, const int *use, int blind)
{
    for (int k = 0; k < PLAN_MAX_SCHEDULES; k++) {
        if (!use[k])
            continue;
        double t = simulate(p, tmp, k, blind);
        double *best = blind ? &p->blind_step : &p->step;
        if (isfinite(t) && !(t >= *best)) {
            *best = t;
            *(blind ? &p->blind_kind : &p->kind) = k;
            copy_split(p, blind ? &p->blind : &p->best, tmp);
        }
    }
}

/* Proposes splits for memory as schedule kind `kind` holds it (with no
 * limit, once for all) and keeps the fastest by the simulator. */
static void search(epipe_plan *p, struct dp *d, int kind, const int *use, struct split *tmp)
{
    /* the smallest bottleneck, then the smallest sums under it and under
     * a few looser thresholds */
    if (!dp_run(p, d, kind, DP_MINMAX, 0, 0))
        return; /* nothing fits the memory limit */
    double bmin = d->g[at(p, d, p->P, p->L, 0)];
    dp_read(p, d, tmp, 0);
    judge(p, tmp, use, 0);
    static const double widen[] = {1.0, 1.02, 1.05, 1.1, 1.2, 1.35, 1.5, 2};
    for (size_t w = 0; w < sizeof widen / sizeof *widen; w++)
        if (dp_run(p, d, kind, DP_SUM, bmin * widen[w] * (1 + 1e-12) + 1e-300, 0)) {
            dp_read(p, d, tmp, 0);
            judge(p, tmp, use, 0);
        }
    /* the compression-blind split: compute balanced alone */
    if (dp_run(p, d, kind, DP_MINMAX, 0, 1)) {
        dp_read(p, d, tmp, 1);
        judge(p, tmp, use, 1);
    }
}

static void dp_free(struct dp *d)
{
    free(d->f);
    free(d->g);
    free(d->from);
    free(d->from_opt);
    free(d->order);
    free(d->env);
    free(d->envb);
    free(d->envo);
    free(d->keyed);
}

/* Local search with the simulator itself: from the best plan, move each
 * cut by one layer (trying every option of the boundary it lands on) and
 * change each boundary's option, keeping any change that shortens the
 * simulated step, until none does. The programme's model (one micro-batch's
 * way through plus the bottleneck for the others) misses the bubbles of
 * short steps; this closes most of that gap (tests/test_plan.c measures it
 * against exhaustive search). */
static void refine(epipe_plan *p, const int *use, struct split *tmp)
{
    if (p->kind < 0)
        return;
    for (int round = 0; round < 64; round++) {
        int improved = 0;
        for (unsigned b = 0; b + 1 < p->P; b++) {
            for (int delta = -1; delta <= 1; delta++) {
                copy_split(p, tmp, &p->best);
                unsigned cut = p->best.first[b + 1] + (unsigned)delta;
                if (delta && (cut <= p->best.first[b] || cut >= p->best.first[b + 2]))
                    continue;
                tmp->first[b + 1] = cut;
                unsigned n = nopt(p, cut, 0);
                for (unsigned o = 0; o < n; o++) {
                    tmp->option[b] = o;
                    double before = p->step;
                    judge(p, tmp, use, 0);
                    improved |= p->step < before;
                }
            }
        }
        if (!improved)
            break;
    }
}

EPIPE_API int epipe_plan_create(epipe_plan **out, const epipe_plan_layer *layers, size_t nlayers,
                                const epipe_plan_codec *codecs, size_t ncodecs,
                                const epipe_plan_options *opts)
{
    epipe_clear_error();
    if (!out)
        return epipe_fail(EPIPE_EINVAL, "epipe_plan_create: out is NULL");
    *out = NULL;
    if (!layers || !nlayers || !opts || (ncodecs && !codecs))
        return epipe_fail(EPIPE_EINVAL,
                          "epipe_plan_create: layers, nlayers, opts (and codecs when ncodecs > 0) "
                          "must be given");
    if (opts->struct_size < sizeof(epipe_plan_options))
        return epipe_fail(EPIPE_EINVAL,
                          "epipe_plan_create: opts->struct_size %zu is below %zu (initialise "
                          "with EPIPE_PLAN_OPTIONS_INIT)",
                          opts->struct_size, sizeof(epipe_plan_options));
    if (nlayers > 1000000)
        return epipe_fail(EPIPE_EINVAL, "epipe_plan_create: %zu layers; at most 1000000", nlayers);
    if (opts->stages < 1 || opts->stages > nlayers || opts->stages > 1024)
        return epipe_fail(EPIPE_EINVAL,
                          "epipe_plan_create: %u stages for %zu layers; each stage needs a "
                          "layer (and at most 1024 stages)",
                          opts->stages, nlayers);
    if (opts->microbatches < 1 || opts->microbatches > 65536)
        return epipe_fail(EPIPE_EINVAL, "epipe_plan_create: %u micro-batches; use 1..65536",
                          opts->microbatches);
    if (!finite_nonneg(opts->memory_bytes) || !isfinite(opts->param_copies) ||
        !isfinite(opts->act_error_budget) || !isfinite(opts->grad_error_budget))
        return epipe_fail(EPIPE_EINVAL,
                          "epipe_plan_create: memory_bytes %g, param_copies %g and the error "
                          "budgets (%g, %g) must be finite (memory >= 0)",
                          opts->memory_bytes, opts->param_copies, opts->act_error_budget,
                          opts->grad_error_budget);
    int rc, use[PLAN_MAX_SCHEDULES];
    if ((rc = check_layers(layers, nlayers)) || (rc = parse_schedules(opts->schedules, use)))
        return rc;
    for (size_t i = 0; i < ncodecs; i++)
        if ((rc = check_codec(&codecs[i], i, nlayers)))
            return rc;
    /* The programme's tables hold (stages + 1) x (layers + 1) x (codec
     * options a boundary) cells: where even one option is too many, the
     * problem is refused before anything is built. */
    size_t least = ((size_t)opts->stages + 1) * (nlayers + 1);
    if (least > PLAN_MAX_CELLS)
        return epipe_fail(EPIPE_EINVAL,
                          "epipe_plan_create: %u stages x %zu layers make at least %zu cells; at "
                          "most %zu (fewer stages or a coarser profile)",
                          opts->stages, nlayers, least, PLAN_MAX_CELLS);
    epipe_plan *p = calloc(1, sizeof *p);
    if (!p)
        return epipe_fail(EPIPE_ENOMEM, "epipe_plan_create: out of memory");
    p->step = p->blind_step = INFINITY;
    p->kind = p->blind_kind = -1;
    struct dp d = {0};
    struct split tmp = {0};
    if ((rc = setup(p, layers, nlayers, codecs, ncodecs, opts)) || (rc = alloc_split(&tmp, p->P)))
        goto fail;
    d.O = 1;
    for (unsigned k = 0; k + 1 < p->L; k++)
        d.O = p->bnd[k].nopt > d.O ? p->bnd[k].nopt : d.O;
    size_t cells = (size_t)(p->P + 1) * (p->L + 1) * d.O, per_cut = (size_t)(p->L + 1) * d.O;
    if (cells > PLAN_MAX_CELLS) {
        rc = epipe_fail(EPIPE_EINVAL,
                        "epipe_plan_create: %u stages x %u layers x %u codec options a boundary "
                        "make %zu cells; at most %zu (fewer candidates or a coarser profile)",
                        p->P, p->L, d.O, cells, PLAN_MAX_CELLS);
        goto fail;
    }
    d.f = malloc(cells * sizeof *d.f);
    d.g = malloc(cells * sizeof *d.g);
    d.from = malloc(cells * sizeof *d.from);
    d.from_opt = malloc(cells * sizeof *d.from_opt);
    d.order = malloc(per_cut * sizeof *d.order);
    d.env = malloc(per_cut * sizeof *d.env);
    d.envb = malloc(per_cut * sizeof *d.envb);
    d.envo = malloc(per_cut * sizeof *d.envo);
    d.keyed = malloc(d.O * sizeof *d.keyed);
    if (!d.f || !d.g || !d.from || !d.from_opt || !d.order || !d.env || !d.envb || !d.envo ||
        !d.keyed) {
        rc = epipe_fail(EPIPE_ENOMEM, "epipe_plan_create: out of memory for %zu cells", cells);
        goto fail;
    }
    dp_sort(p, &d);
    if (p->o.memory_bytes <= 0) {
        search(p, &d, 1, use, &tmp); /* memory is not looked at: one search for all */
    } else {
        /* gpipe keeps every micro-batch; 1f1b and zb-h1 the same fewer */
        int only_gpipe[PLAN_MAX_SCHEDULES] = {use[0], 0, 0};
        int others[PLAN_MAX_SCHEDULES] = {0, use[1], use[2]};
        if (use[0])
            search(p, &d, 0, only_gpipe, &tmp);
        if (use[1] || use[2])
            search(p, &d, 1, others, &tmp);
    }
    /* the blind split is a candidate too, with its codecs free to change:
     * the plan is never slower than it */
    if (p->blind_kind >= 0)
        judge(p, &p->blind, use, 0);
    refine(p, use, &tmp);
    if (p->sim_err) {
        rc = epipe_fail(p->sim_err, "epipe_plan_create: simulating a candidate: %s", p->sim_why);
        goto fail;
    }
    if (p->kind < 0) {
        rc = epipe_fail(EPIPE_ENOTSUP,
                        "epipe_plan_create: no split of %u layers into %u stages fits %g bytes "
                        "per device (parameters x %g, plus the stashed activations of the "
                        "micro-batches in flight)",
                        p->L, p->P, p->o.memory_bytes, p->o.param_copies);
        goto fail;
    }
    if (p->blind_kind < 0) { /* memory: the blind split did not fit; report the plan's */
        copy_split(p, &p->blind, &p->best);
        p->blind_step = NAN;
    }
    dp_free(&d);
    free(tmp.first);
    free(tmp.option);
    *out = p;
    return EPIPE_OK;
fail:
    dp_free(&d);
    free(tmp.first);
    free(tmp.option);
    epipe_plan_destroy(p);
    return rc;
}

EPIPE_API void epipe_plan_destroy(epipe_plan *p)
{
    if (!p)
        return;
    for (unsigned k = 0; p->bnd && k + 1 < p->L; k++) {
        free(p->bnd[k].act);
        free(p->bnd[k].grad);
        free(p->bnd[k].opt);
    }
    free(p->bnd);
    for (size_t i = 0; i < p->npool; i++)
        free(p->pool[i]);
    free(p->pool);
    free(p->layers);
    free(p->pre_fb);
    free(p->pre_param);
    free(p->pre_stash);
    free(p->bw);
    free(p->lat);
    free(p->best.first);
    free(p->best.option);
    free(p->blind.first);
    free(p->blind.option);
    free(p);
}

/* ---- results ---------------------------------------------------------------- */

EPIPE_API unsigned epipe_plan_first_layer(const epipe_plan *p, unsigned stage)
{
    return p && stage <= p->P ? p->best.first[stage] : (unsigned)-1;
}

EPIPE_API const char *epipe_plan_codec_spec(const epipe_plan *p, unsigned b, unsigned dir)
{
    if (!p || b + 1 >= p->P || dir > 1)
        return NULL;
    const struct option *o = split_opt(p, &p->best, b, 0);
    const struct boundary *bd = &p->bnd[p->best.first[b + 1] - 1];
    return dir ? bd->grad[o->g].spec : bd->act[o->a].spec;
}

EPIPE_API const char *epipe_plan_schedule(const epipe_plan *p)
{
    return p ? plan_kinds[p->kind] : NULL;
}

EPIPE_API double epipe_plan_step_seconds(const epipe_plan *p)
{
    return p ? p->step : NAN;
}

EPIPE_API double epipe_plan_blind_step_seconds(const epipe_plan *p)
{
    return p ? p->blind_step : NAN;
}

/* snprintf into buf at *len, counting what does not fit. */
static void put(char *buf, size_t cap, size_t *len, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void put(char *buf, size_t cap, size_t *len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(*len < cap ? buf + *len : NULL, *len < cap ? cap - *len : 0, fmt, ap);
    va_end(ap);
    if (n > 0)
        *len += (size_t)n;
}

static void explain_split(const epipe_plan *p, const struct split *sp, int kind, int blind,
                          char *buf, size_t cap, size_t *len)
{
    double worst = -1;
    char what[96] = "";
    for (unsigned s = 0; s < p->P; s++) {
        unsigned i = sp->first[s], j = sp->first[s + 1];
        double fb = p->pre_fb[j] - p->pre_fb[i], codec = 0;
        if (s + 1 < p->P)
            codec += split_opt(p, sp, s, blind)->out_cost;
        if (s > 0)
            codec += split_opt(p, sp, s - 1, blind)->in_cost;
        put(buf, cap, len,
            "  stage %u: layers %u..%u, compute %.6g s, codecs %.6g s, memory %.4g MB a device\n",
            s, i, j - 1, fb, codec, stage_memory(p, kind, s, i, j) / 1e6);
        if (fb + codec > worst) {
            worst = fb + codec;
            snprintf(what, sizeof what, "stage %u (%.6g s a micro-batch)", s, worst);
        }
        if (s + 1 < p->P) {
            const struct option *o = split_opt(p, sp, s, blind);
            const struct boundary *bd = &p->bnd[j - 1];
            double la = link_time(p, s, s + 1, o->act_wire),
                   lg = link_time(p, s + 1, s, o->grad_wire);
            put(buf, cap, len,
                "  boundary %u (after layer %u, %.4g MB raw): activation %s (%.4g MB, %.6g s "
                "on the link), gradient %s (%.4g MB, %.6g s)\n",
                s, j - 1, p->layers[j - 1].out_bytes / 1e6, bd->act[o->a].spec, o->act_wire / 1e6,
                la, bd->grad[o->g].spec, o->grad_wire / 1e6, lg);
            double l = la > lg ? la : lg;
            if (l > worst) {
                worst = l;
                snprintf(what, sizeof what, "the link of boundary %u (%.6g s a micro-batch)", s, l);
            }
        }
    }
    put(buf, cap, len, "  bottleneck: %s\n", what);
}

EPIPE_API size_t epipe_plan_explain(const epipe_plan *p, char *buf, size_t cap)
{
    size_t len = 0;
    if (cap)
        buf[0] = 0;
    if (!p)
        return 0;
    put(buf, cap, &len,
        "plan: %u layers on %u stages, %u micro-batches, schedule %s: %.6g s a step\n", p->L, p->P,
        p->M, plan_kinds[p->kind], p->step);
    explain_split(p, &p->best, p->kind, 0, buf, cap, &len);
    if (isfinite(p->blind_step)) {
        put(buf, cap, &len,
            "compression-blind (split by compute, codec none), schedule %s: %.6g s a step, "
            "%.3gx the plan's\n",
            plan_kinds[p->blind_kind], p->blind_step, p->blind_step / p->step);
        explain_split(p, &p->blind, p->blind_kind, 1, buf, cap, &len);
    } else {
        put(buf, cap, &len, "compression-blind: no split by compute alone fits the memory limit\n");
    }
    return len;
}
