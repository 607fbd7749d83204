// Each CUDA kernel against its CPU twin, with the achieved memory bandwidth
// printed (label gpu). Without a device every test reports
// "CONCORD_TEST_SKIPPED: no CUDA device" (the ctest SKIP_REGULAR_EXPRESSION).
// No LibTorch: plain buffers, so it builds fast.
//
// Everything runs on a non-blocking stream of the test's own, so a kernel
// that used the default stream instead would race with the copies. Outputs
// are poisoned (all bits set: NaN in every dtype) before each kernel, so an
// element a kernel leaves unwritten fails the comparison.

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/bucket.h"
#include "kernels/scale.h"
#include "kernels/syncbn.h"

namespace concord::kernels {
namespace {

using Bytes = std::vector<unsigned char>;

bool HaveDevice() {
  int devices = 0;
  const bool ok = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
  cudaGetLastError();  // a failed probe leaves no error behind
  return ok;
}

::testing::AssertionResult Ok(cudaError_t e) {
  if (e == cudaSuccess) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << cudaGetErrorName(e) << ": " << cudaGetErrorString(e);
}

// Device memory, freed on scope exit. Every transfer is ordered on the
// test's stream and waited for.
class DeviceBuffer {
 public:
  DeviceBuffer(size_t bytes, cudaStream_t stream)
      : bytes_(bytes), stream_(stream) {
    // One byte more: never a zero-size allocation (null pointer).
    EXPECT_TRUE(Ok(cudaMalloc(&ptr_, bytes_ + 1)));
  }
  template <typename T>
  DeviceBuffer(const std::vector<T>& host, cudaStream_t stream)
      : DeviceBuffer(host.size() * sizeof(T), stream) {
    Put(host.data());
  }
  ~DeviceBuffer() { EXPECT_TRUE(Ok(cudaFree(ptr_))); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() { return ptr_; }
  template <typename T>
  T* as() {
    return static_cast<T*>(ptr_);
  }
  void Put(const void* host) {
    if (bytes_ == 0) return;
    EXPECT_TRUE(Ok(
        cudaMemcpyAsync(ptr_, host, bytes_, cudaMemcpyHostToDevice, stream_)));
    EXPECT_TRUE(Ok(cudaStreamSynchronize(stream_)));
  }
  // All bits set: NaN as float, half and bf16.
  void Poison() {
    if (bytes_ == 0) return;
    EXPECT_TRUE(Ok(cudaMemsetAsync(ptr_, 0xFF, bytes_, stream_)));
  }
  // Waits for the stream (and so reports a kernel's failure) and copies out.
  template <typename T>
  std::vector<T> ToHost() {
    std::vector<T> host(bytes_ / sizeof(T));
    if (bytes_ == 0) {
      EXPECT_TRUE(Ok(cudaStreamSynchronize(stream_)));
      return host;
    }
    EXPECT_TRUE(Ok(cudaMemcpyAsync(host.data(), ptr_, bytes_,
                                   cudaMemcpyDeviceToHost, stream_)));
    EXPECT_TRUE(Ok(cudaStreamSynchronize(stream_)));
    return host;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
  cudaStream_t stream_;
};

class KernelsGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveDevice()) GTEST_SKIP() << "CONCORD_TEST_SKIPPED: no CUDA device";
    ASSERT_TRUE(Ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)));
  }
  void TearDown() override {
    if (stream_ != nullptr) {
      EXPECT_TRUE(Ok(cudaStreamDestroy(stream_)));
    }
  }

  // Launches `launch` once to warm up, then times kRepeats launches with
  // events on the stream and prints bytes moved per second (`bytes` per
  // launch), with the device's theoretical peak for scale.
  template <typename Launch>
  void ReportBandwidth(const std::string& name, double bytes, Launch launch) {
    cudaEvent_t start, stop;
    ASSERT_TRUE(Ok(cudaEventCreate(&start)));
    ASSERT_TRUE(Ok(cudaEventCreate(&stop)));
    ASSERT_TRUE(Ok(launch()));
    ASSERT_TRUE(Ok(cudaEventRecord(start, stream_)));
    constexpr int kRepeats = 20;
    for (int i = 0; i < kRepeats; ++i) ASSERT_TRUE(Ok(launch()));
    ASSERT_TRUE(Ok(cudaEventRecord(stop, stream_)));
    ASSERT_TRUE(Ok(cudaEventSynchronize(stop)));
    float ms = 0;
    ASSERT_TRUE(Ok(cudaEventElapsedTime(&ms, start, stop)));
    const double gbps = bytes * kRepeats / (ms * 1e-3) / 1e9;
    const double peak = PeakGBps();
    if (peak > 0) {
      std::printf("[bandwidth] %-44s %8.1f GB/s (%4.1f%% of %.0f)\n",
                  name.c_str(), gbps, 100 * gbps / peak, peak);
    } else {
      std::printf("[bandwidth] %-44s %8.1f GB/s\n", name.c_str(), gbps);
    }
    EXPECT_TRUE(Ok(cudaEventDestroy(start)));
    EXPECT_TRUE(Ok(cudaEventDestroy(stop)));
  }

  static double PeakGBps() {
    int device = 0, khz = 0, bus_bits = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, device) !=
            cudaSuccess ||
        cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth,
                               device) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return 2.0 * khz * 1e3 * (bus_bits / 8.0) / 1e9;  // double data rate
  }

  cudaStream_t stream_ = nullptr;
};

