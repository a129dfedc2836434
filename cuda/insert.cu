/* `insert` on CUDA tensors. The conv kind's compress is a cuDNN
 * convolution forward (a k x k filter, stride k, no padding), its restore
 * the transposed convolution, which is cuDNN's backward data; the linear
 * kind's are one cuBLAS GEMM each. The body is written by one kernel that
 * also checks the code (fp32, or fp16 with code=fp16), and read by one.
 *
 * The parameters stay the host's: the CPU codec's state, which
 * epipe_codec_tensor() lends and optimizers update in place. Each call
 * compares them with what the device holds (K*C*k*k values) and copies
 * them up when they differ, after the work already on the stream.
 *
 * Training: a forward with EPIPE_CODEC_MICROBATCH set keeps its input
 * (encode) or code (decode) in device memory under that key, and the
 * backward passes run here too: the encoder's is E's backward data and
 * backward filter (cuBLAS for linear), the decoder's a convolution forward
 * with Rt and its backward filter. The parameter gradient is added to the
 * host's, so a backward waits for its stream once.
 *
 * cuDNN runs in FMA math (no TF32 tensor cores) and cuBLAS in its default
 * (fp32) math, so the codes are the CPU's within rounding, not byte for
 * byte (docs/codecs.md).
 *
 * cuDNN is opened at run time like cuBLAS (cuda/cublas.cu). It is the
 * legacy convolution API: deprecated in cuDNN 9, still shipped, and what
 * both frameworks call for a plain convolution. */
#include <cudnn.h> /* types and constants only: the library is opened at run time */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../codecs/inline/half.h"
#include "cuda_impl.h"
#include "dlopen_all.h"

#ifndef EPIPE_CUDNN_PATH
#define EPIPE_CUDNN_PATH "libcudnn.so"
#endif

/* ---- cuDNN, opened once ---------------------------------------------------- */

#define DNN_FNS(X)                                                                                 \
    X(create, cudnnCreate)                                                                         \
    X(destroy, cudnnDestroy)                                                                       \
    X(set_stream, cudnnSetStream)                                                                  \
    X(error_string, cudnnGetErrorString)                                                           \
    X(tensor_create, cudnnCreateTensorDescriptor)                                                  \
    X(tensor_destroy, cudnnDestroyTensorDescriptor)                                                \
    X(tensor_set, cudnnSetTensor4dDescriptor)                                                      \
    X(filter_create, cudnnCreateFilterDescriptor)                                                  \
    X(filter_destroy, cudnnDestroyFilterDescriptor)                                                \
    X(filter_set, cudnnSetFilter4dDescriptor)                                                      \
    X(conv_create, cudnnCreateConvolutionDescriptor)                                               \
    X(conv_destroy, cudnnDestroyConvolutionDescriptor)                                             \
    X(conv_set, cudnnSetConvolution2dDescriptor)                                                   \
    X(conv_math, cudnnSetConvolutionMathType)                                                      \
    X(fwd_algos, cudnnGetConvolutionForwardAlgorithm_v7)                                           \
    X(fwd_space, cudnnGetConvolutionForwardWorkspaceSize)                                          \
    X(fwd, cudnnConvolutionForward)                                                                \
    X(bwd_algos, cudnnGetConvolutionBackwardDataAlgorithm_v7)                                      \
    X(bwd_space, cudnnGetConvolutionBackwardDataWorkspaceSize)                                     \
    X(bwd, cudnnConvolutionBackwardData)                                                           \
    X(filt_algos, cudnnGetConvolutionBackwardFilterAlgorithm_v7)                                   \
    X(filt_space, cudnnGetConvolutionBackwardFilterWorkspaceSize)                                  \
    X(filt, cudnnConvolutionBackwardFilter)

static struct {
    DNN_FNS(EPIPE_CUDA_FIELD)
} dnn;
static pthread_once_t dnn_once = PTHREAD_ONCE_INIT;
static int dnn_ok;

static void dnn_open(void)
{
    static const char *const names[] = {"libcudnn.so.9", EPIPE_CUDNN_PATH, "libcudnn.so",
                                        "libcudnn.so.8"};
    static const char *const syms[] = {DNN_FNS(EPIPE_CUDA_SYM)};
#define SLOT(name, sym) (void **)&dnn.name,
    void **const slots[] = {DNN_FNS(SLOT)};
#undef SLOT
    dnn_ok = epipe_cuda_dlopen_all(names, sizeof names / sizeof *names, syms, slots,
                                   sizeof syms / sizeof *syms) != NULL;
}

