#include "worker/checkpoint/optimizer_snapshot.h"

#include <ATen/ScalarOps.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <sstream>
#include <tuple>
#include <typeinfo>
#include <unordered_map>
#include <utility>

#include "worker/torch_compat.h"

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

// Calls `f` on each tensor of a state of a type CopyState knows.
template <typename F>
void ForEachTensor(const OptimizerParamState& state, F&& f) {
  namespace optim = torch::optim;
  const auto adam_like = [&f](const auto& s) {
    f(s.exp_avg());
    f(s.exp_avg_sq());
    f(s.max_exp_avg_sq());
  };
  if (const auto* s = dynamic_cast<const optim::AdamParamState*>(&state)) {
    adam_like(*s);
  } else if (const auto* w =
                 dynamic_cast<const optim::AdamWParamState*>(&state)) {
    adam_like(*w);
  } else if (const auto* g =
                 dynamic_cast<const optim::SGDParamState*>(&state)) {
    f(g->momentum_buffer());
  } else if (const auto* r =
                 dynamic_cast<const optim::RMSpropParamState*>(&state)) {
    f(r->square_avg());
    f(r->momentum_buffer());
    f(r->grad_avg());
  } else if (const auto* a =
                 dynamic_cast<const optim::AdagradParamState*>(&state)) {
    f(a->sum());
  }
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
  TakeParams(optimizer);
  TakeState(optimizer);
}

void OptimizerSnapshot::TakeParams(torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  deferred_.clear();
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
}

