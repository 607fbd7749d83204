#include <gtest/gtest.h>
#include <torch/torch.h>

#include "kernels/bucket.h"
#include "kernels/scale.h"
#include "kernels/syncbn.h"

namespace concord::kernels {
namespace {

TEST(KernelsCpuTest, ScaleMatchesLibTorch) {
  for (int64_t n : {0, 1, 7, 1023, 100003}) {
    torch::Tensor x = torch::randn({n});
    torch::Tensor expected = x * 0.125f;
    ScaleCpu(x.data_ptr<float>(), n, 0.125f);
    EXPECT_TRUE(torch::equal(x, expected)) << n;
  }
}

DType ToKernelType(torch::ScalarType t) {
  if (t == torch::kHalf) return DType::kFloat16;
  if (t == torch::kBFloat16) return DType::kBFloat16;
  return DType::kFloat32;
}

// A random activation (N, C, *spatial), contiguous, and its kernel shape in
// the layout asked for (see Note [Activation layout]): `data` is what the
// kernel reads; `logical` the same values as a plain (N, C, S) tensor.
struct Activation {
  torch::Tensor data;     // contiguous memory in the kernel's layout
  torch::Tensor logical;  // (N, C, S) float
  ActivationShape shape;
};

Activation MakeActivation(int64_t n, int64_t c, int64_t s, bool channels_last,
                          torch::ScalarType dtype) {
  torch::Tensor x = (torch::randn({n, c, s}) * 3 + 1.5).to(dtype);
  Activation a;
  a.logical = x.to(torch::kFloat);
  if (channels_last) {
    a.data = x.permute({0, 2, 1}).contiguous();
    a.shape = {n * s, c, 1};
  } else {
    a.data = x;
    a.shape = {n, c, s};
  }
  return a;
}

// The CPU twins against LibTorch on random shapes: odd channel counts (apex's
// channels-last bug), empty batches, both layouts, three dtypes.
TEST(KernelsCpuTest, SyncBnTwinsMatchLibTorch) {
  torch::manual_seed(11);
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
    for (bool channels_last : {false, true}) {
      for (auto [n, c, s] : std::vector<std::array<int64_t, 3>>{{4, 1, 9},
                                                                {3, 3, 5},
                                                                {2, 7, 1},
                                                                {5, 33, 3},
                                                                {1, 129, 2},
                                                                {6, 5, 17}}) {
        SCOPED_TRACE(::testing::Message()
                     << dtype << " channels_last " << channels_last << " n "
                     << n << " c " << c << " s " << s);
        Activation a = MakeActivation(n, c, s, channels_last, dtype);
        const DType kt = ToKernelType(dtype);
        const auto tol = [&](double scale) { return 1e-5 * scale + 1e-5; };
        torch::Tensor row = torch::empty({StatsRowSize(c)});
        WelfordStatsCpu(a.data.data_ptr(), kt, a.shape, row.data_ptr<float>());
        torch::Tensor per_channel = a.logical.transpose(0, 1).reshape({c, -1});
        auto [var, mean] = torch::var_mean(per_channel, 1, /*unbiased=*/false);
        EXPECT_TRUE(torch::allclose(row.narrow(0, 0, c), mean, 1e-5, tol(10)));
        EXPECT_TRUE(torch::allclose(row.narrow(0, c, c), var * float(n * s),
                                    1e-4, tol(100)));
        EXPECT_EQ(row[2 * c].item<float>(), float(n * s));

        torch::Tensor m = torch::empty({c}), invstd = torch::empty({c}),
                      unbiased = torch::empty({c}), total = torch::empty({1});
        WelfordCombineCpu(row.data_ptr<float>(), 1, c, 1e-5f,
                          m.data_ptr<float>(), invstd.data_ptr<float>(),
                          unbiased.data_ptr<float>(), total.data_ptr<float>());
        EXPECT_TRUE(torch::allclose(invstd, torch::rsqrt(var + 1e-5), 1e-4));

        torch::Tensor w = torch::rand({c}) + 0.5, b = torch::randn({c});
        torch::Tensor y = torch::empty_like(a.data);
        BatchNormForwardCpu(a.data.data_ptr(), kt, a.shape, m.data_ptr<float>(),
                            invstd.data_ptr<float>(), w.data_ptr<float>(),
                            b.data_ptr<float>(), y.data_ptr());
        torch::Tensor expected_y =
            ((a.logical - m.view({1, c, 1})) * (invstd * w).view({1, c, 1}) +
             b.view({1, c, 1}))
                .to(dtype);
        torch::Tensor y_logical =
            channels_last ? y.view({n, s, c}).permute({0, 2, 1}) : y;
        EXPECT_TRUE(torch::equal(y_logical, expected_y.view_as(y_logical)) ||
                    torch::allclose(y_logical.to(torch::kFloat),
                                    expected_y.to(torch::kFloat), 1e-2, 1e-2));

        torch::Tensor dy_logical = torch::randn({n, c, s}).to(dtype);
        torch::Tensor dy = channels_last
                               ? dy_logical.permute({0, 2, 1}).contiguous()
                               : dy_logical;
        torch::Tensor reduced = torch::empty({2 * c});
        BackwardReduceCpu(dy.data_ptr(), a.data.data_ptr(), kt, a.shape,
                          m.data_ptr<float>(), reduced.data_ptr<float>());
        torch::Tensor g = dy_logical.to(torch::kFloat).to(torch::kDouble);
        torch::Tensor xmu =
            a.logical.to(torch::kDouble) - m.to(torch::kDouble).view({1, c, 1});
        EXPECT_TRUE(torch::allclose(reduced.narrow(0, 0, c).to(torch::kDouble),
                                    g.sum(torch::IntArrayRef{0, 2}), 1e-5,
                                    1e-4));
        EXPECT_TRUE(torch::allclose(reduced.narrow(0, c, c).to(torch::kDouble),
                                    (g * xmu).sum(torch::IntArrayRef{0, 2}),
                                    1e-5, 1e-3));

        torch::Tensor dx = torch::empty_like(a.data);
        const float count = float(n * s);
        BackwardElementwiseCpu(dy.data_ptr(), a.data.data_ptr(), kt, a.shape,
                               m.data_ptr<float>(), invstd.data_ptr<float>(),
                               w.data_ptr<float>(), reduced.data_ptr<float>(),
                               count, dx.data_ptr());
        // LibTorch's own batch-norm gradient on the same values.
        torch::Tensor xr = a.logical.clone().requires_grad_(true);
        torch::Tensor yr =
            torch::batch_norm(xr, w, b, {}, {}, true, 0.1, 1e-5, false);
        (yr * dy_logical.to(torch::kFloat)).sum().backward();
        torch::Tensor dx_logical =
            channels_last ? dx.view({n, s, c}).permute({0, 2, 1}) : dx;
        const double rtol = dtype == torch::kFloat ? 1e-4 : 2e-2;
        EXPECT_TRUE(torch::allclose(dx_logical.to(torch::kFloat),
                                    xr.grad().to(dtype).to(torch::kFloat), rtol,
                                    rtol))
            << (dx_logical.to(torch::kFloat) - xr.grad()).abs().max();
      }
    }
  }
}

TEST(KernelsCpuTest, WelfordCombineEqualsStatisticsOfTheConcatenation) {
  torch::manual_seed(12);
  for (int64_t c : {1, 5, 31}) {
    std::vector<int64_t> sizes{3, 0, 17, 1, 8};
    torch::Tensor full = torch::randn({29, c, 4}) * 5 - 2;
    const int64_t row_size = StatsRowSize(c);
    torch::Tensor gathered = torch::empty({int64_t(sizes.size()) * row_size});
    int64_t offset = 0;
    for (size_t r = 0; r < sizes.size(); ++r) {
      torch::Tensor part = full.narrow(0, offset, sizes[r]).contiguous();
      WelfordStatsCpu(part.data_ptr(), DType::kFloat32, {sizes[r], c, 4},
                      gathered.data_ptr<float>() + r * row_size);
      offset += sizes[r];
    }
    torch::Tensor mean = torch::empty({c}), invstd = torch::empty({c}),
                  unbiased = torch::empty({c}), total = torch::empty({1});
    WelfordCombineCpu(gathered.data_ptr<float>(), int64_t(sizes.size()), c,
                      1e-5f, mean.data_ptr<float>(), invstd.data_ptr<float>(),
                      unbiased.data_ptr<float>(), total.data_ptr<float>());
    torch::Tensor per_channel = full.transpose(0, 1).reshape({c, -1});
    auto [var, m] = torch::var_mean(per_channel, 1, /*unbiased=*/false);
    EXPECT_TRUE(torch::allclose(mean, m, 1e-5, 1e-5));
    EXPECT_TRUE(torch::allclose(invstd, torch::rsqrt(var + 1e-5), 1e-5));
    EXPECT_TRUE(torch::allclose(unbiased, per_channel.var(1, true), 1e-5));
    EXPECT_EQ(total.item<float>(), 29 * 4);
  }
}

TEST(KernelsCpuTest, FlattenUnflattenRoundTripMatchesCat) {
  torch::manual_seed(13);
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kDouble}) {
    std::vector<torch::Tensor> grads;
    for (int64_t n : {5, 0, 1, 1023, 17}) {
      grads.push_back(torch::randn({n}).to(dtype));
    }
    std::vector<BucketSlice> slices;
    int64_t offset = 0;
    for (auto& g : grads) {
      slices.push_back({g.data_ptr(), offset, g.numel()});
      offset += g.numel();
    }
    torch::Tensor bucket = torch::empty({offset}, dtype);
    FlattenCpu(slices.data(), int64_t(slices.size()), bucket.element_size(),
               bucket.data_ptr());
    EXPECT_TRUE(torch::equal(bucket, torch::cat(grads)));
    bucket.mul_(2);
    UnflattenCpu(slices.data(), int64_t(slices.size()), bucket.element_size(),
                 bucket.data_ptr());
    EXPECT_TRUE(torch::equal(torch::cat(grads), bucket));
  }
}