int epipe_cuda_dnn_available(void)
{
    pthread_once(&dnn_once, dnn_open);
    return dnn_ok;
}

/* ---- per-handle state ------------------------------------------------------- */

/* What a backward needs of one micro-batch's forward, on the device: the
 * encoder's input, or the decoder's code; key -1 = free. */
struct ins_slot {
    int64_t key;
    int ndim;
    int64_t shape[EPIPE_MAX_NDIM]; /* of the tensor encoded, or decoded into */
    float *buf;
    size_t cap; /* floats */
};

struct ins_cache {
    ins_slot *s;
    unsigned n;
};

struct ins_state {
    cudnnHandle_t handle;
    cudnnTensorDescriptor_t x, z; /* [B][C][H][W] and the code [B][K][H/k][W/k] */
    cudnnFilterDescriptor_t w;    /* [K][C][k][k] */
    cudnnConvolutionDescriptor_t conv;
    int64_t shape[6]; /* B, C, H, W, K, k the descriptors and algorithms are for */
    int have_shape, have_fwd, have_bwd, have_filt;
    cudnnConvolutionFwdAlgo_t fwd;
    cudnnConvolutionBwdDataAlgo_t bwd;
    cudnnConvolutionBwdFilterAlgo_t filt;
    cudnnMathType_t fwd_math, bwd_math, filt_math; /* the math each algorithm was chosen in */
    size_t fwd_space, bwd_space, filt_space;
    /* The parameters on the device (0: E, 1: Rt) and host copies of what
     * they hold; wn values each, valid[i] once copied. */
    float *wdev[2], *wlast[2];
    size_t wn;
    int valid[2];
    ins_cache enc, dec; /* kept for the backward, by micro-batch */
};

static int dnn_check(epipe_codec *c, cudnnStatus_t s, const char *doing)
{
    if (s == CUDNN_STATUS_SUCCESS)
        return EPIPE_OK;
    return epipe_cuda_fail(c,
                           s == CUDNN_STATUS_ALLOC_FAILED     ? EPIPE_ENOMEM
                           : s == CUDNN_STATUS_NOT_SUPPORTED ? EPIPE_ENOTSUP
                                                             : EPIPE_EIO,
                           "insert: cuDNN error %d (%s) while %s", (int)s, dnn.error_string(s),
                           doing);
}

void epipe_cuda_dnn_release(epipe_cuda_handle *h)
{
    ins_state *st = (ins_state *)h->dnn;
    if (!st)
        return;
    if (st->x)
        dnn.tensor_destroy(st->x);
    if (st->z)
        dnn.tensor_destroy(st->z);
    if (st->w)
        dnn.filter_destroy(st->w);
    if (st->conv)
        dnn.conv_destroy(st->conv);
    if (st->handle)
        dnn.destroy(st->handle);
    for (int i = 0; i < 2; i++)
        cudaFree(st->wdev[i]), free(st->wlast[i]);
    for (ins_cache *ca : {&st->enc, &st->dec}) {
        for (unsigned i = 0; i < ca->n; i++)
            cudaFree(ca->s[i].buf);
        free(ca->s);
    }
    free(st);
    h->dnn = NULL;
}

/* The handle's insert state, made on first use; the cuDNN handle and
 * descriptors only for the conv kind. */
static int state_for(epipe_codec *c, int conv, ins_state **out)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    ins_state *st = (ins_state *)h->dnn;
    int rc;
    if (!st) {
        if (!(st = (ins_state *)calloc(1, sizeof *st)))
            return epipe_cuda_fail(c, EPIPE_ENOMEM, "insert: out of host memory");
        h->dnn = st;
    }
    /* each made once; after a failure, the next call makes what is missing */
    if (conv &&
        ((!st->handle &&
          (rc = dnn_check(c, dnn.create(&st->handle), "creating a cuDNN handle"))) ||
         (!st->x && (rc = dnn_check(c, dnn.tensor_create(&st->x), "creating a descriptor"))) ||
         (!st->z && (rc = dnn_check(c, dnn.tensor_create(&st->z), "creating a descriptor"))) ||
         (!st->w && (rc = dnn_check(c, dnn.filter_create(&st->w), "creating a descriptor"))) ||
         (!st->conv && (rc = dnn_check(c, dnn.conv_create(&st->conv), "creating a descriptor"))) ||
         (rc = dnn_check(c, dnn.set_stream(st->handle, epipe_cuda_stream(c)),
                         "setting the stream"))))
        return rc;
    *out = st;
    return EPIPE_OK;
}

