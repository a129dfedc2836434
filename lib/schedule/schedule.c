/* Schedules as data: the kinds, their layouts (placement of pipeline stages on
 * ranks) and the public schedule API (create proves the lists by simulation). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <epipe/schedule.h>

#include "../error.h"
#include "schedule_impl.h"

struct epipe_schedule {
    const char *kind;
    unsigned microbatches;
    int split;
    int weights; /* epipe_weight_mode */
    struct epipe_sched_layout layout;
    epipe_op **ops; /* ops[r]: rank r's list (an async kind's FIRST list) */
    size_t *counts; /* counts[r]: its length */
    /* Async kinds: the STEADY and DRAIN lists (FIRST is ops), the run of
     * EPIPE_SIM_ASYNC_STEPS steps the simulator proves, and the versions
     * each rank holds. */
    epipe_op **phase_ops[3];
    size_t *phase_counts[3];
    epipe_op **run;
    size_t *run_counts;
    unsigned *versions;
};

/* Rules of each kind over a layout; the limits arrays are allocated by the
 * caller (zeroed: no limit). */
static void rules_gpipe(const struct epipe_sched_layout *l, unsigned m,
                        struct epipe_sched_policy *p)
{
    (void)l, (void)m;
    p->flush_forwards = 1;
}

/* 1F1B: pipeline stage s of P holds at most P-s activations. */
static void rules_1f1b(const struct epipe_sched_layout *l, unsigned m, struct epipe_sched_policy *p)
{
    (void)m;
    for (unsigned s = 0; s < l->nstages; s++)
        p->stage_limit[s] = l->nstages - s;
}

/* Interleaved 1F1B (Megatron-LM, depth-first): forwards in groups of
 * micro-batches (m/R groups of g >= R, the sizes as equal as possible, so
 * any m works), chunk by chunk, backwards the same with the chunks
 * reversed, each in that order only; a forward first when both may run;
 * rank r runs 2(R-r-1) + (v-1)g forwards ahead of its first backward
 * (Megatron's warm-up with g = R when R divides m), so it holds one more. */
static void rules_interleaved(const struct epipe_sched_layout *l, unsigned m,
                              struct epipe_sched_policy *p)
{
    unsigned R = l->ranks, g = epipe_sched_group_size(m, R);
    p->depth_first = p->in_order = p->f_first = 1;
    for (unsigned r = 0; r < R; r++)
        p->rank_limit[r] = 2 * (R - r - 1) + (l->nchunks[r] - 1) * g + 1;
    if (l->nstages == R)
        rules_1f1b(l, m, p);
}

/* The peak live activations of 1f1b on this layout: the most that any rank
 * holds when stage s holds P-s. */
static unsigned peak_1f1b(const struct epipe_sched_layout *l)
{
    unsigned peak = 0;
    for (unsigned r = 0; r < l->ranks; r++) {
        unsigned sum = 0;
        for (unsigned c = 0; c < l->nchunks[r]; c++)
            sum += l->nstages - l->stage_at[l->first[r] + c];
        peak = sum > peak ? sum : peak;
    }
    return peak;
}

/* ZB-H1 (Qi et al. 2024): the forwards and backwards of 1F1B in 1F1B's
 * order, the backward split; a weight backward runs whenever the next of
 * them cannot run yet (or at the end), and every rank may hold as many
 * activations (freed by W) as 1F1B's fullest rank, so the later stages run
 * their weight backwards late, in what were 1F1B's bubbles. */
static void rules_zbh1(const struct epipe_sched_layout *l, unsigned m, struct epipe_sched_policy *p)
{
    unsigned peak = peak_1f1b(l);
    (void)m;
    p->split = 1;
    for (unsigned r = 0; r < l->ranks; r++)
        p->rank_limit[r] = peak;
}

/* ZB-V: two chunks per rank in a V; the same rules as ZB-H1, with a rank
 * holding at most 2R chunk activations (the memory of 1F1B's first stage). */
