/* Activation deltas (spec key delta=1): the per-sample store kept on each
 * side, its index, and the public calls that read or feed it. */
#include <stdlib.h>
#include <string.h>

#include "delta_impl.h"

#define EMPTY EPIPE_DELTA_EMPTY

int epipe_delta_oom(epipe_codec *c)
{
    return epipe_codec_fail(c, EPIPE_ENOMEM, "%s: delta: out of memory", c->ops->name);
}

epipe_delta *epipe_delta_state(epipe_codec *c)
{
    if (!c->delta_state)
        c->delta_state = calloc(1, sizeof(epipe_delta));
    return c->delta_state;
}

void epipe_delta_clear(epipe_delta *s)
{
    free(s->keys), free(s->vals), free(s->rows);
    s->keys = NULL, s->vals = NULL, s->rows = NULL;
    s->tcap = s->nrows = s->rows_cap = 0;
    s->info.stored_samples = s->info.stored_bytes = 0;
}

void epipe_codec_delta_release(epipe_codec *c, int all)
{
    epipe_delta *s = c->delta_state;
    if (!s)
        return;
    epipe_delta_clear(s);
    if (!all)
        return;
    free(s->ids), free(s->kind), free(s->base), free(s->sorted), free(s->rids), free(s->work);
    free(s);
    c->delta_state = NULL;
}

/* ---- public calls ------------------------------------------------------ */

EPIPE_EXPERIMENTAL int epipe_codec_set_samples(epipe_codec *c, const uint64_t *ids, size_t n)
{
    epipe_clear_error();
    if (!c)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_set_samples: codec is NULL");
    if (!c->delta)
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "epipe_codec_set_samples: codec '%s' has no delta=1", c->spec);
    if (n > UINT32_MAX)
        return epipe_codec_fail(c, EPIPE_EINVAL, "epipe_codec_set_samples: %zu ids; at most 2^32-1",
                                n);
    epipe_delta *s = epipe_delta_state(c);
    if (!s)
        return epipe_delta_oom(c);
    if (s->ids_cap < n) {
        uint64_t *p = realloc(s->ids, n * sizeof *p);
        if (!p)
            return epipe_delta_oom(c);
        s->ids = p, s->ids_cap = n;
    }
    if (n && ids)
        memcpy(s->ids, ids, n * sizeof *ids);
    s->nids = n;
    s->ids_set = 1;
    s->untracked = !ids;
    return EPIPE_OK;
}

EPIPE_EXPERIMENTAL int epipe_codec_decoded_samples(const epipe_codec *c, const uint64_t **ids,
                                                   size_t *n)
{
    epipe_clear_error();
    if (!c || !ids || !n)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_decoded_samples: codec, ids or n is NULL");
    const epipe_delta *s = c->delta_state;
    *ids = NULL, *n = 0;
    if (!s || !s->last_ok)
        return epipe_codec_fail((epipe_codec *)c, EPIPE_ESTATE,
                                "epipe_codec_decoded_samples: codec '%s' has not decoded a "
                                "delta payload since its last failed decode (or ever)",
                                c->spec);
    *ids = s->last_untracked ? NULL : s->rids;
    *n = s->last_rows;
    return EPIPE_OK;
}

EPIPE_EXPERIMENTAL int epipe_codec_delta_stats(const epipe_codec *c, epipe_codec_delta_info *info)
{
    epipe_clear_error();
    if (!c || !info)
        return epipe_fail(EPIPE_EINVAL, "epipe_codec_delta_stats: codec or info is NULL");
    const epipe_delta *s = c->delta_state;
    memset(info, 0, sizeof *info);
    if (s)
        *info = s->info;
    return EPIPE_OK;
}

/* ---- the store --------------------------------------------------------- */

static uint64_t hash(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return k;
}

uint32_t epipe_delta_lookup(const epipe_delta *s, uint64_t id)
{
    if (!s->tcap)
        return EMPTY;
    for (size_t h = hash(id) & (s->tcap - 1);; h = (h + 1) & (s->tcap - 1)) {
        if (s->vals[h] == EMPTY || s->keys[h] == id)
            return s->vals[h];
    }
}

/* Room for `more` rows beyond those stored (table and pool), so that the
 * commit after a successful encode or decode cannot fail. */
