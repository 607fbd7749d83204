#include "worker/tensor_ops.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "kernels/bucket.h"
#include "kernels/scale.h"
#include "worker/kernel_dispatch.h"

namespace concord {
namespace {

using kernels::BucketSlice;
using kernels_dispatch::KernelType;
using kernels_dispatch::OnDevice;

bool Strided(const at::Tensor& t) { return t.layout() == at::kStrided; }

// The raw writes below are in-place updates: autograd's version counter must
// see them as it sees Tensor::copy_.
void Bump(const at::Tensor& t) { t.unsafeGetTensorImpl()->bump_version(); }

int64_t MaxNumel(const std::vector<BucketSlice>& slices) {
  int64_t m = 0;
  for (const auto& s : slices) m = std::max(m, s.numel);
  return m;
}

// Flatten (to_bucket) or unflatten the slices against `flat`: one call.
void CopySlices(const at::Tensor& flat, std::vector<BucketSlice>& slices,
                bool to_bucket) {
  if (slices.empty()) return;
  const auto count = static_cast<int64_t>(slices.size());
  const int64_t element_size = flat.element_size();
  // The slice array's device copy is freed on return, before the kernel has
  // run: LibTorch's caching allocator hands its block out again only in
  // stream order, and the kernel runs on the stream it was allocated on.
  at::Tensor device_slices;
  OnDevice(
      flat, "bucket copy",
      [&] {
        if (to_bucket) {
          kernels::FlattenCpu(slices.data(), count, element_size,
                              flat.data_ptr());
        } else {
          kernels::UnflattenCpu(slices.data(), count, element_size,
                                flat.data_ptr());
        }
      },
      [&](auto stream) {
#if defined(CONCORD_KERNELS_CUDA)
        const auto bytes =
            static_cast<int64_t>(slices.size() * sizeof(BucketSlice));
        device_slices = at::empty(
            {bytes},
            at::TensorOptions().dtype(at::kByte).device(flat.device()));
        cudaError_t e = cudaMemcpyAsync(device_slices.data_ptr(), slices.data(),
                                        static_cast<size_t>(bytes),
                                        cudaMemcpyHostToDevice, stream);
        if (e != cudaSuccess) return e;
        const auto* on_device =
            static_cast<const BucketSlice*>(device_slices.data_ptr());
        return to_bucket
                   ? kernels::FlattenCuda(on_device, count, MaxNumel(slices),
                                          element_size, flat.data_ptr(), stream)
                   : kernels::UnflattenCuda(on_device, count, MaxNumel(slices),
                                            element_size, flat.data_ptr(),
                                            stream);
#endif
      });
}

}  // namespace

at::Tensor FlattenTensors(const std::vector<at::Tensor>& tensors) {
  if (tensors.empty()) return at::empty({0}, at::kFloat);
  const at::Tensor& first = tensors.front();
  const bool uniform =
      std::all_of(tensors.begin(), tensors.end(), [&](const at::Tensor& t) {
        return Strided(t) && t.scalar_type() == first.scalar_type() &&
               t.device() == first.device();
      });
  if (!uniform) {
    std::vector<at::Tensor> pieces;
    pieces.reserve(tensors.size());
    for (const auto& t : tensors) pieces.push_back(t.reshape({-1}));
    return at::cat(pieces);
  }
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> contiguous;
  std::vector<BucketSlice> slices;
  contiguous.reserve(tensors.size());
  slices.reserve(tensors.size());
  int64_t offset = 0;
  for (const auto& t : tensors) {
    contiguous.push_back(t.contiguous());
    slices.push_back(
        BucketSlice{contiguous.back().data_ptr(), offset, t.numel()});
    offset += t.numel();
  }
  at::Tensor flat = at::empty({offset}, first.options());
  CopySlices(flat, slices, /*to_bucket=*/true);
  return flat;
}

void UnflattenInto(const at::Tensor& flat,
                   const std::vector<FlatPiece>& pieces) {
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(),
              "UnflattenInto: the flat tensor must be 1-D and contiguous");
  at::NoGradGuard no_grad;
  std::vector<BucketSlice> slices;
  std::vector<at::Tensor> written;
  // Every piece is checked before anything is written.
  for (const auto& [t, offset] : pieces) {
    TORCH_CHECK(offset >= 0 && offset + t.numel() <= flat.numel(),
                "UnflattenInto: a piece of ", t.numel(), " elements at ",
                offset, " lies outside the flat tensor of ", flat.numel());
  }
  for (const auto& [t, offset] : pieces) {
    if (t.numel() == 0) continue;
    if (Strided(t) && t.is_contiguous() &&
        t.scalar_type() == flat.scalar_type() && t.device() == flat.device()) {
      slices.push_back(BucketSlice{t.data_ptr(), offset, t.numel()});
      written.push_back(t);
    } else {
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    }
  }
  CopySlices(flat, slices, /*to_bucket=*/false);
  for (const auto& t : written) Bump(t);
}

void UnflattenInto(const at::Tensor& flat,
                   const std::vector<at::Tensor>& tensors, int64_t offset) {
  std::vector<FlatPiece> pieces;
  pieces.reserve(tensors.size());
  for (const auto& t : tensors) {
    pieces.push_back(FlatPiece{t, offset});
    offset += t.numel();
  }
  UnflattenInto(flat, pieces);
}

void CastInto(const at::Tensor& src, const at::Tensor& dst) {
  const auto from = KernelType(src.scalar_type());
  const auto to = KernelType(dst.scalar_type());
  if (!from || !to || !Strided(src) || !Strided(dst) ||
      src.device() != dst.device() || !src.is_contiguous() ||
      !dst.is_contiguous() || !src.sizes().equals(dst.sizes())) {
    at::NoGradGuard no_grad;
    dst.copy_(src);
    return;
  }
  const int64_t n = src.numel();
  if (n == 0) return;
  OnDevice(
      src, "cast",
      [&] { kernels::CastCpu(src.data_ptr(), *from, dst.data_ptr(), *to, n); },
      [&](auto stream) {
#if defined(CONCORD_KERNELS_CUDA)
        return kernels::CastCuda(src.data_ptr(), *from, dst.data_ptr(), *to, n,
                                 stream);
#endif
      });
  Bump(dst);
}

at::Tensor CastTo(const at::Tensor& src, at::ScalarType dtype) {
  if (!KernelType(src.scalar_type()) || !KernelType(dtype) || !Strided(src)) {
    return src.to(dtype, /*non_blocking=*/false, /*copy=*/true);
  }
  at::Tensor out = at::empty(src.sizes(), src.options().dtype(dtype));
  CastInto(src.contiguous(), out);
  return out;
}

void Scale(const at::Tensor& t, double factor) {
  if (t.scalar_type() != at::kFloat || !Strided(t) || !t.is_contiguous()) {
    at::NoGradGuard no_grad;
    t.mul_(factor);
    return;
  }
  const int64_t n = t.numel();
  if (n == 0) return;
  // As mul_ does for a float32 tensor: the factor rounded to float32.
  const auto f = static_cast<float>(factor);
  OnDevice(
      t, "scale", [&] { kernels::ScaleCpu(t.data_ptr<float>(), n, f); },
      [&](auto stream) {
#if defined(CONCORD_KERNELS_CUDA)
        return kernels::ScaleCuda(t.data_ptr<float>(), n, f, stream);
#endif
      });
  Bump(t);
}

}  // namespace concord
