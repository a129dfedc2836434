/* The schedule simulator: runs every rank's op list against the others,
 * proves there is no deadlock nor broken dependency, and times each op. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <epipe/schedule.h>

#include "../error.h"
#include "schedule_impl.h"

/* Per (pipeline stage, micro-batch) progress bits. */
enum {
    DONE_F = 1,
    DONE_B = 2, /* BACKWARD or BACKWARD_INPUT */
    DONE_W = 4, /* BACKWARD or BACKWARD_WEIGHT */
    GOT_ACT = 8,
    GOT_GRAD = 16,
    SENT_ACT = 32,
    SENT_GRAD = 64,
};

#define NCOSTS 11 /* epipe_sim_cost values are 1..NCOSTS-1 */

/* One message in flight on a link. */
struct msg {
    uint32_t mb;
    double arrive;
};

/* A FIFO link in one direction; capacity m (each micro-batch crosses once). */
struct link {
    struct msg *q;
    size_t head, tail;
    double free_at; /* when the link has sent its last queued message */
};

struct rank_state {
    size_t pc;
    double clock;
    unsigned live;
    int waiting;
};

struct epipe_sim {
    unsigned ranks, nstages, mbs;
    struct epipe_sched_layout l; /* own copy */
    const epipe_op *const *ops;
    const size_t *counts;
    double *cost[NCOSTS]; /* indexed by epipe_sim_cost; cost[k][stage] */
    size_t *first;        /* first[r]: index of rank r's first op in times */
    double *times;        /* 2 per op: start, end */
    unsigned *peak;
    double makespan, bubble, busy;
    int valid;
    /* scratch for a run */
    uint8_t *flags;    /* nstages * mbs */
    struct link *act;  /* act[b]: stage b -> b+1 */
    struct link *grad; /* grad[b]: stage b+1 -> b */
    struct msg *qmem;
    struct rank_state *st;
    unsigned *ready;
    size_t nready;
};

EPIPE_API void epipe_sim_destroy(epipe_sim *sim)
{
    if (!sim)
        return;
    for (int k = 0; k < NCOSTS; k++)
        free(sim->cost[k]);
    epipe_sched_layout_free(&sim->l);
    free(sim->first);
    free(sim->times);
    free(sim->peak);
    free(sim->flags);
    free(sim->act);
    free(sim->grad);
    free(sim->qmem);
    free(sim->st);
    free(sim->ready);
    free(sim);
}

static void wake(epipe_sim *sim, unsigned r)
{
    if (sim->st[r].waiting) {
        sim->st[r].waiting = 0;
        sim->ready[sim->nready++] = r;
    }
}

static int op_error(const epipe_sim *sim, unsigned r, size_t k, const char *what)
{
    const epipe_op *op = &sim->ops[r][k];
    if (sim->l.nchunks[r] == 1 && sim->ranks == sim->nstages)
        return epipe_fail(EPIPE_EINVAL, "rank %u op %zu (%s %u): %s", r, k,
                          epipe_op_kind_name(op->kind), op->microbatch, what);
    return epipe_fail(EPIPE_EINVAL, "rank %u op %zu (%s %u, chunk %u): %s", r, k,
                      epipe_op_kind_name(op->kind), op->microbatch, op->chunk, what);
}

static void send(epipe_sim *sim, struct link *l, uint32_t mb, double now, double cost)
{
    double depart = now > l->free_at ? now : l->free_at;
    l->free_at = depart + cost;
    l->q[l->tail++] = (struct msg){.mb = mb, .arrive = depart + cost};
}

/* Runs compute op cost c on rank state st; returns the end time. */
static double compute(epipe_sim *sim, struct rank_state *st, double c)
{
    sim->busy += c;
    return st->clock += c;
}

/* Runs rank r until it ends, blocks on a receive (returns 1) or breaks a
 * rule (returns the error). Returns 0 when the rank has finished. */
