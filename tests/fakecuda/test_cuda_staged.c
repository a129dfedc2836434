/* Host staging of CUDA tensors (lib/codec/cuda_staged.c), on any machine:
 * the test CUDA module (fakecuda.c) has no kernels and keeps its "device"
 * memory unreadable by the host, so every codec call on a CUDA tensor goes
 * through the staging copies, and one that reads device memory directly
 * crashes. Payloads must be the CPU backend's, byte for byte. The last
 * test turns on the module's plain-loop insert backend: the core's side
 * of insert's CUDA backend (cuda/insert.cu). */
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include <epipe/epipe.h>

static void *(*dev_alloc)(size_t);
static void (*dev_free)(void *);
static int (*dev_copy)(void *, const void *, size_t);
static void *(*last_stream)(unsigned long *);
static unsigned long (*host_allocs)(void);
static void (*insert_kernels)(int);
static unsigned long (*insert_calls)(void);

#define ROWS 8
#define COLS 64
#define N (ROWS * COLS)

/* Samples of 4 x 16 (poweriter's matrices); [ROWS, COLS] for insert's backward. */
static int64_t shape3[3] = {ROWS, 4, 16}, shape2[2] = {ROWS, COLS};

static DLTensor tensor(int device_type, void *data, int bits, uint8_t code)
{
    DLTensor t = {0};
    t.data = data;
    t.device.device_type = (DLDeviceType)device_type;
    t.ndim = 3;
    t.shape = shape3;
    t.dtype.code = code;
    t.dtype.bits = (uint8_t)bits;
    t.dtype.lanes = 1;
    return t;
}

static DLTensor f32(int device_type, void *data)
{
    return tensor(device_type, data, 32, kDLFloat);
}

static void fill(float *x, size_t n, unsigned step)
{
    uint32_t s = 2463534242u + 977u * step;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 17, s ^= s << 5;
        x[i] = ((float)(s % 20001u) - 10000.0f) / 4000.0f + (float)(i % 7) * 0.01f * (float)step;
    }
}

static epipe_codec *make(const char *spec)
{
    epipe_codec *c = NULL;
    int rc = epipe_codec_create(&c, spec);
    if (rc == EPIPE_ENOTSUP)
        return NULL; /* poweriter and insert without BLAS in this build */
    assert_int_equal(rc, EPIPE_OK);
    return c;
}

/* The codec pair on the CPU and on fake CUDA tensors: the same payloads,
 * into device and host memory, and the same decoded values, from device
 * and host payloads, step after step (stateful codecs included). */
static void check_spec(const char *spec)
{
    epipe_codec *ce = make(spec), *cd = make(spec), *ge = make(spec), *gd = make(spec);
    if (!ce) {
        print_message("  %s: not in this build, skipped\n", spec);
        return;
    }
    static float x[N], y_cpu[N], y_gpu[N];
    static uint8_t p_cpu[16 * N], p_gpu[16 * N];
    float *dx = dev_alloc(sizeof x), *dy = dev_alloc(sizeof y_gpu);
    uint8_t *dp = dev_alloc(sizeof p_gpu);
    assert_true(dx && dy && dp);
    for (unsigned step = 0; step < 3; step++) {
        fill(x, N, step);
        assert_int_equal(dev_copy(dx, x, sizeof x), 0);
        DLTensor hx = f32(kDLCPU, x), gx = f32(kDLCUDA, dx);
        size_t wc = 0, wg = 0, cap = 0;
        assert_int_equal(epipe_codec_max_encoded_size(ge, &gx, &cap), EPIPE_OK);
        assert_true(cap <= sizeof p_gpu);
        assert_int_equal(epipe_codec_encode(ce, &hx, p_cpu, sizeof p_cpu, &wc), EPIPE_OK);
        int on_device = step % 2 == 0;
        int rc = epipe_codec_encode(ge, &gx, on_device ? (void *)dp : p_gpu, cap, &wg);
        if (rc)
            fail_msg("%s step %u: %s", spec, step, epipe_codec_last_error(ge));
        assert_int_equal(wg, wc);
        if (on_device)
            assert_int_equal(dev_copy(p_gpu, dp, wg), 0);
        assert_memory_equal(p_gpu, p_cpu, wc);

        DLTensor hy = f32(kDLCPU, y_cpu), gy = f32(kDLCUDA, dy);
        assert_int_equal(epipe_codec_decode(cd, p_cpu, wc, &hy), EPIPE_OK);
        if (!on_device) /* the other way round: a host payload, a device one */
            if (dev_copy(dp, p_cpu, wc))
                fail_msg("%s: copy of %zu bytes", spec, wc);
        rc = epipe_codec_decode(gd, on_device ? (void *)dp : p_cpu, wc, &gy);
        if (rc)
            fail_msg("%s step %u decode: %s", spec, step, epipe_codec_last_error(gd));
        assert_int_equal(dev_copy(y_gpu, dy, sizeof y_gpu), 0);
        assert_memory_equal(y_gpu, y_cpu, sizeof y_cpu);
    }
    dev_free(dx), dev_free(dy), dev_free(dp);
    epipe_codec_destroy(ce), epipe_codec_destroy(cd);
    epipe_codec_destroy(ge), epipe_codec_destroy(gd);
}

