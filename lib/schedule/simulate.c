/* The schedule simulator: runs every stage's op list against the others,
 * proves there is no deadlock nor broken dependency, and times each op. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <epipe/schedule.h>

#include "../error.h"
#include "schedule_impl.h"

/* Per (stage, micro-batch) progress bits. */
enum {
    DONE_F = 1,
    DONE_B = 2,
    GOT_ACT = 4,
    GOT_GRAD = 8,
    SENT_ACT = 16,
    SENT_GRAD = 32,
};

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

struct stage_state {
    size_t pc;
    double clock;
    unsigned live;
    int waiting;
};

struct epipe_sim {
    unsigned stages, mbs;
    const epipe_op *const *ops;
    const size_t *counts;
    double *cost[5]; /* indexed by epipe_sim_cost; cost[k][s] */
    size_t *first;   /* first[s]: index of stage s's first op in times */
    double *times;   /* 2 per op: start, end */
    unsigned *peak;
    double makespan, bubble;
    int valid;
    /* scratch for a run */
    uint8_t *flags;    /* stages * mbs */
    struct link *act;  /* act[s]: stage s -> s+1 */
    struct link *grad; /* grad[s]: stage s -> s-1 */
    struct msg *qmem;
    struct stage_state *st;
    unsigned *ready;
    size_t nready;
};

