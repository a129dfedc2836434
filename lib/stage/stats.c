/* The stage's statistics: totals, per-boundary bytes and rates with a
 * sliding-window peak, step-time percentiles, and the copy that other
 * threads may read while the stage runs. */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <string.h>

#include "stage_impl.h"

/* ---- set-up --------------------------------------------------------------- */

static void clear_count(struct byte_count *b)
{
    memset(b, 0, sizeof *b);
    for (int i = 0; i < STATS_BUCKETS; i++)
        b->bucket_id[i] = -1;
}

static void clear_records(epipe_stage *st)
{
    for (unsigned k = 0; k < st->nch; k++)
        for (int i = 0; i < 2; i++) {
            clear_count(&st->ch[k].brec[i].act);
            clear_count(&st->ch[k].brec[i].grad);
        }
}

int epipe_stage_stats_init(epipe_stage *st)
{
    if (pthread_mutex_init(&st->stats_lock, NULL))
        return epipe_fail(EPIPE_ENOMEM, "cannot create the statistics lock");
    st->stats_lock_ok = 1;
    st->t_origin = now();
    for (unsigned k = 0; k < st->nch; k++) {
        struct chunk *c = &st->ch[k];
        struct boundary_rec *d = &c->brec[0], *u = &c->brec[1];
        d->used = c->has_down && !c->down_local;
        d->boundary = c->g, d->peer = c->down_rank, d->sends_act = 1;
        u->used = c->has_up && !c->up_local;
        u->boundary = c->g - 1, u->peer = c->up_rank, u->sends_act = 0;
    }
    clear_records(st);
    st->st.struct_size = sizeof st->st;
    epipe_stage_stats_publish(st);
    return EPIPE_OK;
}

void epipe_stage_stats_fini(epipe_stage *st)
{
    if (st->stats_lock_ok)
        pthread_mutex_destroy(&st->stats_lock);
    st->stats_lock_ok = 0;
}

/* ---- counting ------------------------------------------------------------- */

/* Adds bytes at time t (seconds since the stage's origin) to the window:
 * buckets of 100 ms, the window the last ten. The peak is the largest sum
 * of ten consecutive buckets seen at any message, per second. */
static void window_add(struct byte_count *b, double t, uint64_t bytes)
{
    int64_t id = (int64_t)(t * STATS_BUCKETS);
    int slot = (int)(id % STATS_BUCKETS);
    if (b->bucket_id[slot] != id)
        b->bucket_id[slot] = id, b->bucket[slot] = 0;
    b->bucket[slot] += bytes;
    uint64_t sum = 0;
    for (int i = 0; i < STATS_BUCKETS; i++)
        if (b->bucket_id[i] > id - STATS_BUCKETS)
            sum += b->bucket[i];
    double mbps = (double)sum / 1e6; /* bytes over one second */
    if (mbps > b->peak_mbps)
        b->peak_mbps = mbps;
}

