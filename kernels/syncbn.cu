#include <algorithm>
#include <cstdint>
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

__device__ __forceinline__ int64_t CeilDivDevice(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

__device__ __forceinline__ void Add(WelfordAcc& acc, float v) {
  acc.count += 1.f;
  const float delta = v - acc.mean;
  acc.mean += delta / acc.count;
  acc.m2 += delta * (v - acc.mean);
}

// Note [Split reductions]
// ~~~~~~~~~~~~~~~~~~~~~~~
// The per-channel reductions (Welford statistics, the backward sums) read
// every element once, so they are bound by memory bandwidth only if enough
// blocks are in flight to keep every SM busy. One block per channel (or per
// 32 channels, channels-last) is far too few for the usual shapes (256
// channels: 256 or 8 blocks on 132 SMs). So each channel's elements are split
// into S parts, a block per (channel or channel tile, part) writes a partial
// result to scratch memory the caller provides (SyncBnScratchFloats), and a
// second kernel merges the S partials of each channel in part order. S
// depends on the shape alone (ReductionSplits), never on the device, and
// every merge runs in a fixed order: the same input gives the same bits on
// any GPU, run after run.

// Threads per block of every kernel here; the block reductions halve a
// stride from it, so it is a power of two.
constexpr int kThreads = 256;
static_assert((kThreads & (kThreads - 1)) == 0, "kThreads: a power of two");
// Channels-last tiles: 32 channels wide (one warp, coalesced), kRows rows.
constexpr int kTileC = 32;
constexpr int kRows = kThreads / kTileC;
// Blocks the split reductions aim for (a dozen or more per SM on current
// GPUs), and the fewest elements a block should have to itself.
constexpr int64_t kWantedBlocks = 2048;
constexpr int64_t kMinPerBlock = 4096;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t Clamp(int64_t v, int64_t lo, int64_t hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

// Blocks for a grid-stride loop over n elements (gridDim.x may be up to
// 2^31 - 1, but 65535 blocks of 256 threads saturate any current GPU).
unsigned GridFor(int64_t n) {
  return static_cast<unsigned>(Clamp(CeilDiv(n, kThreads), 1, 65535));
}

// Contiguous layout: a 2-D block, x along inner (a power of two from 32 to
// kThreads, as wide as inner allows), y along outer.
int ThreadsAlongInner(int64_t inner) {
  int tx = 32;
  while (tx < kThreads && tx < inner) tx *= 2;
  return tx;
}

// See Note [Split reductions]: the number of parts S of each channel's
// elements. Contiguous: parts of the outer range (a block covers whole (o, ·)
// rows); channels-last: parts of the rows. Every part but the last has
// CeilDiv(outer, S) of the outer indices (rows), and none is empty.
int64_t ReductionSplits(const ActivationShape& shape) {
  if (shape.outer <= 0 || shape.channels <= 0) return 1;
  int64_t splits;
  if (shape.inner == 1) {
    const int64_t tiles = CeilDiv(shape.channels, kTileC);
    splits = Clamp(CeilDiv(kWantedBlocks, tiles), 1,
                   std::max<int64_t>(1, shape.outer / (8 * kRows)));
  } else {
    splits = Clamp(
        CeilDiv(kWantedBlocks, shape.channels), 1,
        std::max<int64_t>(
            1, std::min(shape.outer, shape.per_channel() / kMinPerBlock)));
  }
  return CeilDiv(shape.outer, CeilDiv(shape.outer, splits));
}

// Index arithmetic in 32 bits where every index fits (far cheaper on a GPU
// than 64-bit division), else in 64.
template <typename Index>
__device__ __forceinline__ Index ChannelOf(Index k, Index channels,
                                           Index inner) {
  return inner == 1 ? k % channels : (k / inner) % channels;
}

// ---- Welford statistics -----------------------------------------------------

// Partials: [3][S][C] floats, count, mean and m2 of part s of channel c.
template <DType D>
__global__ void WelfordPartialContiguous(const typename Elem<D>::T* x,
                                         int64_t outer, int64_t channels,
                                         int64_t inner, int64_t splits,
                                         float* partial) {
  const int64_t c = blockIdx.x;
  const int64_t part = blockIdx.y;
  const int64_t chunk = CeilDivDevice(outer, splits);
  const int64_t o_begin = part * chunk;
  const int64_t o_end = o_begin + chunk < outer ? o_begin + chunk : outer;
  WelfordAcc acc{0.f, 0.f, 0.f};
  for (int64_t o = o_begin + threadIdx.y; o < o_end; o += blockDim.y) {
    const typename Elem<D>::T* plane = x + (o * channels + c) * inner;
    for (int64_t i = threadIdx.x; i < inner; i += blockDim.x) {
      Add(acc, Elem<D>::Load(plane[i]));
    }
  }
  __shared__ WelfordAcc shared[kThreads];
  const unsigned t = threadIdx.y * blockDim.x + threadIdx.x;
  shared[t] = acc;
  __syncthreads();
  for (unsigned stride = kThreads / 2; stride > 0; stride /= 2) {
    if (t < stride) shared[t] = Merge(shared[t], shared[t + stride]);
    __syncthreads();
  }
  if (t == 0) {
    const int64_t at = part * channels + c, plane = splits * channels;
    partial[at] = shared[0].count;
    partial[plane + at] = shared[0].mean;
    partial[2 * plane + at] = shared[0].m2;
  }
}

// Channels-last: x is [rows][channels]; threadIdx.x along channels.
template <DType D>
__global__ void WelfordPartialChannelsLast(const typename Elem<D>::T* x,
                                           int64_t rows, int64_t channels,
                                           int64_t splits, float* partial) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kTileC + threadIdx.x;
  const int64_t part = blockIdx.y;
  const int64_t chunk = CeilDivDevice(rows, splits);
  const int64_t r_begin = part * chunk;
  const int64_t r_end = r_begin + chunk < rows ? r_begin + chunk : rows;
  WelfordAcc acc{0.f, 0.f, 0.f};
  if (c < channels) {
    for (int64_t r = r_begin + threadIdx.y; r < r_end; r += kRows) {
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
    const int64_t at = part * channels + c, plane = splits * channels;
    partial[at] = total.count;
    partial[plane + at] = total.mean;
    partial[2 * plane + at] = total.m2;
  }
}

// The stats row from the partials, merged in part order.
__global__ void WelfordMerge(const float* partial, int64_t splits,
                             int64_t channels, float per_channel, float* row) {
  const int64_t plane = splits * channels;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       c < channels; c += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    WelfordAcc acc{0.f, 0.f, 0.f};
    for (int64_t s = 0; s < splits; ++s) {
      const int64_t at = s * channels + c;
      acc = Merge(acc, WelfordAcc{partial[at], partial[plane + at],
                                  partial[2 * plane + at]});
    }
    row[c] = acc.mean;
    row[channels + c] = acc.m2;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) row[2 * channels] = per_channel;
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

// ---- element-wise passes ----------------------------------------------------

template <DType D, typename Index>
__global__ void Forward(const typename Elem<D>::T* x, Index n, Index channels,
                        Index inner, const float* mean, const float* invstd,
                        const float* weight, const float* bias,
                        typename Elem<D>::T* y) {
  const Index step = static_cast<Index>(blockDim.x) * gridDim.x;
  for (Index k = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x;
       k < n; k += step) {
    const Index c = ChannelOf(k, channels, inner);
    const float scale = invstd[c] * (weight ? weight[c] : 1.f);
    const float shift = bias ? bias[c] : 0.f;
    y[k] = Elem<D>::Store((Elem<D>::Load(x[k]) - mean[c]) * scale + shift);
  }
}

// ---- backward sums ----------------------------------------------------------

// Partials: [2][S][C] floats, Σ dy and Σ dy (x - mean) of part s of channel c.
template <DType D>
__global__ void ReducePartialContiguous(const typename Elem<D>::T* dy,
                                        const typename Elem<D>::T* x,
                                        int64_t outer, int64_t channels,
                                        int64_t inner, int64_t splits,
                                        const float* mean, float* partial) {
  const int64_t c = blockIdx.x;
  const int64_t part = blockIdx.y;
  const int64_t chunk = CeilDivDevice(outer, splits);
  const int64_t o_begin = part * chunk;
  const int64_t o_end = o_begin + chunk < outer ? o_begin + chunk : outer;
  const float m = mean[c];
  float s = 0.f, sx = 0.f;
  for (int64_t o = o_begin + threadIdx.y; o < o_end; o += blockDim.y) {
    const int64_t base = (o * channels + c) * inner;
    for (int64_t i = threadIdx.x; i < inner; i += blockDim.x) {
      const float g = Elem<D>::Load(dy[base + i]);
      s += g;
      sx += g * (Elem<D>::Load(x[base + i]) - m);
    }
  }
  __shared__ float shared_s[kThreads];
  __shared__ float shared_sx[kThreads];
  const unsigned t = threadIdx.y * blockDim.x + threadIdx.x;
  shared_s[t] = s;
  shared_sx[t] = sx;
  __syncthreads();
  for (unsigned stride = kThreads / 2; stride > 0; stride /= 2) {
    if (t < stride) {
      shared_s[t] += shared_s[t + stride];
      shared_sx[t] += shared_sx[t + stride];
    }
    __syncthreads();
  }
  if (t == 0) {
    const int64_t at = part * channels + c;
    partial[at] = shared_s[0];
    partial[splits * channels + at] = shared_sx[0];
  }
}

template <DType D>
__global__ void ReducePartialChannelsLast(const typename Elem<D>::T* dy,
                                          const typename Elem<D>::T* x,
                                          int64_t rows, int64_t channels,
                                          int64_t splits, const float* mean,
                                          float* partial) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kTileC + threadIdx.x;
  const int64_t part = blockIdx.y;
  const int64_t chunk = CeilDivDevice(rows, splits);
  const int64_t r_begin = part * chunk;
  const int64_t r_end = r_begin + chunk < rows ? r_begin + chunk : rows;
  float s = 0.f, sx = 0.f;
  if (c < channels) {
    const float m = mean[c];
    for (int64_t r = r_begin + threadIdx.y; r < r_end; r += kRows) {
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
    const int64_t at = part * channels + c;
    partial[at] = ts;
    partial[splits * channels + at] = tsx;
  }
}

__global__ void ReduceMerge(const float* partial, int64_t splits,
                            int64_t channels, float* reduced) {
  const int64_t plane = splits * channels;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       c < channels; c += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    float s = 0.f, sx = 0.f;
    for (int64_t p = 0; p < splits; ++p) {
      s += partial[p * channels + c];
      sx += partial[plane + p * channels + c];
    }
    reduced[c] = s;
    reduced[channels + c] = sx;
  }
}

template <DType D, typename Index>
__global__ void BackwardElementwise(const typename Elem<D>::T* dy,
                                    const typename Elem<D>::T* x, Index n,
                                    Index channels, Index inner,
                                    const float* mean, const float* invstd,
                                    const float* weight, const float* reduced,
                                    const float* total_count,
                                    typename Elem<D>::T* dx) {
  const float count = *total_count;
  const Index step = static_cast<Index>(blockDim.x) * gridDim.x;
  for (Index k = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x;
       k < n; k += step) {
    const Index c = ChannelOf(k, channels, inner);
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

// Launches an element-wise kernel over n elements with 32-bit indices where
// they fit.
template <typename Launch>
void WithIndex(int64_t n, Launch launch) {
  if (n <= INT32_MAX) {
    launch(uint32_t{0});
  } else {
    launch(int64_t{0});
  }
}

// DispatchDType (kernels/dtype.h), then the launch's error
// (cudaGetLastError also clears it).
template <typename F>
cudaError_t Dispatch(DType dtype, F f) {
  DispatchDType(dtype, f);
  return cudaGetLastError();
}

}  // namespace

int64_t SyncBnScratchFloats(const ActivationShape& shape) {
  return 3 * ReductionSplits(shape) * shape.channels;
}

cudaError_t WelfordStatsCuda(const void* x, DType dtype,
                             const ActivationShape& shape, float* stats_row,
                             float* scratch, cudaStream_t stream) {
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
  const int64_t splits = ReductionSplits(shape);
  const cudaError_t launched = Dispatch(dtype, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    using T = typename Elem<D>::T;
    const T* in = static_cast<const T*>(x);
    if (shape.inner == 1) {
      const dim3 grid(static_cast<unsigned>(CeilDiv(shape.channels, kTileC)),
                      static_cast<unsigned>(splits));
      WelfordPartialChannelsLast<D><<<grid, dim3(kTileC, kRows), 0, stream>>>(
          in, shape.outer, shape.channels, splits, scratch);
    } else {
      const int tx = ThreadsAlongInner(shape.inner);
      const dim3 grid(static_cast<unsigned>(shape.channels),
                      static_cast<unsigned>(splits));
      WelfordPartialContiguous<D><<<grid, dim3(tx, kThreads / tx), 0, stream>>>(
          in, shape.outer, shape.channels, shape.inner, splits, scratch);
    }
  });
  if (launched != cudaSuccess) return launched;
  WelfordMerge<<<GridFor(shape.channels), kThreads, 0, stream>>>(
      scratch, splits, shape.channels, static_cast<float>(shape.per_channel()),
      stats_row);
  return cudaGetLastError();
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
    WithIndex(n, [&](auto index) {
      using Index = decltype(index);
      Forward<D, Index><<<GridFor(n), kThreads, 0, stream>>>(
          static_cast<const T*>(x), static_cast<Index>(n),
          static_cast<Index>(shape.channels), static_cast<Index>(shape.inner),
          mean, invstd, weight, bias, static_cast<T*>(y));
    });
  });
}

