// Each CUDA kernel against its CPU twin, with the achieved memory bandwidth
// printed (label gpu). Without a device every test reports "skipped: no CUDA
// device". No LibTorch: plain buffers, so it builds fast.

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/bucket.h"
#include "kernels/scale.h"
#include "kernels/syncbn.h"

namespace concord::kernels {
namespace {

#define SKIP_WITHOUT_DEVICE()                                          \
  do {                                                                 \
    int devices = 0;                                                   \
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) { \
      GTEST_SKIP() << "skipped: no CUDA device";                       \
    }                                                                  \
  } while (false)

// A device copy of a host buffer, freed on scope exit.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(const std::vector<T>& host) : n_(host.size()) {
    EXPECT_EQ(cudaMalloc(&ptr_, Bytes() + 1), cudaSuccess);
    cudaMemcpy(ptr_, host.data(), Bytes(), cudaMemcpyHostToDevice);
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() { return static_cast<T*>(ptr_); }
  std::vector<T> ToHost() const {
    std::vector<T> host(n_);
    cudaMemcpy(host.data(), ptr_, Bytes(), cudaMemcpyDeviceToHost);
    return host;
  }
  size_t Bytes() const { return n_ * sizeof(T); }

 private:
  void* ptr_ = nullptr;
  size_t n_;
};

// Runs `launch` a few times and prints GB/s for `bytes` moved per launch.
template <typename Launch>
void ReportBandwidth(const char* name, double bytes, Launch launch) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  launch();
  cudaEventRecord(start);
  constexpr int kRepeats = 20;
  for (int i = 0; i < kRepeats; ++i) launch();
  cudaEventRecord(stop);
  cudaEventSynchronize(stop);
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  std::printf("[bandwidth] %-28s %8.1f GB/s\n", name,
              bytes * kRepeats / (ms * 1e-3) / 1e9);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

