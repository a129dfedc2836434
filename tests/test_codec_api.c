/* The codec API contract, codec by codec where it is generic: spec parsing
 * and its errors, the canonical spec, the payload header checks, dtypes,
 * strides, degenerate tensors and buffer planning. */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <epipe/epipe.h>

#include "tensor.h"
#include "testutil.h"

/* Every registered codec in a typical configuration; each must round-trip
 * within its own bound (checked per codec in its own test file). */
static const char *const all_specs[] = {
    "none",
    "cast:dtype=fp16",
    "cast:dtype=bf16",
    "kmeans:bits=4",
    "topk:ratio=1",
    "quant:bits=8",
    "quant:bits=1",
    "sortquant:bits=8",
    "sortquant:bits=8,mode=sample",
    "sortquant:bits=8,mode=exact",
    "sortquant:bits=16",
    "sortquant:bits=5,split=0",
};
#define NSPECS (sizeof all_specs / sizeof all_specs[0])

static void version_matches_header(void **state)
{
    (void)state;
    assert_int_equal(epipe_version(), EPIPE_VERSION_NUMBER);
    assert_string_equal(epipe_version_string(), "0.1.0");
}

static void status_strings(void **state)
{
    (void)state;
    assert_string_equal(epipe_strerror(EPIPE_OK), "success");
    assert_string_equal(epipe_status_name(EPIPE_EINVAL), "EPIPE_EINVAL");
    assert_string_equal(epipe_strerror(12345), "unknown status");
    for (int s = 0; s >= EPIPE_ECALLBACK; s--)
        assert_string_not_equal(epipe_strerror(s), "unknown status");
}

/* The message must mention `needle`, so a user can see what was wrong. */
static void expect_spec_error(const char *spec, const char *needle)
{
    epipe_codec *c = (epipe_codec *)1;
    int rc = epipe_codec_create(&c, spec);
    if (rc != EPIPE_EINVAL || c != NULL || !strstr(epipe_last_error(), needle))
        fail_msg("spec '%s': rc %d, message '%s', expected EINVAL mentioning '%s'", spec, rc,
                 epipe_last_error(), needle);
}

static void bad_specs_are_named(void **state)
{
    (void)state;
    expect_spec_error("", "empty");
    expect_spec_error("zstd", "unknown codec 'zstd'");
    expect_spec_error("none:", "nothing after");
    expect_spec_error("cast:dtype=fp8", "'fp8' is not one of fp16|bf16");
    expect_spec_error("cast:width=3", "unknown key 'width'");
    expect_spec_error("cast:dtype", "has no '=value'");
    expect_spec_error("cast:dtype=", "empty value");
    expect_spec_error("cast:dtype=fp16,", "empty parameter");
    expect_spec_error("cast:dtype=fp16,dtype=bf16", "given twice");
    expect_spec_error("none:dtype=fp16", "unknown key 'dtype'");
    char longspec[400];
    memset(longspec, 'a', sizeof longspec - 1);
    longspec[sizeof longspec - 1] = '\0';
    expect_spec_error(longspec, "limit");
    assert_int_equal(epipe_codec_create(NULL, "none"), EPIPE_EINVAL);
    epipe_codec *c;
    assert_int_equal(epipe_codec_create(&c, NULL), EPIPE_EINVAL);
}

static void canonical_spec_round_trips(void **state)
{
    (void)state;
    epipe_codec *c, *d;
    assert_int_equal(epipe_codec_create(&c, "cast"), EPIPE_OK);
    assert_string_equal(epipe_codec_spec(c), "cast:dtype=fp16");
    assert_string_equal(epipe_codec_name(c), "cast");
    epipe_codec_destroy(c);
    for (size_t i = 0; i < NSPECS; i++) {
        assert_int_equal(epipe_codec_create(&c, all_specs[i]), EPIPE_OK);
        assert_int_equal(epipe_codec_create(&d, epipe_codec_spec(c)), EPIPE_OK);
        assert_string_equal(epipe_codec_spec(c), epipe_codec_spec(d));
        assert_int_equal(epipe_codec_id(c), epipe_codec_id(d));
        epipe_codec_destroy(c);
        epipe_codec_destroy(d);
    }
    epipe_codec_destroy(NULL);
}

