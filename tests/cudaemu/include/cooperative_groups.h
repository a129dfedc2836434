/* The CUDA emulator's cooperative groups: the grid of a cooperative launch
 * (tests/cudaemu/include/cudaemu.h). */
#ifndef EPIPE_TESTS_CUDAEMU_COOPERATIVE_GROUPS_H
#define EPIPE_TESTS_CUDAEMU_COOPERATIVE_GROUPS_H

namespace cooperative_groups
{
struct grid_group {
    void sync() const
    {
        cudaemu::grid_sync();
    }
    unsigned long long size() const
    {
        return (unsigned long long)gridDim.x * gridDim.y * gridDim.z * blockDim.x * blockDim.y *
               blockDim.z;
    }
    unsigned long long thread_rank() const
    {
        unsigned long long b = blockIdx.x +
                               (unsigned long long)gridDim.x *
                                   (blockIdx.y + (unsigned long long)gridDim.y * blockIdx.z);
        return b * blockDim.x * blockDim.y * blockDim.z + threadIdx.x +
               blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    }
};
static inline grid_group this_grid()
{
    return grid_group();
}
} // namespace cooperative_groups

#endif
