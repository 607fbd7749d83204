#pragma once
// Bucket scaling: data[i] *= factor (gradient averaging, predivision).
// Plain C++ API over raw pointers so the worker can call it from LibTorch
// tensors. The CPU twin is the reference the CUDA kernel is tested against.

#include <cstdint>

namespace concord::kernels {

// CPU twin. `data` holds `n` floats.
void ScaleCpu(float* data, int64_t n, float factor);

#if defined(CONCORD_KERNELS_CUDA)
}  // namespace concord::kernels
#include <cuda_runtime_api.h>
namespace concord::kernels {
// Enqueues the scaling on `stream`; `data` is device memory.
cudaError_t ScaleCuda(float* data, int64_t n, float factor,
                      cudaStream_t stream);
#endif

}  // namespace concord::kernels
