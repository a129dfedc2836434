/* The CUDA emulator's device side: what a kernel sees when a .cu file
 * (rewritten by translate.py) is compiled by the host's C++ compiler and
 * linked with the emulator's runtime (runtime.cc). Force-included first.
 *
 * Every CUDA thread is a fiber; the threads of a block take turns on one
 * OS thread and switch only at __syncthreads, the warp intrinsics and
 * grid.sync, so that a block's barriers and warp exchanges mean what they
 * mean on a GPU. A cooperative launch runs each block on its own OS thread
 * (grid.sync is then a barrier across them); other launches run their
 * blocks one after the other, last block first, on the calling thread.
 * Device memory is host memory the runtime registers (cudaMalloc).
 *
 * It checks logic, not speed or memory ordering: what the tests compare
 * (payloads byte for byte against the CPU codecs) comes out as the GPU's
 * would when the kernels are correct CUDA. Races within a warp that the
 * hardware's lock-step would hide, and timing, are outside it. Tests only. */
#ifndef EPIPE_TESTS_CUDAEMU_H
#define EPIPE_TESTS_CUDAEMU_H

/* The toolkit's headers in their host-compiler form (types, constants,
 * the runtime's declarations, which runtime.cc defines). */
#include <cuda_runtime.h>
#if __has_include(<cublas_v2.h>)
#include <cublas_v2.h>
#endif
#if __has_include(<cudnn.h>)
#include <cudnn.h>
#endif

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <tuple>
#include <type_traits>
#include <utility>

/* From here on the sources take their device paths (cuda_impl.h's device
 * helpers, EPIPE_HD's qualifiers); __CUDA_ARCH__ stays undefined so the
 * shared per-element functions take their host spelling, which the CPU
 * codecs use and which computes the same values. */
#define __CUDACC__ 1
#undef __shared__
/* one instance per OS thread: per block (blocks take turns on a thread, or
 * have a thread each in a cooperative launch) */
#define __shared__ static thread_local
#define __launch_bounds__(...)

/* For tests of error paths: the n-th CUDA call that can fail from now on
 * (an allocation, a copy, a set, a launch, a synchronisation) fails, once
 * (cudaErrorMemoryAllocation or cudaErrorLaunchFailure), or with `sticky`
 * it and every such call after it (cudaErrorIllegalAddress, as after a
 * kernel fault); n = 0 turns it off. The count of such calls since. */
extern "C" void cudaemu_fail_at(long n, int sticky);
extern "C" long cudaemu_fallible_calls(void);
/* The error the failed call of cudaemu_fail_at() returned (cudaSuccess
 * while none has failed since): an allocation's cudaErrorMemoryAllocation. */
extern "C" cudaError_t cudaemu_injected_error(void);
/* Copies made from one device's memory into another's, since the start,
 * where the destination's device had peer access to the source's enabled
 * (cudaDeviceEnablePeerAccess): those a GPU makes peer to peer. */
extern "C" unsigned long cudaemu_peer_copies(void);
/* Cooperative launches may fill only `sms` of the device's SMs (a context
 * given fewer than the device reports, as under MPS): bigger ones fail with
 * cudaErrorCooperativeLaunchTooLarge. 0 lifts the limit. */
extern "C" void cudaemu_limit_coop_sms(int sms);

namespace cudaemu
{
/* The running CUDA thread. */
struct thread_ctx {
    uint3 tid, bid;
    dim3 bdim, gdim;
    unsigned lane;
};
/* the running thread's, set by the runtime at every switch (initial-exec:
 * the runtime library is linked, never opened late) */
#define CUDAEMU_TLS_EXPORT __thread __attribute__((tls_model("initial-exec")))
extern CUDAEMU_TLS_EXPORT const thread_ctx *cudaemu_tl_ctx;
static inline const thread_ctx *self()
{
    return cudaemu_tl_ctx;
}
void syncthreads();
void grid_sync();
void *dynamic_shared();
/* A warp exchange: deposits v, waits for the lanes of mask that have not
 * exited, and returns the 32 deposits and which lanes made them. */
struct warp_view {
    uint64_t v[32];
    unsigned in;
};
const warp_view &warp_exchange(unsigned mask, uint64_t v);
static inline unsigned lane()
{
    return self()->lane;
}
} // namespace cudaemu

#define threadIdx (cudaemu::self()->tid)
#define blockIdx (cudaemu::self()->bid)
#define blockDim (cudaemu::self()->bdim)
#define gridDim (cudaemu::self()->gdim)
static const int warpSize = 32;

static inline void __syncthreads(void)
{
    cudaemu::syncthreads();
}
static inline void __syncwarp(unsigned mask = 0xffffffffu)
{
    cudaemu::warp_exchange(mask, 0);
}
static inline void __threadfence(void)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
static inline void __threadfence_block(void)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

/* ---- warp intrinsics ---------------------------------------------------- */