static void test_payloads_equal_cpu(void **state)
{
    (void)state;
    static const char *const specs[] = {
        "none",
        "quant:bits=4",
        "quant:bits=2,rows=1",
        "sortquant:bits=4",
        "kmeans:bits=2",
        "topk:ratio=0.1",
        "cast:dtype=bf16",
        "sortquant:bits=3,zero=1,ef=1",
        "poweriter:rank=2",
        "poweriter:rank=2,ef=1",
        "insert:kind=linear,out=8,seed=3",
        "insert:kind=linear,out=8,seed=3|quant:bits=8",
    };
    for (size_t i = 0; i < sizeof specs / sizeof *specs; i++)
        check_spec(specs[i]);
}

/* delta=1: the ids go with the encode; payloads shrink once rows are known. */
static void test_deltas_equal_cpu(void **state)
{
    (void)state;
    const char *spec = "quant:bits=2,rows=1,delta=1";
    epipe_codec *ce = make(spec), *cd = make(spec), *ge = make(spec), *gd = make(spec);
    static float x[N], y_cpu[N], y_gpu[N];
    static uint8_t p_cpu[8 * N], p_gpu[8 * N];
    float *dx = dev_alloc(sizeof x), *dy = dev_alloc(sizeof y_gpu);
    uint8_t *dp = dev_alloc(sizeof p_gpu);
    size_t first = 0;
    for (unsigned step = 0; step < 4; step++) {
        uint64_t ids[ROWS];
        for (int r = 0; r < ROWS; r++)
            ids[r] = (uint64_t)(r + (step % 2) * 3); /* rows seen again */
        fill(x, N, step);
        assert_int_equal(dev_copy(dx, x, sizeof x), 0);
        DLTensor hx = f32(kDLCPU, x), gx = f32(kDLCUDA, dx);
        assert_int_equal(epipe_codec_set_samples(ce, ids, ROWS), EPIPE_OK);
        assert_int_equal(epipe_codec_set_samples(ge, ids, ROWS), EPIPE_OK);
        size_t wc = 0, wg = 0;
        assert_int_equal(epipe_codec_encode(ce, &hx, p_cpu, sizeof p_cpu, &wc), EPIPE_OK);
        assert_int_equal(epipe_codec_encode(ge, &gx, dp, sizeof p_gpu, &wg), EPIPE_OK);
        assert_int_equal(wg, wc);
        assert_int_equal(dev_copy(p_gpu, dp, wg), 0);
        assert_memory_equal(p_gpu, p_cpu, wc);
        if (step == 0)
            first = wc;
        DLTensor hy = f32(kDLCPU, y_cpu), gy = f32(kDLCUDA, dy);
        assert_int_equal(epipe_codec_decode(cd, p_cpu, wc, &hy), EPIPE_OK);
        assert_int_equal(epipe_codec_decode(gd, dp, wg, &gy), EPIPE_OK);
        assert_int_equal(dev_copy(y_gpu, dy, sizeof y_gpu), 0);
        assert_memory_equal(y_gpu, y_cpu, sizeof y_cpu);
        const uint64_t *got;
        size_t n;
        assert_int_equal(epipe_codec_decoded_samples(gd, &got, &n), EPIPE_OK);
        assert_int_equal(n, ROWS);
        assert_memory_equal(got, ids, sizeof ids);
    }
    assert_true(first > 0);
    epipe_codec_delta_info info;
    assert_int_equal(epipe_codec_delta_stats(ge, &info), EPIPE_OK);
    assert_true(info.delta_rows > 0); /* rows known from earlier steps went as deltas */
    dev_free(dx), dev_free(dy), dev_free(dp);
    epipe_codec_destroy(ce), epipe_codec_destroy(cd);
    epipe_codec_destroy(ge), epipe_codec_destroy(gd);
}

