// concord::ZeroRedundancyOptimizer (include/concord/zero.h).

#include "concord/zero.h"

#include <torch/serialize.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api/internal.h"
#include "api/zero_impl.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/checkpoint/content.h"
#include "worker/checkpoint/optimizer_snapshot.h"
#include "worker/comm/coalesced.h"
#include "worker/crc32.h"
#include "worker/elastic/state.h"
#include "worker/error.h"
#include "worker/tensor_ops.h"
#include "worker/torch_compat.h"
#include "worker/zero/partition.h"

namespace concord {

namespace optim = torch::optim;

// Note [Elastic ZeRO]
// ~~~~~~~~~~~~~~~~~~~
// Added to an ElasticState, a ZeroRedundancyOptimizer is one of its
// participants (see Note [Participants in checkpoints] in
// worker/elastic/state.h), not one of its optimizers: its state is sharded,
// and no rank may take it whole from the authoritative rank.
// - Every shard has a mirror (see Note [ZeRO mirrors] in
//   worker/zero/partition.h): each rank also steps the shards it mirrors,
//   with the same gradients (for Adam and AdamW their state alone, the
//   parameters arriving with the owner's broadcast), so a shard lives on
//   two ranks, on two nodes where the job has two.
// - A step is transactional. Each rank keeps its own and its mirrored
//   shards as they were at the step's start: as it updates them it copies
//   their parameters, and the update keeps the state from before (see Note
//   [Steps that keep their start] in worker/checkpoint/optimizer_snapshot.h:
//   Adam's and AdamW's moments are written into a second buffer rather than
//   copied, other optimizers' state is copied first; no allocation after
//   the first steps). If the step fails, the re-form decides where the job
//   goes on from: a survivor's commit of the step (the job's step is then
//   the step just taken: every rank had finished its local update before
//   any could finish the step, since that needs every rank's broadcast) or
//   the step before. Each rank then offers the version that matches, live
//   or copied, or nothing (a newcomer, a version that does not match).
// - One rank alone, or two that mirror each other, step every shard
//   (zero::EveryRankStepsAll): the mirrors step whole, nobody broadcasts,
//   and once the State has seen the update come after the step's last
//   collective (Participant::BeginStep's `late`, see Note [Early optimizer
//   steps] in worker/elastic/state.h) nothing can fail the step after it:
//   the step keeps no start, as an unsharded optimizer's does not, and
//   costs what DDP's does (the shards, S/2 each, live on both ranks: the
//   mirrors' redundancy is the whole state at W = 2). Should a collective
//   after the update fail after all, the update is taken again, as an
//   unsharded optimizer's is, and a warning says so.
// - SyncState, on the new generation: every member says which parameters
//   it holds at the job's step; each parameter is taken from the lowest rank
//   holding it (its value and its state, one message per sending rank),
//   the parameters are partitioned over the new world as PyTorch does, and
//   each rank keeps the state of its new shard and of the shards it now
//   mirrors. A parameter no member holds (its owner and its mirror left
//   together) is FAILED_PRECONDITION naming it: the job must resume from a
//   checkpoint, and says so.
// - Checkpoints hold the whole state as an unsharded optimizer's (PyTorch's
//   state_dict in `<name>.pt`), so a sharded job's checkpoint resumes an
//   unsharded job and the other way round, at any world size; the rank that
//   resumes one offers every parameter. A node's snapshot is the whole
//   job's state (any node's may be the one a re-form resumes from), and
//   `<name>.pt` is one file PyTorch loads; see Note [Shards copied where
//   they are] in worker/elastic/state.h: a rank copies its own shard into
//   its node's snapshot (CheckpointOptimizer sends the writer its shapes,
//   FillShard copies) or sends it as bytes to other nodes' writers, and
//   only the writers ever hold the rest.
// Memory per rank, over the unsharded optimizer state S and parameters P
// over N ranks: the live state of its shard and its mirrored one (2 S/N) and
// both as they were at the step's start (2 (S + P)/N); at N <= 2, S and,
// after the first step, no copies.

// Note [ZeRO on the timeline]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With a trace file (JobOptions::trace_file, concord-run --trace) a step's
// parts that a sharded optimizer adds to DDP's are spans of the training
// track, so that where its time goes is read off the timeline rather than
// guessed: "zero copy" (under run_elastic, the copies of the parameters of
// the shards this rank holds, before their update), "zero update" (the
// wrapped optimizer's step over this rank's shard, with what it keeps of
// the state, see Note [Elastic ZeRO]), "zero mirror" (the same over the
// shards this rank mirrors) and "zero broadcast" (the parameters from the
// ranks that stepped them, to the last one's arrival). With
// overlap_with_ddp they lie inside backward:
// the updates where the hook makes them (at the last bucket, or bucket by
// bucket for the interleaved hook), and "zero broadcast" is the wait for
// the broadcasts issued before it (each bucket's after its update in
// PyTorch's order; all after every update under run_elastic, see Note
// [Elastic ZeRO overlapped with DDP] in api/zero_overlap.cc).

namespace {

using zero_api::CopyOptions;
using zero_api::Fail;
using zero_api::kBroadcastSpan;
using zero_api::kCopySpan;
using zero_api::kMirrorSpan;
using zero_api::kName;
using zero_api::kUpdateSpan;

// Throws Error kFailedPrecondition, "<what> an optimizer with a PyTorch
// state_dict form ...", for a wrapped optimizer that has none.
void RequireStateDictForm(const ZeroRedundancyOptimizer::Impl& z,
                          const char* what) {
  if (checkpoint::CaptureOptimizer(kName, *z.local).type.empty()) {
    Fail(ErrorCode::kFailedPrecondition,
         absl::StrCat(what,
                      " an optimizer with a PyTorch state_dict form (SGD, "
                      "Adam, AdamW, RMSprop, Adagrad)"));
  }
}

std::vector<std::vector<int64_t>> NumelsOf(
    const std::vector<optim::OptimizerParamGroup>& groups) {
  std::vector<std::vector<int64_t>> out;
  for (const auto& g : groups) {
    std::vector<int64_t> sizes;
    for (const auto& p : g.params()) sizes.push_back(p.numel());
    out.push_back(std::move(sizes));
  }
  return out;
}

std::vector<torch::Tensor> AllParams(
    const std::vector<optim::OptimizerParamGroup>& groups) {
  std::vector<torch::Tensor> out;
  for (const auto& g : groups) {
    out.insert(out.end(), g.params().begin(), g.params().end());
  }
  return out;
}

// `rank`'s parameters in the partition's order (group by group).
std::vector<torch::Tensor> ShardOf(
    const zero::Partition& partition,
    const std::vector<optim::OptimizerParamGroup>& groups, int rank) {
  std::vector<torch::Tensor> out;
  const auto& shard = partition[static_cast<size_t>(rank)];
  for (size_t g = 0; g < shard.size(); ++g) {
    for (int i : shard[g]) out.push_back(groups[g].params()[size_t(i)]);
  }
  return out;
}

// PyTorch's _verify_same_dense_param_type, and one device (a worker's).
void CheckParams(const std::vector<torch::Tensor>& params) {
  if (params.empty()) {
    Fail(ErrorCode::kInvalidArgument, "got an empty parameter list");
  }
  const torch::Tensor& first = params.front();
  for (const auto& p : params) {
    if (!p.defined()) Fail(ErrorCode::kInvalidArgument, "an undefined tensor");
    if (p.is_sparse()) {
      Fail(ErrorCode::kInvalidArgument,
           "only dense parameters are supported, got a sparse one");
    }
    if (p.scalar_type() != first.scalar_type() ||
        p.device() != first.device()) {
      Fail(ErrorCode::kInvalidArgument,
           absl::StrCat("every parameter must have one dtype and device, got ",
                        c10::toString(first.scalar_type()), " on ",
                        first.device().str(), " and ",
                        c10::toString(p.scalar_type()), " on ",
                        p.device().str()));
    }
  }
}

std::vector<bool> TrainableMask(const std::vector<torch::Tensor>& params) {
  std::vector<bool> out;
  out.reserve(params.size());
  for (const auto& p : params) out.push_back(p.requires_grad());
  return out;
}

std::vector<optim::OptimizerParamGroup> GroupsWith(
    const std::vector<optim::OptimizerParamGroup>& like,
    std::vector<std::vector<torch::Tensor>> params) {
  std::vector<optim::OptimizerParamGroup> out;
  for (size_t g = 0; g < like.size(); ++g) {
    out.emplace_back(std::move(params[g]), like[g].options().clone());
  }
  return out;
}

std::vector<char> Bytes(const std::string& s) {
  return std::vector<char>(s.begin(), s.end());
}

}  // namespace

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(
    std::vector<optim::OptimizerParamGroup> groups,
    std::unique_ptr<optim::OptimizerOptions> defaults, OptimizerFactory make,
    const Job& job, const ZeroOptions& options)
    : optim::Optimizer(std::move(groups), std::move(defaults)),
      impl_(std::make_unique<Impl>(this, job, options, std::move(make))) {
  const std::vector<torch::Tensor> params = AllParams(param_groups());
  CheckParams(params);
  impl_->comm = job.state()->session().shared_communicator();
  if (impl_->comm == nullptr) {
    Fail(ErrorCode::kFailedPrecondition,
         "the job is between generations (a re-form failed)");
  }
  if (options.overlap_with_ddp()) {
    // See Note [ZeRO overlapped with DDP] in api/zero_overlap.cc: no shard
    // until DDP's buckets are known.
    if (param_groups().size() != 1) {
      Fail(ErrorCode::kInvalidArgument,
           "overlap_with_ddp takes one parameter group");
    }
    if (options.parameters_as_bucket_view()) {
      Log()->warn(
          "ZeroRedundancyOptimizer: parameters_as_bucket_view is ignored with "
          "overlap_with_ddp (each bucket's share is flat already)");
    }
    impl_->partition = zero::Partition(size_t(impl_->world()),
                                       std::vector<std::vector<int>>(1));
  } else {
    impl_->partition =
        zero::PartitionParameters(NumelsOf(param_groups()), impl_->world());
  }
  impl_->local = impl_->MakeOver(impl_->partition, {impl_->rank()});
  impl_->trainable = TrainableMask(params);
  impl_->BuildBuckets(param_groups());
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

void ZeroRedundancyOptimizer::Impl::BuildBuckets(
    const std::vector<optim::OptimizerParamGroup>& groups) {
  Impl& z = *this;
  z.buckets.clear();
  if (!z.options.parameters_as_bucket_view() || z.overlapped()) return;
  torch::NoGradGuard no_grad;
  for (int r = 0; r < z.world(); ++r) {
    std::vector<torch::Tensor> trainable;
    for (auto& p : ShardOf(z.partition, groups, r)) {
      if (p.requires_grad()) {
        trainable.push_back(p);
      } else {
        // Out of any bucket it was in (PyTorch clones it out too).
        p.set_data(p.detach().clone());
      }
    }
    const torch::Tensor& any = groups[0].params()[0];
    int64_t size = 0;
    for (const auto& p : trainable) size += p.numel();
    if (size == 0) {
      z.buckets.push_back(torch::zeros({1}, any.options()));
      continue;
    }
    torch::Tensor bucket = torch::empty({size}, any.options());
    int64_t offset = 0;
    for (auto& p : trainable) {
      torch::Tensor view = bucket.narrow(0, offset, p.numel());
      view.copy_(p.detach().flatten());
      p.set_data(view.view_as(p));
      offset += p.numel();
    }
    z.buckets.push_back(std::move(bucket));
  }
}

void ZeroRedundancyOptimizer::Impl::CheckWorld() const {
  const Impl& z = *this;
  auto now = z.job.state()->session().shared_communicator();
  if (now != z.comm) {
    Fail(ErrorCode::kFailedPrecondition,
         absl::StrCat("made for generation ", z.comm->generation(), " (",
                      z.world(), " ranks), the job is now in ",
                      now == nullptr
                          ? std::string("none")
                          : absl::StrCat("generation ", now->generation()),
                      ": its shards of the optimizer state follow a re-form "
                      "only under run_elastic (ElasticState::add it)"));
  }
}

torch::Tensor ZeroRedundancyOptimizer::step(LossClosure closure) {
  Impl& z = *impl_;
  if (z.overlapped()) {
    // PyTorch's: the step is the hook's.
    if (!z.overlap.warned) {
      Log()->warn(
          "ZeroRedundancyOptimizer: step() does nothing with overlap_with_ddp "
          "(DDP's backward steps); leave it out of the training loop");
      z.overlap.warned = true;
    }
    return {};
  }
  z.CheckWorld();
  std::vector<bool> mask = TrainableMask(AllParams(param_groups()));
  if (mask != z.trainable) {
    z.trainable = std::move(mask);
    z.BuildBuckets(param_groups());
  }
  if (z.elastic && z.stepped) {
    // See Note [Elastic ZeRO]: a step's shards are the commit's or the next.
    Fail(ErrorCode::kFailedPrecondition,
         "step() ran twice in one step of run_elastic: commit in between");
  }
  CopyOptions(param_groups(), z.local->param_groups());
  z.TakeParams();
  torch::Tensor loss = z.Update(*z.local, std::move(closure));
  CopyOptions(z.local->param_groups(), param_groups());
  if (z.mirror != nullptr) {
    // See Note [ZeRO mirrors]: the mirrored shards, with the same gradients.
    CopyOptions(param_groups(), z.mirror->param_groups());
    z.Update(*z.mirror);
  }
  z.stepped = true;
  z.ReachedFault();
  if (!z.steps_all) {
    auto span = z.Traced(kBroadcastSpan);
    z.SyncParams(param_groups());
  }
  return loss;
}

void ZeroRedundancyOptimizer::Impl::ReachedFault() {
  if (!elastic) return;
  detail::JobState& js = *job.state();
  if (js.elastic != nullptr && !js.faults().empty()) {
    js.faults().Reached(detail::ElasticStep(*js.elastic),
                        worker::TestFault::Point::kZero, name);
  }
}

void ZeroRedundancyOptimizer::Impl::SyncParams(
    const std::vector<optim::OptimizerParamGroup>& groups) {
  Impl& z = *this;
  if (z.world() == 1) return;
  torch::NoGradGuard no_grad;
  const comm::CollectiveOptions opts = z.Collective();
  // Every rank's parameters at once (PyTorch issues the broadcasts
  // asynchronously, then waits for all): a bucket each, or each rank's
  // parameters flattened into one message.
  std::vector<torch::Tensor> flats;
  std::vector<std::vector<torch::Tensor>> shards;
  std::vector<std::shared_ptr<comm::Work>> works;
  for (int r = 0; r < z.world(); ++r) {
    if (!z.buckets.empty()) {
      works.push_back(z.comm->Broadcast(z.buckets[size_t(r)], r, opts));
      continue;
    }
    std::vector<torch::Tensor> shard;
    for (const auto& p : ShardOf(z.partition, groups, r)) {
      shard.push_back(p.detach());
    }
    if (shard.empty()) continue;
    if (r == z.rank()) {
      flats.push_back(FlattenTensors(shard));
    } else {
      // Received whole: nothing of this rank's values to copy in first.
      int64_t size = 0;
      for (const auto& p : shard) size += p.numel();
      flats.push_back(torch::empty({size}, shard[0].options()));
    }
    works.push_back(z.comm->Broadcast(flats.back(), r, opts));
    shards.push_back(std::move(shard));
  }
  for (auto& w : works) ThrowIfError(w->Synchronize());
  if (!z.buckets.empty()) return;
  // A mirror that stepped the shards it mirrors whole made the same bits
  // (see Note [ZeRO mirrors]): their broadcasts are not copied in again.
  const std::vector<int> mirrored =
      z.mirror_deferred ? std::vector<int>{} : z.Mirrored();
  size_t k = 0;
  for (int r = 0; r < z.world(); ++r) {
    if (ShardOf(z.partition, groups, r).empty()) continue;
    if (r != z.rank() &&
        std::find(mirrored.begin(), mirrored.end(), r) == mirrored.end()) {
      UnflattenInto(flats[k], shards[k]);
    }
    ++k;
  }
}

void ZeroRedundancyOptimizer::consolidate_state_dict(int to) {
  Impl& z = *impl_;
  z.CheckWorld();
  z.CheckOverlapReady("consolidate_state_dict");
  if (to < 0 || to >= z.world()) {
    Fail(ErrorCode::kInvalidArgument,
         absl::StrCat("consolidate_state_dict(", to,
                      "): the job has ranks 0 to ", z.world() - 1));
  }
  CopyOptions(param_groups(), z.local->param_groups());
  checkpoint::OptimizerContent mine =
      checkpoint::CaptureOptimizer(kName, *z.local);
  if (mine.type.empty()) {
    Fail(ErrorCode::kFailedPrecondition,
         "consolidate_state_dict needs an optimizer with a PyTorch state_dict "
         "form (SGD, Adam, AdamW, RMSprop, Adagrad)");
  }
  // This rank's indices into every parameter's (state_dict's) numbering.
  std::vector<int64_t> global;
  {
    std::vector<size_t> offset(param_groups().size(), 0);
    size_t total = 0;
    for (size_t g = 0; g < param_groups().size(); ++g) {
      offset[g] = total;
      total += param_groups()[g].params().size();
    }
    const auto& shard = z.partition[size_t(z.rank())];
    for (size_t g = 0; g < shard.size(); ++g) {
      for (int i : shard[g]) global.push_back(int64_t(offset[g] + size_t(i)));
    }
  }
  for (auto& [index, tensors] : mine.state) {
    index = global[size_t(index)];
    for (auto& [key, t] : tensors) t = t.to(torch::kCPU);
  }
  // Every shard goes to `to` alone (PyTorch broadcasts each rank's to
  // every rank): the others never hold the whole state.
  std::vector<std::pair<int64_t, NamedTensors>> state;
  std::string bytes;
  if (z.rank() != to) {
    std::vector<char> pickled =
        torch::pickle_save(checkpoint::OptimizerToIValue(mine));
    bytes.assign(pickled.begin(), pickled.end());
  }
  absl::StatusOr<std::vector<std::string>> shards =
      comm::GatherStrings(*z.comm, bytes, {to}, z.Collective());
  ThrowIfError(shards.status());
  z.consolidated.reset();
  if (z.rank() != to) return;
  for (int r = 0; r < z.world(); ++r) {
    if (r == to) continue;
    auto theirs = checkpoint::OptimizerFromIValue(
        kName, mine.type, torch::pickle_load(Bytes((*shards)[size_t(r)])));
    ThrowIfError(theirs.status());
    for (auto& entry : theirs->state) state.push_back(std::move(entry));
  }
  for (auto& entry : mine.state) state.push_back(std::move(entry));
  std::sort(state.begin(), state.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::vector<torch::Tensor>> all;
  for (const auto& g : param_groups()) all.push_back(g.params());
  std::unique_ptr<optim::Optimizer> full =
      z.make(GroupsWith(param_groups(), std::move(all)));
  checkpoint::OptimizerContent whole =
      checkpoint::CaptureOptimizer(kName, *full);
  whole.state = std::move(state);
  ThrowIfError(checkpoint::ApplyOptimizer(whole, *full));
  z.consolidated = std::move(full);
}

void ZeroRedundancyOptimizer::save(
    torch::serialize::OutputArchive& archive) const {
  if (impl_->consolidated == nullptr) {
    Fail(ErrorCode::kFailedPrecondition,
         absl::StrCat("the optimizer state has not been consolidated on rank ",
                      impl_->rank(), ": call consolidate_state_dict(",
                      impl_->rank(), ") on every rank first"));
  }
  impl_->consolidated->save(archive);
}

void ZeroRedundancyOptimizer::load(torch::serialize::InputArchive& archive) {
  Impl& z = *impl_;
  z.CheckOverlapReady("load");
  std::unique_ptr<optim::Optimizer> full = z.MakeWhole();
  checkpoint::LoadNativeOptimizer(archive, *full);
  detail::ZeroApply(*this, *full);
}

void detail::ZeroApply(ZeroRedundancyOptimizer& zero,
                       const torch::optim::Optimizer& whole) {
  ZeroRedundancyOptimizer::Impl& z = zero.impl();
  CopyOptions(whole.param_groups(), zero.param_groups());
  // This rank's shard, and the shards it mirrors (see Note [Elastic ZeRO]).
  for (optim::Optimizer* o : {z.local.get(), z.mirror.get()}) {
    if (o == nullptr) continue;
    CopyOptions(zero.param_groups(), o->param_groups());
    auto& state = o->state();
    state.clear();
    for (const auto& g : o->param_groups()) {
      for (const auto& p : g.params()) {
        auto it = whole.state().find(compat::OptimizerStateKey(p));
        if (it != whole.state().end()) {
          state[compat::OptimizerStateKey(p)] = it->second->clone();
        }
      }
    }
  }
}

checkpoint::OptimizerContent detail::ZeroCheckpoint(
    ZeroRedundancyOptimizer& zero, const std::string& name, int root,
    bool in_file) {
  ZeroRedundancyOptimizer::Impl& z = zero.impl();
  z.CheckWorld();
  z.CheckOverlapReady("save_checkpoint");
  RequireStateDictForm(z, "save_checkpoint needs");
  CopyOptions(zero.param_groups(), z.local->param_groups());
  z.shard_.clear();
  auto whole = z.CheckpointOptimizer(
      in_file ? elastic::ShardPlacement::InFile(root, z.world())
              : elastic::ShardPlacement::To(root, z.world()));
  ThrowIfError(whole.status());
  whole->name = name;
  return *std::move(whole);
}

std::map<std::pair<int64_t, std::string>, at::Tensor> detail::ZeroShard(
    ZeroRedundancyOptimizer& zero) {
  std::map<int64_t, NamedTensors> shard = std::move(zero.impl().shard_);
  zero.impl().shard_.clear();
  std::map<std::pair<int64_t, std::string>, at::Tensor> out;
  for (auto& [i, tensors] : shard) {
    for (auto& [key, t] : tensors) out[{i, key}] = std::move(t);
  }
  return out;
}

std::pair<comm::Communicator*, comm::CollectiveOptions> detail::ZeroComm(
    ZeroRedundancyOptimizer& zero) {
  return {zero.impl().comm.get(), zero.impl().Collective()};
}

absl::StatusOr<std::shared_ptr<torch::optim::Optimizer>> detail::ZeroCheck(
    ZeroRedundancyOptimizer& zero, const checkpoint::OptimizerContent& saved) {
  ZeroRedundancyOptimizer::Impl& z = zero.impl();
  z.CheckOverlapReady("load_checkpoint");
  // Checked and filled on an unsharded optimizer of the same kind: a
  // checkpoint of a sharded job or of an unsharded one alike.
  std::shared_ptr<optim::Optimizer> whole = z.MakeWhole();
  CONCORD_RETURN_IF_ERROR(checkpoint::ApplyOptimizer(saved, *whole));
  return whole;
}

void ZeroRedundancyOptimizer::add_param_group(
    const optim::OptimizerParamGroup& group) {
  Impl& z = *impl_;
  z.CheckWorld();
  if (z.overlapped()) {
    Fail(ErrorCode::kFailedPrecondition,
         "add_param_group: overlap_with_ddp takes one parameter group");
  }
  std::vector<torch::Tensor> params = AllParams(param_groups());
  params.insert(params.end(), group.params().begin(), group.params().end());
  CheckParams(params);
  optim::Optimizer::add_param_group(group);
  // The groups before keep their places: the greedy pass over them is the
  // same, and the new group's parameters come after.
  z.partition = zero::PartitionParameters(NumelsOf(param_groups()), z.world());
  std::vector<torch::Tensor> mine;
  for (int i : z.partition[size_t(z.rank())].back()) {
    mine.push_back(param_groups().back().params()[size_t(i)]);
  }
  z.local->add_param_group(optim::OptimizerParamGroup(
      std::move(mine), param_groups().back().options().clone()));
  if (z.mirror != nullptr) {
    // The new group's parameters of the shards this rank mirrors.
    std::vector<torch::Tensor> mirrored;
    for (int r : z.Mirrored()) {
      for (int i : z.partition[size_t(r)].back()) {
        mirrored.push_back(param_groups().back().params()[size_t(i)]);
      }
    }
    z.mirror->add_param_group(optim::OptimizerParamGroup(
        std::move(mirrored), param_groups().back().options().clone()));
  }
  z.trainable = TrainableMask(AllParams(param_groups()));
  impl_->BuildBuckets(param_groups());
}

std::unique_ptr<optim::Optimizer> ZeroRedundancyOptimizer::Impl::MakeOver(
    const zero::Partition& over, const std::vector<int>& ranks) {
  std::vector<std::vector<torch::Tensor>> params(groups().size());
  for (size_t g = 0; g < groups().size(); ++g) {
    for (int r : ranks) {
      for (int i : over[size_t(r)][g]) {
        params[g].push_back(groups()[g].params()[size_t(i)]);
      }
    }
  }
  std::unique_ptr<optim::Optimizer> out =
      make(GroupsWith(groups(), std::move(params)));
  if (out == nullptr || out->param_groups().size() != groups().size()) {
    Fail(ErrorCode::kInvalidArgument,
         "the optimizer factory must make an optimizer over exactly the "
         "groups it is given");
  }
  return out;
}

int64_t ZeroRedundancyOptimizer::Impl::Offset(size_t group) const {
  int64_t offset = 0;
  for (size_t g = 0; g < group; ++g) {
    offset += int64_t(self->param_groups()[g].params().size());
  }
  return offset;
}

namespace {

// The state_dict indices of MakeOver(partition, ranks)'s parameters, in
// its order (group by group).
std::vector<int64_t> IndicesOver(const zero::Partition& partition,
                                 const std::vector<int>& ranks,
                                 const std::vector<int64_t>& offsets) {
  std::vector<int64_t> out;
  for (size_t g = 0; g < offsets.size(); ++g) {
    for (int r : ranks) {
      for (int i : partition[size_t(r)][g]) out.push_back(offsets[g] + i);
    }
  }
  return out;
}

// `optimizer`'s per-parameter state by the indices of `indices` (CPU).
void CaptureInto(const optim::Optimizer& optimizer,
                 const std::vector<int64_t>& indices,
                 std::map<int64_t, NamedTensors>& out) {
  checkpoint::OptimizerContent c =
      checkpoint::CaptureOptimizer(kName, optimizer);
  for (auto& [index, tensors] : c.state) {
    for (auto& [key, t] : tensors) t = t.to(torch::kCPU);
    out[indices[size_t(index)]] = std::move(tensors);
  }
}

std::string PickleTensors(const NamedTensors& tensors) {
  c10::Dict<std::string, torch::Tensor> dict;
  for (const auto& [name, t] : tensors) dict.insert(name, t);
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(dict));
  return std::string(bytes.begin(), bytes.end());
}

NamedTensors UnpickleTensors(const std::string& bytes) {
  NamedTensors out;
  const c10::IValue v = torch::pickle_load(Bytes(bytes));
  for (const auto& entry : v.toGenericDict()) {
    out.emplace_back(entry.key().toStringRef(), entry.value().toTensor());
  }
  return out;
}

// "<index>/<key>" -> (index, key); false for another shape.
bool SplitName(const std::string& name, int64_t* index, std::string* key) {
  const size_t slash = name.find('/');
  if (slash == std::string::npos || slash == 0) return false;
  try {
    size_t used = 0;
    *index = std::stoll(name.substr(0, slash), &used);
    if (used != slash) return false;
  } catch (const std::exception&) {
    return false;
  }
  *key = name.substr(slash + 1);
  return !key->empty();
}

}  // namespace

std::vector<int> ZeroRedundancyOptimizer::Impl::MirrorsFor(
    const zero::Partition& partition, const std::vector<std::string>& nodes) {
  return zero::MirrorsOf(nodes,
                         zero::ShardSizes(partition, NumelsOf(groups())));
}

std::vector<int> ZeroRedundancyOptimizer::Impl::Mirrored() const {
  std::vector<int> out;
  for (size_t r = 0; r < mirror_of.size(); ++r) {
    if (mirror_of[r] == rank()) out.push_back(int(r));
  }
  return out;
}

std::vector<int64_t> ZeroRedundancyOptimizer::Impl::Held() const {
  std::vector<int64_t> offsets;
  for (size_t g = 0; g < self->param_groups().size(); ++g) {
    offsets.push_back(Offset(g));
  }
  std::vector<int64_t> out = IndicesOver(partition, {rank()}, offsets);
  const std::vector<int64_t> more = IndicesOver(partition, Mirrored(), offsets);
  out.insert(out.end(), more.begin(), more.end());
  return out;
}

std::map<int64_t, NamedTensors> ZeroRedundancyOptimizer::Impl::HeldState()
    const {
  std::vector<int64_t> offsets;
  for (size_t g = 0; g < self->param_groups().size(); ++g) {
    offsets.push_back(Offset(g));
  }
  std::map<int64_t, NamedTensors> out;
  CaptureInto(*local, IndicesOver(partition, {rank()}, offsets), out);
  if (mirror != nullptr) {
    CaptureInto(*mirror, IndicesOver(partition, Mirrored(), offsets), out);
  }
  return out;
}

void ZeroRedundancyOptimizer::Impl::BeginStep(int64_t step, bool late) {
  if (!elastic) return;
  shard_.clear();  // the last checkpoint's, filled or not: never kept longer
  if (overlapped() && overlap.status != Overlap::Status::kInitialized &&
      OverlapBucketsFromDdp(step)) {
    // See Note [Elastic ZeRO overlapped with DDP]: the shards exist from
    // the third step's start.
    OverlapInit();
  }
  base = step;
  stepped = false;
  copied = false;  // until the update (TakeParams, Update)
  mirror_deferred = false;
  // See Note [Elastic ZeRO]: with every shard on every member and nothing
  // after the update that can fail the step, the step is DDP's.
  steps_all = zero::EveryRankStepsAll(
      mirror_of, zero::ShardSizes(partition, NumelsOf(groups())));
  keep_start = !(late && steps_all);
  if (!keep_start) {
    own_copy.Clear();
    mirror_copy.Clear();
  }
}

void ZeroRedundancyOptimizer::Impl::RestoreStep() {
  if (!elastic || !stepped || copied) return;
  // See Note [Early optimizer steps] in worker/elastic/state.h: updated in
  // place, then a collective of the step failed.
  Log()->warn(
      "{} '{}' stepped before a collective of step {} that failed, in the "
      "first step it did so: its update is taken again when the step is "
      "(Note [Early optimizer steps])",
      kName, name, base + 1);
  stepped = false;
}

void ZeroRedundancyOptimizer::Impl::TakeParams() {
  if (!elastic || !keep_start) return;
  auto span = Traced(kCopySpan);
  own_copy.TakeParams(*local);
  if (mirror != nullptr) mirror_copy.TakeParams(*mirror);
}

torch::Tensor ZeroRedundancyOptimizer::Impl::Update(
    optim::Optimizer& o, optim::Optimizer::LossClosure closure) {
  const bool own = &o == local.get();
  auto span = Traced(own ? kUpdateSpan : kMirrorSpan);
  if (!elastic || !keep_start) return o.step(std::move(closure));
  // See Note [Steps that keep their start] in
  // worker/checkpoint/optimizer_snapshot.h: the state from before the
  // step is kept while the step runs. A mirror moves the state alone where
  // it can: the parameters come with their owner's broadcast (see Note
  // [ZeRO mirrors] in worker/zero/partition.h), unless nobody broadcasts.
  copied = true;
  if (!own && !steps_all) {
    mirror_deferred = mirror_copy.StepStateTaking(o);
    return {};
  }
  return (own ? own_copy : mirror_copy).StepTaking(o, std::move(closure));
}

absl::Status ZeroRedundancyOptimizer::Impl::SyncState(
    std::shared_ptr<comm::Communicator> next, int root, int64_t step,
    torch::optim::Optimizer& /*optimizer*/) {
  const comm::CollectiveOptions opts = Collective();
  const std::vector<torch::Tensor> params = AllParams(groups());
  const auto n = int64_t(params.size());
  // What this rank offers: the version of the job's step, live or copied.
  bool offers = resumed.has_value();
  if (!offers && !empty && comm != nullptr) {
    switch (zero::OfferAt(base, stepped, copied, step)) {
      case zero::Offer::kLive:
        // The mirrored shards' parameters at the step may not all have
        // arrived (their owner may be the rank that left): made here, from
        // the step's start and the state, the owner's bits.
        if (stepped && mirror_deferred && mirror != nullptr) {
          mirror_copy.FinishParams(*mirror);
        }
        offers = true;
        break;
      case zero::Offer::kCopy:
        own_copy.Restore(*local);
        if (mirror != nullptr) mirror_copy.Restore(*mirror);
        stepped = false;
        offers = true;
        break;
      case zero::Offer::kNone:
        break;
    }
  }
  std::vector<int64_t> held;
  if (resumed.has_value()) {
    for (int64_t i = 0; i < n; ++i) held.push_back(i);
  } else if (offers) {
    held = Held();
  }
  const bool adopts = !adopted.empty() && adopted_step == step;
  if (adopts) {
    for (const auto& [i, tensors] : adopted) held.push_back(i);
  }
  auto offered =
      comm::AllgatherStrings(*next, nlohmann::json(held).dump(), opts);
  CONCORD_RETURN_IF_ERROR(offered.status());
  auto nodes = comm::AllgatherStrings(
      *next, job.state()->session().options().node_id, opts);
  CONCORD_RETURN_IF_ERROR(nodes.status());
  // Each parameter from the lowest rank holding it (see Note [ZeRO sources]).
  std::vector<std::vector<int64_t>> offers_of;
  for (const std::string& text : *offered) {
    const auto list = nlohmann::json::parse(text, nullptr, false);
    if (!list.is_array()) {
      return absl::InternalError("ZeroRedundancyOptimizer: a malformed offer");
    }
    offers_of.push_back(list.get<std::vector<int64_t>>());
  }
  const zero::Sources sources = zero::SourcesOf(offers_of, n);
  const std::vector<int>& source = sources.rank;
  if (!sources.missing.empty() && step > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        kName, ": the optimizer state of parameter(s) ",
        absl::StrJoin(sources.missing, ", "), " at step ", step,
        " is on no member (the rank stepping them and the one mirroring them "
        "left together): resume the job from a checkpoint"));
  }
  // The groups' options (a scheduler's learning rate) are the
  // authoritative rank's.
  {
    std::string bytes;
    if (next->rank() == root) {
      torch::serialize::OutputArchive archive;
      for (size_t g = 0; g < groups().size(); ++g) {
        torch::serialize::OutputArchive one;
        groups()[g].options().serialize(one);
        archive.write(std::to_string(g), one);
      }
      std::ostringstream out;
      archive.save_to(out);
      bytes = out.str();
    }
    CONCORD_RETURN_IF_ERROR(comm::BroadcastBytes(*next, root, &bytes, opts));
    if (next->rank() != root) {
      try {
        std::istringstream in(bytes);
        torch::serialize::InputArchive archive;
        archive.load_from(in);
        for (size_t g = 0; g < groups().size(); ++g) {
          torch::serialize::InputArchive one;
          archive.read(std::to_string(g), one);
          std::unique_ptr<optim::OptimizerOptions> o =
              groups()[g].options().clone();
          o->serialize(one);
          groups()[g].set_options(std::move(o));
        }
      } catch (const std::exception& e) {
        return absl::InternalError(absl::StrCat(
            kName,
            ": the authoritative rank's options do not load: ", e.what()));
      }
    }
  }
  // The new world's partition and mirrors, and what this rank keeps.
  zero::Partition next_partition;
  if (overlapped()) {
    // See Note [Elastic ZeRO overlapped with DDP]: what DDP's layout (the
    // authoritative rank's, synced already) and the job's step say.
    Overlap fresh;
    fresh.ddp = overlap.ddp;
    fresh.shard_buckets = overlap.shard_buckets;
    fresh.warned = overlap.warned;
    overlap = std::move(fresh);
    next_partition = OverlapBucketsFromDdp(step)
                         ? OverlapLayout(next->size())
                         : zero::Partition(size_t(next->size()),
                                           std::vector<std::vector<int>>(1));
  } else {
    next_partition =
        zero::PartitionParameters(NumelsOf(groups()), next->size());
  }
  const std::vector<int> next_mirrors = MirrorsFor(next_partition, *nodes);
  std::vector<int> next_mirrored;
  for (size_t r = 0; r < next_mirrors.size(); ++r) {
    if (next_mirrors[r] == next->rank()) next_mirrored.push_back(int(r));
  }
  std::vector<int64_t> offsets;
  for (size_t g = 0; g < groups().size(); ++g) offsets.push_back(Offset(g));
  const std::vector<int64_t> own_indices =
      IndicesOver(next_partition, {next->rank()}, offsets);
  const std::vector<int64_t> mirror_indices =
      IndicesOver(next_partition, next_mirrored, offsets);
  std::set<int64_t> keep(own_indices.begin(), own_indices.end());
  keep.insert(mirror_indices.begin(), mirror_indices.end());
  // One message per sending rank: its parameters' values and state.
  std::map<int64_t, NamedTensors> received;
  std::map<int64_t, NamedTensors> mine;
  if (offers) mine = resumed.has_value() ? *resumed : HeldState();
  if (adopts) mine.insert(adopted.begin(), adopted.end());
  for (int s = 0; s < next->size(); ++s) {
    if (std::find(source.begin(), source.end(), s) == source.end()) continue;
    std::string bytes;
    if (s == next->rank()) {
      NamedTensors out;
      for (int64_t i = 0; i < n; ++i) {
        if (source[size_t(i)] != s) continue;
        out.emplace_back(absl::StrCat("p/", i),
                         params[size_t(i)].detach().to(torch::kCPU));
        auto it = mine.find(i);
        if (it == mine.end()) continue;
        for (const auto& [key, t] : it->second) {
          out.emplace_back(absl::StrCat("s/", i, "/", key), t);
        }
      }
      bytes = PickleTensors(out);
    }
    CONCORD_RETURN_IF_ERROR(comm::BroadcastBytes(*next, s, &bytes, opts));
    torch::NoGradGuard no_grad;
    for (auto& [name, t] : UnpickleTensors(bytes)) {
      int64_t i = 0;
      std::string key;
      if (absl::StartsWith(name, "p/")) {
        params[size_t(std::stoll(name.substr(2)))].detach().copy_(t);
      } else if (SplitName(name.substr(2), &i, &key) && keep.count(i) != 0) {
        received[i].emplace_back(key, t);
      }
    }
  }
  // The new shards' optimizers, with the state received.
  auto fill = [&](optim::Optimizer& o,
                  const std::vector<int64_t>& indices) -> absl::Status {
    checkpoint::OptimizerContent c = checkpoint::CaptureOptimizer(kName, o);
    if (c.type.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat(kName,
                       " under run_elastic needs an optimizer with a PyTorch "
                       "state_dict form (SGD, Adam, AdamW, RMSprop, Adagrad)"));
    }
    c.state.clear();
    for (size_t k = 0; k < indices.size(); ++k) {
      auto it = received.find(indices[k]);
      if (it != received.end()) c.state.emplace_back(int64_t(k), it->second);
    }
    return checkpoint::ApplyOptimizer(c, o);
  };
  std::unique_ptr<optim::Optimizer> next_local =
      MakeOver(next_partition, {next->rank()});
  CONCORD_RETURN_IF_ERROR(fill(*next_local, own_indices));
  std::unique_ptr<optim::Optimizer> next_mirror;
  if (!next_mirrored.empty()) {
    next_mirror = MakeOver(next_partition, next_mirrored);
    CONCORD_RETURN_IF_ERROR(fill(*next_mirror, mirror_indices));
  }
  local = std::move(next_local);
  mirror = std::move(next_mirror);
  partition = next_partition;
  mirror_of = next_mirrors;
  this->nodes = *nodes;
  comm = std::move(next);
  base = step;
  stepped = false;
  copied = false;
  steps_all = false;  // until the next BeginStep
  resumed.reset();
  empty = false;
  adopted.clear();
  adopted_step = -1;
  consolidated.reset();
  BuildBuckets(groups());
  return absl::OkStatus();
}