static void none_is_exact_and_cast_rounds(void **state)
{
    (void)state;
    float x[5] = {1.0f, -2.5f, 3.14159265f, 65504.0f, 1e-8f}, y[5];
    int64_t sx, sy;
    DLTensor tx = test_view_f32(x, &sx, 5), ty = test_view_f32(y, &sy, 5);
    uint8_t buf[64];
    size_t cap, n;
    epipe_codec *c;
    assert_int_equal(epipe_codec_create(&c, "none"), EPIPE_OK);
    assert_int_equal(epipe_codec_max_encoded_size(c, &tx, &cap), EPIPE_OK);
    assert_int_equal(cap, 16 + 20);
    assert_int_equal(epipe_codec_encode(c, &tx, buf, sizeof buf, &n), EPIPE_OK);
    assert_int_equal(n, cap);
    assert_int_equal(epipe_codec_decode(c, buf, n, &ty), EPIPE_OK);
    assert_memory_equal(x, y, sizeof x);
    epipe_codec_destroy(c);

    assert_int_equal(epipe_codec_create(&c, "cast:dtype=bf16"), EPIPE_OK);
    assert_int_equal(epipe_codec_encode(c, &tx, buf, sizeof buf, &n), EPIPE_OK);
    assert_int_equal(n, 16 + 10);
    assert_int_equal(epipe_codec_decode(c, buf, n, &ty), EPIPE_OK);
    for (int i = 0; i < 5; i++)
        assert_true(fabsf(y[i] - x[i]) <= fabsf(x[i]) * (1.0f / 256));
    epipe_codec_destroy(c);

    assert_int_equal(epipe_codec_create(&c, "cast:dtype=fp16"), EPIPE_OK);
    assert_int_equal(epipe_codec_encode(c, &tx, buf, sizeof buf, &n), EPIPE_OK);
    assert_int_equal(epipe_codec_decode(c, buf, n, &ty), EPIPE_OK);
    assert_true(y[3] == 65504.0f); /* the largest fp16 survives */
    assert_true(fabsf(y[2] - x[2]) <= 2e-3f);
    assert_true(y[4] >= 0.0f && y[4] < 1e-7f); /* flushes to a subnormal or zero */
    epipe_codec_destroy(c);
}

static void f16_and_bf16_conversion_edges(void **state)
{
    (void)state;
    assert_true(epipe_f16_to_f32(epipe_f32_to_f16(1.0f)) == 1.0f);
    assert_true(isinf(epipe_f16_to_f32(epipe_f32_to_f16(70000.0f))));
    assert_true(isnan(epipe_f16_to_f32(epipe_f32_to_f16(NAN))));
    assert_true(epipe_f16_to_f32(epipe_f32_to_f16(5.9604645e-8f)) == 5.9604645e-8f);
    /* round to nearest even at the halfway point 1 + 2^-11 */
    assert_true(epipe_f16_to_f32(epipe_f32_to_f16(1.0f + 0.00048828125f)) == 1.0f);
    assert_true(isnan(epipe_bf16_to_f32(epipe_f32_to_bf16(NAN))));
    assert_true(epipe_bf16_to_f32(epipe_f32_to_bf16(-3.0f)) == -3.0f);
    /* every fp16 value converts to fp32 and back unchanged */
    for (uint32_t h = 0; h < 65536; h++) {
        if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu))
            continue; /* NaN payloads may be quietened */
        assert_int_equal(epipe_f32_to_f16(epipe_f16_to_f32((uint16_t)h)), h);
    }
}

/* A strided fp16 source and a strided bf16 destination give the same
 * values as the dense fp32 path. */