/* fp16 bits of a float that fp16 holds exactly (normal or 0). */
static uint16_t half_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (!(u & 0x7fffffffu))
        return (uint16_t)(u >> 16);
    uint32_t e = ((u >> 23) & 0xffu) - 127u + 15u;
    return (uint16_t)((u >> 16 & 0x8000u) | e << 10 | (u >> 13 & 0x3ffu));
}

/* An fp16 CUDA tensor encodes and decodes as the same fp16 CPU tensor. */
static void test_half_tensors(void **state)
{
    (void)state;
    epipe_codec *ce = make("sortquant:bits=8"), *ge = make("sortquant:bits=8");
    static uint16_t h[N], back_cpu[N], back_gpu[N];
    static uint8_t p_cpu[4 * N], p_gpu[4 * N];
    for (size_t i = 0; i < N; i++)
        h[i] = half_of((float)((int)(i * 37 % 101) - 50) / 16.0f);
    uint16_t *dh = dev_alloc(sizeof h);
    assert_int_equal(dev_copy(dh, h, sizeof h), 0);
    DLTensor hx = tensor(kDLCPU, h, 16, kDLFloat), gx = tensor(kDLCUDA, dh, 16, kDLFloat);
    size_t wc = 0, wg = 0;
    assert_int_equal(epipe_codec_encode(ce, &hx, p_cpu, sizeof p_cpu, &wc), EPIPE_OK);
    assert_int_equal(epipe_codec_encode(ge, &gx, p_gpu, sizeof p_gpu, &wg), EPIPE_OK);
    assert_int_equal(wg, wc);
    assert_memory_equal(p_gpu, p_cpu, wc);
    DLTensor hy = tensor(kDLCPU, back_cpu, 16, kDLFloat), gy = tensor(kDLCUDA, dh, 16, kDLFloat);
    assert_int_equal(epipe_codec_decode(ce, p_cpu, wc, &hy), EPIPE_OK);
    assert_int_equal(epipe_codec_decode(ge, p_gpu, wg, &gy), EPIPE_OK);
    assert_int_equal(dev_copy(back_gpu, dh, sizeof back_gpu), 0);
    assert_memory_equal(back_gpu, back_cpu, sizeof back_cpu);
    dev_free(dh);
    epipe_codec_destroy(ce), epipe_codec_destroy(ge);
}

/* Bad tensors and payloads get the CPU's errors, and nothing is written. */
static void test_refusals(void **state)
{
    (void)state;
    epipe_codec *g = make("poweriter:rank=2");
    if (!g)
        g = make("kmeans:bits=4");
    static float x[N];
    static uint8_t p[8 * N];
    fill(x, N, 1);
    float *dx = dev_alloc(sizeof x);
    uint8_t *dp = dev_alloc(sizeof p);
    assert_int_equal(dev_copy(dx, x, sizeof x), 0);
    size_t w = 7;

    int64_t strides[3] = {1, ROWS, ROWS * 4}; /* column-major */
    DLTensor strided = f32(kDLCUDA, dx);
    strided.strides = strides;
    assert_int_equal(epipe_codec_encode(g, &strided, dp, sizeof p, &w), EPIPE_EINVAL);
    assert_int_equal(w, 0);
    assert_non_null(strstr(epipe_codec_last_error(g), "dense"));

    DLTensor lying = f32(kDLCUDA, x); /* host memory that says kDLCUDA */
    assert_int_equal(epipe_codec_encode(g, &lying, dp, sizeof p, &w), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_codec_last_error(g), "not CUDA device memory"));

    DLTensor gx = f32(kDLCUDA, dx);
    size_t need = 0;
    assert_int_equal(epipe_codec_max_encoded_size(g, &gx, &need), EPIPE_OK);
    assert_int_equal(epipe_codec_encode(g, &gx, dp, need - 1, &w), EPIPE_ENOSPC);
    assert_int_equal(w, 0);
    assert_int_equal(epipe_codec_encode(g, &gx, dp, sizeof p, &w), EPIPE_OK);
    assert_int_equal(w, need);

    /* a truncated and a corrupt device payload */
    assert_int_equal(epipe_codec_decode(g, dp, w - 1, &gx), EPIPE_ETRUNC);
    uint8_t bad[16];
    assert_int_equal(dev_copy(bad, dp, sizeof bad), 0);
    bad[0] ^= 0x40;
    assert_int_equal(dev_copy(dp, bad, sizeof bad), 0);
    assert_int_equal(epipe_codec_decode(g, dp, w, &gx), EPIPE_EPROTO);

    /* bound to the CUDA device by its first tensor */
    DLTensor hx = f32(kDLCPU, x);
    assert_int_equal(epipe_codec_encode(g, &hx, p, sizeof p, &w), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_codec_last_error(g), "bound"));
    DLTensor other = f32(kDLCUDA, dx);
    other.device.device_id = 1;
    assert_int_equal(epipe_codec_encode(g, &other, dp, sizeof p, &w), EPIPE_EINVAL);
    dev_free(dx), dev_free(dp);
    epipe_codec_destroy(g);
}

