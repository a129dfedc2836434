/* Activation-delta compression (the core-level spec key delta=1, AQ-SGD):
 * per sample id, the last reconstructed activation row, on both sides. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../tensor.h"
#include "delta_impl.h"
#include "payload.h"

/* Wrapper body (docs/codecs.md, "Activation deltas"): the fixed part. */
#define DW_MAGIC 0x44 /* 'D' */
#define DW_VERSION 1
#define DW_FIXED 12
#define DW_RAW_FIRST 0x01 /* byte 3: kept full rows travel as raw fp32 (delta_raw=1) */

#define EMPTY EPIPE_DELTA_EMPTY

/* ---- sizes ------------------------------------------------------------- */

/* The inner codec's body for k rows of the current shape (0 for none). */
static int inner_size(epipe_codec *c, uint64_t k, uint64_t rowlen, size_t *bytes)
{
    *bytes = 0;
    if (!k)
        return EPIPE_OK;
    int64_t rows = c->shape[0];
    c->shape[0] = (int64_t)k;
    int rc = c->ops->body_size(c, k * rowlen, bytes);
    c->shape[0] = rows;
    if (rc == EPIPE_EOVERFLOW)
        return epipe_codec_fail(c, rc, "%s: payload for %llu values overflows size_t", c->ops->name,
                                (unsigned long long)(k * rowlen));
    return rc;
}

static uint64_t row_len(const epipe_codec *c)
{
    uint64_t len = 1;
    for (int d = 1; d < c->ndim; d++)
        len *= (uint64_t)c->shape[d];
    return len;
}

static int check_shape(epipe_codec *c)
{
    if (c->ndim < 1)
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "%s: delta=1 needs a tensor whose dimension 0 is the samples; "
                                "this one has 0 dimensions",
                                c->ops->name);
    if ((uint64_t)c->shape[0] > UINT32_MAX)
        return epipe_codec_fail(c, EPIPE_EINVAL, "%s: delta=1: %lld rows; at most 2^32-1",
                                c->ops->name, (long long)c->shape[0]);
    return EPIPE_OK;
}

/* Wrapper bytes before the inner bodies, for r rows with ids of idw bytes. */
static size_t wrapper_size(uint64_t r, unsigned idw)
{
    return DW_FIXED + (size_t)r * idw + (size_t)(r + 3) / 4;
}

int epipe_codec_delta_max_size(epipe_codec *c, uint64_t n, size_t *bytes)
{
    (void)n;
    int rc = check_shape(c);
    if (rc)
        return rc;
    /* The last shape's answer: the loop below calls body_size per split. */
    epipe_delta *s = epipe_delta_state(c);
    if (s && s->mndim == c->ndim &&
        memcmp(s->mshape, c->shape, sizeof(int64_t) * (size_t)c->ndim) == 0) {
        *bytes = s->mbytes;
        return EPIPE_OK;
    }
    uint64_t r = (uint64_t)c->shape[0], rowlen = row_len(c);
    size_t most = 0;
    for (uint64_t k = 0; k <= r / 2; k++) { /* k full rows or k delta rows */
        size_t a, b;
        if ((rc = inner_size(c, k, rowlen, &a)) || (rc = inner_size(c, r - k, rowlen, &b)))
            return rc;
        if (a > SIZE_MAX / 2 || b > SIZE_MAX / 2)
            return epipe_codec_fail(c, EPIPE_EOVERFLOW, "%s: payload overflows size_t",
                                    c->ops->name);
        if (a + b > most)
            most = a + b;
    }
    if (c->delta_raw) {               /* every row raw as well: a bound, not the size */
        uint64_t values = r * rowlen; /* the tensor's count */
        if (values > (SIZE_MAX - most) / 4)
            return epipe_codec_fail(c, EPIPE_EOVERFLOW, "%s: payload overflows size_t",
                                    c->ops->name);
        most += (size_t)values * 4;
    }
    size_t w = wrapper_size(r, 8);
    if (most > SIZE_MAX - w - EPIPE_PAYLOAD_HEADER)
        return epipe_codec_fail(c, EPIPE_EOVERFLOW, "%s: payload overflows size_t", c->ops->name);
    *bytes = EPIPE_PAYLOAD_HEADER + w + most;
    if (s) {
        s->mndim = c->ndim, s->mbytes = *bytes;
        memcpy(s->mshape, c->shape, sizeof(int64_t) * (size_t)c->ndim);
    }
    return EPIPE_OK;
}