static void rules_zbv(const struct epipe_sched_layout *l, unsigned m, struct epipe_sched_policy *p)
{
    (void)m;
    p->split = 1;
    for (unsigned r = 0; r < l->ranks; r++)
        p->rank_limit[r] = 2 * l->ranks;
}

static const struct kind {
    const char *name;
    int scripted; /* follows the forward/backward order of 1f1b on the same layout */
    unsigned default_chunks, need_chunks; /* need_chunks 0: any */
    int v_shape;                          /* default placement a V, else round-robin */
    int round_robin; /* needs the round-robin placement when a rank holds several chunks */
    void (*rules)(const struct epipe_sched_layout *l, unsigned m, struct epipe_sched_policy *p);
    int weights; /* epipe_weight_mode: not FLUSH for the kinds built by async.c */
} kinds[] = {
    {"gpipe", 0, 1, 0, 0, 0, rules_gpipe, EPIPE_WEIGHTS_FLUSH},
    {"1f1b", 0, 1, 0, 0, 0, rules_1f1b, EPIPE_WEIGHTS_FLUSH},
    {"interleaved", 0, 1, 0, 0, 1, rules_interleaved, EPIPE_WEIGHTS_FLUSH},
    {"zb-h1", 1, 1, 0, 0, 0, rules_zbh1, EPIPE_WEIGHTS_FLUSH},
    {"zb-v", 0, 2, 2, 1, 0, rules_zbv, EPIPE_WEIGHTS_FLUSH},
    {"1f1b-async", 0, 1, 1, 0, 0, NULL, EPIPE_WEIGHTS_STASHED},
    {"1f1b-2bw", 0, 1, 1, 0, 0, NULL, EPIPE_WEIGHTS_DOUBLE},
};
#define NKINDS (sizeof kinds / sizeof kinds[0])

EPIPE_API const char *epipe_schedule_kind_name(size_t i)
{
    return i < NKINDS ? kinds[i].name : NULL;
}

static int unknown_kind(const char *kind)
{
    char known[160] = "";
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
    for (unsigned r = 0; r < sched->layout.ranks; r++) {
        if (sched->ops)
            free(sched->ops[r]);
        for (int ph = 1; ph < 3; ph++)
            if (sched->phase_ops[ph])
                free(sched->phase_ops[ph][r]);
        if (sched->run)
            free(sched->run[r]);
    }
    free(sched->ops);
    free(sched->counts);
    for (int ph = 1; ph < 3; ph++) {
        free(sched->phase_ops[ph]);
        free(sched->phase_counts[ph]);
    }
    free(sched->run);
    free(sched->run_counts);
    free(sched->versions);
    epipe_sched_layout_free(&sched->layout);
    free(sched);
}

void epipe_sched_layout_free(struct epipe_sched_layout *l)
{
    free(l->rank_of);
    free(l->chunk_of);
    free(l->nchunks);
    free(l->first);
    free(l->stage_at);
    memset(l, 0, sizeof *l);
}

int epipe_sched_layout_init(struct epipe_sched_layout *l, unsigned ranks, unsigned nstages,
                            unsigned *rank_of)
{
    *l = (struct epipe_sched_layout){.ranks = ranks, .nstages = nstages, .rank_of = rank_of};
    l->chunk_of = malloc(nstages * sizeof *l->chunk_of);
    l->nchunks = calloc(ranks, sizeof *l->nchunks);
    l->first = malloc(ranks * sizeof *l->first);
    l->stage_at = malloc(nstages * sizeof *l->stage_at);
    if (!l->chunk_of || !l->nchunks || !l->first || !l->stage_at)
        return epipe_fail(EPIPE_ENOMEM, "schedule: out of memory");
    for (unsigned s = 0; s < nstages; s++) {
        if (rank_of[s] >= ranks)
            return epipe_fail(EPIPE_EINVAL, "placement[%u] = %u: rank out of range 0..%u", s,
                              rank_of[s], ranks - 1);
        l->chunk_of[s] = l->nchunks[rank_of[s]]++;
    }
    unsigned total = 0;
    for (unsigned r = 0; r < ranks; r++) {
        if (!l->nchunks[r])
            return epipe_fail(EPIPE_EINVAL, "placement: rank %u holds no pipeline stage", r);
        l->first[r] = total;
        total += l->nchunks[r];
    }
    for (unsigned s = 0; s < nstages; s++)
        l->stage_at[l->first[rank_of[s]] + l->chunk_of[s]] = s;
    return EPIPE_OK;
}