absl::Status ZeroRedundancyOptimizer::Impl::HandOver(
    comm::Communicator& old, const std::vector<bool>& leaving, int64_t step) {
  // Each leaving rank's shards (its own and those it mirrors, at the
  // committed step: the step's update ran, or none did) to the first rank
  // after it that stays; the next SyncState offers them.
  const int world = old.size();
  const comm::CollectiveOptions opts = Collective();
  adopted.clear();
  adopted_step = step;
  for (int r = 0; r < world; ++r) {
    if (!leaving[size_t(r)]) continue;
    int to = -1;
    for (int k = 1; k < world && to < 0; ++k) {
      if (!leaving[size_t((r + k) % world)]) to = (r + k) % world;
    }
    std::string bytes;
    if (r == old.rank()) {
      // Every parameter held, with state or without ("held").
      const std::vector<int64_t> indices = Held();
      NamedTensors out = {{"held", torch::tensor(indices, torch::kLong)}};
      for (const auto& [i, tensors] : HeldState()) {
        for (const auto& [key, t] : tensors) {
          out.emplace_back(absl::StrCat(i, "/", key), t);
        }
      }
      bytes = PickleTensors(out);
    }
    CONCORD_RETURN_IF_ERROR(comm::BroadcastBytes(old, r, &bytes, opts));
    if (old.rank() != to) continue;
    for (auto& [entry, t] : UnpickleTensors(bytes)) {
      int64_t i = 0;
      std::string key;
      if (entry == "held") {
        for (int64_t k = 0; k < t.numel(); ++k) {
          adopted[t[k].item<int64_t>()];  // an entry, with state or not
        }
      } else if (SplitName(entry, &i, &key)) {
        adopted[i].emplace_back(key, t);
      }
    }
  }
  return absl::OkStatus();
}

