/* The CUDA emulator's cuDNN (tests/cudaemu/): the calls cuda/insert.cu
 * opens, for 4-d NCHW fp32 tensors, as direct loops on the emulator's
 * device memory: forward convolution, backward data and backward filter
 * with padding, strides and dilation, cross-correlation or convolution.
 * Every algorithm query answers one algorithm needing no workspace. */
#include <stdio.h>
#include <stdlib.h>

#define EMU_EXPORT extern "C" __attribute__((visibility("default")))

namespace
{
struct handle {
    cudaStream_t stream;
};
struct tensor {
    int n, c, h, w, set;
};
struct filter {
    int k, c, r, s, set;
};
struct conv {
    int pad_h, pad_w, u, v, dil_h, dil_w, set;
    cudnnConvolutionMode_t mode;
    cudnnMathType_t math;
};

bool on_device(const void *p)
{
    cudaPointerAttributes a;
    return p && cudaPointerGetAttributes(&a, p) == cudaSuccess && a.type == cudaMemoryTypeDevice;
}

size_t idx(const tensor *t, int n, int c, int h, int w)
{
    return (((size_t)n * t->c + c) * t->h + h) * t->w + w;
}
size_t fidx(const filter *f, int k, int c, int r, int s)
{
    return (((size_t)k * f->c + c) * f->r + r) * f->s + s;
}

/* the shapes agree: y is what x convolved with w by cv gives */
bool shapes(const tensor *x, const filter *w, const conv *cv, const tensor *y)
{
    if (!x || !w || !cv || !y || !x->set || !w->set || !cv->set || !y->set)
        return false;
    int oh = (x->h + 2 * cv->pad_h - cv->dil_h * (w->r - 1) - 1) / cv->u + 1;
    int ow = (x->w + 2 * cv->pad_w - cv->dil_w * (w->s - 1) - 1) / cv->v + 1;
    return x->c == w->c && y->n == x->n && y->c == w->k && y->h == oh && y->w == ow;
}

/* The input coordinate filter tap (r, s) of output (oh, ow) reads, or
 * false where it falls in the padding. */
bool tap(const tensor *x, const filter *w, const conv *cv, int oh, int ow, int r, int s, int *ih,
         int *iw)
{
    int rr = cv->mode == CUDNN_CONVOLUTION ? w->r - 1 - r : r;
    int ss = cv->mode == CUDNN_CONVOLUTION ? w->s - 1 - s : s;
    *ih = oh * cv->u - cv->pad_h + rr * cv->dil_h;
    *iw = ow * cv->v - cv->pad_w + ss * cv->dil_w;
    return *ih >= 0 && *ih < x->h && *iw >= 0 && *iw < x->w;
}

void blend(float *out, float v, const void *alpha, const void *beta)
{
    float a = *(const float *)alpha, b = *(const float *)beta;
    *out = b == 0.0f ? a * v : a * v + b * *out;
}

template <class P> cudnnStatus_t one_algo(int cap, int *n, P *perf)
{
    if (!n || !perf || cap < 1)
        return CUDNN_STATUS_BAD_PARAM;
    memset(perf, 0, sizeof *perf);
    perf->algo = (decltype(perf->algo))0;
    perf->status = CUDNN_STATUS_SUCCESS;
    perf->time = 0.0f;
    perf->memory = 0;
    perf->determinism = CUDNN_DETERMINISTIC;
    perf->mathType = CUDNN_FMA_MATH;
    *n = 1;
    return CUDNN_STATUS_SUCCESS;
}
} // namespace

