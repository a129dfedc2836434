/* The CUDA emulator's own tests (tests/cudaemu/): what the gpu suite's run
 * under it relies on. Warp intrinsics, barriers, block scans and grid.sync
 * compute what CUDA defines; bad launches, copies and sets are refused as
 * the emulator's header says; a kernel that writes past its allocation or
 * deadlocks dies with a report (in a child process); the execution order
 * exposes a missing barrier and a kernel that counts on block 0 first.
 * Written as CUDA, so that nvcc compiles it as well (it is built only for
 * the emulator). */
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cooperative_groups.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpu_test.h"

namespace cg = cooperative_groups;

/* out[t * 8 + i]: intrinsic i as lane t of a 64-thread block sees it */
__global__ void warp_ops(unsigned *out)
{
    unsigned t = threadIdx.x, lane = t & 31;
    unsigned *o = out + t * 8;
    o[0] = __shfl_down_sync(0xffffffffu, t * 10, 3);
    o[1] = __shfl_xor_sync(0xffffffffu, t, 5);
    o[2] = __shfl_sync(0xffffffffu, t, 7);
    o[3] = __ballot_sync(0xffffffffu, lane % 3 == 0);
    o[4] = __any_sync(0xffffffffu, lane == 31 && t < 32);
    o[5] = __all_sync(0xffffffffu, lane < 40);
    o[6] = __match_any_sync(0xffffffffu, lane / 4);
    o[7] = __shfl_down_sync(0xffffffffu, t, 1, 8); /* segments of 8 */
}

static void test_warp_ops(void)
{
    unsigned *d, h[64 * 8];
    CUDA_OK(cudaMalloc((void **)&d, sizeof h));
    warp_ops<<<1, 64>>>(d);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
    for (unsigned t = 0; t < 64; t++) {
        unsigned lane = t & 31, base = t & ~31u, *o = h + t * 8, ballot = 0;
        for (unsigned l = 0; l < 32; l++)
            ballot |= (l % 3 == 0) << l;
        CHECK(o[0] == (lane + 3 < 32 ? (t + 3) * 10 : t * 10), "shfl_down, lane %u", t);
        CHECK(o[1] == (base | (lane ^ 5)), "shfl_xor, lane %u", t);
        CHECK(o[2] == base + 7, "shfl, lane %u", t);
        CHECK(o[3] == ballot, "ballot, lane %u: %#x", t, o[3]);
        CHECK(o[4] == (t < 32), "any, lane %u", t);
        CHECK(o[5] == 1, "all, lane %u", t);
        CHECK(o[6] == 0xfu << (lane / 4 * 4), "match_any, lane %u: %#x", t, o[6]);
        CHECK(o[7] == ((lane & 7) + 1 < 8 ? t + 1 : t), "shfl_down width 8, lane %u", t);
    }
    CUDA_OK(cudaFree(d));
}

/* Each thread writes its slot, meets the others, reads its neighbour's;
 * then a block-wide exclusive scan and sum of tid + 1. */
__global__ void barrier_scan(unsigned *out)
{
    __shared__ unsigned s[256];
    __shared__ cub::BlockScan<unsigned, 256>::TempStorage scan;
    __shared__ cub::BlockReduce<unsigned, 256>::TempStorage red;
    unsigned t = threadIdx.x, before, total;
    s[t] = t * t;
    __syncthreads();
    out[t] = s[(t + 1) % 256];
    cub::BlockScan<unsigned, 256>(scan).ExclusiveSum(t + 1, before, total);
    out[256 + t] = before;
    unsigned sum = cub::BlockReduce<unsigned, 256>(red).Sum(t + 1);
    if (t == 0)
        out[512] = sum, out[513] = total;
}

static void test_barrier_scan(void)
{
    unsigned *d, h[514];
    CUDA_OK(cudaMalloc((void **)&d, sizeof h));
    barrier_scan<<<1, 256>>>(d);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
    for (unsigned t = 0; t < 256; t++) {
        CHECK(h[t] == (t + 1) % 256 * ((t + 1) % 256), "neighbour's slot, thread %u", t);
        CHECK(h[256 + t] == t * (t + 1) / 2, "exclusive scan, thread %u: %u", t, h[256 + t]);
    }
    CHECK(h[512] == 256 * 257 / 2 && h[513] == 256 * 257 / 2, "sum %u, aggregate %u", h[512],
          h[513]);
    CUDA_OK(cudaFree(d));
}