static void strided_and_half_tensors(void **state)
{
    (void)state;
    enum { R = 3, C = 4 };
    uint16_t src16[R * C * 2];
    float dense[R * C];
    for (int i = 0; i < R * C; i++)
        dense[i] = (float)(i - 5) * 0.25f;
    /* src viewed as the transpose of a [C, R] buffer: shape [R, C], strides [1, R] */
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            src16[c * R + r] = epipe_f32_to_f16(dense[r * C + c]);
    int64_t shape[2] = {R, C}, strides[2] = {1, R};
    DLTensor src = {.data = src16,
                    .device = {kDLCPU, 0},
                    .ndim = 2,
                    .dtype = {kDLFloat, 16, 1},
                    .shape = shape,
                    .strides = strides};
    uint16_t out16[R * C * 2];
    int64_t ostrides[2] = {2 * C, 2}; /* every other element of a [R, 2C] buffer */
    memset(out16, 0, sizeof out16);
    DLTensor dst = {.data = out16,
                    .device = {kDLCPU, 0},
                    .ndim = 2,
                    .dtype = {kDLBfloat, 16, 1},
                    .shape = shape,
                    .strides = ostrides};
    epipe_codec *c;
    uint8_t buf[256];
    size_t n;
    assert_int_equal(epipe_codec_create(&c, "none"), EPIPE_OK);
    assert_int_equal(epipe_codec_encode(c, &src, buf, sizeof buf, &n), EPIPE_OK);
    assert_int_equal(buf[2], 1); /* source dtype fp16 recorded */
    assert_int_equal(epipe_codec_decode(c, buf, n, &dst), EPIPE_OK);
    for (int r = 0; r < R; r++)
        for (int col = 0; col < C; col++) {
            assert_true(epipe_bf16_to_f32(out16[r * 2 * C + 2 * col]) == dense[r * C + col]);
            assert_int_equal(out16[r * 2 * C + 2 * col + 1], 0); /* gaps untouched */
        }
    epipe_codec_destroy(c);
}

static void degenerate_tensors(void **state)
{
    (void)state;
    for (size_t s = 0; s < NSPECS; s++) {
        epipe_codec *c;
        assert_int_equal(epipe_codec_create(&c, all_specs[s]), EPIPE_OK);
        static uint8_t buf[1 << 16]; /* room for the largest per-chunk tables */
        size_t n;
        /* empty tensor */
        int64_t zero = 0;
        DLTensor e = {.data = NULL,
                      .device = {kDLCPU, 0},
                      .ndim = 1,
                      .dtype = {kDLFloat, 32, 1},
                      .shape = &zero};
        assert_int_equal(epipe_codec_encode(c, &e, buf, sizeof buf, &n), EPIPE_OK);
        assert_int_equal(epipe_codec_decode(c, buf, n, &e), EPIPE_OK);
        /* a scalar (ndim 0) and all-equal values */
        float one = 0.75f, back = 0;
        DLTensor sc = {.data = &one, .device = {kDLCPU, 0}, .ndim = 0, .dtype = {kDLFloat, 32, 1}};
        DLTensor scb = sc;
        scb.data = &back;
        assert_int_equal(epipe_codec_encode(c, &sc, buf, sizeof buf, &n), EPIPE_OK);
        assert_int_equal(epipe_codec_decode(c, buf, n, &scb), EPIPE_OK);
        assert_true(back == 0.75f);
        float same[40], out[40];
        int64_t s1, s2;
        for (int i = 0; i < 40; i++)
            same[i] = -2.0f;
        DLTensor ts = test_view_f32(same, &s1, 40), to = test_view_f32(out, &s2, 40);
        assert_int_equal(epipe_codec_encode(c, &ts, buf, sizeof buf, &n), EPIPE_OK);
        assert_int_equal(epipe_codec_decode(c, buf, n, &to), EPIPE_OK);
        for (int i = 0; i < 40; i++)
            assert_true(out[i] == -2.0f);
        epipe_codec_destroy(c);
    }
}

/* A tensor whose data do not start on an element boundary (DLPack allows
 * any byte_offset) encodes to the payload of an aligned copy, and decodes
 * into such a tensor the aligned decode's values; the kernels read and
 * wrote it as floats in place before (UBSan: misaligned loads, in every
 * codec). Payload buffers at odd addresses too. */