/* Values of a weight matrix ([K][C*k*k]), and of the code of v's tensor. */
static size_t param_count(const epipe_cuda_insert_view *v)
{
    return (size_t)(v->K * v->C * v->k * v->k);
}

static uint64_t code_count(const epipe_cuda_insert_view *v)
{
    return (uint64_t)(v->B * v->K * (v->conv ? (v->H / v->k) * (v->W / v->k) : 1));
}

/* Parameter `which` (0 E, 1 Rt) on the device, copied up when the host's
 * differ from what the device holds. From pageable memory, the copy has
 * read the host's values when it returns; it runs after the work already
 * on the stream, so a call still using the old values is not disturbed. */
static int weights_for(epipe_codec *c, ins_state *st, const epipe_cuda_insert_view *v, int which,
                       const float **out)
{
    size_t n = param_count(v), bytes = n * sizeof(float);
    const float *host = which ? v->Rt : v->E;
    if (st->wn != n) {
        for (int i = 0; i < 2; i++) {
            cudaFree(st->wdev[i]), free(st->wlast[i]);
            st->wdev[i] = st->wlast[i] = NULL, st->valid[i] = 0;
        }
        st->wn = 0;
        for (int i = 0; i < 2; i++) {
            int rc = epipe_cuda_check(c, cudaMalloc((void **)&st->wdev[i], bytes),
                                      "allocating the parameters");
            if (rc)
                return rc;
            if (!(st->wlast[i] = (float *)malloc(bytes)))
                return epipe_cuda_fail(c, EPIPE_ENOMEM, "insert: out of host memory");
        }
        st->wn = n;
    }
    if (!st->valid[which] || memcmp(st->wlast[which], host, bytes)) {
        int rc = epipe_cuda_check(c,
                                  cudaMemcpyAsync(st->wdev[which], host, bytes,
                                                  cudaMemcpyHostToDevice, epipe_cuda_stream(c)),
                                  "copying the parameters to the device");
        if (rc)
            return rc;
        memcpy(st->wlast[which], host, bytes);
        st->valid[which] = 1;
    }
    *out = st->wdev[which];
    return EPIPE_OK;
}

/* The descriptors for v's shape, and the algorithms cleared when it
 * changed. cuDNN takes int dimensions. */
static int describe(epipe_codec *c, ins_state *st, const epipe_cuda_insert_view *v)
{
    const int64_t shape[6] = {v->B, v->C, v->H, v->W, v->K, v->k};
    if (st->have_shape && !memcmp(st->shape, shape, sizeof shape))
        return EPIPE_OK;
    for (int i = 0; i < 6; i++)
        if (shape[i] > INT32_MAX)
            return epipe_cuda_fail(c, EPIPE_EINVAL,
                                   "insert: a dimension of %lld exceeds what cuDNN takes (2^31-1)",
                                   (long long)shape[i]);
    st->have_shape = st->have_fwd = st->have_bwd = st->have_filt = 0;
    const int B = (int)v->B, C = (int)v->C, H = (int)v->H, W = (int)v->W, K = (int)v->K,
              k = (int)v->k;
    int rc;
    if ((rc = dnn_check(c, dnn.tensor_set(st->x, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, B, C, H, W),
                        "describing the input")) ||
        (rc = dnn_check(c,
                        dnn.tensor_set(st->z, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, B, K, H / k,
                                       W / k),
                        "describing the code")) ||
        (rc = dnn_check(c, dnn.filter_set(st->w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, K, C, k, k),
                        "describing the filter")) ||
        (rc = dnn_check(c,
                        dnn.conv_set(st->conv, 0, 0, k, k, 1, 1, CUDNN_CROSS_CORRELATION,
                                     CUDNN_DATA_FLOAT),
                        "describing the convolution")) ||
        (rc = dnn_check(c, dnn.conv_math(st->conv, CUDNN_FMA_MATH), "choosing FMA math")))
        return rc;
    memcpy(st->shape, shape, sizeof shape);
    st->have_shape = 1;
    return EPIPE_OK;
}

/* The first algorithm cuDNN's heuristics rank that works in FMA math and
 * is deterministic (so one payload restores the same bytes every time),
 * else the first that works. Returns its index in perf, or -1. */
template <typename Perf> static int pick(const Perf *perf, int n)
{
    for (int i = 0; i < n; i++)
        if (perf[i].status == CUDNN_STATUS_SUCCESS && perf[i].mathType == CUDNN_FMA_MATH &&
            perf[i].determinism == CUDNN_DETERMINISTIC)
            return i;
    for (int i = 0; i < n; i++)
        if (perf[i].status == CUDNN_STATUS_SUCCESS)
            return i;
    return -1;
}

