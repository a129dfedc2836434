/* The CUDA emulator's CUB: one header for the parts the kernels use. */
#include "cudaemu_cub.h"
