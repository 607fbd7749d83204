#include <gtest/gtest.h>
#include <torch/torch.h>

#include "kernels/scale.h"

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

#if defined(CONCORD_KERNELS_CUDA)
TEST(KernelsCudaTest, ScaleMatchesCpuTwin) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    GTEST_SKIP() << "skipped: no CUDA device";
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