template <class T> static inline uint64_t cudaemu_bits(T v)
{
    static_assert(sizeof(T) <= 8, "a warp exchange carries at most 8 bytes");
    uint64_t u = 0;
    memcpy(&u, &v, sizeof v);
    return u;
}
template <class T> static inline T cudaemu_from_bits(uint64_t u)
{
    T v;
    memcpy(&v, &u, sizeof v);
    return v;
}
template <class T> static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32)
{
    const cudaemu::warp_view &w = cudaemu::warp_exchange(mask, cudaemu_bits(v));
    unsigned l = cudaemu::lane(), base = l & ~(unsigned)(width - 1);
    return cudaemu_from_bits<T>(w.v[base + ((unsigned)src & (unsigned)(width - 1))]);
}
template <class T> static inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32)
{
    const cudaemu::warp_view &w = cudaemu::warp_exchange(mask, cudaemu_bits(v));
    unsigned l = cudaemu::lane(), seg = l & (unsigned)(width - 1);
    return seg + d < (unsigned)width ? cudaemu_from_bits<T>(w.v[l + d]) : v;
}
template <class T> static inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32)
{
    const cudaemu::warp_view &w = cudaemu::warp_exchange(mask, cudaemu_bits(v));
    unsigned l = cudaemu::lane(), seg = l & (unsigned)(width - 1);
    return seg >= d ? cudaemu_from_bits<T>(w.v[l - d]) : v;
}
template <class T> static inline T __shfl_xor_sync(unsigned mask, T v, int x, int width = 32)
{
    const cudaemu::warp_view &w = cudaemu::warp_exchange(mask, cudaemu_bits(v));
    unsigned l = cudaemu::lane(), src = l ^ (unsigned)x;
    return (src & ~(unsigned)(width - 1)) == (l & ~(unsigned)(width - 1))
               ? cudaemu_from_bits<T>(w.v[src])
               : v;
}
static inline unsigned __ballot_sync(unsigned mask, int pred)
{
    const cudaemu::warp_view &w = cudaemu::warp_exchange(mask, pred != 0);
    unsigned b = 0;
    for (unsigned i = 0; i < 32; i++)
        if ((w.in >> i & 1u) && w.v[i])
            b |= 1u << i;
    return b;
}
static inline int __any_sync(unsigned mask, int pred)
{
    return __ballot_sync(mask, pred) != 0;
}
static inline int __all_sync(unsigned mask, int pred)
{
    const cudaemu::warp_view &w = cudaemu::warp_exchange(mask, pred != 0);
    for (unsigned i = 0; i < 32; i++)
        if ((w.in >> i & 1u) && !w.v[i])
            return 0;
    return 1;
}
template <class T> static inline unsigned __match_any_sync(unsigned mask, T v)
{
    const cudaemu::warp_view &w = cudaemu::warp_exchange(mask, cudaemu_bits(v));
    uint64_t mine = w.v[cudaemu::lane()];
    unsigned b = 0;
    for (unsigned i = 0; i < 32; i++)
        if ((w.in >> i & 1u) && w.v[i] == mine)
            b |= 1u << i;
    return b;
}

/* ---- bit and type intrinsics ------------------------------------------- */

static inline unsigned __float_as_uint(float f)
{
    return cudaemu_from_bits<unsigned>(cudaemu_bits(f));
}
static inline float __uint_as_float(unsigned u)
{
    return cudaemu_from_bits<float>(u);
}
static inline int __float_as_int(float f)
{
    return cudaemu_from_bits<int>(cudaemu_bits(f));
}
static inline float __int_as_float(int i)
{
    return cudaemu_from_bits<float>(cudaemu_bits(i));
}
static inline int __popc(unsigned u)
{
    return __builtin_popcount(u);
}
static inline int __popcll(unsigned long long u)
{
    return __builtin_popcountll(u);
}
static inline int __ffs(int i)
{
    return __builtin_ffs(i);
}
static inline int __ffsll(long long i)
{
    return __builtin_ffsll(i);
}
static inline int __clz(int i)
{
    return i ? __builtin_clz((unsigned)i) : 32;
}
static inline int __clzll(long long i)
{
    return i ? __builtin_clzll((unsigned long long)i) : 64;
}
static inline unsigned __brev(unsigned u)
{
    unsigned r = 0;
    for (int i = 0; i < 32; i++)
        r |= (u >> i & 1u) << (31 - i);
    return r;
}
template <class T> static inline T __ldg(const T *p)
{
    return *p;
}

/* ---- atomics: real ones (a cooperative launch's blocks run at once) ---- */

