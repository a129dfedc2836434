/* The gpu suite: CUDA tensors through the public codec API, checked against
 * the CPU backend's bytes (none, cast, quant), round trips, deferred errors,
 * hostile payloads and host/device mix-ups. Exit 77 without a device. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include <epipe/epipe.h>

#include "../../codecs/inline/sortquant.h"
#include "gpu_test.h"

static DLTensor tensor(int type, void *data, int64_t *shape, int bits, int code)
{
    DLTensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.device.device_type = (DLDeviceType)type;
    t.device.device_id = 0;
    t.ndim = 1;
    t.shape = shape;
    t.dtype.code = (uint8_t)code;
    t.dtype.bits = (uint8_t)bits;
    t.dtype.lanes = 1;
    return t;
}

static void fill(std::vector<float> &x, unsigned seed)
{
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < x.size(); i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        double u = (double)(s >> 11) / 9007199254740992.0;
        x[i] = (float)((u - 0.5) * 8.0 * (1.0 + (double)(i % 7)));
    }
}

/* Encodes x[offset..] on the CPU and on the GPU (pinned payload) and
 * compares the bytes; decodes each payload on the other side and compares
 * the floats. */
static void byte_identity_of(const char *spec, std::vector<float> &x, size_t offset)
{
    size_t n = x.size() - offset;
    int64_t shape[1] = {(int64_t)n};
    epipe_codec *cpu, *gpu;
    CHECK(epipe_codec_create(&cpu, spec) == EPIPE_OK, "%s", epipe_last_error());
    CHECK(epipe_codec_create(&gpu, spec) == EPIPE_OK, "%s", epipe_last_error());
    DLTensor hs = tensor(kDLCPU, x.data() + offset, shape, 32, kDLFloat);
    size_t cap = 0;
    CHECK(epipe_codec_max_encoded_size(cpu, &hs, &cap) == EPIPE_OK, "size");
    std::vector<uint8_t> pc(cap);
    uint8_t *pg;
    CUDA_OK(cudaHostAlloc((void **)&pg, cap ? cap : 1, cudaHostAllocDefault));
    size_t wc = 0, wg = 0;
    CHECK(epipe_codec_encode(cpu, &hs, pc.data(), cap, &wc) == EPIPE_OK, "%s",
          epipe_codec_last_error(cpu));
    float *dx, *dy;
    CUDA_OK(cudaMalloc((void **)&dx, (n + offset) * 4 + 4));
    CUDA_OK(cudaMalloc((void **)&dy, (n + offset) * 4 + 4));
    CUDA_OK(cudaMemcpy(dx, x.data(), (n + offset) * 4, cudaMemcpyHostToDevice));
    DLTensor ds = tensor(kDLCUDA, dx + offset, shape, 32, kDLFloat);
    int rc = epipe_codec_encode(gpu, &ds, pg, cap, &wg);
    CHECK(rc == EPIPE_OK, "%s: gpu encode: %s", spec, epipe_codec_last_error(gpu));
    CHECK(epipe_codec_synchronize(gpu) == EPIPE_OK, "%s", epipe_codec_last_error(gpu));
    CHECK(wc == wg, "%s: sizes %zu vs %zu", spec, wc, wg);
    size_t diff = wc;
    for (size_t i = 0; i < wc && i < wg; i++)
        if (pc[i] != pg[i]) {
            diff = i;
            break;
        }
    CHECK(diff == wc, "%s n=%zu offset=%zu: payloads differ first at byte %zu", spec, n, offset,
          diff);
    /* the GPU decodes the CPU's payload as the CPU does */
    std::vector<float> yc(n + 1), yg(n + 1);
    DLTensor hd = tensor(kDLCPU, yc.data(), shape, 32, kDLFloat);
    DLTensor dd = tensor(kDLCUDA, dy + offset, shape, 32, kDLFloat);
    CHECK(epipe_codec_decode(cpu, pc.data(), wc, &hd) == EPIPE_OK, "cpu decode");
    CHECK(epipe_codec_decode(gpu, pc.data(), wc, &dd) == EPIPE_OK, "%s: gpu decode: %s", spec,
          epipe_codec_last_error(gpu));
    CHECK(epipe_codec_synchronize(gpu) == EPIPE_OK, "%s", epipe_codec_last_error(gpu));
    CUDA_OK(cudaMemcpy(yg.data(), dy + offset, n * 4, cudaMemcpyDeviceToHost));
    CHECK(n == 0 || memcmp(yc.data(), yg.data(), n * 4) == 0, "%s: decoded floats differ", spec);
    /* The same through a payload in device memory, at an offset that is
     * not 16-byte aligned (offset 1) so the vector paths must notice. */
    uint8_t *dp;
    CUDA_OK(cudaMalloc((void **)&dp, cap + 16));
    uint8_t *dpo = dp + (offset ? 4 : 0);
    size_t wd = 0;
    rc = epipe_codec_encode(gpu, &ds, dpo, cap, &wd);
    CHECK(rc == EPIPE_OK, "%s: gpu encode to device memory: %s", spec, epipe_codec_last_error(gpu));
    CHECK(epipe_codec_synchronize(gpu) == EPIPE_OK, "%s", epipe_codec_last_error(gpu));
    CHECK(wd == wc, "%s: device payload sizes %zu vs %zu", spec, wd, wc);
    std::vector<uint8_t> back(wd);
    CUDA_OK(cudaMemcpy(back.data(), dpo, wd, cudaMemcpyDeviceToHost));
    CHECK(wd != wc || memcmp(back.data(), pc.data(), wc) == 0,
          "%s n=%zu offset=%zu: device payload differs from the CPU's", spec, n, offset);
    CUDA_OK(cudaMemcpy(dpo, pc.data(), wc, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(dy, 0, (n + offset) * 4 + 4));
    CHECK(epipe_codec_decode(gpu, dpo, wc, &dd) == EPIPE_OK,
          "%s: gpu decode from device memory: %s", spec, epipe_codec_last_error(gpu));
    CHECK(epipe_codec_synchronize(gpu) == EPIPE_OK, "%s", epipe_codec_last_error(gpu));
    CUDA_OK(cudaMemcpy(yg.data(), dy + offset, n * 4, cudaMemcpyDeviceToHost));
    CHECK(n == 0 || memcmp(yc.data(), yg.data(), n * 4) == 0,
          "%s: decoded floats from a device payload differ", spec);
    cudaFree(dp);
    epipe_codec_destroy(cpu);
    epipe_codec_destroy(gpu);
    cudaFree(dx);
    cudaFree(dy);
    cudaFreeHost(pg);
}

/* byte_identity_of on n values (from the 4-byte `offset` on) of the suite's
 * data: spread over a few binades; with `relu`, half zeros, a third of
 * them -0 (the fit's extent must not care which zero it met first); with
 * relu == 2, also few distinct values, so that exact mode's boundaries cut
 * through runs of equal values (ties by index). */
static void byte_identity(const char *spec, size_t n, size_t offset, int relu = 0)
{
    std::vector<float> x(n + offset);
    fill(x, (unsigned)n);
    for (size_t i = 0; relu && i < x.size(); i++)
        if (x[i] <= 0.0f)
            x[i] = i % 3 ? 0.0f : -0.0f;
    for (size_t i = 0; relu == 2 && i < x.size(); i++)
        if (x[i] != 0.0f)
            x[i] = (float)(int)(x[i] * 2.0f);
    byte_identity_of(spec, x, offset);
}

/* topk's CUDA encode stages the entries at or above a magnitude drawn from
 * a sample of x (sortquant's strata) and stages every entry again when
 * fewer than k reach it. Here the sample holds large values that x holds
 * nowhere else, so the sample's threshold is above the k-th largest, and
 * the second pass must run for the bytes to be the CPU's. */
static void topk_sample_misses(size_t n, double ratio, uint64_t m)
{
    std::vector<float> x(n);
    fill(x, 11);
    for (size_t i = 0; i < n; i++)
        x[i] *= 0.01f;
    uint64_t k = (uint64_t)ceil(ratio * (double)n);
    for (uint64_t j = 0; j < m && j < k / 2; j++) /* far fewer than k, but most of the sample's */
        x[epipe_hd_sq_sample_pos(j * (m / (k / 2)), n, m)] = 100.0f + (float)j;
    char spec[64];
    snprintf(spec, sizeof spec, "topk:ratio=%g", ratio);
    byte_identity_of(spec, x, 0);
}

/* What the CPU codec `spec` makes of n values (fill's `seed`), exactly
 * as long as it is. */
static std::vector<uint8_t> cpu_payload(const char *spec, size_t n, unsigned seed)
{
    std::vector<float> x(n);
    fill(x, seed);
    int64_t shape[1] = {(int64_t)n};
    DLTensor hs = tensor(kDLCPU, x.data(), shape, 32, kDLFloat);
    epipe_codec *cpu;
    CHECK(epipe_codec_create(&cpu, spec) == EPIPE_OK, "%s", spec);
    size_t cap = 0, w = 0;
    epipe_codec_max_encoded_size(cpu, &hs, &cap);
    std::vector<uint8_t> p(cap);
    CHECK(epipe_codec_encode(cpu, &hs, p.data(), cap, &w) == EPIPE_OK, "%s: %s", spec,
          epipe_codec_last_error(cpu));
    epipe_codec_destroy(cpu);
    p.resize(w);
    return p;
}

/* Device memory holding the first w bytes of p (cudaFree it). */
static uint8_t *device_copy(const std::vector<uint8_t> &p, size_t w)
{
    uint8_t *d;
    CUDA_OK(cudaMalloc((void **)&d, w));
    CUDA_OK(cudaMemcpy(d, p.data(), w, cudaMemcpyHostToDevice));
    return d;
}

/* The status of a decode: its own, or where it enqueued (a device
 * payload whose checks the module defers), the next synchronize's. */
static int decode_status(epipe_codec *g, const void *p, size_t w, DLTensor *dst)
{
    int rc = epipe_codec_decode(g, p, w, dst);
    return rc ? rc : epipe_codec_synchronize(g);
}

/* Hostile bytes in a device payload: refused with the CPU's status, by
 * the decode (sortquant's fit mode, whose tables are read back first) or
 * by the synchronize after it (the others: their header and tables are
 * checked there, docs/codec-backends.md); a payload of the wrong length
 * at once; a payload in device memory with a CPU tensor (either way) by
 * name. */
static void hostile_device_payload(void)
{
    size_t n = 999;
    std::vector<float> x(n);
    fill(x, 5);
    int64_t shape[1] = {(int64_t)n};
    DLTensor hs = tensor(kDLCPU, x.data(), shape, 32, kDLFloat);
    float *d;
    uint8_t *dp;
    CUDA_OK(cudaMalloc((void **)&d, n * 4));
    CUDA_OK(cudaMalloc((void **)&dp, n * 4 + 1024));
    DLTensor dd = tensor(kDLCUDA, d, shape, 32, kDLFloat);
    std::vector<float> ho(n);
    DLTensor hs_out = tensor(kDLCPU, ho.data(), shape, 32, kDLFloat);
    const char *specs[] = {"quant:bits=4", "sortquant:bits=4,mode=sample",
                           "sortquant:bits=4,mode=fit", "sortquant:bits=4,mode=exact"};
    for (const char *spec : specs) {
        epipe_codec *cpu, *gpu;
        epipe_codec_create(&cpu, spec);
        epipe_codec_create(&gpu, spec);
        std::vector<uint8_t> p(n * 4 + 1024);
        size_t w = 0;
        CHECK(epipe_codec_encode(cpu, &hs, p.data(), p.size(), &w) == EPIPE_OK, "%s", spec);
        /* the first chunk's min made NaN (its two high bytes), the padding
         * bits after the last 4-bit code, a header byte */
        size_t min_at = 16 + (strstr(spec, "fit") ? 4 : 0) + 2;
        size_t at[3] = {min_at, w - 1, 5};
        for (size_t b = 0; b < 3; b++) {
            std::vector<uint8_t> q(p.begin(), p.begin() + w);
            if (b == 0)
                q[at[b]] = q[at[b] + 1] = 0xff;
            else
                q[at[b]] ^= b == 1 ? 0x80 : 0x5a;
            CUDA_OK(cudaMemcpy(dp, q.data(), w, cudaMemcpyHostToDevice));
            int rc = decode_status(gpu, dp, w, &dd);
            CHECK(rc == EPIPE_EPROTO || (b == 2 && (rc == EPIPE_EVERSION || rc == EPIPE_EINVAL)),
                  "%s: corrupt byte %zu of a device payload: rc %d (%s)", spec, at[b], rc,
                  epipe_codec_last_error(gpu));
            int rc_cpu = epipe_codec_decode(cpu, q.data(), w, &hs_out);
            CHECK(rc == rc_cpu && !strcmp(epipe_codec_last_error(gpu), epipe_codec_last_error(cpu)),
                  "%s: corrupt byte %zu: the GPU says %d '%s', the CPU %d '%s'", spec, at[b], rc,
                  epipe_codec_last_error(gpu), rc_cpu, epipe_codec_last_error(cpu));
        }
        CUDA_OK(cudaMemcpy(dp, p.data(), w, cudaMemcpyHostToDevice));
        CHECK(epipe_codec_decode(gpu, dp, w, &dd) == EPIPE_OK, "%s: %s", spec,
              epipe_codec_last_error(gpu));
        CHECK(epipe_codec_decode(gpu, dp, w - 1, &dd) == EPIPE_ETRUNC, "%s: truncated", spec);
        CHECK(epipe_codec_synchronize(gpu) == EPIPE_OK, "%s", epipe_codec_last_error(gpu));
        /* device memory with a CPU tensor */
        CHECK(epipe_codec_encode(cpu, &hs, dp, n * 4 + 1024, &w) == EPIPE_EINVAL,
              "%s: cpu into device", spec);
        CHECK(strstr(epipe_codec_last_error(cpu), "dst is CUDA device memory") != NULL, "%s",
              epipe_codec_last_error(cpu));
        std::vector<float> y(n);
        DLTensor hy = tensor(kDLCPU, y.data(), shape, 32, kDLFloat);
        CHECK(epipe_codec_decode(cpu, dp, w, &hy) == EPIPE_EINVAL, "%s: device payload to cpu",
              spec);
        CHECK(strstr(epipe_codec_last_error(cpu), "src is CUDA device memory") != NULL, "%s",
              epipe_codec_last_error(cpu));
        epipe_codec_destroy(cpu);
        epipe_codec_destroy(gpu);
    }
    /* topk: entries are checked on the device; a bad one surfaces at
     * synchronize, naming the first */
    epipe_codec *cpu, *gpu;
    epipe_codec_create(&cpu, "topk:ratio=0.1");
    epipe_codec_create(&gpu, "topk:ratio=0.1");
    std::vector<uint8_t> p(n * 8 + 64);
    size_t w = 0;
    CHECK(epipe_codec_encode(cpu, &hs, p.data(), p.size(), &w) == EPIPE_OK, "topk");
    const size_t k = 100, body = 16; /* ceil(0.1 * 999) */
    const struct {
        size_t at;
        uint32_t v;
        const char *says;
    } bad[] = {{body + 4 * 7, 5000, "entry 7 has an index out of range"},
               {body + 4 * 9, 0, "entry 9 breaks the ascending index order"},
               {body + 4 * k + 4 * 3, 0x7fc00000u, "entry 3 has a value that is not finite"}};
    for (const auto &b : bad) {
        std::vector<uint8_t> q(p.begin(), p.begin() + w);
        memcpy(&q[b.at], &b.v, 4);
        for (int on_device = 0; on_device < 2; on_device++) {
            CUDA_OK(cudaMemcpy(dp, q.data(), w, cudaMemcpyHostToDevice));
            CHECK(epipe_codec_decode(gpu, on_device ? (const void *)dp : q.data(), w, &dd) ==
                      EPIPE_OK,
                  "topk enqueue: %s", epipe_codec_last_error(gpu));
            CHECK(epipe_codec_synchronize(gpu) == EPIPE_EPROTO, "topk: '%s' not reported", b.says);
            CHECK(strstr(epipe_codec_last_error(gpu), b.says) != NULL, "topk: '%s'",
                  epipe_codec_last_error(gpu));
        }
    }
    CHECK(epipe_codec_synchronize(gpu) == EPIPE_OK, "topk: reported once");
    epipe_codec_destroy(cpu);
    epipe_codec_destroy(gpu);
    cudaFree(dp);
    cudaFree(d);
}

/* fp16 and bf16 device tensors: staged on the device as the CPU stages. */
/* The checks a device payload's decode defers: the decode returns once
 * enqueued, and the next synchronize returns the CPU's status and message
 * for the first bad payload decoded since, once; a good payload decoded
 * after it is decoded right all the same. Past 16 decodes waiting for
 * their checks, the module waits and runs those, and holds a failure for
 * synchronize. `corrupt` bytes of the payload are set to 0xff. A tensor
 * of [rows, 4000 / rows]; tol > 0: the decoded floats within tol of the
 * CPU's, relative to their largest (the codecs on cuBLAS and cuDNN). */
static void deferred_checks(const char *spec, std::vector<size_t> corrupt, int64_t rows = 1,
                            double tol = 0)
{
    size_t n = 4000;
    std::vector<float> x(n), yc(n), yg(n);
    fill(x, 11);
    int64_t shape[2] = {rows, (int64_t)n / rows};
    DLTensor hs = tensor(kDLCPU, x.data(), shape, 32, kDLFloat);
    DLTensor hy = tensor(kDLCPU, yc.data(), shape, 32, kDLFloat);
    hs.ndim = hy.ndim = 2;
    epipe_codec *cpu, *gpu;
    CHECK(epipe_codec_create(&cpu, spec) == EPIPE_OK && epipe_codec_create(&gpu, spec) == EPIPE_OK,
          "%s", spec);
    size_t cap = 0, w = 0;
    epipe_codec_max_encoded_size(cpu, &hs, &cap);
    std::vector<uint8_t> good(cap), bad;
    CHECK(epipe_codec_encode(cpu, &hs, good.data(), cap, &w) == EPIPE_OK, "%s", spec);
    good.resize(w);
    bad = good;
    for (size_t at : corrupt)
        bad[at] = 0xff;
    int want = epipe_codec_decode(cpu, bad.data(), w, &hy);
    char says[512];
    snprintf(says, sizeof says, "%s", epipe_codec_last_error(cpu));
    CHECK(want != EPIPE_OK, "%s: the CPU takes the corrupt payload", spec);
    CHECK(epipe_codec_decode(cpu, good.data(), w, &hy) == EPIPE_OK, "%s", spec);
    uint8_t *dbad = device_copy(bad, w), *dgood = device_copy(good, w);
    float *d1, *d2;
    CUDA_OK(cudaMalloc((void **)&d1, n * 4));
    CUDA_OK(cudaMalloc((void **)&d2, n * 4));
    DLTensor t1 = tensor(kDLCUDA, d1, shape, 32, kDLFloat),
             t2 = tensor(kDLCUDA, d2, shape, 32, kDLFloat);
    t1.ndim = t2.ndim = 2;
    for (int decodes = 2; decodes <= 21; decodes += 19) { /* 21: past the 16 that wait */
        CHECK(epipe_codec_decode(gpu, dbad, w, &t1) == EPIPE_OK,
              "%s: a corrupt device payload was refused before synchronize: %s", spec,
              epipe_codec_last_error(gpu));
        CUDA_OK(cudaMemset(d2, 0, n * 4));
        for (int i = 1; i < decodes; i++)
            CHECK(epipe_codec_decode(gpu, dgood, w, &t2) == EPIPE_OK, "%s: %s", spec,
                  epipe_codec_last_error(gpu));
        int rc = epipe_codec_synchronize(gpu);
        CHECK(rc == want && !strcmp(epipe_codec_last_error(gpu), says),
              "%s, %d decodes: synchronize says %d '%s'; the CPU %d '%s'", spec, decodes, rc,
              epipe_codec_last_error(gpu), want, says);
        CHECK(epipe_codec_synchronize(gpu) == EPIPE_OK, "%s: reported twice", spec);
        CUDA_OK(cudaMemcpy(yg.data(), d2, n * 4, cudaMemcpyDeviceToHost));
        double gap = 0, top = 0;
        for (size_t i = 0; i < n; i++) {
            gap = fmax(gap, fabs((double)yc[i] - yg[i]));
            top = fmax(top, fabs((double)yc[i]));
        }
        CHECK(tol > 0 ? gap <= tol * top : memcmp(yc.data(), yg.data(), n * 4) == 0,
              "%s, %d decodes: the good payload after the bad one decoded wrong (%g off)", spec,
              decodes, gap);
    }
    cudaFree(dbad);
    cudaFree(dgood);
    cudaFree(d1);
    cudaFree(d2);
    epipe_codec_destroy(cpu);
    epipe_codec_destroy(gpu);
}

/* A deferred check reads the shape of its own decode (quant rows=1: one
 * table a row), whatever calls on the handle came between; and an encode
 * between a bad payload's decode and synchronize (ef=1 reads the status
 * word mid-call) is not failed by what that decode's kernels noted. */
static void deferred_checks_keep_to_their_call(void)
{
    epipe_codec *cpu, *gpu;
    epipe_codec_create(&cpu, "quant:bits=8,rows=1");
    epipe_codec_create(&gpu, "quant:bits=8,rows=1");
    std::vector<float> x(256);
    fill(x, 9);
    int64_t s4[2] = {4, 64}, s1[1] = {256};
    DLTensor h4 = tensor(kDLCPU, x.data(), s4, 32, kDLFloat);
    h4.ndim = 2;
    std::vector<uint8_t> p(1024), q(1024);
    size_t w4 = 0, w1 = 0;
    CHECK(epipe_codec_encode(cpu, &h4, p.data(), p.size(), &w4) == EPIPE_OK, "encode [4,64]");
    DLTensor h1 = tensor(kDLCPU, x.data(), s1, 32, kDLFloat);
    CHECK(epipe_codec_encode(cpu, &h1, q.data(), q.size(), &w1) == EPIPE_OK, "encode [256]");
    CHECK(w4 != w1, "the shapes' payloads differ in size");
    size_t row = (w4 - 16) / 4;
    p[16 + 3 * row + 7] = 0xff; /* row 3's step: NaN */
    p[16 + 3 * row + 6] = 0xff;
    std::vector<float> y(256);
    DLTensor hy = tensor(kDLCPU, y.data(), s4, 32, kDLFloat);
    hy.ndim = 2;
    int want = epipe_codec_decode(cpu, p.data(), w4, &hy);
    char says[512];
    snprintf(says, sizeof says, "%s", epipe_codec_last_error(cpu));
    uint8_t *dp = device_copy(p, w4), *dq = device_copy(q, w1);
    float *d;
    CUDA_OK(cudaMalloc((void **)&d, 256 * 4));
    DLTensor d4 = tensor(kDLCUDA, d, s4, 32, kDLFloat), d1 = tensor(kDLCUDA, d, s1, 32, kDLFloat);
    d4.ndim = 2;
    CHECK(epipe_codec_decode(gpu, dp, w4, &d4) == EPIPE_OK, "%s", epipe_codec_last_error(gpu));
    CHECK(epipe_codec_decode(gpu, dq, w1, &d1) == EPIPE_OK, "%s", epipe_codec_last_error(gpu));
    int rc = epipe_codec_synchronize(gpu);
    CHECK(want == EPIPE_EPROTO && rc == want && !strcmp(epipe_codec_last_error(gpu), says),
          "row 3 of [4,64], then a [256] payload: synchronize says %d '%s'; the CPU %d '%s'", rc,
          epipe_codec_last_error(gpu), want, says);
    epipe_codec_destroy(cpu);
    epipe_codec_destroy(gpu);
    /* topk's kernels refuse every entry of a payload of 0xff bytes, whose
     * codec id the CPU refuses first */
    epipe_codec_create(&cpu, "topk:ratio=0.1,ef=1");
    epipe_codec_create(&gpu, "topk:ratio=0.1,ef=1");
    size_t cap = 0;
    epipe_codec_max_encoded_size(cpu, &h1, &cap);
    std::vector<uint8_t> junk(cap, 0xff);
    hy.ndim = 1;
    hy.shape = s1;
    want = epipe_codec_decode(cpu, junk.data(), cap, &hy);
    snprintf(says, sizeof says, "%s", epipe_codec_last_error(cpu));
    uint8_t *dj = device_copy(junk, cap), *out;
    float *dx;
    CUDA_OK(cudaMalloc((void **)&out, cap));
    CUDA_OK(cudaMalloc((void **)&dx, 256 * 4));
    CUDA_OK(cudaMemcpy(dx, x.data(), 256 * 4, cudaMemcpyHostToDevice));
    DLTensor dx1 = tensor(kDLCUDA, dx, s1, 32, kDLFloat);
    size_t w = 0, wg = 0;
    /* a good payload of the GPU's own, for the decodes in between */
    CHECK(epipe_codec_encode(gpu, &dx1, dq, w1, &wg) == EPIPE_OK &&
              epipe_codec_synchronize(gpu) == EPIPE_OK,
          "%s", epipe_codec_last_error(gpu));
    for (int between = 0; between <= 16; between += 16) { /* 16: past those that wait */
        CHECK(epipe_codec_decode(gpu, dj, cap, &d1) == EPIPE_OK, "%s", epipe_codec_last_error(gpu));
        for (int i = 0; i < between; i++)
            CHECK(epipe_codec_decode(gpu, dq, wg, &d1) == EPIPE_OK, "%s",
                  epipe_codec_last_error(gpu));
        CHECK(epipe_codec_encode(gpu, &dx1, out, cap, &w) == EPIPE_OK,
              "an ef=1 encode after a bad payload's decode and %d good ones: %s", between,
              epipe_codec_last_error(gpu));
        rc = epipe_codec_synchronize(gpu);
        CHECK(rc == want && !strcmp(epipe_codec_last_error(gpu), says),
              "the bad payload at synchronize: %d '%s'; the CPU %d '%s'", rc,
              epipe_codec_last_error(gpu), want, says);
        CHECK(epipe_codec_synchronize(gpu) == EPIPE_OK, "reported once: %s",
              epipe_codec_last_error(gpu));
    }
    epipe_codec_destroy(cpu);
    epipe_codec_destroy(gpu);
    /* insert keeping a micro-batch's code for its backward checks at once:
     * a refused payload keeps no code, as on the CPU */
    const char *ins = "insert:kind=linear,out=8,seed=3";
    epipe_codec_create(&cpu, ins);
    epipe_codec_create(&gpu, ins);
    DLTensor hx4 = tensor(kDLCPU, x.data(), s4, 32, kDLFloat);
    hx4.ndim = 2;
    std::vector<uint8_t> pi(1024);
    size_t wi = 0;
    CHECK(epipe_codec_encode(cpu, &hx4, pi.data(), pi.size(), &wi) == EPIPE_OK, "insert: %s",
          epipe_codec_last_error(cpu));
    pi[0] = 0xff;
    epipe_codec_set_param(cpu, EPIPE_CODEC_MICROBATCH, 0);
    epipe_codec_set_param(gpu, EPIPE_CODEC_MICROBATCH, 0);
    hy.ndim = 2;
    hy.shape = s4;
    want = epipe_codec_decode(cpu, pi.data(), wi, &hy);
    CUDA_OK(cudaMemcpy(dj, pi.data(), wi, cudaMemcpyHostToDevice));
    rc = epipe_codec_decode(gpu, dj, wi, &d4);
    CHECK(want != EPIPE_OK && rc == want,
          "insert, kept for its backward: the decode says %d, the CPU %d", rc, want);
    epipe_codec_destroy(cpu);
    epipe_codec_destroy(gpu);
    /* a NaN an encode noted and a bad payload a decode deferred, on one
     * handle: synchronize returns the earlier call's error, and the next
     * synchronize the other's; neither is lost */
    epipe_codec_create(&cpu, "quant:bits=8");
    epipe_codec_create(&gpu, "quant:bits=8");
    std::vector<uint8_t> qp(1024);
    size_t wq = 0;
    CHECK(epipe_codec_encode(cpu, &h1, qp.data(), qp.size(), &wq) == EPIPE_OK, "quant");
    qp[0] = 0xff;
    uint8_t *dqp = device_copy(qp, wq), *qout;
    CUDA_OK(cudaMalloc((void **)&qout, wq));
    x[7] = NAN;
    CUDA_OK(cudaMemcpy(dx, x.data(), 256 * 4, cudaMemcpyHostToDevice));
    for (int encode_first = 1; encode_first >= 0; encode_first--) {
        for (int call = 0; call < 2; call++)
            if ((call == 0) == (encode_first == 1))
                CHECK(epipe_codec_encode(gpu, &dx1, qout, wq, &w) == EPIPE_OK, "enqueue: %s",
                      epipe_codec_last_error(gpu));
            else
                CHECK(epipe_codec_decode(gpu, dqp, wq, &d1) == EPIPE_OK, "enqueue: %s",
                      epipe_codec_last_error(gpu));
        int first = epipe_codec_synchronize(gpu);
        char said[512];
        snprintf(said, sizeof said, "%s", epipe_codec_last_error(gpu));
        int second = epipe_codec_synchronize(gpu);
        CHECK(first == (encode_first ? EPIPE_EINVAL : EPIPE_EPROTO) &&
                  second == (encode_first ? EPIPE_EPROTO : EPIPE_EINVAL),
              "%s first: synchronize says %d '%s', then %d '%s'",
              encode_first ? "the NaN's encode" : "the bad payload's decode", first, said, second,
              epipe_codec_last_error(gpu));
        CHECK(epipe_codec_synchronize(gpu) == EPIPE_OK, "a third error: %s",
              epipe_codec_last_error(gpu));
    }
    x[7] = 0.5f;
    cudaFree(dqp);
    cudaFree(qout);
    cudaFree(dp);
    cudaFree(dq);
    cudaFree(d);
    cudaFree(dj);
    cudaFree(out);
    cudaFree(dx);
    epipe_codec_destroy(cpu);
    epipe_codec_destroy(gpu);
}

/* A quant:bits=4 handle made under EPIPE_CUDA_DEFER_CHECKS = value
 * (NULL: unset), which it reads then. */
static epipe_codec *made_under(const char *value)
{
    epipe_codec *c = NULL;
    if (value)
        setenv("EPIPE_CUDA_DEFER_CHECKS", value, 1);
    else
        unsetenv("EPIPE_CUDA_DEFER_CHECKS");
    CHECK(epipe_codec_create(&c, "quant:bits=4") == EPIPE_OK, "%s", epipe_last_error());
    unsetenv("EPIPE_CUDA_DEFER_CHECKS");
    return c;
}

/* EPIPE_CUDA_DEFER_CHECKS=0 when the handle is made: a corrupt device
 * payload refused by the decode itself, as before; another value refused
 * by name; a change after the handle is made changes nothing. */
static void checks_at_once(void)
{
    size_t n = 1000;
    int64_t shape[1] = {(int64_t)n};
    epipe_codec *now = made_under("0"), *bad = made_under("later"), *gpu = made_under(NULL);
    std::vector<uint8_t> p = cpu_payload("quant:bits=4", n, 3);
    size_t w = p.size();
    p[0] = 0xff; /* the codec id */
    uint8_t *dp = device_copy(p, w);
    float *d;
    CUDA_OK(cudaMalloc((void **)&d, n * 4));
    DLTensor dd = tensor(kDLCUDA, d, shape, 32, kDLFloat);
    CHECK(epipe_codec_decode(now, dp, w, &dd) == EPIPE_EPROTO &&
              strstr(epipe_codec_last_error(now), "codec id 255"),
          "EPIPE_CUDA_DEFER_CHECKS=0: %s", epipe_codec_last_error(now));
    CHECK(epipe_codec_decode(bad, dp, w, &dd) == EPIPE_EINVAL &&
              strstr(epipe_codec_last_error(bad), "EPIPE_CUDA_DEFER_CHECKS = 'later'"),
          "a bad EPIPE_CUDA_DEFER_CHECKS: %s", epipe_codec_last_error(bad));
    setenv("EPIPE_CUDA_DEFER_CHECKS", "0", 1); /* read when the handle was made */
    CHECK(epipe_codec_decode(gpu, dp, w, &dd) == EPIPE_OK &&
              epipe_codec_synchronize(gpu) == EPIPE_EPROTO,
          "deferred: %s", epipe_codec_last_error(gpu));
    unsetenv("EPIPE_CUDA_DEFER_CHECKS");
    epipe_codec_destroy(now);
    epipe_codec_destroy(bad);
    cudaFree(dp);
    cudaFree(d);
    epipe_codec_destroy(gpu);
}

static void half_tensors(const char *spec, int bf16)
{
    size_t n = 10007;
    std::vector<float> x(n);
    fill(x, 7);
    std::vector<uint16_t> h(n);
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        h[i] = (uint16_t)(u >> 16); /* a bf16 (or some fp16) bit pattern */
        if (!bf16 && (h[i] & 0x7c00u) == 0x7c00u)
            h[i] &= 0xbfffu;
    }
    int64_t shape[1] = {(int64_t)n};
    int code = bf16 ? kDLBfloat : kDLFloat;
    epipe_codec *cpu, *gpu;
    epipe_codec_create(&cpu, spec);
    epipe_codec_create(&gpu, spec);
    uint16_t *d;
    CUDA_OK(cudaMalloc((void **)&d, n * 2));
    CUDA_OK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
    DLTensor hs = tensor(kDLCPU, h.data(), shape, 16, code),
             ds = tensor(kDLCUDA, d, shape, 16, code);
    size_t cap = 0, wc, wg;
    epipe_codec_max_encoded_size(cpu, &hs, &cap);
    std::vector<uint8_t> pc(cap), pg(cap);
    CHECK(epipe_codec_encode(cpu, &hs, pc.data(), cap, &wc) == EPIPE_OK, "cpu");
    CHECK(epipe_codec_encode(gpu, &ds, pg.data(), cap, &wg) == EPIPE_OK, "%s",
          epipe_codec_last_error(gpu));
    CHECK(epipe_codec_synchronize(gpu) == EPIPE_OK, "sync");
    CHECK(memcmp(pc.data(), pg.data(), cap) == 0, "%s %s: payloads differ", spec,
          bf16 ? "bf16" : "fp16");
    std::vector<uint16_t> yc(n), yg(n);
    DLTensor hd = tensor(kDLCPU, yc.data(), shape, 16, code),
             dd = tensor(kDLCUDA, d, shape, 16, code);
    CHECK(epipe_codec_decode(cpu, pc.data(), wc, &hd) == EPIPE_OK, "cpu decode");
    CHECK(epipe_codec_decode(gpu, pc.data(), wc, &dd) == EPIPE_OK, "gpu decode");
    CHECK(epipe_codec_synchronize(gpu) == EPIPE_OK, "sync");
    CUDA_OK(cudaMemcpy(yg.data(), d, n * 2, cudaMemcpyDeviceToHost));
    CHECK(memcmp(yc.data(), yg.data(), n * 2) == 0, "%s: decoded halves differ", spec);
    epipe_codec_destroy(cpu);
    epipe_codec_destroy(gpu);
    cudaFree(d);
}