TEST(KernelsCpuTest, CastsRoundLikeLibTorch) {
  torch::manual_seed(14);
  torch::Tensor x =
      torch::cat({torch::randn({10001}) * 100,
                  torch::tensor({0.0f, -0.0f, 1e-8f, -1e-6f, 65504.0f, 70000.0f,
                                 1e38f, 3.0e-5f, 6.1e-5f})});
  const int64_t n = x.numel();
  for (auto [t, kt] : std::vector<std::pair<torch::ScalarType, DType>>{
           {torch::kHalf, DType::kFloat16},
           {torch::kBFloat16, DType::kBFloat16}}) {
    torch::Tensor narrow = torch::empty({n}, t);
    CastCpu(x.data_ptr(), DType::kFloat32, narrow.data_ptr(), kt, n);
    EXPECT_TRUE(torch::equal(narrow, x.to(t))) << t;
    torch::Tensor wide = torch::empty({n});
    CastCpu(narrow.data_ptr(), kt, wide.data_ptr(), DType::kFloat32, n);
    EXPECT_TRUE(torch::equal(wide, narrow.to(torch::kFloat))) << t;
  }
  torch::Tensor h = x.to(torch::kHalf), b = torch::empty({n}, torch::kBFloat16);
  CastCpu(h.data_ptr(), DType::kFloat16, b.data_ptr(), DType::kBFloat16, n);
  EXPECT_TRUE(torch::equal(b, h.to(torch::kFloat).to(torch::kBFloat16)));
}