/* One convolution made ready to run: its algorithm, chosen once per shape
 * (the first of the heuristics' ranking in FMA math that pick() takes,
 * the math it was chosen in and its workspace size), the descriptor set to
 * that math, and its workspace in *ws (NULL when it needs none). query and
 * size call that convolution's cuDNN functions. */
template <typename Perf, typename Algo, typename Query, typename Size>
static int ready(epipe_codec *c, ins_state *st, const char *what, int count, Query query,
                 Size size, int *have, Algo *algo, cudnnMathType_t *math, size_t *space,
                 void **ws)
{
    int rc;
    char doing[80];
    if (!*have) {
        Perf perf[16];
        int n = 0;
        snprintf(doing, sizeof doing, "choosing a %s algorithm", what);
        if ((rc = dnn_check(c, dnn.conv_math(st->conv, CUDNN_FMA_MATH), "choosing FMA math")) ||
            (rc = dnn_check(c, query(count < 16 ? count : 16, &n, perf), doing)))
            return rc;
        int i = pick(perf, n);
        if (i < 0)
            return epipe_cuda_fail(c, EPIPE_ENOTSUP,
                                   "insert: cuDNN has no %s algorithm for this shape", what);
        snprintf(doing, sizeof doing, "sizing the %s workspace", what);
        if ((rc = dnn_check(c, dnn.conv_math(st->conv, perf[i].mathType),
                            "setting the math type")) ||
            (rc = dnn_check(c, size(perf[i].algo, space), doing)))
            return rc;
        *algo = perf[i].algo;
        *math = perf[i].mathType;
        *have = 1;
    }
    *ws = NULL;
    if (*space && (rc = epipe_cuda_grow(c, &epipe_cuda_h(c)->work[1], *space, ws)))
        return rc;
    return dnn_check(c, dnn.conv_math(st->conv, *math), "setting the math type");
}

static int forward_ready(epipe_codec *c, ins_state *st, void **ws)
{
    return ready<cudnnConvolutionFwdAlgoPerf_t>(
        c, st, "forward", CUDNN_CONVOLUTION_FWD_ALGO_COUNT,
        [st](int cap, int *n, cudnnConvolutionFwdAlgoPerf_t *p) {
            return dnn.fwd_algos(st->handle, st->x, st->w, st->conv, st->z, cap, n, p);
        },
        [st](cudnnConvolutionFwdAlgo_t a, size_t *bytes) {
            return dnn.fwd_space(st->handle, st->x, st->w, st->conv, st->z, a, bytes);
        },
        &st->have_fwd, &st->fwd, &st->fwd_math, &st->fwd_space, ws);
}

static int backward_ready(epipe_codec *c, ins_state *st, void **ws)
{
    return ready<cudnnConvolutionBwdDataAlgoPerf_t>(
        c, st, "transposed-convolution", CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT,
        [st](int cap, int *n, cudnnConvolutionBwdDataAlgoPerf_t *p) {
            return dnn.bwd_algos(st->handle, st->w, st->z, st->conv, st->x, cap, n, p);
        },
        [st](cudnnConvolutionBwdDataAlgo_t a, size_t *bytes) {
            return dnn.bwd_space(st->handle, st->w, st->z, st->conv, st->x, a, bytes);
        },
        &st->have_bwd, &st->bwd, &st->bwd_math, &st->bwd_space, ws);
}

static int filter_ready(epipe_codec *c, ins_state *st, void **ws)
{
    return ready<cudnnConvolutionBwdFilterAlgoPerf_t>(
        c, st, "filter-gradient", CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT,
        [st](int cap, int *n, cudnnConvolutionBwdFilterAlgoPerf_t *p) {
            return dnn.filt_algos(st->handle, st->x, st->z, st->conv, st->w, cap, n, p);
        },
        [st](cudnnConvolutionBwdFilterAlgo_t a, size_t *bytes) {
            return dnn.filt_space(st->handle, st->x, st->z, st->conv, st->w, a, bytes);
        },
        &st->have_filt, &st->filt, &st->filt_math, &st->filt_space, ws);
}

/* ---- the slots a backward reads ------------------------------------------- */

/* The slot for key (reused if it exists, else a free one), holding at least
 * n floats of device memory (contents not kept when it grows). */