static int advance(epipe_sim *sim, unsigned r)
{
    struct rank_state *st = &sim->st[r];
    const epipe_op *ops = sim->ops[r];
    const struct epipe_sched_layout *l = &sim->l;
    unsigned m = sim->mbs, P = sim->nstages;
    double *const *cost = sim->cost;
    for (; st->pc < sim->counts[r]; st->pc++) {
        size_t k = st->pc;
        const epipe_op *op = &ops[k];
        uint32_t mb = op->microbatch;
        double *t = &sim->times[2 * (sim->first[r] + k)];
        if (mb >= m)
            return op_error(sim, r, k, "micro-batch out of range");
        if (op->chunk >= l->nchunks[r])
            return op_error(sim, r, k, "chunk out of range for the rank");
        if (op->weight_version)
            return op_error(sim, r, k, "weight_version must be 0");
        unsigned s = l->stage_at[l->first[r] + op->chunk];
        int first = s == 0, last = s + 1 == P;
        uint8_t *f = &sim->flags[(size_t)s * m + mb];
        t[0] = t[1] = st->clock;
        switch (op->kind) {
        case EPIPE_OP_FORWARD:
            if (*f & DONE_F)
                return op_error(sim, r, k, "second forward of the micro-batch");
            if (!first && !(*f & GOT_ACT))
                return op_error(sim, r, k, "forward before its activation is received");
            *f |= DONE_F;
            t[1] = compute(sim, st, cost[EPIPE_SIM_FORWARD][s]);
            if (++st->live > sim->peak[r])
                sim->peak[r] = st->live;
            break;
        case EPIPE_OP_BACKWARD:
        case EPIPE_OP_BACKWARD_INPUT:
            if (*f & DONE_B)
                return op_error(sim, r, k, "second backward of the micro-batch");
            if (!(*f & DONE_F))
                return op_error(sim, r, k, "backward before its forward");
            if (!last && !(*f & GOT_GRAD))
                return op_error(sim, r, k, "backward before its gradient is received");
            if (op->kind == EPIPE_OP_BACKWARD) {
                *f |= DONE_B | DONE_W;
                t[1] = compute(sim, st, cost[EPIPE_SIM_BACKWARD][s] + cost[EPIPE_SIM_WEIGHT][s]);
                st->live--;
            } else {
                *f |= DONE_B;
                t[1] = compute(sim, st, cost[EPIPE_SIM_BACKWARD][s]);
            }
            break;
        case EPIPE_OP_BACKWARD_WEIGHT:
            if (!(*f & DONE_B))
                return op_error(sim, r, k, "weight backward before its input backward");
            if (*f & DONE_W)
                return op_error(sim, r, k, "second weight backward of the micro-batch");
            *f |= DONE_W;
            t[1] = compute(sim, st, cost[EPIPE_SIM_WEIGHT][s]);
            st->live--;
            break;
        case EPIPE_OP_SEND_ACT:
        case EPIPE_OP_SEND_GRAD: {
            int act = op->kind == EPIPE_OP_SEND_ACT;
            if (act ? last : first)
                return op_error(sim, r, k,
                                act ? "the last stage has no next stage"
                                    : "stage 0 has no previous stage");
            if (*f & (act ? SENT_ACT : SENT_GRAD))
                return op_error(sim, r, k, act ? "activation sent twice" : "gradient sent twice");
            if (!(*f & (act ? DONE_F : DONE_B)))
                return op_error(sim, r, k,
                                act ? "activation sent before its forward"
                                    : "gradient sent before its backward");
            *f |= act ? SENT_ACT : SENT_GRAD;
            unsigned to = act ? s + 1 : s - 1, dst = l->rank_of[to];
            double c = 0;
            if (dst != r) {
                t[1] = compute(sim, st,
                               cost[EPIPE_SIM_CODEC][s] +
                                   cost[act ? EPIPE_SIM_ENCODE_ACT : EPIPE_SIM_ENCODE_GRAD][s]);
                c = cost[act ? EPIPE_SIM_SEND_ACT : EPIPE_SIM_SEND_GRAD][s];
            }
            send(sim, act ? &sim->act[s] : &sim->grad[s - 1], mb, st->clock, c);
            wake(sim, dst);
            break;
        }
        case EPIPE_OP_RECV_ACT:
        case EPIPE_OP_RECV_GRAD: {
            int act = op->kind == EPIPE_OP_RECV_ACT;
            if (act ? first : last)
                return op_error(sim, r, k,
                                act ? "stage 0 has no previous stage"
                                    : "the last stage has no next stage");
            if (*f & (act ? GOT_ACT : GOT_GRAD))
                return op_error(sim, r, k, "received twice");
            unsigned from = act ? s - 1 : s + 1;
            struct link *lk = act ? &sim->act[s - 1] : &sim->grad[s];
            if (lk->head == lk->tail) {
                st->waiting = 1;
                return 1;
            }
            if (lk->q[lk->head].mb != mb) {
                char why[96];
                snprintf(why, sizeof why,
                         "the next message on the link is for micro-batch %u "
                         "(links are FIFO)",
                         lk->q[lk->head].mb);
                return op_error(sim, r, k, why);
            }
            double arrive = lk->q[lk->head++].arrive;
            *f |= act ? GOT_ACT : GOT_GRAD;
            if (arrive > st->clock)
                st->clock = arrive;
            if (l->rank_of[from] != r)
                compute(sim, st,
                        cost[EPIPE_SIM_CODEC][from] +
                            cost[act ? EPIPE_SIM_DECODE_ACT : EPIPE_SIM_DECODE_GRAD][from]);
            t[1] = st->clock;
            break;
        }
        default: return op_error(sim, r, k, "unknown op kind");
        }
    }
    return 0;
}