/* The staging copies are ordered on the handle's stream, through buffers
 * of pinned memory the module gives, kept from call to call. */
static void test_copies_on_handle_stream(void **state)
{
    (void)state;
    epipe_codec *g = make("kmeans:bits=2");
    static float x[N];
    static uint8_t p[4 * N];
    float *dx = dev_alloc(sizeof x);
    assert_int_equal(dev_copy(dx, x, sizeof x), 0);
    void *stream = (void *)(uintptr_t)0x5eed;
    assert_int_equal(epipe_codec_set_stream(g, stream), EPIPE_OK);
    unsigned long before = 0, after = 0;
    last_stream(&before);
    DLTensor gx = f32(kDLCUDA, dx);
    size_t w = 0;
    assert_int_equal(epipe_codec_encode(g, &gx, p, sizeof p, &w), EPIPE_OK);
    assert_ptr_equal(last_stream(&after), stream);
    assert_int_equal(after, before + 1); /* the tensor down; the payload is host memory */
    /* the staging buffer is the module's (pinned) memory, kept for the next call */
    unsigned long pinned = host_allocs();
    assert_true(pinned > 0);
    assert_int_equal(epipe_codec_encode(g, &gx, p, sizeof p, &w), EPIPE_OK);
    assert_int_equal(host_allocs(), pinned);
    assert_int_equal(epipe_codec_synchronize(g), EPIPE_OK);
    dev_free(dx);
    epipe_codec_destroy(g);
}

/* insert's backward on CUDA gradients: the CPU's, with the same parameter
 * gradients (host tensors: a staged codec keeps its parameters there). */
static void test_backward_equals_cpu(void **state)
{
    (void)state;
    const char *spec = "insert:kind=linear,out=16,seed=5";
    epipe_codec *c = make(spec), *g = make(spec);
    if (!c) {
        skip();
        return;
    }
    static float x[N], gcode[ROWS * 16], gin_cpu[N], gin_gpu[N];
    static uint8_t p[8 * N];
    fill(x, N, 2);
    fill(gcode, ROWS * 16, 3);
    float *dx = dev_alloc(sizeof x), *dg = dev_alloc(sizeof gcode), *dgin = dev_alloc(sizeof x);
    assert_int_equal(dev_copy(dx, x, sizeof x), 0);
    assert_int_equal(dev_copy(dg, gcode, sizeof gcode), 0);
    assert_int_equal(epipe_codec_set_param(c, EPIPE_CODEC_MICROBATCH, 1), EPIPE_OK);
    assert_int_equal(epipe_codec_set_param(g, EPIPE_CODEC_MICROBATCH, 1), EPIPE_OK);
    DLTensor hx = f32(kDLCPU, x), gx = f32(kDLCUDA, dx);
    hx.ndim = gx.ndim = 2;
    hx.shape = gx.shape = shape2;
    size_t w = 0;
    assert_int_equal(epipe_codec_encode(c, &hx, p, sizeof p, &w), EPIPE_OK);
    assert_int_equal(epipe_codec_encode(g, &gx, p, sizeof p, &w), EPIPE_OK);
    int64_t cshape[2] = {ROWS, 16};
    DLTensor hgc = f32(kDLCPU, gcode), ggc = f32(kDLCUDA, dg);
    hgc.shape = ggc.shape = cshape;
    DLTensor hgi = f32(kDLCPU, gin_cpu), ggi = f32(kDLCUDA, dgin);
    hgc.ndim = ggc.ndim = hgi.ndim = ggi.ndim = 2;
    hgi.shape = ggi.shape = shape2;
    assert_int_equal(epipe_codec_encode_backward(c, 1, &hgc, &hgi), EPIPE_OK);
    int rc = epipe_codec_encode_backward(g, 1, &ggc, &ggi);
    if (rc)
        fail_msg("encode_backward: %s", epipe_codec_last_error(g));
    assert_int_equal(dev_copy(gin_gpu, dgin, sizeof gin_gpu), 0);
    assert_memory_equal(gin_gpu, gin_cpu, sizeof gin_cpu);
    DLTensor *gc = NULL, *gg = NULL;
    assert_int_equal(epipe_codec_tensor(c, 0, NULL, NULL, &gc), EPIPE_OK);
    assert_int_equal(epipe_codec_tensor(g, 0, NULL, NULL, &gg), EPIPE_OK);
    assert_int_equal(gg->device.device_type, kDLCPU);
    size_t count = 1;
    for (int d = 0; d < gc->ndim; d++)
        count *= (size_t)gc->shape[d];
    assert_memory_equal(gg->data, gc->data, count * sizeof(float));
    dev_free(dx), dev_free(dg), dev_free(dgin);
    epipe_codec_destroy(c), epipe_codec_destroy(g);
}