void epipe_stage_stats_count(epipe_stage *st, struct chunk *c, int dir, int sending, uint64_t raw,
                             uint64_t wire)
{
    /* activations go down and gradients come from down; the reverse up */
    struct boundary_rec *r = &c->brec[(dir == DIR_ACT) == (sending != 0) ? 0 : 1];
    struct byte_count *b = dir == DIR_ACT ? &r->act : &r->grad;
    double t = now() - st->t_origin;
    pthread_mutex_lock(&st->stats_lock);
    b->raw += raw, b->wire += wire;
    window_add(b, t, wire);
    pthread_mutex_unlock(&st->stats_lock);
    epipe_stage_stats_publish(st); /* the totals count each message at once */
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The q-quantile (0..1) of the last steps, by the nearest rank. */
static double quantile(const double *sorted, unsigned n, double q)
{
    if (!n)
        return 0;
    unsigned i = (unsigned)(q * n + 0.999999); /* ceil(q n), at least 1 */
    if (i < 1)
        i = 1;
    return sorted[(i > n ? n : i) - 1];
}

void epipe_stage_stats_step_end(epipe_stage *st, double seconds, int with_forwards)
{
    if (!st->training) /* forward-only steps: in steps and step_seconds only */
        return;
    st->train_seconds += seconds;
    if (!with_forwards) /* a drain: no samples, and not a step's time */
        return;
    if (st->batch > 0)
        st->st.samples += (uint64_t)st->batch;
    st->step_ring[st->ring_pos] = seconds;
    st->ring_pos = (st->ring_pos + 1) % EPIPE_STAGE_STATS_STEPS;
    if (st->ring_n < EPIPE_STAGE_STATS_STEPS)
        st->ring_n++;
    double sorted[EPIPE_STAGE_STATS_STEPS];
    memcpy(sorted, st->step_ring, sizeof(double) * st->ring_n);
    qsort(sorted, st->ring_n, sizeof(double), cmp_double);
    st->st.step_p50_seconds = quantile(sorted, st->ring_n, 0.50);
    st->st.step_p99_seconds = quantile(sorted, st->ring_n, 0.99);
}

void epipe_stage_stats_publish(epipe_stage *st)
{
    epipe_stage_stats *s = &st->st;
    s->samples_per_second = st->train_seconds > 0 ? (double)s->samples / st->train_seconds : 0;
    s->bubble_fraction = s->step_seconds > 0 ? s->wait_seconds / s->step_seconds : 0;
    uint32_t n = 0;
    for (unsigned k = 0; k < st->nch; k++)
        n += (uint32_t)st->ch[k].brec[0].used + (uint32_t)st->ch[k].brec[1].used;
    s->boundaries = n;
    pthread_mutex_lock(&st->stats_lock);
    st->pub = *s;
    pthread_mutex_unlock(&st->stats_lock);
}

/* ---- the public calls ----------------------------------------------------- */

/* Copies the part of src a caller's struct of `size` bytes has. */
static int copy_sized(void *out, const void *src, size_t have, const char *call)
{
    size_t n = *(const size_t *)out;
    if (n < sizeof(size_t))
        return epipe_fail(EPIPE_EINVAL, "%s: set struct_size to the size of the struct", call);
    if (n > have)
        n = have;
    memcpy((char *)out + sizeof(size_t), (const char *)src + sizeof(size_t), n - sizeof(size_t));
    return EPIPE_OK;
}

EPIPE_API int epipe_stage_get_stats(const epipe_stage *st, epipe_stage_stats *out)
{
    epipe_clear_error();
    if (!st || !out)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_get_stats: stage or stats is NULL");
    epipe_stage *w = (epipe_stage *)st; /* the lock, not the stage, changes */
    pthread_mutex_lock(&w->stats_lock);
    epipe_stage_stats copy = st->pub;
    pthread_mutex_unlock(&w->stats_lock);
    return copy_sized(out, &copy, sizeof copy, "epipe_stage_get_stats (sizeof(epipe_stage_stats))");
}

EPIPE_API int epipe_stage_get_boundary_stats(const epipe_stage *st, uint32_t index,
                                             epipe_boundary_stats *out)
{
    epipe_clear_error();
    if (!st || !out)
        return epipe_fail(EPIPE_EINVAL, "epipe_stage_get_boundary_stats: stage or stats is NULL");
    epipe_stage *w = (epipe_stage *)st;
    epipe_boundary_stats b = {.struct_size = sizeof b};
    uint32_t n = 0;
    int found = 0;
    pthread_mutex_lock(&w->stats_lock);
    double secs = st->pub.step_seconds;
    /* pipeline order: each chunk's up boundary before its down one */
    for (unsigned k = 0; k < st->nch && !found; k++)
        for (int i = 1; i >= 0 && !found; i--) {
            const struct boundary_rec *r = &st->ch[k].brec[i];
            if (!r->used || n++ != index)
                continue;
            found = 1;
            b.boundary = r->boundary, b.peer = r->peer,
            b.sends_activations = (uint32_t)r->sends_act;
            b.act_raw = r->act.raw, b.act_wire = r->act.wire;
            b.grad_raw = r->grad.raw, b.grad_wire = r->grad.wire;
            b.act_mbps = secs > 0 ? (double)r->act.wire / 1e6 / secs : 0;
            b.grad_mbps = secs > 0 ? (double)r->grad.wire / 1e6 / secs : 0;
            b.act_peak_mbps = r->act.peak_mbps, b.grad_peak_mbps = r->grad.peak_mbps;
        }
    uint32_t count = st->pub.boundaries;
    pthread_mutex_unlock(&w->stats_lock);
    if (!found)
        return epipe_fail(EPIPE_EINVAL,
                          "epipe_stage_get_boundary_stats: boundary record %u of %u (this rank "
                          "has %u boundaries to other ranks)",
                          index, count, count);
    return copy_sized(out, &b, sizeof b,
                      "epipe_stage_get_boundary_stats (sizeof(epipe_boundary_stats))");
}

static void stage_reset_stats(epipe_stage *st)
{
    if (!st)
        return;
    memset(&st->st, 0, sizeof st->st);
    st->st.struct_size = sizeof st->st;
    st->train_seconds = 0;
    st->ring_n = st->ring_pos = 0;
    pthread_mutex_lock(&st->stats_lock);
    clear_records(st);
    pthread_mutex_unlock(&st->stats_lock);
    epipe_stage_stats_publish(st);
}

EPIPE_API void epipe_stage_reset_stats(epipe_stage *st)
{
    int nested;
    epipe_clear_error(); /* a refusal is seen in epipe_last_error() */
    if (stage_claim(st, "epipe_stage_reset_stats", &nested))
        return;
    stage_reset_stats(st);
    stage_release(st, nested, 0);
}
