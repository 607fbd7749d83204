#pragma once
// SlowMo's options as the library runs them: the public
// concord::SlowMoOptions (concord/slowmo_options.h, the one home of
// fairscale's arguments and their defaults) resolved (the peer graph parsed)
// and completed with what the job gives (the node, the collective timeout,
// DDP's broadcast_buffers). No LibTorch here but <torch/arg.h>.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "concord/slowmo_options.h"
#include "worker/slowmo/gossip_graph.h"

namespace concord::slowmo {

// The public enum (concord/slowmo_options.h), by its shorter name inside.
using BaseAlgorithm = concord::SlowMoBaseAlgorithm;

// The public struct's defaults, made once.
const concord::SlowMoOptions& PublicDefaults();

struct SlowMoOptions {
  BaseAlgorithm base_algorithm = BaseAlgorithm::kLocalSgd;
  double slowmo_momentum = PublicDefaults().slowmo_momentum();
  bool slowmo_memory_efficient = PublicDefaults().slowmo_memory_efficient();
  int64_t slowmo_frequency = PublicDefaults().slowmo_frequency();
  double slowmo_lr = PublicDefaults().slowmo_lr();
  int slowmo_num_shards = PublicDefaults().slowmo_num_shards();
  int64_t localsgd_frequency = PublicDefaults().localsgd_frequency();
  GraphType graph = GraphType::kNPeerDirectedExponential;
  int peers_per_itr = PublicDefaults().peers_per_itr();
  bool push_sum = PublicDefaults().push_sum();
  bool slowmo_sgp_average_params = PublicDefaults().slowmo_sgp_average_params();
  // fairscale's broadcast_buffers: the module's buffers are broadcast from
  // the authoritative rank before every forward (PrepareForward).
  bool broadcast_buffers = true;
  // See Note [Node hierarchy] in worker/slowmo/hierarchy.h: > 1 groups the
  // ranks into nodes of at most this many processes that share `node_id`.
  int nprocs_per_node = PublicDefaults().nprocs_per_node();
  // This worker's node (WorkerOptions::node_id); ranks with the same one
  // share a node. Empty everywhere: nodes of nprocs_per_node consecutive
  // ranks, fairscale's layout.
  std::string node_id;
  absl::Duration collective_timeout = absl::Minutes(5);
};

// INVALID_ARGUMENT with a one-line reason for a bad value.
absl::Status ValidateOptions(const SlowMoOptions& options);

// The public options resolved and checked (INVALID_ARGUMENT, one line, naming
// the field); node_id, collective_timeout and broadcast_buffers keep their
// defaults for the caller to set.
absl::StatusOr<SlowMoOptions> FromPublic(const concord::SlowMoOptions& o);

}  // namespace concord::slowmo