/* max |a - b| over max |a| */
static double rel_diff(const float *a, const float *b, size_t n)
{
    double d = 0, m = 0;
    for (size_t i = 0; i < n; i++) {
        double e = (double)a[i] - b[i];
        d = e < 0 ? (-e > d ? -e : d) : (e > d ? e : d);
        m = a[i] < 0 ? (-a[i] > m ? -a[i] : m) : (a[i] > m ? a[i] : m);
    }
    return m > 0 ? d / m : d;
}

/* One spec on a CUDA tensor of `shape` through the module's insert loops
 * (mode 1: without train ops; 2: with): calls that keep nothing run on
 * the module (its call count grows) with the parameters the core lends,
 * giving the CPU's codes within rounding and restoring the CPU's payload
 * alike, from host and device payloads; a parameter the host changes
 * reaches the next call; the CPU's refusals (a shape that does not fit, a
 * NaN) hold; then training, below. */
static void insert_spec(const char *spec, int64_t *shape, int ndim, size_t zn, int mode)
{
    insert_kernels(mode);
    epipe_codec *c = make(spec), *g = make(spec);
    if (!c) {
        print_message("  %s: not in this build, skipped\n", spec);
        return;
    }
    static float x[N], yc[N], yg[N], z[N], gin_c[N], gin_g[N];
    static uint8_t pc[8 * N], pg[8 * N];
    size_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= (size_t)shape[d];
    assert_true(n <= N && zn <= N);
    fill(x, n, 4);
    float *dx = dev_alloc(n * 4), *dy = dev_alloc(n * 4), *dz = dev_alloc(zn * 4);
    uint8_t *dp = dev_alloc(sizeof pg);
    assert_int_equal(dev_copy(dx, x, n * 4), 0);
    DLTensor hx = f32(kDLCPU, x), gx = f32(kDLCUDA, dx), hy = f32(kDLCPU, yc),
             gy = f32(kDLCUDA, dy);
    hx.ndim = gx.ndim = hy.ndim = gy.ndim = ndim;
    hx.shape = gx.shape = hy.shape = gy.shape = shape;
    size_t cap = 0;
    assert_int_equal(epipe_codec_max_encoded_size(g, &gx, &cap), EPIPE_OK);
    for (int step = 0; step < 2; step++) {
        if (step) /* the host changes a weight of each: the next call uses it */
            for (int i = 0; i < 2; i++) {
                DLTensor *pcw, *pgw;
                assert_int_equal(epipe_codec_tensor(c, (unsigned)i, NULL, &pcw, NULL), EPIPE_OK);
                assert_int_equal(epipe_codec_tensor(g, (unsigned)i, NULL, &pgw, NULL), EPIPE_OK);
                ((float *)pcw->data)[1] += 0.5f, ((float *)pgw->data)[1] += 0.5f;
            }
        unsigned long before = insert_calls();
        size_t wc = 0, wg = 0;
        assert_int_equal(epipe_codec_encode(c, &hx, pc, sizeof pc, &wc), EPIPE_OK);
        int rc = epipe_codec_encode(g, &gx, step ? (void *)dp : pg, cap, &wg);
        if (rc)
            fail_msg("%s: %s", spec, epipe_codec_last_error(g));
        assert_int_equal(insert_calls(), before + 1);
        assert_int_equal(wg, wc);
        if (step)
            assert_int_equal(dev_copy(pg, dp, wg), 0);
        assert_memory_equal(pg, pc, 16); /* the header */
        /* the codes: the CPU's within rounding (fp32 codes here) */
        float zc[64], zg[64];
        size_t m = zn < 64 ? zn : 64;
        memcpy(zc, pc + 16, m * 4), memcpy(zg, pg + 16, m * 4);
        assert_true(rel_diff(zc, zg, m) < 1e-5);
        assert_int_equal(epipe_codec_decode(c, pc, wc, &hy), EPIPE_OK);
        if (!step)
            assert_int_equal(dev_copy(dp, pc, wc), 0);
        rc = epipe_codec_decode(g, step ? pc : (void *)dp, wc, &gy);
        if (rc)
            fail_msg("%s decode: %s", spec, epipe_codec_last_error(g));
        assert_int_equal(insert_calls(), before + 2);
        assert_int_equal(dev_copy(yg, dy, n * 4), 0);
        assert_true(rel_diff(yc, yg, n) < 1e-5);
    }
    /* a corrupt code: refused as on the CPU */
    size_t wc = 0;
    assert_int_equal(epipe_codec_encode(c, &hx, pc, sizeof pc, &wc), EPIPE_OK);
    pc[16 + 3] = 0x7f, pc[16 + 2] = 0x80, pc[16 + 1] = 0, pc[16] = 0; /* +inf */
    assert_int_equal(epipe_codec_decode(g, pc, wc, &gy), EPIPE_EPROTO);
    /* a NaN, named by its index */
    float nan = NAN;
    assert_int_equal(dev_copy(dx + 7, &nan, 4), 0);
    size_t w = 0;
    assert_int_equal(epipe_codec_encode(g, &gx, pg, cap, &w), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_codec_last_error(g), "index 7"));
    assert_int_equal(dev_copy(dx, x, n * 4), 0);
    /* training. Mode 1 (no train ops): the forward staged, the CPU's
     * bytes, the module not called; the backward on the CPU's caches
     * whatever the knob says by then. Mode 2: forward and backward on the
     * module, the gradients (and the parameters', in the host's tensors)
     * the CPU's within rounding. */
    unsigned long before = insert_calls();
    assert_int_equal(epipe_codec_set_param(c, EPIPE_CODEC_MICROBATCH, 2), EPIPE_OK);
    assert_int_equal(epipe_codec_set_param(g, EPIPE_CODEC_MICROBATCH, 2), EPIPE_OK);
    size_t wg = 0;
    assert_int_equal(epipe_codec_encode(c, &hx, pc, sizeof pc, &wc), EPIPE_OK);
    assert_int_equal(epipe_codec_encode(g, &gx, pg, cap, &wg), EPIPE_OK);
    assert_int_equal(wg, wc);
    if (mode == 1) {
        assert_int_equal(insert_calls(), before);
        assert_memory_equal(pg, pc, wc);
        assert_int_equal(epipe_codec_set_param(g, EPIPE_CODEC_MICROBATCH, -1), EPIPE_OK);
    } else {
        assert_int_equal(insert_calls(), before + 1);
        assert_int_equal(epipe_codec_decode(c, pc, wc, &hy), EPIPE_OK);
        assert_int_equal(epipe_codec_decode(g, pc, wc, &gy), EPIPE_OK);
    }
    int zndim = 0;
    int64_t zshape[EPIPE_CODEC_MAX_NDIM];
    assert_int_equal(epipe_codec_code_shape(c, &hx, &zndim, zshape), EPIPE_OK);
    fill(z, zn, 5);
    assert_int_equal(dev_copy(dz, z, zn * 4), 0);
    DLTensor hz = f32(kDLCPU, z), gz = f32(kDLCUDA, dz), hgi = hx, ggi = gx;
    hz.ndim = gz.ndim = zndim;
    hz.shape = gz.shape = zshape;
    hgi.data = gin_c, ggi.data = dy;
    assert_int_equal(epipe_codec_encode_backward(c, 2, &hz, &hgi), EPIPE_OK);
    int rc = epipe_codec_encode_backward(g, 2, &gz, &ggi);
    if (rc)
        fail_msg("%s backward: %s", spec, epipe_codec_last_error(g));
    assert_int_equal(dev_copy(gin_g, dy, n * 4), 0);
    if (mode == 1) {
        assert_memory_equal(gin_g, gin_c, n * 4);
        assert_int_equal(insert_calls(), before);
    } else {
        assert_true(rel_diff(gin_c, gin_g, n) < 1e-5);
        assert_int_equal(insert_calls(), before + 3);
        /* the decoder's backward: gy (gin_c, as a gradient) to the code's */
        static float gz_c[N], gz_g[N];
        assert_int_equal(dev_copy(dy, gin_c, n * 4), 0);
        DLTensor hgy = hgi, ggy = ggi, hgz = hz, ggz = gz;
        hgy.data = gin_c, hgz.data = gz_c;
        assert_int_equal(epipe_codec_decode_backward(c, 2, &hgy, &hgz), EPIPE_OK);
        rc = epipe_codec_decode_backward(g, 2, &ggy, &ggz);
        if (rc)
            fail_msg("%s decode backward: %s", spec, epipe_codec_last_error(g));
        assert_int_equal(dev_copy(gz_g, dz, zn * 4), 0);
        assert_true(rel_diff(gz_c, gz_g, zn) < 1e-5);
        /* each forward serves one backward; a host gradient beside a CUDA one is refused */
        assert_int_equal(epipe_codec_decode_backward(g, 2, &ggy, &ggz), EPIPE_ESTATE);
        assert_int_equal(epipe_codec_encode(g, &gx, pg, cap, &wg), EPIPE_OK);
        assert_int_equal(epipe_codec_encode_backward(g, 2, &gz, &hgi), EPIPE_EINVAL);
        for (unsigned i = 0; i < 2; i++) {
            DLTensor *gc, *gg;
            assert_int_equal(epipe_codec_tensor(c, i, NULL, NULL, &gc), EPIPE_OK);
            assert_int_equal(epipe_codec_tensor(g, i, NULL, NULL, &gg), EPIPE_OK);
            assert_int_equal(gg->device.device_type, kDLCPU);
            size_t count = 1;
            for (int d = 0; d < gc->ndim; d++)
                count *= (size_t)gc->shape[d];
            assert_true(rel_diff(gc->data, gg->data, count) < 1e-5);
        }
    }
    dev_free(dx), dev_free(dy), dev_free(dz), dev_free(dp);
    epipe_codec_destroy(c), epipe_codec_destroy(g);
}