/* ef=1 on the GPU keeps the CPU's residuals: over encodes of changing
 * tensors in two micro-batch slots, with a payload in pinned or device
 * memory, every payload equals the CPU's byte for byte (a residual one ulp
 * off would change the next payload's codes); a new shape starts a slot
 * over on both; a NaN is refused at the encode and leaves the residual as
 * it was; reset_feedback clears the slots. */
static void ef_matches_cpu(const char *spec, int device_payload)
{
    const size_t n = 70000, m = 3000; /* above and below quant's fused launch */
    epipe_codec *cpu, *gpu;
    CHECK(epipe_codec_create(&cpu, spec) == EPIPE_OK, "%s", epipe_last_error());
    CHECK(epipe_codec_create(&gpu, spec) == EPIPE_OK, "%s", epipe_last_error());
    std::vector<float> x(n);
    float *dx;
    uint8_t *pg;
    size_t cap = n * 4 + 4096;
    std::vector<uint8_t> pc(cap), back(cap);
    CUDA_OK(cudaMalloc((void **)&dx, n * 4));
    if (device_payload)
        CUDA_OK(cudaMalloc((void **)&pg, cap));
    else
        CUDA_OK(cudaHostAlloc((void **)&pg, cap, cudaHostAllocDefault));
    const size_t sizes[] = {n, n, m, n, n, m, n};
    const int64_t slots[] = {0, 1, 0, 0, 1, 0, 0};
    for (int step = 0; step < 7; step++) {
        size_t k = sizes[step];
        fill(x, 100u + (unsigned)step);
        if (step == 6) /* a NaN: refused at once on both, the residual kept */
            x[4321] = NAN;
        int64_t shape[1] = {(int64_t)k};
        DLTensor hs = tensor(kDLCPU, x.data(), shape, 32, kDLFloat);
        DLTensor ds = tensor(kDLCUDA, dx, shape, 32, kDLFloat);
        CUDA_OK(cudaMemcpy(dx, x.data(), k * 4, cudaMemcpyHostToDevice));
        epipe_codec_set_param(cpu, EPIPE_CODEC_MICROBATCH, slots[step]);
        epipe_codec_set_param(gpu, EPIPE_CODEC_MICROBATCH, slots[step]);
        size_t wc = 0, wg = 0;
        int rcc = epipe_codec_encode(cpu, &hs, pc.data(), cap, &wc);
        int rcg = epipe_codec_encode(gpu, &ds, pg, cap, &wg);
        if (step == 6) {
            CHECK(rcc == EPIPE_EINVAL && rcg == EPIPE_EINVAL, "%s: NaN: cpu %d, gpu %d (%s)", spec,
                  rcc, rcg, epipe_codec_last_error(gpu));
            CHECK(strstr(epipe_codec_last_error(gpu), "index 4321 is NaN") != NULL, "%s: '%s'",
                  spec, epipe_codec_last_error(gpu));
            x[4321] = 1.0f; /* the same step again, clean: the residual was kept */
            CUDA_OK(cudaMemcpy(dx, x.data(), k * 4, cudaMemcpyHostToDevice));
            rcc = epipe_codec_encode(cpu, &hs, pc.data(), cap, &wc);
            rcg = epipe_codec_encode(gpu, &ds, pg, cap, &wg);
        }
        CHECK(rcc == EPIPE_OK && rcg == EPIPE_OK, "%s step %d: cpu %d, gpu %d: %s", spec, step,
              rcc, rcg, epipe_codec_last_error(gpu));
        CHECK(epipe_codec_synchronize(gpu) == EPIPE_OK, "%s", epipe_codec_last_error(gpu));
        CUDA_OK(cudaMemcpy(back.data(), pg, wg, cudaMemcpyDefault));
        CHECK(wc == wg && memcmp(pc.data(), back.data(), wc) == 0,
              "%s step %d (%s payload): ef payloads differ from the CPU's", spec, step,
              device_payload ? "device" : "pinned");
    }
    /* reset: both start from zero residuals, so the next payloads are
     * plain encodes of x */
    CHECK(epipe_codec_reset_feedback(gpu) == EPIPE_OK && epipe_codec_reset_feedback(cpu) == 0,
          "reset");
    int64_t shape[1] = {(int64_t)n};
    DLTensor hs = tensor(kDLCPU, x.data(), shape, 32, kDLFloat);
    DLTensor ds = tensor(kDLCUDA, dx, shape, 32, kDLFloat);
    fill(x, 7u);
    CUDA_OK(cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice));
    size_t wc = 0, wg = 0;
    CHECK(epipe_codec_encode(cpu, &hs, pc.data(), cap, &wc) == EPIPE_OK &&
              epipe_codec_encode(gpu, &ds, pg, cap, &wg) == EPIPE_OK &&
              epipe_codec_synchronize(gpu) == EPIPE_OK,
          "%s after reset: %s", spec, epipe_codec_last_error(gpu));
    CUDA_OK(cudaMemcpy(back.data(), pg, wg, cudaMemcpyDefault));
    CHECK(wc == wg && memcmp(pc.data(), back.data(), wc) == 0, "%s: differ after reset", spec);
    epipe_codec_destroy(cpu);
    epipe_codec_destroy(gpu);
    cudaFree(dx);
    if (device_payload)
        cudaFree(pg);
    else
        cudaFreeHost(pg);
}