std::unique_ptr<optim::Optimizer> ZeroRedundancyOptimizer::Impl::MakeWhole() {
  std::vector<std::vector<torch::Tensor>> all;
  for (const auto& g : groups()) all.push_back(g.params());
  return make(GroupsWith(groups(), std::move(all)));
}

absl::StatusOr<NamedTensors> ZeroRedundancyOptimizer::Impl::CheckpointState(
    const torch::optim::Optimizer& /*optimizer*/) {
  return NamedTensors{};  // all of it is in CheckpointOptimizer's
}

absl::StatusOr<checkpoint::OptimizerContent>
ZeroRedundancyOptimizer::Impl::CheckpointOptimizer(
    const elastic::ShardPlacement& placement) {
  std::vector<int64_t> offsets;
  for (size_t g = 0; g < groups().size(); ++g) offsets.push_back(Offset(g));
  std::map<int64_t, NamedTensors> own;
  CaptureInto(*local, IndicesOver(partition, {rank()}, offsets), own);
  NamedTensors mine;
  for (const auto& [i, tensors] : own) {
    for (const auto& [key, t] : tensors) {
      mine.emplace_back(absl::StrCat(i, "/", key), t);
    }
  }
  // See Note [Shards copied where they are] in worker/elastic/state.h: each
  // shard goes only to the ranks that write their node's snapshot, as bytes
  // or, to its own node's writer, as its entries' shapes (a hole each, which
  // this rank fills). The others never hold the whole state.
  const int me = rank();
  // A writer takes its own shard as it is; the others' come as bytes or as
  // holes.
  bool as_bytes = false;
  for (int w : placement.writers) as_bytes |= placement.AsBytes(w, me);
  auto all = comm::GatherStrings(
      *comm, as_bytes ? PickleTensors(mine) : std::string(), placement.writers,
      Collective(),
      [&placement](int w, int r) { return !placement.AsBytes(w, r); });
  CONCORD_RETURN_IF_ERROR(all.status());
  std::vector<std::string> holes;
  if (placement.AnyInPlace()) {
    const auto shaped = [&placement](int w, int r) {
      return w != r && placement.in_place[static_cast<size_t>(r)] &&
             placement.writer_of[static_cast<size_t>(r)] == w;
    };
    nlohmann::json shapes = nlohmann::json::array();
    if (shaped(placement.writer_of[static_cast<size_t>(me)], me)) {
      if (placement.crcs) {
        // See Note [Shards written where they are] in
        // worker/checkpoint/disk.h: the bytes this rank will write, and
        // their CRC-32 for the file's headers.
        for (auto& [i, tensors] : own) {
          for (auto& [key, t] : tensors) {
            t = t.detach().to(at::kCPU).contiguous();
            shapes.push_back(
                {absl::StrCat(i, "/", key), static_cast<int>(t.scalar_type()),
                 t.sizes().vec(),
                 Crc32(0, t.data_ptr(), size_t(t.numel()) * t.element_size())});
          }
        }
      } else {
        for (const auto& [entry, t] : mine) {
          shapes.push_back(
              {entry, static_cast<int>(t.scalar_type()), t.sizes().vec()});
        }
      }
      shard_ = std::move(own);
    }
    CONCORD_ASSIGN_OR_RETURN(
        holes, comm::GatherStrings(
                   *comm, shapes.empty() ? std::string() : shapes.dump(),
                   placement.writers, Collective(),
                   [&shaped](int w, int r) { return !shaped(w, r); }));
  }
  checkpoint::OptimizerContent whole =
      checkpoint::CaptureOptimizer(name, *MakeWhole());
  if (all->empty()) return whole;  // not a writer: not kept
  std::map<int64_t, NamedTensors> state;
  const auto add = [&state](const std::string& entry, at::Tensor t) {
    int64_t i = 0;
    std::string key;
    if (!SplitName(entry, &i, &key)) {
      return absl::InternalError(
          absl::StrCat(kName, ": a malformed shard entry '", entry, "'"));
    }
    state[i].emplace_back(key, std::move(t));
    return absl::OkStatus();
  };
  for (int r = 0; r < int(all->size()); ++r) {
    const std::string& bytes = (*all)[size_t(r)];
    if (r == me) {
      for (const auto& [entry, t] : mine) {
        CONCORD_RETURN_IF_ERROR(add(entry, t));
      }
      continue;
    }
    if (bytes.empty()) continue;  // a shard not sent as bytes
    for (auto& [entry, t] : UnpickleTensors(bytes)) {
      CONCORD_RETURN_IF_ERROR(add(entry, std::move(t)));
    }
  }
  for (const std::string& said : holes) {
    if (said.empty()) continue;
    const nlohmann::json shapes =
        nlohmann::json::parse(said, nullptr, /*allow_exceptions=*/false);
    if (!shapes.is_array()) {
      return absl::InternalError(
          absl::StrCat(kName, ": a malformed list of a shard's shapes"));
    }
    for (const nlohmann::json& e : shapes) {
      // A hole (see Note [Holes] in worker/checkpoint/memory.h): its rank
      // copies it into the node's snapshot, or writes it into the file
      // (with its CRC-32, see Note [Shards written where they are] in
      // worker/checkpoint/disk.h).
      std::string entry;
      at::Tensor hole;
      std::optional<uint32_t> crc;
      try {
        entry = e.at(0).get<std::string>();
        hole = at::empty(
            e.at(2).get<std::vector<int64_t>>(),
            at::TensorOptions()
                .dtype(static_cast<at::ScalarType>(e.at(1).get<int>()))
                .device(at::kMeta));
        if (e.size() > 3) crc = e.at(3).get<uint32_t>();
      } catch (const std::exception& error) {
        return absl::InternalError(absl::StrCat(
            kName, ": a malformed shape of a shard's entry: ", error.what()));
      }
      if (crc.has_value()) {
        int64_t i = 0;
        std::string key;
        if (SplitName(entry, &i, &key)) whole.hole_crc[{i, key}] = *crc;
      }
      CONCORD_RETURN_IF_ERROR(add(entry, std::move(hole)));
    }
  }
  // PyTorch's state_dict of the whole optimizer: the groups' options and
  // indices as an unsharded one has them, every shard's state.
  whole.state.assign(state.begin(), state.end());
  return whole;
}