static void tensors_off_element_boundaries(void **state)
{
    (void)state;
    static const char *const extra[] = {
        "quant:bits=4,ef=1",
        "topk:ratio=0.1",
        "kmeans:bits=2",
#ifdef EPIPE_HAVE_BLAS
        "poweriter:rank=2,shared=1",
#endif
    };
    enum { ROWS = 64, COLS = 48, N = ROWS * COLS };
    float x[N];
    test_fill(x, N, DIST_NORMAL, 23);
    static unsigned char raw[4 * N + 8], rawout[4 * N + 8];
    int64_t shape[2] = {ROWS, COLS};
    size_t nspecs = NSPECS + sizeof extra / sizeof extra[0];
    for (size_t k = 0; k < nspecs; k++) {
        const char *spec = k < NSPECS ? all_specs[k] : extra[k - NSPECS];
        for (uint64_t off = 1; off < 4; off++) {
            epipe_codec *a = test_codec(spec, 1, 0), *b = test_codec(spec, 1, 0);
            memcpy(raw + off, x, sizeof x);
            DLTensor al = {.data = x,
                           .device = {kDLCPU, 0},
                           .ndim = 2,
                           .dtype = {kDLFloat, 32, 1},
                           .shape = shape};
            DLTensor mis = al;
            mis.data = raw, mis.byte_offset = off;
            size_t cap, na, nb;
            assert_int_equal(epipe_codec_max_encoded_size(a, &al, &cap), EPIPE_OK);
            unsigned char *pa = malloc(cap), *pb = malloc(cap + 4);
            assert_int_equal(epipe_codec_encode(a, &al, pa, cap, &na), EPIPE_OK);
            if (epipe_codec_encode(b, &mis, pb + off, cap, &nb) != EPIPE_OK)
                fail_msg("%s, byte_offset %llu: %s", spec, (unsigned long long)off,
                         epipe_codec_last_error(b));
            if (na != nb || memcmp(pa, pb + off, na))
                fail_msg("%s, byte_offset %llu: another payload", spec, (unsigned long long)off);
            float ya[N], yb[N];
            DLTensor da = al, db = mis;
            da.data = ya, db.data = rawout;
            assert_int_equal(epipe_codec_decode(a, pa, na, &da), EPIPE_OK);
            assert_int_equal(epipe_codec_decode(b, pb + off, nb, &db), EPIPE_OK);
            memcpy(yb, rawout + off, sizeof yb);
            assert_memory_equal(ya, yb, sizeof ya);
            free(pa), free(pb);
            epipe_codec_destroy(a), epipe_codec_destroy(b);
        }
    }
}

static void bad_tensors_and_buffers(void **state)
{
    (void)state;
    epipe_codec *c;
    float x[8] = {0};
    int64_t s;
    DLTensor t = test_view_f32(x, &s, 8);
    uint8_t buf[128];
    size_t n;
    assert_int_equal(epipe_codec_create(&c, "none"), EPIPE_OK);
    assert_int_equal(epipe_codec_encode(c, &t, buf, 16 + 31, &n), EPIPE_ENOSPC);
    assert_non_null(strstr(epipe_codec_last_error(c), "needs 48 bytes"));
    assert_int_equal(n, 0);
    DLTensor bad = t;
    bad.dtype.code = kDLInt;
    assert_int_equal(epipe_codec_encode(c, &bad, buf, sizeof buf, &n), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "src has dtype"));
    bad = t;
    bad.device.device_type = kDLCUDA;
    assert_int_equal(epipe_codec_encode(c, &bad, buf, sizeof buf, &n), EPIPE_ENOTSUP);
    assert_non_null(strstr(epipe_last_error(), "CUDA"));
    bad = t;
    int64_t neg = -1;
    bad.shape = &neg;
    assert_int_equal(epipe_codec_encode(c, &bad, buf, sizeof buf, &n), EPIPE_EINVAL);
    bad = t;
    int64_t huge[4] = {INT64_MAX, INT64_MAX, 2, 2};
    bad.shape = huge;
    bad.ndim = 4;
    assert_int_equal(epipe_codec_max_encoded_size(c, &bad, &n), EPIPE_EOVERFLOW);
    assert_int_equal(epipe_codec_set_param(c, EPIPE_CODEC_THREADS, 300), EPIPE_EINVAL);
    assert_int_equal(epipe_codec_set_param(c, EPIPE_CODEC_THREADS, 2), EPIPE_OK);
    assert_int_equal(epipe_codec_set_param(c, (epipe_codec_param)99, 2), EPIPE_EINVAL);
    epipe_codec_destroy(c);
}