/* ---- inner encode and decode ------------------------------------------- */

/* Runs the inner codec's encode (dir 0) or decode (dir 1) on k rows, with
 * no micro-batch state (poweriter's warm start would see two shapes). */
static int inner(epipe_codec *c, const epipe_codec_backend *be, int dir, uint64_t k,
                 uint64_t rowlen, float *vals, uint8_t *body)
{
    if (!k)
        return EPIPE_OK;
    int64_t rows = c->shape[0], mb = c->microbatch;
    c->shape[0] = (int64_t)k;
    c->microbatch = -1;
    int rc;
    if (dir == 0)
        rc = (c->use_reference ? be->encode_ref : be->encode)(c, vals, k * rowlen, body);
    else
        rc = (c->use_reference ? be->decode_ref : be->decode)(c, body, k * rowlen, vals);
    c->shape[0] = rows;
    c->microbatch = mb;
    return rc;
}

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, unsigned w)
{
    uint64_t v = 0;
    for (unsigned i = 0; i < w; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* Where each row goes in the work arrays: with raw first sightings, the
 * kept full rows (raw on the wire), then the other full rows (coded), then
 * the deltas; otherwise all full rows, then the deltas; each in row order. */
typedef struct {
    size_t keep, full, delta;
    int raw;
} row_slots;

static size_t count_kept(const uint8_t *kind, size_t r)
{
    size_t k = 0;
    for (size_t i = 0; i < r; i++)
        k += kind[i] == EPIPE_DELTA_KEEP;
    return k;
}

static void slots_init(row_slots *q, size_t nraw, size_t nfull, int raw)
{
    q->keep = 0, q->full = raw ? nraw : 0, q->delta = nfull, q->raw = raw;
}

static size_t slot_next(row_slots *q, unsigned kind)
{
    if (kind == EPIPE_DELTA_ROW)
        return q->delta++;
    if (kind == EPIPE_DELTA_KEEP && q->raw)
        return q->keep++;
    return q->full++;
}

/* ---- encode ------------------------------------------------------------ */

/* Each row's kind and base; *nfull full rows, *nnew of them to keep. */
static int plan_rows(epipe_codec *c, epipe_delta *s, size_t r, size_t *nfull, size_t *nnew)
{
    uint64_t budget = (uint64_t)c->delta_mb << 20, rowbytes = s->rowlen * sizeof(float);
    uint64_t kept = s->nrows * rowbytes;
    *nfull = *nnew = 0;
    for (size_t i = 0; i < r; i++) {
        if (s->untracked) { /* full, and kept by neither side */
            s->base[i] = EMPTY, s->kind[i] = EPIPE_DELTA_FULL;
            ++*nfull;
            continue;
        }
        uint32_t b = epipe_delta_lookup(s, s->ids[i]);
        s->base[i] = b;
        if (b != EMPTY) {
            s->kind[i] = EPIPE_DELTA_ROW;
            continue;
        }
        ++*nfull;
        if (kept + rowbytes <= budget && s->nrows + *nnew < EMPTY - 1) {
            s->kind[i] = EPIPE_DELTA_KEEP;
            kept += rowbytes;
            ++*nnew;
        } else if (c->delta_strict) {
            return epipe_codec_fail(c, EPIPE_ENOMEM,
                                    "%s: delta: keeping sample id %llu would take the stored "
                                    "rows past delta_mb=%u MiB (%llu bytes a row); raise "
                                    "delta_mb, or drop delta_strict=1 to send such samples in "
                                    "full",
                                    c->ops->name, (unsigned long long)s->ids[i], c->delta_mb,
                                    (unsigned long long)rowbytes);
        } else {
            s->kind[i] = EPIPE_DELTA_FULL;
        }
    }
    return EPIPE_OK;
}

/* Writes the wrapper, the raw rows and both inner bodies for the planned
 * rows, and the reconstruction the decoder will make into work[n, 2n) (in
 * the order of row_slots). */
static int encode_rows(epipe_codec *c, const epipe_codec_backend *be, epipe_delta *s,
                       const float *x, size_t r, size_t nfull, int raw, uint8_t *body, size_t *blen)
{
    const uint64_t *ids = s->ids;
    uint64_t rl = s->rowlen, n = r * rl;
    size_t nraw = raw ? count_kept(s->kind, r) : 0;
    float *w = s->work, *y = s->work + n;
    row_slots q;
    slots_init(&q, nraw, nfull, raw);
    for (size_t i = 0; i < r; i++) {
        const float *xi = x + i * rl;
        float *d = w + slot_next(&q, s->kind[i]) * rl;
        if (s->kind[i] != EPIPE_DELTA_ROW) {
            memcpy(d, xi, rl * sizeof *xi);
            continue;
        }
        const float *p = s->rows + (size_t)s->base[i] * rl;
        for (uint64_t v = 0; v < rl; v++)
            d[v] = xi[v] - p[v];
        size_t bad = epipe_find_nonfinite(d, rl);
        if (bad < rl)
            return epipe_codec_fail(c, EPIPE_EINVAL,
                                    "%s: delta: row %zu (sample id %llu) value %zu: %g less its "
                                    "stored %g overflows fp32",
                                    c->ops->name, i, (unsigned long long)ids[i], bad,
                                    (double)xi[bad], (double)p[bad]);
    }
    unsigned idw = s->untracked ? 0 : 4;
    for (size_t i = 0; idw && i < r; i++)
        if (ids[i] > UINT32_MAX)
            idw = 8;
    size_t a, b, wsz = wrapper_size(r, idw), rawb = nraw * rl * 4;
    int rc;
    if ((rc = inner_size(c, nfull - nraw, rl, &a)) || (rc = inner_size(c, r - nfull, rl, &b)))
        return rc;
    body[0] = DW_MAGIC, body[1] = DW_VERSION, body[2] = (uint8_t)idw;
    body[3] = raw ? DW_RAW_FIRST : 0;
    put32(body + 4, (uint32_t)r);
    put32(body + 8, (uint32_t)nfull);
    uint8_t *p = body + DW_FIXED;
    for (size_t i = 0; i < r; i++, p += idw)
        for (unsigned k = 0; k < idw; k++)
            p[k] = (uint8_t)(ids[i] >> (8 * k));
    memset(p, 0, (r + 3) / 4);
    for (size_t i = 0; i < r; i++)
        p[i / 4] |= (uint8_t)(s->kind[i] << (2 * (i % 4)));
    uint8_t *br = body + wsz, *bf = br + rawb, *bd = bf + a;
    for (size_t v = 0; v < nraw * rl; v++)
        epipe_put_f32(br + 4 * v, w[v]);
    memcpy(y, w, nraw * rl * sizeof *y); /* the decoder reads them exactly */
    if ((rc = inner(c, be, 0, nfull - nraw, rl, w + nraw * rl, bf)) ||
        (rc = inner(c, be, 0, r - nfull, rl, w + nfull * rl, bd)))
        return rc;
    /* What the decoder will see: decode what was just written. */
    if ((rc = inner(c, be, 1, nfull - nraw, rl, y + nraw * rl, bf)) ||
        (rc = inner(c, be, 1, r - nfull, rl, y + nfull * rl, bd)))
        return rc;
    *blen = wsz + rawb + a + b;
    return EPIPE_OK;
}

/* Adds each delta row's base to its decoded delta in y (full rows first,
 * then delta rows). */
static void add_bases(epipe_delta *s, size_t r, size_t nfull, float *y)
{
    uint64_t rl = s->rowlen;
    for (size_t i = 0, jd = nfull; i < r; i++) {
        if (s->kind[i] != EPIPE_DELTA_ROW)
            continue;
        float *row = y + jd++ * rl;
        const float *q = s->rows + (size_t)s->base[i] * rl;
        for (uint64_t v = 0; v < rl; v++)
            row[v] += q[v];
    }
}

/* Keeps every reconstructed row of y whose kind says so (the room for new
 * rows was reserved), and writes the rows in row order into out when it
 * is not NULL. */
static void keep(epipe_delta *s, const uint64_t *ids, size_t r, size_t nfull, int raw,
                 const float *y, float *out, int untracked)
{
    uint64_t rl = s->rowlen;
    row_slots q;
    slots_init(&q, raw ? count_kept(s->kind, r) : 0, nfull, raw);
    for (size_t i = 0; i < r; i++) {
        const float *row = y + slot_next(&q, s->kind[i]) * rl;
        if (out)
            memcpy(out + i * rl, row, rl * sizeof *row);
        if (s->kind[i] == EPIPE_DELTA_FULL) {
            if (untracked)
                s->info.untracked_rows++;
            else
                s->info.fallback_rows++;
            continue;
        }
        epipe_delta_store(s, ids[i], row);
        if (s->kind[i] == EPIPE_DELTA_ROW)
            s->info.delta_rows++;
        else
            s->info.full_rows++;
    }
}

int epipe_codec_delta_encode(epipe_codec *c, const epipe_codec_backend *be, const float *x,
                             uint64_t n, enum epipe_dtype dt, uint8_t *payload, size_t *written)
{
    const char *name = c->ops->name;
    if (be != c->ops->cpu)
        return epipe_codec_fail(c, EPIPE_ENOTSUP, "%s: delta=1 runs on the CPU backend only", name);
    epipe_delta *s = epipe_delta_state(c);
    if (!s)
        return epipe_delta_oom(c);
    int rc = check_shape(c);
    if (rc)
        return rc;
    size_t r = (size_t)c->shape[0];
    if (!s->ids_set)
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "%s: delta=1 needs the sample ids of the tensor's %zu rows: call "
                                "epipe_codec_set_samples() before every encode",
                                name, r);
    s->ids_set = 0; /* the ids are for this encode only */
    if (s->nids != r)
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "%s: delta=1: %zu sample ids were set for a tensor of %zu rows "
                                "(its dimension 0)",
                                name, s->nids, r);
    size_t bad = epipe_find_nonfinite(x, n);
    if (bad < n)
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "%s: input value at index %zu is %s; delta=1 needs finite values",
                                name, bad,
                                isnan(x[bad]) ? "NaN"
                                : x[bad] > 0  ? "+inf"
                                              : "-inf");
    if ((rc = epipe_delta_per_call(c, s, r, n)))
        return rc;
    uint64_t dup;
    if (!s->untracked && epipe_delta_find_duplicate(s, s->ids, r, &dup))
        return epipe_codec_fail(c, EPIPE_EINVAL,
                                "%s: delta=1: sample id %llu occurs twice in one tensor", name,
                                (unsigned long long)dup);
    epipe_delta_match_shape(s, c, dt);
    size_t nfull, nnew, blen = 0;
    int raw = c->delta_raw && !s->untracked;
    if ((rc = plan_rows(c, s, r, &nfull, &nnew)) || (rc = epipe_delta_reserve(c, s, nnew)) ||
        (rc = encode_rows(c, be, s, x, r, nfull, raw, payload + EPIPE_PAYLOAD_HEADER, &blen)))
        return rc;
    add_bases(s, r, nfull, s->work + n);
    keep(s, s->ids, r, nfull, raw, s->work + n, NULL, s->untracked);
    *written = EPIPE_PAYLOAD_HEADER + blen;
    return EPIPE_OK;
}