absl::Status ZeroRedundancyOptimizer::Impl::FillShard(
    const checkpoint::Content& laid) {
  const std::map<int64_t, NamedTensors> shard = std::move(shard_);
  shard_.clear();
  const checkpoint::OptimizerContent* into = nullptr;
  for (const auto& o : laid.optimizers) {
    if (o.name == name) into = &o;
  }
  if (into == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the node's snapshot has no optimizer '", name, "' to copy into"));
  }
  std::map<int64_t, const NamedTensors*> places;
  for (const auto& [i, tensors] : into->state) places[i] = &tensors;
  torch::NoGradGuard no_grad;
  for (const auto& [i, tensors] : shard) {
    const auto place = places.find(i);
    for (const auto& [key, t] : tensors) {
      const at::Tensor* to = nullptr;
      if (place != places.end()) {
        for (const auto& [k, v] : *place->second) {
          if (k == key) to = &v;
        }
      }
      if (to == nullptr || !to->sizes().equals(t.sizes()) ||
          to->scalar_type() != t.scalar_type()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "optimizer '", name, "': the node's snapshot has ",
            to == nullptr ? "no place" : checkpoint::DescribeTensor(*to),
            " for parameter ", i, "'s ", key, " (",
            checkpoint::DescribeTensor(t), ")"));
      }
      if (t.device().is_cpu() && t.is_contiguous()) {
        // A plain copy, as the snapshot's own (see CopySnapshot).
        std::memcpy(to->data_ptr(), t.data_ptr(), t.numel() * t.element_size());
      } else {
        to->copy_(t);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ZeroRedundancyOptimizer::Impl::ResumeState(
    const NamedTensors* saved, torch::optim::Optimizer& /*optimizer*/) {
  if (saved == nullptr) {
    // Another rank resumed the checkpoint: what this one holds is not the
    // job's.
    resumed.reset();
    empty = true;
  }
  return absl::OkStatus();
}

absl::Status ZeroRedundancyOptimizer::Impl::ResumeOptimizer(
    const checkpoint::OptimizerContent& saved) {
  // Checked and its options taken on an unsharded optimizer of the same
  // kind: a checkpoint of a sharded job or of an unsharded one alike.
  std::unique_ptr<optim::Optimizer> whole = MakeWhole();
  CONCORD_RETURN_IF_ERROR(checkpoint::ApplyOptimizer(saved, *whole));
  if (saved.type.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "optimizer '", name, "' was saved in LibTorch's own format, which ",
        kName, " does not take"));
  }
  CopyOptions(whole->param_groups(), groups());
  std::map<int64_t, NamedTensors> state;
  for (const auto& [i, tensors] : saved.state) state[i] = tensors;
  resumed = std::move(state);
  empty = false;
  return absl::OkStatus();
}

