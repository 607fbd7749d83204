#include "kernels/scale.h"

namespace concord::kernels {
namespace {

__global__ void ScaleKernel(float* data, int64_t n, float factor) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    data[i] *= factor;
  }
}

}  // namespace

cudaError_t ScaleCuda(float* data, int64_t n, float factor,
                      cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(wanted < 65535 ? wanted : 65535);
  ScaleKernel<<<blocks, kThreads, 0, stream>>>(data, n, factor);
  return cudaGetLastError();
}

}  // namespace concord::kernels
