/* Hostile payloads decoded on the GPU against the CPU, and extreme tensors
 * encoded by both, under the emulator (tests/cudaemu/): a differential
 * fuzz of the CUDA module's payload checks and kernels, which no libFuzzer
 * target reaches.
 *
 * Decoders: for each codec, valid payloads are mutated at random (bits
 * flipped, bytes set, truncated, lengthened; mostly in the header and
 * tables, where the checks are) and decoded by both backends, the GPU from
 * pinned host memory and from device memory by turns. Both must refuse a
 * payload with the same status (the GPU's may come from the next
 * synchronize: the deferred checks), or both accept it and write the same
 * floats, bit for bit. EPIPE_HOSTILE_ROUNDS: rounds a codec (2000).
 *
 * Encoders: tensors of constants, zeros of both signs, subnormals, huge
 * outliers, ties and the odd NaN or infinity, 1 to 70,000 values, encoded
 * by both: the same status, and the same bytes when both accept.
 * EPIPE_HOSTILE_ENCODES: rounds a codec (24).
 *
 * EPIPE_HOSTILE_SPECS: only the codec settings whose spec holds this text
 * (for a long campaign on one codec).
 *
 * Exit 77 without the emulator's device. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include <epipe/epipe.h>

#include "gpu_test.h"

static uint64_t rng = 0x243f6a8885a308d3ull;
static uint64_t next_random(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static DLTensor tensor(int type, void *data, int64_t *shape, int ndim)
{
    DLTensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.device.device_type = (DLDeviceType)type;
    t.ndim = ndim;
    t.shape = shape;
    t.dtype.code = kDLFloat;
    t.dtype.bits = 32;
    t.dtype.lanes = 1;
    return t;
}

/* One mutation of p (length n, at most cap); its description in what. */
static size_t mutate(uint8_t *p, size_t n, size_t cap, char *what, size_t wcap)
{
    /* mostly the first 96 bytes: the header, the tables, topk's first entries */
    size_t span = n < 96 || next_random() % 4 == 0 ? n : 96;
    size_t at = span ? next_random() % span : 0;
    switch (next_random() % 6) {
    case 0:
    case 1: {
        unsigned bit = (unsigned)(next_random() % 8);
        if (n)
            p[at] ^= (uint8_t)(1u << bit);
        snprintf(what, wcap, "bit %u of byte %zu flipped", bit, at);
        return n;
    }
    case 2: {
        static const uint8_t vals[] = {0x00, 0xff, 0x7f, 0x80, 0x01};
        uint8_t v = next_random() % 2 ? vals[next_random() % 5] : (uint8_t)next_random();
        if (n)
            p[at] = v;
        snprintf(what, wcap, "byte %zu set to %#x", at, v);
        return n;
    }
    case 3: { /* a float of a table set to something extreme */
        static const uint32_t f[] = {0x7fc00000u, 0x7f800000u, 0xff800000u, 0x80000000u,
                                     0x00000001u, 0x7f7fffffu};
        uint32_t v = f[next_random() % 6];
        size_t a = n >= 4 ? (at & ~(size_t)3) % (n - 3) : 0;
        if (n >= 4)
            memcpy(p + a, &v, 4);
        snprintf(what, wcap, "bytes %zu..%zu set to the float bits %#x", a, a + 3, v);
        return n;
    }
    case 4: {
        size_t m = n ? next_random() % n : 0;
        snprintf(what, wcap, "truncated from %zu to %zu bytes", n, m);
        return m;
    }
    default: {
        size_t m = n + 1 + next_random() % 16;
        m = m > cap ? cap : m;
        for (size_t i = n; i < m; i++)
            p[i] = (uint8_t)next_random();
        snprintf(what, wcap, "lengthened from %zu to %zu bytes", n, m);
        return m;
    }
    }
}

/* EPIPE_HOSTILE_SPECS, where set, names the settings to run. */
static bool wanted(const char *spec)
{
    const char *only = getenv("EPIPE_HOSTILE_SPECS");
    return !only || !*only || strstr(spec, only);
}

/* max |a - b| over max |a| (0 when a is all zeros and b equals it). */
static double rel_gap(const float *a, const float *b, size_t n)
{
    double d = 0, m = 0;
    for (size_t i = 0; i < n; i++) {
        d = fmax(d, fabs((double)a[i] - b[i]));
        m = fmax(m, fabs((double)a[i]));
    }
    return m > 0 ? d / m : d;
}