/* ---- decode ------------------------------------------------------------ */

/* Row i's kind in the wrapper's 2-bit kind array (unchecked: 0..3). */
static unsigned wire_kind(const uint8_t *kinds, size_t i)
{
    return (kinds[i / 4] >> (2 * (i % 4))) & 3u;
}

static int proto(epipe_codec *c, const char *fmt, const char *what, unsigned long long a,
                 unsigned long long b)
{
    char m[200];
    snprintf(m, sizeof m, fmt, what, a, b);
    return epipe_codec_fail(c, EPIPE_EPROTO, "%s: delta payload: %s", c->ops->name, m);
}

/* Reads and checks the wrapper's rows: ids into s->ids, kinds and bases;
 * returns the count of new rows to keep in *nnew. */
static int read_rows(epipe_codec *c, epipe_delta *s, const uint8_t *p, size_t r, unsigned idw,
                     size_t nfull, size_t *nnew)
{
    const uint8_t *kinds = p + r * idw;
    size_t full = 0;
    *nnew = 0;
    for (size_t i = 0; i < r; i++) {
        s->rids[i] = idw ? get_le(p + i * idw, idw) : 0;
        unsigned k = wire_kind(kinds, i);
        if (k > EPIPE_DELTA_ROW)
            return proto(c, "%s %llu has kind %llu (0..2)", "row", i, k);
        if (!idw && k != EPIPE_DELTA_FULL)
            return proto(c, "%s %llu of a payload without ids has kind %llu, not 0", "row", i, k);
        s->kind[i] = (uint8_t)k;
        full += k != EPIPE_DELTA_ROW;
    }
    if ((r % 4) && (kinds[r / 4] >> (2 * (r % 4))))
        return proto(c, "%s bits after row %llu are 0x%llx, not 0", "padding", r - 1,
                     (unsigned)kinds[r / 4] >> (2 * (r % 4)));
    if (full != nfull)
        return proto(c, "%s says %llu full rows; its row kinds say %llu", "header", nfull, full);
    if (!idw)
        return EPIPE_OK; /* untracked rows: nothing to look up or keep */
    uint64_t dup;
    if (epipe_delta_find_duplicate(s, s->rids, r, &dup))
        return proto(c, "%s %llu occurs twice%.0llu", "sample id", dup, 0);
    for (size_t i = 0; i < r; i++) {
        uint32_t b = epipe_delta_lookup(s, s->rids[i]);
        s->base[i] = b;
        if (s->kind[i] == EPIPE_DELTA_ROW && b == EMPTY)
            return epipe_codec_fail(c, EPIPE_EPROTO,
                                    "%s: delta payload: row %zu is a delta for sample id %llu, "
                                    "for which this decoder holds no stored row (were both "
                                    "sides reset together, and is this the encoder's stream?)",
                                    c->ops->name, i, (unsigned long long)s->rids[i]);
        if (s->kind[i] == EPIPE_DELTA_FULL && b != EMPTY)
            return epipe_codec_fail(c, EPIPE_EPROTO,
                                    "%s: delta payload: row %zu sends sample id %llu in full "
                                    "without keeping it, but this decoder holds a stored row for "
                                    "it: the two sides' stores differ",
                                    c->ops->name, i, (unsigned long long)s->rids[i]);
        *nnew += s->kind[i] == EPIPE_DELTA_KEEP && b == EMPTY;
    }
    uint64_t rowbytes = s->rowlen * sizeof(float);
    if ((s->nrows + *nnew) * rowbytes > (uint64_t)c->delta_mb << 20 ||
        s->nrows + *nnew >= EMPTY - 1)
        return epipe_codec_fail(c, EPIPE_EPROTO,
                                "%s: delta payload: keeping its %zu new samples would take this "
                                "decoder's stored rows past delta_mb=%u MiB: both sides need "
                                "the same delta_mb, and resets on both sides together",
                                c->ops->name, *nnew, c->delta_mb);
    return EPIPE_OK;
}

