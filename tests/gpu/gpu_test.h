/* What the gpu suite's programs share: a CHECK that counts failures and
 * goes on, CUDA_OK for set-up calls, and the skip (exit 77, meson's
 * protocol, with the reason) where no CUDA device is usable. */
#ifndef EPIPE_TESTS_GPU_TEST_H
#define EPIPE_TESTS_GPU_TEST_H

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static int gpu_test_failures;
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                        \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
            __atomic_add_fetch(&gpu_test_failures, 1, __ATOMIC_RELAXED);                           \
        }                                                                                          \
    } while (0)
#define CUDA_OK(e)                                                                                 \
    do {                                                                                           \
        cudaError_t err_ = (e);                                                                    \
        if (err_ != cudaSuccess) {                                                                 \
            fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(err_));     \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* The device count; exits 77 with the reason when there is none. */
static inline int gpu_test_devices_or_skip(void)
{
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
        printf("SKIP: no CUDA device: %s\n",
               e != cudaSuccess ? cudaGetErrorString(e) : "the driver reports 0 devices");
        exit(77);
    }
    return count;
}

/* A progress line: the part that starts, at seconds since the first part
 * started, so that a run its time limit cut off shows where the time went. */
static inline void gpu_test_part(const char *name)
{
    static struct timespec t0;
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    if (!t0.tv_sec && !t0.tv_nsec)
        t0 = t;
    printf("[%7.1f s] %s\n", (double)(t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9, name);
    fflush(stdout);
}

/* The program's exit status: 1 after any failure. */
static inline int gpu_test_result(void)
{
    if (gpu_test_failures) {
        fprintf(stderr, "%d failures\n", gpu_test_failures);
        return 1;
    }
    printf("ok\n");
    return 0;
}

#endif
