#pragma once
// concord::ZeroRedundancyOptimizer: PyTorch's ZeroRedundancyOptimizer
// (torch.distributed.optim) for a LibTorch program. Each rank keeps the
// optimizer state of its shard of the parameters only, steps that shard
// with the optimizer it wraps, and sends the updated parameters to the
// others; with Adam that is 8 bytes of state per parameter over the world
// instead of 8 on every rank.
//
//   concord::DistributedDataParallel ddp(model, job);
//   concord::ZeroRedundancyOptimizer optimizer(
//       ddp->parameters(), torch::optim::AdamOptions(1e-3), job);
//   ... forward, backward, optimizer.step() as with any optimizer ...
//   optimizer.consolidate_state_dict(0);         // every rank, then on 0:
//   if (job.rank() == 0) torch::save(optimizer, "optimizer.pt");
//
// The arithmetic is PyTorch's (see Note [ZeRO partition] in
// worker/zero/partition.h): the same partition, each parameter stepped by
// the wrapped LibTorch optimizer, so parameters and optimizer state end
// bit-identical to PyTorch's ZeroRedundancyOptimizer with DDP, and to an
// unsharded optimizer of the same kind.
//
// Under run_elastic (ElasticState::add it as any optimizer) no state goes
// with a rank that dies: each shard is also stepped by a mirror rank, on
// another node where there is one, and a re-form re-partitions over the new
// world; checkpoints hold the whole state as an unsharded optimizer's
// (PyTorch's state_dict). It then wraps SGD, Adam, AdamW, RMSprop or
// Adagrad only (see Note [Elastic ZeRO] in api/zero.cc; docs/api.md says
// what it costs).
//
// With ZeroOptions::overlap_with_ddp the step runs inside DDP's backward
// (PyTorch's ddp_zero_hook), as soon as each bucket's gradients are
// reduced:
//
//   concord::ZeroRedundancyOptimizer optimizer(
//       ddp->parameters(), torch::optim::AdamOptions(1e-3), job,
//       concord::ZeroOptions().overlap_with_ddp(true));
//   ddp->register_comm_hook(concord::hook_with_zero_step(
//       concord::allreduce_hook, ddp, optimizer));
//   ... forward, backward: the parameters are updated when it returns ...
//
// It is a torch::optim::Optimizer: param_groups() holds every parameter
// with its group's options (a learning-rate scheduler changes them there;
// each step hands them to the wrapped optimizer), zero_grad() clears every
// gradient, and torch::save / torch::load take the whole state as the
// wrapped optimizer's own archive (save after consolidate_state_dict; load
// on every rank, each keeping its shard). state() is empty: this rank's
// state is local_optimizer().state().

#include <torch/arg.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "concord/comm_hook.h"
#include "concord/ddp.h"
#include "concord/job.h"
#include "concord/zero_options.h"

namespace concord {

namespace detail {
// The LibTorch optimizer whose options these are.
template <typename Options>
struct OptimizerFor;
template <>
struct OptimizerFor<torch::optim::SGDOptions> {
  using type = torch::optim::SGD;
};
template <>
struct OptimizerFor<torch::optim::AdamOptions> {
  using type = torch::optim::Adam;
};
template <>
struct OptimizerFor<torch::optim::AdamWOptions> {
  using type = torch::optim::AdamW;
};
template <>
struct OptimizerFor<torch::optim::RMSpropOptions> {
  using type = torch::optim::RMSprop;
};
template <>
struct OptimizerFor<torch::optim::AdagradOptions> {
  using type = torch::optim::Adagrad;
};
}  // namespace detail

class ZeroRedundancyOptimizer : public torch::optim::Optimizer {
 public:
  // Makes the wrapped optimizer over the given groups (each with its
  // options set): PyTorch's optimizer_class.
  using OptimizerFactory =
      std::function<std::unique_ptr<torch::optim::Optimizer>(
          std::vector<torch::optim::OptimizerParamGroup>)>;

  // Over `params` (or groups), wrapping the LibTorch optimizer whose
  // options `defaults` are (SGD, Adam, AdamW, RMSprop, Adagrad), on the
  // job's current world. Every rank makes it with the same parameters in the
  // same order. Throws Error kInvalidArgument: no parameters, parameters of
  // different dtypes or devices, or a sparse one.
  template <typename Options,
            typename Type = typename detail::OptimizerFor<Options>::type>
  ZeroRedundancyOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                          const Options& defaults, const Job& job,
                          const ZeroOptions& options = {})
      : ZeroRedundancyOptimizer(
            std::move(groups), std::make_unique<Options>(defaults),
            [defaults](std::vector<torch::optim::OptimizerParamGroup> g) {
              return std::make_unique<Type>(std::move(g), defaults);
            },
            job, options) {}
  template <typename Options,
            typename Type = typename detail::OptimizerFor<Options>::type>
  ZeroRedundancyOptimizer(std::vector<torch::Tensor> params,
                          const Options& defaults, const Job& job,
                          const ZeroOptions& options = {})
      : ZeroRedundancyOptimizer(
            std::vector<torch::optim::OptimizerParamGroup>{
                torch::optim::OptimizerParamGroup(std::move(params))},
            defaults, job, options) {}
  // Any other optimizer: `make` builds it over this rank's groups (and, for
  // consolidate_state_dict and load, over all of them); `defaults` are the
  // options of groups that have none.
  ZeroRedundancyOptimizer(
      std::vector<torch::optim::OptimizerParamGroup> groups,
      std::unique_ptr<torch::optim::OptimizerOptions> defaults,
      OptimizerFactory make, const Job& job, const ZeroOptions& options = {});
  ~ZeroRedundancyOptimizer() override;
  ZeroRedundancyOptimizer(const ZeroRedundancyOptimizer&) = delete;
  ZeroRedundancyOptimizer& operator=(const ZeroRedundancyOptimizer&) = delete;

