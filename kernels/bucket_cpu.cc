#include <cstring>

#include "kernels/bucket.h"

namespace concord::kernels {

void FlattenCpu(const BucketSlice* slices, int64_t count, int64_t element_size,
                void* bucket) {
  auto* out = static_cast<char*>(bucket);
  for (int64_t k = 0; k < count; ++k) {
    if (slices[k].numel == 0) continue;
    std::memcpy(out + slices[k].offset * element_size, slices[k].data,
                static_cast<size_t>(slices[k].numel * element_size));
  }
}

void UnflattenCpu(const BucketSlice* slices, int64_t count,
                  int64_t element_size, const void* bucket) {
  const auto* in = static_cast<const char*>(bucket);
  for (int64_t k = 0; k < count; ++k) {
    if (slices[k].numel == 0) continue;
    std::memcpy(slices[k].data, in + slices[k].offset * element_size,
                static_cast<size_t>(slices[k].numel * element_size));
  }
}

void CastCpu(const void* src, DType src_type, void* dst, DType dst_type,
             int64_t n) {
  if (src_type == dst_type) {
    if (n > 0)
      std::memcpy(dst, src, static_cast<size_t>(n * DTypeSize(src_type)));
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    StoreFromFloat(dst, dst_type, i, LoadAsFloat(src, src_type, i));
  }
}

}  // namespace concord::kernels
