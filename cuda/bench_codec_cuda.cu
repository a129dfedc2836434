/* epipe-bench-cuda: encode and decode throughput of a codec on a CUDA
 * tensor against a device-to-device copy of the same tensor in the same run. */
#include <cuda_runtime.h>
#include <cudnn.h> /* types only: --cudnn opens the library at run time */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <epipe/epipe.h>

#include "dlopen_all.h"

static void usage(void)
{
    fprintf(stderr, "usage: epipe-bench-cuda SPEC [SPEC...] [--n VALUES | --shape D0,D1,...]\n"
                    "                        [--reps R] [--payload device|host] [--cudnn]\n\n"
                    "Times epipe_codec_encode and _decode of a dense fp32 CUDA tensor (default\n"
                    "12.8M normal values, one dimension; --shape for the codecs that read the\n"
                    "shape, poweriter and insert) into and from a payload in device memory (default)\n"
                    "or pinned host memory, beside a cudaMemcpyAsync device-to-device copy of\n"
                    "the tensor. Throughput: R calls (default 20) enqueued back to back, one\n"
                    "epipe_codec_synchronize after them, stream time per call (x copy: the\n"
                    "copy's time over the codec's). Latency: one call and its synchronize,\n"
                    "best of R. --cudnn: for insert:kind=conv on a [B,C,H,W] --shape, also the\n"
                    "same two convolutions (forward; backward data, the transposed one) called\n"
                    "directly through cuDNN in FMA math, each with the fastest algorithm\n"
                    "cudnnFind measures, and the codec's times over theirs. Exit 77 without a\n"
                    "CUDA device.\n");
}

