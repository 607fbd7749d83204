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
  if (count <= 0) return cudaSuccess;
  // max_numel only sizes the grid (the loops run to each slice's own numel):
  // a wrong hint is slow, never wrong.
  int64_t x = (max_numel + kThreads - 1) / kThreads;
  if (x < 1) x = 1;
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

// dst[i] = src[i] through float, with the twins' conversions (Elem, see Note
// [Integer conversions]): bit for bit CastCpu, NaNs included.
template <DType S, DType D>
__global__ void Cast(const typename Elem<S>::T* src, typename Elem<D>::T* dst,
                     int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    dst[i] = Elem<D>::Store(Elem<S>::Load(src[i]));
  }
}

template <DType S, DType D>
void LaunchCast(const void* src, void* dst, int64_t n, cudaStream_t stream) {
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  Cast<S, D>
      <<<static_cast<unsigned>(wanted < kMaxGrid ? wanted : kMaxGrid), kThreads,
         0, stream>>>(static_cast<const typename Elem<S>::T*>(src),
                      static_cast<typename Elem<D>::T*>(dst), n);
}

template <DType S>
cudaError_t CastFrom(const void* src, void* dst, DType dst_type, int64_t n,
                     cudaStream_t stream) {
  switch (dst_type) {
    case DType::kFloat32:
      LaunchCast<S, DType::kFloat32>(src, dst, n, stream);
      break;
    case DType::kFloat16:
      LaunchCast<S, DType::kFloat16>(src, dst, n, stream);
      break;
    case DType::kBFloat16:
      LaunchCast<S, DType::kBFloat16>(src, dst, n, stream);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
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
  if (n <= 0) return cudaSuccess;
  if (src_type == dst_type) {
    return cudaMemcpyAsync(dst, src,
                           static_cast<size_t>(n * DTypeSize(src_type)),
                           cudaMemcpyDeviceToDevice, stream);
  }
  switch (src_type) {
    case DType::kFloat32:
      return CastFrom<DType::kFloat32>(src, dst, dst_type, n, stream);
    case DType::kFloat16:
      return CastFrom<DType::kFloat16>(src, dst, dst_type, n, stream);
    case DType::kBFloat16:
      return CastFrom<DType::kBFloat16>(src, dst, dst_type, n, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace concord::kernels
