/* The CUDA emulator's cuBLAS (tests/cudaemu/): the calls cuda/cublas.cu
 * opens, as plain loops on the emulator's device memory. Operands that are
 * not device memory are refused, as cuBLAS faults on them. */
#include <stdio.h>
#include <stdlib.h>

#define EMU_EXPORT extern "C" __attribute__((visibility("default")))

namespace
{
struct handle {
    cudaStream_t stream;
};

bool on_device(const void *p)
{
    cudaPointerAttributes a;
    return p && cudaPointerGetAttributes(&a, p) == cudaSuccess && a.type == cudaMemoryTypeDevice;
}

/* element (i, j) of op(M), M column-major with leading dimension ld */
float at(const float *m, int ld, cublasOperation_t op, long long i, long long j)
{
    return op == CUBLAS_OP_N ? m[i + j * ld] : m[j + i * ld];
}
} // namespace

EMU_EXPORT cublasStatus_t cublasCreate_v2(cublasHandle_t *h)
{
    if (!h)
        return CUBLAS_STATUS_INVALID_VALUE;
    *h = (cublasHandle_t)calloc(1, sizeof(handle));
    return *h ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_ALLOC_FAILED;
}

EMU_EXPORT cublasStatus_t cublasDestroy_v2(cublasHandle_t h)
{
    free(h);
    return CUBLAS_STATUS_SUCCESS;
}

EMU_EXPORT cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    ((handle *)h)->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}

/* C_i = alpha op(A_i) op(B_i) + beta C_i for i < batch; C is not read
 * when beta is 0 (its garbage must not leak in, as in cuBLAS). */
EMU_EXPORT cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta,
                                                    cublasOperation_t tb, int m, int n, int k,
                                                    const float *alpha, const float *A, int lda,
                                                    long long sa, const float *B, int ldb,
                                                    long long sb, const float *beta, float *C,
                                                    int ldc, long long sc, int batch)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    if (m < 0 || n < 0 || k < 0 || batch < 0 || !alpha || !beta ||
        lda < (ta == CUBLAS_OP_N ? (m > 1 ? m : 1) : (k > 1 ? k : 1)) ||
        ldb < (tb == CUBLAS_OP_N ? (k > 1 ? k : 1) : (n > 1 ? n : 1)) || ldc < (m > 1 ? m : 1))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (!m || !n || !batch)
        return CUBLAS_STATUS_SUCCESS;
    if ((k && (!on_device(A) || !on_device(B))) || !on_device(C)) {
        fprintf(stderr, "cudaemu cuBLAS: an operand of SgemmStridedBatched is not device memory\n");
        return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    for (int b = 0; b < batch; b++) {
        const float *a = A + b * sa, *bb = B + b * sb;
        float *c = C + b * sc;
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++) {
                float s = 0.0f;
                for (int l = 0; l < k; l++)
                    s += at(a, lda, ta, i, l) * at(bb, ldb, tb, l, j);
                float *out = &c[i + (long long)j * ldc];
                *out = *beta == 0.0f ? *alpha * s : *alpha * s + *beta * *out;
            }
    }
    return CUBLAS_STATUS_SUCCESS;
}