static int deadlock(const epipe_sim *sim)
{
    char msg[EPIPE_ERRMSG_MAX];
    size_t n = (size_t)snprintf(msg, sizeof msg, "deadlock:");
    for (unsigned r = 0; r < sim->ranks && n < sizeof msg; r++) {
        const struct rank_state *st = &sim->st[r];
        if (st->pc == sim->counts[r])
            continue;
        const epipe_op *op = &sim->ops[r][st->pc];
        unsigned s = sim->l.stage_at[sim->l.first[r] + op->chunk];
        unsigned from = op->kind == EPIPE_OP_RECV_ACT ? s - 1 : s + 1;
        n += (size_t)snprintf(msg + n, sizeof msg - n,
                              "%s rank %u waits at op %zu (%s %u, stage %u) for rank %u",
                              n > 10 ? ";" : "", r, st->pc, epipe_op_kind_name(op->kind),
                              op->microbatch, s, sim->l.rank_of[from]);
    }
    return epipe_fail(EPIPE_ESTATE, "%s", msg);
}

EPIPE_API int epipe_sim_run(epipe_sim *sim)
{
    epipe_clear_error();
    if (!sim)
        return epipe_fail(EPIPE_EINVAL, "epipe_sim_run: sim is NULL");
    unsigned R = sim->ranks, P = sim->nstages, m = sim->mbs;
    sim->valid = 0;
    sim->busy = 0;
    memset(sim->flags, 0, (size_t)P * m);
    memset(sim->st, 0, R * sizeof *sim->st);
    memset(sim->peak, 0, R * sizeof *sim->peak);
    for (unsigned s = 0; s < P; s++) {
        sim->act[s] = (struct link){.q = sim->qmem + (size_t)2 * s * m};
        sim->grad[s] = (struct link){.q = sim->qmem + (size_t)(2 * s + 1) * m};
    }
    /* Every rank starts ready; a blocked one is woken by a send to it. */
    sim->nready = 0;
    for (unsigned r = R; r-- > 0;)
        sim->ready[sim->nready++] = r;
    while (sim->nready) {
        unsigned r = sim->ready[--sim->nready];
        int rc = advance(sim, r);
        if (rc < 0)
            return rc;
    }
    double makespan = 0;
    for (unsigned r = 0; r < R; r++) {
        if (sim->st[r].pc < sim->counts[r])
            return deadlock(sim);
        if (sim->st[r].clock > makespan)
            makespan = sim->st[r].clock;
    }
    for (unsigned s = 0; s < P; s++)
        for (unsigned i = 0; i < m; i++) {
            uint8_t f = sim->flags[(size_t)s * m + i];
            if ((f & (DONE_F | DONE_B | DONE_W)) != (DONE_F | DONE_B | DONE_W))
                return epipe_fail(EPIPE_EINVAL, "stage %u never runs the %s of micro-batch %u", s,
                                  !(f & DONE_F)   ? "forward"
                                  : !(f & DONE_B) ? "backward"
                                                  : "weight backward",
                                  i);
        }
    double total = makespan * R;
    sim->makespan = makespan;
    sim->bubble = total > 0 ? (total - sim->busy) / total : 0;
    if (sim->bubble < 0) /* rounding */
        sim->bubble = 0;
    sim->valid = 1;
    return EPIPE_OK;
}