/* A payload is checked against the decoder before any body byte is used. */
static void payload_header_is_checked(void **state)
{
    (void)state;
    float x[8] = {1, 2, 3, 4, 5, 6, 7, 8}, y[8];
    int64_t sx, sy, s7;
    DLTensor tx = test_view_f32(x, &sx, 8), ty = test_view_f32(y, &sy, 8);
    DLTensor t7 = test_view_f32(y, &s7, 7);
    uint8_t buf[128], tmp[129];
    size_t n;
    epipe_codec *none, *f16, *b16;
    assert_int_equal(epipe_codec_create(&none, "none"), EPIPE_OK);
    assert_int_equal(epipe_codec_create(&f16, "cast:dtype=fp16"), EPIPE_OK);
    assert_int_equal(epipe_codec_create(&b16, "cast:dtype=bf16"), EPIPE_OK);
    assert_int_equal(epipe_codec_encode(f16, &tx, buf, sizeof buf, &n), EPIPE_OK);
    assert_int_equal(epipe_codec_decode(none, buf, n, &ty), EPIPE_EPROTO);
    assert_non_null(strstr(epipe_codec_last_error(none), "(cast)"));
    assert_int_equal(epipe_codec_decode(b16, buf, n, &ty), EPIPE_EPROTO);
    assert_non_null(strstr(epipe_codec_last_error(b16), "parameter word"));
    assert_int_equal(epipe_codec_decode(f16, buf, n, &t7), EPIPE_EINVAL);
    assert_int_equal(epipe_codec_decode(f16, buf, n - 1, &ty), EPIPE_ETRUNC);
    assert_int_equal(epipe_codec_decode(f16, buf, 15, &ty), EPIPE_ETRUNC);
    memcpy(tmp, buf, n);
    tmp[n] = 0;
    assert_int_equal(epipe_codec_decode(f16, tmp, n + 1, &ty), EPIPE_EPROTO);
    memcpy(tmp, buf, n);
    tmp[1] = 9;
    assert_int_equal(epipe_codec_decode(f16, tmp, n, &ty), EPIPE_EVERSION);
    memcpy(tmp, buf, n);
    tmp[3] = 1;
    assert_int_equal(epipe_codec_decode(f16, tmp, n, &ty), EPIPE_EPROTO);
    memcpy(tmp, buf, n);
    tmp[8] = 0xff; /* count field */
    assert_int_equal(epipe_codec_decode(f16, tmp, n, &ty), EPIPE_EINVAL);
    assert_int_equal(epipe_codec_decode(f16, buf, n, &ty), EPIPE_OK);
    assert_memory_equal(x, y, sizeof x); /* small integers are exact in fp16 */
    epipe_codec_destroy(none);
    epipe_codec_destroy(f16);
    epipe_codec_destroy(b16);
}

/* cast saturates a finite value beyond its type's range to the largest
 * finite value instead of infinity; infinities and NaN stay as they are. */
static void cast_saturates_out_of_range(void **state)
{
    (void)state;
    float x[7] = {FLT_MAX, -FLT_MAX, 65520.0f, INFINITY, -INFINITY, 65504.0f, NAN}, y[7];
    int64_t sx, sy;
    DLTensor tx = test_view_f32(x, &sx, 7), ty = test_view_f32(y, &sy, 7);
    uint8_t buf[64];
    size_t n;
    epipe_codec *c;
    assert_int_equal(epipe_codec_create(&c, "cast:dtype=fp16"), EPIPE_OK);
    assert_int_equal(epipe_codec_encode(c, &tx, buf, sizeof buf, &n), EPIPE_OK);
    assert_int_equal(buf[16] | buf[17] << 8, 0x7bff); /* FLT_MAX: the largest fp16 */
    assert_int_equal(epipe_codec_decode(c, buf, n, &ty), EPIPE_OK);
    assert_true(y[0] == 65504.0f && y[1] == -65504.0f && y[2] == 65504.0f);
    assert_true(isinf(y[3]) && y[3] > 0 && isinf(y[4]) && y[4] < 0);
    assert_true(y[5] == 65504.0f && isnan(y[6]));
    epipe_codec_destroy(c);

    union {
        uint32_t u;
        float f;
    } bmax = {.u = 0x7f7f0000u}; /* the largest bf16 */
    assert_int_equal(epipe_codec_create(&c, "cast:dtype=bf16"), EPIPE_OK);
    assert_int_equal(epipe_codec_encode(c, &tx, buf, sizeof buf, &n), EPIPE_OK);
    assert_int_equal(buf[16] | buf[17] << 8, 0x7f7f);
    assert_int_equal(epipe_codec_decode(c, buf, n, &ty), EPIPE_OK);
    assert_true(y[0] == bmax.f && y[1] == -bmax.f && y[2] == 65536.0f);
    assert_true(isinf(y[3]) && y[3] > 0 && isinf(y[4]) && y[4] < 0 && isnan(y[6]));
    epipe_codec_destroy(c);
}