/* Checks the layout against the kind and fills sc->layout. */
static int make_layout(epipe_schedule *sc, const struct kind *k, unsigned ranks,
                       const epipe_schedule_layout *lay)
{
    const char *kn = k->name;
    unsigned chunks = lay ? lay->chunks : 0;
    const unsigned *placement = lay ? lay->placement : NULL;
    unsigned n = placement ? lay->placement_len : 0;
    if (lay && !placement && lay->placement_len)
        return epipe_fail(EPIPE_EINVAL, "%s schedule: placement_len %u without a placement", kn,
                          lay->placement_len);
    if (placement) {
        if (n == 0)
            return epipe_fail(EPIPE_EINVAL, "%s schedule: the placement has length 0", kn);
        if (n > EPIPE_SCHEDULE_MAX_STAGES)
            return epipe_fail(EPIPE_EINVAL,
                              "%s schedule: a placement of %u pipeline stages is over the "
                              "limit of %u",
                              kn, n, EPIPE_SCHEDULE_MAX_STAGES);
    } else {
        if (!chunks)
            chunks = k->default_chunks;
        if (chunks > EPIPE_SCHEDULE_MAX_STAGES / ranks)
            return epipe_fail(EPIPE_EINVAL,
                              "%s schedule: %u ranks x %u chunks is over the limit of %u "
                              "pipeline stages",
                              kn, ranks, chunks, EPIPE_SCHEDULE_MAX_STAGES);
        n = ranks * chunks;
    }
    unsigned *rank_of = malloc(n * sizeof *rank_of);
    if (!rank_of)
        return epipe_fail(EPIPE_ENOMEM, "schedule: out of memory");
    for (unsigned s = 0; s < n; s++) {
        if (placement)
            rank_of[s] = placement[s];
        else if (k->v_shape && (s / ranks) % 2)
            rank_of[s] = ranks - 1 - s % ranks;
        else
            rank_of[s] = s % ranks;
    }
    int rc = epipe_sched_layout_init(&sc->layout, ranks, n, rank_of);
    if (rc == EPIPE_EINVAL) {
        char why[EPIPE_ERRMSG_MAX];
        snprintf(why, sizeof why, "%s", epipe_last_error());
        return epipe_fail(EPIPE_EINVAL, "%s schedule over %u ranks: %s", kn, ranks, why);
    }
    if (rc)
        return rc;
    for (unsigned r = 0; r < ranks; r++) {
        unsigned c = sc->layout.nchunks[r];
        if (lay && lay->chunks && c != lay->chunks)
            return epipe_fail(EPIPE_EINVAL,
                              "%s schedule: rank %u holds %u chunks in the placement, not the "
                              "%u of layout.chunks",
                              kn, r, c, lay->chunks);
        if (c > EPIPE_SCHEDULE_MAX_CHUNKS)
            return epipe_fail(EPIPE_EINVAL,
                              "%s schedule: rank %u holds %u chunks, over the limit of %u", kn, r,
                              c, EPIPE_SCHEDULE_MAX_CHUNKS);
        if (k->need_chunks && c != k->need_chunks)
            return epipe_fail(EPIPE_EINVAL, "%s schedule: rank %u holds %u chunks; %s needs %u", kn,
                              r, c, kn, k->need_chunks);
    }
    /* Megatron's order is deadlock-free on the round-robin placement only. */
    if (k->round_robin && n > ranks)
        for (unsigned s = 0; s < n; s++)
            if (sc->layout.rank_of[s] != s % ranks)
                return epipe_fail(EPIPE_EINVAL,
                                  "%s schedule: pipeline stage %u is on rank %u; with several "
                                  "chunks on a rank %s needs the round-robin placement (stage s "
                                  "on rank s %% %u)",
                                  kn, s, sc->layout.rank_of[s], kn, ranks);
    return EPIPE_OK;
}