EMU_EXPORT cudnnStatus_t cudnnCreate(cudnnHandle_t *h)
{
    if (!h)
        return CUDNN_STATUS_BAD_PARAM;
    *h = (cudnnHandle_t)calloc(1, sizeof(handle));
    return *h ? CUDNN_STATUS_SUCCESS : CUDNN_STATUS_ALLOC_FAILED;
}
EMU_EXPORT cudnnStatus_t cudnnDestroy(cudnnHandle_t h)
{
    free(h);
    return CUDNN_STATUS_SUCCESS;
}
EMU_EXPORT cudnnStatus_t cudnnSetStream(cudnnHandle_t h, cudaStream_t s)
{
    if (!h)
        return CUDNN_STATUS_BAD_PARAM;
    ((handle *)h)->stream = s;
    return CUDNN_STATUS_SUCCESS;
}
EMU_EXPORT const char *cudnnGetErrorString(cudnnStatus_t s)
{
    return s == CUDNN_STATUS_SUCCESS     ? "CUDNN_STATUS_SUCCESS"
           : s == CUDNN_STATUS_BAD_PARAM ? "CUDNN_STATUS_BAD_PARAM"
                                         : "CUDNN_STATUS_NOT_SUPPORTED (cudaemu)";
}

#define EMU_DESCRIPTOR(T, Create, Destroy)                                                         \
    EMU_EXPORT cudnnStatus_t Create(T##_t *d)                                                      \
    {                                                                                              \
        if (!d)                                                                                    \
            return CUDNN_STATUS_BAD_PARAM;                                                         \
        *d = (T##_t)calloc(1, 64);                                                                 \
        return *d ? CUDNN_STATUS_SUCCESS : CUDNN_STATUS_ALLOC_FAILED;                              \
    }                                                                                              \
    EMU_EXPORT cudnnStatus_t Destroy(T##_t d)                                                      \
    {                                                                                              \
        free(d);                                                                                   \
        return CUDNN_STATUS_SUCCESS;                                                               \
    }
EMU_DESCRIPTOR(cudnnTensorDescriptor, cudnnCreateTensorDescriptor, cudnnDestroyTensorDescriptor)
EMU_DESCRIPTOR(cudnnFilterDescriptor, cudnnCreateFilterDescriptor, cudnnDestroyFilterDescriptor)
EMU_DESCRIPTOR(cudnnConvolutionDescriptor, cudnnCreateConvolutionDescriptor,
               cudnnDestroyConvolutionDescriptor)

EMU_EXPORT cudnnStatus_t cudnnSetTensor4dDescriptor(cudnnTensorDescriptor_t d,
                                                    cudnnTensorFormat_t f, cudnnDataType_t t, int n,
                                                    int c, int h, int w)
{
    if (!d || n <= 0 || c <= 0 || h <= 0 || w <= 0)
        return CUDNN_STATUS_BAD_PARAM;
    if (f != CUDNN_TENSOR_NCHW || t != CUDNN_DATA_FLOAT)
        return CUDNN_STATUS_NOT_SUPPORTED;
    *(tensor *)d = tensor{n, c, h, w, 1};
    return CUDNN_STATUS_SUCCESS;
}
EMU_EXPORT cudnnStatus_t cudnnSetFilter4dDescriptor(cudnnFilterDescriptor_t d, cudnnDataType_t t,
                                                    cudnnTensorFormat_t f, int k, int c, int r,
                                                    int s)
{
    if (!d || k <= 0 || c <= 0 || r <= 0 || s <= 0)
        return CUDNN_STATUS_BAD_PARAM;
    if (f != CUDNN_TENSOR_NCHW || t != CUDNN_DATA_FLOAT)
        return CUDNN_STATUS_NOT_SUPPORTED;
    *(filter *)d = filter{k, c, r, s, 1};
    return CUDNN_STATUS_SUCCESS;
}
EMU_EXPORT cudnnStatus_t cudnnSetConvolution2dDescriptor(cudnnConvolutionDescriptor_t d, int pad_h,
                                                         int pad_w, int u, int v, int dil_h,
                                                         int dil_w, cudnnConvolutionMode_t mode,
                                                         cudnnDataType_t compute)
{
    if (!d || pad_h < 0 || pad_w < 0 || u <= 0 || v <= 0 || dil_h <= 0 || dil_w <= 0)
        return CUDNN_STATUS_BAD_PARAM;
    if (compute != CUDNN_DATA_FLOAT)
        return CUDNN_STATUS_NOT_SUPPORTED;
    conv *cv = (conv *)d;
    *cv = conv{pad_h, pad_w, u, v, dil_h, dil_w, 1, mode, CUDNN_DEFAULT_MATH};
    return CUDNN_STATUS_SUCCESS;
}
EMU_EXPORT cudnnStatus_t cudnnSetConvolutionMathType(cudnnConvolutionDescriptor_t d,
                                                     cudnnMathType_t m)
{
    if (!d)
        return CUDNN_STATUS_BAD_PARAM;
    ((conv *)d)->math = m;
    return CUDNN_STATUS_SUCCESS;
}

EMU_EXPORT cudnnStatus_t cudnnGetConvolutionForwardAlgorithm_v7(
    cudnnHandle_t h, cudnnTensorDescriptor_t x, cudnnFilterDescriptor_t w,
    cudnnConvolutionDescriptor_t cv, cudnnTensorDescriptor_t y, int cap, int *n,
    cudnnConvolutionFwdAlgoPerf_t *perf)
{
    if (!h || !shapes((tensor *)x, (filter *)w, (conv *)cv, (tensor *)y))
        return CUDNN_STATUS_BAD_PARAM;
    return one_algo(cap, n, perf);
}
EMU_EXPORT cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithm_v7(
    cudnnHandle_t h, cudnnFilterDescriptor_t w, cudnnTensorDescriptor_t dy,
    cudnnConvolutionDescriptor_t cv, cudnnTensorDescriptor_t dx, int cap, int *n,
    cudnnConvolutionBwdDataAlgoPerf_t *perf)
{
    if (!h || !shapes((tensor *)dx, (filter *)w, (conv *)cv, (tensor *)dy))
        return CUDNN_STATUS_BAD_PARAM;
    return one_algo(cap, n, perf);
}
EMU_EXPORT cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithm_v7(
    cudnnHandle_t h, cudnnTensorDescriptor_t x, cudnnTensorDescriptor_t dy,
    cudnnConvolutionDescriptor_t cv, cudnnFilterDescriptor_t dw, int cap, int *n,
    cudnnConvolutionBwdFilterAlgoPerf_t *perf)
{
    if (!h || !shapes((tensor *)x, (filter *)dw, (conv *)cv, (tensor *)dy))
        return CUDNN_STATUS_BAD_PARAM;
    return one_algo(cap, n, perf);
}
/* cudnnFind*: the same one algorithm, "measured" */
EMU_EXPORT cudnnStatus_t cudnnFindConvolutionForwardAlgorithm(
    cudnnHandle_t h, cudnnTensorDescriptor_t x, cudnnFilterDescriptor_t w,
    cudnnConvolutionDescriptor_t cv, cudnnTensorDescriptor_t y, int cap, int *n,
    cudnnConvolutionFwdAlgoPerf_t *perf)
{
    return cudnnGetConvolutionForwardAlgorithm_v7(h, x, w, cv, y, cap, n, perf);
}
EMU_EXPORT cudnnStatus_t cudnnFindConvolutionBackwardDataAlgorithm(
    cudnnHandle_t h, cudnnFilterDescriptor_t w, cudnnTensorDescriptor_t dy,
    cudnnConvolutionDescriptor_t cv, cudnnTensorDescriptor_t dx, int cap, int *n,
    cudnnConvolutionBwdDataAlgoPerf_t *perf)
{
    return cudnnGetConvolutionBackwardDataAlgorithm_v7(h, w, dy, cv, dx, cap, n, perf);
}
EMU_EXPORT cudnnStatus_t cudnnGetConvolutionForwardWorkspaceSize(
    cudnnHandle_t h, cudnnTensorDescriptor_t x, cudnnFilterDescriptor_t w,
    cudnnConvolutionDescriptor_t cv, cudnnTensorDescriptor_t y, cudnnConvolutionFwdAlgo_t a,
    size_t *bytes)
{
    if (!h || !bytes || !shapes((tensor *)x, (filter *)w, (conv *)cv, (tensor *)y))
        return CUDNN_STATUS_BAD_PARAM;
    *bytes = 0;
    return CUDNN_STATUS_SUCCESS;
}
EMU_EXPORT cudnnStatus_t cudnnGetConvolutionBackwardDataWorkspaceSize(
    cudnnHandle_t h, cudnnFilterDescriptor_t w, cudnnTensorDescriptor_t dy,
    cudnnConvolutionDescriptor_t cv, cudnnTensorDescriptor_t dx, cudnnConvolutionBwdDataAlgo_t a,
    size_t *bytes)
{
    if (!h || !bytes || !shapes((tensor *)dx, (filter *)w, (conv *)cv, (tensor *)dy))
        return CUDNN_STATUS_BAD_PARAM;
    *bytes = 0;
    return CUDNN_STATUS_SUCCESS;
}
EMU_EXPORT cudnnStatus_t cudnnGetConvolutionBackwardFilterWorkspaceSize(
    cudnnHandle_t h, cudnnTensorDescriptor_t x, cudnnTensorDescriptor_t dy,
    cudnnConvolutionDescriptor_t cv, cudnnFilterDescriptor_t dw, cudnnConvolutionBwdFilterAlgo_t a,
    size_t *bytes)
{
    if (!h || !bytes || !shapes((tensor *)x, (filter *)dw, (conv *)cv, (tensor *)dy))
        return CUDNN_STATUS_BAD_PARAM;
    *bytes = 0;
    return CUDNN_STATUS_SUCCESS;
}

/* y = alpha conv(x, w) + beta y */
EMU_EXPORT cudnnStatus_t cudnnConvolutionForward(cudnnHandle_t h, const void *alpha,
                                                 cudnnTensorDescriptor_t xd, const void *x,
                                                 cudnnFilterDescriptor_t wd, const void *w,
                                                 cudnnConvolutionDescriptor_t cd,
                                                 cudnnConvolutionFwdAlgo_t algo, void *space,
                                                 size_t space_bytes, const void *beta,
                                                 cudnnTensorDescriptor_t yd, void *y)
{
    const tensor *X = (tensor *)xd, *Y = (tensor *)yd;
    const filter *W = (filter *)wd;
    const conv *cv = (conv *)cd;
    if (!h || !alpha || !beta || !shapes(X, W, cv, Y))
        return CUDNN_STATUS_BAD_PARAM;
    if (!on_device(x) || !on_device(w) || !on_device(y))
        return CUDNN_STATUS_EXECUTION_FAILED;
    const float *xf = (const float *)x, *wf = (const float *)w;
    for (int n = 0; n < Y->n; n++)
        for (int k = 0; k < Y->c; k++)
            for (int oh = 0; oh < Y->h; oh++)
                for (int ow = 0; ow < Y->w; ow++) {
                    float s = 0.0f;
                    for (int c = 0; c < W->c; c++)
                        for (int r = 0; r < W->r; r++)
                            for (int q = 0; q < W->s; q++) {
                                int ih, iw;
                                if (tap(X, W, cv, oh, ow, r, q, &ih, &iw))
                                    s += xf[idx(X, n, c, ih, iw)] * wf[fidx(W, k, c, r, q)];
                            }
                    blend((float *)y + idx(Y, n, k, oh, ow), s, alpha, beta);
                }
    return CUDNN_STATUS_SUCCESS;
}

/* dx = alpha (the gradient of conv(x, w) with respect to x, given dy) + beta dx */
EMU_EXPORT cudnnStatus_t cudnnConvolutionBackwardData(
    cudnnHandle_t h, const void *alpha, cudnnFilterDescriptor_t wd, const void *w,
    cudnnTensorDescriptor_t dyd, const void *dy, cudnnConvolutionDescriptor_t cd,
    cudnnConvolutionBwdDataAlgo_t algo, void *space, size_t space_bytes, const void *beta,
    cudnnTensorDescriptor_t dxd, void *dx)
{
    const tensor *X = (tensor *)dxd, *Y = (tensor *)dyd;
    const filter *W = (filter *)wd;
    const conv *cv = (conv *)cd;
    if (!h || !alpha || !beta || !shapes(X, W, cv, Y))
        return CUDNN_STATUS_BAD_PARAM;
    if (!on_device(w) || !on_device(dy) || !on_device(dx))
        return CUDNN_STATUS_EXECUTION_FAILED;
    size_t nx = (size_t)X->n * X->c * X->h * X->w;
    float *g = (float *)calloc(nx ? nx : 1, sizeof(float));
    if (!g)
        return CUDNN_STATUS_ALLOC_FAILED;
    const float *wf = (const float *)w, *dyf = (const float *)dy;
    for (int n = 0; n < Y->n; n++)
        for (int k = 0; k < Y->c; k++)
            for (int oh = 0; oh < Y->h; oh++)
                for (int ow = 0; ow < Y->w; ow++) {
                    float d = dyf[idx(Y, n, k, oh, ow)];
                    for (int c = 0; c < W->c; c++)
                        for (int r = 0; r < W->r; r++)
                            for (int q = 0; q < W->s; q++) {
                                int ih, iw;
                                if (tap(X, W, cv, oh, ow, r, q, &ih, &iw))
                                    g[idx(X, n, c, ih, iw)] += d * wf[fidx(W, k, c, r, q)];
                            }
                }
    for (size_t i = 0; i < nx; i++)
        blend((float *)dx + i, g[i], alpha, beta);
    free(g);
    return CUDNN_STATUS_SUCCESS;
}

/* dw = alpha (the gradient of conv(x, w) with respect to w, given dy) + beta dw */
EMU_EXPORT cudnnStatus_t cudnnConvolutionBackwardFilter(
    cudnnHandle_t h, const void *alpha, cudnnTensorDescriptor_t xd, const void *x,
    cudnnTensorDescriptor_t dyd, const void *dy, cudnnConvolutionDescriptor_t cd,
    cudnnConvolutionBwdFilterAlgo_t algo, void *space, size_t space_bytes, const void *beta,
    cudnnFilterDescriptor_t dwd, void *dw)
{
    const tensor *X = (tensor *)xd, *Y = (tensor *)dyd;
    const filter *W = (filter *)dwd;
    const conv *cv = (conv *)cd;
    if (!h || !alpha || !beta || !shapes(X, W, cv, Y))
        return CUDNN_STATUS_BAD_PARAM;
    if (!on_device(x) || !on_device(dy) || !on_device(dw))
        return CUDNN_STATUS_EXECUTION_FAILED;
    const float *xf = (const float *)x, *dyf = (const float *)dy;
    for (int k = 0; k < W->k; k++)
        for (int c = 0; c < W->c; c++)
            for (int r = 0; r < W->r; r++)
                for (int q = 0; q < W->s; q++) {
                    float s = 0.0f;
                    for (int n = 0; n < Y->n; n++)
                        for (int oh = 0; oh < Y->h; oh++)
                            for (int ow = 0; ow < Y->w; ow++) {
                                int ih, iw;
                                if (tap(X, W, cv, oh, ow, r, q, &ih, &iw))
                                    s += xf[idx(X, n, c, ih, iw)] * dyf[idx(Y, n, k, oh, ow)];
                            }
                    blend((float *)dw + fidx(W, k, c, r, q), s, alpha, beta);
                }
    return CUDNN_STATUS_SUCCESS;
}