/* quant rows=1: a [rows, len] tensor (len not a multiple of 4 where
 * asked, so the vector paths must step aside) encodes to the CPU's bytes
 * with the payload in pinned or device memory, each decodes the other's
 * payload to the same floats, a NaN is named by its index in the tensor,
 * and a corrupt row table is refused before any kernel runs, from host
 * and from device memory. */
static void rows_match_cpu(const char *spec, int64_t rows, int64_t len)
{
    size_t n = (size_t)(rows * len);
    std::vector<float> x(n);
    fill(x, (unsigned)(rows * 1000 + len));
    for (int64_t r = 0; r < rows; r++) /* rows of very different scales */
        for (int64_t i = 0; i < len; i++)
            x[(size_t)(r * len + i)] *= (float)(1 + r * r);
    int64_t shape[2] = {rows, len};
    epipe_codec *cpu, *gpu;
    CHECK(epipe_codec_create(&cpu, spec) == EPIPE_OK, "%s", epipe_last_error());
    CHECK(epipe_codec_create(&gpu, spec) == EPIPE_OK, "%s", epipe_last_error());
    DLTensor hs = tensor(kDLCPU, x.data(), shape, 32, kDLFloat);
    hs.ndim = 2;
    size_t cap = 0, wc = 0, wg = 0;
    CHECK(epipe_codec_max_encoded_size(cpu, &hs, &cap) == EPIPE_OK, "size");
    std::vector<uint8_t> pc(cap), back(cap);
    CHECK(epipe_codec_encode(cpu, &hs, pc.data(), cap, &wc) == EPIPE_OK, "%s",
          epipe_codec_last_error(cpu));
    float *dx, *dy;
    uint8_t *pin, *dev;
    CUDA_OK(cudaMalloc((void **)&dx, n * 4));
    CUDA_OK(cudaMalloc((void **)&dy, n * 4));
    CUDA_OK(cudaHostAlloc((void **)&pin, cap, cudaHostAllocDefault));
    CUDA_OK(cudaMalloc((void **)&dev, cap));
    CUDA_OK(cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice));
    DLTensor ds = tensor(kDLCUDA, dx, shape, 32, kDLFloat), dd = tensor(kDLCUDA, dy, shape, 32,
                                                                        kDLFloat);
    ds.ndim = dd.ndim = 2;
    std::vector<float> yc(n), yg(n);
    DLTensor hd = tensor(kDLCPU, yc.data(), shape, 32, kDLFloat);
    hd.ndim = 2;
    CHECK(epipe_codec_decode(cpu, pc.data(), wc, &hd) == EPIPE_OK, "cpu decode");
    for (int where = 0; where < 2; where++) {
        uint8_t *p = where ? dev : pin;
        CHECK(epipe_codec_encode(gpu, &ds, p, cap, &wg) == EPIPE_OK &&
                  epipe_codec_synchronize(gpu) == EPIPE_OK,
              "%s: gpu encode: %s", spec, epipe_codec_last_error(gpu));
        CUDA_OK(cudaMemcpy(back.data(), p, wg, cudaMemcpyDefault));
        CHECK(wg == wc && memcmp(back.data(), pc.data(), wc) == 0,
              "%s [%lld,%lld] (%s payload): bytes differ from the CPU's", spec, (long long)rows,
              (long long)len, where ? "device" : "pinned");
        CUDA_OK(cudaMemcpy(p, pc.data(), wc, cudaMemcpyDefault));
        CUDA_OK(cudaMemset(dy, 0, n * 4));
        CHECK(epipe_codec_decode(gpu, p, wc, &dd) == EPIPE_OK &&
                  epipe_codec_synchronize(gpu) == EPIPE_OK,
              "%s: gpu decode: %s", spec, epipe_codec_last_error(gpu));
        CUDA_OK(cudaMemcpy(yg.data(), dy, n * 4, cudaMemcpyDeviceToHost));
        CHECK(memcmp(yc.data(), yg.data(), n * 4) == 0, "%s (%s payload): decoded floats differ",
              spec, where ? "device" : "pinned");
        /* row 2's step made negative: refused with the CPU's status */
        if (rows > 2) {
            std::vector<uint8_t> bad(pc);
            size_t size = (wc - 16) / (size_t)rows;
            bad[16 + 2 * size + 7] = 0xbf; /* the sign byte of step: -x */
            CUDA_OK(cudaMemcpy(p, bad.data(), wc, cudaMemcpyDefault));
            CHECK(epipe_codec_decode(cpu, bad.data(), wc, &hd) == EPIPE_EPROTO, "cpu bad table");
            CHECK(decode_status(gpu, p, wc, &dd) == EPIPE_EPROTO,
                  "%s (%s payload): a bad row table was not refused: %s", spec,
                  where ? "device" : "pinned", epipe_codec_last_error(gpu));
        }
    }
    /* a NaN in the last row: named by its index in the whole tensor */
    x[n - 2] = NAN;
    CUDA_OK(cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice));
    CHECK(epipe_codec_encode(gpu, &ds, pin, cap, &wg) == EPIPE_OK, "enqueue");
    CHECK(epipe_codec_synchronize(gpu) == EPIPE_EINVAL, "%s: NaN not reported", spec);
    char want[64];
    snprintf(want, sizeof want, "index %zu is NaN", n - 2);
    CHECK(strstr(epipe_codec_last_error(gpu), want) != NULL, "%s: '%s'", spec,
          epipe_codec_last_error(gpu));
    epipe_codec_destroy(cpu);
    epipe_codec_destroy(gpu);
    cudaFree(dx);
    cudaFree(dy);
    cudaFree(dev);
    cudaFreeHost(pin);
}

