/* 1F1B without a flush (PipeDream): each rank's lists for the first step,
 * every later step and the drain, the weight versions their ops carry, and
 * the run of several steps that the simulator proves. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../error.h"
#include "schedule_impl.h"

/* The three phases live in one stream per pipeline stage s of P: w = P-s-1
 * warm-up forwards, then pairs "forward g+w, backward g", then the last w
 * backwards. A step's list holds the forwards of that step's m micro-batches
 * and the backward paired with each; so with m > w the backward of a
 * micro-batch always runs before the forward that reuses its id in the next
 * step. */

struct list {
    epipe_op *ops;
    size_t n;
};

static void put(struct list *l, uint32_t kind, unsigned mb, uint32_t version)
{
    l->ops[l->n++] = (epipe_op){
        .kind = kind, .microbatch = mb, .chunk = 0, .weight_version = version};
}

static void put_forward(struct list *l, unsigned s, unsigned P, unsigned mb, uint32_t v)
{
    if (s > 0)
        put(l, EPIPE_OP_RECV_ACT, mb, v);
    put(l, EPIPE_OP_FORWARD, mb, v);
    if (s + 1 < P)
        put(l, EPIPE_OP_SEND_ACT, mb, v);
}

static void put_backward(struct list *l, unsigned s, unsigned P, unsigned mb, uint32_t v)
{
    if (s + 1 < P)
        put(l, EPIPE_OP_RECV_GRAD, mb, v);
    put(l, EPIPE_OP_BACKWARD, mb, v);
    if (s > 0)
        put(l, EPIPE_OP_SEND_GRAD, mb, v);
}

/* The version (relative to the list's start, as a 32-bit two's complement
 * offset) of the forward at pair position j of a list and of the backward
 * paired with it. Per-micro-batch updates: a forward sees one update per
 * backward before it in the list; a backward uses its forward's version.
 * Per-step updates: every forward of a list sees the version of its start;
 * a backward of the previous list's micro-batch the one before. */
static uint32_t first_forward_version(int mode, unsigned j, unsigned w)
{
    return mode == EPIPE_WEIGHTS_STASHED && j >= w ? j - w : 0;
}

int epipe_sched_build_async(const struct epipe_sched_layout *l, unsigned m, int mode,
                            epipe_op **phase_ops[3], size_t *phase_counts[3])
{
    unsigned P = l->nstages;
    for (unsigned s = 0; s < P; s++) {
        unsigned r = l->rank_of[s], w = P - s - 1;
        struct list first = {malloc(sizeof(epipe_op) * 6 * m), 0};
        struct list steady = {malloc(sizeof(epipe_op) * 6 * m), 0};
        struct list drain = {malloc(sizeof(epipe_op) * 3 * (w + 1)), 0};
        phase_ops[EPIPE_PHASE_FIRST][r] = first.ops;
        phase_ops[EPIPE_PHASE_STEADY][r] = steady.ops;
        phase_ops[EPIPE_PHASE_DRAIN][r] = drain.ops;
        if (!first.ops || !steady.ops || !drain.ops)
            return epipe_fail(EPIPE_ENOMEM, "schedule: out of memory");
        int stashed = mode == EPIPE_WEIGHTS_STASHED;
        /* the first step: warm-up forwards, then pairs */
        for (unsigned j = 0; j < m; j++) {
            put_forward(&first, s, P, j, first_forward_version(mode, j, w));
            if (j >= w)
                put_backward(&first, s, P, j - w, first_forward_version(mode, j - w, w));
        }
        /* every later step, in the steady state: pair j runs the forward of
         * micro-batch j and the backward of micro-batch j - w, of the
         * previous step while j < w */
        for (unsigned j = 0; j < m; j++) {
            put_forward(&steady, s, P, j, stashed ? j : 0);
            uint32_t bv = stashed ? (uint32_t)(j - w) : j < w ? UINT32_MAX : 0;
            put_backward(&steady, s, P, (j + m - w) % m, bv);
        }
        /* the drain: the last w backwards, after a steady step */
        for (unsigned i = 0; i < w; i++)
            put_backward(&drain, s, P, m - w + i, stashed ? (uint32_t)(i - w) : UINT32_MAX);
        phase_counts[EPIPE_PHASE_FIRST][r] = first.n;
        phase_counts[EPIPE_PHASE_STEADY][r] = steady.n;
        phase_counts[EPIPE_PHASE_DRAIN][r] = drain.n;
    }
    return EPIPE_OK;
}

/* ---- the run the simulator proves, and the check of the versions -------- */

/* Global micro-batch ids: the k-th forward (backward) of a stage is global
 * micro-batch k, as the runtime numbers messages (the step of a micro-batch
 * is the step of its forward). */