int epipe_sim_create_layout_raw(epipe_sim **out, const struct epipe_sched_layout *lay,
                                unsigned microbatches, const epipe_op *const *ops,
                                const size_t *counts)
{
    epipe_clear_error();
    if (!out)
        return epipe_fail(EPIPE_EINVAL, "epipe_sim_create: out is NULL");
    *out = NULL;
    if (!ops || !counts)
        return epipe_fail(EPIPE_EINVAL, "epipe_sim_create: NULL op lists");
    unsigned R = lay->ranks, P = lay->nstages;
    if (!P || !microbatches || (uint64_t)P * microbatches > EPIPE_SCHEDULE_MAX_PRODUCT)
        return epipe_fail(EPIPE_EINVAL, "simulator: %u stages x %u micro-batches is out of range",
                          P, microbatches);
    epipe_sim *sim = calloc(1, sizeof *sim);
    if (!sim)
        return epipe_fail(EPIPE_ENOMEM, "simulator: out of memory");
    sim->ranks = R;
    sim->nstages = P;
    sim->mbs = microbatches;
    sim->ops = ops;
    sim->counts = counts;
    unsigned *rank_of = malloc(P * sizeof *rank_of);
    if (!rank_of) {
        free(sim);
        return epipe_fail(EPIPE_ENOMEM, "simulator: out of memory");
    }
    memcpy(rank_of, lay->rank_of, P * sizeof *rank_of);
    int rc = epipe_sched_layout_init(&sim->l, R, P, rank_of);
    if (rc) {
        epipe_sim_destroy(sim);
        return rc;
    }
    int ok = 1;
    for (int k = 1; k < NCOSTS; k++)
        ok &= (sim->cost[k] = calloc(P, sizeof(double))) != NULL;
    for (unsigned s = 0; ok && s < P; s++) {
        sim->cost[EPIPE_SIM_FORWARD][s] = 1;
        sim->cost[EPIPE_SIM_BACKWARD][s] = 1;
    }
    sim->first = calloc(R, sizeof *sim->first);
    size_t total = 0;
    for (unsigned r = 0; ok && sim->first && r < R; r++) {
        if (!ops[r] && counts[r]) {
            epipe_sim_destroy(sim);
            return epipe_fail(EPIPE_EINVAL, "simulator: rank %u has no op list", r);
        }
        sim->first[r] = total;
        total += counts[r];
    }
    size_t pm = (size_t)P * microbatches;
    sim->times = malloc((total ? total : 1) * 2 * sizeof(double));
    sim->peak = calloc(R, sizeof *sim->peak);
    sim->flags = malloc(pm);
    sim->act = calloc(P, sizeof *sim->act);
    sim->grad = calloc(P, sizeof *sim->grad);
    sim->qmem = malloc(2 * pm * sizeof *sim->qmem);
    sim->st = calloc(R, sizeof *sim->st);
    sim->ready = malloc(R * sizeof *sim->ready);
    if (!ok || !sim->first || !sim->times || !sim->peak || !sim->flags || !sim->act || !sim->grad ||
        !sim->qmem || !sim->st || !sim->ready) {
        epipe_sim_destroy(sim);
        return epipe_fail(EPIPE_ENOMEM, "simulator: out of memory");
    }
    rc = epipe_sim_run(sim);
    if (rc != EPIPE_OK) {
        epipe_sim_destroy(sim);
        return rc;
    }
    *out = sim;
    return EPIPE_OK;
}