static int slot_take(epipe_codec *c, ins_cache *ca, int64_t key, size_t n, ins_slot **out)
{
    ins_slot *s = NULL, *free_slot = NULL;
    for (unsigned i = 0; i < ca->n; i++) {
        if (ca->s[i].key == key)
            s = &ca->s[i];
        else if (ca->s[i].key < 0 && !free_slot)
            free_slot = &ca->s[i];
    }
    if (!s)
        s = free_slot;
    if (!s) {
        ins_slot *ns = (ins_slot *)realloc(ca->s, (ca->n + 1) * sizeof *ns);
        if (!ns)
            return epipe_cuda_fail(c, EPIPE_ENOMEM, "insert: out of host memory");
        ca->s = ns;
        s = &ca->s[ca->n++];
        memset(s, 0, sizeof *s);
        s->key = -1;
    }
    if (s->cap < n || !s->buf) {
        cudaFree(s->buf);
        s->buf = NULL, s->cap = 0;
        int rc = epipe_cuda_check(c, cudaMalloc((void **)&s->buf, (n ? n : 1) * sizeof(float)),
                                  "keeping a tensor for the backward");
        if (rc)
            return rc;
        s->cap = n ? n : 1;
    }
    s->key = key;
    s->ndim = c->ndim;
    memcpy(s->shape, c->shape, sizeof(int64_t) * (size_t)c->ndim);
    *out = s;
    return EPIPE_OK;
}

static ins_slot *slot_find(ins_state *st, int enc, int64_t key)
{
    ins_cache *ca = enc ? &st->enc : &st->dec;
    for (unsigned i = 0; i < ca->n; i++)
        if (ca->s[i].key == key)
            return &ca->s[i];
    return NULL;
}

/* ---- the code's bytes ------------------------------------------------------- */

/* The code z (n values) into the body, as the CPU's put_code writes it:
 * fp32 bytes, or fp16 rounded to nearest even. A code that is not finite,
 * or (code16) beyond fp16, goes into the status word; the CPU refuses both
 * before writing, the module when the caller synchronizes. */
__global__ void ins_code_out(const float *z, uint64_t n, int code16, uint8_t *out,
                             epipe_cuda_status *st)
{
    const int aligned = code16 ? ((uintptr_t)out & 1u) == 0 : ((uintptr_t)out & 3u) == 0;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        float v = z[i];
        if (!epipe_hd_finite(v))
            atomicMin(&st->code, (unsigned long long)i);
        else if (code16 && !(fabsf(v) < 65520.0f))
            atomicMin(&st->code, (unsigned long long)i | EPIPE_CUDA_CODE_FP16);
        if (code16) {
            uint16_t h = epipe_hd_f32_to_f16(v);
            if (aligned)
                ((uint16_t *)out)[i] = h;
            else
                out[2 * i] = (uint8_t)h, out[2 * i + 1] = (uint8_t)(h >> 8);
        } else {
            if (aligned)
                ((uint32_t *)out)[i] = epipe_hd_f2u(v);
            else
                epipe_cuda_put_f32(out + 4 * i, v);
        }
    }
}

/* After ins_code_out: when a code was not finite, notes the input's values
 * that are not finite, so the error names the input's index as the CPU's
 * does; when every code is finite each block returns at once. */
__global__ void ins_find_input(const float *x, uint64_t n, const epipe_cuda_status *st,
                               epipe_cuda_status *note)
{
    __shared__ int bad;
    if (threadIdx.x == 0) {
        unsigned long long code = *(volatile const unsigned long long *)&st->code;
        bad = code != ~0ull && !(code & EPIPE_CUDA_CODE_FP16);
    }
    __syncthreads();
    if (!bad)
        return;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x)
        if (!epipe_hd_finite(x[i]))
            epipe_cuda_note_nonfinite(note, x[i], i);
}

/* The body's n codes into z; a NaN or infinity (never written by an
 * encoder) is a bad payload entry, read as 0 until the caller synchronizes
 * and is told. */
__global__ void ins_code_in(const uint8_t *in, uint64_t n, int code16, float *z,
                            epipe_cuda_status *st)
{
    const int aligned = code16 ? ((uintptr_t)in & 1u) == 0 : ((uintptr_t)in & 3u) == 0;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        float v;
        if (code16) {
            uint16_t h = aligned ? ((const uint16_t *)in)[i]
                                 : (uint16_t)(in[2 * i] | in[2 * i + 1] << 8);
            v = epipe_hd_f16_to_f32(h); /* fp16's NaN and infinities stay so */
        } else {
            v = aligned ? epipe_hd_u2f(((const uint32_t *)in)[i]) : epipe_cuda_get_f32(in + 4 * i);
        }
        if (!epipe_hd_finite(v)) {
            atomicMin(&st->bad, (unsigned long long)i << 2 | EPIPE_CUDA_BAD_VALUE);
            v = 0.0f;
        }
        z[i] = v;
    }
}

