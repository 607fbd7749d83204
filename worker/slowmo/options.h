#pragma once
// SlowMo's options: fairscale's SlowMoDistributedDataParallel arguments and
// defaults (no LibTorch here: tools parse flags into them).

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "worker/slowmo/gossip_graph.h"

namespace concord::slowmo {

enum class BaseAlgorithm { kLocalSgd, kSgp };

// fairscale's constructor arguments and defaults.
struct SlowMoOptions {
  BaseAlgorithm base_algorithm = BaseAlgorithm::kLocalSgd;
  double slowmo_momentum = 0.5;
  bool slowmo_memory_efficient = true;
  int64_t slowmo_frequency = 48;
  double slowmo_lr = 1.0;
  int slowmo_num_shards = 32;
  int64_t localsgd_frequency = 3;
  GraphType graph = GraphType::kNPeerDirectedExponential;
  int peers_per_itr = 1;
  bool push_sum = true;
  bool slowmo_sgp_average_params = false;
  // fairscale's broadcast_buffers: the module's buffers are broadcast from
  // the authoritative rank before every forward (PrepareForward).
  bool broadcast_buffers = true;
  // See Note [Node hierarchy] in worker/slowmo/hierarchy.h: > 1 groups the
  // ranks into nodes of at most this many processes that share `node_id`.
  int nprocs_per_node = 1;
  // This worker's node (WorkerOptions::node_id); ranks with the same one
  // share a node. Empty everywhere: nodes of nprocs_per_node consecutive
  // ranks, fairscale's layout.
  std::string node_id;
  absl::Duration collective_timeout = absl::Minutes(5);
};

// INVALID_ARGUMENT with a one-line reason for a bad value.
absl::Status ValidateOptions(const SlowMoOptions& options);

}  // namespace concord::slowmo
