#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/syncbn.h"

namespace concord::kernels {
namespace {

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

struct WelfordAcc {
  float count;
  float mean;
  float m2;
};

__device__ __forceinline__ WelfordAcc Merge(WelfordAcc a, WelfordAcc b) {
  if (b.count == 0.f) return a;
  if (a.count == 0.f) return b;
  const float total = a.count + b.count;
  const float delta = b.mean - a.mean;
  const float nb_over = b.count / total;
  WelfordAcc out;
  out.count = total;
  out.mean = a.mean + delta * nb_over;
  out.m2 = a.m2 + b.m2 + delta * delta * a.count * nb_over;
  return out;
}

constexpr int kThreads = 256;
// Channels-last tiles: 32 channels wide (coalesced), kRows rows deep.
constexpr int kTileC = 32;
constexpr int kRows = 8;

int GridFor(int64_t n) {
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  return static_cast<int>(wanted < 65535 ? (wanted < 1 ? 1 : wanted) : 65535);
}

// Contiguous layout: one block per channel, threads over (outer, inner).
template <typename T>
__global__ void WelfordContiguous(const T* x, int64_t outer, int64_t channels,
                                  int64_t inner, float* row) {
  const int64_t c = blockIdx.x;
  const int64_t per_channel = outer * inner;
  WelfordAcc acc{0.f, 0.f, 0.f};
  for (int64_t k = threadIdx.x; k < per_channel; k += blockDim.x) {
    const int64_t o = k / inner, i = k - o * inner;
    const float v = ToFloat(x[(o * channels + c) * inner + i]);
    acc.count += 1.f;
    const float delta = v - acc.mean;
    acc.mean += delta / acc.count;
    acc.m2 += delta * (v - acc.mean);
  }
  __shared__ WelfordAcc shared[kThreads];
  shared[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      shared[threadIdx.x] =
          Merge(shared[threadIdx.x], shared[threadIdx.x + stride]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    row[c] = shared[0].mean;
    row[channels + c] = shared[0].m2;
    if (c == 0) row[2 * channels] = static_cast<float>(per_channel);
  }
}

// Channels-last: x is [rows][channels]; threadIdx.x along channels.
template <typename T>
__global__ void WelfordChannelsLast(const T* x, int64_t rows, int64_t channels,
                                    float* row) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kTileC + threadIdx.x;
  WelfordAcc acc{0.f, 0.f, 0.f};
  if (c < channels) {
    for (int64_t r = threadIdx.y; r < rows; r += kRows) {
      const float v = ToFloat(x[r * channels + c]);
      acc.count += 1.f;
      const float delta = v - acc.mean;
      acc.mean += delta / acc.count;
      acc.m2 += delta * (v - acc.mean);
    }
  }
  __shared__ WelfordAcc shared[kRows][kTileC];
  shared[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < channels) {
    WelfordAcc total = shared[0][threadIdx.x];
    for (int y = 1; y < kRows; ++y)
      total = Merge(total, shared[y][threadIdx.x]);
    row[c] = total.mean;
    row[channels + c] = total.m2;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0) {
    row[2 * channels] = static_cast<float>(rows);
  }
}

__global__ void Combine(const float* gathered, int64_t ranks, int64_t channels,
                        float eps, float* mean, float* invstd,
                        float* var_unbiased, float* total_count) {
  const int64_t row = 2 * channels + 1;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       c < channels; c += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    WelfordAcc acc{0.f, 0.f, 0.f};
    for (int64_t r = 0; r < ranks; ++r) {
      const float* s = gathered + r * row;
      acc = Merge(acc, WelfordAcc{s[2 * channels], s[c], s[channels + c]});
    }
    const float var = acc.count > 0.f ? acc.m2 / acc.count : 0.f;
    mean[c] = acc.mean;
    invstd[c] = rsqrtf(var + eps);
    var_unbiased[c] = acc.count > 1.f ? acc.m2 / (acc.count - 1.f) : nanf("");
    if (c == 0) *total_count = acc.count;
  }
}

template <typename T>
__global__ void Forward(const T* x, int64_t n, int64_t channels, int64_t inner,
                        const float* mean, const float* invstd,
                        const float* weight, const float* bias, T* y) {
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       k < n; k += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t c = (k / inner) % channels;
    const float scale = invstd[c] * (weight ? weight[c] : 1.f);
    const float shift = bias ? bias[c] : 0.f;
    y[k] = FromFloat<T>((ToFloat(x[k]) - mean[c]) * scale + shift);
  }
}

template <typename T>
__global__ void ReduceContiguous(const T* dy, const T* x, int64_t outer,
                                 int64_t channels, int64_t inner,
                                 const float* mean, float* reduced) {
  const int64_t c = blockIdx.x;
  const int64_t per_channel = outer * inner;
  const float m = mean[c];
  float s = 0.f, sx = 0.f;
  for (int64_t k = threadIdx.x; k < per_channel; k += blockDim.x) {
    const int64_t o = k / inner, i = k - o * inner;
    const int64_t at = (o * channels + c) * inner + i;
    const float g = ToFloat(dy[at]);
    s += g;
    sx += g * (ToFloat(x[at]) - m);
  }
  __shared__ float shared_s[kThreads];
  __shared__ float shared_sx[kThreads];
  shared_s[threadIdx.x] = s;
  shared_sx[threadIdx.x] = sx;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      shared_s[threadIdx.x] += shared_s[threadIdx.x + stride];
      shared_sx[threadIdx.x] += shared_sx[threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    reduced[c] = shared_s[0];
    reduced[channels + c] = shared_sx[0];
  }
}