/* ---- encode and decode ------------------------------------------------------ */

static int launched(epipe_codec *c, const char *what)
{
    return epipe_cuda_check(c, cudaGetLastError(), what);
}

static int ins_encode(epipe_codec *c, const float *x, size_t n, uint8_t *body)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    cudaStream_t s = epipe_cuda_stream(c);
    epipe_cuda_insert_view v;
    ins_state *st;
    const float *E;
    int rc = epipe_cuda_core_fns->ins_plan(c, c->shape, c->ndim, n, &v);
    if (rc || (rc = state_for(c, v.conv, &st)) || (rc = weights_for(c, st, &v, 0, &E)))
        return rc;
    if (c->microbatch >= 0) { /* keep the input for the backward */
        ins_slot *keep;
        if ((rc = slot_take(c, &st->enc, c->microbatch, n, &keep)) ||
            (n && (rc = epipe_cuda_check(c,
                                         cudaMemcpyAsync(keep->buf, x, n * sizeof(float),
                                                         cudaMemcpyDeviceToDevice, s),
                                         "keeping the input"))))
            return rc;
    }
    const uint64_t zn = code_count(&v);
    if (!zn)
        return EPIPE_OK;
    void *z, *out;
    if ((rc = epipe_cuda_grow(c, &h->work[0], zn * sizeof(float), &z)))
        return rc;
    if (v.conv) {
        void *space;
        const float one = 1.0f, zero = 0.0f;
        if ((rc = describe(c, st, &v)) || (rc = forward_ready(c, st, &space)) ||
            (rc = dnn_check(c,
                            dnn.fwd(st->handle, &one, st->x, x, st->w, E, st->conv, st->fwd, space,
                                    st->fwd_space, &zero, st->z, z),
                            "compressing (convolution forward)")))
            return rc;
    } else {
        /* Z [B][K] row-major is column-major K x B: E (column-major C x K)
         * transposed, times X (column-major C x B). */
        if ((rc = epipe_cuda_gemm(c, "compressing (Z = X Et)", 1, 0, (int)v.K, (int)v.B, (int)v.C,
                                  E, (int)v.C, 0, x, (int)v.C, 0, (float *)z, (int)v.K, 0, 1)))
            return rc;
    }
    const size_t bytes = (size_t)zn * (v.code16 ? 2 : 4);
    if ((rc = epipe_cuda_body_out(c, 0, bytes, &out)))
        return rc;
    ins_code_out<<<epipe_cuda_blocks(zn, 256), 256, 0, s>>>((const float *)z, zn, v.code16,
                                                            (uint8_t *)out, h->status);
    if ((rc = launched(c, "launching the code kernel")))
        return rc;
    /* A few hundred blocks: they return at once unless a code was not
     * finite, and a block for every 256 values (50,176 for a
     * [32,32,112,112] input) took 33 us on an H200 just to start and end. */
    ins_find_input<<<epipe_cuda_extent_blocks(n), 256, 0, s>>>(x, n, h->status, h->status);
    if ((rc = launched(c, "launching the input check")))
        return rc;
    return epipe_cuda_body_flush(c, body, 0, out, bytes);
}