int epipe_sim_create_raw(epipe_sim **out, unsigned stages, unsigned microbatches,
                         const epipe_op *const *ops, const size_t *counts)
{
    if (out)
        *out = NULL;
    if (!stages || stages > EPIPE_SCHEDULE_MAX_STAGES)
        return epipe_fail(EPIPE_EINVAL, "simulator: %u stages is out of range", stages);
    unsigned *rank_of = malloc(stages * sizeof *rank_of);
    if (!rank_of)
        return epipe_fail(EPIPE_ENOMEM, "simulator: out of memory");
    for (unsigned s = 0; s < stages; s++)
        rank_of[s] = s;
    struct epipe_sched_layout l = {.ranks = stages, .nstages = stages, .rank_of = rank_of};
    int rc = epipe_sim_create_layout_raw(out, &l, microbatches, ops, counts);
    free(rank_of);
    return rc;
}

EPIPE_API int epipe_sim_create(epipe_sim **out, const epipe_schedule *sched)
{
    if (!sched) {
        if (out)
            *out = NULL;
        return epipe_fail(EPIPE_EINVAL, "epipe_sim_create: schedule is NULL");
    }
    const epipe_op *const *ops;
    const size_t *counts;
    unsigned m;
    epipe_schedule_lists(sched, &ops, &counts, &m);
    return epipe_sim_create_layout_raw(out, epipe_schedule_layout_of(sched), m, ops, counts);
}

EPIPE_API int epipe_sim_set_cost(epipe_sim *sim, epipe_sim_cost what, unsigned stage, double value)
{
    epipe_clear_error();
    if (!sim)
        return epipe_fail(EPIPE_EINVAL, "epipe_sim_set_cost: sim is NULL");
    if (what < EPIPE_SIM_FORWARD || what >= NCOSTS)
        return epipe_fail(EPIPE_EINVAL, "epipe_sim_set_cost: unknown cost %d", (int)what);
    if (stage != EPIPE_SIM_ALL_STAGES && stage >= sim->nstages)
        return epipe_fail(EPIPE_EINVAL, "epipe_sim_set_cost: stage %u is out of range 0..%u", stage,
                          sim->nstages - 1);
    if (!isfinite(value) || value < 0)
        return epipe_fail(EPIPE_EINVAL, "epipe_sim_set_cost: cost %g is not finite and >= 0",
                          value);
    sim->valid = 0;
    for (unsigned s = 0; s < sim->nstages; s++)
        if (stage == EPIPE_SIM_ALL_STAGES || s == stage)
            sim->cost[what][s] = value;
    return EPIPE_OK;
}

EPIPE_API double epipe_sim_makespan(const epipe_sim *sim)
{
    return sim && sim->valid ? sim->makespan : NAN;
}

EPIPE_API double epipe_sim_bubble_fraction(const epipe_sim *sim)
{
    return sim && sim->valid ? sim->bubble : NAN;
}

static int check_stage(const epipe_sim *sim, unsigned stage, const char *fn)
{
    if (!sim)
        return epipe_fail(EPIPE_EINVAL, "%s: sim is NULL", fn);
    if (stage >= sim->ranks)
        return epipe_fail(EPIPE_EINVAL, "%s: stage %u is out of range 0..%u", fn, stage,
                          sim->ranks - 1);
    if (!sim->valid)
        return epipe_fail(EPIPE_ESTATE, "%s: a cost changed since the last epipe_sim_run", fn);
    return EPIPE_OK;
}

EPIPE_API int epipe_sim_peak_live(const epipe_sim *sim, unsigned stage, unsigned *peak)
{
    epipe_clear_error();
    int rc = check_stage(sim, stage, "epipe_sim_peak_live");
    if (rc)
        return rc;
    if (!peak)
        return epipe_fail(EPIPE_EINVAL, "epipe_sim_peak_live: peak is NULL");
    *peak = sim->peak[stage];
    return EPIPE_OK;
}

EPIPE_API int epipe_sim_op_time(const epipe_sim *sim, unsigned stage, size_t index, double *start,
                                double *end)
{
    epipe_clear_error();
    int rc = check_stage(sim, stage, "epipe_sim_op_time");
    if (rc)
        return rc;
    if (index >= sim->counts[stage])
        return epipe_fail(EPIPE_EINVAL,
                          "epipe_sim_op_time: op %zu of stage %u is out of "
                          "range (the stage has %zu ops)",
                          index, stage, sim->counts[stage]);
    const double *t = &sim->times[2 * (sim->first[stage] + index)];
    if (start)
        *start = t[0];
    if (end)
        *end = t[1];
    return EPIPE_OK;
}
