#include "worker/checkpoint/optimizer_snapshot.h"

#include <sstream>
#include <typeinfo>

namespace concord::checkpoint {
namespace {

using torch::optim::OptimizerParamState;

// `dst` becomes a copy of `src`: in place when it has the same shape, type
// and device (and is not `src` itself), else a fresh clone.
void CopyTensor(const torch::Tensor& src, torch::Tensor& dst) {
  if (!src.defined()) {
    dst = torch::Tensor();
  } else if (dst.defined() && !dst.is_same(src) && dst.sizes() == src.sizes() &&
             dst.dtype() == src.dtype() && dst.device() == src.device()) {
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

// Appends `v`'s bytes to `out`.
template <typename T>
void Append(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

// What moves when an optimizer updates this state: its tensors' version
// counters and its step counter.
void AppendState(std::string& out, const OptimizerParamState& state) {
  namespace optim = torch::optim;
  auto version = [&out](const torch::Tensor& t) {
    Append(out, t.defined() ? t._version() : int64_t{-1});
  };
  if (const auto* s = dynamic_cast<const optim::AdamParamState*>(&state)) {
    Append(out, s->step());
    version(s->exp_avg());
    version(s->exp_avg_sq());
  } else if (const auto* s =
                 dynamic_cast<const optim::AdamWParamState*>(&state)) {
    Append(out, s->step());
    version(s->exp_avg());
    version(s->exp_avg_sq());
  } else if (const auto* s =
                 dynamic_cast<const optim::SGDParamState*>(&state)) {
    version(s->momentum_buffer());
  } else if (const auto* s =
                 dynamic_cast<const optim::RMSpropParamState*>(&state)) {
    Append(out, s->step());
    version(s->square_avg());
  } else if (const auto* s =
                 dynamic_cast<const optim::AdagradParamState*>(&state)) {
    Append(out, s->step());
    version(s->sum());
  }
}

bool AllKnown(const torch::optim::Optimizer& optimizer) {
  for (const auto& [key, state] : optimizer.state()) {
    if (!Known(*state)) return false;
  }
  return true;
}

}  // namespace

std::string OptimizerSnapshot::Signature(
    const torch::optim::Optimizer& optimizer) {
  std::string out;
  for (const auto& group : optimizer.param_groups()) {
    for (const torch::Tensor& p : group.params()) {
      Append(out, p._version());
      // LibTorch's optimizers update p.data(), whose version counter is not
      // the parameter's: on the CPU the first element's bytes tell.
      if (p.device().is_cpu() && p.numel() > 0 && p.is_contiguous()) {
        out.append(static_cast<const char*>(p.data_ptr()), p.element_size());
      }
    }
  }
  // A first step adds entries; later ones move their counters.
  Append(out, optimizer.state().size());
  for (const auto& [key, state] : optimizer.state()) AppendState(out, *state);
  return out;
}

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

}  // namespace concord::checkpoint