/* Builds sc's lists: a scripted kind first builds 1f1b's on the layout. */
static int build_lists(epipe_schedule *sc, const struct kind *k, struct epipe_sched_policy *pol)
{
    const struct epipe_sched_layout *l = &sc->layout;
    epipe_op **script = NULL;
    size_t *script_n = NULL;
    int rc = EPIPE_OK;
    if (k->scripted) {
        script = calloc(l->ranks, sizeof *script);
        script_n = calloc(l->ranks, sizeof *script_n);
        if (!script || !script_n) {
            rc = epipe_fail(EPIPE_ENOMEM, "schedule: out of memory");
            goto out;
        }
        struct epipe_sched_policy p1 = {.stage_limit = pol->stage_limit};
        rules_1f1b(l, sc->microbatches, &p1);
        rc = epipe_sched_build(l, sc->microbatches, &p1, script, script_n);
        memset(pol->stage_limit, 0, l->nstages * sizeof *pol->stage_limit);
        if (rc)
            goto out;
        pol->script = (const epipe_op *const *)script;
        pol->script_n = script_n;
    }
    k->rules(l, sc->microbatches, pol);
    sc->split = pol->split;
    rc = epipe_sched_build(l, sc->microbatches, pol, sc->ops, sc->counts);
out:
    if (script)
        for (unsigned r = 0; r < l->ranks; r++)
            free(script[r]);
    free(script);
    free(script_n);
    return rc;
}

/* Proves raw lists with the simulator; a failure is a bug of the builder. */
static int prove(const epipe_schedule *sc, unsigned m, const epipe_op *const *ops,
                 const size_t *counts)
{
    epipe_sim *sim;
    int rc = epipe_sim_create_layout_raw(&sim, &sc->layout, m, ops, counts);
    if (rc == EPIPE_OK) {
        epipe_sim_destroy(sim);
        return EPIPE_OK;
    }
    if (rc == EPIPE_ENOMEM)
        return rc;
    char why[EPIPE_ERRMSG_MAX];
    snprintf(why, sizeof why, "%s", epipe_last_error());
    return epipe_fail(EPIPE_EINTERNAL, "%s schedule ranks=%u stages=%u m=%u failed its proof: %s",
                      sc->kind, sc->layout.ranks, sc->layout.nstages, sc->microbatches, why);
}

/* 1f1b-async and 1f1b-2bw (async.c): one chunk per rank, m >= P; the three
 * phase lists, the run the simulator proves, the versions replayed. */
