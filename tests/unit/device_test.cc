// See Note [Worker device]: the device and backend decisions, on CPU.

#include "worker/device.h"

#include <gtest/gtest.h>

namespace concord {
namespace {

using Kind = DeviceRequest::Kind;

TEST(DeviceRequestTest, ParsesEveryForm) {
  ASSERT_EQ(ParseDeviceRequest("cpu")->kind, Kind::kCpu);
  ASSERT_EQ(ParseDeviceRequest("auto")->kind, Kind::kAuto);
  auto cuda = ParseDeviceRequest("cuda");
  ASSERT_TRUE(cuda.ok());
  EXPECT_EQ(cuda->kind, Kind::kCuda);
  EXPECT_EQ(cuda->index, -1);
  auto two = ParseDeviceRequest("cuda:2");
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(two->index, 2);
  EXPECT_EQ(two->ToString(), "cuda:2");
  EXPECT_EQ(cuda->ToString(), "cuda");
}

TEST(DeviceRequestTest, RefusesWhatIsNotADevice) {
  for (const char* bad :
       {"", "gpu", "CUDA", "cuda:", "cuda:-1", "cuda:x", "cuda:1:2", "cuda0",
        "cuda:99999999999", " cpu", "mps"}) {
    auto r = ParseDeviceRequest(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("expected cpu, cuda, cuda:N or auto"),
              std::string::npos);
  }
}

TEST(ResolveDeviceTest, CpuIsTheCpuWhateverTheMachine) {
  for (int devices : {0, 1, 8}) {
    auto r = ResolveDevice(*ParseDeviceRequest("cpu"), 3, devices, "");
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->device, WorkerDevice{});
    EXPECT_TRUE(r->note.empty());
  }
}

TEST(ResolveDeviceTest, CudaIsTheLocalRanksDevice) {
  for (int local = 0; local < 4; ++local) {
    auto r = ResolveDevice(*ParseDeviceRequest("cuda"), local, 4, "");
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->device.ToString(), "cuda:" + std::to_string(local));
  }
  // No launcher: local rank unknown (-1) is device 0.
  EXPECT_EQ(
      ResolveDevice(*ParseDeviceRequest("cuda"), -1, 2, "")->device.ToString(),
      "cuda:0");
}

TEST(ResolveDeviceTest, NamedDeviceIgnoresTheLocalRank) {
  // Several processes sharing one GPU (over Gloo) all name cuda:0.
  for (int local = 0; local < 4; ++local) {
    auto r = ResolveDevice(*ParseDeviceRequest("cuda:0"), local, 1, "");
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->device.ToString(), "cuda:0");
  }
}

TEST(ResolveDeviceTest, CudaWithoutADeviceNamesTheProblem) {
  auto r = ResolveDevice(*ParseDeviceRequest("cuda"), 0, 0,
                         "LibTorch 1.13.0 was built without CUDA");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.status().message(),
            "device cuda: no CUDA device is visible (LibTorch 1.13.0 was "
            "built without CUDA)");
  auto named = ResolveDevice(*ParseDeviceRequest("cuda:1"), 0, 1, "");
  ASSERT_FALSE(named.ok());
  EXPECT_EQ(named.status().message(),
            "device cuda:1: only 1 CUDA device is visible");
  auto rank = ResolveDevice(*ParseDeviceRequest("cuda"), 2, 2, "");
  ASSERT_FALSE(rank.ok());
  EXPECT_NE(rank.status().message().find("local rank 2 has no CUDA device"),
            std::string::npos)
      << rank.status();
  for (const auto& s : {r.status(), named.status(), rank.status()}) {
    EXPECT_EQ(std::string(s.message()).find('\n'), std::string::npos);
  }
}

TEST(ResolveDeviceTest, AutoFallsBackToTheCpuAndSaysWhy) {
  auto r = ResolveDevice(*ParseDeviceRequest("auto"), 1, 0, "no driver");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->device, WorkerDevice{});
  EXPECT_EQ(r->note,
            "device auto: no CUDA device is visible (no driver); training on "
            "the CPU");
  auto gpu = ResolveDevice(*ParseDeviceRequest("auto"), 1, 2, "");
  ASSERT_TRUE(gpu.ok());
  EXPECT_EQ(gpu->device.ToString(), "cuda:1");
  EXPECT_TRUE(gpu->note.empty());
  // More local ranks than devices: an error, not a silent CPU worker.
  EXPECT_FALSE(ResolveDevice(*ParseDeviceRequest("auto"), 2, 2, "").ok());
}

TEST(BackendTest, ParsesAndRefuses) {
  EXPECT_EQ(*ParseBackendRequest("auto"), BackendRequest::kAuto);
  EXPECT_EQ(*ParseBackendRequest("gloo"), BackendRequest::kGloo);
  EXPECT_EQ(*ParseBackendRequest("nccl"), BackendRequest::kNccl);
  auto bad = ParseBackendRequest("mpi");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
}

// Which communicator a worker builds for which device.
TEST(BackendTest, ChoosesTheCommunicatorForTheDevice) {
  const WorkerDevice cpu;
  const WorkerDevice gpu{DeviceType::kCuda, 0};
  // auto: NCCL on a GPU when built with it; Gloo otherwise.
  EXPECT_EQ(*ChooseBackend(BackendRequest::kAuto, cpu, true), Backend::kGloo);
  EXPECT_EQ(*ChooseBackend(BackendRequest::kAuto, gpu, true), Backend::kNccl);
  EXPECT_EQ(*ChooseBackend(BackendRequest::kAuto, gpu, false), Backend::kGloo);
  // gloo: always (CUDA tensors staged through host memory).
  EXPECT_EQ(*ChooseBackend(BackendRequest::kGloo, gpu, true), Backend::kGloo);
  EXPECT_EQ(*ChooseBackend(BackendRequest::kGloo, cpu, false), Backend::kGloo);
  // nccl: only a CUDA worker of a build with NCCL.
  EXPECT_EQ(*ChooseBackend(BackendRequest::kNccl, gpu, true), Backend::kNccl);
  auto on_cpu = ChooseBackend(BackendRequest::kNccl, cpu, true);
  ASSERT_FALSE(on_cpu.ok());
  EXPECT_EQ(on_cpu.status().message(),
            "backend nccl needs a CUDA device; this worker's is cpu");
  auto unbuilt = ChooseBackend(BackendRequest::kNccl, gpu, false);
  ASSERT_FALSE(unbuilt.ok());
  EXPECT_EQ(unbuilt.status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace concord