std::vector<float> RandomFloats(size_t n, uint32_t seed, float mean = 1.0f,
                                float stddev = 3.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(mean, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

std::vector<float> RandomInts(size_t n, uint32_t seed, int lo, int hi) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(dist(gen));
  return v;
}

// `values` rounded to `t` by the twin's cast: what both sides read.
Bytes Narrow(const std::vector<float>& values, DType t) {
  Bytes out(values.size() * static_cast<size_t>(DTypeSize(t)));
  CastCpu(values.data(), DType::kFloat32, out.data(), t,
          static_cast<int64_t>(values.size()));
  return out;
}

std::vector<float> Widen(const Bytes& data, DType t) {
  std::vector<float> out(data.size() / static_cast<size_t>(DTypeSize(t)));
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = LoadAsFloat(data.data(), t, static_cast<int64_t>(i));
  }
  return out;
}

const char* Name(DType t) {
  switch (t) {
    case DType::kFloat16:
      return "fp16";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat32:
    default:
      return "fp32";
  }
}

// One unit in the last place of `t`, relative (the narrow outputs may differ
// by one rounding where CUDA's float arithmetic fused a multiply-add).
double Ulp(DType t) {
  return t == DType::kFloat16    ? 0x1p-10
         : t == DType::kBFloat16 ? 0x1p-7
                                 : 0x1p-23;
}

// got (kernel) against want (twin): |got - want| <= tol(i), and NaN exactly
// where the twin has NaN.
::testing::AssertionResult NearEach(const std::vector<float>& got,
                                    const std::vector<float>& want,
                                    const std::function<double(size_t)>& tol,
                                    const char* what) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure()
           << what << ": sizes " << got.size() << " vs " << want.size();
  }
  for (size_t i = 0; i < got.size(); ++i) {
    const bool gn = std::isnan(got[i]), wn = std::isnan(want[i]);
    if (gn != wn || (!gn && !(std::fabs(static_cast<double>(got[i]) -
                                        want[i]) <= tol(i)))) {
      return ::testing::AssertionFailure()
             << what << " at " << i << ": kernel " << got[i] << ", twin "
             << want[i] << ", tolerance " << tol(i);
    }
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult Near(const std::vector<float>& got,
                                const std::vector<float>& want, double rtol,
                                double atol, const char* what) {
  return NearEach(
      got, want,
      [&](size_t i) { return atol + rtol * std::fabs(double(want[i])); }, what);
}

// The first differing element of two byte buffers of `size`-byte elements.
::testing::AssertionResult SameBits(const Bytes& got, const Bytes& want,
                                    size_t size, const char* what) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << what << ": sizes differ";
  }
  for (size_t i = 0; i < got.size(); i += size) {
    if (std::memcmp(got.data() + i, want.data() + i, size) != 0) {
      uint64_t g = 0, w = 0;
      std::memcpy(&g, got.data() + i, size);
      std::memcpy(&w, want.data() + i, size);
      return ::testing::AssertionFailure()
             << what << ": element " << i / size << " kernel 0x" << std::hex
             << g << ", twin 0x" << w;
    }
  }
  return ::testing::AssertionSuccess();
}

