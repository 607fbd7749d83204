#pragma once
// concord-train's --algorithm and SlowMo flags, named like fairscale's
// SlowMoDistributedDataParallel arguments, parsed straight into the public
// concord::SlowMoOptions (concord/slowmo_options.h: its defaults are the
// flags' defaults). No LibTorch here but <torch/arg.h>.

#include <CLI/CLI.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "concord/slowmo_options.h"

namespace concord::train {

struct SlowMoFlags {
  std::string algorithm = "ddp";  // ddp|localsgd|slowmo-localsgd|slowmo-sgp
  concord::SlowMoOptions options;
  // Which of the flags were given (a SlowMo flag with --algorithm ddp, or a
  // slow-momentum one with localsgd, is an error rather than ignored).
  std::vector<std::string> given;
};

// Adds the options to `app` (group "SlowMo").
void AddSlowMoFlags(CLI::App& app, SlowMoFlags* flags);

// The SlowMo options the flags ask for; nullopt for --algorithm ddp.
// INVALID_ARGUMENT (one line, naming the flag) for values that do not fit.
absl::StatusOr<std::optional<concord::SlowMoOptions>> SlowMoOptionsFrom(
    const SlowMoFlags& flags);

}  // namespace concord::train
