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
#include <optional>
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

// Note [PowerSGD across re-forms]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// PyTorch's PowerSGDState lives as long as its process group; an elastic
// job's state outlives its generations. One PowerSgdState per module is kept
// across re-forms (each generation's hook shares it) and is part of the
// elastic state (worker/elastic/powersgd_participant.h):
//  - transactional like the optimizer (see Note [Elastic step]): BeginStep
//  keeps
//    what a step replaces (error feedback and P memories are replaced, not
//    changed in place; Q memories, changed in place, are copied: they are
//    small), and Restore puts it back after a failed step;
//  - the iteration count, the generator and the Q memories are the same on
//    every rank (Q is allreduced): a re-form gives every rank the
//    authoritative rank's, so newcomers compress in step with the
//    survivors instead of everyone going back to vanilla allreduce;
//  - the error feedback is each rank's own. The bucket's result depends on
//    the ranks' errors only through their sum (P = sum_r M_r Q and
//    Q = sum_r M_r^T P are linear in the inputs M_r = g_r + e_r, and the
//    new errors sum to sum_r M_r minus the world times the result), so a
//    checkpoint keeps that sum, and the rank that resumes from it holds it
//    all while the others start at zero: the same arithmetic up to
//    rounding. A rank that dies takes its share with it.

// State shared by every bucket of one DDP model. Used from the autograd
// thread only.
class PowerSgdState {
 public:
  explicit PowerSgdState(PowerSgdOptions options)
      : options_(options), rng_(options.random_seed) {}
  const PowerSgdOptions& options() const { return options_; }
  int64_t iteration() const { return iter_; }

  // See Note [PowerSGD across re-forms]: a step begins; it failed (back to
  // where it began; nothing when no step began since the last Restore).
  void BeginStep();
  void Restore();
  // The state every rank holds alike: count, generator, Q memories and the
  // P memories' sizes, as a LibTorch archive; and taking it (the memories
  // made with `options`' dtype and device). INVALID_ARGUMENT for bytes that
  // are not one; nothing changed then.
  std::string SaveReplicated() const;
  absl::Status LoadReplicated(const std::string& bytes,
                              const at::TensorOptions& options);
  // This rank's error feedback, by bucket index.
  const std::map<size_t, at::Tensor>& errors() const { return error_; }
  void SetErrors(std::map<size_t, at::Tensor> errors) {
    error_ = std::move(errors);
  }

 private:
  friend class PowerSgd;
  // numpy's legacy RandomState(seed).randint(1_000_000_000).
  int64_t NextSeed();
  struct Saved {
    std::mt19937 rng;
    int64_t iter = 0;
    std::map<size_t, at::Tensor> error, p_memory, q_memory;
  };

  PowerSgdOptions options_;
  std::mt19937 rng_;
  int64_t iter_ = 0;
  std::map<size_t, at::Tensor> error_;
  std::map<size_t, at::Tensor> p_memory_;
  std::map<size_t, at::Tensor> q_memory_;
  std::optional<Saved> saved_;  // BeginStep's
};

CommHook PowerSgdHook(std::shared_ptr<PowerSgdState> state,
                      std::shared_ptr<comm::Communicator> comm,
                      comm::CollectiveOptions options = {});

// Parses "powersgd[:RANK[:START_ITER]]". INVALID_ARGUMENT otherwise.
absl::StatusOr<PowerSgdOptions> ParsePowerSgd(const std::string& spec);

}  // namespace concord::ddp