/* What can be set can be read back; a parameter's range can be asked
 * without a codec. */
static void getters_and_bounds(void **state)
{
    (void)state;
    epipe_codec *c;
    double v, lo, hi;
    int64_t k;
    assert_int_equal(epipe_codec_create(&c, "sortquant:bits=6,mode=sample"), EPIPE_OK);
    assert_int_equal(epipe_codec_spec_param(c, "bits", &v), EPIPE_OK);
    assert_true(v == 6);
    assert_int_equal(epipe_codec_spec_param(c, "split", &v), EPIPE_OK); /* derived: 6/4 */
    assert_true(v == 1);
    assert_non_null(strstr(epipe_codec_spec(c), "split=1"));
    assert_int_equal(epipe_codec_spec_param(c, "mode", &v), EPIPE_OK);
    assert_true(v == 1); /* sample, the second choice */
    assert_int_equal(epipe_codec_spec_param(c, "width", &v), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_codec_last_error(c), "bits, split, mode, sample"));
    assert_int_equal(epipe_codec_spec_param(c, NULL, &v), EPIPE_EINVAL);

    assert_int_equal(epipe_codec_get_param(c, EPIPE_CODEC_THREADS, &k), EPIPE_OK);
    assert_int_equal(k, 0);
    assert_int_equal(epipe_codec_set_param(c, EPIPE_CODEC_THREADS, 3), EPIPE_OK);
    assert_int_equal(epipe_codec_get_param(c, EPIPE_CODEC_THREADS, &k), EPIPE_OK);
    assert_int_equal(k, 3);
    assert_int_equal(epipe_codec_get_param(c, EPIPE_CODEC_MICROBATCH, &k), EPIPE_OK);
    assert_int_equal(k, -1);
    assert_int_equal(epipe_codec_set_param(c, EPIPE_CODEC_MICROBATCH, 5), EPIPE_OK);
    assert_int_equal(epipe_codec_get_param(c, EPIPE_CODEC_MICROBATCH, &k), EPIPE_OK);
    assert_int_equal(k, 5);
    assert_int_equal(epipe_codec_get_param(c, (epipe_codec_param)99, &k), EPIPE_EINVAL);

    /* Sizing needs no mutable handle. */
    float x[4] = {0};
    int64_t sx;
    DLTensor t = test_view_f32(x, &sx, 4);
    const epipe_codec *cc = c;
    size_t bytes;
    assert_int_equal(epipe_codec_max_encoded_size(cc, &t, &bytes), EPIPE_OK);
    epipe_codec_destroy(c);

    assert_int_equal(epipe_codec_param_bounds("sortquant", "bits", &lo, &hi), EPIPE_OK);
    assert_true(lo == 2 && hi == 16);
    assert_int_equal(epipe_codec_param_bounds("quant", "bits", &lo, &hi), EPIPE_OK);
    assert_true(lo == 1 && hi == 16);
    assert_int_equal(epipe_codec_param_bounds("sortquant", "mode", &lo, &hi), EPIPE_OK);
    assert_true(lo == 0 && hi == 2); /* exact, sample, fit */
    assert_int_equal(epipe_codec_param_bounds("topk", "ratio", &lo, &hi), EPIPE_OK);
    assert_true(lo > 0 && hi == 1);
    assert_int_equal(epipe_codec_param_bounds("zstd", "level", &lo, &hi), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "unknown codec 'zstd'"));
    assert_int_equal(epipe_codec_param_bounds("quant", "split", &lo, &hi), EPIPE_EINVAL);
    assert_non_null(
        strstr(epipe_last_error(), "no parameter 'split' (its keys: bits, zero, rows, group, ef)"));
    assert_int_equal(epipe_codec_param_bounds("none", "bits", &lo, &hi), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "its keys: none"));
    assert_int_equal(epipe_codec_param_bounds("chain", "bits", &lo, &hi), EPIPE_EINVAL);

    /* Every bound accepts its ends: the spec parser and the query agree. */
    const char *checks[][2] = {{"quant", "bits"}, {"kmeans", "bits"}, {"sortquant", "bits"}};
    for (size_t i = 0; i < sizeof checks / sizeof checks[0]; i++) {
        char spec[64];
        assert_int_equal(epipe_codec_param_bounds(checks[i][0], checks[i][1], &lo, &hi), EPIPE_OK);
        snprintf(spec, sizeof spec, "%s:%s=%.0f", checks[i][0], checks[i][1], hi);
        assert_int_equal(epipe_codec_create(&c, spec), EPIPE_OK);
        epipe_codec_destroy(c);
        snprintf(spec, sizeof spec, "%s:%s=%.0f", checks[i][0], checks[i][1], hi + 1);
        assert_int_equal(epipe_codec_create(&c, spec), EPIPE_EINVAL);
    }
}

