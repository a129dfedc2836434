/* CUDA errors mid-call, under the emulator (tests/cudaemu/): for each
 * codec, every CUDA call an encode and a decode make is failed in turn
 * (cudaemu_fail_at). Each failure must come back as EPIPE_ENOMEM or
 * EPIPE_EIO with a message naming the CUDA error, from the call or from the
 * next epipe_codec_synchronize(), never lost, never a crash or a hang; and
 * the handle must work again once CUDA does (the same bytes as before,
 * where the codec keeps no state between calls). Then a sticky error (as
 * after a kernel fault): every later call fails the same way. Then a
 * cooperative launch refused for want of SMs: the encodes fall back. Exit
 * 77 without the emulator's device. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#include <vector>

#include <epipe/epipe.h>

#include "gpu_test.h"

struct fault_case {
    const char *spec;
    std::vector<int64_t> shape;
    int stateful; /* keeps state between calls (ef=1, warm starts, learning) */
};

static DLTensor tensor(int type, void *data, std::vector<int64_t> &shape)
{
    DLTensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.device.device_type = (DLDeviceType)type;
    t.ndim = (int)shape.size();
    t.shape = shape.data();
    t.dtype.code = kDLFloat;
    t.dtype.bits = 32;
    t.dtype.lanes = 1;
    return t;
}

/* The statuses of one encode (none without x), synchronize, decode (none
 * without ref), synchronize; 1 when every failure among them is reported
 * as the header promises. */
static int round_trip(epipe_codec *c, DLTensor *x, uint8_t *payload, size_t cap, size_t *written,
                      const uint8_t *ref, size_t ref_n, DLTensor *y, int rc[4], const char *what)
{
    rc[0] = x ? epipe_codec_encode(c, x, payload, cap, written) : EPIPE_OK;
    std::string m0 = rc[0] ? epipe_codec_last_error(c) : "";
    rc[1] = epipe_codec_synchronize(c);
    std::string m1 = rc[1] ? epipe_codec_last_error(c) : "";
    rc[2] = ref ? epipe_codec_decode(c, ref, ref_n, y) : EPIPE_OK;
    std::string m2 = rc[2] ? epipe_codec_last_error(c) : "";
    rc[3] = epipe_codec_synchronize(c);
    std::string m3 = rc[3] ? epipe_codec_last_error(c) : "";
    const std::string *msg[4] = {&m0, &m1, &m2, &m3};
    int ok = 1;
    for (int i = 0; i < 4; i++) {
        if (rc[i] == EPIPE_OK)
            continue;
        int named = strstr(msg[i]->c_str(), "CUDA error while") != NULL;
        CHECK((rc[i] == EPIPE_EIO || rc[i] == EPIPE_ENOMEM) && named,
              "%s: call %d returned %d: %s", what, i, rc[i], msg[i]->c_str());
        ok &= (rc[i] == EPIPE_EIO || rc[i] == EPIPE_ENOMEM) && named;
    }
    return ok;
}