/* kmeans refuses a value that is not finite at the encode, as the CPU
 * does (its fit waits for the stream anyway), and the handle goes on. */
static void kmeans_refuses_nonfinite(size_t n)
{
    std::vector<float> x(n);
    fill(x, 5u);
    x[n / 2 + 1] = -INFINITY;
    x[n - 1] = NAN;
    int64_t shape[1] = {(int64_t)n};
    epipe_codec *g;
    epipe_codec_create(&g, "kmeans:bits=4");
    float *d;
    CUDA_OK(cudaMalloc((void **)&d, n * 4));
    CUDA_OK(cudaMemcpy(d, x.data(), n * 4, cudaMemcpyHostToDevice));
    DLTensor ds = tensor(kDLCUDA, d, shape, 32, kDLFloat);
    std::vector<uint8_t> p(n + 4096);
    size_t w;
    char want[64];
    snprintf(want, sizeof want, "index %zu is not finite", n / 2 + 1);
    CHECK(epipe_codec_encode(g, &ds, p.data(), p.size(), &w) == EPIPE_EINVAL,
          "kmeans n=%zu: -inf not refused", n);
    CHECK(strstr(epipe_codec_last_error(g), want) != NULL, "kmeans: message '%s'",
          epipe_codec_last_error(g));
    x[n / 2 + 1] = 1.0f;
    x[n - 1] = 2.0f;
    CUDA_OK(cudaMemcpy(d, x.data(), n * 4, cudaMemcpyHostToDevice));
    CHECK(epipe_codec_encode(g, &ds, p.data(), p.size(), &w) == EPIPE_OK &&
              epipe_codec_synchronize(g) == EPIPE_OK,
          "kmeans after a refusal: %s", epipe_codec_last_error(g));
    epipe_codec_destroy(g);
    cudaFree(d);
}

/* x copied to the device and encoded there into p by a fresh handle of
 * spec (in *g, with the device copy in *d: the caller synchronizes, and
 * keeps p until then, and frees both); the encode's status. */
static int encode_on_device(const char *spec, const std::vector<float> &x,
                            std::vector<uint8_t> &p, epipe_codec **g, float **d)
{
    size_t n = x.size();
    int64_t shape[1] = {(int64_t)n};
    epipe_codec_create(g, spec);
    CUDA_OK(cudaMalloc((void **)d, n * 4));
    CUDA_OK(cudaMemcpy(*d, x.data(), n * 4, cudaMemcpyHostToDevice));
    DLTensor ds = tensor(kDLCUDA, *d, shape, 32, kDLFloat);
    p.resize(n * 4 + 64);
    size_t w;
    return epipe_codec_encode(*g, &ds, p.data(), p.size(), &w);
}

/* A NaN surfaces at synchronize with the CPU's message. */
static void deferred_nonfinite(const char *spec, size_t n = 5000)
{
    std::vector<float> x(n, 1.0f);
    x[3001] = NAN;
    x[4000] = INFINITY;
    std::vector<uint8_t> p;
    epipe_codec *g;
    float *d;
    CHECK(encode_on_device(spec, x, p, &g, &d) == EPIPE_OK, "enqueue");
    CHECK(epipe_codec_synchronize(g) == EPIPE_EINVAL, "%s: deferred NaN not reported", spec);
    CHECK(strstr(epipe_codec_last_error(g), "index 3001 is NaN") != NULL, "%s: message '%s'", spec,
          epipe_codec_last_error(g));
    CHECK(epipe_codec_synchronize(g) == EPIPE_OK, "status not cleared");
    epipe_codec_destroy(g);
    cudaFree(d);
}

/* A handle destroyed with a deferred error no synchronize returned says
 * so on the log, naming the error; one whose error was returned says
 * nothing. */
static char destroy_said[512];
static int destroy_warnings;

static void destroy_log(void *user, int level, const char *subsys, int rank, const char *message)
{
    (void)user;
    (void)rank;
    if (level == EPIPE_LOG_WARN && strcmp(subsys, "codec") == 0) {
        destroy_warnings++;
        snprintf(destroy_said, sizeof destroy_said, "%s", message);
    }
}

static void destroy_reports_unreturned(const char *spec)
{
    std::vector<float> x(5000, 1.0f);
    x[3001] = NAN;
    std::vector<uint8_t> p;
    epipe_codec *g;
    float *d;
    epipe_set_log_callback(destroy_log, NULL);
    destroy_warnings = 0;
    CHECK(encode_on_device(spec, x, p, &g, &d) == EPIPE_OK, "enqueue");
    epipe_codec_destroy(g); /* without a synchronize */
    CHECK(destroy_warnings == 1 && strstr(destroy_said, "index 3001 is NaN") &&
              strstr(destroy_said, "epipe_codec_destroy"),
          "%s: %d warnings, '%s'", spec, destroy_warnings, destroy_said);
    cudaFree(d);
    destroy_warnings = 0;
    CHECK(encode_on_device(spec, x, p, &g, &d) == EPIPE_OK, "enqueue");
    CHECK(epipe_codec_synchronize(g) == EPIPE_EINVAL, "%s: the NaN", spec);
    epipe_codec_destroy(g);
    CHECK(destroy_warnings == 0, "%s: a returned error said again: '%s'", spec, destroy_said);
    epipe_set_log_callback(NULL, NULL);
    cudaFree(d);
}

/* A bad payload whose failure a later decode's wait held (past the 16
 * that wait), then a payload with a good header and a bad topk entry,
 * which the kernels note: synchronize returns the first, and the next
 * synchronize the second, which is not taken for the first's notes. With
 * at_destroy, the handle is destroyed after the first synchronize, and
 * destroy says the second on the log. */
static void held_then_noted(int at_destroy)
{
    size_t n = 1000;
    int64_t shape[1] = {(int64_t)n};
    epipe_codec *gpu;
    epipe_codec_create(&gpu, "topk:ratio=0.1");
    std::vector<uint8_t> good = cpu_payload("topk:ratio=0.1", n, 4), header(good), entry(good);
    size_t w = good.size();
    header[0] = 0xff;    /* the codec id */
    uint32_t far = 5000; /* entry 7's index, past the 1000 values */
    memcpy(&entry[16 + 4 * 7], &far, 4);
    uint8_t *dg = device_copy(good, w), *dh = device_copy(header, w), *de = device_copy(entry, w);
    float *d;
    CUDA_OK(cudaMalloc((void **)&d, n * 4));
    DLTensor dd = tensor(kDLCUDA, d, shape, 32, kDLFloat);
    if (at_destroy) {
        epipe_set_log_callback(destroy_log, NULL);
        destroy_warnings = 0;
    }
    CHECK(epipe_codec_decode(gpu, dh, w, &dd) == EPIPE_OK, "%s", epipe_codec_last_error(gpu));
    for (int i = 0; i < 16; i++)
        CHECK(epipe_codec_decode(gpu, dg, w, &dd) == EPIPE_OK, "%s", epipe_codec_last_error(gpu));
    CHECK(epipe_codec_decode(gpu, de, w, &dd) == EPIPE_OK, "%s", epipe_codec_last_error(gpu));
    int first = epipe_codec_synchronize(gpu);
    char said[512];
    snprintf(said, sizeof said, "%s", epipe_codec_last_error(gpu));
    if (at_destroy) {
        CHECK(first == EPIPE_EPROTO, "the first: %s", said);
        epipe_codec_destroy(gpu);
        CHECK(destroy_warnings == 1 && strstr(destroy_said, "entry 7 has an index out of range"),
              "the held one at destroy: %d warnings, '%s'", destroy_warnings, destroy_said);
        epipe_set_log_callback(NULL, NULL);
    } else {
        int second = epipe_codec_synchronize(gpu);
        CHECK(first == EPIPE_EPROTO && strstr(said, "codec id 255") && second == EPIPE_EPROTO &&
                  strstr(epipe_codec_last_error(gpu), "entry 7 has an index out of range"),
              "a held failure, then a noted entry: %d '%s', then %d '%s'", first, said, second,
              epipe_codec_last_error(gpu));
        CHECK(epipe_codec_synchronize(gpu) == EPIPE_OK, "a third: %s", epipe_codec_last_error(gpu));
        epipe_codec_destroy(gpu);
    }
    cudaFree(dg);
    cudaFree(dh);
    cudaFree(de);
    cudaFree(d);
}

/* Binding (epipe/codec.h): a decode that fails at once binds nothing; one
 * that returns EPIPE_OK binds its handle to the device, even where the
 * synchronize after it refuses the payload. */
static void refused_decode_binds(void)
{
    size_t n = 1000;
    int64_t shape[1] = {(int64_t)n};
    std::vector<uint8_t> bad = cpu_payload("topk:ratio=0.1", n, 4);
    bad[0] = 0xff; /* the codec id: checked at the synchronize */
    uint8_t *db = device_copy(bad, bad.size());
    float *d;
    CUDA_OK(cudaMalloc((void **)&d, n * 4));
    std::vector<float> host(n);
    DLTensor dd = tensor(kDLCUDA, d, shape, 32, kDLFloat),
             hd = tensor(kDLCPU, host.data(), shape, 32, kDLFloat);
    epipe_codec *g;
    epipe_codec_create(&g, "topk:ratio=0.1");
    CHECK(epipe_codec_decode(g, db, bad.size() - 1, &dd) == EPIPE_EPROTO, "a short payload: %s",
          epipe_codec_last_error(g));
    CHECK(epipe_codec_decode(g, bad.data(), bad.size(), &hd) == EPIPE_EPROTO &&
              !strstr(epipe_codec_last_error(g), "bound to"),
          "after a failed decode, not bound: %s", epipe_codec_last_error(g));
    epipe_codec_destroy(g);
    epipe_codec_create(&g, "topk:ratio=0.1");
    CHECK(epipe_codec_decode(g, db, bad.size(), &dd) == EPIPE_OK, "%s", epipe_codec_last_error(g));
    CHECK(epipe_codec_synchronize(g) == EPIPE_EPROTO, "the refusal: %s",
          epipe_codec_last_error(g));
    CHECK(epipe_codec_decode(g, bad.data(), bad.size(), &hd) == EPIPE_EINVAL &&
              strstr(epipe_codec_last_error(g), "bound to CUDA"),
          "bound by the refused decode: %s", epipe_codec_last_error(g));
    epipe_codec_destroy(g);
    cudaFree(db);
    cudaFree(d);
}

