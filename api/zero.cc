// concord::ZeroRedundancyOptimizer (include/concord/zero.h).

#include "concord/zero.h"

#include <torch/serialize.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api/internal.h"
#include "worker/checkpoint/content.h"
#include "worker/comm/coalesced.h"
#include "worker/error.h"
#include "worker/tensor_ops.h"
#include "worker/torch_compat.h"
#include "worker/zero/partition.h"

namespace concord {

namespace optim = torch::optim;

struct ZeroRedundancyOptimizer::Impl {
  Job job;
  ZeroOptions options;
  OptimizerFactory make;
  // The world the partition is for: the generation's communicator it was
  // made on, this rank in it.
  std::shared_ptr<comm::Communicator> comm;
  zero::Partition partition;
  std::unique_ptr<optim::Optimizer> local;
  // ZeroOptions::parameters_as_bucket_view: each rank's trainable
  // parameters, flat (one tensor per rank).
  std::vector<torch::Tensor> buckets;
  std::vector<bool> trainable;
  // What consolidate_state_dict gathered here (null elsewhere): an
  // unsharded optimizer of the wrapped kind over every parameter.
  std::unique_ptr<optim::Optimizer> consolidated;

  Impl(const Job& j, const ZeroOptions& o, OptimizerFactory m)
      : job(j), options(o), make(std::move(m)) {}