static void sweep(const fault_case &fc)
{
    std::vector<int64_t> shape = fc.shape;
    size_t n = 1;
    for (int64_t d : shape)
        n *= (size_t)d;
    std::vector<float> x(n);
    uint64_t s = n * 2654435761u + 7;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)((double)(s >> 11) / 9007199254740992.0 - 0.5) * (float)(1 + i % 5);
    }
    epipe_codec *c;
    if (epipe_codec_create(&c, fc.spec) != EPIPE_OK) {
        printf("SKIP %s: %s\n", fc.spec, epipe_last_error());
        return;
    }
    float *dx, *dy;
    uint8_t *pin;
    size_t cap = 0, wref = 0, w = 0;
    CUDA_OK(cudaMalloc((void **)&dx, n * 4));
    CUDA_OK(cudaMalloc((void **)&dy, n * 4));
    CUDA_OK(cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice));
    DLTensor tx = tensor(kDLCUDA, dx, shape), ty = tensor(kDLCUDA, dy, shape);
    CHECK(epipe_codec_max_encoded_size(c, &tx, &cap) == EPIPE_OK, "%s: size", fc.spec);
    CUDA_OK(cudaHostAlloc((void **)&pin, cap, cudaHostAllocDefault));
    std::vector<uint8_t> ref(cap);
    std::vector<float> yref(n), y(n);

    /* a clean run: the reference, and how many fallible calls it makes */
    int rc[4];
    cudaemu_fail_at(0, 0);
    round_trip(c, &tx, pin, cap, &wref, NULL, 0, &ty, rc, fc.spec);
    CHECK(rc[0] == EPIPE_OK && rc[1] == EPIPE_OK, "%s: clean encode: %s", fc.spec,
          epipe_codec_last_error(c));
    memcpy(ref.data(), pin, wref);
    cudaemu_fail_at(0, 0);
    round_trip(c, &tx, pin, cap, &w, ref.data(), wref, &ty, rc, fc.spec);
    long calls = cudaemu_fallible_calls();
    CUDA_OK(cudaMemcpy(yref.data(), dy, n * 4, cudaMemcpyDeviceToHost));
    CHECK(calls > 0, "%s: no fallible CUDA calls", fc.spec);

    int lost = 0;
    for (long k = 1; k <= calls; k++) {
        char what[200];
        snprintf(what, sizeof what, "%s, CUDA call %ld of %ld failed", fc.spec, k, calls);
        cudaemu_fail_at(k, 0);
        round_trip(c, &tx, pin, cap, &w, ref.data(), wref, &ty, rc, what);
        long made = cudaemu_fallible_calls();
        cudaemu_fail_at(0, 0);
        /* the failed call was made: some status must say so */
        if (made >= k && !(rc[0] || rc[1] || rc[2] || rc[3])) {
            CHECK(0, "%s: no call reported it", what);
            lost++;
        }
        /* and the handle works again, with the same bytes */
        round_trip(c, &tx, pin, cap, &w, NULL, 0, &ty, rc, what);
        CHECK(rc[0] == EPIPE_OK && rc[1] == EPIPE_OK, "%s: encode after it: %s", what,
              epipe_codec_last_error(c));
        if (!fc.stateful && rc[0] == EPIPE_OK)
            CHECK(w == wref && memcmp(pin, ref.data(), wref) == 0,
                  "%s: the encode after it made other bytes", what);
        round_trip(c, NULL, pin, cap, &w, ref.data(), wref, &ty, rc, what);
        CHECK(rc[2] == EPIPE_OK && rc[3] == EPIPE_OK, "%s: decode after it: %s", what,
              epipe_codec_last_error(c));
        CUDA_OK(cudaMemcpy(y.data(), dy, n * 4, cudaMemcpyDeviceToHost));
        if (!fc.stateful)
            CHECK(memcmp(y.data(), yref.data(), n * 4) == 0,
                  "%s: the decode after it made other floats", what);
        if (lost > 3)
            break;
    }
    printf("%-40s %ld CUDA calls failed in turn\n", fc.spec, calls);
    CUDA_OK(cudaFreeHost(pin));
    CUDA_OK(cudaFree(dx));
    CUDA_OK(cudaFree(dy));
    epipe_codec_destroy(c);
}