EPIPE_API void epipe_sim_destroy(epipe_sim *sim)
{
    if (!sim)
        return;
    for (int k = 0; k < 5; k++)
        free(sim->cost[k]);
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

static void wake(epipe_sim *sim, unsigned s)
{
    if (sim->st[s].waiting) {
        sim->st[s].waiting = 0;
        sim->ready[sim->nready++] = s;
    }
}

static int op_error(const epipe_sim *sim, unsigned s, size_t k, const char *what)
{
    const epipe_op *op = &sim->ops[s][k];
    return epipe_fail(EPIPE_EINVAL, "stage %u op %zu (%s %u): %s", s, k,
                      epipe_op_kind_name(op->kind), op->microbatch, what);
}

static void send(epipe_sim *sim, struct link *l, uint32_t mb, double now, double cost)
{
    double depart = now > l->free_at ? now : l->free_at;
    l->free_at = depart + cost;
    l->q[l->tail++] = (struct msg){.mb = mb, .arrive = depart + cost};
}

/* Runs stage s until it ends, blocks on a receive (returns 1) or breaks a
 * rule (returns the error). Returns 0 when the stage has finished. */
static int advance(epipe_sim *sim, unsigned s)
{
    struct stage_state *st = &sim->st[s];
    const epipe_op *ops = sim->ops[s];
    unsigned p = sim->stages, m = sim->mbs;
    int first = s == 0, last = s + 1 == p;
    for (; st->pc < sim->counts[s]; st->pc++) {
        size_t k = st->pc;
        const epipe_op *op = &ops[k];
        uint32_t mb = op->microbatch;
        double *t = &sim->times[2 * (sim->first[s] + k)];
        if (mb >= m)
            return op_error(sim, s, k, "micro-batch out of range");
        if (op->chunk || op->reserved)
            return op_error(sim, s, k, "chunk and reserved must be 0");
        uint8_t *f = &sim->flags[(size_t)s * m + mb];
        t[0] = t[1] = st->clock;
        switch (op->kind) {
        case EPIPE_OP_FORWARD:
            if (*f & DONE_F)
                return op_error(sim, s, k, "second forward of the micro-batch");
            if (!first && !(*f & GOT_ACT))
                return op_error(sim, s, k, "forward before its activation is received");
            *f |= DONE_F;
            st->clock = t[1] = st->clock + sim->cost[EPIPE_SIM_FORWARD][s];
            if (++st->live > sim->peak[s])
                sim->peak[s] = st->live;
            break;
        case EPIPE_OP_BACKWARD:
            if (*f & DONE_B)
                return op_error(sim, s, k, "second backward of the micro-batch");
            if (!(*f & DONE_F))
                return op_error(sim, s, k, "backward before its forward");
            if (!last && !(*f & GOT_GRAD))
                return op_error(sim, s, k, "backward before its gradient is received");
            *f |= DONE_B;
            st->clock = t[1] = st->clock + sim->cost[EPIPE_SIM_BACKWARD][s];
            st->live--;
            break;
        case EPIPE_OP_SEND_ACT:
            if (last)
                return op_error(sim, s, k, "the last stage has no next stage");
            if (*f & SENT_ACT)
                return op_error(sim, s, k, "activation sent twice");
            if (!(*f & DONE_F))
                return op_error(sim, s, k, "activation sent before its forward");
            *f |= SENT_ACT;
            send(sim, &sim->act[s], mb, st->clock, sim->cost[EPIPE_SIM_SEND_ACT][s]);
            wake(sim, s + 1);
            break;
        case EPIPE_OP_SEND_GRAD:
            if (first)
                return op_error(sim, s, k, "stage 0 has no previous stage");
            if (*f & SENT_GRAD)
                return op_error(sim, s, k, "gradient sent twice");
            if (!(*f & DONE_B))
                return op_error(sim, s, k, "gradient sent before its backward");
            *f |= SENT_GRAD;
            send(sim, &sim->grad[s], mb, st->clock, sim->cost[EPIPE_SIM_SEND_GRAD][s]);
            wake(sim, s - 1);
            break;
        case EPIPE_OP_RECV_ACT:
        case EPIPE_OP_RECV_GRAD: {
            int act = op->kind == EPIPE_OP_RECV_ACT;
            if (act ? first : last)
                return op_error(sim, s, k,
                                act ? "stage 0 has no previous stage"
                                    : "the last stage has no next stage");
            if (*f & (act ? GOT_ACT : GOT_GRAD))
                return op_error(sim, s, k, "received twice");
            struct link *l = act ? &sim->act[s - 1] : &sim->grad[s + 1];
            if (l->head == l->tail) {
                st->waiting = 1;
                return 1;
            }
            if (l->q[l->head].mb != mb) {
                char why[96];
                snprintf(why, sizeof why,
                         "the next message on the link is for micro-batch %u "
                         "(links are FIFO)",
                         l->q[l->head].mb);
                return op_error(sim, s, k, why);
            }
            double arrive = l->q[l->head++].arrive;
            *f |= act ? GOT_ACT : GOT_GRAD;
            if (arrive > st->clock)
                st->clock = arrive;
            t[1] = st->clock;
            break;
        }
        default: return op_error(sim, s, k, "unknown op kind");
        }
    }
    return 0;
}

static int deadlock(const epipe_sim *sim)
{
    char msg[EPIPE_ERRMSG_MAX];
    size_t n = (size_t)snprintf(msg, sizeof msg, "deadlock:");
    for (unsigned s = 0; s < sim->stages && n < sizeof msg; s++) {
        const struct stage_state *st = &sim->st[s];
        if (st->pc == sim->counts[s])
            continue;
        const epipe_op *op = &sim->ops[s][st->pc];
        int act = op->kind == EPIPE_OP_RECV_ACT;
        n += (size_t)snprintf(msg + n, sizeof msg - n,
                              "%s stage %u waits at op %zu (%s %u) for stage %u", n > 10 ? ";" : "",
                              s, st->pc, epipe_op_kind_name(op->kind), op->microbatch,
                              act ? s - 1 : s + 1);
    }
    return epipe_fail(EPIPE_ESTATE, "%s", msg);
}

EPIPE_API int epipe_sim_run(epipe_sim *sim)
{
    epipe_clear_error();
    if (!sim)
        return epipe_fail(EPIPE_EINVAL, "epipe_sim_run: sim is NULL");
    unsigned p = sim->stages, m = sim->mbs;
    sim->valid = 0;
    memset(sim->flags, 0, (size_t)p * m);
    memset(sim->st, 0, p * sizeof *sim->st);
    memset(sim->peak, 0, p * sizeof *sim->peak);
    for (unsigned s = 0; s < p; s++) {
        sim->act[s] = (struct link){.q = sim->qmem + (size_t)2 * s * m};
        sim->grad[s] = (struct link){.q = sim->qmem + (size_t)(2 * s + 1) * m};
    }
    /* Every stage starts ready; a blocked one is woken by a send to it. */
    sim->nready = 0;
    for (unsigned s = p; s-- > 0;)
        sim->ready[sim->nready++] = s;
    while (sim->nready) {
        unsigned s = sim->ready[--sim->nready];
        int rc = advance(sim, s);
        if (rc < 0)
            return rc;
    }
    double makespan = 0, busy = 0;
    for (unsigned s = 0; s < p; s++) {
        if (sim->st[s].pc < sim->counts[s])
            return deadlock(sim);
        for (unsigned i = 0; i < m; i++) {
            uint8_t f = sim->flags[(size_t)s * m + i];
            if (!(f & DONE_F) || !(f & DONE_B))
                return epipe_fail(EPIPE_EINVAL, "stage %u never runs the %s of micro-batch %u", s,
                                  f & DONE_F ? "backward" : "forward", i);
        }
        if (sim->st[s].clock > makespan)
            makespan = sim->st[s].clock;
        busy += m * (sim->cost[EPIPE_SIM_FORWARD][s] + sim->cost[EPIPE_SIM_BACKWARD][s]);
    }
    double total = makespan * p;
    sim->makespan = makespan;
    sim->bubble = total > 0 ? (total - busy) / total : 0;
    sim->valid = 1;
    return EPIPE_OK;
}

int epipe_sim_create_raw(epipe_sim **out, unsigned stages, unsigned microbatches,
                         const epipe_op *const *ops, const size_t *counts)
{
    epipe_clear_error();
    if (!out)
        return epipe_fail(EPIPE_EINVAL, "epipe_sim_create: out is NULL");
    *out = NULL;
    if (!ops || !counts)
        return epipe_fail(EPIPE_EINVAL, "epipe_sim_create: NULL op lists");
    if (!stages || !microbatches || (uint64_t)stages * microbatches > EPIPE_SCHEDULE_MAX_PRODUCT)
        return epipe_fail(EPIPE_EINVAL, "simulator: %u stages x %u micro-batches is out of range",
                          stages, microbatches);
    epipe_sim *sim = calloc(1, sizeof *sim);
    if (!sim)
        return epipe_fail(EPIPE_ENOMEM, "simulator: out of memory");
    sim->stages = stages;
    sim->mbs = microbatches;
    sim->ops = ops;
    sim->counts = counts;
    int ok = 1;
    for (int k = 1; k < 5; k++)
        ok &= (sim->cost[k] = calloc(stages, sizeof(double))) != NULL;
    sim->first = calloc(stages, sizeof *sim->first);
    size_t total = 0;
    for (unsigned s = 0; ok && s < stages; s++) {
        if (!ops[s] && counts[s]) {
            epipe_sim_destroy(sim);
            return epipe_fail(EPIPE_EINVAL, "simulator: stage %u has no op list", s);
        }
        sim->first[s] = total;
        total += counts[s];
        sim->cost[EPIPE_SIM_FORWARD][s] = 1;
        sim->cost[EPIPE_SIM_BACKWARD][s] = 1;
    }
    size_t pm = (size_t)stages * microbatches;
    sim->times = malloc((total ? total : 1) * 2 * sizeof(double));
    sim->peak = calloc(stages, sizeof *sim->peak);
    sim->flags = malloc(pm);
    sim->act = calloc(stages, sizeof *sim->act);
    sim->grad = calloc(stages, sizeof *sim->grad);
    sim->qmem = malloc(2 * pm * sizeof *sim->qmem);
    sim->st = calloc(stages, sizeof *sim->st);
    sim->ready = malloc(stages * sizeof *sim->ready);
    if (!ok || !sim->first || !sim->times || !sim->peak || !sim->flags || !sim->act || !sim->grad ||
        !sim->qmem || !sim->st || !sim->ready) {
        epipe_sim_destroy(sim);
        return epipe_fail(EPIPE_ENOMEM, "simulator: out of memory");
    }
    int rc = epipe_sim_run(sim);
    if (rc != EPIPE_OK) {
        epipe_sim_destroy(sim);
        return rc;
    }
    *out = sim;
    return EPIPE_OK;
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
    epipe_schedule_lists(sched, &ops, &counts);
    return epipe_sim_create_raw(out, epipe_schedule_stages(sched),
                                epipe_schedule_microbatches(sched), ops, counts);
}

EPIPE_API int epipe_sim_set_cost(epipe_sim *sim, epipe_sim_cost what, unsigned stage, double value)
{
    epipe_clear_error();
    if (!sim)
        return epipe_fail(EPIPE_EINVAL, "epipe_sim_set_cost: sim is NULL");
    if (what < EPIPE_SIM_FORWARD || what > EPIPE_SIM_SEND_GRAD)
        return epipe_fail(EPIPE_EINVAL, "epipe_sim_set_cost: unknown cost %d", (int)what);
    if (stage != EPIPE_SIM_ALL_STAGES && stage >= sim->stages)
        return epipe_fail(EPIPE_EINVAL, "epipe_sim_set_cost: stage %u is out of range 0..%u", stage,
                          sim->stages - 1);
    if (!isfinite(value) || value < 0)
        return epipe_fail(EPIPE_EINVAL, "epipe_sim_set_cost: cost %g is not finite and >= 0",
                          value);
    sim->valid = 0;
    for (unsigned s = 0; s < sim->stages; s++)
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
    if (stage >= sim->stages)
        return epipe_fail(EPIPE_EINVAL, "%s: stage %u is out of range 0..%u", fn, stage,
                          sim->stages - 1);
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