struct BnCase {
  int64_t n, c, s;
};

// Every SyncBN kernel against its twin: three dtypes, both layouts, odd and
// power-of-two channel counts, C = 1, C = 0, an empty batch, a count of 1;
// the combination over three ranks, one of them empty. Each kernel starts
// from the twin's inputs, so that errors do not compound.
TEST_F(KernelsGpuTest, SyncBnKernelsMatchCpuTwins) {
  const std::vector<BnCase> cases{
      {4, 3, 37},   {2, 33, 5},    {8, 129, 1},      {1, 1, 7}, {3, 1, 1},
      {1, 3, 1},    {5, 65, 3},    {7, 31, 2},       {0, 5, 3}, {2, 0, 3},
      {3, 1000, 1}, {2, 2, 70000}, {32, 64, 56 * 56}};
  uint32_t seed = 1;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (bool channels_last : {false, true}) {
      for (const BnCase& bc : cases) {
        SCOPED_TRACE(::testing::Message()
                     << Name(dtype) << (channels_last ? " channels-last" : "")
                     << " n " << bc.n << " c " << bc.c << " s " << bc.s);
        const ActivationShape shape =
            channels_last ? ActivationShape{bc.n * bc.s, bc.c, 1}
                          : ActivationShape{bc.n, bc.c, bc.s};
        const auto numel = static_cast<size_t>(shape.numel());
        const int64_t c = shape.channels;
        const auto uc = static_cast<size_t>(c);
        const int64_t row_size = StatsRowSize(c);
        const size_t es = static_cast<size_t>(DTypeSize(dtype));
        const Bytes x = Narrow(RandomFloats(numel, seed++), dtype);
        const Bytes dy = Narrow(RandomFloats(numel, seed++), dtype);
        const Bytes other = Narrow(RandomFloats(numel, seed++, -2.f), dtype);
        const std::vector<float> w = RandomFloats(uc, seed++);
        const std::vector<float> b = RandomFloats(uc, seed++);

        // The twins.
        std::vector<float> row(static_cast<size_t>(row_size));
        WelfordStatsCpu(x.data(), dtype, shape, row.data());
        // Three ranks: this one, an empty one, another one.
        std::vector<float> gathered = row;
        gathered.resize(static_cast<size_t>(2 * row_size), 0.f);
        std::vector<float> row_b(static_cast<size_t>(row_size));
        WelfordStatsCpu(other.data(), dtype, shape, row_b.data());
        gathered.insert(gathered.end(), row_b.begin(), row_b.end());
        std::vector<float> mean(uc), invstd(uc), var(uc), total(1);
        WelfordCombineCpu(gathered.data(), 3, c, 1e-5f, mean.data(),
                          invstd.data(), var.data(), total.data());
        Bytes y(numel * es), y_plain(numel * es), dx(numel * es);
        BatchNormForwardCpu(x.data(), dtype, shape, mean.data(), invstd.data(),
                            w.data(), b.data(), y.data());
        BatchNormForwardCpu(x.data(), dtype, shape, mean.data(), invstd.data(),
                            nullptr, nullptr, y_plain.data());
        std::vector<float> reduced(2 * uc);
        BackwardReduceCpu(dy.data(), x.data(), dtype, shape, mean.data(),
                          reduced.data());
        BackwardElementwiseCpu(dy.data(), x.data(), dtype, shape, mean.data(),
                               invstd.data(), w.data(), reduced.data(),
                               total[0], dx.data());

        // The kernels.
        DeviceBuffer d_x(x, stream_), d_dy(dy, stream_), d_w(w, stream_),
            d_b(b, stream_), d_gathered(gathered, stream_),
            d_mean(mean, stream_), d_invstd(invstd, stream_),
            d_reduced(reduced, stream_), d_total(total, stream_);
        DeviceBuffer o_row(row.size() * 4, stream_), o_mean(uc * 4, stream_),
            o_invstd(uc * 4, stream_), o_var(uc * 4, stream_),
            o_total(4, stream_), o_y(numel * es, stream_),
            o_reduced(2 * uc * 4, stream_), o_dx(numel * es, stream_),
            scratch(static_cast<size_t>(SyncBnScratchFloats(shape)) * 4,
                    stream_);

        o_row.Poison();
        scratch.Poison();
        ASSERT_TRUE(
            Ok(WelfordStatsCuda(d_x.get(), dtype, shape, o_row.as<float>(),
                                scratch.as<float>(), stream_)));
        const std::vector<float> got_row = o_row.ToHost<float>();
        // mean: float against double accumulation; m2 likewise; the count
        // exactly.
        EXPECT_TRUE(NearEach(
            got_row, row,
            [&](size_t i) {
              const double v = std::fabs(double(row[i]));
              if (i < uc) return 1e-4 + 1e-4 * v;      // mean
              if (i < 2 * uc) return 1e-4 + 2e-4 * v;  // m2
              return 0.0;                              // count
            },
            "welford stats"));

        o_mean.Poison();
        o_invstd.Poison();
        o_var.Poison();
        o_total.Poison();
        ASSERT_TRUE(Ok(WelfordCombineCuda(
            d_gathered.as<float>(), 3, c, 1e-5f, o_mean.as<float>(),
            o_invstd.as<float>(), o_var.as<float>(), o_total.as<float>(),
            stream_)));
        EXPECT_TRUE(Near(o_mean.ToHost<float>(), mean, 1e-5, 1e-5, "mean"));
        EXPECT_TRUE(Near(o_invstd.ToHost<float>(), invstd, 1e-5, 0, "invstd"));
        EXPECT_TRUE(
            Near(o_var.ToHost<float>(), var, 1e-5, 1e-6, "var_unbiased"));
        EXPECT_EQ(o_total.ToHost<float>(), total);

        // Outputs in `dtype`: within one unit of its last place (fused
        // multiply-adds round once less), plus the float arithmetic's own.
        const double out_rtol = std::max(Ulp(dtype), 1e-5);
        const double out_atol = dtype == DType::kFloat32 ? 1e-4 : 1e-3;
        o_y.Poison();
        ASSERT_TRUE(Ok(BatchNormForwardCuda(
            d_x.get(), dtype, shape, d_mean.as<float>(), d_invstd.as<float>(),
            d_w.as<float>(), d_b.as<float>(), o_y.get(), stream_)));
        EXPECT_TRUE(Near(Widen(o_y.ToHost<unsigned char>(), dtype),
                         Widen(y, dtype), out_rtol, out_atol, "forward"));
        o_y.Poison();
        ASSERT_TRUE(Ok(BatchNormForwardCuda(
            d_x.get(), dtype, shape, d_mean.as<float>(), d_invstd.as<float>(),
            nullptr, nullptr, o_y.get(), stream_)));
        EXPECT_TRUE(Near(Widen(o_y.ToHost<unsigned char>(), dtype),
                         Widen(y_plain, dtype), out_rtol, out_atol,
                         "forward without weight and bias"));

        // Sums: within a float accumulation's error of the twin's double
        // ones, scaled by the sum of the magnitudes.
        std::vector<double> abs_dy(uc, 0.0), abs_dy_xmu(uc, 0.0);
        {
          const std::vector<float> xf = Widen(x, dtype), gf = Widen(dy, dtype);
          const int64_t inner = shape.inner;
          for (size_t k = 0; k < numel; ++k) {
            const auto ch = static_cast<size_t>((int64_t(k) / inner) % c);
            abs_dy[ch] += std::fabs(double(gf[k]));
            abs_dy_xmu[ch] += std::fabs(double(gf[k]) * (xf[k] - mean[ch]));
          }
        }
        o_reduced.Poison();
        scratch.Poison();
        ASSERT_TRUE(Ok(BackwardReduceCuda(
            d_dy.get(), d_x.get(), dtype, shape, d_mean.as<float>(),
            o_reduced.as<float>(), scratch.as<float>(), stream_)));
        EXPECT_TRUE(NearEach(
            o_reduced.ToHost<float>(), reduced,
            [&](size_t i) {
              return 1e-5 + 1e-4 * (i < uc ? abs_dy[i] : abs_dy_xmu[i - uc]);
            },
            "backward reduce"));

        o_dx.Poison();
        ASSERT_TRUE(Ok(BackwardElementwiseCuda(
            d_dy.get(), d_x.get(), dtype, shape, d_mean.as<float>(),
            d_invstd.as<float>(), d_w.as<float>(), d_reduced.as<float>(),
            d_total.as<float>(), o_dx.get(), stream_)));
        EXPECT_TRUE(Near(Widen(o_dx.ToHost<unsigned char>(), dtype),
                         Widen(dx, dtype), out_rtol, out_atol,
                         "backward elementwise"));

        // Every element counted once: on small integers (and an integer
        // mean) the float sums are exact, so the reduction must equal the
        // twin's bit for bit.
        {
          const Bytes xi = Narrow(RandomInts(numel, seed++, -4, 4), dtype);
          const Bytes gi = Narrow(RandomInts(numel, seed++, -4, 4), dtype);
          const std::vector<float> mi = RandomInts(uc, seed++, -2, 2);
          std::vector<float> want(2 * uc);
          BackwardReduceCpu(gi.data(), xi.data(), dtype, shape, mi.data(),
                            want.data());
          DeviceBuffer d_xi(xi, stream_), d_gi(gi, stream_), d_mi(mi, stream_);
          o_reduced.Poison();
          ASSERT_TRUE(Ok(BackwardReduceCuda(
              d_gi.get(), d_xi.get(), dtype, shape, d_mi.as<float>(),
              o_reduced.as<float>(), scratch.as<float>(), stream_)));
          EXPECT_EQ(o_reduced.ToHost<float>(), want)
              << "backward reduce on integers";
        }

        if (numel >= 1000000) {
          const double bytes = static_cast<double>(numel * es);
          const std::string tag = std::string(Name(dtype)) +
                                  (channels_last ? " channels-last " : " ") +
                                  std::to_string(numel) + ": ";
          ReportBandwidth(tag + "welford stats", bytes, [&] {
            return WelfordStatsCuda(d_x.get(), dtype, shape, o_row.as<float>(),
                                    scratch.as<float>(), stream_);
          });
          ReportBandwidth(tag + "forward", 2 * bytes, [&] {
            return BatchNormForwardCuda(d_x.get(), dtype, shape,
                                        d_mean.as<float>(),
                                        d_invstd.as<float>(), d_w.as<float>(),
                                        d_b.as<float>(), o_y.get(), stream_);
          });
          ReportBandwidth(tag + "backward reduce", 2 * bytes, [&] {
            return BackwardReduceCuda(d_dy.get(), d_x.get(), dtype, shape,
                                      d_mean.as<float>(), o_reduced.as<float>(),
                                      scratch.as<float>(), stream_);
          });
          ReportBandwidth(tag + "backward elementwise", 3 * bytes, [&] {
            return BackwardElementwiseCuda(
                d_dy.get(), d_x.get(), dtype, shape, d_mean.as<float>(),
                d_invstd.as<float>(), d_w.as<float>(), d_reduced.as<float>(),
                d_total.as<float>(), o_dx.get(), stream_);
          });
        }
      }
    }
  }
}

