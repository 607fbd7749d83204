// concord-bench-zero-save: one rank of a loop without run_elastic whose
// Adam state is sharded (concord::ZeroRedundancyOptimizer), saving it with
// concord::save_checkpoint; the Concord half of bench/zero_save.py, which
// runs it under `concord-run --standalone` with the shards written where
// they are (see Note [Shards written where they are] in
// worker/checkpoint/disk.h) and, as the other side, gathered on rank 0 as
// bytes (CONCORD_TEST_SHARDS_AS_BYTES=1).
//
// The model: --layers square Linear layers (no bias) holding --mib MiB of
// float parameters. One Adam step makes the state (2 floats a parameter,
// on the rank that steps it); then --saves checkpoints, each timed. Prints
// one JSON line per rank: the save's wall times (ms), the peak RSS before
// the first save and after the last (ru_maxrss, KiB), and the size of the
// shard of the state this rank holds (bytes).
#include <sys/resource.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "concord/checkpoint.h"
#include "concord/job.h"
#include "concord/zero.h"

namespace {

int64_t PeakKib() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss);
}

int Run(int argc, char** argv) {
  CLI::App app{"concord-bench-zero-save: save_checkpoint of a sharded Adam"};
  double mib = 64;
  int layers = 4;
  int saves = 3;
  std::string dir;
  app.add_option("--mib", mib, "MiB of parameters")->check(CLI::PositiveNumber);
  app.add_option("--layers", layers, "square Linear layers holding them")
      ->check(CLI::Range(1, 1024));
  app.add_option("--saves", saves, "checkpoints taken")
      ->check(CLI::Range(1, 100));
  app.add_option("--dir", dir, "the checkpoints' directory")->required();
  CLI11_PARSE(app, argc, argv);

  torch::manual_seed(0);
  const auto width =
      static_cast<int64_t>(std::sqrt(mib * (1 << 20) / sizeof(float) / layers));
  torch::nn::Sequential model;
  for (int i = 0; i < layers; ++i) {
    model->push_back(
        torch::nn::Linear(torch::nn::LinearOptions(width, width).bias(false)));
  }
  concord::Job job;
  concord::ZeroRedundancyOptimizer optimizer(
      model->parameters(), torch::optim::AdamOptions(1e-3), job);
  // One step: every rank's shard of the state exists.
  for (auto& p : model->parameters()) p.mutable_grad() = torch::ones_like(p);
  optimizer.step();
  int64_t shard_bytes = 0;
  for (const auto& [key, state] : optimizer.local_optimizer().state()) {
    const auto& adam = static_cast<const torch::optim::AdamParamState&>(*state);
    shard_bytes += adam.exp_avg().nbytes() + adam.exp_avg_sq().nbytes();
  }

  concord::CheckpointState saved;
  saved.add("optimizer", optimizer);
  const int64_t before = PeakKib();
  std::vector<double> ms;
  for (int s = 1; s <= saves; ++s) {
    const auto start = std::chrono::steady_clock::now();
    concord::save_checkpoint(job, dir, s, saved, /*keep=*/1);
    ms.push_back(std::chrono::duration<double, std::milli>(
                     std::chrono::steady_clock::now() - start)
                     .count());
  }
  std::cout << nlohmann::json{{"rank", job.rank()},
                              {"world", job.world_size()},
                              {"save_ms", ms},
                              {"peak_before_kib", before},
                              {"peak_after_kib", PeakKib()},
                              {"shard_bytes", shard_bytes}}
                   .dump()
            << std::endl;
  job.finish();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "concord-bench-zero-save: " << e.what() << "\n";
    return 1;
  }
}