/* tol: 0, the same floats bit for bit; else within tol of the largest
 * (poweriter: its GPU rounds differently, docs/codecs.md). */
static void differential(const char *spec, int64_t rows, int64_t cols, int rounds, double tol = 0)
{
    if (!wanted(spec))
        return;
    int64_t shape[2] = {rows, cols};
    size_t n = (size_t)(rows * cols);
    std::vector<float> x(n), yc(n), yg(n);
    for (size_t i = 0; i < n; i++)
        x[i] = (float)((i * 2654435761u) % 4001) / 1000.0f - 2.0f + (i % 17 == 0 ? 30.0f : 0.0f);
    epipe_codec *cpu, *gpu;
    if (epipe_codec_create(&cpu, spec) != EPIPE_OK) {
        printf("SKIP %s: %s\n", spec, epipe_last_error());
        return;
    }
    CHECK(epipe_codec_create(&gpu, spec) == EPIPE_OK, "%s", epipe_last_error());
    DLTensor hx = tensor(kDLCPU, x.data(), shape, 2), hy = tensor(kDLCPU, yc.data(), shape, 2);
    size_t cap = 0, w = 0;
    CHECK(epipe_codec_max_encoded_size(cpu, &hx, &cap) == EPIPE_OK, "%s: size", spec);
    cap += 32; /* room to lengthen */
    std::vector<uint8_t> good(cap), bad(cap);
    CHECK(epipe_codec_encode(cpu, &hx, good.data(), cap, &w) == EPIPE_OK, "%s: encode: %s", spec,
          epipe_codec_last_error(cpu));
    float *dy;
    uint8_t *pin, *dev;
    CUDA_OK(cudaMalloc((void **)&dy, n * 4));
    CUDA_OK(cudaHostAlloc((void **)&pin, cap, cudaHostAllocDefault));
    CUDA_OK(cudaMalloc((void **)&dev, cap));
    DLTensor dd = tensor(kDLCUDA, dy, shape, 2);
    int refused = 0, accepted = 0, disagreed = 0;
    for (int r = 0; r < rounds && disagreed < 5; r++) {
        memcpy(bad.data(), good.data(), w);
        char what[160];
        size_t m = mutate(bad.data(), w, cap, what, sizeof what);
        if (next_random() % 3 == 0) { /* two mutations */
            char more[160];
            m = mutate(bad.data(), m, cap, more, sizeof more);
            snprintf(what + strlen(what), sizeof what - strlen(what), ", then %.100s", more);
        }
        int rc_c = epipe_codec_decode(cpu, bad.data(), m, &hy);
        int on_device = r % 2;
        uint8_t *p = on_device ? dev : pin;
        CUDA_OK(cudaMemcpy(p, bad.data(), m ? m : 1, cudaMemcpyDefault));
        CUDA_OK(cudaMemset(dy, 0xcd, n * 4));
        int rc_g = epipe_codec_decode(gpu, p, m, &dd);
        int rc_s = epipe_codec_synchronize(gpu);
        int rc = rc_g ? rc_g : rc_s;
        if (rc_g && rc_s)
            CHECK(0, "%s: %s: a refused decode left a deferred error %d", spec, what, rc_s);
        if (rc_c != rc) {
            CHECK(0, "%s (%s payload): %s: the CPU returns %d (%s), the GPU %d (%s)", spec,
                  on_device ? "device" : "pinned", what, rc_c,
                  rc_c ? epipe_codec_last_error(cpu) : "", rc,
                  rc ? epipe_codec_last_error(gpu) : "");
            disagreed++;
            continue;
        }
        if (rc) {
            refused++;
            continue;
        }
        accepted++;
        CUDA_OK(cudaMemcpy(yg.data(), dy, n * 4, cudaMemcpyDeviceToHost));
        if (tol > 0) {
            double gap = rel_gap(yc.data(), yg.data(), n);
            if (!(gap <= tol)) {
                CHECK(0, "%s (%s payload): %s: both accept it; the GPU's tensor is %.3g off",
                      spec, on_device ? "device" : "pinned", what, gap);
                disagreed++;
            }
        } else if (memcmp(yc.data(), yg.data(), n * 4)) {
            size_t i = 0;
            while (!memcmp(&yc[i], &yg[i], 4))
                i++;
            CHECK(0, "%s (%s payload): %s: both accept it, and value %zu is %a on the CPU, %a on "
                     "the GPU",
                  spec, on_device ? "device" : "pinned", what, i, (double)yc[i], (double)yg[i]);
            disagreed++;
        }
    }
    printf("%-36s %4d refused by both, %4d accepted by both with the same floats%s\n", spec,
           refused, accepted, tol > 0 ? " (within the tolerance)" : "");
    CUDA_OK(cudaFree(dy));
    CUDA_OK(cudaFreeHost(pin));
    CUDA_OK(cudaFree(dev));
    epipe_codec_destroy(cpu);
    epipe_codec_destroy(gpu);
}