void OptimizerSnapshot::TakeState(torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
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

bool OptimizerSnapshot::Folds(const torch::optim::Optimizer& optimizer) {
  namespace optim = torch::optim;
  const bool adam = typeid(optimizer) == typeid(optim::Adam);
  if (!adam && typeid(optimizer) != typeid(optim::AdamW)) return false;
  for (const auto& group : optimizer.param_groups()) {
    const bool amsgrad =
        adam ? static_cast<const optim::AdamOptions&>(group.options()).amsgrad()
             : static_cast<const optim::AdamWOptions&>(group.options())
                   .amsgrad();
    // A moment undefined where the step reads it: LibTorch's own step
    // decides what happens.
    const auto ready = [amsgrad](const auto* s) {
      return s != nullptr && s->exp_avg().defined() &&
             s->exp_avg_sq().defined() &&
             (!amsgrad || s->max_exp_avg_sq().defined());
    };
    for (const torch::Tensor& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (p.grad().is_sparse()) return false;
      auto it = optimizer.state().find(compat::OptimizerStateKey(p));
      if (it == optimizer.state().end()) return false;  // made by this step
      const OptimizerParamState* state = it->second.get();
      if (adam ? !ready(dynamic_cast<const optim::AdamParamState*>(state))
               : !ready(dynamic_cast<const optim::AdamWParamState*>(state))) {
        return false;
      }
    }
  }
  return true;
}

namespace {

// `spare` made fit to be written with what `like` holds: kept when it has
// its sizes, strides, type and device, else a new tensor like it.
torch::Tensor& Fit(torch::Tensor& spare, const torch::Tensor& like) {
  if (!spare.defined() || spare.is_same(like) ||
      spare.sizes() != like.sizes() || spare.strides() != like.strides() ||
      spare.dtype() != like.dtype() || spare.device() != like.device()) {
    spare = at::empty_like(like, at::MemoryFormat::Preserve);
  }
  return spare;
}

// Note [Folded steps in chunks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A folded step's operations are elementwise: an element's arithmetic is
// the same whatever range an operation is given (the vectorized and scalar
// loops agree; the unit test compares against LibTorch's step() on tensors
// larger than a chunk, of odd sizes). On the CPU, with contiguous tensors,
// each parameter's operations run chunk by chunk, kChunk elements at a
// time, all of a chunk's back to back while its tensors are in the core's
// cache, rather than each over the whole parameter; and the temporaries
// (the L2 penalty's gradient, Adam's denominator) go into one scratch
// buffer of a chunk, where LibTorch's step allocates two tensors of the
// parameter's size, paged in afresh at every step. Elsewhere (CUDA, where a
// chunk would be a launch, or another layout) the operations run whole, as
// LibTorch's.
constexpr int64_t kChunk = int64_t{1} << 16;

// Whether a folded step may run over `tensors` chunk by chunk: more than a
// chunk's elements (a smaller parameter is in the cache whole, and a view
// costs about as much as an operation on it).
bool Chunkable(std::initializer_list<const torch::Tensor*> tensors) {
  const torch::Tensor& first = **tensors.begin();
  if (first.numel() <= kChunk) return false;
  for (const torch::Tensor* t : tensors) {
    if (!t->defined() || !t->device().is_cpu() || !t->is_contiguous() ||
        t->numel() != first.numel() || t->dtype() != first.dtype()) {
      return false;
    }
  }
  return true;
}

// Calls f(part, scratch) once per chunk of `n` elements, part(t) being t's
// elements of the chunk and scratch a tensor of as many elements like
// `like` (from `held`); unchunked, once with part(t) = t and no scratch.
template <typename F>
void ForEachChunk(bool chunked, const torch::Tensor& like, torch::Tensor& held,
                  F&& f) {
  if (!chunked) {
    f([](const torch::Tensor& t) { return t; }, torch::Tensor());
    return;
  }
  const int64_t n = like.numel();
  const int64_t size = std::min(n, kChunk);
  if (!held.defined() || held.numel() < size || held.dtype() != like.dtype()) {
    held = torch::empty({std::max(size, int64_t{1})}, like.options());
  }
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t length = std::min(kChunk, n - start);
    f(
        [start, length](const torch::Tensor& t) {
          return t.view({-1}).narrow(0, start, length);
        },
        held.narrow(0, 0, length));
  }
}

// See Note [Steps that keep their start]: LibTorch's Adam::step (`decoupled`:
// AdamW::step) for one parameter is FoldedMoments, its state read from `was`
// and written into `next`'s tensors, then FoldedParams. (AdamW's decay of
// the parameter, its step's first operation, comes second here: the moments
// do not read the parameter, so the bits are the same.) Both run in chunks
// where they can (see Note [Folded steps in chunks]), with `scratch`.
template <typename State, typename Options>
void FoldedMoments(const torch::Tensor& p, const Options& options,
                   const State& was, State& next, bool decoupled,
                   torch::Tensor& scratch) {
  const torch::Tensor& grad = p.grad();
  next.step(was.step() + 1);
  const auto beta1 = std::get<0>(options.betas());
  const auto beta2 = std::get<1>(options.betas());
  const bool penalty = !decoupled && options.weight_decay() != 0;
  torch::Tensor& exp_avg = Fit(next.exp_avg(), was.exp_avg());
  torch::Tensor& exp_avg_sq = Fit(next.exp_avg_sq(), was.exp_avg_sq());
  torch::Tensor* max_exp_avg_sq = nullptr;
  if (options.amsgrad()) {
    max_exp_avg_sq = &Fit(next.max_exp_avg_sq(), was.max_exp_avg_sq());
  } else {
    // An unused moment goes on as it was (LibTorch leaves it alone).
    next.max_exp_avg_sq(was.max_exp_avg_sq());
  }
  const bool chunked = Chunkable({&p, &grad, &was.exp_avg(), &was.exp_avg_sq(),
                                  &exp_avg, &exp_avg_sq}) &&
                       (max_exp_avg_sq == nullptr ||
                        Chunkable({&p, &was.max_exp_avg_sq(), max_exp_avg_sq}));
  ForEachChunk(chunked, p, scratch, [&](auto part, torch::Tensor tmp) {
    torch::Tensor g = part(grad);
    if (penalty) {
      // grad.add(p, weight_decay), into the scratch when chunked.
      g = chunked ? at::add_out(tmp, g, part(p), options.weight_decay())
                  : g.add(p, options.weight_decay());
    }
    // exp_avg.mul_(beta1) is at::mul_out(exp_avg, wrapped(beta1), exp_avg)
    // (at::native::mul_ in ATen/native/BinaryOps.cpp).
    torch::Tensor m = part(exp_avg);
    at::mul_out(m, at::native::wrapped_scalar_tensor(beta1),
                part(was.exp_avg()));
    m.add_(g, 1 - beta1);
    torch::Tensor v = part(exp_avg_sq);
    at::mul_out(v, at::native::wrapped_scalar_tensor(beta2),
                part(was.exp_avg_sq()));
    v.addcmul_(g, g, 1 - beta2);
    if (max_exp_avg_sq != nullptr) {
      torch::Tensor most = part(*max_exp_avg_sq);
      torch::max_out(most, v, part(was.max_exp_avg_sq()));
    }
  });
}

// The parameter's update from its state after the step, `now`.
template <typename State, typename Options>
void FoldedParams(torch::Tensor& p, const Options& options, const State& now,
                  bool decoupled, torch::Tensor& scratch) {
  const auto bias_correction1 =
      1 - std::pow(std::get<0>(options.betas()), now.step());
  const auto bias_correction2 =
      1 - std::pow(std::get<1>(options.betas()), now.step());
  const auto step_size = options.lr() / bias_correction1;
  const torch::Tensor& second =
      options.amsgrad() ? now.max_exp_avg_sq() : now.exp_avg_sq();
  const bool chunked = Chunkable({&p, &second, &now.exp_avg()});
  ForEachChunk(chunked, p, scratch, [&](auto part, torch::Tensor tmp) {
    torch::Tensor q = part(p);
    if (decoupled && options.weight_decay() != 0) {
      q.mul_(1 - options.lr() * options.weight_decay());
    }
    // (second.sqrt() / sqrt(bias_correction2)).add_(eps): the division is
    // by a wrapped scalar (at::native::div's Scalar overload).
    torch::Tensor denom;
    if (chunked) {
      at::sqrt_out(tmp, part(second));
      at::div_out(
          tmp, tmp,
          at::native::wrapped_scalar_tensor(std::sqrt(bias_correction2)));
      denom = tmp.add_(options.eps());
    } else {
      denom = (second.sqrt() / std::sqrt(bias_correction2)).add_(options.eps());
    }
    q.addcdiv_(part(now.exp_avg()), denom, -step_size);
  });
}

using KeptState = std::unordered_map<
    std::decay_t<
        decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type,
    std::unique_ptr<OptimizerParamState>>;

// Folds one group's step (see Note [Steps that keep their start]); with
// `params` false the parameters are left as they are and `stepped` marks,
// from `index` on (the group's first parameter over every group), those
// whose state the step moved.
template <typename State, typename Options>
void FoldGroup(torch::optim::OptimizerParamGroup& group,
               torch::optim::Optimizer& optimizer, KeptState& kept,
               bool decoupled, bool params, size_t index,
               std::vector<bool>& stepped, torch::Tensor& scratch) {
  const auto& options = static_cast<const Options&>(group.options());
  for (torch::Tensor& p : group.params()) {
    const size_t i = index++;
    if (i >= stepped.size()) stepped.resize(i + 1, false);
    stepped[i] = false;
    const auto key = compat::OptimizerStateKey(p);
    auto found = optimizer.state().find(key);
    if (found == optimizer.state().end()) {
      kept.erase(key);  // no gradient (Folds): no state before or after
      continue;
    }
    std::unique_ptr<OptimizerParamState>& live = found->second;
    std::unique_ptr<OptimizerParamState>& spare = kept[key];
    if (!p.grad().defined()) {
      CopyInto(*live, spare);  // the step leaves it as it is
      continue;
    }
    if (spare == nullptr || typeid(*spare) != typeid(*live)) {
      spare = std::make_unique<State>();
    }
    auto& next = static_cast<State&>(*spare);
    FoldedMoments(p, options, static_cast<const State&>(*live), next, decoupled,
                  scratch);
    if (params) {
      FoldedParams(p, options, next, decoupled, scratch);
    } else {
      stepped[i] = true;
    }
    live.swap(spare);  // the optimizer's the new state, the snapshot the old
  }
}

}  // namespace