static void test_insert_on_the_module(void **state)
{
    (void)state;
    int64_t conv[4] = {2, 4, 4, 8}, lin[2] = {ROWS, COLS};
    for (int mode = 1; mode <= 2; mode++) {
        insert_spec("insert:kind=conv,out=3,kernel=2,seed=7", conv, 4, 2 * 3 * 2 * 4, mode);
        insert_spec("insert:kind=linear,out=16,seed=5", lin, 2, ROWS * 16, mode);
    }
    /* a shape the CPU refuses is refused alike, before the module runs */
    epipe_codec *g = make("insert:kind=conv,out=2,kernel=3");
    if (g) {
        float *dx = dev_alloc(2 * 4 * 4 * 8 * 4);
        DLTensor gx = f32(kDLCUDA, dx);
        gx.ndim = 4;
        gx.shape = conv;
        uint8_t p[4096];
        size_t w = 0;
        assert_int_equal(epipe_codec_encode(g, &gx, p, sizeof p, &w), EPIPE_EINVAL);
        assert_non_null(strstr(epipe_codec_last_error(g), "divisible by kernel=3"));
        dev_free(dx);
        epipe_codec_destroy(g);
    }
    insert_kernels(0);
}

/* A child forked after the parent set CUDA up cannot use it: there a CUDA
 * tensor is EPIPE_ENOTSUP saying so, host tensors still encode, and the
 * parent's CUDA handles neither reach CUDA nor hang, even when another
 * thread of the parent was inside the CUDA loader at fork(). */