// The combination's edge cases: every rank empty, counts of one, no
// channels.
TEST_F(KernelsGpuTest, WelfordCombineEdgeCasesMatchCpuTwin) {
  struct Case {
    int64_t ranks, channels;
    std::vector<float> gathered;
  };
  const std::vector<Case> cases{
      {2, 2, {0, 0, 0, 0, 0, 0, 0, 0, 0, 0}},                 // all empty
      {2, 1, {3.f, 0.f, 1.f, 5.f, 0.f, 1.f}},                 // counts of one
      {3, 1, {3.f, 0.f, 1.f, 0.f, 0.f, 0.f, 7.f, 0.f, 0.f}},  // one sample
      {2, 0, {4.f, 6.f}},                                     // no channels
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(::testing::Message()
                 << "ranks " << k.ranks << " channels " << k.channels);
    const auto uc = static_cast<size_t>(k.channels);
    std::vector<float> mean(uc), invstd(uc), var(uc), total(1);
    WelfordCombineCpu(k.gathered.data(), k.ranks, k.channels, 1e-5f,
                      mean.data(), invstd.data(), var.data(), total.data());
    DeviceBuffer d_gathered(k.gathered, stream_), o_mean(uc * 4, stream_),
        o_invstd(uc * 4, stream_), o_var(uc * 4, stream_), o_total(4, stream_);
    o_mean.Poison();
    o_invstd.Poison();
    o_var.Poison();
    o_total.Poison();
    ASSERT_TRUE(Ok(WelfordCombineCuda(d_gathered.as<float>(), k.ranks,
                                      k.channels, 1e-5f, o_mean.as<float>(),
                                      o_invstd.as<float>(), o_var.as<float>(),
                                      o_total.as<float>(), stream_)));
    EXPECT_TRUE(Near(o_mean.ToHost<float>(), mean, 1e-6, 1e-6, "mean"));
    EXPECT_TRUE(Near(o_invstd.ToHost<float>(), invstd, 1e-6, 0, "invstd"));
    EXPECT_TRUE(Near(o_var.ToHost<float>(), var, 1e-6, 0, "var_unbiased"));
    EXPECT_EQ(o_total.ToHost<float>(), total);
  }
}