/* Every block adds its id + 1, the grid meets, every thread reads the total. */
__global__ void grid_meet(unsigned *sum, unsigned *seen)
{
    cg::grid_group grid = cg::this_grid();
    if (threadIdx.x == 0)
        atomicAdd(sum, blockIdx.x + 1);
    grid.sync();
    seen[blockIdx.x * blockDim.x + threadIdx.x] = *(volatile unsigned *)sum;
}

static void test_grid_sync(void)
{
    int blocks = 0, per = 0, sms = 0;
    CUDA_OK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, (const void *)grid_meet, 64, 0));
    CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    blocks = per * sms;
    CHECK(blocks > 1, "a cooperative launch of %d blocks", blocks);
    unsigned *sum, *seen, zero = 0;
    CUDA_OK(cudaMalloc((void **)&sum, 4));
    CUDA_OK(cudaMalloc((void **)&seen, 4 * 64 * (size_t)blocks));
    CUDA_OK(cudaMemcpy(sum, &zero, 4, cudaMemcpyHostToDevice));
    void *args[] = {(void *)&sum, (void *)&seen};
    CUDA_OK(cudaLaunchCooperativeKernel((const void *)grid_meet, blocks, 64, args, 0, 0));
    unsigned *h = (unsigned *)malloc(4 * 64 * (size_t)blocks);
    CUDA_OK(cudaMemcpy(h, seen, 4 * 64 * (size_t)blocks, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 64 * blocks; i++)
        CHECK(h[i] == (unsigned)(blocks * (blocks + 1) / 2), "thread %d saw %u", i, h[i]);
    /* more blocks than can be resident at once: refused, as by the driver */
    CHECK(cudaLaunchCooperativeKernel((const void *)grid_meet, blocks + 1, 64, args, 0, 0) ==
              cudaErrorCooperativeLaunchTooLarge,
          "too large a cooperative launch");
    cudaGetLastError();
    free(h);
    CUDA_OK(cudaFree(sum));
    CUDA_OK(cudaFree(seen));
}

__global__ void nothing(unsigned *p)
{
    if (p)
        p[0] = 1;
}

__global__ void big_shared(unsigned *p)
{
    extern __shared__ unsigned dyn[];
    dyn[threadIdx.x] = threadIdx.x;
    __syncthreads();
    if (threadIdx.x == 0)
        p[0] = dyn[blockDim.x - 1];
}

static void test_bad_launches(void)
{
    nothing<<<0, 32>>>(NULL);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "0 blocks");
    nothing<<<1, 1025>>>(NULL);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "1025 threads");
    nothing<<<dim3(1, 65536), 32>>>(NULL);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "grid y of 65536");
    CHECK(cudaGetLastError() == cudaSuccess, "cudaGetLastError clears");
    unsigned *d, h = 0;
    CUDA_OK(cudaMalloc((void **)&d, 4));
    big_shared<<<1, 256, 64 * 1024>>>(d);
    CHECK(cudaGetLastError() == cudaErrorInvalidValue, "64 KiB of dynamic shared memory unasked");
    CUDA_OK(cudaFuncSetAttribute(big_shared, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 64 * 1024));
    big_shared<<<1, 256, 64 * 1024>>>(d);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(&h, d, 4, cudaMemcpyDeviceToHost));
    CHECK(h == 255, "dynamic shared memory after the attribute: %u", h);
    CUDA_OK(cudaFree(d));
}

static void test_bad_copies(void)
{
    unsigned char *d, host[64], *pin;
    CUDA_OK(cudaMalloc((void **)&d, 32));
    CUDA_OK(cudaHostAlloc((void **)&pin, 32, cudaHostAllocDefault));
    CHECK(cudaMemcpy(d, host, 33, cudaMemcpyHostToDevice) == cudaErrorInvalidValue,
          "a copy past the device block");
    CHECK(cudaMemcpy(host, host + 32, 8, cudaMemcpyHostToDevice) == cudaErrorInvalidValue,
          "host memory named as the device side");
    CHECK(cudaMemcpy(d, pin, 8, cudaMemcpyDeviceToDevice) == cudaErrorInvalidValue,
          "pinned memory named as the device side");
    CHECK(cudaMemcpy(host, d, 8, cudaMemcpyHostToHost) == cudaErrorInvalidValue,
          "device memory named as the host side");
    CHECK(cudaMemset(d + 16, 0, 17) == cudaErrorInvalidValue, "a memset past the block");
    CHECK(cudaMemcpy(pin, d, 32, cudaMemcpyDefault) == cudaSuccess, "a good copy");
    for (int i = 0; i < 32; i++)
        CHECK(pin[i] == 0xcd, "fresh device memory is garbage: byte %d is %#x", i, pin[i]);
    CHECK(cudaFree(pin) == cudaErrorInvalidValue, "cudaFree of pinned memory");
    cudaGetLastError();
    CUDA_OK(cudaFreeHost(pin));
    CUDA_OK(cudaFree(d));
}

