#pragma once
// A copy of an optimizer and the parameters it steps, to put back when a
// step fails after the optimizer stepped (see Note [Early optimizer steps] in
// worker/elastic/state.h).
//
// Note [Steps that keep their start]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A sharded optimizer under run_elastic keeps each step's start (see Note
// [Elastic ZeRO] in api/zero.cc): copying Adam's moments before the step
// reads and writes them once more than the step does, and on a CPU job
// that copy took as long as the update itself (bench/zero_vs_ddp.py's
// "zero copy"). StepTaking folds the copy into the update instead: for
// LibTorch's Adam and AdamW it makes the step's arithmetic itself, the same
// operations in the same order as their step() in LibTorch 1.13 and 2.x
// (torch/csrc/api/src/optim/adam.cpp, adamw.cpp), except that each moment's
// first operation (exp_avg.mul_(beta1), exp_avg_sq.mul_(beta2), the
// amsgrad maximum) writes into another tensor — the one this snapshot kept
// from the step before — rather than in place; the per-parameter state
// objects are then swapped, so the snapshot holds the state from before
// the step untouched and the optimizer the new one. The elementwise kernels
// are the same ones (mul_ is mul_out with its output as an input), so the
// result is LibTorch's bit for bit (tested against step() for every option
// that changes the arithmetic). Two buffers per moment alternate: no copy,
// and no allocation after the first such step. On the CPU the operations
// run in cache-sized chunks (see Note [Folded steps in chunks] in
// optimizer_snapshot.cc; bench/tensor_ops.cc's BM_AdamStep* compare it with
// LibTorch's step). The parameters, which the model holds, are copied
// (TakeParams). Any other optimizer, and a step given a closure (which may
// make first gradients), is copied as Take copies it, then stepped by its
// own step().

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace concord::checkpoint {

class OptimizerSnapshot {
 public:
  // Copies the optimizer's parameters (every group's), its per-parameter
  // state and its groups' options. Tensors of an earlier Take of the same
  // shapes are reused (no allocation in the steady state). Optimizers whose
  // per-parameter state is LibTorch's SGD, Adam, AdamW, RMSprop or Adagrad
  // are copied tensor by tensor on their device; any other (LBFGS, a
  // user's) through Optimizer::save.
  void Take(torch::optim::Optimizer& optimizer);

  // Take in two parts around a step of the optimizer that this snapshot
  // makes itself (see Note [Steps that keep their start]): TakeParams
  // copies the parameters and the groups' options; StepTaking then keeps
  // the per-parameter state as it is and steps the optimizer (its
  // step(closure), whose loss it returns). Restore afterwards puts back the
  // state from before the step, as after a Take.
  void TakeParams(torch::optim::Optimizer& optimizer);
  torch::Tensor StepTaking(
      torch::optim::Optimizer& optimizer,
      torch::optim::Optimizer::LossClosure closure = nullptr);
  // StepTaking's first half, for a shard whose parameters another rank
  // steps and sends (a ZeRO mirror, see Note [ZeRO mirrors] in
  // worker/zero/partition.h): where StepTaking folds (Folds), the state
  // alone moves and the parameters stay as TakeParams copied them; true
  // then. Elsewhere it is StepTaking, parameters and all; false.
  bool StepStateTaking(torch::optim::Optimizer& optimizer);
  // After a StepStateTaking that returned true, and before the next
  // TakeParams: each parameter whose state it moved becomes its copy from
  // TakeParams updated with the optimizer's state, the bits StepTaking
  // would have made (the second half, for a mirror whose shard's owner
  // left before its parameters arrived).
  void FinishParams(torch::optim::Optimizer& optimizer) const;
  // Whether StepTaking keeps `optimizer`'s state without copying it (when
  // it is given no closure): the type is LibTorch's Adam or AdamW (not a
  // subclass) and every parameter with a gradient has its state already,
  // with dense gradients.
  static bool Folds(const torch::optim::Optimizer& optimizer);
  // Puts back what Take copied, into the same tensors (a parameter keeps
  // its identity; per-parameter state made since is dropped). Call only
  // after a Take, on the optimizer taken from.
  void Restore(torch::optim::Optimizer& optimizer) const;

  // Bytes that change when `optimizer` steps (see Note [Early optimizer
  // steps]): its parameters' version counters and, on the CPU, their
  // first elements (LibTorch's own optimizers update p.data(), which does
  // not move the parameter's counter), and its per-parameter state (how
  // many entries, their tensors' version counters and step counters). Cheap:
  // a few bytes a parameter, no device synchronisation. An optimizer with
  // no per-parameter state stepping CUDA parameters through .data() (SGD
  // without momentum) leaves it unchanged.
  static std::string Signature(const torch::optim::Optimizer& optimizer);

  // The bytes this snapshot holds: its parameters' and state's tensors (or
  // the serialized optimizer).
  int64_t bytes() const;
  // Drops everything it holds (bytes() is then 0); the next Take or
  // TakeParams allocates anew.
  void Clear();

  // Whether the last Take went through Optimizer::save.
  bool serialized() const { return serialized_; }

 private:
  // Optimizer::state()'s key (the parameter's TensorImpl, as a string).
  using Key = std::decay_t<
      decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;

  // Take's second part: the per-parameter state, copied.
  void TakeState(torch::optim::Optimizer& optimizer);
  // StepTaking's folded step of a Folds optimizer; the parameters too when
  // `params`.
  void Fold(torch::optim::Optimizer& optimizer, bool params);

  std::vector<torch::Tensor> params_;
  std::unordered_map<Key, std::unique_ptr<torch::optim::OptimizerParamState>>
      state_;
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> options_;
  // By parameter (every group's in order): whose update the last
  // StepStateTaking left to FinishParams.
  std::vector<bool> deferred_;
  // A folded step's temporaries (see Note [Folded steps in chunks] in
  // optimizer_snapshot.cc).
  mutable torch::Tensor scratch_;
  std::string archive_;  // serialized_: the whole optimizer
  bool serialized_ = false;
};

}  // namespace concord::checkpoint