/* One infinity alone, of either sign: refused by synchronize, naming it,
 * and never a hang (a chunk whose extent reached -inf once made the table
 * kernel's step search loop forever: exact mode sorts every value, the
 * infinities too). */
static void deferred_infinity(const char *spec, float inf, size_t n = 5000)
{
    std::vector<float> x(n);
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(i % 97) - 48.0f;
    x[n / 3] = inf;
    char want[64];
    snprintf(want, sizeof want, "index %zu is %s", n / 3, inf > 0 ? "+inf" : "-inf");
    std::vector<uint8_t> p;
    epipe_codec *g;
    float *d;
    int rc = encode_on_device(spec, x, p, &g, &d);
    if (rc == EPIPE_OK)
        rc = epipe_codec_synchronize(g);
    CHECK(rc == EPIPE_EINVAL && strstr(epipe_codec_last_error(g), want), "%s: %s: %d '%s'", spec,
          want, rc, epipe_codec_last_error(g));
    epipe_codec_destroy(g);
    cudaFree(d);
}

/* A corrupt table is refused before any kernel runs (the body is host
 * memory), with the CPU's status. */
static void hostile_table(void)
{
    size_t n = 1000;
    std::vector<float> x(n);
    fill(x, 3);
    int64_t shape[1] = {(int64_t)n};
    epipe_codec *g;
    epipe_codec_create(&g, "quant:bits=8");
    DLTensor hs = tensor(kDLCPU, x.data(), shape, 32, kDLFloat);
    std::vector<uint8_t> p(n * 4 + 1024); /* room for every codec below */
    size_t w;
    epipe_codec *cpu;
    epipe_codec_create(&cpu, "quant:bits=8");
    epipe_codec_encode(cpu, &hs, p.data(), p.size(), &w);
    float *d;
    CUDA_OK(cudaMalloc((void **)&d, n * 4));
    DLTensor dd = tensor(kDLCUDA, d, shape, 32, kDLFloat);
    /* min NaN, step NaN, step negative, min + 255 * step past the range */
    const float bad[4][2] = {{NAN, 0.1f}, {0.0f, NAN}, {0.0f, -1.0f}, {3e38f, 3e36f}};
    for (int b = 0; b < 4; b++) {
        std::vector<uint8_t> q(p.begin(), p.begin() + w);
        memcpy(&q[16], &bad[b][0], 4);
        memcpy(&q[20], &bad[b][1], 4);
        int rc = epipe_codec_decode(g, q.data(), w, &dd);
        CHECK(rc == EPIPE_EPROTO, "bad table %d: rc %d", b, rc);
    }
    CHECK(epipe_codec_decode(g, p.data(), w, &dd) == EPIPE_OK, "clean payload");
    /* padding: 999 codes of 4 bits leave 4 bits to corrupt */
    epipe_codec *g4, *c4;
    epipe_codec_create(&g4, "quant:bits=4");
    epipe_codec_create(&c4, "quant:bits=4");
    int64_t s999[1] = {999};
    DLTensor h999 = tensor(kDLCPU, x.data(), s999, 32, kDLFloat),
             d999 = tensor(kDLCUDA, d, s999, 32, kDLFloat);
    CHECK(epipe_codec_encode(c4, &h999, p.data(), p.size(), &w) == EPIPE_OK, "cpu 4-bit");
    p[w - 1] |= 0x80;
    CHECK(epipe_codec_decode(g4, p.data(), w, &d999) == EPIPE_EPROTO, "dirty padding");
    CHECK(strstr(epipe_codec_last_error(g4), "padding bits") != NULL, "%s",
          epipe_codec_last_error(g4));
    epipe_codec_destroy(g4);
    epipe_codec_destroy(c4);
    /* sortquant mode=fit: the fit word is checked by the CPU's code */
    epipe_codec *gf, *cf;
    epipe_codec_create(&gf, "sortquant:bits=8,mode=fit");
    epipe_codec_create(&cf, "sortquant:bits=8,mode=fit");
    CHECK(epipe_codec_encode(cf, &hs, p.data(), p.size(), &w) == EPIPE_OK, "cpu fit");
    CHECK(epipe_codec_decode(gf, p.data(), w, &dd) == EPIPE_OK, "%s", epipe_codec_last_error(gf));
    const size_t hdr = 16; /* the payload header; the body's fit word follows */
    for (int b = 0; b < 2; b++) {
        std::vector<uint8_t> q(p.begin(), p.begin() + w);
        q[hdr + (b ? 0 : 1)] = b ? 7 : 1; /* split 7 past the largest; a reserved byte */
        CHECK(epipe_codec_decode(gf, q.data(), w, &dd) == EPIPE_EPROTO, "fit word %d", b);
        CHECK(strstr(epipe_codec_last_error(gf), b ? "split" : "reserved") != NULL, "%s",
              epipe_codec_last_error(gf));
    }
    epipe_codec_destroy(gf);
    epipe_codec_destroy(cf);
    CHECK(epipe_codec_synchronize(g) == EPIPE_OK, "sync");
    epipe_codec_destroy(g);
    epipe_codec_destroy(cpu);
    cudaFree(d);
}

/* Host memory labelled kDLCUDA, and a CPU tensor to a CUDA-bound handle. */
static void mixups(void)
{
    int64_t shape[1] = {16};
    static float host[16];
    epipe_codec *g;
    epipe_codec_create(&g, "none");
    DLTensor lie = tensor(kDLCUDA, host, shape, 32, kDLFloat);
    uint8_t p[256];
    size_t w;
    CHECK(epipe_codec_encode(g, &lie, p, sizeof p, &w) == EPIPE_EINVAL, "host memory as kDLCUDA");
    float *d;
    CUDA_OK(cudaMalloc((void **)&d, 64));
    DLTensor dev = tensor(kDLCUDA, d, shape, 32, kDLFloat),
             cpu = tensor(kDLCPU, host, shape, 32, kDLFloat);
    CHECK(epipe_codec_encode(g, &dev, p, sizeof p, &w) == EPIPE_OK, "%s",
          epipe_codec_last_error(g));
    CHECK(epipe_codec_encode(g, &cpu, p, sizeof p, &w) == EPIPE_EINVAL, "cpu tensor, cuda handle");
    CHECK(strstr(epipe_codec_last_error(g), "bound to CUDA") != NULL, "%s",
          epipe_codec_last_error(g));
    DLTensor misaligned = tensor(kDLCUDA, (char *)d + 2, shape, 32, kDLFloat);
    misaligned.shape[0] = 8;
    CHECK(epipe_codec_encode(g, &misaligned, p, sizeof p, &w) == EPIPE_EINVAL, "misaligned");
    epipe_codec_synchronize(g);
    epipe_codec_destroy(g);
    cudaFree(d);
}

/* The CPU's payload pc (wc bytes) decoded on the GPU into dd, from host
 * memory or (from_device) a copy in device buffer dp; dd's values into yg. */
static void decode_on_gpu(epipe_codec *gpu, const char *spec, const std::vector<uint8_t> &pc,
                          size_t wc, uint8_t *dp, int from_device, DLTensor *dd,
                          std::vector<float> &yg)
{
    CUDA_OK(cudaMemset(dd->data, 0, yg.size() * 4));
    if (from_device)
        CUDA_OK(cudaMemcpy(dp, pc.data(), wc, cudaMemcpyHostToDevice));
    CHECK(epipe_codec_decode(gpu, from_device ? (const void *)dp : pc.data(), wc, dd) == EPIPE_OK,
          "%s: gpu decode: %s", spec, epipe_codec_last_error(gpu));
    CHECK(epipe_codec_synchronize(gpu) == EPIPE_OK, "%s", epipe_codec_last_error(gpu));
    CUDA_OK(cudaMemcpy(yg.data(), dd->data, yg.size() * 4, cudaMemcpyDeviceToHost));
}

/* The CPU codec the device's results are compared with, or a SKIP line
 * (which scripts/device/gpu-check.sh counts) where this build has no BLAS:
 * poweriter's and insert's CPU sides need it. Any other refusal fails. */
static bool cpu_side_or_skip(epipe_codec **cpu, const char *spec)
{
    int rc = epipe_codec_create(cpu, spec);
    if (rc == EPIPE_ENOTSUP) {
        printf("SKIP %s: no CPU side to compare with: %s\n", spec, epipe_last_error());
        return false;
    }
    CHECK(rc == EPIPE_OK, "%s: %s", spec, epipe_last_error());
    return rc == EPIPE_OK;
}

/* poweriter on the GPU (fused products or cuBLAS, CholeskyQR2 on the device): over
 * four warm-started steps, the last of rank 1 (the host's QR), the GPU's
 * payload decoded on the CPU stays within 1e-4 of max|x| of the CPU's own
 * round trip, and the CPU's payload decoded on the GPU within 1e-5; a
 * payload from a device buffer decodes the same; and a NaN is refused at
 * once, naming its index, as on the CPU.
 * Needs a BLAS build (poweriter's CPU side). */
static void poweriter_close_to_cpu(const char *spec, int64_t nb, int64_t rows, int64_t cols)
{
    epipe_codec *cpu, *gpu;
    if (!cpu_side_or_skip(&cpu, spec))
        return;
    CHECK(epipe_codec_create(&gpu, spec) == EPIPE_OK, "%s", epipe_last_error());
    size_t n = (size_t)(nb * rows * cols);
    int64_t shape[3] = {nb, rows, cols};
    std::vector<float> x(n), yc(n), yg(n), yx(n);
    float *dx, *dy;
    CUDA_OK(cudaMalloc((void **)&dx, n * 4));
    CUDA_OK(cudaMalloc((void **)&dy, n * 4));
    DLTensor hs = tensor(kDLCPU, x.data(), shape, 32, kDLFloat), ds = hs;
    ds.data = dx;
    ds.device.device_type = kDLCUDA;
    hs.ndim = ds.ndim = 3;
    DLTensor hy = hs, dd = ds;
    hy.data = yc.data();
    dd.data = dy;
    size_t cap = 0;
    CHECK(epipe_codec_max_encoded_size(cpu, &hs, &cap) == EPIPE_OK, "size");
    std::vector<uint8_t> pc(cap), pg(cap);
    uint8_t *dp;
    CUDA_OK(cudaMalloc((void **)&dp, cap));
    /* max |a - b| over max |x|: the tolerance the CPU's fast path keeps
     * against its reference (tests/test_poweriter.c) */
    auto rel = [&](const std::vector<float> &a, const std::vector<float> &b) {
        double d = 0, xm = 0;
        for (size_t i = 0; i < n; i++) {
            d = fmax(d, fabs((double)a[i] - b[i]));
            xm = fmax(xm, fabs((double)x[i]));
        }
        return xm > 0 ? d / xm : d;
    };
    for (unsigned step = 0; step < 4; step++) {
        fill(x, 77 + step);
        for (size_t i = 0; i < n; i++) /* low rank plus noise: the factors matter */
            x[i] = x[i] * 0.05f + (float)((i / (size_t)cols) % 5) * (float)(i % 13);
        /* the last step exactly rank 1: P's Gram matrix is singular, the
         * device's Cholesky refuses it and the encode starts over with the
         * host's Householder QR */
        for (size_t i = 0; step == 3 && i < n; i++)
            x[i] = (float)((i / (size_t)cols) % 5 + 1) * (float)((int)(i % (size_t)cols % 7) - 3);
        CUDA_OK(cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice));
        size_t wc = 0, wg = 0;
        CHECK(epipe_codec_encode(cpu, &hs, pc.data(), cap, &wc) == EPIPE_OK, "%s",
              epipe_codec_last_error(cpu));
        /* steps 0-2 are well conditioned: the device's own QR must take
         * them (a restart on the host's QR would hide a kernel's error) */
        if (step < 3)
            setenv("EPIPE_CUDA_TEST_NO_RESTART", "1", 1);
        int rc = epipe_codec_encode(gpu, &ds, dp, cap, &wg);
        unsetenv("EPIPE_CUDA_TEST_NO_RESTART");
        CHECK(rc == EPIPE_OK, "%s step %u: gpu encode: %s", spec, step,
              epipe_codec_last_error(gpu));
        CHECK(epipe_codec_synchronize(gpu) == EPIPE_OK, "%s", epipe_codec_last_error(gpu));
        CHECK(wc == wg, "%s: sizes %zu vs %zu", spec, wc, wg);
        CUDA_OK(cudaMemcpy(pg.data(), dp, wg, cudaMemcpyDeviceToHost));
        CHECK(memcmp(pc.data(), pg.data(), 32) == 0, "%s: body headers differ", spec);
        /* the CPU's round trip, and the GPU's payload decoded on the CPU */
        CHECK(epipe_codec_decode(cpu, pc.data(), wc, &hy) == EPIPE_OK, "cpu decode");
        DLTensor hx = hy;
        hx.data = yx.data();
        CHECK(epipe_codec_decode(cpu, pg.data(), wg, &hx) == EPIPE_OK, "%s: cpu decode of gpu: %s",
              spec, epipe_codec_last_error(cpu));
        double e1 = rel(yx, yc);
        CHECK(e1 <= 1e-4, "%s step %u: the GPU's payload decodes %.3g from the CPU's", spec, step,
              e1);
        /* the CPU's payload decoded on the GPU, from host and device memory */
        for (int from_device = 0; from_device < 2; from_device++) {
            decode_on_gpu(gpu, spec, pc, wc, dp, from_device, &dd, yg);
            double e2 = rel(yg, yc);
            CHECK(e2 <= 1e-5, "%s step %u: the GPU decodes the CPU's payload %.3g off", spec, step,
                  e2);
        }
    }
    /* a NaN: refused by the encode itself, naming its index */
    float nan = NAN;
    CUDA_OK(cudaMemcpy(dx + 5, &nan, 4, cudaMemcpyHostToDevice));
    size_t w = 0;
    CHECK(epipe_codec_encode(gpu, &ds, dp, cap, &w) == EPIPE_EINVAL, "%s: NaN accepted", spec);
    CHECK(strstr(epipe_codec_last_error(gpu), "index 5") != NULL, "%s: %s", spec,
          epipe_codec_last_error(gpu));
    CHECK(epipe_codec_synchronize(gpu) == EPIPE_OK, "%s: after the NaN: %s", spec,
          epipe_codec_last_error(gpu));
    /* Corrupt payloads, from device and from host memory: a bad header is
     * refused at once (the host reads it), a bad factor or scale by the
     * next synchronize (the decode kernel checks them), naming its entry:
     * record b's scale is entry b * (1 + (rows + cols) * r), its Q and P
     * values follow. Then the handle decodes again as before. */
    size_t wc = 0;
    fill(x, 5);
    CHECK(epipe_codec_encode(cpu, &hs, pc.data(), cap, &wc) == EPIPE_OK, "cpu encode");
    std::vector<uint8_t> good(pc);
    unsigned r = (unsigned)good[16]; /* the body header's rank */
    uint64_t per = 1 + (uint64_t)(rows + cols) * r;
    size_t es = strstr(spec, "fp16") ? 2 : 4, rec = 4 + (size_t)(rows + cols) * r * es;
    struct {
        size_t at;
        uint8_t byte;
        uint64_t entry; /* ~0: the header, refused at once (from the device: at synchronize) */
    } bad[] = {
        {16 + 32 + 4 + es - 1, 0x7f, 1},                      /* Q[0][0] of matrix 0: |v| > 1 */
        {16 + 32 + rec + 3, 0x80, per},                       /* matrix 1's scale negative */
        {16 + 32 + rec + 4 + (size_t)rows * r * es + es - 1, 0xff, per + 1 + (uint64_t)rows * r},
        {16 + 4, 1, ~0ull},                                   /* the reserved field */
    };
    for (auto &b : bad)
        for (int from_device = 0; from_device < 2; from_device++) {
            pc = good;
            pc[b.at] = b.byte;
            if (from_device)
                CUDA_OK(cudaMemcpy(dp, pc.data(), wc, cudaMemcpyHostToDevice));
            int rc = epipe_codec_decode(gpu, from_device ? (const void *)dp : pc.data(), wc, &dd);
            if (b.entry == ~0ull) {
                if (from_device) /* deferred checks: docs/codec-backends.md */
                    rc = rc ? rc : epipe_codec_synchronize(gpu);
                CHECK(rc == EPIPE_EPROTO && strstr(epipe_codec_last_error(gpu), "reserved"),
                      "%s: a bad header: %d %s", spec, rc, epipe_codec_last_error(gpu));
                continue;
            }
            CHECK(rc == EPIPE_OK, "%s: %s", spec, epipe_codec_last_error(gpu));
            char want[64];
            snprintf(want, sizeof want, "payload entry %llu is not finite or is outside",
                     (unsigned long long)b.entry);
            rc = epipe_codec_synchronize(gpu);
            CHECK(rc == EPIPE_EPROTO && strstr(epipe_codec_last_error(gpu), want),
                  "%s: byte %zu: %d %s (wanted '%s')", spec, b.at, rc,
                  epipe_codec_last_error(gpu), want);
        }
    decode_on_gpu(gpu, spec, good, wc, dp, 1, &dd, yg);
    cudaFree(dx);
    cudaFree(dy);
    cudaFree(dp);
    epipe_codec_destroy(cpu);
    epipe_codec_destroy(gpu);
}