std::vector<float> RandomFloats(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(1.0f, 3.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

void ExpectNear(const std::vector<float>& a, const std::vector<float>& b,
                float rtol, float atol, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_LE(std::fabs(a[i] - b[i]), atol + rtol * std::fabs(b[i]))
        << what << " at " << i;
  }
}

TEST(KernelsGpuTest, SyncBnKernelsMatchCpuTwins) {
  SKIP_WITHOUT_DEVICE();
  struct Shape {
    int64_t n, c, s;
  };
  for (bool channels_last : {false, true}) {
    for (Shape sh : {Shape{4, 3, 37}, Shape{2, 33, 5}, Shape{8, 129, 1},
                     Shape{32, 64, 56 * 56}}) {
      const ActivationShape shape = channels_last
                                        ? ActivationShape{sh.n * sh.s, sh.c, 1}
                                        : ActivationShape{sh.n, sh.c, sh.s};
      const auto n = static_cast<size_t>(shape.numel());
      const int64_t c = shape.channels;
      std::vector<float> x = RandomFloats(n, 1), dy = RandomFloats(n, 2);
      std::vector<float> w = RandomFloats(c, 3), b = RandomFloats(c, 4);
      // Twins.
      std::vector<float> row(StatsRowSize(c)), mean(c), invstd(c), var(c),
          total(1), y(n), reduced(2 * c), dx(n);
      WelfordStatsCpu(x.data(), DType::kFloat32, shape, row.data());
      WelfordCombineCpu(row.data(), 1, c, 1e-5f, mean.data(), invstd.data(),
                        var.data(), total.data());
      BatchNormForwardCpu(x.data(), DType::kFloat32, shape, mean.data(),
                          invstd.data(), w.data(), b.data(), y.data());
      BackwardReduceCpu(dy.data(), x.data(), DType::kFloat32, shape,
                        mean.data(), reduced.data());
      BackwardElementwiseCpu(dy.data(), x.data(), DType::kFloat32, shape,
                             mean.data(), invstd.data(), w.data(),
                             reduced.data(), total[0], dx.data());
      // Kernels, each from the twin's inputs.
      DeviceBuffer<float> dx_in(x), ddy(dy), dw(w), db(b), drow(row),
          dmean(mean), dinv(invstd), dvar(var), dtotal(total), dyo(y),
          dred(reduced), ddx(dx);
      ASSERT_EQ(WelfordStatsCuda(dx_in.get(), DType::kFloat32, shape,
                                 drow.get(), nullptr),
                cudaSuccess);
      ExpectNear(drow.ToHost(), row, 1e-4f, 1e-3f, "welford");
      ASSERT_EQ(
          WelfordCombineCuda(drow.get(), 1, c, 1e-5f, dmean.get(), dinv.get(),
                             dvar.get(), dtotal.get(), nullptr),
          cudaSuccess);
      ExpectNear(dinv.ToHost(), invstd, 1e-4f, 1e-5f, "combine");
      DeviceBuffer<float> twin_mean(mean), twin_inv(invstd);
      ASSERT_EQ(BatchNormForwardCuda(dx_in.get(), DType::kFloat32, shape,
                                     twin_mean.get(), twin_inv.get(), dw.get(),
                                     db.get(), dyo.get(), nullptr),
                cudaSuccess);
      ExpectNear(dyo.ToHost(), y, 1e-5f, 1e-5f, "forward");
      ASSERT_EQ(BackwardReduceCuda(ddy.get(), dx_in.get(), DType::kFloat32,
                                   shape, twin_mean.get(), dred.get(), nullptr),
                cudaSuccess);
      ExpectNear(dred.ToHost(), reduced, 1e-3f, 1e-2f, "backward reduce");
      DeviceBuffer<float> twin_red(reduced);
      ASSERT_EQ(BackwardElementwiseCuda(ddy.get(), dx_in.get(), DType::kFloat32,
                                        shape, twin_mean.get(), twin_inv.get(),
                                        dw.get(), twin_red.get(), total[0],
                                        ddx.get(), nullptr),
                cudaSuccess);
      ExpectNear(ddx.ToHost(), dx, 1e-4f, 1e-5f, "backward elementwise");
      if (n >= 1000000) {
        const double bytes = static_cast<double>(n) * sizeof(float);
        const char* tag = channels_last ? "channels-last" : "contiguous";
        std::printf("[bandwidth] layout %s, %zu elements\n", tag, n);
        ReportBandwidth("welford stats", bytes, [&] {
          WelfordStatsCuda(dx_in.get(), DType::kFloat32, shape, drow.get(),
                           nullptr);
        });
        ReportBandwidth("forward", 2 * bytes, [&] {
          BatchNormForwardCuda(dx_in.get(), DType::kFloat32, shape,
                               twin_mean.get(), twin_inv.get(), dw.get(),
                               db.get(), dyo.get(), nullptr);
        });
        ReportBandwidth("backward reduce", 2 * bytes, [&] {
          BackwardReduceCuda(ddy.get(), dx_in.get(), DType::kFloat32, shape,
                             twin_mean.get(), dred.get(), nullptr);
        });
        ReportBandwidth("backward elementwise", 3 * bytes, [&] {
          BackwardElementwiseCuda(ddy.get(), dx_in.get(), DType::kFloat32,
                                  shape, twin_mean.get(), twin_inv.get(),
                                  dw.get(), twin_red.get(), total[0], ddx.get(),
                                  nullptr);
        });
      }
    }
  }
}

TEST(KernelsGpuTest, BucketAndCastKernelsMatchCpuTwins) {
  SKIP_WITHOUT_DEVICE();
  std::vector<int64_t> sizes{5, 0, 1, 1023, 17, 1 << 20, 3};
  int64_t total = 0, max_numel = 0;
  for (int64_t s : sizes) {
    total += s;
    max_numel = std::max(max_numel, s);
  }
  std::vector<float> all = RandomFloats(static_cast<size_t>(total), 5);
  DeviceBuffer<float> sources(all);
  std::vector<BucketSlice> slices;
  int64_t offset = 0;
  for (int64_t s : sizes) {
    // The bucket is reversed relative to the sources: offsets matter.
    slices.push_back({sources.get() + offset, total - offset - s, s});
    offset += s;
  }
  std::vector<float> expected(static_cast<size_t>(total));
  std::vector<BucketSlice> host_slices = slices;
  offset = 0;
  for (auto& s : host_slices) {
    s.data = all.data() + offset;
    offset += s.numel;
  }
  FlattenCpu(host_slices.data(), int64_t(sizes.size()), 4, expected.data());
  DeviceBuffer<float> bucket(std::vector<float>(static_cast<size_t>(total)));
  std::vector<unsigned char> slice_bytes(slices.size() * sizeof(BucketSlice));
  std::memcpy(slice_bytes.data(), slices.data(), slice_bytes.size());
  DeviceBuffer<unsigned char> device_slices(slice_bytes);
  auto* dslices = reinterpret_cast<BucketSlice*>(device_slices.get());
  ASSERT_EQ(FlattenCuda(dslices, int64_t(sizes.size()), max_numel, 4,
                        bucket.get(), nullptr),
            cudaSuccess);
  EXPECT_EQ(bucket.ToHost(), expected);
  ASSERT_EQ(ScaleCuda(bucket.get(), total, 2.0f, nullptr), cudaSuccess);
  ASSERT_EQ(UnflattenCuda(dslices, int64_t(sizes.size()), max_numel, 4,
                          bucket.get(), nullptr),
            cudaSuccess);
  std::vector<float> doubled = all;
  for (auto& v : doubled) v *= 2.0f;
  EXPECT_EQ(sources.ToHost(), doubled);
  ReportBandwidth("flatten", 2.0 * total * 4, [&] {
    FlattenCuda(dslices, int64_t(sizes.size()), max_numel, 4, bucket.get(),
                nullptr);
  });

  for (DType narrow : {DType::kFloat16, DType::kBFloat16}) {
    std::vector<uint16_t> twin(static_cast<size_t>(total));
    CastCpu(all.data(), DType::kFloat32, twin.data(), narrow, total);
    DeviceBuffer<uint16_t> out(std::vector<uint16_t>(twin.size()));
    DeviceBuffer<float> in(all);
    ASSERT_EQ(
        CastCuda(in.get(), DType::kFloat32, out.get(), narrow, total, nullptr),
        cudaSuccess);
    EXPECT_EQ(out.ToHost(), twin);
    ASSERT_EQ(
        CastCuda(out.get(), narrow, in.get(), DType::kFloat32, total, nullptr),
        cudaSuccess);
    std::vector<float> wide(twin.size());
    CastCpu(twin.data(), narrow, wide.data(), DType::kFloat32, total);
    EXPECT_EQ(in.ToHost(), wide);
    ReportBandwidth("cast fp32->16", 6.0 * total, [&] {
      CastCuda(in.get(), DType::kFloat32, out.get(), narrow, total, nullptr);
    });
  }
}

}  // namespace
}  // namespace concord::kernels
