#pragma once
// concord::DistributedDataParallel: PyTorch's DistributedDataParallel as a
// LibTorch module holder.
//
//   concord::Job job;
//   Net net;                  // a TORCH_MODULE holder, a std::shared_ptr of
//                             // any torch::nn::Module, a torch::jit::Module
//   net->to(job.device());
//   concord::DistributedDataParallel ddp(net, job,
//       concord::DdpOptions().bucket_cap_mb(25));
//   torch::optim::SGD opt(ddp->parameters(), 0.1);
//   auto loss = torch::mse_loss(ddp->forward(x), y);   // net's own signature
//   loss.backward();     // gradients are averaged over the ranks here
//   opt.step();
//
// Construction checks that every rank wraps the same model (names, shapes,
// dtypes, order: kFailedPrecondition naming the first difference, on every
// rank) and gives every rank the authoritative rank's parameters and
// buffers. Backward averages gradients with bucketed allreduce overlapping
// the rest of backward, with PyTorch's arithmetic (see Note [Reducer flow] in
// worker/ddp/reducer.h). TorchScript modules work the same way:
// `concord::DistributedDataParallel ddp(torch::jit::load(path), job)` and
// `ddp->forward({x}).toTensor()`.
//
// Forward and backward throw concord::Error when a collective fails (a peer
// died, the generation ended): retryable() is true, and an elastic loop
// re-forms. One training thread drives a DistributedDataParallel.

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>
#include <torch/script.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "concord/comm_hook.h"
#include "concord/ddp_options.h"
#include "concord/error.h"
#include "concord/job.h"

namespace concord {

// What the buckets look like and how the last synchronised backward went
// (what PyTorch's DDP logging data reports).
struct DdpStats {
  int64_t iterations = 0;  // synchronised backward passes so far
  int64_t bucket_rebuilds = 0;
  std::vector<int64_t> bucket_bytes;
  // The buckets' parameters by name, as first built and as now (after the
  // rebuild in the order gradients came).
  std::vector<std::vector<std::string>> initial_bucket_params;
  std::vector<std::vector<std::string>> bucket_params;
  // The last synchronised iteration, in microseconds: forward (armed to
  // the first gradient), backward (first to last gradient), communication
  // (first allreduce launched to all reduced) and the part of it hidden
  // behind backward.
  int64_t forward_compute_us = 0;
  int64_t backward_compute_us = 0;
  int64_t backward_comm_us = 0;
  int64_t overlap_us = 0;
  // Parameters no rank used in the last iteration (find_unused_parameters).
  std::vector<std::string> unused_parameters;
};

namespace detail {

// What DistributedDataParallel does that does not depend on the wrapped
// module's C++ type: it lives in libconcord.
class DdpCore {
 public:
  // Throws Error (kInvalidArgument: no trainable parameter, contradictory
  // or unknown options and names; kFailedPrecondition: the ranks' models
  // differ; those of the broadcast).
  DdpCore(std::shared_ptr<torch::nn::Module> module, const Job& job,
          const DdpOptions& options);
  DdpCore(const torch::jit::Module& module, const Job& job,
          const DdpOptions& options);
  ~DdpCore();
  DdpCore(const DdpCore&) = delete;
  DdpCore& operator=(const DdpCore&) = delete;

  void before_forward();
  void after_forward();
  void set_require_backward_grad_sync(bool sync);
  bool require_backward_grad_sync() const;
  bool join();
  void perform_slowmo(torch::optim::Optimizer& optimizer);
  void register_comm_hook(CommHook hook);
  DdpStats stats() const;
  const Job& job() const;

  struct Impl;  // api/internal.h
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace detail

// PyTorch's `with ddp.no_sync():` — while it lives, backward only
// accumulates gradients locally; the first backward after it reduces what
// accumulated.
class NoSyncGuard {
 public:
  explicit NoSyncGuard(detail::DdpCore& core)
      : core_(&core), previous_(core.require_backward_grad_sync()) {
    core_->set_require_backward_grad_sync(false);
  }
  ~NoSyncGuard() { core_->set_require_backward_grad_sync(previous_); }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;

