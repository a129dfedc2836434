/* The gpu suite: stages with CUDA tensors on a GPU, the exchange of
 * tests/support/stage_exchange.h (GPipe and 1F1B over inproc and TCP,
 * received tensors in device or host memory, each equal byte for byte to
 * what the CPU codecs make of what was sent) with codecs that have CUDA
 * kernels. tests/fakecuda/test_stage_staged.c runs the same on any machine
 * through host staging. Exit 77 without a device. */
#include <cuda_runtime.h>

#include "gpu_test.h"
#include "stage_exchange.h"

static void *dev_alloc(size_t bytes)
{
    void *p = NULL;
    return cudaMalloc(&p, bytes) == cudaSuccess ? p : NULL;
}

static void dev_free(void *p)
{
    cudaFree(p);
}

static int dev_copy(void *dst, const void *src, size_t bytes)
{
    return cudaMemcpy(dst, src, bytes, cudaMemcpyDefault) == cudaSuccess ? 0 : -1;
}

int main(void)
{
    int count = gpu_test_devices_or_skip();
    sx_memory mem = {dev_alloc, dev_free, dev_copy};
    if (sx_run_all(&mem, "quant:bits=8", "sortquant:bits=8,mode=sample", count))
        return fprintf(stderr, "%d failures\n", sx_failures), 1;
    return gpu_test_result();
}
