#pragma once
// concord-train's command line (no LibTorch here but <torch/arg.h>): every
// flag, parsed and checked against each other before anything is loaded;
// those of the job (--device, --backend, --checkpoint-*) are checked with
// the environment's values by concord::plan_job, also before.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "concord/ddp_options.h"
#include "concord/zero_options.h"
#include "tools/slowmo_flags.h"

namespace concord::train {

struct TrainFlags {
  std::string model;
  std::string data;
  std::string loss = "cross_entropy";
  std::string optimizer = "sgd";
  double lr = 0.01;
  double momentum = 0;
  double weight_decay = 0;
  // ZeroRedundancyOptimizer over the optimizer, with these options.
  bool zero = false;
  concord::ZeroOptions zero_options;
  // ZeroOptions::overlap_with_ddp through hook_with_zero_step ("step") or
  // hook_with_zero_step_interleaved ("interleaved"); empty: no overlap.
  std::string zero_overlap;
  bool zero_shard_buckets = false;
  int64_t batch_size = 32;
  int64_t epochs = 1;
  bool shuffle = false;
  uint64_t seed = 0;
  std::string output;
  std::string metrics_out;
  int64_t log_interval = 10;
  std::string log_level = "info";
  std::string trace;
  // JobOptions::device and backend (see Note [Worker device] in
  // worker/device.h): empty = CONCORD_DEVICE's, else the CPU;
  // CONCORD_BACKEND's, else auto.
  std::string device;
  std::string backend;
  // DDP: PyTorch's and apex's options, parsed straight into the public
  // struct (its defaults are the flags'); SlowMo's go into its `slowmo`.
  concord::DdpOptions ddp;
  int64_t grad_accum = 1;
  bool sync_bn = false;
  // Elastic training.
  std::string sharding = "elastic";
  bool no_divide_by_initial_world_size = false;
  bool throw_on_early_termination = false;
  std::string output_per_worker;
  std::string sample_log;
  // Checkpoints (see Note [Checkpoints] in worker/checkpoint/checkpointer.h);
  // unset: the environment's (concord-run's).
  std::optional<std::string> checkpoint_dir;
  std::optional<int64_t> checkpoint_every;
  std::optional<int> checkpoint_keep;
  bool no_resume = false;
  // SlowMo: --algorithm and fairscale's arguments.
  concord::train::SlowMoFlags slowmo;
};

// Parses argv. --help prints the usage and exits 0; INVALID_ARGUMENT (one
// line, naming the flag) for a flag that is unknown, malformed or does not
// fit with the others.
absl::StatusOr<TrainFlags> ParseTrainFlags(int argc, char** argv);

}  // namespace concord::train