cudaError_t BackwardReduceCuda(const void* dy, const void* x, DType dtype,
                               const ActivationShape& shape, const float* mean,
                               float* reduced, float* scratch,
                               cudaStream_t stream) {
  if (shape.channels == 0) return cudaSuccess;
  if (shape.per_channel() == 0) {
    return cudaMemsetAsync(reduced, 0, 2 * shape.channels * sizeof(float),
                           stream);
  }
  const int64_t splits = ReductionSplits(shape);
  const cudaError_t launched = Dispatch(dtype, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    using T = typename Elem<D>::T;
    const T* g = static_cast<const T*>(dy);
    const T* in = static_cast<const T*>(x);
    if (shape.inner == 1) {
      const dim3 grid(static_cast<unsigned>(CeilDiv(shape.channels, kTileC)),
                      static_cast<unsigned>(splits));
      ReducePartialChannelsLast<D><<<grid, dim3(kTileC, kRows), 0, stream>>>(
          g, in, shape.outer, shape.channels, splits, mean, scratch);
    } else {
      const int tx = ThreadsAlongInner(shape.inner);
      const dim3 grid(static_cast<unsigned>(shape.channels),
                      static_cast<unsigned>(splits));
      ReducePartialContiguous<D><<<grid, dim3(tx, kThreads / tx), 0, stream>>>(
          g, in, shape.outer, shape.channels, shape.inner, splits, mean,
          scratch);
    }
  });
  if (launched != cudaSuccess) return launched;
  ReduceMerge<<<GridFor(shape.channels), kThreads, 0, stream>>>(
      scratch, splits, shape.channels, reduced);
  return cudaGetLastError();
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
    WithIndex(n, [&](auto index) {
      using Index = decltype(index);
      BackwardElementwise<D, Index><<<GridFor(n), kThreads, 0, stream>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x),
          static_cast<Index>(n), static_cast<Index>(shape.channels),
          static_cast<Index>(shape.inner), mean, invstd, weight, reduced,
          total_count, static_cast<T*>(dx));
    });
  });
}

}  // namespace concord::kernels
