/* The list builder: turns a kind's rules into each rank's op list by a
 * greedy run at costs F = 1, B = 2 (Bi = W = 1), over any placement of pipeline stages on ranks. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../error.h"
#include "schedule_impl.h"

/* Not done yet, as a time. */
#define NEVER UINT32_MAX

struct bstate {
    const struct epipe_sched_layout *l;
    const struct epipe_sched_policy *pol;
    unsigned m;
    uint32_t *fdone, *bdone; /* [stage * m + mb]: time the op ends, or NEVER */
    unsigned *nf, *nb, *nw;  /* per stage: forwards, backwards, weight backwards issued */
    unsigned *rank_live;     /* per rank */
    unsigned *rank_fleft;    /* per rank: forwards not yet issued */
    uint32_t *busy;          /* per rank: time it is free again */
    size_t *spos;            /* per rank: position in the script */
    epipe_op **ops;
    size_t *counts;
};

static void put(struct bstate *b, unsigned r, epipe_op_kind kind, unsigned mb, unsigned chunk)
{
    b->ops[r][b->counts[r]++] = (epipe_op){
        .kind = (uint32_t)kind, .microbatch = mb, .chunk = chunk};
}

/* Priority of an op of a stage (lower runs first). */
static uint64_t key(const struct bstate *b, unsigned s, unsigned mb, int backward)
{
    const struct epipe_sched_layout *l = b->l;
    if (b->pol->depth_first) {
        unsigned r = l->rank_of[s], c = l->chunk_of[s];
        if (backward)
            c = l->nchunks[r] - 1 - c;
        return ((uint64_t)epipe_sched_group(b->m, l->ranks, mb) << 40) | ((uint64_t)c << 20) | mb;
    }
    return ((uint64_t)mb << 20) | (l->nstages - 1 - s);
}

static unsigned live_limit(const unsigned *limits, unsigned i)
{
    return limits && limits[i] ? limits[i] : UINT32_MAX;
}

/* Can stage s issue its next forward (backward) at time t? */
static int f_ready(const struct bstate *b, unsigned s, uint32_t t)
{
    unsigned mb = b->nf[s], r = b->l->rank_of[s];
    if (mb >= b->m)
        return 0;
    if (s > 0 && b->fdone[(size_t)(s - 1) * b->m + mb] > t)
        return 0;
    unsigned live = b->nf[s] - (b->pol->split ? b->nw[s] : b->nb[s]);
    return live < live_limit(b->pol->stage_limit, s) &&
           b->rank_live[r] < live_limit(b->pol->rank_limit, r);
}

static int b_ready(const struct bstate *b, unsigned s, uint32_t t)
{
    unsigned mb = b->nb[s];
    if (mb >= b->nf[s] || b->fdone[(size_t)s * b->m + mb] > t)
        return 0;
    return s + 1 == b->l->nstages || b->bdone[(size_t)(s + 1) * b->m + mb] <= t;
}

/* The stage of rank r whose next op of one class runs now, or UINT32_MAX.
 * cls: 0 backward, 1 forward, 2 weight backward. */
static unsigned pick(const struct bstate *b, unsigned r, uint32_t t, int cls)
{
    const struct epipe_sched_layout *l = b->l;
    unsigned best = UINT32_MAX;
    uint64_t best_key = UINT64_MAX;
    for (unsigned c = 0; c < l->nchunks[r]; c++) {
        unsigned s = l->stage_at[l->first[r] + c];
        unsigned next = cls == 0 ? b->nb[s] : cls == 1 ? b->nf[s] : b->nw[s];
        if (next >= b->m)
            continue;
        int ready;
        if (cls == 2)
            ready = next < b->nb[s] && b->bdone[(size_t)s * b->m + next] <= t;
        else
            ready = cls == 0 ? b_ready(b, s, t) : f_ready(b, s, t);
        if (!ready && !(b->pol->in_order && cls < 2))
            continue;
        uint64_t k = key(b, s, next, cls == 0);
        if (k < best_key) {
            best_key = k;
            best = ready ? s : UINT32_MAX - 1; /* in order: a blocked head blocks the class */
        }
    }
    return best >= UINT32_MAX - 1 ? UINT32_MAX : best;
}

/* The script's next compute op of rank r, if it can run at t: its stage
 * (its class in *cls), else UINT32_MAX. */
static unsigned scripted(struct bstate *b, unsigned r, uint32_t t, int *cls)
{
    const epipe_op *ops = b->pol->script[r];
    size_t n = b->pol->script_n[r], *pos = &b->spos[r];
    while (*pos < n && ops[*pos].kind != EPIPE_OP_FORWARD && ops[*pos].kind != EPIPE_OP_BACKWARD)
        ++*pos;
    if (*pos == n)
        return UINT32_MAX;
    const struct epipe_sched_layout *l = b->l;
    unsigned s = l->stage_at[l->first[r] + ops[*pos].chunk];
    *cls = ops[*pos].kind == EPIPE_OP_FORWARD ? 1 : 0;
    if (!(*cls ? f_ready(b, s, t) : b_ready(b, s, t)))
        return UINT32_MAX;
    ++*pos;
    return s;
}

