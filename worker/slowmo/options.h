#pragma once
// What SlowMo needs besides the public concord::SlowMoOptions
// (concord/slowmo_options.h), and the options' checks. No LibTorch here but
// <torch/arg.h>.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/job_defaults.h"
#include "concord/slowmo_options.h"
#include "worker/slowmo/gossip_graph.h"

namespace concord::slowmo {

// The public enum (concord/slowmo_options.h), by its shorter name inside.
using BaseAlgorithm = concord::SlowMoBaseAlgorithm;

// What SlowMo runs with besides the user's concord::SlowMoOptions (the one
// home of fairscale's arguments and their defaults): what the job and DDP
// give, never a user.
struct SlowMoInternals {
  // DDP's broadcast_buffers (fairscale's): the module's buffers are
  // broadcast from the authoritative rank before every forward
  // (PrepareForward).
  bool broadcast_buffers = true;
  // This worker's node (WorkerOptions::node_id); ranks with the same one
  // share a node (see Note [Node hierarchy] in worker/slowmo/hierarchy.h,
  // for nprocs_per_node > 1). Empty everywhere: nodes of nprocs_per_node
  // consecutive ranks, fairscale's layout.
  std::string node_id;
  absl::Duration collective_timeout = kDefaultCollectiveTimeout;
};

// INVALID_ARGUMENT with a one-line reason naming the field for a bad value
// (an unknown sgp_graph among them).
absl::Status ValidateOptions(const concord::SlowMoOptions& options,
                             const SlowMoInternals& internals = {});

// The options' sgp_graph parsed (INVALID_ARGUMENT "sgp_graph: ...").
absl::StatusOr<GraphType> GraphOf(const concord::SlowMoOptions& options);

}  // namespace concord::slowmo
