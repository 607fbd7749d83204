#pragma once
// PowerSGD gradient compression (Vogels et al., 2019) as a DDP communication
// hook, with the arithmetic of PyTorch's powerSGD_hook (1.13): vanilla
// allreduce for the first `start_iter` iterations; then, per bucket, error
// feedback, a rank-r approximation P Q^T of every matrix worth compressing
// (Q warm-started across iterations, otherwise drawn from a generator seeded
// like numpy's RandomState(random_seed).randint(1e9) so that all ranks draw
// the same), allreduce of the uncompressed rest, of P and of Q, and
// decompression into the bucket.

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <random>
#include <string>

#include "absl/status/statusor.h"
#include "worker/ddp/comm_hooks.h"

namespace concord::ddp {

struct PowerSgdOptions {
  int64_t matrix_approximation_rank = 1;
  int64_t start_iter = 1000;  // PyTorch's start_powerSGD_iter
  double min_compression_rate = 2;
  bool use_error_feedback = true;
  bool warm_start = true;
  double orthogonalization_epsilon = 0;
  uint32_t random_seed = 0;
};

// State shared by every bucket of one DDP model. Used from the autograd
// thread only.
class PowerSgdState {
 public:
  explicit PowerSgdState(PowerSgdOptions options)
      : options_(options), rng_(options.random_seed) {}
  const PowerSgdOptions& options() const { return options_; }
  int64_t iteration() const { return iter_; }

 private:
  friend class PowerSgd;
  // numpy's legacy RandomState(seed).randint(1_000_000_000).
  int64_t NextSeed();

  PowerSgdOptions options_;
  std::mt19937 rng_;
  int64_t iter_ = 0;
  std::map<size_t, at::Tensor> error_;
  std::map<size_t, at::Tensor> p_memory_;
  std::map<size_t, at::Tensor> q_memory_;
};

CommHook PowerSgdHook(std::shared_ptr<PowerSgdState> state,
                      std::shared_ptr<comm::Communicator> comm,
                      comm::CollectiveOptions options = {});

// Parses "powersgd[:RANK[:START_ITER]]". INVALID_ARGUMENT otherwise.
absl::StatusOr<PowerSgdOptions> ParsePowerSgd(const std::string& spec);

}  // namespace concord::ddp