static int ins_decode(epipe_codec *c, const uint8_t *body, size_t n, float *y)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    cudaStream_t s = epipe_cuda_stream(c);
    epipe_cuda_insert_view v;
    ins_state *st;
    const float *Rt;
    int rc = epipe_cuda_core_fns->ins_plan(c, c->shape, c->ndim, n, &v);
    if (rc || (rc = state_for(c, v.conv, &st)) || (rc = weights_for(c, st, &v, 1, &Rt)))
        return rc;
    const uint64_t zn = code_count(&v);
    if (!zn)
        return EPIPE_OK;
    const void *in;
    void *z;
    ins_slot *keep = NULL; /* read the code straight into the slot the backward uses */
    if ((rc = epipe_cuda_body_in(c, body, 0, (size_t)zn * (v.code16 ? 2 : 4), &in)) ||
        (c->microbatch >= 0 && (rc = slot_take(c, &st->dec, c->microbatch, zn, &keep))) ||
        (!keep && (rc = epipe_cuda_grow(c, &h->work[0], zn * sizeof(float), &z))))
        return rc;
    if (keep)
        z = keep->buf;
    ins_code_in<<<epipe_cuda_blocks(zn, 256), 256, 0, s>>>((const uint8_t *)in, zn, v.code16,
                                                           (float *)z, h->status);
    if ((rc = launched(c, "launching the code kernel")))
        return rc;
    if (!v.conv) /* Y [B][C] row-major is column-major C x B: Rt (column-major C x K) times Z */
        return epipe_cuda_gemm(c, "restoring (Y = Z Rt)", 0, 0, (int)v.C, (int)v.B, (int)v.K, Rt,
                               (int)v.C, 0, (const float *)z, (int)v.K, 0, y, (int)v.C, 0, 1);
    void *space;
    const float one = 1.0f, zero = 0.0f;
    if ((rc = describe(c, st, &v)) || (rc = backward_ready(c, st, &space)))
        return rc;
    return dnn_check(c,
                     dnn.bwd(st->handle, &one, st->w, Rt, st->z, z, st->conv, st->bwd, space,
                             st->bwd_space, &zero, st->x, y),
                     "restoring (transposed convolution)");
}

/* ---- training --------------------------------------------------------------- */

static int no_slot(epipe_codec *c, const char *what, int64_t mb)
{
    return epipe_cuda_fail(c, EPIPE_ESTATE,
                           "insert: no %s of micro-batch %lld is kept for its backward (set "
                           "EPIPE_CODEC_MICROBATCH to the micro-batch before the %s)",
                           what, (long long)mb, what);
}

/* The parameter gradient dw (n values, device) added to the host's g, the
 * gradient epipe_codec_tensor() lends: the backward waits for its stream. */
static int add_gradient(epipe_codec *c, const void *dw, float *g, size_t n)
{
    void *hw;
    int rc = epipe_cuda_host(c, n * sizeof(float), &hw);
    if (rc ||
        (rc = epipe_cuda_check(c,
                               cudaMemcpyAsync(hw, dw, n * sizeof(float), cudaMemcpyDeviceToHost,
                                               epipe_cuda_stream(c)),
                               "copying the parameter gradient")) ||
        (rc = epipe_cuda_check(c, cudaStreamSynchronize(epipe_cuda_stream(c)),
                               "waiting for the parameter gradient")))
        return rc;
    const float *d = (const float *)hw;
    for (size_t i = 0; i < n; i++)
        g[i] += d[i];
    return EPIPE_OK;
}

static uint64_t count(const ins_slot *s)
{
    uint64_t n = 1;
    for (int d = 0; d < s->ndim; d++)
        n *= (uint64_t)s->shape[d];
    return n;
}

/* The slot of micro-batch mb (enc: the input; else the code), the shapes
 * checked as on the CPU, its view, state and parameter `which`, and K*P
 * floats of device memory for the parameter gradient. */
static int backward_setup(epipe_codec *c, int enc, int64_t mb, const int64_t *zshape, int zndim,
                          const int64_t *fshape, int fndim, ins_slot **s,
                          epipe_cuda_insert_view *v, ins_state **st, const float **w, void **dw)
{
    ins_state *have = (ins_state *)epipe_cuda_h(c)->dnn;
    if (!have || !(*s = slot_find(have, enc, mb)))
        return no_slot(c, enc ? "encode" : "decode", mb);
    const epipe_cuda_core *core = epipe_cuda_core_fns;
    int rc = core->ins_check_backward(c, mb, enc ? "input" : "output", (*s)->shape, (*s)->ndim,
                                      zshape, zndim, fshape, fndim);
    if (rc || (rc = core->ins_plan(c, (*s)->shape, (*s)->ndim, count(*s), v)) ||
        (rc = state_for(c, v->conv, st)) || (rc = weights_for(c, *st, v, enc ? 0 : 1, w)) ||
        (v->conv && (rc = describe(c, *st, v))))
        return rc;
    size_t wn = param_count(v);
    return epipe_cuda_grow(c, &epipe_cuda_h(c)->work[0], wn * sizeof(float), dw);
}

/* The filter gradient of the convolution from x-space (src) to z-space
 * (dz) into dw, with cuDNN's backward filter. */
static int filter_gradient(epipe_codec *c, ins_state *st, const float *src, const float *dz,
                           void *dw)
{
    void *space;
    const float one = 1.0f, zero = 0.0f;
    int rc = filter_ready(c, st, &space);
    if (rc)
        return rc;
    return dnn_check(c,
                     dnn.filt(st->handle, &one, st->x, src, st->z, dz, st->conv, st->filt, space,
                              st->filt_space, &zero, st->w, dw),
                     "computing the filter gradient");
}

