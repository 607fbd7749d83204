#pragma once
// SyncBatchNorm's kernels: per-channel Welford statistics, their parallel
// combination over ranks, the forward normalisation, the backward reduction
// and the backward element-wise pass. Plain C++ over raw pointers; the CPU
// twins (…Cpu) are the reference the CUDA kernels (…Cuda) are tested against
// and what the worker runs on machines without a GPU.
//
// Note [Activation layout]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// An activation with C channels is addressed as [outer][C][inner]: element
// (o, c, i) lives at (o * C + c) * inner + i. A contiguous (N, C, *) tensor is
// outer = N, inner = prod(*); a channels-last one (N, *, C) is
// outer = N * prod(*), inner = 1. The CUDA kernels pick a channels-last
// strategy (a warp along 32 channels) when inner == 1. Every per-channel
// statistic is float32, whatever the activation's dtype; counts are per channel
// and the same for every channel (outer * inner).
//
// Note [Gathered statistics]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each rank contributes one row of StatsRowSize(C) = 2C + 1 floats:
// mean[0..C), m2[0..C) (sum of squared deviations from the mean), count.
// Rows are stacked by rank (what one allgather produces). A row with count 0
// (a rank with an empty batch) takes no part in the combination. Counts are
// floats: exact up to 2^24 elements per channel and rank.

#include <cstdint>

#include "kernels/dtype.h"

namespace concord::kernels {

struct ActivationShape {
  int64_t outer = 0;
  int64_t channels = 0;
  int64_t inner = 1;
  int64_t numel() const { return outer * channels * inner; }
  int64_t per_channel() const { return outer * inner; }
};

inline int64_t StatsRowSize(int64_t channels) { return 2 * channels + 1; }

// ---- CPU twins (host memory; accumulate in double) --------------------------

// Fills one stats row (see Note [Gathered statistics]) for `x`: per-channel
// mean and m2 by Welford's algorithm, and count = shape.per_channel(). An empty
// activation gives zeros.
void WelfordStatsCpu(const void* x, DType dtype, const ActivationShape& shape,
                     float* stats_row);

// Combines `ranks` stats rows by Chan's parallel Welford update, weighted by
// count. Writes per channel: mean, invstd = 1 / sqrt(var_biased + eps) and
// var_unbiased = m2 / (count - 1) (NaN when count <= 1); and the total count
// to `*total_count`. A total count of 0 gives mean 0, var 0.
void WelfordCombineCpu(const float* gathered, int64_t ranks, int64_t channels,
                       float eps, float* mean, float* invstd,
                       float* var_unbiased, float* total_count);

// y = (x - mean) * invstd * weight + bias, y in `dtype` like x. `weight` and
// `bias` may be null (1 and 0).
void BatchNormForwardCpu(const void* x, DType dtype,
                         const ActivationShape& shape, const float* mean,
                         const float* invstd, const float* weight,
                         const float* bias, void* y);

// Per channel: sum_dy = Σ dy, sum_dy_xmu = Σ dy * (x - mean) over this rank's
// elements, written to reduced[0..C) and reduced[C..2C) (one buffer, so that
// one allreduce sums both).
void BackwardReduceCpu(const void* dy, const void* x, DType dtype,
                       const ActivationShape& shape, const float* mean,
                       float* reduced);

// dx = (dy - sum_dy / N - (x - mean) * invstd^2 * sum_dy_xmu / N)
//      * invstd * weight,
// with the global sums `reduced` (as BackwardReduce lays them out) and the
// global count N = total_count > 0. `weight` may be null (1).
void BackwardElementwiseCpu(const void* dy, const void* x, DType dtype,
                            const ActivationShape& shape, const float* mean,
                            const float* invstd, const float* weight,
                            const float* reduced, float total_count, void* dx);

#if defined(CONCORD_KERNELS_CUDA)
}  // namespace concord::kernels
#include <cuda_runtime_api.h>
namespace concord::kernels {
// ---- CUDA kernels: the same contracts, device pointers, enqueued on
// `stream`; accumulation in float. They return the launch error, if any.
// BackwardElementwiseCuda reads the total count from device memory (what
// WelfordCombineCuda wrote), so that no host ever waits for it.
//
// WelfordStatsCuda and BackwardReduceCuda split each channel's elements over
// many blocks and merge the parts in a fixed order (see Note [Split reductions]
// in syncbn.cu): they need `scratch`, SyncBnScratchFloats(shape) floats of
// device memory that nothing else uses until the kernels are done (memory
// from LibTorch's caching allocator on the same stream will do). The result
// depends on the shape and the input only, not on the device.
int64_t SyncBnScratchFloats(const ActivationShape& shape);
cudaError_t WelfordStatsCuda(const void* x, DType dtype,
                             const ActivationShape& shape, float* stats_row,
                             float* scratch, cudaStream_t stream);
cudaError_t WelfordCombineCuda(const float* gathered, int64_t ranks,
                               int64_t channels, float eps, float* mean,
                               float* invstd, float* var_unbiased,
                               float* total_count, cudaStream_t stream);
cudaError_t BatchNormForwardCuda(const void* x, DType dtype,
                                 const ActivationShape& shape,
                                 const float* mean, const float* invstd,
                                 const float* weight, const float* bias,
                                 void* y, cudaStream_t stream);
cudaError_t BackwardReduceCuda(const void* dy, const void* x, DType dtype,
                               const ActivationShape& shape, const float* mean,
                               float* reduced, float* scratch,
                               cudaStream_t stream);
cudaError_t BackwardElementwiseCuda(const void* dy, const void* x, DType dtype,
                                    const ActivationShape& shape,
                                    const float* mean, const float* invstd,
                                    const float* weight, const float* reduced,
                                    const float* total_count, void* dx,
                                    cudaStream_t stream);
#endif

}  // namespace concord::kernels