torch::Tensor OptimizerSnapshot::StepTaking(
    torch::optim::Optimizer& optimizer,
    torch::optim::Optimizer::LossClosure closure) {
  // A closure may give parameters their first gradients, which Folds did
  // not see: the optimizer's own step then.
  if (closure != nullptr || !Folds(optimizer)) {
    deferred_.clear();
    TakeState(optimizer);
    return optimizer.step(std::move(closure));
  }
  Fold(optimizer, true);
  return {};
}

bool OptimizerSnapshot::StepStateTaking(torch::optim::Optimizer& optimizer) {
  if (!Folds(optimizer)) {
    StepTaking(optimizer);
    return false;
  }
  Fold(optimizer, false);
  return true;
}

void OptimizerSnapshot::Fold(torch::optim::Optimizer& optimizer, bool params) {
  namespace optim = torch::optim;
  torch::NoGradGuard no_grad;
  serialized_ = false;
  archive_.clear();
  for (auto it = state_.begin(); it != state_.end();) {
    it = optimizer.state().count(it->first) ? std::next(it) : state_.erase(it);
  }
  const bool adam = typeid(optimizer) == typeid(optim::Adam);
  size_t index = 0;
  for (auto& group : optimizer.param_groups()) {
    if (adam) {
      FoldGroup<optim::AdamParamState, optim::AdamOptions>(
          group, optimizer, state_, false, params, index, deferred_, scratch_);
    } else {
      FoldGroup<optim::AdamWParamState, optim::AdamWOptions>(
          group, optimizer, state_, true, params, index, deferred_, scratch_);
    }
    index += group.params().size();
  }
  deferred_.resize(index);
}