 private:
  detail::DdpCore* core_;
  bool previous_;
};

namespace detail {

template <typename T>
struct IsSharedPtr : std::false_type {};
template <typename T>
struct IsSharedPtr<std::shared_ptr<T>> : std::true_type {};

// The torch::nn::Module inside a holder or a shared_ptr.
template <typename Wrapped>
std::shared_ptr<torch::nn::Module> ModuleOf(const Wrapped& module) {
  if constexpr (IsSharedPtr<Wrapped>::value) {
    static_assert(
        std::is_base_of_v<torch::nn::Module, typename Wrapped::element_type>,
        "DistributedDataParallel wraps a std::shared_ptr of a "
        "torch::nn::Module");
    return module;
  } else {
    return module.ptr();
  }
}

}  // namespace detail

// `Wrapped`: what PyTorch's DDP takes, any module: a C++-frontend module
// holder (what TORCH_MODULE declares: `Net`, `torch::nn::Sequential`, ...),
// a std::shared_ptr of any torch::nn::Module with a forward
// (std::make_shared<Net>() of a plain `struct Net : torch::nn::Module`), or
// a torch::jit::Module.
template <typename Wrapped>
class DistributedDataParallelImpl : public torch::nn::Module {
  static constexpr bool kScript = std::is_same_v<Wrapped, torch::jit::Module>;

 public:
  DistributedDataParallelImpl(Wrapped module, const Job& job,
                              const DdpOptions& options = {})
      : torch::nn::Module("concord::DistributedDataParallel"),
        module_(std::move(module)) {
    if constexpr (kScript) {
      // The optimizer takes ddp->parameters(): the script module's own
      // tensors, registered here ('.' is not allowed in a name: '_').
      for (const auto& p : module_.named_parameters(/*recurse=*/true)) {
        std::string name = "module_" + p.name;
        for (char& c : name) c = c == '.' ? '_' : c;
        register_parameter(name, p.value, p.value.requires_grad());
      }
      core_ = std::make_unique<detail::DdpCore>(module_, job, options);
    } else {
      std::shared_ptr<torch::nn::Module> inner = detail::ModuleOf(module_);
      if (inner == nullptr) {
        throw Error(ErrorCode::kInvalidArgument,
                    "DistributedDataParallel: an empty module");
      }
      register_module("module", inner);
      core_ = std::make_unique<detail::DdpCore>(std::move(inner), job, options);
    }
  }

  // The wrapped module's forward, with DDP's work around it. TorchScript:
  // forward(std::vector<c10::IValue>) returns c10::IValue.
  template <typename... Args>
  auto forward(Args&&... args) {
    core_->before_forward();
    if constexpr (kScript) {
      auto out = module_.forward(
          std::vector<c10::IValue>{c10::IValue(std::forward<Args>(args))...});
      core_->after_forward();
      return out;
    } else {
      auto out = module_->forward(std::forward<Args>(args)...);
      core_->after_forward();
      return out;
    }
  }
  // TorchScript: forward({x, y}).
  template <bool S = kScript, typename = std::enable_if_t<S>>
  c10::IValue forward(std::vector<c10::IValue> inputs) {
    core_->before_forward();
    c10::IValue out = module_.forward(std::move(inputs));
    core_->after_forward();
    return out;
  }