elastic::Participant* detail::ZeroParticipant(ZeroRedundancyOptimizer& zero,
                                              const std::string& name) {
  ZeroRedundancyOptimizer::Impl& z = zero.impl();
  RequireStateDictForm(z, "under run_elastic it needs");
  z.elastic = true;
  z.name = name;
  return &z;
}

optim::Optimizer& ZeroRedundancyOptimizer::local_optimizer() {
  return *impl_->local;
}

const optim::Optimizer& ZeroRedundancyOptimizer::local_optimizer() const {
  return *impl_->local;
}

int64_t ZeroRedundancyOptimizer::state_bytes() const {
  const Impl& z = *impl_;
  int64_t bytes = 0;
  auto add = [&bytes](const optim::Optimizer* o) {
    if (o == nullptr) return;
    for (const auto& [index, tensors] :
         checkpoint::CaptureOptimizer(kName, *o).state) {
      for (const auto& [key, t] : tensors) {
        if (key != "step") bytes += int64_t(t.nbytes());
      }
    }
  };
  add(z.local.get());
  add(z.mirror.get());
  // Under run_elastic, the shards as they were at the step's start.
  return bytes + z.own_copy.bytes() + z.mirror_copy.bytes();
}

std::vector<int> ZeroRedundancyOptimizer::owners() const {
  impl_->CheckOverlapReady("owners");
  return zero::OwnerOf(impl_->partition, NumelsOf(param_groups()));
}

}  // namespace concord