static int build_async(epipe_schedule *sc, const struct kind *k)
{
    const struct epipe_sched_layout *l = &sc->layout;
    unsigned R = l->ranks, P = l->nstages, m = sc->microbatches;
    if (P != R)
        return epipe_fail(EPIPE_EINVAL,
                          "%s schedule: %u pipeline stages on %u ranks; it takes one chunk per "
                          "rank",
                          k->name, P, R);
    if (m < P)
        return epipe_fail(EPIPE_EINVAL,
                          "%s schedule: %u micro-batches a step for %u pipeline stages; it needs "
                          "m >= %u, so that each micro-batch's backward ends before the next "
                          "step reuses its id",
                          k->name, m, P, P);
    if ((uint64_t)P * m * EPIPE_SIM_ASYNC_STEPS > EPIPE_SCHEDULE_MAX_PRODUCT)
        return epipe_fail(EPIPE_EINVAL,
                          "%s schedule: %u stages x %u micro-batches x %u proven steps exceeds "
                          "the limit of %u",
                          k->name, P, m, EPIPE_SIM_ASYNC_STEPS, EPIPE_SCHEDULE_MAX_PRODUCT);
    sc->weights = k->weights;
    sc->ops = calloc(R, sizeof *sc->ops);
    sc->counts = calloc(R, sizeof *sc->counts);
    for (int ph = 1; ph < 3; ph++) {
        sc->phase_ops[ph] = calloc(R, sizeof *sc->phase_ops[ph]);
        sc->phase_counts[ph] = calloc(R, sizeof *sc->phase_counts[ph]);
    }
    sc->run = calloc(R, sizeof *sc->run);
    sc->run_counts = calloc(R, sizeof *sc->run_counts);
    sc->versions = calloc(R, sizeof *sc->versions);
    if (!sc->ops || !sc->counts || !sc->phase_ops[1] || !sc->phase_ops[2] || !sc->phase_counts[1] ||
        !sc->phase_counts[2] || !sc->run || !sc->run_counts || !sc->versions)
        return epipe_fail(EPIPE_ENOMEM, "schedule: out of memory");
    sc->phase_ops[0] = sc->ops;
    sc->phase_counts[0] = sc->counts;
    int rc = epipe_sched_build_async(l, m, k->weights, sc->phase_ops, sc->phase_counts);
    epipe_op *const *po[3] = {sc->phase_ops[0], sc->phase_ops[1], sc->phase_ops[2]};
    const size_t *pc[3] = {sc->phase_counts[0], sc->phase_counts[1], sc->phase_counts[2]};
    if (!rc)
        rc = epipe_sched_async_run(l, m, EPIPE_SIM_ASYNC_STEPS, po, pc, sc->run, sc->run_counts);
    if (!rc)
        rc = epipe_sched_async_versions(l, m, k->weights, EPIPE_SIM_ASYNC_STEPS, po, pc,
                                        sc->versions);
    if (!rc)
        rc = prove(sc, m * EPIPE_SIM_ASYNC_STEPS, (const epipe_op *const *)sc->run, sc->run_counts);
    return rc;
}

EPIPE_API int epipe_schedule_create(epipe_schedule **out, const char *kind, unsigned stages,
                                    unsigned microbatches)
{
    return epipe_schedule_create_layout(out, kind, stages, microbatches, NULL);
}