/* After a sticky error every call fails, naming it; nothing crashes. */
static void sticky(void)
{
    std::vector<int64_t> shape = {4096};
    epipe_codec *c;
    CHECK(epipe_codec_create(&c, "quant:bits=8") == EPIPE_OK, "%s", epipe_last_error());
    float *dx, *dy;
    uint8_t *dev;
    size_t cap = 0, w = 0;
    CUDA_OK(cudaMalloc((void **)&dx, 4096 * 4));
    CUDA_OK(cudaMalloc((void **)&dy, 4096 * 4));
    CUDA_OK(cudaMemset(dx, 0, 4096 * 4));
    DLTensor tx = tensor(kDLCUDA, dx, shape), ty = tensor(kDLCUDA, dy, shape);
    CHECK(epipe_codec_max_encoded_size(c, &tx, &cap) == EPIPE_OK, "size");
    CUDA_OK(cudaMalloc((void **)&dev, cap));
    int rc[4];
    cudaemu_fail_at(0, 0);
    round_trip(c, &tx, dev, cap, &w, NULL, 0, &ty, rc, "sticky: clean");
    CHECK(rc[0] == EPIPE_OK && rc[1] == EPIPE_OK, "sticky: clean encode");
    size_t clean = w;
    cudaemu_fail_at(2, 1);
    for (int round = 0; round < 3; round++) {
        round_trip(c, &tx, dev, cap, &w, dev, clean, &ty, rc, "after a sticky error");
        CHECK(rc[0] || rc[1], "round %d: the encode after a sticky error succeeded", round);
        CHECK(rc[2] || rc[3], "round %d: the decode after a sticky error succeeded", round);
        CHECK(strstr(epipe_codec_last_error(c), "cudaErrorIllegalAddress") != NULL,
              "round %d: the error does not name it: %s", round, epipe_codec_last_error(c));
    }
    cudaemu_fail_at(0, 0);
    epipe_codec_destroy(c);
    cudaFree(dev);
    cudaFree(dx);
    cudaFree(dy);
}

/* A context with fewer SMs than the device reports (an MPS client with a
 * thread percentage, a green context) refuses the cooperative launches
 * sized by the device's count: quant's, sample-mode sortquant's and topk's
 * encodes then take their multi-launch paths, with the same bytes, and keep
 * to them. Run last: the refusal is remembered for the device. */
static void cooperative_launch_refused(void)
{
    const char *specs[] = {"quant:bits=8", "sortquant:bits=8,mode=sample", "topk:ratio=0.1"};
    std::vector<int64_t> shape = {70000};
    size_t n = 70000;
    std::vector<float> x(n);
    for (size_t i = 0; i < n; i++)
        x[i] = (float)((i * 2654435761u) % 10007) / 10007.0f - 0.5f;
    float *dx;
    CUDA_OK(cudaMalloc((void **)&dx, n * 4));
    CUDA_OK(cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice));
    DLTensor tx = tensor(kDLCUDA, dx, shape);
    for (const char *spec : specs) {
        epipe_codec *c;
        CHECK(epipe_codec_create(&c, spec) == EPIPE_OK, "%s", epipe_last_error());
        size_t cap = 0, w[3] = {0, 0, 0};
        CHECK(epipe_codec_max_encoded_size(c, &tx, &cap) == EPIPE_OK, "%s: size", spec);
        std::vector<uint8_t> out[3];
        for (int k = 0; k < 3; k++) { /* the cooperative launch, refused, remembered */
            cudaemu_limit_coop_sms(k ? 1 : 0);
            uint8_t *pin;
            CUDA_OK(cudaHostAlloc((void **)&pin, cap, cudaHostAllocDefault));
            int rc = epipe_codec_encode(c, &tx, pin, cap, &w[k]);
            if (rc == EPIPE_OK)
                rc = epipe_codec_synchronize(c);
            CHECK(rc == EPIPE_OK, "%s, encode %d with fewer SMs: %s", spec, k,
                  epipe_codec_last_error(c));
            out[k].assign(pin, pin + w[k]);
            CUDA_OK(cudaFreeHost(pin));
        }
        for (int k = 1; k < 3; k++)
            CHECK(out[k] == out[0], "%s: encode %d with fewer SMs made other bytes", spec, k);
        printf("%-40s a refused cooperative launch: the same %zu bytes\n", spec, w[0]);
        epipe_codec_destroy(c);
    }
    cudaemu_limit_coop_sms(0);
    CUDA_OK(cudaFree(dx));
}

/* Each codec call gives the calling thread its current device back, on a
 * machine of two devices: the host computes on device 1, its tensor is on
 * device 0 (before, synchronize and destroy left it on device 0). */