/* The backend comes from the tensor's device: pinned host memory is the
 * CPU's; a CUDA tensor on a CPU-bound handle, or without the module, is
 * refused. */
static void backend_follows_the_device(void **state)
{
    (void)state;
    float x[4] = {1, 2, 3, 4}, y[4];
    int64_t sx, sy;
    DLTensor tx = test_view_f32(x, &sx, 4), ty = test_view_f32(y, &sy, 4);
    uint8_t buf[64];
    size_t n;
    epipe_codec *c;
    assert_int_equal(epipe_codec_create(&c, "quant:bits=8"), EPIPE_OK);
    tx.device.device_type = kDLCUDAHost;
    assert_int_equal(epipe_codec_encode(c, &tx, buf, sizeof buf, &n), EPIPE_OK);
    /* The handle is bound to the CPU now: a CUDA tensor names both. */
    tx.device.device_type = kDLCUDA;
    assert_int_equal(epipe_codec_max_encoded_size(c, &tx, &n), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_codec_last_error(c), "bound to CPU"));
    epipe_codec_destroy(c);
    /* A fresh handle: without the CUDA module (tests/test_cuda_loader.c
     * covers it) the CUDA tensor is refused as unsupported. */
    setenv("EPIPE_CUDA_MODULE", "/nonexistent/libepipe-cuda.so", 1);
    assert_int_equal(epipe_codec_create(&c, "quant:bits=8"), EPIPE_OK);
    assert_int_equal(epipe_codec_max_encoded_size(c, &tx, &n), EPIPE_ENOTSUP);
    assert_non_null(strstr(epipe_codec_last_error(c), "src is a CUDA tensor"));
    ty.device.device_type = kDLCUDAManaged;
    assert_int_equal(epipe_codec_decode(c, buf, sizeof buf, &ty), EPIPE_ENOTSUP);
    assert_non_null(strstr(epipe_last_error(), "dst is a CUDA tensor"));
    epipe_codec_destroy(c);
    unsetenv("EPIPE_CUDA_MODULE");
}

/* The tensor check the CUDA path uses: a CUDA tensor passes it when the
 * caller says CUDA is handled (its shape and dtype checked as a CPU
 * tensor's), and is refused as unsupported when not. The first GPU run
 * found every CUDA tensor refused here, which no CPU test had looked at. */
static void inspect_lets_cuda_through_when_asked(void **state)
{
    (void)state;
    float x[6];
    int64_t s;
    DLTensor t = test_view_f32(x, &s, 6);
    char msg[256] = "";
    uint64_t n = 0;
    enum epipe_dtype dt;
    t.device.device_type = kDLCUDA;
    assert_int_equal(epipe_tensor_inspect_on(&t, "src", msg, &n, &dt, 1), EPIPE_OK);
    assert_int_equal(n, 6);
    assert_int_equal(dt, EPIPE_DTYPE_F32);
    t.device.device_type = kDLCUDAManaged;
    assert_int_equal(epipe_tensor_inspect_on(&t, "src", msg, &n, &dt, 1), EPIPE_OK);
    assert_int_equal(epipe_tensor_inspect_on(&t, "src", msg, &n, &dt, 0), EPIPE_ENOTSUP);
    assert_non_null(strstr(msg, "src is a CUDA tensor"));
    t.device.device_type = kDLCUDA;
    t.dtype.bits = 64; /* the CPU's checks still apply */
    assert_int_equal(epipe_tensor_inspect_on(&t, "src", msg, &n, &dt, 1), EPIPE_EINVAL);
    assert_non_null(strstr(msg, "fp64"));
    t.dtype.bits = 32;
    t.device.device_type = kDLOpenCL; /* another device stays refused */
    assert_int_equal(epipe_tensor_inspect_on(&t, "src", msg, &n, &dt, 1), EPIPE_EINVAL);
    assert_non_null(strstr(msg, "device type 4"));
}