/* gz to the input's gradient gx (E's backward data), and E's gradient
 * from the kept input: the CPU's encode_backward. */
static int ins_encode_backward(epipe_codec *c, int64_t mb, const float *gz, const int64_t *zshape,
                               int zndim, float *gx, const int64_t *xshape, int xndim)
{
    ins_slot *s;
    epipe_cuda_insert_view v;
    ins_state *st;
    const float *E;
    void *dw;
    int rc = backward_setup(c, 1, mb, zshape, zndim, xshape, xndim, &s, &v, &st, &E, &dw);
    if (rc)
        return rc;
    const size_t wn = param_count(&v);
    if (v.B && v.conv) {
        void *space;
        const float one = 1.0f, zero = 0.0f;
        if ((rc = backward_ready(c, st, &space)) ||
            (rc = dnn_check(c,
                            dnn.bwd(st->handle, &one, st->w, E, st->z, gz, st->conv, st->bwd, space,
                                    st->bwd_space, &zero, st->x, gx),
                            "back-propagating through the compress")) ||
            (rc = filter_gradient(c, st, s->buf, gz, dw)) || (rc = add_gradient(c, dw, v.gE, wn)))
            return rc;
    } else if (v.B) {
        /* gX [B][C] = gZ [B][K] E [K][C]; dE [K][C] = gZᵀ X, column-major */
        const int B = (int)v.B, C = (int)v.C, K = (int)v.K;
        if ((rc = epipe_cuda_gemm(c, "back-propagating through the compress", 0, 0, C, B, K, E, C,
                                  0, gz, K, 0, gx, C, 0, 1)) ||
            (rc = epipe_cuda_gemm(c, "computing the compress gradient", 0, 1, C, K, B, s->buf, C, 0,
                                  gz, K, 0, (float *)dw, C, 0, 1)) ||
            (rc = add_gradient(c, dw, v.gE, wn)))
            return rc;
    }
    s->key = -1;
    return EPIPE_OK;
}

/* gy to the code's gradient gz (a convolution forward with Rt), and Rt's
 * gradient from the kept code: the CPU's decode_backward. */
static int ins_decode_backward(epipe_codec *c, int64_t mb, const float *gy, const int64_t *yshape,
                               int yndim, float *gz, const int64_t *zshape, int zndim)
{
    ins_slot *s;
    epipe_cuda_insert_view v;
    ins_state *st;
    const float *Rt;
    void *dw;
    int rc = backward_setup(c, 0, mb, zshape, zndim, yshape, yndim, &s, &v, &st, &Rt, &dw);
    if (rc)
        return rc;
    const size_t wn = param_count(&v);
    if (v.B && v.conv) {
        void *space;
        const float one = 1.0f, zero = 0.0f;
        if ((rc = forward_ready(c, st, &space)) ||
            (rc = dnn_check(c,
                            dnn.fwd(st->handle, &one, st->x, gy, st->w, Rt, st->conv, st->fwd,
                                    space, st->fwd_space, &zero, st->z, gz),
                            "back-propagating through the restore")) ||
            (rc = filter_gradient(c, st, gy, s->buf, dw)) || (rc = add_gradient(c, dw, v.gRt, wn)))
            return rc;
    } else if (v.B) {
        /* gZ [B][K] = gY [B][C] Rtᵀ; dRt [K][C] = Zᵀ gY, column-major */
        const int B = (int)v.B, C = (int)v.C, K = (int)v.K;
        if ((rc = epipe_cuda_gemm(c, "back-propagating through the restore", 1, 0, K, B, C, Rt, C,
                                  0, gy, C, 0, gz, K, 0, 1)) ||
            (rc = epipe_cuda_gemm(c, "computing the restore gradient", 0, 1, C, K, B, gy, C, 0,
                                  s->buf, K, 0, (float *)dw, C, 0, 1)) ||
            (rc = add_gradient(c, dw, v.gRt, wn)))
            return rc;
    }
    s->key = -1;
    return EPIPE_OK;
}

/* The backward passes only: the parameters, their gradients and the SGD
 * step are the host's, which the core reaches through the CPU backend. */
static const epipe_codec_train_ops ins_train = {
    NULL, ins_encode_backward, ins_decode_backward, NULL, NULL, NULL, NULL,
};

const epipe_codec_backend epipe_cuda_insert = {ins_encode, ins_decode, NULL, NULL, 1, &ins_train};