Bytes RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  Bytes out(n);
  for (auto& b : out) b = static_cast<unsigned char>(gen());
  return out;
}

// Flatten and unflatten against the twins, for every element size, with an
// empty slice, a bucket laid out in the reverse order of the sources, more
// slices than grid.y takes (65535), and a grid-sizing hint that is too small.
TEST_F(KernelsGpuTest, BucketKernelsMatchCpuTwins) {
  struct Layout {
    std::vector<int64_t> sizes;
    bool exact_hint;
  };
  std::vector<Layout> layouts{{{5, 0, 1, 1023, 17, 1 << 20, 3}, true},
                              {{5, 0, 1, 1023, 17, 1 << 20, 3}, false},
                              {std::vector<int64_t>(70000, 3), true},
                              {{0, 0}, true}};
  uint32_t seed = 100;
  for (int64_t es : {1, 2, 4, 8}) {
    for (const Layout& layout : layouts) {
      const std::vector<int64_t>& sizes = layout.sizes;
      SCOPED_TRACE(::testing::Message() << "element size " << es << ", "
                                        << sizes.size() << " slices");
      int64_t total = 0, max_numel = 0;
      for (int64_t s : sizes) {
        total += s;
        max_numel = std::max(max_numel, s);
      }
      const int64_t hint = layout.exact_hint ? max_numel : 1;
      const auto count = static_cast<int64_t>(sizes.size());
      const auto bytes = static_cast<size_t>(total * es);
      Bytes sources = RandomBytes(bytes, seed++);
      DeviceBuffer d_sources(sources, stream_), d_bucket(bytes, stream_);
      // The same slices over host and device sources; the bucket reversed.
      std::vector<BucketSlice> host_slices, device_slices;
      int64_t offset = 0;
      for (int64_t s : sizes) {
        const int64_t in_bucket = total - offset - s;
        host_slices.push_back({sources.data() + offset * es, in_bucket, s});
        device_slices.push_back(
            {d_sources.as<unsigned char>() + offset * es, in_bucket, s});
        offset += s;
      }
      DeviceBuffer d_slices(device_slices, stream_);
      auto* slices = d_slices.as<BucketSlice>();

      Bytes bucket(bytes);
      FlattenCpu(host_slices.data(), count, es, bucket.data());
      d_bucket.Poison();
      ASSERT_TRUE(
          Ok(FlattenCuda(slices, count, hint, es, d_bucket.get(), stream_)));
      EXPECT_TRUE(SameBits(d_bucket.ToHost<unsigned char>(), bucket,
                           static_cast<size_t>(es), "flatten"));

      // A new bucket back into the tensors.
      const Bytes next = RandomBytes(bytes, seed++);
      d_bucket.Put(next.data());
      UnflattenCpu(host_slices.data(), count, es, next.data());
      d_sources.Poison();
      ASSERT_TRUE(
          Ok(UnflattenCuda(slices, count, hint, es, d_bucket.get(), stream_)));
      EXPECT_TRUE(SameBits(d_sources.ToHost<unsigned char>(), sources,
                           static_cast<size_t>(es), "unflatten"));

      if (bytes >= (1u << 20) && layout.exact_hint) {
        const std::string tag = std::to_string(es) + "-byte elements, " +
                                std::to_string(count) + " slices: ";
        ReportBandwidth(tag + "flatten", 2.0 * double(bytes), [&] {
          return FlattenCuda(slices, count, max_numel, es, d_bucket.get(),
                             stream_);
        });
        ReportBandwidth(tag + "unflatten", 2.0 * double(bytes), [&] {
          return UnflattenCuda(slices, count, max_numel, es, d_bucket.get(),
                               stream_);
        });
      }
    }
  }
}