static void caller_device_kept(void)
{
    setenv("CUDAEMU_DEVICES", "2", 1);
    std::vector<int64_t> shape = {4096};
    std::vector<float> x(4096, 0.25f);
    float *dx, *dy;
    CUDA_OK(cudaSetDevice(0));
    CUDA_OK(cudaMalloc((void **)&dx, 4096 * 4));
    CUDA_OK(cudaMalloc((void **)&dy, 4096 * 4));
    CUDA_OK(cudaMemcpy(dx, x.data(), 4096 * 4, cudaMemcpyHostToDevice));
    DLTensor tx = tensor(kDLCUDA, dx, shape), ty = tensor(kDLCUDA, dy, shape);
    for (const char *spec : {"quant:bits=8", "sortquant:bits=8", "topk:ratio=0.1"}) {
        epipe_codec *c;
        CHECK(epipe_codec_create(&c, spec) == EPIPE_OK, "%s", epipe_last_error());
        std::vector<uint8_t> payload(1 << 16);
        size_t w = 0;
        int cur = -1;
        CUDA_OK(cudaSetDevice(1));
        const char *steps[] = {"encode", "synchronize", "decode", "synchronize", "destroy"};
        for (int k = 0; k < 5; k++) {
            int rc = k == 0   ? epipe_codec_encode(c, &tx, payload.data(), payload.size(), &w)
                     : k == 2 ? epipe_codec_decode(c, payload.data(), w, &ty)
                     : k == 4 ? (epipe_codec_destroy(c), EPIPE_OK)
                              : epipe_codec_synchronize(c);
            CHECK(rc == EPIPE_OK, "%s: %s: %s", spec, steps[k], epipe_last_error());
            CUDA_OK(cudaGetDevice(&cur));
            CHECK(cur == 1, "%s: after %s the thread is on device %d, not its own 1", spec,
                  steps[k], cur);
        }
    }
    printf("%-40s the caller's device kept through encode, decode, synchronize, destroy\n",
           "quant, sortquant, topk");
    CUDA_OK(cudaSetDevice(0));
    CUDA_OK(cudaFree(dx));
    CUDA_OK(cudaFree(dy));
    unsetenv("CUDAEMU_DEVICES");
}

/* poweriter's warm start after a failed encode: a handle warm for view A
 * encodes view B (a larger slot buffer) with each of B's CUDA calls failed
 * in turn; whether B failed or not, the slot no longer holds A's start, so
 * the next encode of A starts cold: the bytes of a fresh handle's encode.
 * (The slot once kept claiming A over a reallocated buffer when an
 * allocation after it failed, and started from garbage.) Then a deferred
 * decode error survives an encode refused at once for a NaN. */