/* max |a - b| over max |ref|, the tolerance measure of the shaped codecs */
static double rel_diff(const float *a, const float *b, const float *ref, size_t n)
{
    double d = 0, m = 0;
    for (size_t i = 0; i < n; i++) {
        d = fmax(d, fabs((double)a[i] - b[i]));
        m = fmax(m, fabs((double)ref[i]));
    }
    return m > 0 ? d / m : d;
}

/* One poweriter spec on both sides for [nb, rows, cols] tensors: the CPU's
 * codec and the GPU's, x on the host and on the device, a host payload for
 * the CPU's encodes and a pinned one for the GPU's. */
struct pi_pair {
    const char *spec = NULL;
    epipe_codec *cpu = NULL, *gpu = NULL;
    int64_t shape[3] = {0, 0, 0};
    size_t n = 0, cap = 0;
    std::vector<float> x;
    std::vector<uint8_t> pc;
    float *dx = NULL;
    uint8_t *pin = NULL;
    DLTensor hs, ds;

    /* false, with a SKIP line, where this build has no CPU side */
    bool open(const char *s, int64_t nb, int64_t rows, int64_t cols)
    {
        spec = s;
        if (!cpu_side_or_skip(&cpu, spec))
            return false;
        CHECK(epipe_codec_create(&gpu, spec) == EPIPE_OK, "%s", epipe_last_error());
        shape[0] = nb, shape[1] = rows, shape[2] = cols;
        n = (size_t)(nb * rows * cols);
        x.resize(n);
        CUDA_OK(cudaMalloc((void **)&dx, n * 4));
        hs = tensor(kDLCPU, x.data(), shape, 32, kDLFloat);
        hs.ndim = 3;
        ds = hs;
        ds.data = dx;
        ds.device.device_type = kDLCUDA;
        CHECK(epipe_codec_max_encoded_size(cpu, &hs, &cap) == EPIPE_OK, "%s: size", spec);
        pc.resize(cap);
        CUDA_OK(cudaHostAlloc((void **)&pin, cap, cudaHostAllocDefault));
        return true;
    }

    /* x encoded on both sides (into pc and pin), the GPU's with its own QR
     * (EPIPE_CUDA_TEST_NO_RESTART: the tensors here are well conditioned)
     * and synchronized */
    void encode(size_t *wc, size_t *wg)
    {
        CUDA_OK(cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice));
        CHECK(epipe_codec_encode(cpu, &hs, pc.data(), cap, wc) == EPIPE_OK, "%s: cpu: %s", spec,
              epipe_codec_last_error(cpu));
        setenv("EPIPE_CUDA_TEST_NO_RESTART", "1", 1);
        CHECK(epipe_codec_encode(gpu, &ds, pin, cap, wg) == EPIPE_OK &&
                  epipe_codec_synchronize(gpu) == EPIPE_OK,
              "%s: gpu: %s", spec, epipe_codec_last_error(gpu));
        unsetenv("EPIPE_CUDA_TEST_NO_RESTART");
    }

    /* a payload decoded on the CPU into y */
    void decode(const uint8_t *p, size_t w, std::vector<float> &y)
    {
        y.resize(n);
        DLTensor t = hs;
        t.data = y.data();
        CHECK(epipe_codec_decode(cpu, p, w, &t) == EPIPE_OK, "%s: decode: %s", spec,
              epipe_codec_last_error(cpu));
    }

    ~pi_pair()
    {
        cudaFree(dx);
        cudaFreeHost(pin);
        epipe_codec_destroy(cpu);
        epipe_codec_destroy(gpu);
    }
};

/* poweriter with error feedback on the GPU: step after step, the payload
 * (from x plus the residual the device keeps) decodes within 1e-4 of
 * max|x| of the CPU's, whose residual evolves the same way. */
static void poweriter_ef_follows_cpu(void)
{
    pi_pair t;
    if (!t.open("poweriter:rank=2,ef=1", 8, 16, 64))
        return;
    std::vector<float> yc, yg;
    for (unsigned step = 0; step < 4; step++) {
        fill(t.x, 500 + step);
        for (size_t i = 0; i < t.n; i++) /* low rank plus noise, the noise fed back */
            t.x[i] = t.x[i] * 0.05f + (float)((i / 64) % 5) * (float)(i % 13);
        size_t wc = 0, wg = 0;
        t.encode(&wc, &wg);
        t.decode(t.pc.data(), wc, yc);
        t.decode(t.pin, wg, yg);
        double d = rel_diff(yg.data(), yc.data(), t.x.data(), t.n);
        CHECK(d <= 1e-4, "%s step %u: the GPU's payload decodes %.3g from the CPU's", t.spec, step,
              d);
    }
}

/* The warm start the GPU keeps is the one the CPU keeps: on random
 * tensors (no dominant subspace, so the start decides the factors), the
 * second of two encodes decodes within 1e-4 of the CPU's second, while a
 * cold start's second encode is far from it (the start matters). Slots of
 * two micro-batches are kept apart. Needs a BLAS build. */
static void poweriter_warm_start_follows_cpu(void)
{
    pi_pair t;
    if (!t.open("poweriter:rank=3", 4, 16, 300))
        return;
    epipe_codec *cold;
    CHECK(epipe_codec_create(&cold, "poweriter:rank=3,warm=0") == EPIPE_OK, "cold");
    std::vector<uint8_t> p0(t.cap);
    std::vector<float> yc, yg, y0;
    for (unsigned step = 0; step < 2; step++)
        for (int mb = 0; mb < 2; mb++) {
            fill(t.x, 300 + step * 2 + (unsigned)mb);
            CHECK(epipe_codec_set_param(t.cpu, EPIPE_CODEC_MICROBATCH, mb) == EPIPE_OK &&
                      epipe_codec_set_param(t.gpu, EPIPE_CODEC_MICROBATCH, mb) == EPIPE_OK,
                  "micro-batch");
            size_t wc = 0, wg = 0, w0 = 0;
            t.encode(&wc, &wg);
            CHECK(epipe_codec_encode(cold, &t.hs, p0.data(), t.cap, &w0) == EPIPE_OK, "cold");
            t.decode(t.pc.data(), wc, yc);
            t.decode(t.pin, wg, yg);
            t.decode(p0.data(), w0, y0);
            double d = rel_diff(yg.data(), yc.data(), yc.data(), t.n),
                   dcold = rel_diff(y0.data(), yc.data(), yc.data(), t.n);
            CHECK(d <= 1e-4, "step %u micro-batch %d: the GPU's payload decodes %.3g from the "
                  "CPU's", step, mb, d);
            if (step == 1)
                CHECK(dcold > 1e-2, "step 1 micro-batch %d: a cold start is only %.3g from the "
                      "warm one: the test cannot tell starts apart", mb, dcold);
        }
    epipe_codec_destroy(cold);
}


/* A body's codes as floats (fp32, or fp16 with code16). */
static std::vector<float> codes_of(const uint8_t *body, size_t count, int code16)
{
    std::vector<float> z(count);
    for (size_t i = 0; i < count; i++) {
        if (code16) {
            uint16_t h = (uint16_t)(body[2 * i] | body[2 * i + 1] << 8);
            /* fp16 to fp32, normal and subnormal values (the codes are finite) */
            int e = (h >> 10) & 31, m = h & 1023;
            float v = e ? ldexpf((float)(m | 1024), e - 25) : ldexpf((float)m, -24);
            z[i] = h & 0x8000 ? -v : v;
        } else {
            memcpy(&z[i], body + 4 * i, 4);
        }
    }
    return z;
}

/* insert on the GPU (cuDNN for conv, cuBLAS for linear, the parameters the
 * host's): the GPU's codes within 1e-5 of the largest of the CPU's (fp16
 * codes within 2^-10 of it: one rounding step), its payload decoded on the
 * CPU and the CPU's decoded on the GPU (host and device payloads) within
 * 1e-5; parameters the host changes reach the next call; a NaN, a code
 * beyond fp16 and a corrupt code are refused when the caller synchronizes;
 * and training (EPIPE_CODEC_MICROBATCH set): both backward passes and the
 * parameter gradients within 1e-5 of the CPU's. Needs a BLAS build. */
