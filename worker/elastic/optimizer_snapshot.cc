#include "worker/elastic/optimizer_snapshot.h"

#include <sstream>
#include <typeinfo>

namespace concord::elastic {
namespace {

using torch::optim::OptimizerParamState;

// `dst` becomes a copy of `src`: in place when it has the same shape, type
// and device (and is not `src` itself), else a fresh clone.
void CopyTensor(const torch::Tensor& src, torch::Tensor& dst) {
  if (!src.defined()) {
    dst = torch::Tensor();
  } else if (dst.defined() && !dst.is_same(src) &&
             dst.sizes() == src.sizes() && dst.dtype() == src.dtype() &&
             dst.device() == src.device()) {
    dst.copy_(src);
  } else {
    dst = src.clone();
  }
}

// Copies every field of `src` into `dst`, an object of the same type.
// False for a type this does not know.
bool CopyState(const OptimizerParamState& src, OptimizerParamState& dst) {
  namespace optim = torch::optim;
  if (const auto* s = dynamic_cast<const optim::AdamParamState*>(&src)) {
    auto& d = static_cast<optim::AdamParamState&>(dst);
    d.step(s->step());
    CopyTensor(s->exp_avg(), d.exp_avg());
    CopyTensor(s->exp_avg_sq(), d.exp_avg_sq());
    CopyTensor(s->max_exp_avg_sq(), d.max_exp_avg_sq());
    return true;
  }
  if (const auto* s = dynamic_cast<const optim::AdamWParamState*>(&src)) {
    auto& d = static_cast<optim::AdamWParamState&>(dst);
    d.step(s->step());
    CopyTensor(s->exp_avg(), d.exp_avg());
    CopyTensor(s->exp_avg_sq(), d.exp_avg_sq());
    CopyTensor(s->max_exp_avg_sq(), d.max_exp_avg_sq());
    return true;
  }
  if (const auto* s = dynamic_cast<const optim::SGDParamState*>(&src)) {
    auto& d = static_cast<optim::SGDParamState&>(dst);
    CopyTensor(s->momentum_buffer(), d.momentum_buffer());
    return true;
  }
  if (const auto* s = dynamic_cast<const optim::RMSpropParamState*>(&src)) {
    auto& d = static_cast<optim::RMSpropParamState&>(dst);
    d.step(s->step());
    CopyTensor(s->square_avg(), d.square_avg());
    CopyTensor(s->momentum_buffer(), d.momentum_buffer());
    CopyTensor(s->grad_avg(), d.grad_avg());
    return true;
  }
  if (const auto* s = dynamic_cast<const optim::AdagradParamState*>(&src)) {
    auto& d = static_cast<optim::AdagradParamState&>(dst);
    d.step(s->step());
    CopyTensor(s->sum(), d.sum());
    return true;
  }
  return false;
}

// Into `slot` a copy of `src` whose tensors are its own.
void CopyInto(const OptimizerParamState& src,
              std::unique_ptr<OptimizerParamState>& slot) {
  if (slot == nullptr || typeid(*slot) != typeid(src)) {
    slot = src.clone();  // shares src's tensors until CopyState
  }
  CopyState(src, *slot);
}

bool Known(const OptimizerParamState& s) {
  namespace optim = torch::optim;
  return dynamic_cast<const optim::AdamParamState*>(&s) != nullptr ||
         dynamic_cast<const optim::AdamWParamState*>(&s) != nullptr ||
         dynamic_cast<const optim::SGDParamState*>(&s) != nullptr ||
         dynamic_cast<const optim::RMSpropParamState*>(&s) != nullptr ||
         dynamic_cast<const optim::AdagradParamState*>(&s) != nullptr;
}

bool AllKnown(const torch::optim::Optimizer& optimizer) {
  for (const auto& [key, state] : optimizer.state()) {
    if (!Known(*state)) return false;
  }
  return true;
}

}  // namespace

void OptimizerSnapshot::Take(torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  size_t i = 0;
  for (const auto& group : optimizer.param_groups()) {
    for (const torch::Tensor& p : group.params()) {
      if (i == params_.size()) params_.emplace_back();
      CopyTensor(p, params_[i++]);
    }
  }
  params_.resize(i);
  options_.clear();
  for (const auto& group : optimizer.param_groups()) {
    options_.push_back(group.has_options() ? group.options().clone() : nullptr);
  }
  serialized_ = !AllKnown(optimizer);
  if (serialized_) {
    state_.clear();
    torch::serialize::OutputArchive archive;
    optimizer.save(archive);
    std::ostringstream out;
    archive.save_to(out);
    archive_ = out.str();
    return;
  }
  archive_.clear();
  // Entries of parameters that have no state now go.
  for (auto it = state_.begin(); it != state_.end();) {
    it = optimizer.state().count(it->first) ? std::next(it) : state_.erase(it);
  }
  for (const auto& [key, state] : optimizer.state()) {
    CopyInto(*state, state_[key]);
  }
}

void OptimizerSnapshot::Restore(torch::optim::Optimizer& optimizer) const {
  torch::NoGradGuard no_grad;
  size_t i = 0;
  for (auto& group : optimizer.param_groups()) {
    for (torch::Tensor& p : group.params()) {
      if (i < params_.size()) p.copy_(params_[i]);
      ++i;
    }
  }
  if (serialized_) {
    torch::serialize::InputArchive archive;
    std::istringstream in(archive_);
    archive.load_from(in);
    optimizer.load(archive);
    return;
  }
  auto& live = optimizer.state();
  for (auto it = live.begin(); it != live.end();) {
    it = state_.count(it->first) ? std::next(it) : live.erase(it);
  }
  for (const auto& [key, saved] : state_) {
    CopyInto(*saved, live[key]);
  }
  size_t g = 0;
  for (auto& group : optimizer.param_groups()) {
    if (g < options_.size() && options_[g] != nullptr) {
      group.set_options(options_[g]->clone());
    }
    ++g;
  }
}

}  // namespace concord::elastic