static int hammering = 1; /* read and written with __atomic builtins */

static void *hammer(void *p)
{
    epipe_codec *c = p;
    while (__atomic_load_n(&hammering, __ATOMIC_RELAXED))
        epipe_codec_synchronize(c); /* takes the loader's lock each time */
    return NULL;
}

static int forked_child_main(epipe_codec *parents, float *dx, float *x)
{
    alarm(10); /* a hang ends as SIGALRM, which the parent reports */
    static uint8_t p[8 * N];
    size_t w = 0;
    epipe_codec *c = NULL;
    if (epipe_codec_create(&c, "quant:bits=8") != EPIPE_OK)
        return 2;
    DLTensor gx = f32(kDLCUDA, dx), hx = f32(kDLCPU, x);
    if (epipe_codec_encode(c, &gx, p, sizeof p, &w) != EPIPE_ENOTSUP ||
        !strstr(epipe_codec_last_error(c), "forked after CUDA was set up"))
        return 3;
    epipe_codec_destroy(c);
    if (epipe_codec_create(&c, "quant:bits=8") != EPIPE_OK ||
        epipe_codec_encode(c, &hx, p, sizeof p, &w) != EPIPE_OK)
        return 4;
    epipe_codec_destroy(c);
    /* the parent's handle, bound to CUDA: its calls take the loader's lock
     * and must not reach CUDA (nor is it destroyed here: CUDA's pinned
     * memory is not mapped in a child, and is deliberately not freed) */
    if (epipe_codec_synchronize(parents) != EPIPE_OK)
        return 5;
    return 0;
}