// Inputs for the casts: for a 16-bit type every bit pattern; for float the
// special values (zeros, infinities, NaNs with payloads and signs,
// subnormals, the half and bf16 rounding boundaries) and random bit patterns.
Bytes CastInputs(DType t) {
  if (t != DType::kFloat32) {
    Bytes out(2 * 65536);
    for (uint32_t h = 0; h < 65536; ++h) {
      const auto v = static_cast<uint16_t>(h);
      std::memcpy(out.data() + 2 * h, &v, 2);
    }
    return out;
  }
  std::vector<uint32_t> words{
      0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u,
      0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FBFFFFFu, 0x7FFFFFFFu,
      0xFFFFFFFFu, 0x7FC12345u, 0x00000001u, 0x80000001u, 0x007FFFFFu,
      0x00800000u, 0x7F7FFFFFu, 0xFF7FFFFFu,
      0x477FE000u,  // 65504, the largest half
      0x477FEFFFu,  // just below 65520: rounds to 65504
      0x477FF000u,  // 65520: rounds to infinity
      0x38800000u,  // 2^-14, the smallest normal half
      0x387FE000u,  // just below it
      0x33800000u,  // 2^-24, the smallest subnormal half
      0x33000000u,  // 2^-25: a tie, rounds to zero
      0x33000001u,  // just above: rounds to 2^-24
      0x33C00000u,  // 1.5 * 2^-24: a tie, rounds to 2^-23
      0x3F808000u,  // a bf16 tie rounding to even (down)
      0x3F818000u,  // a bf16 tie rounding to even (up)
      0x7F7F8000u,  // bf16 rounds to infinity
      0x3F802000u,  // a half tie
      0x3F806000u};
  std::mt19937 gen(7);
  for (int i = 0; i < (1 << 20); ++i) words.push_back(gen());
  for (float f : RandomFloats(1 << 16, 8, 0.f, 100.f)) {
    uint32_t w;
    std::memcpy(&w, &f, 4);
    words.push_back(w);
  }
  Bytes out(4 * words.size());
  std::memcpy(out.data(), words.data(), out.size());
  return out;
}