int epipe_codec_delta_decode(epipe_codec *c, const epipe_codec_backend *be, const void *src,
                             size_t len, DLTensor *dst, uint64_t n, enum epipe_dtype dt)
{
    const char *name = c->ops->name;
    if (be != c->ops->cpu)
        return epipe_codec_fail(c, EPIPE_ENOTSUP, "%s: delta=1 runs on the CPU backend only", name);
    epipe_delta *s = epipe_delta_state(c);
    if (!s)
        return epipe_delta_oom(c);
    s->last_ok = 0;
    int rc = check_shape(c);
    if (rc)
        return rc;
    const uint8_t *p = (const uint8_t *)src + EPIPE_PAYLOAD_HEADER;
    size_t blen = len - EPIPE_PAYLOAD_HEADER, r = (size_t)c->shape[0];
    if (blen < DW_FIXED)
        return epipe_codec_fail(c, EPIPE_ETRUNC,
                                "%s: delta payload: body is %zu bytes; its header alone is %d",
                                name, blen, DW_FIXED);
    if (p[0] != DW_MAGIC)
        return proto(c, "%s byte is 0x%02llx, not 0x%02llx (was it made with delta=1?)", "first",
                     p[0], DW_MAGIC);
    if (p[1] != DW_VERSION)
        return epipe_codec_fail(c, EPIPE_EVERSION,
                                "%s: delta payload version %u; this library reads %d", name, p[1],
                                DW_VERSION);
    if ((p[2] != 0 && p[2] != 4 && p[2] != 8) || (p[3] & ~DW_RAW_FIRST))
        return proto(c, "%s width %llu (0, 4 or 8) or flags 0x%02llx (0 or 1)", "id", p[2], p[3]);
    uint64_t rows = get_le(p + 4, 4), nfull = get_le(p + 8, 4);
    if (rows != r)
        return proto(c, "%s says %llu rows; dst has %llu (its dimension 0)", "header", rows, r);
    if (nfull > r)
        return proto(c, "%s says %llu full rows of %llu", "header", nfull, r);
    unsigned idw = p[2];
    int raw = p[3] & DW_RAW_FIRST;
    size_t a, b, wsz = wrapper_size(r, idw);
    if (blen < wsz)
        return epipe_codec_fail(c, EPIPE_ETRUNC,
                                "%s: delta payload: body is %zu bytes; its row table needs %zu",
                                name, blen, wsz);
    /* the kept full rows' count, for the sizes (read_rows checks the kinds) */
    size_t nraw = 0;
    for (size_t i = 0; raw && i < r; i++)
        nraw += wire_kind(p + DW_FIXED + r * idw, i) == EPIPE_DELTA_KEEP;
    if (nraw > nfull)
        return proto(c, "%s says %llu full rows; its row kinds say at least %llu", "header", nfull,
                     nraw);
    epipe_delta_match_shape(s, c, dt);
    if ((rc = inner_size(c, nfull - nraw, s->rowlen, &a)) ||
        (rc = inner_size(c, r - nfull, s->rowlen, &b)))
        return rc;
    size_t rawb = nraw * s->rowlen * 4;
    size_t need = wsz + rawb + a + b; /* cannot overflow: max_size bounded it */
    if (blen < need)
        return epipe_codec_fail(c, EPIPE_ETRUNC,
                                "%s: delta payload: body is %zu bytes; its rows need %zu", name,
                                blen, need);
    if (blen > need)
        return epipe_codec_fail(c, EPIPE_EPROTO, "%s: delta payload has %zu bytes after its end",
                                name, blen - need);
    size_t nnew;
    if ((rc = epipe_delta_per_call(c, s, r, n)) ||
        (rc = read_rows(c, s, p + DW_FIXED, r, idw, nfull, &nnew)) ||
        (rc = epipe_delta_reserve(c, s, nnew)))
        return rc;
    float *y = s->work + n, *out;
    const uint8_t *br = p + wsz, *bf = br + rawb, *bd = bf + a;
    for (size_t v = 0; v < nraw * s->rowlen; v++)
        y[v] = epipe_get_f32(br + 4 * v);
    if ((rc = inner(c, be, 1, nfull - nraw, s->rowlen, y + nraw * s->rowlen, (uint8_t *)bf)) ||
        (rc = inner(c, be, 1, r - nfull, s->rowlen, y + nfull * s->rowlen, (uint8_t *)bd)))
        return rc;
    add_bases(s, r, nfull, y);
    size_t bad = epipe_find_nonfinite(y, n);
    if (bad < n)
        return proto(c, "%s %llu of %llu is not finite once decoded", "value", bad, n);
    if ((rc = epipe_codec_stage_out(c, dst, n, dt, &out)))
        return rc;
    keep(s, s->rids, r, nfull, raw, y, out, idw == 0);
    s->last_ok = 1, s->last_rows = r, s->last_untracked = idw == 0;
    epipe_codec_stage_out_done(dst, out, n);
    return EPIPE_OK;
}