/* An asynchronous copy from the device into pinned memory lands at the next
 * wait (poison until then), one into pageable memory at once; a copy that
 * reads host memory, and the device's own later work, see what it brought. */
static void test_late_copies(void)
{
    unsigned char *d, *d2, *pin, *pin2, page[16];
    cudaStream_t s, other;
    CUDA_OK(cudaMalloc((void **)&d, 16));
    CUDA_OK(cudaMalloc((void **)&d2, 16));
    CUDA_OK(cudaHostAlloc((void **)&pin, 16, cudaHostAllocDefault));
    CUDA_OK(cudaHostAlloc((void **)&pin2, 16, cudaHostAllocDefault));
    CUDA_OK(cudaStreamCreate(&s));
    CUDA_OK(cudaStreamCreate(&other));
    CUDA_OK(cudaMemset(d, 7, 16));
    CUDA_OK(cudaMemcpyAsync(pin, d, 16, cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaMemset(d, 9, 16)); /* after the copy in stream order: not what it reads */
    CHECK(pin[0] == 0xee && pin[15] == 0xee, "pinned bytes before a wait: %#x", pin[0]);
    CUDA_OK(cudaStreamSynchronize(other));
    CHECK(pin[0] == 0xee, "another stream's wait delivered the copy");
    CUDA_OK(cudaStreamSynchronize(s));
    CHECK(pin[0] == 7 && pin[15] == 7, "pinned bytes after the wait: %u", pin[0]);
    CUDA_OK(cudaMemcpyAsync(page, d, 16, cudaMemcpyDeviceToHost, s));
    CHECK(page[0] == 9, "pageable bytes land at once: %u", page[0]);
    /* a copy out of the pinned buffer reads what the pending copy brings */
    CUDA_OK(cudaMemcpyAsync(pin2, d, 16, cudaMemcpyDefault, s));
    CUDA_OK(cudaMemcpyAsync(d2, pin2, 16, cudaMemcpyHostToDevice, s));
    CUDA_OK(cudaMemcpy(page, d2, 16, cudaMemcpyDeviceToHost));
    CHECK(page[0] == 9, "a copy from pinned memory after a pending one: %u", page[0]);
    /* an event, the device, a query and the frees wait too */
    CUDA_OK(cudaMemset(d, 3, 16));
    cudaEvent_t e;
    CUDA_OK(cudaEventCreate(&e));
    CUDA_OK(cudaMemcpyAsync(pin, d, 16, cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaEventRecord(e, s));
    CUDA_OK(cudaEventSynchronize(e));
    CHECK(pin[0] == 3, "after an event's wait: %u", pin[0]);
    CUDA_OK(cudaMemcpyAsync(pin, d2, 16, cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaDeviceSynchronize());
    CHECK(pin[0] == 9, "after the device's wait: %u", pin[0]);
    CUDA_OK(cudaMemcpyAsync(pin, d, 16, cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamQuery(s) == cudaSuccess && pin[0] == 3, "after a query that says done");
    CUDA_OK(cudaMemcpyAsync(pin2, d, 16, cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaFreeHost(pin2)); /* it waits: the copy lands before the memory goes */
    CUDA_OK(cudaEventDestroy(e));
    CUDA_OK(cudaStreamDestroy(s));
    CUDA_OK(cudaStreamDestroy(other));
    CUDA_OK(cudaFreeHost(pin));
    CUDA_OK(cudaFree(d));
    CUDA_OK(cudaFree(d2));
}

/* A copy from pinned memory to the device may read its source until the
 * next wait: the host writing it before one is reported (and aborts), in a
 * child; writing it after the wait is not. */
static void test_pinned_source_written(void)
{
    unsigned char *d, *pin;
    CUDA_OK(cudaMalloc((void **)&d, 64));
    CUDA_OK(cudaHostAlloc((void **)&pin, 64, cudaHostAllocDefault));
    memset(pin, 1, 64);
    CUDA_OK(cudaMemcpyAsync(d, pin, 64, cudaMemcpyHostToDevice, 0));
    CUDA_OK(cudaStreamSynchronize(0));
    memset(pin, 2, 64); /* after the wait: fine */
    CUDA_OK(cudaStreamSynchronize(0));
    fflush(NULL);
    pid_t p = fork();
    if (p == 0) {
        cudaMemcpyAsync(d, pin, 64, cudaMemcpyHostToDevice, 0);
        pin[63] = 3; /* before the wait */
        cudaStreamSynchronize(0);
        _exit(0);
    }
    int status = 0;
    CHECK(p > 0 && waitpid(p, &status, 0) == p, "fork");
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT,
          "a pinned source written before the wait was not reported (status %#x)", status);
    CUDA_OK(cudaFreeHost(pin));
    CUDA_OK(cudaFree(d));
}

/* Blocks take tickets in the order they run. */
__global__ void tickets(unsigned *next, unsigned *ticket)
{
    if (threadIdx.x == 0)
        ticket[blockIdx.x] = atomicAdd(next, 1u);
}

/* Thread 0 sets a value the others read with no barrier between: a race
 * on a GPU, which the emulator's order makes visible. */
__global__ void racy(unsigned *out)
{
    __shared__ unsigned v;
    if (threadIdx.x == 0)
        v = 0;
    __syncthreads();
    if (threadIdx.x == 0)
        v = 7;
    out[threadIdx.x] = v; /* a __syncthreads is missing above */
}

static void test_order(void)
{
    unsigned *d, h[128], zero = 0;
    CUDA_OK(cudaMalloc((void **)&d, sizeof h));
    CUDA_OK(cudaMemcpy(d, &zero, 4, cudaMemcpyHostToDevice));
    tickets<<<5, 32>>>(d, d + 1);
    CUDA_OK(cudaMemcpy(h, d, 6 * 4, cudaMemcpyDeviceToHost));
    CHECK(h[1 + 4] == 0 && h[1 + 0] == 4, "the last block runs first: tickets %u .. %u", h[1],
          h[5]);
    racy<<<1, 128>>>(d);
    CUDA_OK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
    int stale = 0, fresh = 0;
    for (int t = 0; t < 128; t++)
        stale += h[t] == 0, fresh += h[t] == 7;
    CHECK(stale > 0 && fresh > 0, "the missing barrier shows: %d threads read before the write, "
                                  "%d after", stale, fresh);
    CUDA_OK(cudaFree(d));
}

/* A kernel that writes one element past its block, and one whose threads
 * wait at a barrier that thread 0 never reaches. */
__global__ void overrun(unsigned *p, int n)
{
    if (threadIdx.x == 0)
        p[n] = 1;
}

__global__ void deadlock(unsigned *p)
{
    if (threadIdx.x == 0)
        p[0] = __shfl_sync(0xffffffffu, 1u, 0);
    else
        __syncthreads();
}

/* Runs fn in a child; 1 when it died of sig (or, under a sanitizer that
 * catches the signal, exited with `caught` in its report) with `want` on
 * stderr. */
static int dies(void (*fn)(void), int sig, const char *caught, const char *want)
{
    int fds[2];
    if (pipe(fds))
        return 0;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        fn();
        _exit(0);
    }
    close(fds[1]);
    char buf[4096] = "";
    size_t got = 0;
    ssize_t r;
    while (got + 1 < sizeof buf && (r = read(fds[0], buf + got, sizeof buf - 1 - got)) > 0)
        got += (size_t)r;
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    int died = (WIFSIGNALED(status) && WTERMSIG(status) == sig) ||
               (WIFEXITED(status) && WEXITSTATUS(status) && caught && strstr(buf, caught));
    return died && (!want || strstr(buf, want));
}

static void run_overrun(void)
{
    unsigned *d;
    CUDA_OK(cudaMalloc((void **)&d, 4096));
    overrun<<<1, 32>>>(d, 1024);
}

static void run_deadlock(void)
{
    unsigned *d;
    CUDA_OK(cudaMalloc((void **)&d, 4));
    deadlock<<<1, 64>>>(d);
}

int main(void)
{
    gpu_test_devices_or_skip();
    test_warp_ops();
    test_barrier_scan();
    test_grid_sync();
    test_bad_launches();
    test_bad_copies();
    test_late_copies();
    test_pinned_source_written();
    test_order();
    CHECK(dies(run_overrun, SIGSEGV, "SEGV", NULL), "a write past the block faults");
    CHECK(dies(run_deadlock, SIGABRT, NULL, "wait for each other"), "a deadlock is reported");
    return gpu_test_result();
}
