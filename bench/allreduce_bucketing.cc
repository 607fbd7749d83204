// Bucketed vs raw Gloo allreduce, ranks as threads on loopback.
//
//   build/bin/concord-bench-allreduce [--world 2] [--repeat 20] [--cap-mb 25]
//
// The gradient sizes are those of a ResNet-50-like model (161 tensors, 25.6 M
// floats) unless --tensors N --numel M asks for N tensors of M floats. Prints
// the median time per step of: one allreduce per tensor (all in flight, then
// waited), and DDP-style buckets (copy into flat buckets of --cap-mb, one
// allreduce each, copy back), and their ratio.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "bench/model_sizes.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/comm/store.h"
#include "worker/ddp/bucket_assignment.h"

namespace {

using concord::comm::Communicator;
using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Result {
  double raw_ms = 0, bucketed_ms = 0;
  size_t buckets = 0;
};

void RunRank(int rank, int world, int repeat, int64_t cap_bytes,
             const std::vector<int64_t>& sizes,
             concord::comm::InMemoryStore* store, Result* out) {
  concord::comm::GlooOptions o;
  o.rank = rank;
  o.size = world;
  auto comm = concord::comm::GlooCommunicator::Create(o, store);
  if (!comm.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank,
                 comm.status().ToString().c_str());
    std::exit(1);
  }
  std::vector<at::Tensor> grads;
  for (int64_t n : sizes) grads.push_back(at::randn({n}));
  // Buckets as the reducer lays them out after its rebuild.
  std::vector<concord::ddp::GradSpec> specs;
  std::vector<size_t> order;
  for (size_t i = 0; i < sizes.size(); ++i) {
    specs.push_back({sizes[i] * 4, 0});
    order.push_back(sizes.size() - 1 - i);
  }
  const auto assignment =
      concord::ddp::ComputeBucketAssignment(specs, order, 1 << 20, cap_bytes);
  std::vector<at::Tensor> flats;
  for (const auto& b : assignment) {
    int64_t n = 0;
    for (size_t i : b) n += sizes[i];
    flats.push_back(at::empty({n}));
  }
  std::vector<double> raw, bucketed;
  for (int r = 0; r < repeat + 2; ++r) {
    auto t0 = Clock::now();
    std::vector<std::shared_ptr<concord::comm::Work>> works;
    for (size_t i = order.size(); i-- > 0;) {
      works.push_back((*comm)->AllreduceSum(grads[order[i]], {}));
    }
    for (auto& w : works) (void)w->Wait();
    auto t1 = Clock::now();
    works.clear();
    for (size_t b = 0; b < assignment.size(); ++b) {
      int64_t off = 0;
      for (size_t i : assignment[b]) {
        flats[b].narrow(0, off, sizes[i]).copy_(grads[i]);
        off += sizes[i];
      }
      works.push_back((*comm)->AllreduceSum(flats[b], {}));
    }
    for (size_t b = 0; b < assignment.size(); ++b) {
      (void)works[b]->Wait();
      int64_t off = 0;
      for (size_t i : assignment[b]) {
        grads[i].copy_(flats[b].narrow(0, off, sizes[i]));
        off += sizes[i];
      }
    }
    auto t2 = Clock::now();
    if (r >= 2) {  // warm-up
      raw.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      bucketed.push_back(
          std::chrono::duration<double, std::milli>(t2 - t1).count());
    }
  }
  if (rank == 0) {
    out->raw_ms = Median(raw);
    out->bucketed_ms = Median(bucketed);
    out->buckets = assignment.size();
  }
}

}  // namespace

int main(int argc, char** argv) {
  int world = 2, repeat = 20;
  double cap_mb = 25;
  int64_t tensors = 0, numel = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--world")
      world = std::atoi(argv[i + 1]);
    else if (flag == "--repeat")
      repeat = std::atoi(argv[i + 1]);
    else if (flag == "--cap-mb")
      cap_mb = std::atof(argv[i + 1]);
    else if (flag == "--tensors")
      tensors = std::atoll(argv[i + 1]);
    else if (flag == "--numel")
      numel = std::atoll(argv[i + 1]);
    else {
      std::fprintf(stderr, "concord-bench-allreduce: unknown flag %s\n",
                   argv[i]);
      return 2;
    }
  }
  if (world < 1 || repeat < 1 || cap_mb <= 0) {
    std::fprintf(stderr,
                 "concord-bench-allreduce: bad --world/--repeat/--cap-mb\n");
    return 2;
  }
  at::set_num_threads(1);
  const std::vector<int64_t> sizes =
      tensors > 0 ? std::vector<int64_t>(tensors, std::max<int64_t>(numel, 1))
                  : concord::bench::ResNet50Like();
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  concord::comm::InMemoryStore store;
  Result result;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back(RunRank, r, world, repeat,
                         static_cast<int64_t>(cap_mb * 1024 * 1024), sizes,
                         &store, &result);
  }
  for (auto& t : threads) t.join();
  std::printf("world %d, %zu tensors, %.1f MB of float32 gradients, %d steps\n",
              world, sizes.size(), total * 4 / 1e6, repeat);
  std::printf("%-34s %10.2f ms\n", "raw: one allreduce per tensor",
              result.raw_ms);
  std::printf("%-34s %10.2f ms  (%zu buckets, cap %.1f MB)\n",
              "bucketed: DDP buckets + copies", result.bucketed_ms,
              result.buckets, cap_mb);
  std::printf("%-34s %10.2f\n", "ratio raw / bucketed",
              result.raw_ms / result.bucketed_ms);
  return 0;
}