EPIPE_API int epipe_schedule_create_layout(epipe_schedule **out, const char *kind, unsigned ranks,
                                           unsigned microbatches,
                                           const epipe_schedule_layout *layout)
{
    epipe_clear_error();
    if (!out)
        return epipe_fail(EPIPE_EINVAL, "epipe_schedule_create: out is NULL");
    *out = NULL;
    if (!kind)
        return epipe_fail(EPIPE_EINVAL, "epipe_schedule_create: kind is NULL");
    size_t ki = 0;
    while (ki < NKINDS && strcmp(kinds[ki].name, kind))
        ki++;
    if (ki == NKINDS)
        return unknown_kind(kind);
    const struct kind *k = &kinds[ki];
    if (ranks < 1 || ranks > EPIPE_SCHEDULE_MAX_STAGES)
        return epipe_fail(EPIPE_EINVAL, "%s schedule: %u stages is out of range 1..%u", kind, ranks,
                          EPIPE_SCHEDULE_MAX_STAGES);
    if (microbatches < 1 || microbatches > EPIPE_SCHEDULE_MAX_MICROBATCHES)
        return epipe_fail(EPIPE_EINVAL, "%s schedule: %u micro-batches is out of range 1..%u", kind,
                          microbatches, EPIPE_SCHEDULE_MAX_MICROBATCHES);
    /* Only one version of the struct exists; a larger one would carry
     * settings this library cannot honour. */
    if (layout && layout->struct_size != sizeof *layout)
        return epipe_fail(EPIPE_EINVAL,
                          "%s schedule: layout.struct_size %zu is not the %zu this library knows "
                          "(initialise it with EPIPE_SCHEDULE_LAYOUT_INIT)",
                          kind, layout->struct_size, sizeof *layout);

    epipe_schedule *sc = calloc(1, sizeof *sc);
    if (!sc)
        return epipe_fail(EPIPE_ENOMEM, "schedule: out of memory");
    sc->kind = k->name;
    sc->microbatches = microbatches;
    int rc = make_layout(sc, k, ranks, layout);
    if (rc) {
        epipe_schedule_destroy(sc);
        return rc;
    }
    unsigned P = sc->layout.nstages;
    if ((uint64_t)P * microbatches > EPIPE_SCHEDULE_MAX_PRODUCT) {
        epipe_schedule_destroy(sc);
        return epipe_fail(EPIPE_EINVAL,
                          "%s schedule: %u stages x %u micro-batches exceeds the limit of %u", kind,
                          P, microbatches, EPIPE_SCHEDULE_MAX_PRODUCT);
    }
    if (k->weights != EPIPE_WEIGHTS_FLUSH) {
        rc = build_async(sc, k);
        if (rc) {
            epipe_schedule_destroy(sc);
            return rc;
        }
        *out = sc;
        return EPIPE_OK;
    }
    struct epipe_sched_policy pol = {0};
    pol.stage_limit = calloc(P, sizeof *pol.stage_limit);
    pol.rank_limit = calloc(ranks, sizeof *pol.rank_limit);
    sc->ops = calloc(ranks, sizeof *sc->ops);
    sc->counts = calloc(ranks, sizeof *sc->counts);
    if (!pol.stage_limit || !pol.rank_limit || !sc->ops || !sc->counts) {
        rc = epipe_fail(EPIPE_ENOMEM, "schedule: out of memory");
    } else {
        rc = build_lists(sc, k, &pol);
    }
    free(pol.stage_limit);
    free(pol.rank_limit);
    if (rc) {
        epipe_schedule_destroy(sc);
        return rc;
    }

    /* Prove it: a schedule that deadlocks or breaks a dependency is a bug. */
    if ((rc = prove(sc, microbatches, (const epipe_op *const *)sc->ops, sc->counts))) {
        epipe_schedule_destroy(sc);
        return rc;
    }
    *out = sc;
    return EPIPE_OK;
}

EPIPE_API const char *epipe_schedule_kind(const epipe_schedule *sched)
{
    return sched ? sched->kind : "";
}

EPIPE_API unsigned epipe_schedule_stages(const epipe_schedule *sched)
{
    return sched ? sched->layout.ranks : 0;
}

EPIPE_API unsigned epipe_schedule_pipeline_stages(const epipe_schedule *sched)
{
    return sched ? sched->layout.nstages : 0;
}

EPIPE_API unsigned epipe_schedule_chunks(const epipe_schedule *sched, unsigned rank)
{
    return sched && rank < sched->layout.ranks ? sched->layout.nchunks[rank] : 0;
}

EPIPE_API int epipe_schedule_stage_of(const epipe_schedule *sched, unsigned rank, unsigned chunk,
                                      unsigned *stage)
{
    epipe_clear_error();
    if (!sched || !stage)
        return epipe_fail(EPIPE_EINVAL, "epipe_schedule_stage_of: NULL argument");
    const struct epipe_sched_layout *l = &sched->layout;
    if (rank >= l->ranks)
        return epipe_fail(EPIPE_EINVAL, "%s schedule: rank %u is out of range 0..%u", sched->kind,
                          rank, l->ranks - 1);
    if (chunk >= l->nchunks[rank])
        return epipe_fail(EPIPE_EINVAL, "%s schedule: chunk %u of rank %u is out of range 0..%u",
                          sched->kind, chunk, rank, l->nchunks[rank] - 1);
    *stage = l->stage_at[l->first[rank] + chunk];
    return EPIPE_OK;
}

