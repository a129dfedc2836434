/* The CUDA emulator's CUB (tests/cudaemu/include/cudaemu.h): the block
 * scan and reduction and the device radix sort and selection the kernels
 * call, with CUB's documented results (a stable sort; floats ordered by
 * their bits with -0.0 and +0.0 equal; a selection that keeps the input's
 * order). Plain loops: what they must compute, not how CUB computes it. */
#ifndef EPIPE_TESTS_CUDAEMU_CUB_H
#define EPIPE_TESTS_CUDAEMU_CUB_H

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

namespace cub
{

enum BlockScanAlgorithm { BLOCK_SCAN_RAKING, BLOCK_SCAN_RAKING_MEMOIZE, BLOCK_SCAN_WARP_SCANS };
enum BlockReduceAlgorithm {
    BLOCK_REDUCE_RAKING,
    BLOCK_REDUCE_RAKING_COMMUTATIVE_ONLY,
    BLOCK_REDUCE_WARP_REDUCTIONS
};

static inline unsigned cudaemu_linear_tid()
{
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

template <class T, int BLOCK_DIM_X, BlockScanAlgorithm ALGORITHM = BLOCK_SCAN_RAKING,
          int BLOCK_DIM_Y = 1, int BLOCK_DIM_Z = 1, int ARCH = 0>
class BlockScan
{
  public:
    enum { THREADS = BLOCK_DIM_X * BLOCK_DIM_Y * BLOCK_DIM_Z };
    struct TempStorage {
        T v[THREADS];
        T total;
    };
    explicit BlockScan(TempStorage &s) : s_(s)
    {
    }
    void ExclusiveSum(T in, T &out)
    {
        T total;
        ExclusiveSum(in, out, total);
    }
    void ExclusiveSum(T in, T &out, T &aggregate)
    {
        Scan(in, out, aggregate, 0);
    }
    void InclusiveSum(T in, T &out)
    {
        T total;
        Scan(in, out, total, 1);
    }
    void InclusiveSum(T in, T &out, T &aggregate)
    {
        Scan(in, out, aggregate, 1);
    }

  private:
    void Scan(T in, T &out, T &aggregate, int inclusive)
    {
        unsigned t = cudaemu_linear_tid();
        s_.v[t] = in;
        __syncthreads();
        if (t == 0) {
            T run = T();
            for (unsigned i = 0; i < THREADS; i++) {
                T x = s_.v[i];
                s_.v[i] = inclusive ? run + x : run;
                run = run + x;
            }
            s_.total = run;
        }
        __syncthreads();
        out = s_.v[t];
        aggregate = s_.total;
        __syncthreads(); /* the storage free for the next call */
    }
    TempStorage &s_;
};

/* The sum is a scan's aggregate. */
template <class T, int BLOCK_DIM_X, BlockReduceAlgorithm ALGORITHM = BLOCK_REDUCE_WARP_REDUCTIONS,
          int BLOCK_DIM_Y = 1, int BLOCK_DIM_Z = 1, int ARCH = 0>
class BlockReduce
{
    typedef BlockScan<T, BLOCK_DIM_X, BLOCK_SCAN_RAKING, BLOCK_DIM_Y, BLOCK_DIM_Z> scan_t;

  public:
    typedef typename scan_t::TempStorage TempStorage;
    explicit BlockReduce(TempStorage &s) : s_(s)
    {
    }
    /* valid in thread 0 (here in every thread, which CUB does not promise) */
    T Sum(T in)
    {
        T before, total;
        scan_t(s_).ExclusiveSum(in, before, total);
        return total;
    }

  private:
    TempStorage &s_;
};

/* ---- device-wide calls: synchronous loops on the host ------------------ */

template <class K> static inline uint64_t cudaemu_radix_key(K k)
{
    if constexpr (std::is_same<K, float>::value) {
        uint32_t u;
        memcpy(&u, &k, 4);
        if (u == 0x80000000u)
            u = 0; /* -0.0 sorts as +0.0 */
        return u & 0x80000000u ? ~u : u | 0x80000000u;
    } else if constexpr (std::is_same<K, double>::value) {
        uint64_t u;
        memcpy(&u, &k, 8);
        if (u == 0x8000000000000000ull)
            u = 0;
        return u & 0x8000000000000000ull ? ~u : u | 0x8000000000000000ull;
    } else if constexpr (std::is_signed<K>::value) {
        return (uint64_t)(typename std::make_unsigned<K>::type)k ^
               ((uint64_t)1 << (sizeof(K) * 8 - 1));
    } else {
        return (uint64_t)k;
    }
}

/* CUB's two calls: the first (temp NULL) asks the scratch size, which is
 * answered, *sized set; the second must give that much. */
static const size_t cudaemu_temp_bytes = 64;
template <class N>
static inline cudaError_t cudaemu_temp(const void *temp, size_t &temp_bytes, N num_items,
                                       bool *sized)
{
    *sized = !temp;
    if (!temp) {
        temp_bytes = cudaemu_temp_bytes;
        return cudaSuccess;
    }
    return temp_bytes < cudaemu_temp_bytes || num_items < 0 ? cudaErrorInvalidValue : cudaSuccess;
}

struct DeviceRadixSort {
    template <class K, class V, class N>
    static cudaError_t SortPairs(void *temp, size_t &temp_bytes, const K *keys_in, K *keys_out,
                                 const V *values_in, V *values_out, N num_items, int begin_bit = 0,
                                 int end_bit = sizeof(K) * 8, cudaStream_t stream = 0)
    {
        (void)stream;
        bool sized;
        cudaError_t e = cudaemu_temp(temp, temp_bytes, num_items, &sized);
        if (sized || e != cudaSuccess)
            return e;
        size_t n = (size_t)num_items;
        uint64_t mask = end_bit - begin_bit >= 64 ? ~0ull : ((1ull << (end_bit - begin_bit)) - 1);
        std::vector<size_t> order(n);
        for (size_t i = 0; i < n; i++)
            order[i] = i;
        std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
            return (cudaemu_radix_key(keys_in[a]) >> begin_bit & mask) <
                   (cudaemu_radix_key(keys_in[b]) >> begin_bit & mask);
        });
        std::vector<K> ks(n);
        std::vector<V> vs(values_in ? n : 0);
        for (size_t i = 0; i < n; i++) {
            ks[i] = keys_in[order[i]];
            if (values_in)
                vs[i] = values_in[order[i]];
        }
        std::copy(ks.begin(), ks.end(), keys_out);
        if (values_in)
            std::copy(vs.begin(), vs.end(), values_out);
        return cudaSuccess;
    }
    template <class K, class N>
    static cudaError_t SortKeys(void *temp, size_t &temp_bytes, const K *keys_in, K *keys_out,
                                N num_items, int begin_bit = 0, int end_bit = sizeof(K) * 8,
                                cudaStream_t stream = 0)
    {
        return SortPairs(temp, temp_bytes, keys_in, keys_out, (const char *)NULL, (char *)NULL,
                         num_items, begin_bit, end_bit, stream);
    }
};

struct DeviceSelect {
    template <class In, class Out, class Count, class N, class Op>
    static cudaError_t If(void *temp, size_t &temp_bytes, In in, Out out, Count num_selected,
                          N num_items, Op select_op, cudaStream_t stream = 0)
    {
        (void)stream;
        bool sized;
        cudaError_t e = cudaemu_temp(temp, temp_bytes, num_items, &sized);
        if (sized || e != cudaSuccess)
            return e;
        size_t k = 0;
        for (size_t i = 0; i < (size_t)num_items; i++)
            if (select_op(in[i]))
                out[k++] = in[i];
        *num_selected = k;
        return cudaSuccess;
    }
};

} // namespace cub

#endif