static void test_forked_child(void **state)
{
    (void)state;
    static float x[N];
    static uint8_t p[8 * N];
    fill(x, N, 3);
    float *dx = dev_alloc(sizeof x);
    assert_int_equal(dev_copy(dx, x, sizeof x), 0);
    epipe_codec *c = make("quant:bits=8"), *busy = make("quant:bits=8");
    DLTensor gx = f32(kDLCUDA, dx);
    size_t w = 0;
    assert_int_equal(epipe_codec_encode(c, &gx, p, sizeof p, &w), EPIPE_OK);
    assert_int_equal(epipe_codec_encode(busy, &gx, p, sizeof p, &w), EPIPE_OK);
    __atomic_store_n(&hammering, 1, __ATOMIC_RELAXED);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, hammer, busy), 0);
    for (int k = 0; k < 40; k++) {
        fflush(NULL);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0)
            _exit(forked_child_main(c, dx, x));
        int st = 0;
        assert_int_equal(waitpid(pid, &st, 0), pid);
        if (WIFSIGNALED(st))
            fail_msg("fork %d: the child was killed by signal %d (SIGALRM %d: it hung)", k,
                     WTERMSIG(st), SIGALRM);
        if (WEXITSTATUS(st))
            fail_msg("fork %d: the child exited %d", k, WEXITSTATUS(st));
    }
    __atomic_store_n(&hammering, 0, __ATOMIC_RELAXED);
    pthread_join(th, NULL);
    /* the parent's CUDA is untouched */
    assert_int_equal(epipe_codec_encode(c, &gx, p, sizeof p, &w), EPIPE_OK);
    epipe_codec_destroy(c);
    epipe_codec_destroy(busy);
    dev_free(dx);
}

int main(void)
{
    const char *path = getenv("EPIPE_CUDA_MODULE");
    void *so = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
    if (!so) {
        fprintf(stderr, "EPIPE_CUDA_MODULE must name the test module (fakecuda): %s\n",
                path ? dlerror() : "unset");
        return 1;
    }
    *(void **)&dev_alloc = dlsym(so, "fakecuda_alloc");
    *(void **)&dev_free = dlsym(so, "fakecuda_free");
    *(void **)&dev_copy = dlsym(so, "fakecuda_copy");
    *(void **)&last_stream = dlsym(so, "fakecuda_last_stream");
    *(void **)&host_allocs = dlsym(so, "fakecuda_host_allocs");
    *(void **)&insert_kernels = dlsym(so, "fakecuda_insert_kernels");
    *(void **)&insert_calls = dlsym(so, "fakecuda_insert_calls");
    if (!dev_alloc || !dev_free || !dev_copy || !last_stream || !host_allocs || !insert_kernels ||
        !insert_calls) {
        fprintf(stderr, "%s is not the test CUDA module\n", path);
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_payloads_equal_cpu),
        cmocka_unit_test(test_deltas_equal_cpu),
        cmocka_unit_test(test_half_tensors),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_copies_on_handle_stream),
        cmocka_unit_test(test_backward_equals_cpu),
        cmocka_unit_test(test_insert_on_the_module),
        cmocka_unit_test(test_forked_child),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
