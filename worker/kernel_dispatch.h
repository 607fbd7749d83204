#pragma once
// Runs one of kernels/'s kernels on a LibTorch tensor's device (internal; not
// an installed header). See Note [Kernels in the worker]: a CPU tensor runs the
// CPU twin; a CUDA tensor runs the CUDA kernel (when Concord was built with
// them) on LibTorch's current stream of the tensor's device, with that
// device current, as LibTorch's own ops run: the host does not wait. What
// reads the results is ordered after them by that stream — LibTorch's ops on
// it, the communicators through an event recorded on it (see Note [CUDA tensors
// over Gloo], and the NCCL communicator's stream waits on it).

#include <ATen/ATen.h>

#include <optional>

#include "concord/config.h"
#include "kernels/dtype.h"

#if defined(CONCORD_KERNELS_CUDA)
#include <cuda_runtime_api.h>
#endif
#if defined(CONCORD_KERNELS_CUDA) && CONCORD_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
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
#if defined(CONCORD_KERNELS_CUDA) && CONCORD_TORCH_CUDA
  TORCH_CHECK(t.is_cuda(), what, ": unsupported device ", t.device());
  const c10::cuda::CUDAGuard guard(t.device());
  const cudaError_t launched =
      cuda(c10::cuda::getCurrentCUDAStream(t.device().index()).stream());
  TORCH_CHECK(launched == cudaSuccess, what,
              " CUDA kernel: ", cudaGetErrorString(launched));
#else
  (void)cuda;
  TORCH_CHECK(false, what, ": tensors on ", t.device(),
              " need Concord built with CUDA kernels and a CUDA LibTorch");
#endif
}

}  // namespace concord::kernels_dispatch
