#pragma once
// The bucket and scaling kernels (kernels/bucket.h, kernels/scale.h) on
// LibTorch tensors: what DDP's reducer, its compression hooks, the coalesced
// broadcast and SlowMo use to pack many tensors into one message and back.
//
// Note [Kernels in the worker]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each call goes to the tensor's device (kernel_dispatch.h): the CPU twin for
// CPU tensors, the CUDA kernel for CUDA tensors when Concord was built with
// them. What the kernels cannot take (mixed dtypes or devices, element types
// other than float32/float16/bfloat16 for casts and scaling) is done with the
// LibTorch op that means the same, so every call is defined for every input.
// The arithmetic is PyTorch's: a flatten/unflatten is a copy; a cast rounds to
// nearest even as Tensor::to does; Scale(t, f) equals t.mul_(f) bit for bit
// (float32 times the factor rounded to float32).

#include <ATen/core/Tensor.h>

#include <vector>

namespace concord {

// The tensors' elements, one after another, in one new contiguous 1-D tensor
// (PyTorch's _flatten_dense_tensors). One launch when every tensor has the
// same dtype and device (non-contiguous ones are made contiguous first);
// otherwise at::cat's type promotion. An empty list gives an empty float
// tensor.
at::Tensor FlattenTensors(const std::vector<at::Tensor>& tensors);

// One tensor and where its elements start in a flat tensor.
struct FlatPiece {
  at::Tensor tensor;
  int64_t offset = 0;
};

// Copies flat[offset, offset + numel) back into each piece's tensor, whatever
// its layout (_unflatten_dense_tensors plus the copy), bumping its version as
// Tensor::copy_ does. Contiguous tensors of flat's dtype and device take one
// launch; the rest are copied with Tensor::copy_ (casting, as it does).
// Throws c10::Error when a piece lies outside `flat`.
void UnflattenInto(const at::Tensor& flat,
                   const std::vector<FlatPiece>& pieces);

// The same for tensors laid out one after another from `offset`.
void UnflattenInto(const at::Tensor& flat,
                   const std::vector<at::Tensor>& tensors, int64_t offset = 0);

// src converted to `dtype` (a new contiguous tensor of src's shape).
at::Tensor CastTo(const at::Tensor& src, at::ScalarType dtype);

// dst.copy_(src) for tensors of the same shape, casting on the way.
void CastInto(const at::Tensor& src, const at::Tensor& dst);

// t *= factor in place.
void Scale(const at::Tensor& t, double factor);

}  // namespace concord