  int rank() const { return comm->rank(); }
  int world() const { return comm->size(); }
  comm::CollectiveOptions Collective() const {
    comm::CollectiveOptions o;
    o.timeout = absl::Milliseconds(job.timeouts().collective()->count());
    return o;
  }
  // ZeroOptions::parameters_as_bucket_view: (re)makes `buckets` and points
  // the parameters into them.
  void BuildBuckets(const std::vector<optim::OptimizerParamGroup>& groups);
  // kFailedPrecondition once the job left the generation `comm` is of.
  void CheckWorld() const;
  // Every rank's parameters from the rank that stepped them.
  void SyncParams(const std::vector<optim::OptimizerParamGroup>& groups);
};

namespace {

constexpr const char* kName = "ZeroRedundancyOptimizer";

[[noreturn]] void Fail(ErrorCode code, const std::string& message) {
  throw Error(code, absl::StrCat(kName, ": ", message));
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

// Every group's options from `from` to `to` (the same number of groups).
void CopyOptions(const std::vector<optim::OptimizerParamGroup>& from,
                 std::vector<optim::OptimizerParamGroup>& to) {
  for (size_t g = 0; g < from.size() && g < to.size(); ++g) {
    if (from[g].has_options()) to[g].set_options(from[g].options().clone());
  }
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
      impl_(std::make_unique<Impl>(job, options, std::move(make))) {
  const std::vector<torch::Tensor> params = AllParams(param_groups());
  CheckParams(params);
  impl_->comm = job.state()->session().shared_communicator();
  if (impl_->comm == nullptr) {
    Fail(ErrorCode::kFailedPrecondition,
         "the job is between generations (a re-form failed)");
  }
  impl_->partition =
      zero::PartitionParameters(NumelsOf(param_groups()), impl_->world());
  std::vector<std::vector<torch::Tensor>> mine;
  const auto& shard = impl_->partition[size_t(impl_->rank())];
  for (size_t g = 0; g < param_groups().size(); ++g) {
    std::vector<torch::Tensor> ps;
    for (int i : shard[g]) ps.push_back(param_groups()[g].params()[size_t(i)]);
    mine.push_back(std::move(ps));
  }
  impl_->local = impl_->make(GroupsWith(param_groups(), std::move(mine)));
  if (impl_->local == nullptr ||
      impl_->local->param_groups().size() != param_groups().size()) {
    Fail(ErrorCode::kInvalidArgument,
         "the optimizer factory must make an optimizer over exactly the "
         "groups it is given");
  }
  impl_->trainable = TrainableMask(params);
  impl_->BuildBuckets(param_groups());
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

void ZeroRedundancyOptimizer::Impl::BuildBuckets(
    const std::vector<optim::OptimizerParamGroup>& groups) {
  Impl& z = *this;
  z.buckets.clear();
  if (!z.options.parameters_as_bucket_view()) return;
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
                      ": its shards of the optimizer state do not follow a "
                      "re-form"));
  }
}

torch::Tensor ZeroRedundancyOptimizer::step(LossClosure closure) {
  Impl& z = *impl_;
  z.CheckWorld();
  std::vector<bool> mask = TrainableMask(AllParams(param_groups()));
  if (mask != z.trainable) {
    z.trainable = std::move(mask);
    z.BuildBuckets(param_groups());
  }
  CopyOptions(param_groups(), z.local->param_groups());
  torch::Tensor loss = z.local->step(std::move(closure));
  CopyOptions(z.local->param_groups(), param_groups());
  z.SyncParams(param_groups());
  return loss;
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
    flats.push_back(FlattenTensors(shard));
    works.push_back(z.comm->Broadcast(flats.back(), r, opts));
    shards.push_back(std::move(shard));
  }
  for (auto& w : works) ThrowIfError(w->Synchronize());
  if (!z.buckets.empty()) return;
  size_t k = 0;
  for (int r = 0; r < z.world(); ++r) {
    if (ShardOf(z.partition, groups, r).empty()) continue;
    if (r != z.rank()) UnflattenInto(flats[k], shards[k]);
    ++k;
  }
}

void ZeroRedundancyOptimizer::consolidate_state_dict(int to) {
  Impl& z = *impl_;
  z.CheckWorld();
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
  std::vector<std::pair<int64_t, NamedTensors>> state;
  const comm::CollectiveOptions opts = z.Collective();
  for (int r = 0; r < z.world(); ++r) {
    if (r == to) continue;
    std::string bytes;
    if (r == z.rank()) {
      std::vector<char> pickled =
          torch::pickle_save(checkpoint::OptimizerToIValue(mine));
      bytes.assign(pickled.begin(), pickled.end());
    }
    ThrowIfError(comm::BroadcastBytes(*z.comm, r, &bytes, opts));
    if (z.rank() != to) continue;
    auto theirs = checkpoint::OptimizerFromIValue(
        kName, mine.type, torch::pickle_load(Bytes(bytes)));
    ThrowIfError(theirs.status());
    for (auto& entry : theirs->state) state.push_back(std::move(entry));
  }
  z.consolidated.reset();
  if (z.rank() != to) return;
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
  std::vector<std::vector<torch::Tensor>> all;
  for (const auto& g : param_groups()) all.push_back(g.params());
  std::unique_ptr<optim::Optimizer> full =
      z.make(GroupsWith(param_groups(), std::move(all)));
  checkpoint::LoadNativeOptimizer(archive, *full);
  CopyOptions(full->param_groups(), param_groups());
  CopyOptions(param_groups(), z.local->param_groups());
  auto& state = z.local->state();
  state.clear();
  for (const auto& g : z.local->param_groups()) {
    for (const auto& p : g.params()) {
      auto it = full->state().find(compat::OptimizerStateKey(p));
      if (it != full->state().end()) {
        state[compat::OptimizerStateKey(p)] = it->second->clone();
      }
    }
  }
}

void ZeroRedundancyOptimizer::add_param_group(
    const optim::OptimizerParamGroup& group) {
  Impl& z = *impl_;
  z.CheckWorld();
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
  z.trainable = TrainableMask(AllParams(param_groups()));
  impl_->BuildBuckets(param_groups());
}

optim::Optimizer& ZeroRedundancyOptimizer::local_optimizer() {
  return *impl_->local;
}

const optim::Optimizer& ZeroRedundancyOptimizer::local_optimizer() const {
  return *impl_->local;
}

std::vector<int> ZeroRedundancyOptimizer::owners() const {
  return zero::OwnerOf(impl_->partition, NumelsOf(param_groups()));
}

}  // namespace concord