  // Steps this rank's shard with the wrapped optimizer (the groups' options
  // as param_groups() has them), then every rank's updated parameters reach
  // every rank (one broadcast per rank, of its parameters coalesced or its
  // bucket). Every rank calls it. Returns the closure's loss, as the
  // wrapped optimizer does. Throws Error: that of the broadcast (a peer
  // gone: kUnavailable, kDeadlineExceeded, kAborted), kFailedPrecondition
  // when the job re-formed outside run_elastic since the optimizer was
  // made.
  torch::Tensor step(LossClosure closure = nullptr) override;

  // Gathers every rank's shard of the state on rank `to` (PyTorch's
  // consolidate_state_dict), for save there. Every rank calls it.
  // Throws Error: those of step's broadcast; kInvalidArgument for a `to`
  // outside the world; kFailedPrecondition for an optimizer that has no
  // PyTorch state_dict form (not one of the five above).
  void consolidate_state_dict(int to = 0);

  // The whole state, as the wrapped optimizer's archive (torch::save):
  // what the last consolidate_state_dict gathered on this rank. Throws
  // Error kFailedPrecondition on a rank it did not gather on.
  void save(torch::serialize::OutputArchive& archive) const override;
  // A whole state saved by the wrapped optimizer's kind (an unsharded one
  // or a ZeroRedundancyOptimizer's save): every rank keeps its shard's and
  // every group's options. Throws c10::Error for an archive that does not
  // fit, as LibTorch's optimizers do.
  void load(torch::serialize::InputArchive& archive) override;

  // PyTorch's add_param_group: the new group's parameters are placed
  // after the others' (those keep their rank). Every rank calls it alike,
  // under run_elastic between steps.
  // Hides Optimizer::add_param_group: call it on the
  // ZeroRedundancyOptimizer itself.
  void add_param_group(const torch::optim::OptimizerParamGroup& group);

  // The optimizer stepping this rank's shard (PyTorch's `optim`).
  torch::optim::Optimizer& local_optimizer();
  const torch::optim::Optimizer& local_optimizer() const;
  // The rank stepping each parameter, flattened over the groups in order
  // (the indices of PyTorch's state_dict).
  std::vector<int> owners() const;
  // Bytes of optimizer state this rank keeps: its shard's and, under
  // run_elastic, the shards it mirrors and both as they were at the last
  // step's start, their parameters included (see Note [Elastic ZeRO] in
  // api/zero.cc).
  int64_t state_bytes() const;

  // Inside Concord (ElasticState, the overlap hooks).
  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// PyTorch's hook_with_zero_step(hook, ddp, zero, shard_buckets), for a
// `zero` made with ZeroOptions::overlap_with_ddp over `ddp`'s parameters:
// `hook` (allreduce_hook, or any other) reduces each bucket; at the last
// bucket each rank waits for its buckets' reductions, steps their share
// of the parameters with the wrapped optimizer and sends them, bucket by
// bucket, and backward returns once every parameter is updated. The shards
// follow DDP's buckets (see Note [ZeRO overlap partition] in
// worker/zero/partition.h): each bucket to one rank (b % world), or with
// `shard_buckets` split over ranks to even out their shares. DDP's first
// two backwards update nothing: the first builds DDP's final buckets, the
// second tells the optimizer what they hold. Register it on `ddp` before
// the first forward; `ddp` and `zero` outlive its backwards. Throws Error
// kInvalidArgument: `zero` without overlap_with_ddp; kAlreadyExists: a
// hook made for `zero` already. When the shards are made (in backward,
// from the hook; under run_elastic at the third step's start), Error
// kFailedPrecondition: `zero`'s parameters are not exactly `ddp`'s, or
// shard_buckets cannot place a bucket.
CommHook hook_with_zero_step(CommHook hook, detail::DdpCore& ddp,
                             ZeroRedundancyOptimizer& zero,
                             bool shard_buckets = false);
template <typename Wrapped>
CommHook hook_with_zero_step(CommHook hook,
                             DistributedDataParallel<Wrapped>& ddp,
                             ZeroRedundancyOptimizer& zero,
                             bool shard_buckets = false) {
  return hook_with_zero_step(std::move(hook), ddp->core(), zero, shard_buckets);
}

// PyTorch's hook_with_zero_step_interleaved: the same, but each bucket's
// share is stepped and sent as soon as that bucket is reduced, interleaving
// the optimizer's work and broadcasts with the other buckets' reductions.
// The same parameters, bit for bit. Under run_elastic both update every
// share before the first broadcast, which keeps the step transactional: this
// one then runs as hook_with_zero_step.
CommHook hook_with_zero_step_interleaved(CommHook hook, detail::DdpCore& ddp,
                                         ZeroRedundancyOptimizer& zero,
                                         bool shard_buckets = false);
template <typename Wrapped>
CommHook hook_with_zero_step_interleaved(CommHook hook,
                                         DistributedDataParallel<Wrapped>& ddp,
                                         ZeroRedundancyOptimizer& zero,
                                         bool shard_buckets = false) {
  return hook_with_zero_step_interleaved(std::move(hook), ddp->core(), zero,
                                         shard_buckets);
}

}  // namespace concord
