#pragma once
// Bucket kernels: flatten many tensors into one bucket and back in one
// launch, and fp32 <-> fp16/bf16 casts for compression hooks. Plain C++ over
// raw pointers; the CPU twins (…Cpu) are the reference for the CUDA kernels
// (…Cuda) and run where no GPU exists.

#include <cstdint>

#include "kernels/dtype.h"

namespace concord::kernels {

// One tensor's place in a bucket: `numel` elements at `data` (contiguous)
// <-> bucket elements [offset, offset + numel).
struct BucketSlice {
  void* data = nullptr;
  int64_t offset = 0;
  int64_t numel = 0;
};

// Copies every slice's tensor into the bucket. `element_size` is 1, 2, 4 or
// 8 bytes. Slices must not overlap in the bucket.
void FlattenCpu(const BucketSlice* slices, int64_t count, int64_t element_size,
                void* bucket);
// Copies the bucket back into every slice's tensor.
void UnflattenCpu(const BucketSlice* slices, int64_t count,
                  int64_t element_size, const void* bucket);

// dst[i] = src[i] converted (round to nearest even), i < n. Any pair of
// DTypes; the same type copies.
void CastCpu(const void* src, DType src_type, void* dst, DType dst_type,
             int64_t n);

#if defined(CONCORD_KERNELS_CUDA)
}  // namespace concord::kernels
#include <cuda_runtime_api.h>
namespace concord::kernels {
// One launch for all slices. `device_slices` (the array itself) lives in
// device memory, as do the tensors and the bucket; `max_numel` is the largest
// slice (it sizes the grid: a smaller value is slower, not wrong). Enqueued on
// `stream`. CastCuda's `src` and `dst` must not overlap (its threads run in
// no order; CastCpu's in-place narrowing has no CUDA counterpart).
cudaError_t FlattenCuda(const BucketSlice* device_slices, int64_t count,
                        int64_t max_numel, int64_t element_size, void* bucket,
                        cudaStream_t stream);
cudaError_t UnflattenCuda(const BucketSlice* device_slices, int64_t count,
                          int64_t max_numel, int64_t element_size,
                          const void* bucket, cudaStream_t stream);
cudaError_t CastCuda(const void* src, DType src_type, void* dst, DType dst_type,
                     int64_t n, cudaStream_t stream);
#endif

}  // namespace concord::kernels
