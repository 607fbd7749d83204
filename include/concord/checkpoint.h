#pragma once
// Checkpoints of a training loop that does not run under run_elastic (which
// takes its own: JobOptions::checkpoints), in the same format (README
// "Checkpoints"): each module's file as torch.save(model.state_dict())
// writes it, each optimizer's as torch.save(optimizer.state_dict()), the
// user's values, and a manifest, in DIR/<job id>/step-<N>/, written so that
// a crash never leaves a checkpoint that loads half.
//
//   concord::CheckpointState state;
//   state.add("model", model).add("optimizer", optimizer);
//   if (auto step = concord::load_checkpoint(job, "/data/ckpt", state)) {
//     first_step = *step + 1;               // every rank reads it
//   }
//   for (...) {
//     ... train step ...
//     if (step % 100 == 0) concord::save_checkpoint(job, "/data/ckpt", step,
//     state);
//   }
//
// Rank 0 writes (the state of a data-parallel job is the same on every
// rank); every rank reads. The write is synchronous (a plain loop has no
// commit to copy at): run_elastic's checkpoints cost the step one memory
// copy instead, or less with CheckpointOptions::overlap.

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "concord/job.h"

namespace concord {

// What a checkpoint holds, by name: modules, optimizers, the user's values.
class CheckpointState {
 public:
  // Adds a module (its parameters and buffers by name: its file is
  // <name>.pt) or an optimizer (<name>.pt, PyTorch's state_dict). Names are
  // plain file names, each used once. They must outlive the state.
  template <typename M>
  CheckpointState& add(const std::string& name,
                       torch::nn::ModuleHolder<M>& module) {
    return add_module(name, module.ptr());
  }
  CheckpointState& add_module(const std::string& name,
                              std::shared_ptr<torch::nn::Module> module);
  CheckpointState& add(const std::string& name,
                       torch::optim::Optimizer& optimizer);
  // The user's own tensors (state.pt's values/<name>).
  std::map<std::string, torch::Tensor>& values() { return values_; }
  const std::map<std::string, torch::Tensor>& values() const { return values_; }

  const std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>&
  modules() const {
    return modules_;
  }
  const std::vector<std::pair<std::string, torch::optim::Optimizer*>>&
  optimizers() const {
    return optimizers_;
  }

 private:
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>
      modules_;
  std::vector<std::pair<std::string, torch::optim::Optimizer*>> optimizers_;
  std::map<std::string, torch::Tensor> values_;
};

// Rank 0 writes `state` as DIR/<job id>/step-<step>/ and keeps the newest
// `keep`; the other ranks return at once. A ZeroRedundancyOptimizer's state
// is written whole, as an unsharded optimizer's state_dict, but gathered
// nowhere: with one, every rank calls this at the same step, rank 0 writes
// the files with the other ranks' shards left as holes, and each rank
// writes its own shard into rank 0's file (or, where it does not see rank
// 0's filesystem, sends it to rank 0, which writes it); every rank returns
// once the checkpoint is published, or throws the error rank 0 met (see
// README "Checkpoints"). Throws Error: kInvalidArgument
// (a step < 1, keep < 1, a name that cannot be a file name),
// kUnavailable naming what could not be written (nothing half-written is
// left to load); with a ZeroRedundancyOptimizer, those of its collectives
// (a peer gone) and kFailedPrecondition before an overlapped one has its
// shards (the third backward).
void save_checkpoint(const Job& job, const std::string& dir, int64_t step,
                     const CheckpointState& state, int keep = 3);

// Loads the job's newest complete checkpoint in DIR into `state` (each
// module and optimizer by name; a ZeroRedundancyOptimizer takes its shards
// of the whole state, whether a sharded or an unsharded job saved it) and
// returns its step; none there:
// std::nullopt. One that fails its checks is passed over with a warning
// line. Throws Error kFailedPrecondition naming what does not fit (a module
// or optimizer the checkpoint lacks, another shape, another optimizer
// type); nothing is changed then.
std::optional<int64_t> load_checkpoint(const Job& job, const std::string& dir,
                                       CheckpointState& state);

}  // namespace concord