/* Issues one op on rank r at time t if the rules allow one; returns 1 if so. */
static int step(struct bstate *b, unsigned r, uint32_t t)
{
    const struct epipe_sched_layout *l = b->l;
    const struct epipe_sched_policy *pol = b->pol;
    unsigned s = UINT32_MAX;
    int cls = 0;
    if (pol->script) {
        s = scripted(b, r, t, &cls);
        if (s == UINT32_MAX)
            s = pick(b, r, t, cls = 2);
    } else if (pol->f_first)
        s = pick(b, r, t, cls = 1);
    if (!pol->script) {
        if (s == UINT32_MAX && (!pol->flush_forwards || !b->rank_fleft[r]))
            s = pick(b, r, t, cls = 0);
        if (s == UINT32_MAX && !pol->f_first)
            s = pick(b, r, t, cls = 1);
        if (s == UINT32_MAX && pol->split)
            s = pick(b, r, t, cls = 2);
    }
    if (s == UINT32_MAX)
        return 0;
    unsigned c = l->chunk_of[s], last = l->nstages - 1;
    size_t at = (size_t)s * b->m;
    if (cls == 1) {
        unsigned mb = b->nf[s]++;
        if (s > 0)
            put(b, r, EPIPE_OP_RECV_ACT, mb, c);
        put(b, r, EPIPE_OP_FORWARD, mb, c);
        if (s < last)
            put(b, r, EPIPE_OP_SEND_ACT, mb, c);
        b->fdone[at + mb] = t + 1;
        b->rank_live[r]++;
        b->rank_fleft[r]--;
    } else if (cls == 0) {
        unsigned mb = b->nb[s]++;
        if (s < last)
            put(b, r, EPIPE_OP_RECV_GRAD, mb, c);
        put(b, r, pol->split ? EPIPE_OP_BACKWARD_INPUT : EPIPE_OP_BACKWARD, mb, c);
        if (s > 0)
            put(b, r, EPIPE_OP_SEND_GRAD, mb, c);
        b->bdone[at + mb] = t + (pol->split ? 1 : 2);
        if (!pol->split)
            b->rank_live[r]--;
        b->busy[r] = t + (pol->split ? 1 : 2);
        return 1;
    } else {
        unsigned mb = b->nw[s]++;
        put(b, r, EPIPE_OP_BACKWARD_WEIGHT, mb, c);
        b->rank_live[r]--;
    }
    b->busy[r] = t + 1;
    return 1;
}

int epipe_sched_build(const struct epipe_sched_layout *l, unsigned microbatches,
                      const struct epipe_sched_policy *pol, epipe_op **ops, size_t *counts)
{
    unsigned P = l->nstages, R = l->ranks, m = microbatches;
    size_t pm = (size_t)P * m;
    struct bstate b = {.l = l, .pol = pol, .m = m, .ops = ops, .counts = counts};
    b.fdone = malloc(pm * sizeof *b.fdone);
    b.bdone = malloc(pm * sizeof *b.bdone);
    b.nf = calloc(P, sizeof *b.nf);
    b.nb = calloc(P, sizeof *b.nb);
    b.nw = calloc(P, sizeof *b.nw);
    b.rank_live = calloc(R, sizeof *b.rank_live);
    b.rank_fleft = calloc(R, sizeof *b.rank_fleft);
    b.busy = calloc(R, sizeof *b.busy);
    b.spos = calloc(R, sizeof *b.spos);
    int rc = EPIPE_OK;
    if (!b.fdone || !b.bdone || !b.nf || !b.nb || !b.nw || !b.rank_live || !b.rank_fleft ||
        !b.busy || !b.spos) {
        rc = epipe_fail(EPIPE_ENOMEM, "schedule: out of memory");
        goto out;
    }
    for (size_t i = 0; i < pm; i++)
        b.fdone[i] = b.bdone[i] = NEVER;
    size_t left = 0;
    for (unsigned r = 0; r < R; r++) {
        /* At most 3 ops around each forward and backward, 1 per weight backward. */
        ops[r] = malloc((size_t)l->nchunks[r] * m * 7 * sizeof(epipe_op));
        counts[r] = 0;
        if (!ops[r]) {
            rc = epipe_fail(EPIPE_ENOMEM, "schedule: out of memory");
            goto out;
        }
        b.rank_fleft[r] = l->nchunks[r] * m;
        left += (size_t)l->nchunks[r] * m * (pol->split ? 3 : 2);
    }
    for (uint32_t t = 0; left; t++) {
        int any = 0;
        for (unsigned r = 0; r < R; r++) {
            if (b.busy[r] > t)
                any = 1;
            else if (step(&b, r, t))
                any = 1, left--;
        }
        if (!any) {
            rc = epipe_fail(EPIPE_EINTERNAL,
                            "schedule rules leave every rank stuck at unit time %u "
                            "(%zu compute ops left)",
                            (unsigned)t, left);
            goto out;
        }
    }
out:
    free(b.fdone);
    free(b.bdone);
    free(b.nf);
    free(b.nb);
    free(b.nw);
    free(b.rank_live);
    free(b.rank_fleft);
    free(b.busy);
    free(b.spos);
    return rc;
}
