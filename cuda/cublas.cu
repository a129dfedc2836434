/* cuBLAS for the module's products (poweriter's, insert's linear kind),
 * opened on first use rather than linked: the module loads (and every
 * other codec works) without it, and loading it costs nothing to programs
 * that never multiply on a GPU. */
#include <cublas_v2.h> /* types and constants only: the library is opened at run time */
#include <pthread.h>

#include "cuda_impl.h"
#include "dlopen_all.h"

#ifndef EPIPE_CUBLAS_PATH
#define EPIPE_CUBLAS_PATH "libcublas.so"
#endif

#define BLAS_FNS(X)                                                                                \
    X(create, cublasCreate_v2)                                                                     \
    X(destroy, cublasDestroy_v2)                                                                   \
    X(set_stream, cublasSetStream_v2)                                                              \
    X(gemm, cublasSgemmStridedBatched)

static struct {
    BLAS_FNS(EPIPE_CUDA_FIELD)
} blas;
static pthread_once_t blas_once = PTHREAD_ONCE_INIT;
static int blas_ok;

static void blas_open(void)
{
    static const char *const names[] = {"libcublas.so", EPIPE_CUBLAS_PATH, "libcublas.so.13",
                                        "libcublas.so.12", "libcublas.so.11"};
    static const char *const syms[] = {BLAS_FNS(EPIPE_CUDA_SYM)};
#define SLOT(name, sym) (void **)&blas.name,
    void **const slots[] = {BLAS_FNS(SLOT)};
#undef SLOT
    blas_ok = epipe_cuda_dlopen_all(names, sizeof names / sizeof *names, syms, slots,
                                    sizeof syms / sizeof *syms) != NULL;
}

int epipe_cuda_blas_available(void)
{
    pthread_once(&blas_once, blas_open);
    return blas_ok;
}

static int blas_check(epipe_codec *c, cublasStatus_t s, const char *doing)
{
    if (s == CUBLAS_STATUS_SUCCESS)
        return EPIPE_OK;
    return epipe_cuda_fail(c, s == CUBLAS_STATUS_ALLOC_FAILED ? EPIPE_ENOMEM : EPIPE_EIO,
                           "%s: cuBLAS error %d while %s", c->ops->name, (int)s, doing);
}

/* The handle's cuBLAS handle, made on first use, on the handle's stream. */
static int blas_for(epipe_codec *c, cublasHandle_t *out)
{
    epipe_cuda_handle *h = epipe_cuda_h(c);
    int rc;
    if (!h->blas) {
        cublasHandle_t b;
        if ((rc = blas_check(c, blas.create(&b), "creating a cuBLAS handle")))
            return rc;
        h->blas = b;
    }
    *out = (cublasHandle_t)h->blas;
    return blas_check(c, blas.set_stream(*out, epipe_cuda_stream(c)), "setting the stream");
}

int epipe_cuda_gemm(epipe_codec *c, const char *doing, int ta, int tb, int m, int n, int k,
                    const float *a, int lda, long long sa, const float *b, int ldb, long long sb,
                    float *out, int ldc, long long sc, int batch)
{
    cublasHandle_t handle;
    const float one = 1.0f, zero = 0.0f;
    int rc = blas_for(c, &handle);
    return rc ? rc
              : blas_check(c,
                           blas.gemm(handle, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                     tb ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k, &one, a, lda, sa, b,
                                     ldb, sb, &zero, out, ldc, sc, batch),
                           doing);
}

void epipe_cuda_blas_release(epipe_cuda_handle *h)
{
    if (h->blas)
        blas.destroy((cublasHandle_t)h->blas);
    h->blas = NULL;
}
