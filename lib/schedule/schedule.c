/* Schedules as data: builds each stage's op list for gpipe and 1f1b, and the
 * public schedule API around it (create proves the lists with the simulator). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <epipe/schedule.h>

#include "../error.h"
#include "schedule_impl.h"

struct epipe_schedule {
    const char *kind;
    unsigned stages, microbatches;
    epipe_op **ops; /* ops[s]: stage s's list */
    size_t *counts; /* counts[s]: its length */
};

/* Appends ops to one stage's list; the list was sized for the worst case. */
struct builder {
    epipe_op *ops;
    size_t n;
    unsigned stage, stages;
};

static void put(struct builder *b, epipe_op_kind kind, unsigned mb)
{
    b->ops[b->n++] = (epipe_op){.kind = (uint32_t)kind, .microbatch = mb};
}

static void forward(struct builder *b, unsigned mb)
{
    if (b->stage > 0)
        put(b, EPIPE_OP_RECV_ACT, mb);
    put(b, EPIPE_OP_FORWARD, mb);
    if (b->stage + 1 < b->stages)
        put(b, EPIPE_OP_SEND_ACT, mb);
}

static void backward(struct builder *b, unsigned mb)
{
    if (b->stage + 1 < b->stages)
        put(b, EPIPE_OP_RECV_GRAD, mb);
    put(b, EPIPE_OP_BACKWARD, mb);
    if (b->stage > 0)
        put(b, EPIPE_OP_SEND_GRAD, mb);
}

static void build_gpipe(struct builder *b, unsigned m)
{
    for (unsigned i = 0; i < m; i++)
        forward(b, i);
    for (unsigned i = 0; i < m; i++)
        backward(b, i);
}

static void build_1f1b(struct builder *b, unsigned m)
{
    unsigned p = b->stages, s = b->stage;
    unsigned warmup = p - s - 1 < m ? p - s - 1 : m;
    for (unsigned i = 0; i < warmup; i++)
        forward(b, i);
    for (unsigned i = 0; i + warmup < m; i++) {
        forward(b, i + warmup);
        backward(b, i);
    }
    for (unsigned i = m - warmup; i < m; i++)
        backward(b, i);
}

static const struct {
    const char *name;
    void (*build)(struct builder *b, unsigned microbatches);
} kinds[] = {
    {"gpipe", build_gpipe},
    {"1f1b", build_1f1b},
};
#define NKINDS (sizeof kinds / sizeof kinds[0])

EPIPE_API const char *epipe_schedule_kind_name(size_t i)
{
    return i < NKINDS ? kinds[i].name : NULL;
}

static int unknown_kind(const char *kind)
{
    char known[128] = "";
    for (size_t i = 0; i < NKINDS; i++) {
        if (i)
            strcat(known, ", ");
        strcat(known, kinds[i].name);
    }
    return epipe_fail(EPIPE_EINVAL, "unknown schedule kind '%.64s' (known: %s)", kind, known);
}

EPIPE_API void epipe_schedule_destroy(epipe_schedule *sched)
{
    if (!sched)
        return;
    if (sched->ops)
        for (unsigned s = 0; s < sched->stages; s++)
            free(sched->ops[s]);
    free(sched->ops);
    free(sched->counts);
    free(sched);
}