  // The wrapped module (PyTorch's ddp.module).
  Wrapped& module() { return module_; }
  // Backward without the allreduce while the guard lives.
  NoSyncGuard no_sync() { return NoSyncGuard(*core_); }
  // PyTorch's `with ddp.join():` — for ranks whose inputs run out unevenly
  // (each rank's own data, not an ElasticSampler's windows). Call it inside
  // run_elastic when this rank's loop has no more batches, after its last
  // commit; then return from the loop. It meets the others' next step
  // agreement and this rank leaves the job: those that still have data
  // re-form without it and go on, dividing the gradient sum by the initial
  // world size as PyTorch's join does (nobody shadows their collectives
  // with zeros). When every rank has run out, it returns on all of them and
  // training is over. Returns true when this rank left and others go on,
  // false when training ended everywhere. Throws Error: kFailedPrecondition
  // without an ElasticState or in the middle of a step; those of the
  // agreement (with ElasticStateOptions::throw_on_early_termination, every
  // rank throws once one runs out). The module takes no forward after it.
  bool join() { return core_->join(); }
  // fairscale's perform_slowmo(optimizer), with DdpOptions::slowmo: after
  // every optimizer.step() (and, in run_elastic, after state.commit()),
  // averages the parameters as the base algorithm says and takes the slow
  // momentum step when one is due (docs/architecture.md, "SlowMo, LocalSGD
  // and SGP").
  // After a re-form the new world's ranks take the authoritative rank's
  // SlowMo state and finish an average the committed step still owed.
  // Throws Error: kFailedPrecondition without DdpOptions::slowmo or before
  // the step was committed; those of the collectives (retryable).
  void perform_slowmo(torch::optim::Optimizer& optimizer) {
    core_->perform_slowmo(optimizer);
  }
  // PyTorch's register_comm_hook(state, hook): `hook(*state, bucket)`
  // reduces each bucket in place of the default allreduce
  // (concord/comm_hook.h); `state` is shared with the caller. Kept across
  // re-forms. Before the first forward. Throws Error: kAlreadyExists when
  // a hook (or DdpOptions::comm_hook) is set; kFailedPrecondition with
  // DdpOptions::slowmo or apex's scaling options.
  template <typename State, typename Hook>
  void register_comm_hook(std::shared_ptr<State> state, Hook hook) {
    core_->register_comm_hook(
        [state = std::move(state), hook = std::move(hook)](GradBucket& b) {
          return hook(*state, b);
        });
  }
  // A hook whose state, if any, it captures itself.
  void register_comm_hook(CommHook hook) {
    core_->register_comm_hook(std::move(hook));
  }
  // Buckets and the last iteration's timings.
  DdpStats stats() const { return core_->stats(); }
  const Job& job() const { return core_->job(); }
  // Inside Concord (ElasticState).
  detail::DdpCore& core() { return *core_; }

 private:
  Wrapped module_;
  std::unique_ptr<detail::DdpCore> core_;
};

template <typename Wrapped>
class DistributedDataParallel
    : public torch::nn::ModuleHolder<DistributedDataParallelImpl<Wrapped>> {
  using Holder = torch::nn::ModuleHolder<DistributedDataParallelImpl<Wrapped>>;

 public:
  // Empty, to be assigned later.
  DistributedDataParallel(std::nullptr_t) : Holder(nullptr) {}  // NOLINT
  explicit DistributedDataParallel(
      std::shared_ptr<DistributedDataParallelImpl<Wrapped>> impl)
      : Holder(std::move(impl)) {}
  DistributedDataParallel(Wrapped module, const Job& job,
                          const DdpOptions& options = {})
      : Holder(std::make_shared<DistributedDataParallelImpl<Wrapped>>(
            std::move(module), job, options)) {}
  // ddp(x) is ddp->forward(x) (ModuleHolder's own cannot see a forward
  // that is a template).
  template <typename... Args>
  auto operator()(Args&&... args) {
    return this->get()->forward(std::forward<Args>(args)...);
  }
};

// A training loop's two calls whose LibTorch behaves differently from one
// version to the next, made the same with LibTorch 1.13 and 2.x:
// see Note [LibTorch versions] in worker/torch_compat.h.

// Zeroes every gradient `optimizer` owns (set_to_none false: detached and
// filled with zeros, as PyTorch's zero_grad(set_to_none=False)) or drops
// them (true: undefined, as PyTorch's zero_grad() since 2.0).
// Optimizer::zero_grad() alone zeroes them in LibTorch 1.13 and drops them
// in 2.x.
void zero_grad(torch::optim::Optimizer& optimizer, bool set_to_none);

// Runs TorchScript graphs unfused on the CPU from now on, in the whole
// process (Python's torch._C._jit_override_can_fuse_on_cpu(False)): every
// elementwise op of a scripted model is ATen's, with the same arithmetic as
// PyTorch's reference (eager, or TorchScript without the fuser), whatever
// LibTorch this is. LibTorch 2.x with LLVM fuses them into generated
// kernels that round differently; 1.13 as Debian builds it never fuses.
// Call it before the first forward (concord-train does, for --model).
void disable_torchscript_cpu_fusion();

}  // namespace concord