template <typename T>
__global__ void ReduceChannelsLast(const T* dy, const T* x, int64_t rows,
                                   int64_t channels, const float* mean,
                                   float* reduced) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kTileC + threadIdx.x;
  float s = 0.f, sx = 0.f;
  if (c < channels) {
    const float m = mean[c];
    for (int64_t r = threadIdx.y; r < rows; r += kRows) {
      const float g = ToFloat(dy[r * channels + c]);
      s += g;
      sx += g * (ToFloat(x[r * channels + c]) - m);
    }
  }
  __shared__ float shared_s[kRows][kTileC];
  __shared__ float shared_sx[kRows][kTileC];
  shared_s[threadIdx.y][threadIdx.x] = s;
  shared_sx[threadIdx.y][threadIdx.x] = sx;
  __syncthreads();
  if (threadIdx.y == 0 && c < channels) {
    float ts = 0.f, tsx = 0.f;
    for (int y = 0; y < kRows; ++y) {
      ts += shared_s[y][threadIdx.x];
      tsx += shared_sx[y][threadIdx.x];
    }
    reduced[c] = ts;
    reduced[channels + c] = tsx;
  }
}

template <typename T>
__global__ void BackwardElementwise(const T* dy, const T* x, int64_t n,
                                    int64_t channels, int64_t inner,
                                    const float* mean, const float* invstd,
                                    const float* weight, const float* reduced,
                                    float total_count, T* dx) {
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       k < n; k += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t c = (k / inner) % channels;
    const float mean_dy = reduced[c] / total_count;
    const float mean_dy_xmu = reduced[channels + c] / total_count;
    const float is = invstd[c];
    const float scale = is * (weight ? weight[c] : 1.f);
    const float g = ToFloat(dy[k]);
    const float v = ToFloat(x[k]);
    dx[k] = FromFloat<T>((g - mean_dy - (v - mean[c]) * is * is * mean_dy_xmu) *
                         scale);
  }
}

// Calls f(T{}) with the CUDA element type of `dtype`.
template <typename F>
cudaError_t Dispatch(DType dtype, F f) {
  switch (dtype) {
    case DType::kFloat16:
      f(__half{});
      break;
    case DType::kBFloat16:
      f(__nv_bfloat16{});
      break;
    case DType::kFloat32:
    default:
      f(float{});
      break;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t WelfordStatsCuda(const void* x, DType dtype,
                             const ActivationShape& shape, float* stats_row,
                             cudaStream_t stream) {
  if (shape.channels == 0) return cudaSuccess;
  if (shape.per_channel() == 0) {
    return cudaMemsetAsync(
        stats_row, 0, StatsRowSize(shape.channels) * sizeof(float), stream);
  }
  return Dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x);
    if (shape.inner == 1) {
      const int blocks =
          static_cast<int>((shape.channels + kTileC - 1) / kTileC);
      WelfordChannelsLast<T><<<blocks, dim3(kTileC, kRows), 0, stream>>>(
          in, shape.outer, shape.channels, stats_row);
    } else {
      WelfordContiguous<T>
          <<<static_cast<unsigned>(shape.channels), kThreads, 0, stream>>>(
              in, shape.outer, shape.channels, shape.inner, stats_row);
    }
  });
}

cudaError_t WelfordCombineCuda(const float* gathered, int64_t ranks,
                               int64_t channels, float eps, float* mean,
                               float* invstd, float* var_unbiased,
                               float* total_count, cudaStream_t stream) {
  if (channels == 0) return cudaSuccess;
  Combine<<<GridFor(channels), kThreads, 0, stream>>>(
      gathered, ranks, channels, eps, mean, invstd, var_unbiased, total_count);
  return cudaGetLastError();
}

cudaError_t BatchNormForwardCuda(const void* x, DType dtype,
                                 const ActivationShape& shape,
                                 const float* mean, const float* invstd,
                                 const float* weight, const float* bias,
                                 void* y, cudaStream_t stream) {
  const int64_t n = shape.numel();
  if (n == 0) return cudaSuccess;
  return Dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    Forward<T><<<GridFor(n), kThreads, 0, stream>>>(
        static_cast<const T*>(x), n, shape.channels, shape.inner, mean, invstd,
        weight, bias, static_cast<T*>(y));
  });
}

cudaError_t BackwardReduceCuda(const void* dy, const void* x, DType dtype,
                               const ActivationShape& shape, const float* mean,
                               float* reduced, cudaStream_t stream) {
  if (shape.channels == 0) return cudaSuccess;
  if (shape.per_channel() == 0) {
    return cudaMemsetAsync(reduced, 0, 2 * shape.channels * sizeof(float),
                           stream);
  }
  return Dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* g = static_cast<const T*>(dy);
    const T* in = static_cast<const T*>(x);
    if (shape.inner == 1) {
      const int blocks =
          static_cast<int>((shape.channels + kTileC - 1) / kTileC);
      ReduceChannelsLast<T><<<blocks, dim3(kTileC, kRows), 0, stream>>>(
          g, in, shape.outer, shape.channels, mean, reduced);
    } else {
      ReduceContiguous<T>
          <<<static_cast<unsigned>(shape.channels), kThreads, 0, stream>>>(
              g, in, shape.outer, shape.channels, shape.inner, mean, reduced);
    }
  });
}

cudaError_t BackwardElementwiseCuda(const void* dy, const void* x, DType dtype,
                                    const ActivationShape& shape,
                                    const float* mean, const float* invstd,
                                    const float* weight, const float* reduced,
                                    float total_count, void* dx,
                                    cudaStream_t stream) {
  const int64_t n = shape.numel();
  if (n == 0) return cudaSuccess;
  return Dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    BackwardElementwise<T><<<GridFor(n), kThreads, 0, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), n, shape.channels,
        shape.inner, mean, invstd, weight, reduced, total_count,
        static_cast<T*>(dx));
  });
}

}  // namespace concord::kernels
