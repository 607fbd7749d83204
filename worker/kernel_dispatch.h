#pragma once
// Runs one of kernels/'s kernels on a LibTorch tensor's device (internal; not
// an installed header). Note [Kernels in the worker]: a CPU tensor runs the
// CPU twin; a CUDA tensor runs the CUDA kernel (when Concord was built with
// them) on the legacy default stream — the stream LibTorch's own work runs on
// unless the program picked another — with the tensor's device current, and
// the stream is synchronised before returning, because the communicators
// read the results from their own streams (NCCL) or from the host (Gloo).

#include <ATen/ATen.h>

#include <optional>

#include "kernels/dtype.h"

#if defined(CONCORD_KERNELS_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace concord::kernels_dispatch {

// The kernels' element type for a LibTorch dtype, if they take it.
inline std::optional<kernels::DType> KernelType(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return kernels::DType::kFloat32;
    case at::kHalf:
      return kernels::DType::kFloat16;
    case at::kBFloat16:
      return kernels::DType::kBFloat16;
    default:
      return std::nullopt;
  }
}

// `cpu()` runs the twin; `cuda(stream)` enqueues the kernel and returns its
// launch error. `what` names the caller in errors ("SyncBatchNorm").
template <typename Cpu, typename Cuda>
void OnDevice(const at::Tensor& t, const char* what, Cpu cpu, Cuda cuda) {
  if (t.is_cpu()) {
    cpu();
    return;
  }
#if defined(CONCORD_KERNELS_CUDA)
  TORCH_CHECK(t.is_cuda(), what, ": unsupported device ", t.device());
  int previous = 0;
  TORCH_CHECK(cudaGetDevice(&previous) == cudaSuccess, what,
              ": cudaGetDevice failed");
  const int device = t.device().index() < 0 ? previous : t.device().index();
  if (device != previous) {
    TORCH_CHECK(cudaSetDevice(device) == cudaSuccess, what, ": cudaSetDevice(",
                device, ") failed");
  }
  const cudaError_t launched = cuda(static_cast<cudaStream_t>(nullptr));
  const cudaError_t synced =
      launched == cudaSuccess ? cudaStreamSynchronize(nullptr) : launched;
  if (device != previous) cudaSetDevice(previous);
  TORCH_CHECK(launched == cudaSuccess, what,
              " CUDA kernel: ", cudaGetErrorString(launched));
  TORCH_CHECK(synced == cudaSuccess, what,
              ": cudaStreamSynchronize failed: ", cudaGetErrorString(synced));
#else
  (void)cuda;
  TORCH_CHECK(false, what, ": tensors on ", t.device(),
              " need Concord built with CUDA kernels");
#endif
}

}  // namespace concord::kernels_dispatch