void OptimizerSnapshot::FinishParams(torch::optim::Optimizer& optimizer) const {
  namespace optim = torch::optim;
  torch::NoGradGuard no_grad;
  const bool adam = typeid(optimizer) == typeid(optim::Adam);
  size_t i = 0;
  for (auto& group : optimizer.param_groups()) {
    for (torch::Tensor& p : group.params()) {
      const size_t k = i++;
      if (k >= deferred_.size() || !deferred_[k] || k >= params_.size()) {
        continue;
      }
      const OptimizerParamState& now =
          *optimizer.state().at(compat::OptimizerStateKey(p));
      p.copy_(params_[k]);
      if (adam) {
        FoldedParams(p, static_cast<const optim::AdamOptions&>(group.options()),
                     static_cast<const optim::AdamParamState&>(now), false,
                     scratch_);
      } else {
        FoldedParams(
            p, static_cast<const optim::AdamWOptions&>(group.options()),
            static_cast<const optim::AdamWParamState&>(now), true, scratch_);
      }
    }
  }
}

void OptimizerSnapshot::Clear() {
  params_.clear();
  state_.clear();
  options_.clear();
  deferred_.clear();
  scratch_ = torch::Tensor();
  archive_.clear();
  serialized_ = false;
}

int64_t OptimizerSnapshot::bytes() const {
  int64_t out = int64_t(archive_.size());
  auto add = [&out](const torch::Tensor& t) {
    if (t.defined()) out += int64_t(t.nbytes());
  };
  for (const torch::Tensor& p : params_) add(p);
  for (const auto& [key, state] : state_) ForEachTensor(*state, add);
  return out;
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
