#include "worker/slowmo/options.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace concord::slowmo {

const concord::SlowMoOptions& PublicDefaults() {
  static const concord::SlowMoOptions defaults;
  return defaults;
}

absl::StatusOr<SlowMoOptions> FromPublic(const concord::SlowMoOptions& o) {
  SlowMoOptions s;
  s.base_algorithm = o.base_algorithm();
  s.localsgd_frequency = o.localsgd_frequency();
  s.slowmo_momentum = o.slowmo_momentum();
  s.slowmo_lr = o.slowmo_lr();
  s.slowmo_frequency = o.slowmo_frequency();
  s.slowmo_memory_efficient = o.slowmo_memory_efficient();
  s.slowmo_num_shards = o.slowmo_num_shards();
  s.nprocs_per_node = o.nprocs_per_node();
  absl::StatusOr<GraphType> graph = ParseGraphType(o.sgp_graph());
  if (!graph.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sgp_graph: ", graph.status().message()));
  }
  s.graph = *graph;
  s.peers_per_itr = o.peers_per_itr();
  s.push_sum = o.push_sum();
  s.slowmo_sgp_average_params = o.slowmo_sgp_average_params();
  if (absl::Status valid = ValidateOptions(s); !valid.ok()) return valid;
  return s;
}

absl::Status ValidateOptions(const SlowMoOptions& o) {
  if (o.nprocs_per_node < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("nprocs_per_node must be >= 1, got ", o.nprocs_per_node));
  }
  if (o.slowmo_frequency < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "slowmo_frequency must be >= 1, got ", o.slowmo_frequency));
  }
  if (o.localsgd_frequency < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "localsgd_frequency must be >= 1, got ", o.localsgd_frequency));
  }
  if (o.slowmo_num_shards < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "slowmo_num_shards must be >= 1, got ", o.slowmo_num_shards));
  }
  if (!(o.slowmo_momentum >= 0.0 && o.slowmo_momentum < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "slowmo_momentum must be in [0, 1), got ", o.slowmo_momentum));
  }
  if (!(o.slowmo_lr > 0.0) || !std::isfinite(o.slowmo_lr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("slowmo_lr must be > 0, got ", o.slowmo_lr));
  }
  if (o.peers_per_itr < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("peers_per_itr must be >= 1, got ", o.peers_per_itr));
  }
  if (o.collective_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("collective_timeout must be positive");
  }
  return absl::OkStatus();
}

}  // namespace concord::slowmo
