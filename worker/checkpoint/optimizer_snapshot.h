#pragma once
// A copy of an optimizer and the parameters it steps, to put back when a
// step fails after the optimizer stepped (see Note [Early optimizer steps] in
// worker/elastic/state.h).

#include <torch/torch.h>

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

  // Whether the last Take went through Optimizer::save.
  bool serialized() const { return serialized_; }

 private:
  // Optimizer::state()'s key (the parameter's TensorImpl, as a string).
  using Key = std::decay_t<
      decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;

  std::vector<torch::Tensor> params_;
  std::unordered_map<Key, std::unique_ptr<torch::optim::OptimizerParamState>>
      state_;
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> options_;
  std::string archive_;  // serialized_: the whole optimizer
  bool serialized_ = false;
};

}  // namespace concord::checkpoint
