/* `quant:bits=B`: global min/max uniform quantization, the research
 * baseline sortquant is measured against; fast path and scalar reference.
 * With rows=1 each row of dimension 0 (a sample) is quantized on its own
 * range: the body is then one such body per row, back to back. group=K
 * does the same for each run of K values (K dividing every row: for NCHW
 * activations K = H*W is one range per channel of each sample). */
#include <math.h>
#include <stdlib.h>

#include "../lib/bitpack.h"
#include "../lib/codec/codec_impl.h"
#include "quantize_common.h"

static const epipe_param_desc quant_params[] = {
    {.key = "bits", .kind = EPIPE_PARAM_INT, .min = 1, .max = 16, .def = 8},
    /* Encoder only (the payload is the same format): 0 is a level. */
    {.key = "zero",
     .kind = EPIPE_PARAM_CHOICE,
     .def = 0,
     .choices = epipe_param_bool,
     .quiet_default = 1},
    /* One range per row of dimension 0 (a sample): samples whose values
     * differ in scale (gradients, activation deltas) each keep their own. */
    {.key = "rows",
     .kind = EPIPE_PARAM_CHOICE,
     .def = 0,
     .choices = epipe_param_bool,
     .quiet_default = 1},
    /* One range per run of this many values (0: off): finer than a row,
     * where parts of a sample differ in scale (the channels of a conv). */
    {.key = "group",
     .kind = EPIPE_PARAM_INT,
     .min = 0,
     .max = 1 << 20,
     .def = 0,
     .quiet_default = 1},
};

typedef struct quant_state {
    epipe_qtab tab; /* one chunk */
    float *lut;
} quant_state;

static void quant_release(epipe_codec *c)
{
    quant_state *st = c->state;
    if (!st)
        return;
    epipe_qtab_free(&st->tab);
    free(st->lut);
    free(st);
    c->state = NULL;
}

static int quant_configure(epipe_codec *c)
{
    unsigned bits = (unsigned)c->p[QUANT_BITS];
    quant_state *st = calloc(1, sizeof *st);
    if (!st)
        return epipe_fail(EPIPE_ENOMEM, "quant: out of memory");
    c->state = st;
    if (epipe_qtab_init(&st->tab, bits, 0) || !(st->lut = malloc(sizeof(float) << bits)))
        return epipe_fail(EPIPE_ENOMEM, "quant: out of memory");
    st->tab.zero = (int)c->p[QUANT_ZERO];
    return EPIPE_OK;
}

/* Bit 8 of the word: rows=1; bits 9-29: group (the body differs, so a
 * decoder must agree). */
#define QUANT_WORD_ROWS 0x100u
#define QUANT_WORD_GROUP_SHIFT 9

static uint32_t quant_param_word(const epipe_codec *c)
{
    return (uint32_t)c->p[QUANT_BITS] | (c->p[QUANT_ROWS] ? QUANT_WORD_ROWS : 0) |
           (uint32_t)c->p[QUANT_GROUP] << QUANT_WORD_GROUP_SHIFT;
}

/* The body of one quantized range of n values: min, step, the codes. */
static int one_body_size(const epipe_codec *c, uint64_t n, uint64_t *bytes)
{
    if (n >= 1ull << 59)
        return EPIPE_EOVERFLOW;
    *bytes = epipe_bitpack_bytes(n, (unsigned)c->p[QUANT_BITS]) + 8;
    return EPIPE_OK;
}

/* How the n values split into ranges: one, one per row with rows=1, or one
 * per run of `group` values. */
static void ranges(const epipe_codec *c, uint64_t n, uint64_t *count, uint64_t *len)
{
    epipe_codec_ranges(c, n, c->p[QUANT_ROWS] != 0, (uint64_t)c->p[QUANT_GROUP], count, len);
}

static int quant_body_size(const epipe_codec *c, uint64_t n, size_t *bytes)
{
    uint64_t count, len, one, row;
    if (!epipe_codec_group_fits(c, n, (uint64_t)c->p[QUANT_GROUP], &row))
        return epipe_codec_fail((epipe_codec *)c, EPIPE_EINVAL, /* only its message is written */
                                "quant: group=%lld does not divide the %llu values of each row "
                                "of dimension 0 (choose a divisor, or rows=1 for one range a row)",
                                (long long)c->p[QUANT_GROUP], (unsigned long long)row);
    ranges(c, n, &count, &len);
    if (one_body_size(c, len, &one) || one > SIZE_MAX / count)
        return EPIPE_EOVERFLOW;
    *bytes = (size_t)(one * count);
    return EPIPE_OK;
}