/* Tensors at the edges, for the encoders: constants, mostly zeros, zeros
 * of both signs, subnormals, huge outliers, heavy ties, and now and then a
 * NaN or an infinity; sizes from 1 to past the cooperative paths' 64K. */
static size_t extreme_tensor(std::vector<float> &x, int64_t cols, char *what, size_t wcap)
{
    static const size_t sizes[] = {1, 2, 7, 8, 9, 250, 1000, 4096, 5000, 65536, 70000};
    size_t n = sizes[next_random() % (sizeof sizes / sizeof *sizes)];
    n = (n + (size_t)cols - 1) / (size_t)cols * (size_t)cols; /* whole rows */
    x.resize(n);
    unsigned kind = (unsigned)(next_random() % 8);
    static const char *const kinds[] = {"a constant", "mostly zeros", "zeros of both signs",
                                        "subnormals", "huge outliers", "heavy ties",
                                        "spread over 60 binades", "uniform"};
    float c = (float)((int)(next_random() % 7) - 3) * 0.75f;
    for (size_t i = 0; i < n; i++) {
        float u = (float)((double)(next_random() >> 11) / 9007199254740992.0) * 2.0f - 1.0f;
        switch (kind) {
        case 0: x[i] = c; break;
        case 1: x[i] = next_random() % 50 ? 0.0f : u; break;
        case 2: x[i] = next_random() % 2 ? 0.0f : -0.0f; break;
        case 3: x[i] = u * 1e-40f; break;
        case 4: x[i] = next_random() % 100 ? u : u * 3e37f; break;
        case 5: x[i] = (float)(int)(u * 3.0f); break;
        case 6: x[i] = u * ldexpf(1.0f, (int)(next_random() % 60) - 30); break;
        default: x[i] = u; break;
        }
    }
    int special = next_random() % 8 == 0;
    if (special) {
        static const float sp[] = {NAN, INFINITY, -INFINITY};
        x[next_random() % n] = sp[next_random() % 3];
    }
    snprintf(what, wcap, "%zu values, %s%s", n, kinds[kind], special ? ", one not finite" : "");
    return n;
}

/* Encodes extreme tensors with both backends: the same status, and the
 * same bytes when both accept (tol 0), or payloads that the CPU decodes
 * within tol of each other (relative to the largest value). */
