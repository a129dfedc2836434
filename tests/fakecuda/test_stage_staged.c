/* Stages with CUDA tensors on any machine, through the test CUDA module
 * (fakecuda.c: no kernels, device memory the host cannot touch): the
 * exchange of tests/support/stage_exchange.h with codecs that go through
 * host staging, so the stage runtime's device buffers, lent tensors and
 * copies are checked here as tests/gpu/test_gpu_stage.cu checks them on a
 * GPU; then that the stage's CUDA stream reaches every staging copy. */
#include <dlfcn.h>
#include <stdint.h>

#include "stage_exchange.h"

static void *(*last_stream)(unsigned long *);

int main(void)
{
    const char *path = getenv("EPIPE_CUDA_MODULE");
    void *so = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
    sx_memory mem = {0};
    if (so) {
        *(void **)&mem.alloc = dlsym(so, "fakecuda_alloc");
        *(void **)&mem.free = dlsym(so, "fakecuda_free");
        *(void **)&mem.copy = dlsym(so, "fakecuda_copy");
        *(void **)&last_stream = dlsym(so, "fakecuda_last_stream");
    }
    if (!mem.alloc || !mem.free || !mem.copy || !last_stream) {
        fprintf(stderr, "EPIPE_CUDA_MODULE must name the test module (fakecuda)\n");
        return 1;
    }
    /* The test module has one device and stages every codec. */
    const char *act = "quant:bits=8", *grad = "sortquant:bits=8,mode=sample";
    sx_run_all(&mem, act, grad, 1);

    void *stream = (void *)(uintptr_t)0xbeef;
    unsigned long before = 0, after = 0;
    SX_CHECK(last_stream(&before) != stream, "the stream was not used yet");
    epipe_comm *c[2];
    if (epipe_comm_create_inproc(c, 2) != EPIPE_OK)
        return fprintf(stderr, "inproc: %s\n", epipe_last_error()), 1;
    sx_run_pair(&mem, c[0], c[1], "1f1b", act, grad, 1, stream);
    SX_CHECK(last_stream(&after) == stream, "the last staging copy was not on the stage's stream");
    SX_CHECK(after > before, "no staging copies");
    epipe_comm_destroy(c[0]);
    epipe_comm_destroy(c[1]);
    /* and the hand-over between two chunks of one rank (ZB-V) */
    void *v_stream = (void *)(uintptr_t)0xfeed;
    sx_run_v(&mem, v_stream);
    SX_CHECK(last_stream(NULL) == v_stream, "the ZB-V copies were not on the stage's stream");
    if (sx_failures)
        return fprintf(stderr, "%d failures\n", sx_failures), 1;
    printf("ok\n");
    return 0;
}