static void poweriter_slot_after_failures(void)
{
    const char *spec = "poweriter:rank=2";
    std::vector<int64_t> sa = {4, 16, 20}, sb = {4, 16, 200};
    const size_t na = 4 * 16 * 20, nb = 4 * 16 * 200;
    std::vector<float> x(nb);
    uint64_t r = 99;
    for (size_t i = 0; i < nb; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)((double)(r >> 11) / 9007199254740992.0 - 0.5) * (float)(1 + i % 3);
    }
    float *dx;
    uint8_t *pin;
    CUDA_OK(cudaMalloc((void **)&dx, nb * 4));
    CUDA_OK(cudaMemcpy(dx, x.data(), nb * 4, cudaMemcpyHostToDevice));
    DLTensor ta = tensor(kDLCUDA, dx, sa), tb = tensor(kDLCUDA, dx, sb);
    epipe_codec *fresh;
    if (epipe_codec_create(&fresh, spec) != EPIPE_OK) {
        printf("SKIP %s: %s\n", spec, epipe_last_error());
        return;
    }
    size_t cap = 0, w = 0, wc = 0;
    CHECK(epipe_codec_max_encoded_size(fresh, &tb, &cap) == EPIPE_OK, "size");
    CUDA_OK(cudaHostAlloc((void **)&pin, cap, cudaHostAllocDefault));
    std::vector<uint8_t> cold(cap);
    CHECK(epipe_codec_encode(fresh, &ta, pin, cap, &wc) == EPIPE_OK &&
              epipe_codec_synchronize(fresh) == EPIPE_OK,
          "cold encode: %s", epipe_codec_last_error(fresh));
    memcpy(cold.data(), pin, wc);
    long calls = 0;
    for (long k = 0; k <= calls; k++) {
        epipe_codec *c;
        CHECK(epipe_codec_create(&c, spec) == EPIPE_OK, "create");
        CHECK(epipe_codec_encode(c, &ta, pin, cap, &w) == EPIPE_OK &&
                  epipe_codec_synchronize(c) == EPIPE_OK,
              "warm-up: %s", epipe_codec_last_error(c));
        cudaemu_fail_at(k, 0); /* counts the calls from here */
        int rc = epipe_codec_encode(c, &tb, pin, cap, &w);
        int rs = epipe_codec_synchronize(c);
        if (k == 0) /* the clean run: B's calls */
            calls = cudaemu_fallible_calls();
        cudaemu_fail_at(0, 0);
        CHECK(k == 0 ? rc == EPIPE_OK && rs == EPIPE_OK : rc != EPIPE_OK || rs != EPIPE_OK,
              "%s: B with call %ld failed: %d %d", spec, k, rc, rs);
        CHECK(epipe_codec_encode(c, &ta, pin, cap, &w) == EPIPE_OK &&
                  epipe_codec_synchronize(c) == EPIPE_OK,
              "A again: %s", epipe_codec_last_error(c));
        CHECK(w == wc && memcmp(pin, cold.data(), wc) == 0,
              "%s: after B with call %ld failed, A did not start cold", spec, k);
        epipe_codec_destroy(c);
    }
    printf("%-40s slot cold again after each of %ld failed calls of an encode\n", spec, calls);

    /* a corrupt factor decoded (deferred), then a NaN encoded (at once):
     * the next synchronize still reports the decode's error */
    std::vector<uint8_t> bad(cold.begin(), cold.begin() + (long)wc);
    bad[16 + 32 + 4 + 3] = 0x7f; /* Q[0][0] of matrix 0: |v| > 1 */
    float *dy, nan = NAN;
    CUDA_OK(cudaMalloc((void **)&dy, na * 4));
    DLTensor ty = tensor(kDLCUDA, dy, sa);
    CHECK(epipe_codec_decode(fresh, bad.data(), wc, &ty) == EPIPE_OK, "decode");
    CUDA_OK(cudaMemcpy(dx + 3, &nan, 4, cudaMemcpyHostToDevice));
    CHECK(epipe_codec_encode(fresh, &ta, pin, cap, &w) == EPIPE_EINVAL, "NaN accepted");
    int rs = epipe_codec_synchronize(fresh);
    CHECK(rs == EPIPE_EPROTO && strstr(epipe_codec_last_error(fresh), "payload entry 1 "),
          "the decode's deferred error after a refused encode: %d %s", rs,
          epipe_codec_last_error(fresh));
    CUDA_OK(cudaFree(dx));
    CUDA_OK(cudaFree(dy));
    CUDA_OK(cudaFreeHost(pin));
    epipe_codec_destroy(fresh);
}

int main(void)
{
    gpu_test_devices_or_skip();
    const fault_case cases[] = {
        {"none", {5000}, 0},
        {"cast:dtype=bf16", {5000}, 0},
        {"quant:bits=8", {5000}, 0},
        {"quant:bits=8", {70000}, 0}, /* the cooperative encode */
        {"quant:bits=3,rows=1", {40, 125}, 0},
        {"quant:bits=2,zero=1,group=25", {40, 125}, 0},
        {"quant:bits=4,ef=1", {5000}, 1},
        {"sortquant:bits=8,mode=sample", {5000}, 0},
        {"sortquant:bits=8,mode=sample", {70000}, 0}, /* select, cooperative encode */
        {"sortquant:bits=8", {5000}, 0},
        {"sortquant:bits=4,mode=exact", {5000}, 0},
        {"topk:ratio=0.1", {5000}, 0},
        {"kmeans:bits=2", {5000}, 0},
        {"poweriter:rank=2", {4, 16, 20}, 1},
        {"insert:kind=linear,out=4", {10, 32}, 1},
        {"insert:kind=conv,out=2,kernel=2", {2, 3, 8, 8}, 1},
    };
    for (const fault_case &fc : cases)
        sweep(fc);
    poweriter_slot_after_failures();
    sticky();
    caller_device_kept();
    cooperative_launch_refused();
    return gpu_test_result();
}