static void insert_close_to_cpu(const char *spec, const std::vector<int64_t> &dims, size_t zcount,
                                int code16)
{
    epipe_codec *cpu, *gpu;
    if (!cpu_side_or_skip(&cpu, spec))
        return;
    CHECK(epipe_codec_create(&gpu, spec) == EPIPE_OK, "%s", epipe_last_error());
    std::vector<int64_t> shape = dims;
    size_t n = 1;
    for (int64_t d : dims)
        n *= (size_t)d;
    std::vector<float> x(n), yc(n), yg(n), yx(n);
    fill(x, 11);
    float *dx, *dy;
    CUDA_OK(cudaMalloc((void **)&dx, n * 4));
    CUDA_OK(cudaMalloc((void **)&dy, n * 4));
    CUDA_OK(cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice));
    DLTensor hs = tensor(kDLCPU, x.data(), shape.data(), 32, kDLFloat), ds = hs;
    hs.ndim = ds.ndim = (int)dims.size();
    ds.data = dx;
    ds.device.device_type = kDLCUDA;
    DLTensor hy = hs, dd = ds, hx = hs;
    hy.data = yc.data();
    hx.data = yx.data();
    dd.data = dy;
    size_t cap = 0;
    CHECK(epipe_codec_max_encoded_size(cpu, &hs, &cap) == EPIPE_OK, "size");
    CHECK(cap == 16 + zcount * (code16 ? 2 : 4), "%s: payload of %zu bytes", spec, cap);
    std::vector<uint8_t> pc(cap), pg(cap), ph(cap);
    uint8_t *dp;
    CUDA_OK(cudaMalloc((void **)&dp, cap + 1));
    const double tol = code16 ? 1.0 / 1024 : 1e-5;
    for (int step = 0; step < 2; step++) {
        if (step) { /* the host changes a parameter of both: the next call uses it */
            for (epipe_codec *c : {cpu, gpu}) {
                const char *name;
                DLTensor *param, *grad;
                CHECK(epipe_codec_tensor(c, 0, &name, &param, &grad) == EPIPE_OK, "tensor");
                ((float *)param->data)[0] += 0.5f;
                CHECK(epipe_codec_tensor(c, 1, &name, &param, &grad) == EPIPE_OK, "tensor");
                ((float *)param->data)[1] -= 0.25f;
            }
        }
        size_t wc = 0, wg = 0, wh = 0;
        CHECK(epipe_codec_encode(cpu, &hs, pc.data(), cap, &wc) == EPIPE_OK, "%s",
              epipe_codec_last_error(cpu));
        CHECK(epipe_codec_encode(gpu, &ds, dp, cap, &wg) == EPIPE_OK, "%s: gpu encode: %s", spec,
              epipe_codec_last_error(gpu));
        CHECK(epipe_codec_encode(gpu, &ds, ph.data(), cap, &wh) == EPIPE_OK, "%s: gpu encode: %s",
              spec, epipe_codec_last_error(gpu));
        CHECK(epipe_codec_synchronize(gpu) == EPIPE_OK, "%s", epipe_codec_last_error(gpu));
        CHECK(wc == wg && wc == wh, "%s: sizes %zu, %zu, %zu", spec, wc, wg, wh);
        CUDA_OK(cudaMemcpy(pg.data(), dp, wg, cudaMemcpyDeviceToHost));
        CHECK(memcmp(pc.data(), pg.data(), 16) == 0, "%s: headers differ", spec);
        CHECK(memcmp(pg.data(), ph.data(), wg) == 0, "%s: device and host payloads differ", spec);
        std::vector<float> zc = codes_of(pc.data() + 16, zcount, code16),
                           zg = codes_of(pg.data() + 16, zcount, code16);
        double ez = rel_diff(zg.data(), zc.data(), zc.data(), zcount);
        CHECK(ez <= tol, "%s step %d: the GPU's codes are %.3g off the CPU's", spec, step, ez);
        CHECK(epipe_codec_decode(cpu, pc.data(), wc, &hy) == EPIPE_OK, "cpu decode");
        CHECK(epipe_codec_decode(cpu, pg.data(), wg, &hx) == EPIPE_OK, "%s: cpu decode of gpu: %s",
              spec, epipe_codec_last_error(cpu));
        double e1 = rel_diff(yx.data(), yc.data(), yc.data(), n);
        CHECK(e1 <= (code16 ? 2 * tol : 1e-4), "%s step %d: the GPU's payload restores %.3g off",
              spec, step, e1);
        for (int from_device = 0; from_device < 2; from_device++) {
            decode_on_gpu(gpu, spec, pc, wc, dp, from_device, &dd, yg);
            double e2 = rel_diff(yg.data(), yc.data(), yc.data(), n);
            CHECK(e2 <= 1e-5, "%s step %d: the GPU restores the CPU's payload %.3g off", spec, step,
                  e2);
        }
    }
    /* a payload at an odd address: the kernels' byte path */
    {
        size_t wc = 0, wg = 0;
        CHECK(epipe_codec_encode(cpu, &hs, pc.data(), cap, &wc) == EPIPE_OK, "cpu encode");
        CHECK(epipe_codec_encode(gpu, &ds, dp + 1, cap, &wg) == EPIPE_OK, "%s: odd payload: %s",
              spec, epipe_codec_last_error(gpu));
        CHECK(epipe_codec_synchronize(gpu) == EPIPE_OK, "%s", epipe_codec_last_error(gpu));
        CUDA_OK(cudaMemcpy(pg.data(), dp + 1, wg, cudaMemcpyDeviceToHost));
        std::vector<float> zc = codes_of(pc.data() + 16, zcount, code16),
                           zg = codes_of(pg.data() + 16, zcount, code16);
        CHECK(rel_diff(zg.data(), zc.data(), zc.data(), zcount) <= tol, "%s: odd payload codes",
              spec);
        CHECK(epipe_codec_decode(gpu, dp + 1, wg, &dd) == EPIPE_OK &&
                  epipe_codec_synchronize(gpu) == EPIPE_OK,
              "%s: odd payload decode: %s", spec, epipe_codec_last_error(gpu));
    }
    /* a NaN: the code is not finite, and the error names the input's index */
    float bad = NAN;
    CUDA_OK(cudaMemcpy(dx + 5, &bad, 4, cudaMemcpyHostToDevice));
    size_t w = 0;
    CHECK(epipe_codec_encode(gpu, &ds, dp, cap, &w) == EPIPE_OK, "%s: enqueue", spec);
    CHECK(epipe_codec_synchronize(gpu) == EPIPE_EINVAL, "%s: NaN accepted", spec);
    CHECK(strstr(epipe_codec_last_error(gpu), "index 5") != NULL, "%s: %s", spec,
          epipe_codec_last_error(gpu));
    CHECK(epipe_codec_synchronize(gpu) == EPIPE_OK, "%s: reported twice", spec);
    CUDA_OK(cudaMemcpy(dx + 5, &x[5], 4, cudaMemcpyHostToDevice));
    if (code16) { /* codes beyond fp16: refused by name */
        std::vector<float> big(n, 3e5f);
        CUDA_OK(cudaMemcpy(dx, big.data(), n * 4, cudaMemcpyHostToDevice));
        CHECK(epipe_codec_encode(gpu, &ds, dp, cap, &w) == EPIPE_OK, "%s: enqueue", spec);
        CHECK(epipe_codec_synchronize(gpu) == EPIPE_EINVAL, "%s: beyond fp16 accepted", spec);
        CHECK(strstr(epipe_codec_last_error(gpu), "fp16") != NULL, "%s: %s", spec,
              epipe_codec_last_error(gpu));
        CUDA_OK(cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice));
    }
    /* a corrupt code (an infinity) in a device payload */
    {
        size_t wc = 0;
        CHECK(epipe_codec_encode(cpu, &hs, pc.data(), cap, &wc) == EPIPE_OK, "cpu encode");
        size_t at = 16 + (zcount / 2) * (code16 ? 2 : 4);
        if (code16)
            pc[at] = 0x00, pc[at + 1] = 0x7c;
        else
            pc[at] = 0, pc[at + 1] = 0, pc[at + 2] = 0x80, pc[at + 3] = 0x7f;
        CUDA_OK(cudaMemcpy(dp, pc.data(), wc, cudaMemcpyHostToDevice));
        CHECK(epipe_codec_decode(gpu, dp, wc, &dd) == EPIPE_OK, "%s: enqueue", spec);
        CHECK(epipe_codec_synchronize(gpu) == EPIPE_EPROTO, "%s: corrupt code accepted", spec);
        CHECK(epipe_codec_decode(cpu, pc.data(), wc, &hy) == EPIPE_EPROTO, "cpu: corrupt");
    }
    /* training: the forward keeps its input (encode) or code (decode) on
     * the device, the backward passes run there, and the parameter
     * gradients land in the host's tensors, each within 1e-5 of the CPU's */
    CHECK(epipe_codec_set_param(cpu, EPIPE_CODEC_MICROBATCH, 3) == EPIPE_OK, "knob");
    CHECK(epipe_codec_set_param(gpu, EPIPE_CODEC_MICROBATCH, 3) == EPIPE_OK, "knob");
    size_t wc = 0, wg = 0;
    CHECK(epipe_codec_encode(cpu, &hs, pc.data(), cap, &wc) == EPIPE_OK, "cpu encode");
    CHECK(epipe_codec_encode(gpu, &ds, dp, cap, &wg) == EPIPE_OK, "%s: training encode: %s", spec,
          epipe_codec_last_error(gpu));
    CHECK(epipe_codec_decode(cpu, pc.data(), wc, &hy) == EPIPE_OK, "cpu decode");
    CHECK(epipe_codec_decode(gpu, pc.data(), wc, &dd) == EPIPE_OK, "%s: training decode: %s", spec,
          epipe_codec_last_error(gpu));
    CHECK(epipe_codec_synchronize(gpu) == EPIPE_OK, "%s", epipe_codec_last_error(gpu));
    int zndim = 0;
    int64_t zshape[EPIPE_CODEC_MAX_NDIM];
    CHECK(epipe_codec_code_shape(cpu, &hs, &zndim, zshape) == EPIPE_OK, "code shape");
    std::vector<float> gz(zcount), gy(n), gxc(n), gxg(n), gzc(zcount), gzg(zcount);
    fill(gz, 3);
    fill(gy, 4);
    float *dgz, *dgx;
    CUDA_OK(cudaMalloc((void **)&dgz, zcount * 4));
    CUDA_OK(cudaMalloc((void **)&dgx, n * 4));
    CUDA_OK(cudaMemcpy(dgz, gz.data(), zcount * 4, cudaMemcpyHostToDevice));
    DLTensor hgz = tensor(kDLCPU, gz.data(), zshape, 32, kDLFloat), dgzt = hgz;
    hgz.ndim = dgzt.ndim = zndim;
    dgzt.data = dgz;
    dgzt.device.device_type = kDLCUDA;
    DLTensor hgx = hs, dgxt = ds;
    hgx.data = gxc.data();
    dgxt.data = dgx;
    CHECK(epipe_codec_encode_backward(cpu, 3, &hgz, &hgx) == EPIPE_OK, "cpu backward");
    CHECK(epipe_codec_encode_backward(gpu, 3, &dgzt, &dgxt) == EPIPE_OK,
          "%s: gpu encode backward: %s", spec, epipe_codec_last_error(gpu));
    CUDA_OK(cudaMemcpy(gxg.data(), dgx, n * 4, cudaMemcpyDeviceToHost));
    double eb = rel_diff(gxg.data(), gxc.data(), gxc.data(), n);
    CHECK(eb <= 1e-5, "%s: the input's gradient is %.3g off the CPU's", spec, eb);
    CHECK(epipe_codec_encode_backward(gpu, 3, &dgzt, &dgxt) == EPIPE_ESTATE,
          "%s: a second backward of one forward", spec);
    /* the decoder's backward: gy to the code's gradient, and Rt's gradient */
    CUDA_OK(cudaMemcpy(dgx, gy.data(), n * 4, cudaMemcpyHostToDevice));
    DLTensor hgy = hgx, dgyt = dgxt;
    hgy.data = gy.data();
    hgz.data = gzc.data();
    CHECK(epipe_codec_decode_backward(cpu, 3, &hgy, &hgz) == EPIPE_OK, "cpu decode backward");
    CHECK(epipe_codec_decode_backward(gpu, 3, &dgyt, &dgzt) == EPIPE_OK,
          "%s: gpu decode backward: %s", spec, epipe_codec_last_error(gpu));
    CUDA_OK(cudaMemcpy(gzg.data(), dgz, zcount * 4, cudaMemcpyDeviceToHost));
    double ed = rel_diff(gzg.data(), gzc.data(), gzc.data(), zcount);
    CHECK(ed <= 1e-5, "%s: the code's gradient is %.3g off the CPU's", spec, ed);
    for (unsigned i = 0; i < 2; i++) { /* E's and Rt's gradients, in the host's tensors */
        const char *name;
        DLTensor *pc0, *gc0, *pg0, *gg0;
        CHECK(epipe_codec_tensor(cpu, i, &name, &pc0, &gc0) == EPIPE_OK &&
                  epipe_codec_tensor(gpu, i, &name, &pg0, &gg0) == EPIPE_OK,
              "tensors");
        CHECK(gg0->device.device_type == kDLCPU, "%s: a parameter gradient on the device", spec);
        size_t wcount = 1;
        for (int d = 0; d < gc0->ndim; d++)
            wcount *= (size_t)gc0->shape[d];
        double eg = rel_diff((const float *)gg0->data, (const float *)gc0->data,
                             (const float *)gc0->data, wcount);
        CHECK(eg <= 1e-5, "%s: %s's gradient is %.3g off the CPU's", spec, name, eg);
    }
    CHECK(epipe_codec_decode_backward(gpu, 4, &dgyt, &dgzt) == EPIPE_ESTATE,
          "%s: a backward with nothing kept", spec);
    cudaFree(dgz);
    cudaFree(dgx);
    cudaFree(dx);
    cudaFree(dy);
    cudaFree(dp);
    epipe_codec_destroy(cpu);
    epipe_codec_destroy(gpu);
}

/* Host staging (lib/codec/cuda_staged.c): a chain and activation deltas
 * take CUDA tensors through the CPU backend on pinned host copies, so
 * their payloads, into pinned and device memory in turn, are the CPU's
 * bytes, and their decodes the CPU's floats, step after step (the deltas'
 * rows seen again in every other step). */
