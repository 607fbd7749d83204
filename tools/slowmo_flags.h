#pragma once
// concord-train's --algorithm and SlowMo flags, named like fairscale's
// SlowMoDistributedDataParallel arguments (no LibTorch here).

#include <CLI/CLI.hpp>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "worker/slowmo/options.h"

namespace concord::train {

struct SlowMoFlags {
  std::string algorithm = "ddp";  // ddp|localsgd|slowmo-localsgd|slowmo-sgp
  int64_t localsgd_frequency = 3;
  int64_t slowmo_frequency = 48;
  double slowmo_momentum = 0.5;
  double slowmo_lr = 1.0;
  int slowmo_num_shards = 32;
  bool slowmo_memory_efficient = true;
  int nprocs_per_node = 1;
  std::string sgp_graph = "npeer-directed-exponential";
  bool push_sum = true;
  bool slowmo_sgp_average_params = false;
  // Which of the flags were given (a SlowMo flag with --algorithm ddp, or a
  // slow-momentum one with localsgd, is an error rather than ignored).
  std::vector<std::string> given;
};

// Adds the options to `app` (group "SlowMo").
void AddSlowMoFlags(CLI::App& app, SlowMoFlags* flags);

// The SlowMo options the flags ask for; nullopt for --algorithm ddp.
// INVALID_ARGUMENT (one line, naming the flag) for values that do not fit.
absl::StatusOr<std::optional<slowmo::SlowMoOptions>> SlowMoOptionsFrom(
    const SlowMoFlags& flags);

}  // namespace concord::train