// Every pair of dtypes, bit for bit (NaNs too: see Note [Integer conversions]).
TEST_F(KernelsGpuTest, CastKernelsMatchCpuTwinBitForBit) {
  const DType types[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  for (DType from : types) {
    const Bytes in = CastInputs(from);
    const int64_t n = static_cast<int64_t>(in.size()) / DTypeSize(from);
    DeviceBuffer d_in(in, stream_);
    for (DType to : types) {
      SCOPED_TRACE(::testing::Message() << Name(from) << " -> " << Name(to));
      const size_t out_bytes = static_cast<size_t>(n * DTypeSize(to));
      Bytes want(out_bytes);
      CastCpu(in.data(), from, want.data(), to, n);
      DeviceBuffer d_out(out_bytes, stream_);
      d_out.Poison();
      ASSERT_TRUE(Ok(CastCuda(d_in.get(), from, d_out.get(), to, n, stream_)));
      EXPECT_TRUE(SameBits(d_out.ToHost<unsigned char>(), want,
                           static_cast<size_t>(DTypeSize(to)), "cast"));
      // Nothing for n = 0.
      ASSERT_TRUE(Ok(CastCuda(d_in.get(), from, d_out.get(), to, 0, stream_)));
    }
  }
  // Bandwidth on 2^24 elements.
  const int64_t n = 1 << 24;
  DeviceBuffer wide(static_cast<size_t>(4 * n), stream_),
      narrow(static_cast<size_t>(2 * n), stream_);
  EXPECT_TRUE(Ok(cudaMemsetAsync(wide.get(), 0, size_t(4 * n), stream_)));
  EXPECT_TRUE(Ok(cudaMemsetAsync(narrow.get(), 0, size_t(2 * n), stream_)));
  for (DType t : {DType::kFloat16, DType::kBFloat16}) {
    ReportBandwidth(std::string("cast fp32 -> ") + Name(t), 6.0 * n, [&] {
      return CastCuda(wide.get(), DType::kFloat32, narrow.get(), t, n, stream_);
    });
    ReportBandwidth(std::string("cast ") + Name(t) + " -> fp32", 6.0 * n, [&] {
      return CastCuda(narrow.get(), t, wide.get(), DType::kFloat32, n, stream_);
    });
  }
}

TEST_F(KernelsGpuTest, ScaleKernelMatchesCpuTwin) {
  uint32_t seed = 200;
  for (int64_t n : {0, 1, 7, 100003, 1 << 24}) {
    SCOPED_TRACE(n);
    std::vector<float> data = RandomFloats(static_cast<size_t>(n), seed++);
    DeviceBuffer d(data, stream_);
    ScaleCpu(data.data(), n, 0.3f);
    ASSERT_TRUE(Ok(ScaleCuda(d.as<float>(), n, 0.3f, stream_)));
    EXPECT_EQ(d.ToHost<float>(), data);
    if (n >= (1 << 24)) {
      ReportBandwidth("scale fp32", 8.0 * double(n), [&] {
        return ScaleCuda(d.as<float>(), n, 1.0f, stream_);
      });
    }
  }
}

}  // namespace
}  // namespace concord::kernels