#define CUDAEMU_ATOMIC_INT(T)                                                                      \
    static inline T atomicAdd(T *p, T v)                                                           \
    {                                                                                              \
        return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);                                         \
    }                                                                                              \
    static inline T atomicSub(T *p, T v)                                                           \
    {                                                                                              \
        return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST);                                         \
    }                                                                                              \
    static inline T atomicOr(T *p, T v)                                                            \
    {                                                                                              \
        return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST);                                          \
    }                                                                                              \
    static inline T atomicAnd(T *p, T v)                                                           \
    {                                                                                              \
        return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST);                                         \
    }                                                                                              \
    static inline T atomicExch(T *p, T v)                                                          \
    {                                                                                              \
        return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);                                        \
    }                                                                                              \
    static inline T atomicCAS(T *p, T cmp, T v)                                                    \
    {                                                                                              \
        __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);        \
        return cmp;                                                                                \
    }                                                                                              \
    static inline T atomicMin(T *p, T v)                                                           \
    {                                                                                              \
        T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);                                              \
        while (v < old &&                                                                          \
               !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) \
            ;                                                                                      \
        return old;                                                                                \
    }                                                                                              \
    static inline T atomicMax(T *p, T v)                                                           \
    {                                                                                              \
        T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);                                              \
        while (v > old &&                                                                          \
               !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) \
            ;                                                                                      \
        return old;                                                                                \
    }
CUDAEMU_ATOMIC_INT(int)
CUDAEMU_ATOMIC_INT(unsigned)
CUDAEMU_ATOMIC_INT(long long)
CUDAEMU_ATOMIC_INT(unsigned long long)
#undef CUDAEMU_ATOMIC_INT

template <class F> static inline F cudaemu_atomic_add_float(F *p, F v)
{
    F old = *p, want;
    do
        want = old + v;
    while (!__atomic_compare_exchange(p, &old, &want, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    return old;
}
static inline float atomicAdd(float *p, float v)
{
    return cudaemu_atomic_add_float(p, v);
}
static inline double atomicAdd(double *p, double v)
{
    return cudaemu_atomic_add_float(p, v);
}

/* ---- launches ----------------------------------------------------------- */

/* kernel<<<grid, block, shared, stream>>>'s configuration */
struct cudaemu_cfg {
    dim3 grid, block;
    size_t shared;
    cudaStream_t stream;
    cudaemu_cfg(dim3 g, dim3 b, size_t sh = 0, cudaStream_t s = 0)
        : grid(g), block(b), shared(sh), stream(s)
    {
    }
};

namespace cudaemu
{
/* Runs body once per CUDA thread of the launch (runtime.cc); the status
 * a real launch would leave for cudaGetLastError. */
typedef void (*body_fn)(void *closure);
cudaError_t launch(const void *kernel, const cudaemu_cfg &cfg, int cooperative, body_fn body,
                   void *closure);
/* The launcher of a kernel known only by its address (a cooperative
 * launch's void *args). */
typedef cudaError_t (*invoker_fn)(const void *kernel, const cudaemu_cfg &cfg, void **args);
void register_kernel(const void *kernel, invoker_fn invoke);

template <class... P> struct call {
    void (*kernel)(P...);
    std::tuple<typename std::decay<P>::type...> args;
    static void body(void *closure)
    {
        call *c = (call *)closure;
        /* each thread gets its own copies of the parameters, as on a GPU */
        std::tuple<typename std::decay<P>::type...> mine = c->args;
        std::apply(c->kernel, mine);
    }
};

template <class... P, size_t... I>
static cudaError_t invoke_args(const void *kernel, const cudaemu_cfg &cfg, void **args,
                               std::index_sequence<I...>)
{
    call<P...> c = {(void (*)(P...))kernel, {*(typename std::decay<P>::type *)args[I]...}};
    return launch(kernel, cfg, 1, &call<P...>::body, &c);
}
template <class... P>
static cudaError_t invoke(const void *kernel, const cudaemu_cfg &cfg, void **args)
{
    return invoke_args<P...>(kernel, cfg, args, std::index_sequence_for<P...>());
}
} // namespace cudaemu

/* An argument as the kernel's parameter type, converted as a call would
 * (NULL, an integer here, becomes a null pointer). */
template <class T, class A> static inline T cudaemu_arg(A &&a)
{
    if constexpr (std::is_pointer<T>::value &&
                  std::is_integral<typename std::decay<A>::type>::value)
        return a ? (T)(uintptr_t)a : (T)0;
    else
        return a;
}

template <class... P, class... A>
static inline void cudaemu_launch(const cudaemu_cfg &cfg, void (*kernel)(P...), A &&...a)
{
    static_assert(sizeof...(P) == sizeof...(A), "a kernel launch with the wrong argument count");
    cudaemu::call<P...> c = {kernel, {cudaemu_arg<typename std::decay<P>::type>(a)...}};
    cudaemu::launch((const void *)kernel, cfg, 0, &cudaemu::call<P...>::body, &c);
}

/* (const void *)kernel, registered so that cudaLaunchCooperativeKernel can
 * call it with its void *args. */
template <class... P> static inline const void *cudaemu_kernel_ptr(void (*kernel)(P...))
{
    cudaemu::register_kernel((const void *)kernel, &cudaemu::invoke<P...>);
    return (const void *)kernel;
}

/* cuda_runtime.h's kernel-typed overload (it has it for nvcc only) */
template <class... P>
static inline cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr,
                                               int value)
{
    return cudaFuncSetAttribute((const void *)kernel, attr, value);
}

static inline void *cudaemu_dynamic_shared(void)
{
    return cudaemu::dynamic_shared();
}

#endif