int epipe_sched_async_run(const struct epipe_sched_layout *l, unsigned m, unsigned steps,
                          epipe_op *const *phase_ops[3], const size_t *phase_counts[3],
                          epipe_op **run, size_t *run_n)
{
    for (unsigned r = 0; r < l->ranks; r++) {
        size_t n = phase_counts[EPIPE_PHASE_FIRST][r] +
                   (size_t)(steps - 1) * phase_counts[EPIPE_PHASE_STEADY][r] +
                   phase_counts[EPIPE_PHASE_DRAIN][r];
        if (!(run[r] = malloc(sizeof(epipe_op) * (n ? n : 1))))
            return epipe_fail(EPIPE_ENOMEM, "schedule: out of memory");
        uint64_t nf = 0, nb = 0;
        size_t k = 0;
        for (unsigned t = 0; t <= steps; t++) {
            int ph = t == 0      ? EPIPE_PHASE_FIRST
                     : t < steps ? EPIPE_PHASE_STEADY
                                 : EPIPE_PHASE_DRAIN;
            const epipe_op *ops = phase_ops[ph][r];
            for (size_t i = 0; i < phase_counts[ph][r]; i++) {
                epipe_op op = ops[i];
                /* a send follows the compute op it sends for */
                uint64_t g = op.kind == EPIPE_OP_SEND_ACT                                  ? nf - 1
                             : op.kind == EPIPE_OP_SEND_GRAD                               ? nb - 1
                             : op.kind == EPIPE_OP_FORWARD || op.kind == EPIPE_OP_RECV_ACT ? nf
                                                                                           : nb;
                if (g % m != op.microbatch)
                    return epipe_fail(EPIPE_EINTERNAL,
                                      "async schedule: rank %u, step %u, op %zu names micro-batch "
                                      "%u where the stream has %llu",
                                      r, t, i, op.microbatch, (unsigned long long)(g % m));
                op.microbatch = (uint32_t)g;
                op.weight_version = 0; /* checked by the replay, not the simulator */
                run[r][k++] = op;
                if (op.kind == EPIPE_OP_FORWARD)
                    nf++;
                else if (op.kind == EPIPE_OP_BACKWARD)
                    nb++;
            }
        }
        if (nf != (uint64_t)steps * m || nb != nf)
            return epipe_fail(EPIPE_EINTERNAL,
                              "async schedule: rank %u runs %llu forwards and %llu backwards in "
                              "%u steps of %u",
                              r, (unsigned long long)nf, (unsigned long long)nb, steps, m);
        run_n[r] = k;
    }
    return EPIPE_OK;
}

/* Replays `steps` steps of each rank as the runtime counts versions (an
 * update after each backward, or after each list) and checks every op's
 * static version against it from the third step on (the steady state the
 * lists describe; the first list always): *versions[r] receives the most
 * weight versions rank r must hold at once (the current one, and every one
 * an in-flight micro-batch's forward used). */
/* Live micro-batches per weight version, and how many versions have any:
 * what a rank holds, kept as ops come instead of counted over every
 * micro-batch at each op (that was O(m^2) a list). */
struct held {
    uint32_t *count; /* by version */
    unsigned distinct;
};

static void held_add(struct held *h, uint64_t v)
{
    if (h->count[v]++ == 0)
        h->distinct++;
}

static void held_drop(struct held *h, uint64_t v)
{
    if (--h->count[v] == 0)
        h->distinct--;
}

int epipe_sched_async_versions(const struct epipe_sched_layout *l, unsigned m, int mode,
                               unsigned steps, epipe_op *const *phase_ops[3],
                               const size_t *phase_counts[3], unsigned *versions)
{
    /* versions count updates: at most one per backward, or one per list */
    size_t nver = (size_t)(steps + 1) * m + 2;
    uint64_t *fv = malloc(sizeof *fv * m);
    unsigned char *live = malloc(m);
    struct held h = {calloc(nver, sizeof *h.count), 0};
    if (!fv || !live || !h.count) {
        free(fv);
        free(live);
        free(h.count);
        return epipe_fail(EPIPE_ENOMEM, "schedule: out of memory");
    }
    int rc = EPIPE_OK;
    for (unsigned r = 0; r < l->ranks && rc == EPIPE_OK; r++) {
        uint64_t upd = 0;
        unsigned most = 1;
        memset(live, 0, m);
        for (unsigned t = 0; t <= steps && rc == EPIPE_OK; t++) {
            int ph = t == 0      ? EPIPE_PHASE_FIRST
                     : t < steps ? EPIPE_PHASE_STEADY
                                 : EPIPE_PHASE_DRAIN;
            uint64_t base = upd;
            for (size_t i = 0; i < phase_counts[ph][r]; i++) {
                const epipe_op *op = &phase_ops[ph][r][i];
                uint64_t v;
                if (op->kind == EPIPE_OP_FORWARD) {
                    if (live[op->microbatch])
                        held_drop(&h, fv[op->microbatch]);
                    v = fv[op->microbatch] = upd;
                    live[op->microbatch] = 1;
                    held_add(&h, v);
                } else if (op->kind == EPIPE_OP_BACKWARD) {
                    v = fv[op->microbatch];
                } else {
                    continue;
                }
                int checked = ph != EPIPE_PHASE_STEADY || t >= 2;
                if (checked && (uint32_t)(v - base) != op->weight_version) {
                    rc = epipe_fail(EPIPE_EINTERNAL,
                                    "async schedule: rank %u, step %u, op %zu carries version "
                                    "offset %d where the replay has %d",
                                    r, t, i, (int)op->weight_version, (int)(uint32_t)(v - base));
                    break;
                }
                /* distinct versions held: the current one and the in-flight ones */
                unsigned held = 1 + h.distinct - (h.count[upd] ? 1 : 0);
                most = held > most ? held : most;
                if (op->kind == EPIPE_OP_BACKWARD) {
                    if (live[op->microbatch])
                        held_drop(&h, fv[op->microbatch]);
                    live[op->microbatch] = 0;
                    if (mode == EPIPE_WEIGHTS_STASHED)
                        upd++;
                }
            }
            if (mode == EPIPE_WEIGHTS_DOUBLE)
                upd++; /* the host's update after each list */
        }
        for (unsigned j = 0; j < m; j++) /* the next rank starts with none held */
            if (live[j])
                held_drop(&h, fv[j]);
        versions[r] = most;
    }
    free(fv);
    free(live);
    free(h.count);
    return rc;
}
