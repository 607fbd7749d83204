#include <type_traits>

#include "kernels/syncbn.h"

namespace concord::kernels {
namespace {

// Elements are loaded and stored through Elem<D> (kernels/dtype.h): the
// same bits as the CPU twins' conversions. Statistics accumulate in float.

struct WelfordAcc {
  float count;
  float mean;
  float m2;
};

// Chan et al.'s parallel update; a count-0 side takes no part.
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

__device__ __forceinline__ void Add(WelfordAcc& acc, float v) {
  acc.count += 1.f;
  const float delta = v - acc.mean;
  acc.mean += delta / acc.count;
  acc.m2 += delta * (v - acc.mean);
}

// The block reductions below halve a stride from kThreads / 2: kThreads must
// be a power of two, and every kernel using them is launched with exactly
// kThreads threads (the shared arrays are sized by it).
constexpr int kThreads = 256;
static_assert((kThreads & (kThreads - 1)) == 0, "kThreads: a power of two");
// Channels-last tiles: 32 channels wide (coalesced), kRows rows deep.
constexpr int kTileC = 32;
constexpr int kRows = 8;
static_assert(kTileC * kRows <= 1024, "block too large");

// Blocks for a grid-stride loop over n elements (gridDim.x may be up to
// 2^31 - 1, but 65535 blocks of 256 threads saturate any current GPU).
unsigned GridFor(int64_t n) {
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(wanted < 65535 ? (wanted < 1 ? 1 : wanted)
                                              : 65535);
}

// Blocks for the channels-last kernels: one per 32 channels.
unsigned TilesFor(int64_t channels) {
  return static_cast<unsigned>((channels + kTileC - 1) / kTileC);
}

// Contiguous layout: one block per channel, threads over (outer, inner).
template <DType D>
__global__ void WelfordContiguous(const typename Elem<D>::T* x, int64_t outer,
                                  int64_t channels, int64_t inner, float* row) {
  const int64_t c = blockIdx.x;
  const int64_t per_channel = outer * inner;
  WelfordAcc acc{0.f, 0.f, 0.f};
  for (int64_t k = threadIdx.x; k < per_channel; k += blockDim.x) {
    const int64_t o = k / inner, i = k - o * inner;
    Add(acc, Elem<D>::Load(x[(o * channels + c) * inner + i]));
  }
  __shared__ WelfordAcc shared[kThreads];
  shared[threadIdx.x] = acc;
  __syncthreads();
  for (unsigned stride = kThreads / 2; stride > 0; stride /= 2) {
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
template <DType D>
__global__ void WelfordChannelsLast(const typename Elem<D>::T* x, int64_t rows,
                                    int64_t channels, float* row) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kTileC + threadIdx.x;
  WelfordAcc acc{0.f, 0.f, 0.f};
  if (c < channels) {
    for (int64_t r = threadIdx.y; r < rows; r += kRows) {
      Add(acc, Elem<D>::Load(x[r * channels + c]));
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

// The count alone, for an activation without channels (a row of one float).
__global__ void WriteCount(float* row, float count) { row[0] = count; }

__global__ void Combine(const float* gathered, int64_t ranks, int64_t channels,
                        float eps, float* mean, float* invstd,
                        float* var_unbiased, float* total_count) {
  const int64_t row = 2 * channels + 1;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    // As the twin: the sum of every row's count (in double, as it).
    double total = 0;
    for (int64_t r = 0; r < ranks; ++r)
      total += gathered[r * row + 2 * channels];
    *total_count = static_cast<float>(total);
  }
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       c < channels; c += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    WelfordAcc acc{0.f, 0.f, 0.f};
    for (int64_t r = 0; r < ranks; ++r) {
      const float* s = gathered + r * row;
      acc = Merge(acc, WelfordAcc{s[2 * channels], s[c], s[channels + c]});
    }
    const float var = acc.count > 0.f ? acc.m2 / acc.count : 0.f;
    mean[c] = acc.mean;
    // Correctly rounded sqrt and division (not rsqrtf's approximation): the
    // twin's double result rounded to float, but for var's rounding.
    invstd[c] = 1.f / sqrtf(var + eps);
    var_unbiased[c] = acc.count > 1.f ? acc.m2 / (acc.count - 1.f)
                                      : __int_as_float(0x7FC00000);
  }
}

template <DType D>
__global__ void Forward(const typename Elem<D>::T* x, int64_t n,
                        int64_t channels, int64_t inner, const float* mean,
                        const float* invstd, const float* weight,
                        const float* bias, typename Elem<D>::T* y) {
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       k < n; k += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t c = (k / inner) % channels;
    const float scale = invstd[c] * (weight ? weight[c] : 1.f);
    const float shift = bias ? bias[c] : 0.f;
    y[k] = Elem<D>::Store((Elem<D>::Load(x[k]) - mean[c]) * scale + shift);
  }
}

template <DType D>
__global__ void ReduceContiguous(const typename Elem<D>::T* dy,
                                 const typename Elem<D>::T* x, int64_t outer,
                                 int64_t channels, int64_t inner,
                                 const float* mean, float* reduced) {
  const int64_t c = blockIdx.x;
  const int64_t per_channel = outer * inner;
  const float m = mean[c];
  float s = 0.f, sx = 0.f;
  for (int64_t k = threadIdx.x; k < per_channel; k += blockDim.x) {
    const int64_t o = k / inner, i = k - o * inner;
    const int64_t at = (o * channels + c) * inner + i;
    const float g = Elem<D>::Load(dy[at]);
    s += g;
    sx += g * (Elem<D>::Load(x[at]) - m);
  }
  __shared__ float shared_s[kThreads];
  __shared__ float shared_sx[kThreads];
  shared_s[threadIdx.x] = s;
  shared_sx[threadIdx.x] = sx;
  __syncthreads();
  for (unsigned stride = kThreads / 2; stride > 0; stride /= 2) {
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

template <DType D>
__global__ void ReduceChannelsLast(const typename Elem<D>::T* dy,
                                   const typename Elem<D>::T* x, int64_t rows,
                                   int64_t channels, const float* mean,
                                   float* reduced) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kTileC + threadIdx.x;
  float s = 0.f, sx = 0.f;
  if (c < channels) {
    const float m = mean[c];
    for (int64_t r = threadIdx.y; r < rows; r += kRows) {
      const float g = Elem<D>::Load(dy[r * channels + c]);
      s += g;
      sx += g * (Elem<D>::Load(x[r * channels + c]) - m);
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

template <DType D>
__global__ void BackwardElementwise(const typename Elem<D>::T* dy,
                                    const typename Elem<D>::T* x, int64_t n,
                                    int64_t channels, int64_t inner,
                                    const float* mean, const float* invstd,
                                    const float* weight, const float* reduced,
                                    const float* total_count,
                                    typename Elem<D>::T* dx) {
  const float count = *total_count;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       k < n; k += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t c = (k / inner) % channels;
    // The twin's order of operations.
    const float mean_dy = reduced[c] / count;
    const float mean_dy_xmu = reduced[channels + c] / count;
    const float is = invstd[c];
    const float kc = is * is * mean_dy_xmu;
    const float scale = is * (weight ? weight[c] : 1.f);
    const float g = Elem<D>::Load(dy[k]);
    const float v = Elem<D>::Load(x[k]);
    dx[k] = Elem<D>::Store((g - mean_dy - (v - mean[c]) * kc) * scale);
  }
}

// Calls f(std::integral_constant<DType, D>) for `dtype`, then reports the
// launch's error (cudaGetLastError also clears it).
template <typename F>
cudaError_t Dispatch(DType dtype, F f) {
  switch (dtype) {
    case DType::kFloat16:
      f(std::integral_constant<DType, DType::kFloat16>{});
      break;
    case DType::kBFloat16:
      f(std::integral_constant<DType, DType::kBFloat16>{});
      break;
    case DType::kFloat32:
    default:
      f(std::integral_constant<DType, DType::kFloat32>{});
      break;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t WelfordStatsCuda(const void* x, DType dtype,
                             const ActivationShape& shape, float* stats_row,
                             cudaStream_t stream) {
  if (shape.channels == 0) {
    // The row is the count alone; the twin writes it.
    WriteCount<<<1, 1, 0, stream>>>(stats_row,
                                    static_cast<float>(shape.per_channel()));
    return cudaGetLastError();
  }
  if (shape.per_channel() == 0) {
    return cudaMemsetAsync(
        stats_row, 0, StatsRowSize(shape.channels) * sizeof(float), stream);
  }
  return Dispatch(dtype, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    using T = typename Elem<D>::T;
    const T* in = static_cast<const T*>(x);
    if (shape.inner == 1) {
      WelfordChannelsLast<D>
          <<<TilesFor(shape.channels), dim3(kTileC, kRows), 0, stream>>>(
              in, shape.outer, shape.channels, stats_row);
    } else {
      WelfordContiguous<D>
          <<<static_cast<unsigned>(shape.channels), kThreads, 0, stream>>>(
              in, shape.outer, shape.channels, shape.inner, stats_row);
    }
  });
}

cudaError_t WelfordCombineCuda(const float* gathered, int64_t ranks,
                               int64_t channels, float eps, float* mean,
                               float* invstd, float* var_unbiased,
                               float* total_count, cudaStream_t stream) {
  // Launched even without channels: block 0 writes the total count.
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
    constexpr DType D = decltype(tag)::value;
    using T = typename Elem<D>::T;
    Forward<D><<<GridFor(n), kThreads, 0, stream>>>(
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
    constexpr DType D = decltype(tag)::value;
    using T = typename Elem<D>::T;
    const T* g = static_cast<const T*>(dy);
    const T* in = static_cast<const T*>(x);
    if (shape.inner == 1) {
      ReduceChannelsLast<D>
          <<<TilesFor(shape.channels), dim3(kTileC, kRows), 0, stream>>>(
              g, in, shape.outer, shape.channels, mean, reduced);
    } else {
      ReduceContiguous<D>
          <<<static_cast<unsigned>(shape.channels), kThreads, 0, stream>>>(
              g, in, shape.outer, shape.channels, shape.inner, mean, reduced);
    }
  });
}

cudaError_t BackwardElementwiseCuda(const void* dy, const void* x, DType dtype,
                                    const ActivationShape& shape,
                                    const float* mean, const float* invstd,
                                    const float* weight, const float* reduced,
                                    const float* total_count, void* dx,
                                    cudaStream_t stream) {
  const int64_t n = shape.numel();
  if (n == 0) return cudaSuccess;
  return Dispatch(dtype, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    using T = typename Elem<D>::T;
    BackwardElementwise<D><<<GridFor(n), kThreads, 0, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), n, shape.channels,
        shape.inner, mean, invstd, weight, reduced, total_count,
        static_cast<T*>(dx));
  });
}

}  // namespace concord::kernels
