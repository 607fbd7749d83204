#pragma once
// concord::SlowMoOptions: fairscale's SlowMoDistributedDataParallel
// arguments, taken by DdpOptions::slowmo (concord/ddp.h). The one home of
// SlowMo's options and defaults: concord-train parses its flags into this
// struct, and the library's own options (worker/slowmo/options.h) take their
// defaults from it. Only <torch/arg.h> (the TORCH_ARG accessors) from
// LibTorch.

#include <torch/arg.h>

#include <cstdint>
#include <string>

namespace concord {

// fairscale's SlowMoDistributedDataParallel base algorithms.
enum class SlowMoBaseAlgorithm {
  kLocalSgd,  // exact parameter averages every localsgd_frequency steps
  kSgp,       // stochastic gradient push: a gossip round every step
};

// fairscale's SlowMoDistributedDataParallel arguments and defaults
// (fairscale.experimental.nn.data_parallel). Slow momentum is off when
// slowmo_lr is 1 and slowmo_momentum 0: plain LocalSGD or SGP.
struct SlowMoOptions {
  TORCH_ARG(SlowMoBaseAlgorithm,
            base_algorithm) = SlowMoBaseAlgorithm::kLocalSgd;
  TORCH_ARG(int64_t, localsgd_frequency) = 3;
  TORCH_ARG(double, slowmo_momentum) = 0.5;  // beta, in [0, 1)
  TORCH_ARG(double, slowmo_lr) = 1.0;        // alpha
  TORCH_ARG(int64_t, slowmo_frequency) = 48;
  // The slow-momentum state sharded over min(world, num_shards) ranks, each
  // shard with a replica on the next rank (survives one loss).
  TORCH_ARG(bool, slowmo_memory_efficient) = true;
  TORCH_ARG(int, slowmo_num_shards) = 32;
  // > 1: gradients are averaged inside each node (workers with one
  // CONCORD_NODE_ID, at most this many) every step, and the algorithm runs
  // between the node masters.
  TORCH_ARG(int, nprocs_per_node) = 1;
  // SGP: the peer graph ("npeer-directed-exponential", "directed-exponential",
  // "bipartite-exponential", "directed-linear", "bipartite-linear", "ring"),
  // out-peers per round, push-sum (false: push-pull), and an exact average
  // at each slow-momentum step.
  TORCH_ARG(std::string, sgp_graph) = "npeer-directed-exponential";
  TORCH_ARG(int, peers_per_itr) = 1;
  TORCH_ARG(bool, push_sum) = true;
  TORCH_ARG(bool, slowmo_sgp_average_params) = false;
};

}  // namespace concord