#define CK(e)                                                                                      \
    do {                                                                                           \
        cudaError_t err_ = (e);                                                                    \
        if (err_ != cudaSuccess) {                                                                 \
            fprintf(stderr, "CUDA error: %s (line %d)\n", cudaGetErrorString(err_), __LINE__);     \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

/* Latency: one call and its synchronisation, best of `reps`. */
static double best_of(int reps, cudaEvent_t a, cudaEvent_t b, int (*fn)(void *), void *ctx)
{
    float best = INFINITY;
    for (int r = 0; r < reps; r++) {
        cudaEventRecord(a, 0);
        if (fn(ctx))
            return NAN;
        cudaEventRecord(b, 0);
        cudaEventSynchronize(b);
        float ms;
        cudaEventElapsedTime(&ms, a, b);
        best = ms < best ? ms : best;
    }
    return best / 1e3;
}

/* Throughput: `reps` calls enqueued back to back on the stream, one
 * synchronisation (done) after them, the stream time per call. */
static double per_call(int reps, cudaEvent_t a, cudaEvent_t b, int (*fn)(void *),
                       int (*done)(void *), void *ctx)
{
    if (fn(ctx) || (done && done(ctx))) /* warm: scratch allocated */
        return NAN;
    cudaEventRecord(a, 0);
    for (int r = 0; r < reps; r++)
        if (fn(ctx))
            return NAN;
    cudaEventRecord(b, 0);
    if (done && done(ctx))
        return NAN;
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    return ms / 1e3 / reps;
}

struct ctx {
    epipe_codec *c;
    DLTensor *x, *y;
    uint8_t *payload;
    size_t cap, written;
    float *copy_dst;
    size_t n;
};

static int run_copy(void *p)
{
    ctx *k = (ctx *)p;
    return cudaMemcpyAsync(k->copy_dst, k->x->data, k->n * 4, cudaMemcpyDeviceToDevice, 0) !=
           cudaSuccess;
}

static int enqueue_encode(void *p)
{
    ctx *k = (ctx *)p;
    if (epipe_codec_encode(k->c, k->x, k->payload, k->cap, &k->written)) {
        fprintf(stderr, "encode: %s\n", epipe_codec_last_error(k->c));
        return 1;
    }
    return 0;
}

static int enqueue_decode(void *p)
{
    ctx *k = (ctx *)p;
    if (epipe_codec_decode(k->c, k->payload, k->written, k->y)) {
        fprintf(stderr, "decode: %s\n", epipe_codec_last_error(k->c));
        return 1;
    }
    return 0;
}

static int sync_codec(void *p)
{
    ctx *k = (ctx *)p;
    if (epipe_codec_synchronize(k->c)) {
        fprintf(stderr, "synchronize: %s\n", epipe_codec_last_error(k->c));
        return 1;
    }
    return 0;
}

static int run_encode(void *p)
{
    return enqueue_encode(p) || sync_codec(p);
}

static int run_decode(void *p)
{
    return enqueue_decode(p) || sync_codec(p);
}

/* ---- --cudnn: insert's convolutions called directly -------------------------- */

#define DNN_FNS(X)                                                                                 \
    X(create, cudnnCreate)                                                                         \
    X(tensor_create, cudnnCreateTensorDescriptor)                                                  \
    X(tensor_set, cudnnSetTensor4dDescriptor)                                                      \
    X(filter_create, cudnnCreateFilterDescriptor)                                                  \
    X(filter_set, cudnnSetFilter4dDescriptor)                                                      \
    X(conv_create, cudnnCreateConvolutionDescriptor)                                               \
    X(conv_set, cudnnSetConvolution2dDescriptor)                                                   \
    X(conv_math, cudnnSetConvolutionMathType)                                                      \
    X(find_fwd, cudnnFindConvolutionForwardAlgorithm)                                              \
    X(fwd_space, cudnnGetConvolutionForwardWorkspaceSize)                                          \
    X(fwd, cudnnConvolutionForward)                                                                \
    X(find_bwd, cudnnFindConvolutionBackwardDataAlgorithm)                                         \
    X(bwd_space, cudnnGetConvolutionBackwardDataWorkspaceSize)                                     \
    X(bwd, cudnnConvolutionBackwardData)                                                           \
    X(destroy, cudnnDestroy)                                                                       \
    X(tensor_destroy, cudnnDestroyTensorDescriptor)                                                \
    X(filter_destroy, cudnnDestroyFilterDescriptor)                                                \
    X(conv_destroy, cudnnDestroyConvolutionDescriptor)

static struct {
    DNN_FNS(EPIPE_CUDA_FIELD)
} dnn;

static int dnn_open(void)
{
    static const char *const names[] = {"libcudnn.so.9", "libcudnn.so", "libcudnn.so.8"};
    static const char *const syms[] = {DNN_FNS(EPIPE_CUDA_SYM)};
#define SLOT(name, sym) (void **)&dnn.name,
    void **const slots[] = {DNN_FNS(SLOT)};
#undef SLOT
    return epipe_cuda_dlopen_all(names, sizeof names / sizeof *names, syms, slots,
                                 sizeof syms / sizeof *syms) != NULL;
}

struct dnn_ctx {
    cudnnHandle_t h;
    cudnnTensorDescriptor_t x, z;
    cudnnFilterDescriptor_t w;
    cudnnConvolutionDescriptor_t conv;
    cudnnConvolutionFwdAlgo_t fa;
    cudnnConvolutionBwdDataAlgo_t ba;
    void *space;
    size_t fs, bs;
    const float *in, *wt;
    float *code, *out;
};

/* What dnn_reference() made (NULL members skipped). */
static void dnn_release(dnn_ctx *d)
{
    if (d->conv)
        dnn.conv_destroy(d->conv);
    if (d->w)
        dnn.filter_destroy(d->w);
    if (d->z)
        dnn.tensor_destroy(d->z);
    if (d->x)
        dnn.tensor_destroy(d->x);
    if (d->h)
        dnn.destroy(d->h);
    cudaFree(d->space);
}

static int dnn_forward(void *p)
{
    dnn_ctx *d = (dnn_ctx *)p;
    const float one = 1, zero = 0;
    return dnn.fwd(d->h, &one, d->x, d->in, d->w, d->wt, d->conv, d->fa, d->space, d->fs, &zero,
                   d->z, d->code) != CUDNN_STATUS_SUCCESS;
}

static int dnn_backward(void *p)
{
    dnn_ctx *d = (dnn_ctx *)p;
    const float one = 1, zero = 0;
    return dnn.bwd(d->h, &one, d->w, d->wt, d->z, d->code, d->conv, d->ba, d->space, d->bs, &zero,
                   d->x, d->out) != CUDNN_STATUS_SUCCESS;
}

/* The stream time per call of insert's two convolutions on [B,C,H,W] with
 * a [K,C,k,k] filter of stride k, called directly; 0 when it cannot run. */
static int dnn_reference(const int64_t *s, int K, int k, const float *x, float *y, int reps,
                         cudaEvent_t a, cudaEvent_t b, double *tf, double *tb)
{
    static int opened = -1;
    if (opened < 0)
        opened = dnn_open();
    if (!opened) {
        printf("  --cudnn: cuDNN not found\n");
        return 0;
    }
    dnn_ctx d = {};
    const int B = (int)s[0], C = (int)s[1], H = (int)s[2], W = (int)s[3];
    int n = 0;
    cudnnConvolutionFwdAlgoPerf_t fp[8];
    cudnnConvolutionBwdDataAlgoPerf_t bp[8];
    float *wt = NULL, *code = NULL;
    if (cudaMalloc((void **)&wt, (size_t)K * C * k * k * 4) ||
        cudaMalloc((void **)&code, (size_t)B * K * (H / k) * (W / k) * 4) ||
        cudaMemset(wt, 0, (size_t)K * C * k * k * 4) || dnn.create(&d.h) ||
        dnn.tensor_create(&d.x) || dnn.tensor_create(&d.z) || dnn.filter_create(&d.w) ||
        dnn.conv_create(&d.conv) ||
        dnn.tensor_set(d.x, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, B, C, H, W) ||
        dnn.tensor_set(d.z, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, B, K, H / k, W / k) ||
        dnn.filter_set(d.w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, K, C, k, k) ||
        dnn.conv_set(d.conv, 0, 0, k, k, 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT) ||
        dnn.conv_math(d.conv, CUDNN_FMA_MATH) ||
        dnn.find_fwd(d.h, d.x, d.w, d.conv, d.z, 8, &n, fp) || n < 1 || fp[0].status ||
        dnn.find_bwd(d.h, d.w, d.z, d.conv, d.x, 8, &n, bp) || n < 1 || bp[0].status) {
        printf("  --cudnn: cuDNN could not run these convolutions\n");
        dnn_release(&d), cudaFree(wt), cudaFree(code);
        return 0;
    }
    d.fa = fp[0].algo, d.ba = bp[0].algo;
    dnn.fwd_space(d.h, d.x, d.w, d.conv, d.z, d.fa, &d.fs);
    dnn.bwd_space(d.h, d.w, d.z, d.conv, d.x, d.ba, &d.bs);
    if (cudaMalloc(&d.space, (d.fs > d.bs ? d.fs : d.bs) + 1)) {
        d.space = NULL;
        dnn_release(&d), cudaFree(wt), cudaFree(code);
        return 0;
    }
    d.in = x, d.wt = wt, d.code = code, d.out = y;
    *tf = per_call(reps, a, b, dnn_forward, NULL, &d);
    *tb = per_call(reps, a, b, dnn_backward, NULL, &d);
    printf("  cuDNN directly (algorithms %d and %d, as cudnnFind ranks them in FMA math): "
           "forward %.3f ms, transposed %.3f ms\n",
           (int)d.fa, (int)d.ba, *tf * 1e3, *tb * 1e3);
    dnn_release(&d), cudaFree(wt), cudaFree(code);
    return !isnan(*tf) && !isnan(*tb);
}

__global__ void fill_normal(float *x, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        unsigned long long z = i * 0x9e3779b97f4a7c15ull + 12345;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        float u1 = ((z >> 40) + 1) / 16777217.0f, u2 = ((z >> 16) & 0xffffff) / 16777216.0f;
        x[i] = sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
    }
}

int main(int argc, char **argv)
{
    size_t n = 12800000;
    int reps = 20, nspec = 0, host_payload = 0, ndim = 1, cudnn = 0;
    int64_t shape[8] = {0};
    const char *specs[32];
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--n") && i + 1 < argc) {
            n = strtoull(argv[++i], NULL, 10);
            ndim = 1;
        } else if (!strcmp(argv[i], "--shape") && i + 1 < argc) {
            const char *p = argv[++i];
            n = 1;
            for (ndim = 0; *p && ndim < 8; ndim++) {
                char *end;
                unsigned long long d = strtoull(p, &end, 10);
                if (end == p || !d || (*end && *end != ',') || n > SIZE_MAX / 4 / d)
                    return usage(), 2;
                shape[ndim] = (int64_t)d;
                n *= (size_t)d;
                p = *end ? end + 1 : end;
            }
            if (*p || !ndim)
                return usage(), 2;
        } else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--cudnn"))
            cudnn = 1;
        else if (!strcmp(argv[i], "--payload") && i + 1 < argc &&
                 (!strcmp(argv[i + 1], "host") || !strcmp(argv[i + 1], "device")))
            host_payload = !strcmp(argv[++i], "host");
        else if (argv[i][0] == '-' || nspec == 32)
            return usage(), 2;
        else
            specs[nspec++] = argv[i];
    }
    if (!nspec || !n || reps < 1)
        return usage(), 2;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || !count) {
        printf("SKIP: no CUDA device: %s\n", e ? cudaGetErrorString(e) : "0 devices");
        return 77;
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    float *x, *y, *z;
    CK(cudaMalloc((void **)&x, n * 4));
    CK(cudaMalloc((void **)&y, n * 4));
    CK(cudaMalloc((void **)&z, n * 4));
    fill_normal<<<1024, 256>>>(x, n);
    CK(cudaDeviceSynchronize());
    if (ndim == 1)
        shape[0] = (int64_t)n;
    DLTensor tx, ty;
    memset(&tx, 0, sizeof tx);
    tx.data = x;
    tx.device.device_type = kDLCUDA;
    tx.ndim = ndim;
    tx.shape = shape;
    tx.dtype.code = kDLFloat;
    tx.dtype.bits = 32;
    tx.dtype.lanes = 1;
    ty = tx;
    ty.data = y;
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    printf("device: %s, %zu fp32 values (%.1f MB), payload in %s memory, best of %d\n", prop.name,
           n, n * 4 / 1e6, host_payload ? "pinned host" : "device", reps);
    ctx k = {};
    k.x = &tx;
    k.y = &ty;
    k.n = n;
    k.copy_dst = z;
    double tc = per_call(reps, a, b, run_copy, NULL, &k);
    printf("%-36s %8.3f ms %7.1f GB/s (read+write), %d back to back\n", "cudaMemcpy D2D", tc * 1e3,
           8.0 * n / tc / 1e9, reps);
    printf("%-36s %-30s | %-30s | %s\n", "", "encode: stream time per call",
           "decode: stream time per call", "one call + synchronize");
    for (int s = 0; s < nspec; s++) {
        if (epipe_codec_create(&k.c, specs[s])) {
            fprintf(stderr, "%s: %s\n", specs[s], epipe_last_error());
            return 1;
        }
        if (epipe_codec_max_encoded_size(k.c, &tx, &k.cap)) {
            fprintf(stderr, "%s: %s\n", specs[s], epipe_codec_last_error(k.c));
            return 1;
        }
        if (host_payload)
            CK(cudaHostAlloc((void **)&k.payload, k.cap, cudaHostAllocDefault));
        else
            CK(cudaMalloc((void **)&k.payload, k.cap));
        double te = per_call(reps, a, b, enqueue_encode, sync_codec, &k);
        double td = per_call(reps, a, b, enqueue_decode, sync_codec, &k);
        double le = best_of(reps, a, b, run_encode, &k), ld = best_of(reps, a, b, run_decode, &k);
        if (isnan(te) || isnan(td) || isnan(le) || isnan(ld))
            return 1;
        printf("%-36s %8.3f ms %6.1f GB/s %5.2fx | %8.3f ms %6.1f GB/s %5.2fx | enc %.3f dec %.3f "
               "ms | %.2f B/value\n",
               specs[s], te * 1e3, 4.0 * n / te / 1e9, tc / te, td * 1e3, 4.0 * n / td / 1e9,
               tc / td, le * 1e3, ld * 1e3, (double)k.written / (double)n);
        int zndim = 0;
        int64_t zs[8];
        double tf, tb;
        if (cudnn && ndim == 4 && !strncmp(specs[s], "insert:", 7) &&
            epipe_codec_code_shape(k.c, &tx, &zndim, zs) == EPIPE_OK && zndim == 4 &&
            dnn_reference(shape, (int)zs[1], (int)(shape[2] / zs[2]), x, z, reps, a, b, &tf, &tb))
            printf("  the codec over cuDNN directly: encode %.2fx, decode %.2fx\n", te / tf,
                   td / tb);
        if (host_payload)
            cudaFreeHost(k.payload);
        else
            cudaFree(k.payload);
        epipe_codec_destroy(k.c);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return 0;
}