// See Note [Integer conversions]: the integer-only conversions the CUDA kernels
// use give the twins' bits for every 16-bit input, and for every float whose
// low 16 bits are one of the patterns around the half and bf16 rounding
// points (all 2^32 floats agree too; too slow for a unit test).
TEST(KernelsCpuTest, IntegerConversionsEqualTheTwins) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const auto v = static_cast<uint16_t>(h);
    ASSERT_EQ(bits::HalfToFloat(v), detail::BitsFromFloat(HalfBitsToFloat(v)))
        << std::hex << h;
    ASSERT_EQ(bits::Bf16ToFloat(v), detail::BitsFromFloat(Bf16BitsToFloat(v)))
        << std::hex << h;
  }
  const uint32_t lows[] = {0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001,
                           0x1FFF, 0x2000, 0x3000, 0x5000, 0x7FFF,
                           0x8000, 0x8001, 0xC000, 0xFFFF};
  for (uint32_t high = 0; high < 65536; ++high) {
    for (uint32_t low : lows) {
      const uint32_t w = (high << 16) | low;
      const float f = detail::FloatFromBits(w);
      ASSERT_EQ(bits::FloatToHalf(w), FloatToHalfBits(f)) << std::hex << w;
      ASSERT_EQ(bits::FloatToBf16(w), FloatToBf16Bits(f)) << std::hex << w;
    }
  }
}