static void differential_encode(const char *spec, int64_t cols, int rounds, double tol = 0)
{
    if (!wanted(spec))
        return;
    epipe_codec *cpu, *gpu;
    if (epipe_codec_create(&cpu, spec) != EPIPE_OK) {
        printf("SKIP %s: %s\n", spec, epipe_last_error());
        return;
    }
    CHECK(epipe_codec_create(&gpu, spec) == EPIPE_OK, "%s", epipe_last_error());
    std::vector<float> x;
    std::vector<uint8_t> pc, pg;
    int refused = 0, same = 0, disagreed = 0;
    for (int r = 0; r < rounds && disagreed < 5; r++) {
        char what[120];
        size_t n = extreme_tensor(x, cols, what, sizeof what);
        int64_t shape[2] = {(int64_t)n / cols, cols};
        DLTensor hx = tensor(kDLCPU, x.data(), shape, 2);
        size_t cap = 0, wc = 0, wg = 0;
        CHECK(epipe_codec_max_encoded_size(cpu, &hx, &cap) == EPIPE_OK, "%s: size", spec);
        pc.resize(cap);
        pg.resize(cap);
        float *dx;
        uint8_t *pin;
        CUDA_OK(cudaMalloc((void **)&dx, n * 4));
        CUDA_OK(cudaHostAlloc((void **)&pin, cap, cudaHostAllocDefault));
        CUDA_OK(cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice));
        DLTensor dxt = tensor(kDLCUDA, dx, shape, 2);
        int rc_c = epipe_codec_encode(cpu, &hx, pc.data(), cap, &wc);
        int rc_g = epipe_codec_encode(gpu, &dxt, pin, cap, &wg);
        int rc_s = epipe_codec_synchronize(gpu);
        int rc = rc_g ? rc_g : rc_s;
        if (rc_c != rc) {
            CHECK(0, "%s: %s: the CPU returns %d (%s), the GPU %d (%s)", spec, what, rc_c,
                  rc_c ? epipe_codec_last_error(cpu) : "", rc,
                  rc ? epipe_codec_last_error(gpu) : "");
            disagreed++;
        } else if (rc) {
            refused++;
        } else if (tol > 0) {
            std::vector<float> yc(n), yg(n);
            DLTensor hc = tensor(kDLCPU, yc.data(), shape, 2), hg = tensor(kDLCPU, yg.data(), shape, 2);
            CHECK(wc == wg, "%s: %s: sizes %zu and %zu", spec, what, wc, wg);
            CHECK(epipe_codec_decode(cpu, pc.data(), wc, &hc) == EPIPE_OK, "%s", spec);
            int rd = epipe_codec_decode(cpu, pin, wg, &hg);
            double gap = rd ? INFINITY : rel_gap(yc.data(), yg.data(), n);
            if (!(gap <= tol)) {
                CHECK(0, "%s: %s: both accept it; the GPU's payload decodes %.3g off (%s)", spec,
                      what, gap, rd ? epipe_codec_last_error(cpu) : "");
                disagreed++;
            } else {
                same++;
            }
        } else if (wc != wg || memcmp(pc.data(), pin, wc)) {
            size_t i = 0;
            while (i < wc && i < wg && pc[i] == pin[i])
                i++;
            CHECK(0, "%s: %s: both accept it; payloads of %zu and %zu bytes differ first at %zu",
                  spec, what, wc, wg, i);
            disagreed++;
        } else {
            same++;
        }
        CUDA_OK(cudaFree(dx));
        CUDA_OK(cudaFreeHost(pin));
    }
    printf("%-36s %4d refused by both, %4d encoded to %s\n", spec, refused, same,
           tol > 0 ? "payloads that decode alike" : "the same bytes");
    epipe_codec_destroy(cpu);
    epipe_codec_destroy(gpu);
}

int main(void)
{
    gpu_test_devices_or_skip();
    const char *env = getenv("EPIPE_HOSTILE_ROUNDS");
    int rounds = env && atoi(env) > 0 ? atoi(env) : 2000;
    const char *specs[] = {"none",
                           "cast:dtype=fp16",
                           "cast:dtype=bf16",
                           "quant:bits=8",
                           "quant:bits=3",
                           "quant:bits=4,zero=1",
                           "sortquant:bits=8,mode=sample",
                           "sortquant:bits=4",
                           "sortquant:bits=8,mode=exact",
                           "sortquant:bits=12,split=6,mode=sample",
                           "topk:ratio=0.1",
                           "topk:ratio=0.01",
                           "topk:ratio=0.5",
                           "kmeans:bits=2",
                           "kmeans:bits=4"};
    for (const char *s : specs)
        differential(s, 40, 125, rounds);
    differential("quant:bits=4,rows=1", 40, 125, rounds);
    differential("quant:bits=2,group=25", 40, 125, rounds);
    differential("poweriter:rank=3,shared=1", 40, 125, rounds, 1e-5);
    differential("poweriter:rank=2,factors=fp16,shared=1", 40, 125, rounds, 1e-5);
    /* the encoders on extreme tensors (25 values a row for rows=1 and
     * group=25); fewer rounds: the tensors are larger */
    env = getenv("EPIPE_HOSTILE_ENCODES");
    int encodes = env && atoi(env) > 0 ? atoi(env) : 24;
    for (const char *s : specs)
        differential_encode(s, 1, encodes);
    differential_encode("quant:bits=4,rows=1", 25, encodes);
    differential_encode("quant:bits=2,group=25,zero=1", 25, encodes);
    /* 1e-3, not the 1e-4 of the gpu suite's small matrices: up to 2,800
     * rows here, whose sums in fp32 (the emulator's cuBLAS adds them in
     * order) stray by about rows x 2^-24 from OpenBLAS's */
    differential_encode("poweriter:rank=2,warm=0,shared=1", 25, encodes, 1e-3);
    return gpu_test_result();
}
