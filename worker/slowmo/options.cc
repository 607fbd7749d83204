#include "worker/slowmo/options.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace concord::slowmo {

absl::StatusOr<GraphType> GraphOf(const concord::SlowMoOptions& o) {
  absl::StatusOr<GraphType> graph = ParseGraphType(o.sgp_graph());
  if (!graph.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sgp_graph: ", graph.status().message()));
  }
  return *graph;
}

absl::Status ValidateOptions(const concord::SlowMoOptions& o,
                             const SlowMoInternals& internals) {
  if (absl::StatusOr<GraphType> graph = GraphOf(o); !graph.ok()) {
    return graph.status();
  }
  if (o.nprocs_per_node() < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nprocs_per_node must be >= 1, got ", o.nprocs_per_node()));
  }
  if (o.slowmo_frequency() < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "slowmo_frequency must be >= 1, got ", o.slowmo_frequency()));
  }
  if (o.localsgd_frequency() < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "localsgd_frequency must be >= 1, got ", o.localsgd_frequency()));
  }
  if (o.slowmo_num_shards() < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "slowmo_num_shards must be >= 1, got ", o.slowmo_num_shards()));
  }
  if (!(o.slowmo_momentum() >= 0.0 && o.slowmo_momentum() < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "slowmo_momentum must be in [0, 1), got ", o.slowmo_momentum()));
  }
  if (!(o.slowmo_lr() > 0.0) || !std::isfinite(o.slowmo_lr())) {
    return absl::InvalidArgumentError(
        absl::StrCat("slowmo_lr must be > 0, got ", o.slowmo_lr()));
  }
  if (o.peers_per_itr() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("peers_per_itr must be >= 1, got ", o.peers_per_itr()));
  }
  if (internals.collective_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("collective_timeout must be positive");
  }
  return absl::OkStatus();
}

}  // namespace concord::slowmo
