// concord-bench-syncbn: the Concord half of bench/syncbn_vs_pytorch.py.
// Times concord::SyncBatchNorm forward + backward and prints one JSON
// object: {"ms_per_step_median", "ms_per_step_mean", ...} of rank 0.
//
//   concord-bench-syncbn --world 2 --device cuda --backend nccl
//       --batch 32 --channels 256 --spatial 56 --dtype float32
//       [--channels-last] [--iters 50] [--warmup 5]
//   concord-run --standalone --nproc 2 -- concord-bench-syncbn --session ...
//
// Without --session the W ranks are threads of this process (Gloo over
// loopback; NCCL with one GPU per rank): --device cuda puts rank r on
// cuda:r. Ranks that share one GPU must be processes (LibTorch runs every
// backward on a device in one thread: one rank's SyncBatchNorm backward
// would wait for a peer queued behind it), so with --session this process
// is one worker of a Concord job: the job's size is the world, the session's
// communicator is the group, and --device / --backend (cpu, cuda = cuda:<local
// rank>, cuda:N; gloo, nccl) choose as concord-train's do. Each timed step
// is forward, backward of (y * g).sum() and a device synchronisation, as the
// Python side does with nn.SyncBatchNorm. Not a test.

#include <torch/cuda.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "concord/config.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/comm/store.h"
#include "worker/session.h"
#include "worker/syncbn/sync_batch_norm.h"
#if CONCORD_HAVE_NCCL && CONCORD_TORCH_CUDA
#include "worker/comm/nccl/nccl_communicator.h"
#endif

namespace {

struct Config {
  int world = 2;
  std::string device = "cpu";
  std::string backend = "gloo";
  int64_t batch = 32, channels = 256, spatial = 56;
  std::string dtype = "float32";
  bool channels_last = false;
  int iters = 50, warmup = 5;
  bool session = false;
};

torch::Device RankDevice(const Config& c, int rank) {
  if (c.device == "cpu") return torch::kCPU;
  if (c.device == "cuda") {
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(rank));
  }
  return torch::Device(c.device);
}

absl::StatusOr<std::unique_ptr<concord::comm::Communicator>> Connect(
    const Config& c, int rank, concord::comm::Store* store) {
  if (c.backend == "nccl") {
#if CONCORD_HAVE_NCCL && CONCORD_TORCH_CUDA
    concord::comm::NcclOptions nccl;
    nccl.rank = rank;
    nccl.size = c.world;
    nccl.generation = 1;
    nccl.device = RankDevice(c, rank).index();
    nccl.connect_timeout = absl::Seconds(60);
    auto made = concord::comm::NcclCommunicator::Create(nccl, store);
    if (!made.ok()) return made.status();
    return std::unique_ptr<concord::comm::Communicator>(std::move(*made));
#else
    return absl::FailedPreconditionError(
        "this build has no NCCL communicator (NCCL and a CUDA LibTorch)");
#endif
  }
  concord::comm::GlooOptions gloo;
  gloo.rank = rank;
  gloo.size = c.world;
  gloo.generation = 1;
  gloo.connect_timeout = absl::Seconds(60);
  auto made = concord::comm::GlooCommunicator::Create(gloo, store);
  if (!made.ok()) return made.status();
  return std::unique_ptr<concord::comm::Communicator>(std::move(*made));
}

// Milliseconds of each timed step of a rank on `device` in `comm`'s group.
std::vector<double> RunRank(const Config& c, const torch::Device& device,
                            std::shared_ptr<concord::comm::Communicator> comm) {
  concord::comm::CollectiveOptions collective;
  collective.timeout = absl::Seconds(60);
  const int rank = comm->rank();
  concord::SyncBatchNorm bn(
      torch::nn::BatchNormOptions(c.channels),
      std::make_shared<concord::SyncBnGroup>(std::move(comm), collective));
  bn->to(device);
  const auto dtype = c.dtype == "float16"    ? torch::kHalf
                     : c.dtype == "bfloat16" ? torch::kBFloat16
                                             : torch::kFloat;
  const auto memory_format = c.channels_last ? at::MemoryFormat::ChannelsLast
                                             : at::MemoryFormat::Contiguous;
  torch::manual_seed(rank);
  auto options = torch::TensorOptions().device(device).dtype(dtype);
  torch::Tensor x =
      torch::randn({c.batch, c.channels, c.spatial, c.spatial}, options)
          .contiguous(memory_format)
          .requires_grad_(true);
  torch::Tensor g = torch::randn_like(x);
  auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
  };
  std::vector<double> ms;
  for (int i = 0; i < c.warmup + c.iters; ++i) {
    sync();
    const auto t0 = std::chrono::steady_clock::now();
    (bn->forward(x) * g).sum().backward();
    sync();
    const auto t1 = std::chrono::steady_clock::now();
    if (i >= c.warmup) {
      ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
  }
  return ms;
}