static void staged_matches_cpu(const char *spec, int64_t rows, int64_t cols, int delta)
{
    int64_t shape[2] = {rows, cols};
    size_t n = (size_t)(rows * cols);
    epipe_codec *c[4]; /* CPU encode, CPU decode, GPU encode, GPU decode */
    for (int i = 0; i < 4; i++)
        CHECK(epipe_codec_create(&c[i], spec) == EPIPE_OK, "%s: %s", spec, epipe_last_error());
    std::vector<float> x(n), yc(n), yg(n);
    float *dx, *dy;
    CUDA_OK(cudaMalloc((void **)&dx, n * 4));
    CUDA_OK(cudaMalloc((void **)&dy, n * 4));
    DLTensor hx = tensor(kDLCPU, x.data(), shape, 32, kDLFloat);
    DLTensor gx = tensor(kDLCUDA, dx, shape, 32, kDLFloat);
    DLTensor hy = tensor(kDLCPU, yc.data(), shape, 32, kDLFloat);
    DLTensor gy = tensor(kDLCUDA, dy, shape, 32, kDLFloat);
    hx.ndim = gx.ndim = hy.ndim = gy.ndim = 2;
    size_t cap = 0;
    CHECK(epipe_codec_max_encoded_size(c[2], &gx, &cap) == EPIPE_OK, "%s: size", spec);
    std::vector<uint8_t> pc(cap), back(cap);
    uint8_t *pinned, *dp;
    CUDA_OK(cudaHostAlloc((void **)&pinned, cap, cudaHostAllocDefault));
    CUDA_OK(cudaMalloc((void **)&dp, cap));
    std::vector<uint64_t> ids((size_t)rows);
    for (unsigned step = 0; step < 4; step++) {
        fill(x, 17 + step);
        CUDA_OK(cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice));
        for (int64_t r = 0; delta && r < rows; r++)
            ids[(size_t)r] = (uint64_t)r + (step % 2) * 3;
        for (int i = 0; delta && i < 4; i += 2)
            CHECK(epipe_codec_set_samples(c[i], ids.data(), ids.size()) == EPIPE_OK, "%s",
                  epipe_codec_last_error(c[i]));
        int on_device = step % 2;
        uint8_t *pg = on_device ? dp : pinned;
        size_t wc = 0, wg = 0;
        CHECK(epipe_codec_encode(c[0], &hx, pc.data(), cap, &wc) == EPIPE_OK, "%s: %s", spec,
              epipe_codec_last_error(c[0]));
        CHECK(epipe_codec_encode(c[2], &gx, pg, cap, &wg) == EPIPE_OK &&
                  epipe_codec_synchronize(c[2]) == EPIPE_OK,
              "%s step %u: gpu encode: %s", spec, step, epipe_codec_last_error(c[2]));
        CUDA_OK(cudaMemcpy(back.data(), pg, wg, cudaMemcpyDefault));
        CHECK(wc == wg && memcmp(back.data(), pc.data(), wc) == 0,
              "%s step %u: the %s payload is not the CPU's (%zu vs %zu bytes)", spec, step,
              on_device ? "device" : "pinned", wg, wc);
        CHECK(epipe_codec_decode(c[1], pc.data(), wc, &hy) == EPIPE_OK, "%s: cpu decode: %s",
              spec, epipe_codec_last_error(c[1]));
        CHECK(epipe_codec_decode(c[3], pg, wg, &gy) == EPIPE_OK &&
                  epipe_codec_synchronize(c[3]) == EPIPE_OK,
              "%s step %u: gpu decode: %s", spec, step, epipe_codec_last_error(c[3]));
        CUDA_OK(cudaMemcpy(yg.data(), dy, n * 4, cudaMemcpyDeviceToHost));
        CHECK(memcmp(yg.data(), yc.data(), n * 4) == 0, "%s step %u: decoded floats differ",
              spec, step);
        const uint64_t *got = NULL;
        size_t ng = 0;
        CHECK(!delta || (epipe_codec_decoded_samples(c[3], &got, &ng) == EPIPE_OK &&
                         ng == ids.size() && memcmp(got, ids.data(), ng * 8) == 0),
              "%s step %u: the decoded rows' ids", spec, step);
    }
    if (delta) {
        epipe_codec_delta_info info;
        CHECK(epipe_codec_delta_stats(c[2], &info) == EPIPE_OK && info.delta_rows > 0,
              "%s: no row went as a delta", spec);
    }
    for (int i = 0; i < 4; i++)
        epipe_codec_destroy(c[i]);
    cudaFree(dx);
    cudaFree(dy);
    cudaFree(dp);
    cudaFreeHost(pinned);
}

int main(void)
{
    gpu_test_devices_or_skip();
    const char *specs[] = {"none",
                           "cast:dtype=fp16",
                           "cast:dtype=bf16",
                           "quant:bits=8",
                           "quant:bits=4",
                           "quant:bits=13",
                           "quant:bits=1",
                           "quant:bits=4,zero=1", /* 0 on the grid: the moved min */
                           "quant:bits=2,zero=1",
                           "sortquant:bits=8,mode=sample",
                           "sortquant:bits=4,split=1,mode=sample",
                           "sortquant:bits=12,split=8,mode=sample,sample=1024",
                           "sortquant:bits=16,split=12,mode=sample",
                           "sortquant:bits=4,split=1,mode=sample,zero=1",
                           "sortquant:bits=8,split=3,mode=sample", /* 8 and 16 chunks: */
                           "sortquant:bits=8,split=4,mode=sample", /* the fused kernels */
                           "sortquant:bits=6,split=0,mode=sample", /* one chunk */
                           "sortquant:bits=8", /* mode=fit, the default, split chosen */
                           "sortquant:bits=4,mode=fit",
                           "sortquant:bits=2,mode=fit",
                           "sortquant:bits=8,mode=fit,split=3",
                           "sortquant:bits=4,mode=fit,zero=1",
                           "sortquant:bits=8,zero=1",
                           "sortquant:bits=12,mode=fit,sample=1024",
                           "sortquant:bits=8,mode=exact",
                           "sortquant:bits=4,split=1,mode=exact",
                           "sortquant:bits=12,split=8,mode=exact",
                           "sortquant:bits=4,split=1,mode=exact,zero=1",
                           "sortquant:bits=16,split=12,mode=exact",
                           "topk:ratio=0.1",
                           "topk:ratio=0.001",
                           "topk:ratio=0.5",
                           "topk:ratio=1",
                           /* up to 65536 values (2^18 at 12 bits) the fit runs on
                            * all of them; above, on the sample and the tails */
                           "kmeans:bits=2",
                           "kmeans:bits=4",
                           "kmeans:bits=8,iters=5",
                           "kmeans:bits=12,iters=3"};
    const size_t sizes[] = {0, 1, 7, 8, 9, 1000, 4097, 1 << 20, 3000017};
    /* EPIPE_GPU_TEST_QUICK: small tensors only (the compute-sanitizer runs,
     * which are 10-100x slower, check the kernels, not the sizes) */
    const char *quick = getenv("EPIPE_GPU_TEST_QUICK");
    const size_t max_n = quick && *quick && strcmp(quick, "0") ? 5000 : SIZE_MAX;
    gpu_test_part("byte identity");
    for (const char *s : specs)
        for (size_t n : sizes)
            for (size_t off : {0, 1})
                if (n <= max_n)
                    byte_identity(s, n, off,
                                  !strstr(s, "sortquant") || strstr(s, "mode=sample") ? 0
                                  : strstr(s, "mode=exact")                           ? 2
                                                                                      : 1);
    /* just past 64K values, in quick runs too: the cooperative encodes
     * (quant; sample mode with 2 to 16 chunks) under compute-sanitizer */
    for (const char *s : {"quant:bits=8", "sortquant:bits=8,mode=sample",
                          "sortquant:bits=8,split=4,mode=sample,zero=1", "topk:ratio=0.01"})
        byte_identity(s, 65543, 1);
    /* topk past 64K (one cooperative launch), ties at the threshold; and
     * both paths with a sample that misleads */
    byte_identity("topk:ratio=0.3", 65543, 0, 2);
    const uint64_t tk_sample = 16384; /* TK_SAMPLE in cuda/topk.cu: with another size
                                       * the large values miss the sample and the
                                       * second pass goes untested */
    topk_sample_misses(65543, 0.05, tk_sample);
    topk_sample_misses(40009, 0.05, tk_sample);
    gpu_test_part("byte identity, other data");
    for (size_t n : sizes) { /* the other data for fit and exact; ties for topk */
        if (n > max_n)
            continue;
        byte_identity("topk:ratio=0.7", n, 0, 1);
        byte_identity("topk:ratio=0.3", n, 1, 2);
        byte_identity("sortquant:bits=8,mode=fit", n, 0, 0);
        byte_identity("sortquant:bits=8,mode=exact", n, 0, 0);
        /* sample mode's radix select on half zeros of both signs (one bin
         * takes half the sample) and on ties */
        byte_identity("sortquant:bits=8,mode=sample", n, 0, 1);
        byte_identity("sortquant:bits=12,split=6,mode=sample", n, 1, 2);
        /* zeros of both signs: an extreme that is 0 is the first zero */
        byte_identity("kmeans:bits=4", n, 0, 1);
        byte_identity("kmeans:bits=2", n, 1, 2);
    }
    gpu_test_part("fp16 and bf16 tensors");
    for (const char *s : specs) {
        half_tensors(s, 0);
        half_tensors(s, 1);
    }
    gpu_test_part("deferred errors");
    deferred_nonfinite("quant:bits=8");
    deferred_nonfinite("sortquant:bits=8,mode=sample");
    deferred_nonfinite("sortquant:bits=8,mode=fit");
    deferred_nonfinite("sortquant:bits=8,mode=exact");
    /* past 64K values: quant's and sample mode's cooperative launches */
    deferred_nonfinite("quant:bits=8", 200000);
    deferred_nonfinite("sortquant:bits=8,mode=sample", 200000);
    destroy_reports_unreturned("quant:bits=8");
    destroy_reports_unreturned("topk:ratio=0.1");
    held_then_noted(1); /* the held one said by destroy */
    for (const char *s : {"quant:bits=8", "quant:bits=4,rows=1", "sortquant:bits=8,mode=sample",
                          "sortquant:bits=8,mode=fit", "sortquant:bits=8,mode=exact",
                          "sortquant:bits=12,split=6,mode=exact", "topk:ratio=0.1"})
        for (float inf : {-INFINITY, INFINITY})
            deferred_infinity(s, inf);
    deferred_infinity("sortquant:bits=8,mode=sample", -INFINITY, 200000);
    kmeans_refuses_nonfinite(5000);   /* the fit on all values */
    kmeans_refuses_nonfinite(300000); /* the fit on the sample */
    gpu_test_part("rows and groups");
    rows_match_cpu("quant:bits=2,rows=1", 16, 3136);
    rows_match_cpu("quant:bits=3,rows=1", 5, 333); /* rows not 4-aligned, codes not bytes */
    rows_match_cpu("quant:bits=8,zero=1,rows=1", 70000, 3); /* rows past one grid's y */
    rows_match_cpu("quant:bits=4,rows=1", 1, 100000);  /* one row: the one-range path */
    rows_match_cpu("quant:bits=2,zero=1,group=196", 16, 3136); /* a range per channel */
    rows_match_cpu("quant:bits=3,group=111", 5, 333);          /* runs not 4-aligned */
    gpu_test_part("error feedback");
    for (int dev = 0; dev < 2; dev++) {
        ef_matches_cpu("quant:bits=2,ef=1", dev);
        ef_matches_cpu("quant:bits=4,zero=1,ef=1", dev);
        ef_matches_cpu("sortquant:bits=4,ef=1", dev);
        ef_matches_cpu("sortquant:bits=2,mode=sample,ef=1", dev);
        ef_matches_cpu("cast:dtype=bf16,ef=1", dev);
        ef_matches_cpu("topk:ratio=0.05,ef=1", dev);
    }
    gpu_test_part("insert");
    /* conv (cuDNN): [B,C,H,W] to [B,K,H/k,W/k]; linear (cuBLAS): [..., D] to [..., d] */
    insert_close_to_cpu("insert:kind=conv,out=4,kernel=2,seed=3", {3, 8, 6, 10}, 3 * 4 * 3 * 5, 0);
    insert_close_to_cpu("insert:kind=conv,ratio=0.25,kernel=4,code=fp16", {2, 4, 8, 8},
                        2 * 16 * 2 * 2, 1);
    insert_close_to_cpu("insert:kind=conv,out=4,kernel=2", {32, 32, 28, 28}, 32 * 4 * 14 * 14, 0);
    insert_close_to_cpu("insert:kind=linear,out=2,seed=3", {5, 7, 16}, 5 * 7 * 2, 0);
    insert_close_to_cpu("insert:kind=linear,out=8,code=fp16", {33, 64}, 33 * 8, 1);
    gpu_test_part("host staging: a chain, activation deltas");
    staged_matches_cpu("insert:kind=linear,out=8,seed=3|quant:bits=8", 12, 64, 0);
    staged_matches_cpu("quant:bits=2,rows=1,delta=1", 8, 300, 1);
    staged_matches_cpu("sortquant:bits=4,delta=1", 6, 1000, 1);
    gpu_test_part("poweriter");
    poweriter_close_to_cpu("poweriter:rank=3", 8, 16, 64);
    poweriter_close_to_cpu("poweriter:rank=2,iters=2,factors=fp16", 4, 32, 200);
    poweriter_close_to_cpu("poweriter:rank=4,warm=0", 3, 8, 8);
    /* the fused products over several tiles of columns and groups of rows
     * (enough matrices for the fused path: PI_FUSED_MIN_BLOCKS); few wide
     * matrices of many rows (cuBLAS, the device's QR); then cuBLAS with
     * the device's QR (rank above 8), and with the host's (rank above 64) */
    poweriter_close_to_cpu("poweriter:rank=3,iters=2", 64, 70, 300);
    poweriter_close_to_cpu("poweriter:rank=3", 2, 70, 600);
    poweriter_close_to_cpu("poweriter:rank=12", 3, 16, 40);
    poweriter_close_to_cpu("poweriter:rank=70", 2, 72, 80);
    poweriter_warm_start_follows_cpu();
    poweriter_ef_follows_cpu();
    gpu_test_part("hostile payloads, mix-ups");
    hostile_table();
    hostile_device_payload();
    /* a header byte (the codec id), then a table's min made NaN */
    for (const char *spec : {"none", "cast:dtype=fp16", "topk:ratio=0.1"})
        deferred_checks(spec, {0});
    for (const char *spec : {"quant:bits=4", "quant:bits=3,group=100",
                             "sortquant:bits=4,mode=sample", "sortquant:bits=4,mode=exact"}) {
        deferred_checks(spec, {0});
        deferred_checks(spec, {18, 19});
    }
    /* poweriter's body header (its first byte), insert's codec id */
    deferred_checks("poweriter:rank=2,shared=1", {0}, 40, 1e-4);
    deferred_checks("poweriter:rank=2,shared=1", {16}, 40, 1e-4);
    deferred_checks("insert:kind=linear,out=8,seed=3", {0}, 40, 1e-4);
    deferred_checks_keep_to_their_call();
    held_then_noted(0);
    refused_decode_binds();
    checks_at_once();
    mixups();
    gpu_test_part("done");
    return gpu_test_result();
}
