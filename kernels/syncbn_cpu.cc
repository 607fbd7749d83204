#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/syncbn.h"

namespace concord::kernels {
namespace {

// Welford's running (count, mean, m2), merged by Chan et al.'s update.
struct Welford {
  double count = 0;
  double mean = 0;
  double m2 = 0;
  void Add(double v) {
    count += 1;
    const double delta = v - mean;
    mean += delta / count;
    m2 += delta * (v - mean);
  }
  void Merge(double n, double other_mean, double other_m2) {
    if (n == 0) return;
    const double total = count + n;
    const double delta = other_mean - mean;
    mean += delta * n / total;
    m2 += other_m2 + delta * delta * count * n / total;
    count = total;
  }
};

template <DType T>
inline float Load(const void* data, int64_t i) {
  if constexpr (T == DType::kFloat32) {
    return static_cast<const float*>(data)[i];
  } else if constexpr (T == DType::kFloat16) {
    return HalfBitsToFloat(static_cast<const uint16_t*>(data)[i]);
  } else {
    return Bf16BitsToFloat(static_cast<const uint16_t*>(data)[i]);
  }
}

template <DType T>
inline void Store(void* data, int64_t i, float v) {
  if constexpr (T == DType::kFloat32) {
    static_cast<float*>(data)[i] = v;
  } else if constexpr (T == DType::kFloat16) {
    static_cast<uint16_t*>(data)[i] = FloatToHalfBits(v);
  } else {
    static_cast<uint16_t*>(data)[i] = FloatToBf16Bits(v);
  }
}

}  // namespace

void WelfordStatsCpu(const void* x, DType dtype, const ActivationShape& shape,
                     float* stats_row) {
  const int64_t c_count = shape.channels;
  std::vector<Welford> acc(static_cast<size_t>(c_count));
  DispatchDType(dtype, [&](auto type) {
    constexpr DType T = decltype(type)::value;
    if (shape.inner == 1) {
      // Channels-last: one running Welford per channel (double is exact
      // enough for a sequential update).
      for (int64_t o = 0; o < shape.outer; ++o) {
        for (int64_t c = 0; c < c_count; ++c) {
          acc[c].Add(Load<T>(x, o * c_count + c));
        }
      }
      return;
    }
    for (int64_t o = 0; o < shape.outer; ++o) {
      for (int64_t c = 0; c < c_count; ++c) {
        // One Welford per (row, channel) run, merged: pairwise-like error
        // growth instead of one long sequential sum.
        Welford run;
        const int64_t base = (o * c_count + c) * shape.inner;
        for (int64_t i = 0; i < shape.inner; ++i) run.Add(Load<T>(x, base + i));
        acc[c].Merge(run.count, run.mean, run.m2);
      }
    }
  });
  for (int64_t c = 0; c < c_count; ++c) {
    stats_row[c] = static_cast<float>(acc[c].mean);
    stats_row[c_count + c] = static_cast<float>(acc[c].m2);
  }
  stats_row[2 * c_count] = static_cast<float>(shape.per_channel());
}

void WelfordCombineCpu(const float* gathered, int64_t ranks, int64_t channels,
                       float eps, float* mean, float* invstd,
                       float* var_unbiased, float* total_count) {
  const int64_t row = StatsRowSize(channels);
  double total = 0;
  for (int64_t r = 0; r < ranks; ++r) total += gathered[r * row + 2 * channels];
  for (int64_t c = 0; c < channels; ++c) {
    Welford acc;
    for (int64_t r = 0; r < ranks; ++r) {
      const float* s = gathered + r * row;
      acc.Merge(s[2 * channels], s[c], s[channels + c]);
    }
    const double var = acc.count > 0 ? acc.m2 / acc.count : 0.0;
    mean[c] = static_cast<float>(acc.mean);
    invstd[c] = static_cast<float>(1.0 / std::sqrt(var + eps));
    var_unbiased[c] = acc.count > 1
                          ? static_cast<float>(acc.m2 / (acc.count - 1))
                          : std::numeric_limits<float>::quiet_NaN();
  }
  *total_count = static_cast<float>(total);
}

void BatchNormForwardCpu(const void* x, DType dtype,
                         const ActivationShape& shape, const float* mean,
                         const float* invstd, const float* weight,
                         const float* bias, void* y) {
  DispatchDType(dtype, [&](auto type) {
    constexpr DType T = decltype(type)::value;
    for (int64_t o = 0; o < shape.outer; ++o) {
      for (int64_t c = 0; c < shape.channels; ++c) {
        const float scale = invstd[c] * (weight ? weight[c] : 1.0f);
        const float shift = bias ? bias[c] : 0.0f;
        const int64_t base = (o * shape.channels + c) * shape.inner;
        for (int64_t i = 0; i < shape.inner; ++i) {
          const float v = Load<T>(x, base + i);
          Store<T>(y, base + i, (v - mean[c]) * scale + shift);
        }
      }
    }
  });
}

void BackwardReduceCpu(const void* dy, const void* x, DType dtype,
                       const ActivationShape& shape, const float* mean,
                       float* reduced) {
  const int64_t c_count = shape.channels;
  std::vector<double> sum_dy(static_cast<size_t>(c_count), 0.0);
  std::vector<double> sum_dy_xmu(static_cast<size_t>(c_count), 0.0);
  DispatchDType(dtype, [&](auto type) {
    constexpr DType T = decltype(type)::value;
    for (int64_t o = 0; o < shape.outer; ++o) {
      for (int64_t c = 0; c < c_count; ++c) {
        const int64_t base = (o * c_count + c) * shape.inner;
        const double m = mean[c];
        double s = 0, sx = 0;
        for (int64_t i = 0; i < shape.inner; ++i) {
          const double g = Load<T>(dy, base + i);
          s += g;
          sx += g * (static_cast<double>(Load<T>(x, base + i)) - m);
        }
        sum_dy[c] += s;
        sum_dy_xmu[c] += sx;
      }
    }
  });
  for (int64_t c = 0; c < c_count; ++c) {
    reduced[c] = static_cast<float>(sum_dy[c]);
    reduced[c_count + c] = static_cast<float>(sum_dy_xmu[c]);
  }
}

void BackwardElementwiseCpu(const void* dy, const void* x, DType dtype,
                            const ActivationShape& shape, const float* mean,
                            const float* invstd, const float* weight,
                            const float* reduced, float total_count, void* dx) {
  const int64_t c_count = shape.channels;
  DispatchDType(dtype, [&](auto type) {
    constexpr DType T = decltype(type)::value;
    for (int64_t o = 0; o < shape.outer; ++o) {
      for (int64_t c = 0; c < c_count; ++c) {
        const float mean_dy = reduced[c] / total_count;
        const float mean_dy_xmu = reduced[c_count + c] / total_count;
        const float k = invstd[c] * invstd[c] * mean_dy_xmu;
        const float scale = invstd[c] * (weight ? weight[c] : 1.0f);
        const int64_t base = (o * c_count + c) * shape.inner;
        for (int64_t i = 0; i < shape.inner; ++i) {
          const float g = Load<T>(dy, base + i);
          const float v = Load<T>(x, base + i);
          Store<T>(dx, base + i, (g - mean_dy - (v - mean[c]) * k) * scale);
        }
      }
    }
  });
}

}  // namespace concord::kernels
