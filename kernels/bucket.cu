#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/bucket.h"

namespace concord::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 65535;

// grid.y walks the slices, grid.x (with a stride) the elements of each.
template <typename T, bool kToBucket>
__global__ void CopySlices(const BucketSlice* slices, int64_t count,
                           T* bucket) {
  for (int64_t k = blockIdx.y; k < count; k += gridDim.y) {
    const BucketSlice s = slices[k];
    T* data = static_cast<T*>(s.data);
    for (int64_t i =
             static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
         i < s.numel; i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
      if (kToBucket) {
        bucket[s.offset + i] = data[i];
      } else {
        data[i] = bucket[s.offset + i];
      }
    }
  }
}

template <bool kToBucket>
cudaError_t LaunchCopy(const BucketSlice* slices, int64_t count,
                       int64_t max_numel, int64_t element_size, void* bucket,
                       cudaStream_t stream) {
  if (count == 0 || max_numel == 0) return cudaSuccess;
  const int64_t x = (max_numel + kThreads - 1) / kThreads;
  const dim3 grid(static_cast<unsigned>(x < kMaxGrid ? x : kMaxGrid),
                  static_cast<unsigned>(count < kMaxGrid ? count : kMaxGrid));
  switch (element_size) {
    case 1:
      CopySlices<uint8_t, kToBucket><<<grid, kThreads, 0, stream>>>(
          slices, count, static_cast<uint8_t*>(bucket));
      break;
    case 2:
      CopySlices<uint16_t, kToBucket><<<grid, kThreads, 0, stream>>>(
          slices, count, static_cast<uint16_t*>(bucket));
      break;
    case 4:
      CopySlices<uint32_t, kToBucket><<<grid, kThreads, 0, stream>>>(
          slices, count, static_cast<uint32_t*>(bucket));
      break;
    case 8:
      CopySlices<uint64_t, kToBucket><<<grid, kThreads, 0, stream>>>(
          slices, count, static_cast<uint64_t*>(bucket));
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

__device__ __forceinline__ float Load(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kFloat16:
      return __half2float(static_cast<const __half*>(p)[i]);
    case DType::kBFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::kFloat32:
    default:
      return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ void Store(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kFloat16:
      static_cast<__half*>(p)[i] = __float2half_rn(v);
      break;
    case DType::kBFloat16:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
      break;
    case DType::kFloat32:
    default:
      static_cast<float*>(p)[i] = v;
      break;
  }
}

__global__ void Cast(const void* src, DType src_type, void* dst, DType dst_type,
                     int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    Store(dst, dst_type, i, Load(src, src_type, i));
  }
}

}  // namespace

cudaError_t FlattenCuda(const BucketSlice* device_slices, int64_t count,
                        int64_t max_numel, int64_t element_size, void* bucket,
                        cudaStream_t stream) {
  return LaunchCopy<true>(device_slices, count, max_numel, element_size, bucket,
                          stream);
}

cudaError_t UnflattenCuda(const BucketSlice* device_slices, int64_t count,
                          int64_t max_numel, int64_t element_size,
                          const void* bucket, cudaStream_t stream) {
  return LaunchCopy<false>(device_slices, count, max_numel, element_size,
                           const_cast<void*>(bucket), stream);
}

cudaError_t CastCuda(const void* src, DType src_type, void* dst, DType dst_type,
                     int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (src_type == dst_type) {
    return cudaMemcpyAsync(dst, src, n * DTypeSize(src_type),
                           cudaMemcpyDeviceToDevice, stream);
  }
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  Cast<<<static_cast<unsigned>(wanted < kMaxGrid ? wanted : kMaxGrid), kThreads,
         0, stream>>>(src, src_type, dst, dst_type, n);
  return cudaGetLastError();
}

}  // namespace concord::kernels