// CastCpu's vectorised paths (F16C for float <-> half where the processor
// has it, the -O3 loops otherwise) against the scalar conversions: every
// 16-bit input, and the floats of the sweep above (the rounding points, NaN
// payloads, subnormals, infinities) in one call of 917,504 elements.
TEST(KernelsCpuTest, CastCpuEqualsTheScalarConversions) {
  std::vector<uint16_t> all16(65536);
  for (uint32_t h = 0; h < 65536; ++h) all16[h] = static_cast<uint16_t>(h);
  std::vector<float> wide(all16.size());
  for (auto from : {DType::kFloat16, DType::kBFloat16}) {
    CastCpu(all16.data(), from, wide.data(), DType::kFloat32,
            static_cast<int64_t>(all16.size()));
    for (uint32_t h = 0; h < 65536; ++h) {
      const float want = from == DType::kFloat16
                             ? HalfBitsToFloat(static_cast<uint16_t>(h))
                             : Bf16BitsToFloat(static_cast<uint16_t>(h));
      ASSERT_EQ(detail::BitsFromFloat(wide[h]), detail::BitsFromFloat(want))
          << std::hex << h;
    }
  }
  const uint32_t lows[] = {0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001,
                           0x1FFF, 0x2000, 0x3000, 0x5000, 0x7FFF,
                           0x8000, 0x8001, 0xC000, 0xFFFF};
  std::vector<float> floats;
  for (uint32_t high = 0; high < 65536; ++high) {
    for (uint32_t low : lows) {
      floats.push_back(detail::FloatFromBits((high << 16) | low));
    }
  }
  std::vector<uint16_t> narrow(floats.size());
  for (auto to : {DType::kFloat16, DType::kBFloat16}) {
    CastCpu(floats.data(), DType::kFloat32, narrow.data(), to,
            static_cast<int64_t>(floats.size()));
    for (size_t i = 0; i < floats.size(); ++i) {
      const uint16_t want = to == DType::kFloat16 ? FloatToHalfBits(floats[i])
                                                  : FloatToBf16Bits(floats[i]);
      ASSERT_EQ(narrow[i], want)
          << std::hex << detail::BitsFromFloat(floats[i]);
    }
  }
}

#if defined(CONCORD_KERNELS_CUDA)
TEST(KernelsCudaTest, ScaleMatchesCpuTwin) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    GTEST_SKIP() << "CONCORD_TEST_SKIPPED: no CUDA device";
  }
  const int64_t n = 100003;
  std::vector<float> host(n);
  for (int64_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 977) - 3.5f;
  std::vector<float> expected = host;
  ScaleCpu(expected.data(), n, 0.25f);
  float* device = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&device), n * sizeof(float)),
            cudaSuccess);
  cudaMemcpy(device, host.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  ASSERT_EQ(ScaleCuda(device, n, 0.25f, nullptr), cudaSuccess);
  cudaMemcpy(host.data(), device, n * sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(device);
  EXPECT_EQ(host, expected);
}
#endif

}  // namespace
}  // namespace concord::kernels