EPIPE_API int epipe_schedule_placement(const epipe_schedule *sched, unsigned stage, unsigned *rank,
                                       unsigned *chunk)
{
    epipe_clear_error();
    if (!sched)
        return epipe_fail(EPIPE_EINVAL, "epipe_schedule_placement: schedule is NULL");
    if (stage >= sched->layout.nstages)
        return epipe_fail(EPIPE_EINVAL, "%s schedule: pipeline stage %u is out of range 0..%u",
                          sched->kind, stage, sched->layout.nstages - 1);
    if (rank)
        *rank = sched->layout.rank_of[stage];
    if (chunk)
        *chunk = sched->layout.chunk_of[stage];
    return EPIPE_OK;
}

EPIPE_API int epipe_schedule_splits_backward(const epipe_schedule *sched)
{
    return sched ? sched->split : 0;
}

EPIPE_API int epipe_schedule_weights(const epipe_schedule *sched)
{
    return sched ? sched->weights : EPIPE_WEIGHTS_FLUSH;
}

EPIPE_API unsigned epipe_schedule_weight_versions(const epipe_schedule *sched, unsigned stage)
{
    if (!sched || stage >= sched->layout.ranks)
        return 0;
    return sched->versions ? sched->versions[stage] : 1;
}

EPIPE_API int epipe_schedule_phase_ops(const epipe_schedule *sched, unsigned stage, int phase,
                                       const epipe_op **ops, size_t *count)
{
    epipe_clear_error();
    if (!sched || !ops || !count)
        return epipe_fail(EPIPE_EINVAL, "epipe_schedule_phase_ops: NULL argument");
    if (stage >= sched->layout.ranks)
        return epipe_fail(EPIPE_EINVAL, "%s schedule: stage %u is out of range 0..%u", sched->kind,
                          stage, sched->layout.ranks - 1);
    if (phase < EPIPE_PHASE_FIRST || phase > EPIPE_PHASE_DRAIN)
        return epipe_fail(EPIPE_EINVAL,
                          "epipe_schedule_phase_ops: phase %d is not FIRST (0), STEADY (1) or "
                          "DRAIN (2)",
                          phase);
    if (sched->weights == EPIPE_WEIGHTS_FLUSH) {
        *ops = sched->ops[stage];
        *count = phase == EPIPE_PHASE_DRAIN ? 0 : sched->counts[stage];
        return EPIPE_OK;
    }
    *ops = sched->phase_ops[phase][stage];
    *count = sched->phase_counts[phase][stage];
    return EPIPE_OK;
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
    if (stage >= sched->layout.ranks)
        return epipe_fail(EPIPE_EINVAL, "%s schedule: stage %u is out of range 0..%u", sched->kind,
                          stage, sched->layout.ranks - 1);
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
    case EPIPE_OP_BACKWARD_INPUT: return "Bi";
    case EPIPE_OP_BACKWARD_WEIGHT: return "W";
    default: return "?";
    }
}

void epipe_schedule_lists(const epipe_schedule *sched, const epipe_op *const **ops,
                          const size_t **counts, unsigned *microbatches)
{
    int run = sched->weights != EPIPE_WEIGHTS_FLUSH;
    *ops = (const epipe_op *const *)(run ? sched->run : sched->ops);
    *counts = run ? sched->run_counts : sched->counts;
    *microbatches = sched->microbatches * (run ? EPIPE_SIM_ASYNC_STEPS : 1);
}

const struct epipe_sched_layout *epipe_schedule_layout_of(const epipe_schedule *sched)
{
    return &sched->layout;
}