static int quant_encode_one(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    quant_state *st = c->state;
    epipe_qtab *t = &st->tab;
    epipe_q_set_empty(t, 0);
    if (n) {
        unsigned threads = epipe_codec_workers(c, n);
        float lo, hi;
        size_t bad = epipe_q_extent(t, x, n, &lo, &hi, threads);
        if (bad < n)
            return epipe_q_reject_nonfinite(c, x, n, bad);
        epipe_q_set_chunk(t, 0, lo, hi);
        epipe_q_encode(t, x, n, body + 8, threads, NULL, NULL);
    }
    epipe_q_write_table(t, body);
    return EPIPE_OK;
}

static int quant_decode_one(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    quant_state *st = c->state;
    int rc = epipe_q_read_table(c, &st->tab, body, n);
    if (rc)
        return rc;
    epipe_q_decode(&st->tab, body + 8, n, y, st->lut, epipe_codec_workers(c, n));
    return EPIPE_OK;
}

/* The reference: a min/max loop, then one value at a time. */
static int quant_encode_one_ref(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    quant_state *st = c->state;
    epipe_qtab *t = &st->tab;
    size_t bad = epipe_find_nonfinite(x, n);
    if (bad < n)
        return epipe_q_reject_nonfinite(c, x, n, bad);
    epipe_q_set_empty(t, 0);
    if (n) {
        float lo = x[0], hi = x[0];
        for (size_t i = 1; i < n; i++) {
            if (x[i] < lo)
                lo = x[i];
            if (x[i] > hi)
                hi = x[i];
        }
        epipe_q_set_chunk(t, 0, lo, hi);
    }
    uint16_t *codes = malloc(sizeof *codes * (n + 1));
    if (!codes)
        return epipe_codec_fail(c, EPIPE_ENOMEM, "quant: out of memory");
    for (size_t i = 0; i < n; i++)
        codes[i] = epipe_q_code(t, x[i], 0);
    epipe_q_write_table(t, body);
    epipe_bitpack_ref(codes, n, t->bits, body + 8);
    free(codes);
    return EPIPE_OK;
}

static int quant_decode_one_ref(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    quant_state *st = c->state;
    int rc = epipe_q_read_table(c, &st->tab, body, n);
    if (rc)
        return rc;
    epipe_q_decode_ref(&st->tab, body + 8, n, y);
    return EPIPE_OK;
}

typedef int (*encode_fn)(epipe_codec *, const float *, size_t, uint8_t *);
typedef int (*decode_fn)(epipe_codec *, const uint8_t *, size_t, float *);

/* Each range's body in turn: one for the tensor, or one per row. */
static int encode_ranges(epipe_codec *c, encode_fn one, const float *x, size_t n, uint8_t *body)
{
    uint64_t count, len, size = 0;
    ranges(c, n, &count, &len);
    one_body_size(c, len, &size); /* checked by body_size before any call */
    for (uint64_t r = 0; r < count; r++) {
        const float *row = x + r * len;
        int rc = one(c, row, (size_t)len, body + r * size);
        size_t bad;
        if (rc == EPIPE_EINVAL && r && (bad = epipe_find_nonfinite(row, (size_t)len)) < len)
            /* name the value by its index in the tensor, not in its row */
            return epipe_q_reject_nonfinite(c, x, n, (size_t)(r * len) + bad);
        if (rc)
            return rc;
    }
    return EPIPE_OK;
}

static int decode_ranges(epipe_codec *c, decode_fn one, const uint8_t *body, size_t n, float *y)
{
    uint64_t count, len, size = 0;
    ranges(c, n, &count, &len);
    one_body_size(c, len, &size);
    for (uint64_t r = 0; r < count; r++) {
        int rc = one(c, body + r * size, (size_t)len, y + r * len);
        if (rc)
            return rc;
    }
    return EPIPE_OK;
}

static int quant_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    return encode_ranges(c, quant_encode_one, x, n, body);
}

static int quant_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    return decode_ranges(c, quant_decode_one, body, n, y);
}

static int quant_encode_ref(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    return encode_ranges(c, quant_encode_one_ref, x, n, body);
}

static int quant_decode_ref(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    return decode_ranges(c, quant_decode_one_ref, body, n, y);
}

static const epipe_codec_backend quant_cpu = {
    .encode = quant_encode,
    .decode = quant_decode,
    .encode_ref = quant_encode_ref,
    .decode_ref = quant_decode_ref,
};

const epipe_codec_ops epipe_codec_quant = {
    .name = "quant",
    .id = EPIPE_CODEC_ID_QUANT,
    .params = quant_params,
    .nparams = sizeof quant_params / sizeof quant_params[0],
    .configure = quant_configure,
    .param_word = quant_param_word,
    .body_size = quant_body_size,
    .release = quant_release,
    .cpu = &quant_cpu,
};
