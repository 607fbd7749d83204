// ZeroRedundancyOptimizer overlapped with DDP's backward: PyTorch's
// ddp_zero_hook (hook_with_zero_step, hook_with_zero_step_interleaved), in
// include/concord/zero.h.

#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api/internal.h"
#include "api/zero_impl.h"
#include "worker/ddp/engine.h"
#include "worker/error.h"

namespace concord {

// Note [ZeRO overlapped with DDP]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With ZeroOptions::overlap_with_ddp the optimizer step moves into DDP's
// communication hook, as PyTorch's ddp_zero_hook does it:
// - Warm-up (PyTorch's _OverlapStatus). Until DDP has rebuilt its buckets
//   the hook only reduces. The first backward with rebuilt buckets records
//   each bucket's parameters (kCollecting); at bucket 0 of the next one the
//   shards are made from them (see Note [ZeRO overlap partition] in
//   worker/zero/partition.h): each rank's runs become flat tensors that its
//   parameters' data are views of, and the wrapped optimizer is made over
//   this rank's runs (kInitialized). So nothing is updated in the first
//   two backwards, as in PyTorch.
// - hook_with_zero_step: each bucket is reduced by the wrapped hook; at the
//   last bucket, for each bucket in order, a rank holding a run of it waits
//   for its reduction, steps that run with the bucket's gradients (only
//   those parameters: every other parameter of the wrapped optimizer has no
//   gradient meanwhile), and every rank issues the bucket's broadcasts, one
//   per run in rank order. The hook returns once all broadcasts are done:
//   backward ends with every parameter updated.
// - hook_with_zero_step_interleaved: the same work per bucket as a
//   continuation of the bucket's reduction. Concord runs continuations on
//   the thread that waits for the future (the end of backward, bucket by
//   bucket in order), so every rank issues the broadcasts in the same order
//   whatever the timing; the last bucket's continuation waits for them.
// Both update every parameter once, with the same gradients and the same
// arithmetic as PyTorch (the wrapped hook's: allreduce_hook divides before
// summing), so the parameters are bit-identical to PyTorch's either way.
// step() does nothing (it warns once), as PyTorch's; the state can be
// consolidated, saved and loaded once the shards exist (kFailedPrecondition
// before, where PyTorch raises).

// Note [Elastic ZeRO overlapped with DDP]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under run_elastic (see Note [Elastic ZeRO] in api/zero.cc) the overlapped
// step keeps what makes the plain one transactional, and its shards follow
// the job rather than what one process saw:
// - The shards come from DDP's bucket layout (the authoritative rank's
//   after a re-form, the checkpoint's after a resume), not from watching a
//   backward: at the start of step 3 (BeginStep with two steps committed,
//   DDP's buckets rebuilt), which is when PyTorch's warm-up ends too; a
//   re-form derives them the same way from the job's step, so survivors,
//   newcomers and a job resumed from a checkpoint agree, and the copies at
//   a step's start are of the optimizers the step updates.
// - Mirrors step the runs they mirror in the same hook, with the same
//   gradients.
// - Both hooks wait for every bucket this rank steps, update all of them
//   (no collective in between, so a rank either updates all or none) and
//   only then broadcast: as with step(), a rank can finish the step only
//   after every rank has updated. The interleaved hook thus runs as
//   hook_with_zero_step; the parameters are the same bit for bit.

namespace {

// Each of `tensors` as an index into `params` (a DDP bucket's parameters
// into the optimizer's group). kFailedPrecondition for one that is not
// there.
std::vector<int> IndicesIn(const std::vector<torch::Tensor>& params,
                           const std::vector<torch::Tensor>& tensors) {
  std::unordered_map<const void*, int> index;
  for (size_t i = 0; i < params.size(); ++i) {
    index[params[i].unsafeGetTensorImpl()] = int(i);
  }
  std::vector<int> out;
  for (const torch::Tensor& t : tensors) {
    auto it = index.find(t.unsafeGetTensorImpl());
    if (it == index.end()) {
      zero_api::Fail(ErrorCode::kFailedPrecondition,
                     "overlap_with_ddp: DDP's buckets hold a parameter this "
                     "optimizer does not (make it over ddp->parameters())");
    }
    out.push_back(it->second);
  }
  return out;
}

}  // namespace

void ZeroRedundancyOptimizer::Impl::CheckOverlapReady(const char* what) const {
  if (overlapped() && overlap.status != Overlap::Status::kInitialized) {
    zero_api::Fail(
        ErrorCode::kFailedPrecondition,
        absl::StrCat(what,
                     ": with overlap_with_ddp the shards follow DDP's "
                     "buckets, known from the third backward on"));
  }
}

void ZeroRedundancyOptimizer::Impl::OverlapSetup(bool ddp_rebuilt,
                                                 const GradBucket& bucket) {
  Overlap& o = overlap;
  if (!ddp_rebuilt) return;
  if (o.status == Overlap::Status::kUninitialized) {
    o.status = Overlap::Status::kCollecting;
  }
  if (o.status != Overlap::Status::kCollecting) return;
  if (bucket.index() == 0 && !o.buckets.empty()) {
    OverlapInit();
    return;
  }
  o.buckets.push_back(IndicesIn(groups()[0].params(), bucket.parameters()));
}

void ZeroRedundancyOptimizer::Impl::OverlapInit() {
  partition = OverlapLayout(world());
  // Under run_elastic the mirrors follow the shards (see Note [ZeRO
  // mirrors]); nothing is stepped before, so no state moves.
  if (elastic) mirror_of = MirrorsFor(partition, nodes);
  local = MakeOver(partition, {rank()});
  const std::vector<int> mirrored = Mirrored();
  mirror = mirrored.empty() ? nullptr : MakeOver(partition, mirrored);
}

zero::Partition ZeroRedundancyOptimizer::Impl::OverlapLayout(int world) {
  Overlap& o = overlap;
  const std::vector<torch::Tensor>& params = groups()[0].params();
  std::vector<int> count(params.size(), 0);
  std::vector<std::vector<int64_t>> numels;
  for (const auto& bucket : o.buckets) {
    numels.emplace_back();
    for (int i : bucket) {
      ++count[size_t(i)];
      numels.back().push_back(params[size_t(i)].numel());
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (count[i] != 1) {
      zero_api::Fail(
          ErrorCode::kFailedPrecondition,
          absl::StrCat("overlap_with_ddp: parameter ", i, " is in ", count[i],
                       " of DDP's buckets (make the optimizer over "
                       "exactly ddp->parameters())"));
    }
  }
  o.assignment = zero::AssignBuckets(numels, world, o.shard_buckets);
  zero::Partition out(size_t(world), std::vector<std::vector<int>>(1));
  o.flats.clear();
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < o.assignment.runs.size(); ++k) {
    const zero::BucketRun& run = o.assignment.runs[k];
    const std::vector<int>& bucket = o.buckets[size_t(run.bucket)];
    std::vector<torch::Tensor> members;
    int64_t size = 0;
    for (int j = run.offset; j < run.offset + run.length; ++j) {
      const int i = bucket[size_t(j)];
      out[size_t(run.rank)][0].push_back(i);
      members.push_back(params[size_t(i)]);
      size += params[size_t(i)].numel();
    }
    // PyTorch's _build_ddp_param_buckets: the run's parameters become views
    // of one tensor, what its broadcast sends.
    torch::Tensor flat = torch::empty({size}, members[0].options());
    int64_t offset = 0;
    for (torch::Tensor& p : members) {
      torch::Tensor view = flat.narrow(0, offset, p.numel());
      view.copy_(p.detach().flatten());
      p.set_data(view.view_as(p));
      offset += p.numel();
    }
    o.flats.push_back(std::move(flat));
  }
  o.status = Overlap::Status::kInitialized;
  return out;
}

bool ZeroRedundancyOptimizer::Impl::OverlapBucketsFromDdp(int64_t step) {
  Overlap& o = overlap;
  if (o.ddp == nullptr || step < 2) return false;
  const ddp::Engine& engine = *o.ddp->impl().engine;
  if (!engine.BucketsRebuilt()) return false;
  o.buckets.clear();
  for (const ddp::BucketInfo& b : engine.Buckets()) {
    std::vector<torch::Tensor> members;
    for (size_t p : b.params) members.push_back(engine.parameters()[p]);
    o.buckets.push_back(IndicesIn(groups()[0].params(), members));
  }
  return true;
}

bool ZeroRedundancyOptimizer::Impl::Steps(const zero::BucketRun& run) const {
  return run.rank == rank() || (size_t(run.rank) < mirror_of.size() &&
                                mirror_of[size_t(run.rank)] == rank());
}

bool ZeroRedundancyOptimizer::Impl::Holds(size_t b) const {
  for (const zero::BucketRun& run : overlap.assignment.runs) {
    if (size_t(run.bucket) == b && Steps(run)) return true;
  }
  return false;
}

void ZeroRedundancyOptimizer::Impl::OverlapStep(
    const std::vector<ReducedBucket>& reduced) {
  const Overlap& o = overlap;
  const std::vector<torch::Tensor>& params = groups()[0].params();
  // PyTorch hands its functional optimizer a gradient for this run's
  // parameters and None for the others: here the others have none while
  // the wrapped optimizers step.
  std::vector<torch::Tensor*> stepped_params;
  for (optim::Optimizer* opt : {local.get(), mirror.get()}) {
    if (opt == nullptr) continue;
    for (torch::Tensor& p : opt->param_groups()[0].params()) {
      stepped_params.push_back(&p);
    }
  }
  std::vector<torch::Tensor> saved;
  saved.reserve(stepped_params.size());
  for (torch::Tensor* p : stepped_params) {
    saved.push_back(p->grad());
    p->mutable_grad() = torch::Tensor();
  }
  for (const auto& [b, gradients] : reduced) {
    for (const zero::BucketRun& run : o.assignment.runs) {
      if (size_t(run.bucket) != b || !Steps(run)) continue;
      for (int j = run.offset; j < run.offset + run.length; ++j) {
        params[size_t(o.buckets[b][size_t(j)])].mutable_grad() =
            (*gradients)[size_t(j)];
      }
    }
  }
  TakeParams();
  for (optim::Optimizer* opt : {local.get(), mirror.get()}) {
    if (opt == nullptr) continue;
    zero_api::CopyOptions(groups(), opt->param_groups());
    Update(*opt);
  }
  zero_api::CopyOptions(local->param_groups(), groups());
  for (size_t k = 0; k < stepped_params.size(); ++k) {
    stepped_params[k]->mutable_grad() = saved[k];
  }
}

void ZeroRedundancyOptimizer::Impl::OverlapBroadcast(size_t b) {
  Overlap& o = overlap;
  if (world() == 1) return;
  const comm::CollectiveOptions opts = Collective();
  for (int r : o.assignment.ranks[b]) {
    for (size_t k = 0; k < o.assignment.runs.size(); ++k) {
      const zero::BucketRun& run = o.assignment.runs[k];
      if (size_t(run.bucket) != b || run.rank != r) continue;
      o.broadcasts.push_back(comm->Broadcast(o.flats[k], r, opts));
    }
  }
}

void ZeroRedundancyOptimizer::Impl::OverlapFinish() {
  Overlap& o = overlap;
  std::vector<std::shared_ptr<comm::Work>> works = std::move(o.broadcasts);
  o.broadcasts.clear();
  o.pending.clear();
  o.seen = 0;
  if (works.empty()) return;  // nobody broadcasts (one rank, or two)
  auto span = Traced(zero_api::kBroadcastSpan);
  for (auto& w : works) ThrowIfError(w->Synchronize());
}

namespace {

using Impl = ZeroRedundancyOptimizer::Impl;

// What making either hook checks and records.
Impl& Hooked(ZeroRedundancyOptimizer& zero, detail::DdpCore& ddp,
             bool shard_buckets) {
  Impl& z = zero.impl();
  if (!z.overlapped()) {
    zero_api::Fail(ErrorCode::kInvalidArgument,
                   "hook_with_zero_step needs one made with "
                   "ZeroOptions().overlap_with_ddp(true)");
  }
  if (z.overlap.ddp != nullptr) {
    zero_api::Fail(ErrorCode::kAlreadyExists,
                   "a hook_with_zero_step hook was made for it already");
  }
  z.overlap.ddp = &ddp;
  z.overlap.shard_buckets = shard_buckets;
  return z;
}

// Each bucket's start in either hook: whether the optimizer steps in this
// backward.
bool Setup(Impl& z, const GradBucket& bucket) {
  z.CheckWorld();
  auto& o = z.overlap;
  if (bucket.index() == 0) {
    // What a backward that failed half-way left.
    o.pending.clear();
    o.broadcasts.clear();
    o.seen = 0;
  }
  // Under run_elastic the shards come with the step (see Note [Elastic ZeRO
  // overlapped with DDP]).
  if (!z.elastic) {
    z.OverlapSetup(o.ddp->impl().engine->BucketsRebuilt(), bucket);
  }
  return o.status == Impl::Overlap::Status::kInitialized;
}

// The bucket's reduced gradients in its buffer (a hook's future may hold
// them elsewhere; the reducer copies them in the same way).
void TakeValue(const torch::Tensor& value, const torch::Tensor& buffer) {
  if (!value.is_same(buffer)) {
    torch::NoGradGuard no_grad;
    buffer.copy_(value.view_as(buffer));
  }
}

// hook_with_zero_step's work for one bucket, once the optimizer steps.
Future StepAtLastBucket(Impl& z, GradBucket& bucket, Future future) {
  auto& o = z.overlap;
  const size_t b = bucket.index();
  if (z.Holds(b)) {
    o.pending.insert_or_assign(
        b, Impl::Overlap::Pending{future, bucket.buffer(), bucket.gradients()});
  }
  if (b + 1 != o.buckets.size()) return future;
  auto reduced = [&](size_t k) -> Impl::Overlap::Pending& {
    auto it = o.pending.find(k);
    if (it == o.pending.end()) {
      zero_api::Fail(ErrorCode::kInternal,
                     absl::StrCat("bucket ", k, " was not reduced"));
    }
    TakeValue(it->second.future.wait(), it->second.buffer);
    return it->second;
  };
  if (z.elastic) {
    // See Note [Elastic ZeRO overlapped with DDP]: every update, then the
    // broadcasts.
    std::vector<size_t> held;
    for (size_t k = 0; k < o.buckets.size(); ++k) {
      if (z.Holds(k)) held.push_back(k);
    }
    std::vector<Impl::ReducedBucket> all;
    for (size_t k : held) all.emplace_back(k, &reduced(k).gradients);
    z.stepped = true;
    z.OverlapStep(all);
    z.ReachedFault();
    if (!z.steps_all) {
      for (size_t k = 0; k < o.buckets.size(); ++k) z.OverlapBroadcast(k);
    }
  } else {
    // PyTorch's order: bucket by bucket, each share's update then its
    // broadcast.
    for (size_t k = 0; k < o.buckets.size(); ++k) {
      if (z.Holds(k)) z.OverlapStep({{k, &reduced(k).gradients}});
      z.OverlapBroadcast(k);
    }
  }
  z.OverlapFinish();
  return future;
}

// Either hook: the wrapped hook's reduction, then (once the shards exist)
// the step, at the last bucket or bucket by bucket.
CommHook OverlapHook(CommHook hook, detail::DdpCore& ddp,
                     ZeroRedundancyOptimizer& zero, bool shard_buckets,
                     bool interleaved) {
  Impl* z = &Hooked(zero, ddp, shard_buckets);
  return [hook = std::move(hook), z, interleaved](GradBucket& bucket) {
    Future future = hook(bucket);
    if (!Setup(*z, bucket)) return future;
    // Under run_elastic both run as hook_with_zero_step (see Note [Elastic
    // ZeRO overlapped with DDP]).
    if (!interleaved || z->elastic) {
      return StepAtLastBucket(*z, bucket, std::move(future));
    }
    const size_t b = bucket.index();
    torch::Tensor buffer = bucket.buffer();
    std::vector<torch::Tensor> gradients = bucket.gradients();
    return future.then([z, b, buffer, gradients](torch::Tensor value) {
      auto& o = z->overlap;
      TakeValue(value, buffer);
      if (z->Holds(b)) z->OverlapStep({{b, &gradients}});
      z->OverlapBroadcast(b);
      if (++o.seen == o.buckets.size()) z->OverlapFinish();
      return buffer;
    });
  };
}

}  // namespace

CommHook hook_with_zero_step(CommHook hook, detail::DdpCore& ddp,
                             ZeroRedundancyOptimizer& zero,
                             bool shard_buckets) {
  return OverlapHook(std::move(hook), ddp, zero, shard_buckets, false);
}

CommHook hook_with_zero_step_interleaved(CommHook hook, detail::DdpCore& ddp,
                                         ZeroRedundancyOptimizer& zero,
                                         bool shard_buckets) {
  return OverlapHook(std::move(hook), ddp, zero, shard_buckets, true);
}

}  // namespace concord