void PrintResult(const Config& c, int world, std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  const double mean = std::accumulate(ms.begin(), ms.end(), 0.0) /
                      static_cast<double>(ms.size());
  std::printf(
      "{\"ms_per_step_median\": %.4f, \"ms_per_step_mean\": %.4f, "
      "\"iters\": %zu, \"world\": %d, \"device\": \"%s\", \"backend\": "
      "\"%s\"}\n",
      ms[ms.size() / 2], mean, ms.size(), world, c.device.c_str(),
      c.backend.c_str());
}

// --session: one worker of a Concord job; rank 0 prints.
int RunSession(const Config& c) {
  auto options = concord::worker::WorkerOptions::FromEnvironment();
  if (!options.ok()) {
    std::fprintf(stderr, "concord-bench-syncbn: %s\n",
                 options.status().ToString().c_str());
    return 2;
  }
  options->device = *concord::ParseDeviceRequest(c.device);
  options->backend = *concord::ParseBackendRequest(c.backend);
  auto started = concord::worker::Session::Start(*options);
  if (!started.ok()) {
    std::fprintf(stderr, "concord-bench-syncbn: cannot join: %s\n",
                 started.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<concord::worker::Session> session = std::move(*started);
  std::vector<double> ms;
  try {
    ms = RunRank(c, session->torch_device(), session->shared_communicator());
  } catch (const std::exception& e) {
    session->Finish(false, e.what()).IgnoreError();
    std::fprintf(stderr, "concord-bench-syncbn: %s\n", e.what());
    return 1;
  }
  if (session->rank() == 0) PrintResult(c, session->world_size(), ms);
  return session->Finish(true, "").ok() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"concord::SyncBatchNorm forward + backward step time"};
  Config c;
  app.add_option("--world", c.world, "ranks (threads; not with --session)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--device", c.device, "cpu, cuda (rank r on cuda:r), cuda:N")
      ->capture_default_str();
  app.add_option("--backend", c.backend)
      ->check(CLI::IsMember({"gloo", "nccl"}))
      ->capture_default_str();
  app.add_option("--batch", c.batch, "per rank")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--channels", c.channels)
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--spatial", c.spatial, "H = W")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--dtype", c.dtype)
      ->check(CLI::IsMember({"float32", "float16", "bfloat16"}))
      ->capture_default_str();
  app.add_flag("--channels-last", c.channels_last);
  app.add_option("--iters", c.iters)
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--warmup", c.warmup)
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_flag("--session", c.session,
               "one worker of a Concord job (under concord-run), a process "
               "per rank");
  CLI11_PARSE(app, argc, argv);
  if (const auto request = concord::ParseDeviceRequest(c.device);
      !request.ok()) {
    std::fprintf(stderr, "concord-bench-syncbn: --device %s: %s\n",
                 c.device.c_str(),
                 std::string(request.status().message()).c_str());
    return 2;
  }
  if (c.device != "cpu" && !torch::cuda::is_available()) {
    std::fprintf(stderr,
                 "concord-bench-syncbn: --device %s: no CUDA device is "
                 "visible\n",
                 c.device.c_str());
    return 2;
  }
  if (c.session) return RunSession(c);
  if (c.device != "cpu" && c.device != "cuda" && c.world > 1) {
    std::fprintf(stderr,
                 "concord-bench-syncbn: --device %s: ranks that share a GPU "
                 "must be processes (LibTorch runs a device's backward in "
                 "one thread): run them under concord-run with --session\n",
                 c.device.c_str());
    return 2;
  }
  if (c.device == "cuda" &&
      c.world > static_cast<int>(torch::cuda::device_count())) {
    std::fprintf(stderr,
                 "concord-bench-syncbn: --device cuda puts rank r on cuda:r: "
                 "%d ranks, %d device(s)\n",
                 c.world, static_cast<int>(torch::cuda::device_count()));
    return 2;
  }

  concord::comm::InMemoryStore store;
  std::vector<std::vector<double>> times(static_cast<size_t>(c.world));
  std::vector<std::string> errors;
  std::mutex mu;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < c.world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto comm = Connect(c, rank, &store);
        TORCH_CHECK(comm.ok(), comm.status().ToString());
        times[static_cast<size_t>(rank)] = RunRank(
            c, RankDevice(c, rank),
            std::shared_ptr<concord::comm::Communicator>(std::move(*comm)));
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back(e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  if (!errors.empty()) {
    std::fprintf(stderr, "concord-bench-syncbn: %s\n", errors.front().c_str());
    return 1;
  }
  PrintResult(c, c.world, times.front());
  return 0;
}