/* The chain is a codec in the registry: its id names it in messages, but
 * a spec names it only by its syntax, "a|b". */
static void chain_is_a_registered_codec(void **state)
{
    (void)state;
    expect_spec_error("chain", "unknown codec 'chain'");
    assert_non_null(strstr(epipe_last_error(), ", insert)")); /* not listed */
    float x[32], y[32];
    test_fill(x, 32, DIST_NORMAL, 7);
    int64_t shape[2] = {4, 8};
    DLTensor tx = {
        .data = x, .device = {kDLCPU, 0}, .ndim = 2, .dtype = {kDLFloat, 32, 1}, .shape = shape};
    DLTensor ty = tx;
    ty.data = y;
    uint8_t buf[256];
    size_t n;
    epipe_codec *ch, *plain;
    unsigned count;
    int64_t k;
    /* insert needs BLAS: a -Dblas=disabled build refuses it (codecs/noblas.c). */
    int rc = epipe_codec_create(&ch, "insert:kind=linear,out=2|none");
    if (rc == EPIPE_ENOTSUP)
        skip();
    assert_int_equal(rc, EPIPE_OK);
    assert_int_equal(epipe_codec_create(&plain, "insert:kind=linear,out=2"), EPIPE_OK);
    assert_int_equal(epipe_codec_set_param(ch, EPIPE_CODEC_THREADS, 2), EPIPE_OK);
    assert_int_equal(epipe_codec_get_param(ch, EPIPE_CODEC_THREADS, &k), EPIPE_OK);
    assert_int_equal(k, 2);
    assert_int_equal(epipe_codec_encode(ch, &tx, buf, sizeof buf, &n), EPIPE_OK);
    assert_int_equal(n, 16 + 16 + 16 + 4 * 2 * 4);
    assert_int_equal(epipe_codec_decode(plain, buf, n, &ty), EPIPE_EPROTO);
    assert_non_null(strstr(epipe_codec_last_error(plain), "codec id 64 (chain)"));
    assert_int_equal(epipe_codec_decode(ch, buf, n, &ty), EPIPE_OK);
    assert_true(epipe_codec_trainable(ch));
    assert_int_equal(epipe_codec_num_tensors(ch, &count), EPIPE_OK);
    assert_int_equal(count, 2);
    const char *name;
    assert_int_equal(epipe_codec_tensor(ch, 1, &name, NULL, NULL), EPIPE_OK);
    assert_string_equal(name, "restore.weight");
    assert_int_equal(epipe_codec_tensor(ch, 2, &name, NULL, NULL), EPIPE_EINVAL);
    double v;
    assert_int_equal(epipe_codec_spec_param(ch, "out", &v), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_codec_last_error(ch), "a chain has no parameters"));
    epipe_codec_destroy(ch);
    epipe_codec_destroy(plain);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(version_matches_header),
        cmocka_unit_test(status_strings),
        cmocka_unit_test(bad_specs_are_named),
        cmocka_unit_test(canonical_spec_round_trips),
        cmocka_unit_test(none_is_exact_and_cast_rounds),
        cmocka_unit_test(f16_and_bf16_conversion_edges),
        cmocka_unit_test(strided_and_half_tensors),
        cmocka_unit_test(degenerate_tensors),
        cmocka_unit_test(tensors_off_element_boundaries),
        cmocka_unit_test(bad_tensors_and_buffers),
        cmocka_unit_test(payload_header_is_checked),
        cmocka_unit_test(cast_saturates_out_of_range),
        cmocka_unit_test(getters_and_bounds),
        cmocka_unit_test(backend_follows_the_device),
        cmocka_unit_test(inspect_lets_cuda_through_when_asked),
        cmocka_unit_test(chain_is_a_registered_codec),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