EPIPE_API int epipe_schedule_create(epipe_schedule **out, const char *kind, unsigned stages,
                                    unsigned microbatches)
{
    epipe_clear_error();
    if (!out)
        return epipe_fail(EPIPE_EINVAL, "epipe_schedule_create: out is NULL");
    *out = NULL;
    if (!kind)
        return epipe_fail(EPIPE_EINVAL, "epipe_schedule_create: kind is NULL");
    size_t k = 0;
    while (k < NKINDS && strcmp(kinds[k].name, kind))
        k++;
    if (k == NKINDS)
        return unknown_kind(kind);
    if (stages < 1 || stages > EPIPE_SCHEDULE_MAX_STAGES)
        return epipe_fail(EPIPE_EINVAL, "%s schedule: %u stages is out of range 1..%u", kind,
                          stages, EPIPE_SCHEDULE_MAX_STAGES);
    if (microbatches < 1 || microbatches > EPIPE_SCHEDULE_MAX_MICROBATCHES)
        return epipe_fail(EPIPE_EINVAL, "%s schedule: %u micro-batches is out of range 1..%u", kind,
                          microbatches, EPIPE_SCHEDULE_MAX_MICROBATCHES);
    if ((uint64_t)stages * microbatches > EPIPE_SCHEDULE_MAX_PRODUCT)
        return epipe_fail(EPIPE_EINVAL,
                          "%s schedule: %u stages x %u micro-batches exceeds the limit of %u", kind,
                          stages, microbatches, EPIPE_SCHEDULE_MAX_PRODUCT);

    epipe_schedule *sc = calloc(1, sizeof *sc);
    if (!sc)
        return epipe_fail(EPIPE_ENOMEM, "schedule: out of memory");
    sc->kind = kinds[k].name;
    sc->stages = stages;
    sc->microbatches = microbatches;
    sc->ops = calloc(stages, sizeof *sc->ops);
    sc->counts = calloc(stages, sizeof *sc->counts);
    if (!sc->ops || !sc->counts) {
        epipe_schedule_destroy(sc);
        return epipe_fail(EPIPE_ENOMEM, "schedule: out of memory");
    }
    /* At most 3 ops around each forward and each backward. */
    size_t cap = (size_t)6 * microbatches;
    for (unsigned s = 0; s < stages; s++) {
        struct builder b = {.ops = malloc(cap * sizeof(epipe_op)), .stage = s, .stages = stages};
        if (!b.ops) {
            epipe_schedule_destroy(sc);
            return epipe_fail(EPIPE_ENOMEM, "schedule: out of memory for %zu ops", cap);
        }
        kinds[k].build(&b, microbatches);
        sc->ops[s] = b.ops;
        sc->counts[s] = b.n;
    }

    /* Prove it: a schedule that deadlocks or breaks a dependency is a bug. */
    epipe_sim *sim;
    int rc = epipe_sim_create_raw(&sim, stages, microbatches, (const epipe_op *const *)sc->ops,
                                  sc->counts);
    if (rc != EPIPE_OK) {
        epipe_schedule_destroy(sc);
        if (rc == EPIPE_ENOMEM)
            return rc;
        char why[EPIPE_ERRMSG_MAX];
        snprintf(why, sizeof why, "%s", epipe_last_error());
        return epipe_fail(EPIPE_EINTERNAL, "%s schedule p=%u m=%u failed its proof: %s", kind,
                          stages, microbatches, why);
    }
    epipe_sim_destroy(sim);
    *out = sc;
    return EPIPE_OK;
}

EPIPE_API const char *epipe_schedule_kind(const epipe_schedule *sched)
{
    return sched ? sched->kind : "";
}

EPIPE_API unsigned epipe_schedule_stages(const epipe_schedule *sched)
{
    return sched ? sched->stages : 0;
}

EPIPE_API unsigned epipe_schedule_microbatches(const epipe_schedule *sched)
{
    return sched ? sched->microbatches : 0;
}

EPIPE_API int epipe_schedule_ops(const epipe_schedule *sched, unsigned stage, const epipe_op **ops,
                                 size_t *count)
{
    epipe_clear_error();
    if (!sched || !ops || !count)
        return epipe_fail(EPIPE_EINVAL, "epipe_schedule_ops: NULL argument");
    if (stage >= sched->stages)
        return epipe_fail(EPIPE_EINVAL, "%s schedule: stage %u is out of range 0..%u", sched->kind,
                          stage, sched->stages - 1);
    *ops = sched->ops[stage];
    *count = sched->counts[stage];
    return EPIPE_OK;
}

EPIPE_API const char *epipe_op_kind_name(uint32_t kind)
{
    switch (kind) {
    case EPIPE_OP_FORWARD: return "F";
    case EPIPE_OP_BACKWARD: return "B";
    case EPIPE_OP_RECV_ACT: return "recv-act";
    case EPIPE_OP_SEND_ACT: return "send-act";
    case EPIPE_OP_RECV_GRAD: return "recv-grad";
    case EPIPE_OP_SEND_GRAD: return "send-grad";
    default: return "?";
    }
}

void epipe_schedule_lists(const epipe_schedule *sched, const epipe_op *const **ops,
                          const size_t **counts)
{
    *ops = (const epipe_op *const *)sched->ops;
    *counts = sched->counts;
}