int epipe_delta_reserve(epipe_codec *c, epipe_delta *s, size_t more)
{
    size_t want = s->nrows + more;
    uint64_t rowbytes = (s->rowlen ? s->rowlen : 1) * sizeof(float);
    if (want > s->rows_cap) {
        size_t cap = s->rows_cap ? s->rows_cap : 16;
        while (cap < want)
            cap *= 2;
        if (cap > ((uint64_t)c->delta_mb << 20) / rowbytes)
            cap = want; /* never past the budget by doubling */
        float *p = realloc(s->rows, cap * rowbytes);
        if (!p)
            return epipe_codec_fail(c, EPIPE_ENOMEM, "%s: delta: no memory for %zu stored rows",
                                    c->ops->name, cap);
        s->rows = p, s->rows_cap = cap;
    }
    if (2 * want > s->tcap) {
        size_t cap = s->tcap ? s->tcap : 64;
        while (2 * want > cap)
            cap *= 2;
        uint64_t *k = malloc(cap * sizeof *k);
        uint32_t *v = malloc(cap * sizeof *v);
        if (!k || !v) {
            free(k), free(v);
            return epipe_delta_oom(c);
        }
        for (size_t i = 0; i < cap; i++)
            v[i] = EMPTY;
        for (size_t i = 0; i < s->tcap; i++) {
            if (s->vals[i] == EMPTY)
                continue;
            size_t h = hash(s->keys[i]) & (cap - 1);
            while (v[h] != EMPTY)
                h = (h + 1) & (cap - 1);
            k[h] = s->keys[i], v[h] = s->vals[i];
        }
        free(s->keys), free(s->vals);
        s->keys = k, s->vals = v, s->tcap = cap;
    }
    return EPIPE_OK;
}

/* Stores row (rowlen values) for id: over its old row, or as a new one
 * (room reserved). */
void epipe_delta_store(epipe_delta *s, uint64_t id, const float *row)
{
    size_t h = hash(id) & (s->tcap - 1);
    while (s->vals[h] != EMPTY && s->keys[h] != id)
        h = (h + 1) & (s->tcap - 1);
    if (s->vals[h] == EMPTY) {
        s->keys[h] = id;
        s->vals[h] = (uint32_t)s->nrows++;
        s->info.stored_samples++;
        s->info.stored_bytes += s->rowlen * sizeof(float);
    }
    memcpy(s->rows + (size_t)s->vals[h] * s->rowlen, row, s->rowlen * sizeof(float));
}

/* Empties the store when its rows are of another dtype or row shape than
 * the current call's (c->shape), and takes the current ones. */
void epipe_delta_match_shape(epipe_delta *s, const epipe_codec *c, enum epipe_dtype dt)
{
    int same = s->dt == dt && s->ndim == c->ndim;
    for (int d = 1; same && d < c->ndim; d++)
        same = s->shape[d] == c->shape[d];
    if (same && s->nrows)
        return;
    epipe_delta_clear(s);
    s->dt = dt, s->ndim = c->ndim;
    memcpy(s->shape, c->shape, sizeof(int64_t) * (size_t)c->ndim);
    s->rowlen = 1;
    for (int d = 1; d < c->ndim; d++)
        s->rowlen *= (uint64_t)c->shape[d];
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* The first id that occurs twice in ids[0..r), via s->sorted; 0 if none. */
int epipe_delta_find_duplicate(epipe_delta *s, const uint64_t *ids, size_t r, uint64_t *dup)
{
    if (r < 2)
        return 0;
    memcpy(s->sorted, ids, r * sizeof *ids);
    qsort(s->sorted, r, sizeof *s->sorted, cmp_u64);
    for (size_t i = 1; i < r; i++)
        if (s->sorted[i] == s->sorted[i - 1]) {
            *dup = s->sorted[i];
            return 1;
        }
    return 0;
}

/* Per-call buffers: r rows, and 2 * n work values. */
int epipe_delta_per_call(epipe_codec *c, epipe_delta *s, size_t r, uint64_t n)
{
    if (s->rcap < r) {
        uint8_t *k = realloc(s->kind, r);
        if (k)
            s->kind = k;
        uint32_t *b = realloc(s->base, r * sizeof *b);
        if (b)
            s->base = b;
        uint64_t *q = realloc(s->sorted, r * sizeof *q);
        if (q)
            s->sorted = q;
        uint64_t *d = realloc(s->rids, r * sizeof *d);
        if (d)
            s->rids = d;
        if (!k || !b || !q || !d)
            return epipe_delta_oom(c);
        s->rcap = r;
    }
    if (n > SIZE_MAX / 2 / sizeof(float))
        return epipe_delta_oom(c);
    if (s->work_cap < 2 * n) {
        float *w = realloc(s->work, 2 * n * sizeof *w);
        if (!w)
            return epipe_codec_fail(c, EPIPE_ENOMEM, "%s: delta: no memory for %llu values",
                                    c->ops->name, (unsigned long long)(2 * n));
        s->work = w, s->work_cap = 2 * n;
    }
    return EPIPE_OK;
}

const float *epipe_codec_delta_row(const epipe_codec *c, uint64_t id)
{
    const epipe_delta *s = c->delta_state;
    uint32_t b = s ? epipe_delta_lookup(s, id) : EMPTY;
    return b == EMPTY ? NULL : s->rows + (size_t)b * s->rowlen;
}
