// SlowMo's part of the elastic state (see Note [SlowMo step], "Beyond
// fairscale"): SyncState after a re-form takes the authoritative rank's
// counters, push-sum weight and fp32 masters, and Reshard re-assembles the
// slow-momentum slices (from owners or their replicas) over the new world;
// CheckpointState and ResumeState put the same state in checkpoints (see Note
// [Participants in checkpoints] in worker/elastic/state.h), with each rank's
// optimizer state (see Note [Each rank's optimizer state] in slowmo.h).

#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/checkpoint/content.h"
#include "worker/slowmo/slowmo.h"
#include "worker/tensor_ops.h"

namespace concord::slowmo {
namespace {

// See Note [Each rank's optimizer state].
constexpr char kRankState[] = "rank_optimizer/";

// `content`'s per-parameter state tensors in CaptureOptimizer's order, each
// named "<index>/<key>"; none for an optimizer PyTorch has no file for.
NamedTensors StateEntries(const checkpoint::OptimizerContent& content) {
  NamedTensors out;
  if (content.type.empty()) return out;
  for (const auto& [index, tensors] : content.state) {
    for (const auto& [key, t] : tensors) {
      out.emplace_back(absl::StrCat(index, "/", key), t);
    }
  }
  return out;
}

// The entries' positions grouped by dtype and device (one collective a
// group), in order of first appearance.
std::vector<std::vector<size_t>> ByOptions(const NamedTensors& entries) {
  std::vector<std::vector<size_t>> groups;
  for (size_t i = 0; i < entries.size(); ++i) {
    const at::Tensor& t = entries[i].second;
    auto same = [&](const std::vector<size_t>& g) {
      const at::Tensor& first = entries[g.front()].second;
      return first.scalar_type() == t.scalar_type() &&
             first.device() == t.device();
    };
    auto it = std::find_if(groups.begin(), groups.end(), same);
    if (it == groups.end()) {
      groups.push_back({i});
    } else {
      it->push_back(i);
    }
  }
  return groups;
}

int64_t Numel(const NamedTensors& entries) {
  int64_t n = 0;
  for (const auto& entry : entries) n += entry.second.numel();
  return n;
}

}  // namespace

absl::StatusOr<NamedTensors> SlowMo::GatherRankState(
    const torch::optim::Optimizer& optimizer) {
  rank_state_saved_ = false;
  NamedTensors out;
  if (num_nodes_ <= 1) return out;  // every rank's is the same
  const NamedTensors entries =
      StateEntries(checkpoint::CaptureOptimizer("optimizer", optimizer));
  // Every rank learns whether all have the same entries, sizes and dtypes.
  std::string layout;
  for (const auto& [name, t] : entries) {
    absl::StrAppend(&layout, name, checkpoint::DescribeTensor(t), ";");
  }
  const int world = comm_->size();
  comm::CollectiveOptions opts;
  opts.timeout = internals_.collective_timeout;
  torch::Tensor mine = torch::tensor(
      {static_cast<int64_t>(entries.size()), Numel(entries),
       static_cast<int64_t>(std::hash<std::string>{}(layout) >> 1)},
      torch::kLong);
  torch::Tensor all = torch::empty({world * 3}, torch::kLong);
  CONCORD_RETURN_IF_ERROR(
      Wait(comm_->Allgather(all, mine, opts), "optimizer state layout gather"));
  if (entries.empty() ||
      !torch::equal(all.view({world, 3}), mine.expand({world, 3}))) {
    return out;
  }
  std::vector<torch::Tensor> gathered(entries.size());
  for (const std::vector<size_t>& group : ByOptions(entries)) {
    std::vector<torch::Tensor> flat;
    for (size_t i : group) flat.push_back(entries[i].second.reshape({-1}));
    torch::Tensor local = torch::cat(flat);
    const int64_t n = local.numel();
    torch::Tensor rows = torch::empty({world * n}, local.options());
    CONCORD_RETURN_IF_ERROR(
        Wait(comm_->Allgather(rows, local, opts), "optimizer state gather"));
    rows = rows.view({world, n});
    int64_t at = 0;
    for (size_t i : group) {
      const torch::Tensor& t = entries[i].second;
      std::vector<int64_t> shape{world};
      shape.insert(shape.end(), t.sizes().begin(), t.sizes().end());
      gathered[i] = rows.narrow(1, at, t.numel()).reshape(shape);
      at += t.numel();
    }
  }
  for (size_t i = 0; i < entries.size(); ++i) {
    out.emplace_back(absl::StrCat(kRankState, entries[i].first),
                     std::move(gathered[i]));
  }
  rank_state_saved_ = true;
  return out;
}

absl::Status SlowMo::CheckRankState(
    const std::map<std::string, torch::Tensor>& saved,
    const torch::optim::Optimizer& optimizer,
    std::vector<torch::Tensor>* rows) const {
  rows->clear();
  std::map<std::string, torch::Tensor> left;
  for (const auto& [key, t] : saved) {
    if (key.rfind(kRankState, 0) == 0) {
      left.emplace(key.substr(sizeof(kRankState) - 1), t);
    }
  }
  if (left.empty()) return absl::OkStatus();
  const std::string what = "each rank's optimizer state in the checkpoint";
  int64_t world = -1;
  for (const auto& [name, t] :
       StateEntries(checkpoint::CaptureOptimizer("optimizer", optimizer))) {
    auto it = left.find(name);
    if (it == left.end()) {
      return absl::FailedPreconditionError(absl::StrCat(what, " lacks ", name));
    }
    const torch::Tensor& r = it->second;
    if (r.dim() != t.dim() + 1 || r.size(0) < 1 ||
        (world >= 0 && r.size(0) != world) || r.sizes().slice(1) != t.sizes() ||
        r.scalar_type() != t.scalar_type()) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": ", name, " is ", checkpoint::DescribeTensor(r),
                       " for a state of ", checkpoint::DescribeTensor(t)));
    }
    world = r.size(0);
    rows->push_back(r);
    left.erase(it);
  }
  if (!left.empty()) {
    rows->clear();
    return absl::FailedPreconditionError(absl::StrCat(
        what, " has ", left.begin()->first, ", which the optimizer lacks"));
  }
  return absl::OkStatus();
}

absl::Status SlowMo::ScatterRankState(int root, int64_t root_world,
                                      int64_t root_numel,
                                      torch::optim::Optimizer& optimizer) {
  if (root_world == 0) {
    resume_rows_.clear();
    return absl::OkStatus();
  }
  checkpoint::OptimizerContent content =
      checkpoint::CaptureOptimizer("optimizer", optimizer);
  const NamedTensors entries = StateEntries(content);
  const bool is_root = comm_->rank() == root;
  comm::CollectiveOptions opts;
  opts.timeout = internals_.collective_timeout;
  // Every rank learns whether any disagrees, so that all of them fail.
  torch::Tensor mismatch =
      torch::tensor({Numel(entries) != root_numel ||
                             (is_root && resume_rows_.size() != entries.size())
                         ? 1
                         : 0},
                    torch::kInt);
  CONCORD_RETURN_IF_ERROR(
      Wait(comm_->AllreduceSum(mismatch, opts), "optimizer state check"));
  if (mismatch.item<int>() > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("each rank's optimizer state: ", root_numel,
                     " elements on the loading rank, ", Numel(entries),
                     " here, and ", mismatch.item<int>(), " rank(s) disagree"));
  }
  const int rank = comm_->rank();
  std::vector<torch::Tensor> own(entries.size());
  for (const std::vector<size_t>& group : ByOptions(entries)) {
    int64_t n = 0;
    for (size_t i : group) n += entries[i].second.numel();
    torch::Tensor rows =
        torch::empty({root_world, n}, entries[group.front()].second.options());
    int64_t at = 0;
    for (size_t i : group) {
      const int64_t k = entries[i].second.numel();
      if (is_root) {
        rows.narrow(1, at, k).copy_(resume_rows_[i].reshape({root_world, k}));
      }
      at += k;
    }
    CONCORD_RETURN_IF_ERROR(
        Wait(comm_->Broadcast(rows, root, opts), "optimizer state broadcast"));
    if (rank >= root_world) continue;
    at = 0;
    for (size_t i : group) {
      const torch::Tensor& t = entries[i].second;
      own[i] =
          rows.select(0, rank).narrow(0, at, t.numel()).view(t.sizes()).clone();
      at += t.numel();
    }
  }
  if (is_root) {
    Log()->info(
        "SlowMo: ranks below {} take their own optimizer state from the "
        "checkpoint (saved at world size {})",
        std::min<int64_t>(root_world, comm_->size()), root_world);
  }
  resume_rows_.clear();
  if (rank >= root_world) return absl::OkStatus();  // the loaded state
  size_t i = 0;
  for (auto& [index, tensors] : content.state) {
    for (auto& [key, t] : tensors) t = own[i++];
  }
  return checkpoint::ApplyOptimizer(content, optimizer);
}

absl::Status SlowMo::Reshard(int root, int64_t root_updates,
                             bool root_initialized, int64_t my_updates,
                             torch::optim::Optimizer& optimizer) {
  comm::CollectiveOptions opts;
  opts.timeout = internals_.collective_timeout;
  if (!slowmo_ || !root_initialized) {
    initialized_ = false;
    momentum_ = old_params_ = torch::Tensor();
    replica_momentum_ = replica_old_params_ = torch::Tensor();
    return absl::OkStatus();
  }
  torch::Tensor total = torch::tensor({total_}, torch::kLong);
  CONCORD_RETURN_IF_ERROR(
      Wait(comm_->Broadcast(total, root, opts), "state size broadcast"));
  const int64_t n = total.item<int64_t>();
  if (initialized_ && total_ != n) {
    return absl::FailedPreconditionError(
        absl::StrCat("slow momentum holds ", total_, " elements here and ", n,
                     " on the authoritative rank"));
  }
  const auto f32 = StateOptions(torch::kFloat);
  // Only state of the authoritative rank's update count counts. The
  // exchange runs over the whole generation: with a hierarchy the state
  // may sit on a rank that is no longer a master.
  const bool valid = initialized_ && my_updates == root_updates;
  torch::Tensor u, x_old, lost;
  if (!options_.slowmo_memory_efficient()) {
    // Every master holds everything: take it from the lowest rank that has
    // it (the authoritative rank unless it is no master).
    torch::Tensor has =
        torch::zeros({comm_->size()}, StateOptions(torch::kInt));
    if (valid && momentum_.defined() && momentum_.numel() == n) {
      has[comm_->rank()] = 1;
    }
    CONCORD_RETURN_IF_ERROR(
        Wait(comm_->AllreduceSum(has, opts), "slow-momentum holders"));
    const torch::Tensor holders = has.nonzero();
    if (holders.numel() > 0) {
      const int source = has[root].item<int>() > 0
                             ? root
                             : static_cast<int>(holders[0][0].item<int64_t>());
      torch::Tensor both = comm_->rank() == source
                               ? torch::cat({momentum_, old_params_})
                               : torch::empty({2 * n}, f32);
      CONCORD_RETURN_IF_ERROR(Wait(comm_->Broadcast(both, source, opts),
                                   "slow-momentum broadcast"));
      u = both.narrow(0, 0, n);
      x_old = both.narrow(0, n, n);
      lost = torch::zeros({n}, StateOptions(torch::kBool));
    } else {
      u = torch::zeros({n}, f32);
      x_old = torch::zeros({n}, f32);
      lost = torch::ones({n}, StateOptions(torch::kBool));
    }
  } else {
    // Each surviving owner puts its slice where it belongs in the full
    // vectors; then each surviving replica of a slice no owner claimed; a
    // sum gives everyone the whole (each element has one source at most).
    torch::Tensor owned = torch::zeros({n}, StateOptions(torch::kInt));
    const int64_t len = portion_end_ - portion_start_;
    const bool owner =
        valid && len > 0 && momentum_.defined() && momentum_.numel() == len;
    if (owner) owned.narrow(0, portion_start_, len).fill_(1);
    CONCORD_RETURN_IF_ERROR(
        Wait(comm_->AllreduceSum(owned, opts), "re-shard ownership"));
    if (owned.max().item<int>() > 1) {
      return absl::InternalError("two ranks owned one slow-momentum element");
    }
    // [u, x_old, replica claims].
    torch::Tensor packed = torch::zeros({3 * n}, f32);
    if (owner) {
      packed.narrow(0, portion_start_, len).copy_(momentum_);
      packed.narrow(0, n + portion_start_, len).copy_(old_params_);
    }
    const int64_t rlen = replica_end_ - replica_start_;
    if (valid && rlen > 0 && replica_momentum_.defined() &&
        replica_momentum_.numel() == rlen) {
      const torch::Tensor orphan =
          owned.narrow(0, replica_start_, rlen).eq(0).to(torch::kFloat);
      packed.narrow(0, replica_start_, rlen).add_(replica_momentum_ * orphan);
      packed.narrow(0, n + replica_start_, rlen)
          .add_(replica_old_params_ * orphan);
      packed.narrow(0, 2 * n + replica_start_, rlen).copy_(orphan);
    }
    CONCORD_RETURN_IF_ERROR(
        Wait(comm_->AllreduceSum(packed, opts), "slow-momentum re-shard"));
    const torch::Tensor claims = packed.narrow(0, 2 * n, n);
    if (claims.max().item<float>() > 1.0f) {
      return absl::InternalError(
          "two replicas claimed one slow-momentum element");
    }
    const int64_t from_replicas = claims.gt(0.5f).sum().item<int64_t>();
    if (from_replicas > 0) {
      Log()->info(
          "slow momentum: {} of {} elements taken from replicas (their "
          "owner is gone)",
          from_replicas, n);
    }
    u = packed.narrow(0, 0, n);
    x_old = packed.narrow(0, n, n);
    lost = owned.eq(0).logical_and(claims.lt(0.5f));
  }
  const int64_t lost_count = lost.sum().item<int64_t>();
  if (lost_count > 0) {
    // Every holder is gone: slow momentum restarts there from the current
    // (authoritative) parameters.
    std::vector<size_t> order;
    std::vector<double> lr;
    CONCORD_RETURN_IF_ERROR(MapOptimizer(optimizer, &order, &lr));
    std::vector<torch::Tensor> parts;
    for (size_t i : order) parts.push_back(Units()[i].reshape({-1}));
    torch::Tensor x = torch::cat(parts);
    // The slow step works on push-sum numerators (fp32 masters hold them
    // throughout).
    if (fp32_params_.empty() && !is_numerator_ &&
        options_.base_algorithm() == BaseAlgorithm::kSgp) {
      x = x.mul(ps_weight_);
    }
    x_old = torch::where(lost, x, x_old);
    u = torch::where(lost, torch::zeros_like(u), u);
    Log()->warn(
        "slow momentum: {} of {} elements lost with their owner{}; they "
        "restart from the current parameters",
        lost_count, n,
        options_.slowmo_memory_efficient() ? " and its replica" : "s");
  }
  Layout(n);
  const int64_t len = portion_end_ - portion_start_;
  momentum_ = u.narrow(0, portion_start_, len).clone();
  old_params_ = x_old.narrow(0, portion_start_, len).clone();
  const int64_t rlen = replica_end_ - replica_start_;
  replica_momentum_ = u.narrow(0, replica_start_, rlen).clone();
  replica_old_params_ = x_old.narrow(0, replica_start_, rlen).clone();
  initialized_ = true;
  return absl::OkStatus();
}

absl::Status SlowMo::SyncState(std::shared_ptr<comm::Communicator> comm,
                               int authoritative_rank, int64_t step,
                               torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  const int64_t my_updates = num_updates_;
  comm_ = std::move(comm);
  authoritative_rank_ = authoritative_rank;
  comm::CollectiveOptions opts;
  opts.timeout = internals_.collective_timeout;
  int64_t master_numel = -1;  // none
  if (!fp32_params_.empty()) master_numel = UnitOffsets().back();
  // See Note [Each rank's optimizer state]: the rows a resume hands out.
  const int64_t resume_world =
      resume_rows_.empty() ? 0 : resume_rows_.front().size(0);
  int64_t rank_state_numel = 0;
  for (const torch::Tensor& r : resume_rows_) {
    rank_state_numel += r.numel() / resume_world;
  }
  torch::Tensor header =
      torch::tensor({num_updates_, int64_t{initialized_ ? 1 : 0},
                     int64_t{is_numerator_ ? 1 : 0}, master_numel, resume_world,
                     rank_state_numel},
                    torch::kLong);
  CONCORD_RETURN_IF_ERROR(Wait(
      comm_->Broadcast(header, authoritative_rank, opts), "state broadcast"));
  const int64_t root_updates = header[0].item<int64_t>();
  const bool root_initialized = header[1].item<int64_t>() != 0;
  torch::Tensor weight = ps_weight_.clone();
  CONCORD_RETURN_IF_ERROR(
      Wait(comm_->Broadcast(weight, authoritative_rank, opts),
           "push-sum weight broadcast"));
  ps_weight_ = weight;
  is_numerator_ = header[2].item<int64_t>() != 0;
  // See Note [fp16 masters]: the optimizer's fp32 masters follow the
  // authoritative rank like the model.
  // Every rank learns whether any disagrees, so that all of them fail.
  const int64_t root_master_numel = header[3].item<int64_t>();
  torch::Tensor mismatch =
      torch::tensor({root_master_numel != master_numel ? 1 : 0}, torch::kInt);
  CONCORD_RETURN_IF_ERROR(
      Wait(comm_->AllreduceSum(mismatch, opts), "fp32 master check"));
  if (mismatch.item<int>() > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "fp32 masters: ", std::max<int64_t>(root_master_numel, 0),
        " elements on the authoritative rank, ",
        std::max<int64_t>(master_numel, 0), " here, and ", mismatch.item<int>(),
        " rank(s) disagree: call SetFp32Params alike on every rank before "
        "elastic::State::Sync"));
  }
  if (master_numel >= 0) {
    torch::Tensor all = FlattenTensors(fp32_params_);
    CONCORD_RETURN_IF_ERROR(
        Wait(comm_->Broadcast(all, authoritative_rank, opts),
             "fp32 master broadcast"));
    const std::vector<int64_t> at = UnitOffsets();
    for (size_t i = 0; i < fp32_params_.size(); ++i) {
      fp32_params_[i].copy_(all.narrow(0, at[i], fp32_params_[i].numel())
                                .view(fp32_params_[i].sizes()));
    }
  }
  // See Note [Each rank's optimizer state]: after a resume.
  CONCORD_RETURN_IF_ERROR(
      ScatterRankState(authoritative_rank, header[4].item<int64_t>(),
                       header[5].item<int64_t>(), optimizer));
  CONCORD_RETURN_IF_ERROR(EnsureGroups());
  CONCORD_RETURN_IF_ERROR(Reshard(authoritative_rank, root_updates,
                                  root_initialized, my_updates, optimizer));
  num_updates_ = root_updates;
  CONCORD_RETURN_IF_ERROR(RebuildGraph());
  if (num_updates_ == step - 1) {
    Log()->info("SlowMo: finishing update {} in generation {}", step,
                comm_->generation());
    return PerformSlowMo(optimizer);
  }
  if (num_updates_ != step) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SlowMo has performed ", num_updates_,
        " updates but the committed step is ", step,
        ": call PerformSlowMo once after every optimizer step, after "
        "State::Commit"));
  }
  return absl::OkStatus();
}

absl::StatusOr<NamedTensors> SlowMo::CheckpointState(
    const torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  CONCORD_ASSIGN_OR_RETURN(NamedTensors out, GatherRankState(optimizer));
  out.emplace_back("updates", torch::tensor(num_updates_, torch::kLong));
  out.emplace_back("push_sum_weight", ps_weight_.clone());
  out.emplace_back("push_sum_numerator",
                   torch::tensor(int64_t{is_numerator_ ? 1 : 0}, torch::kLong));
  if (!fp32_params_.empty()) {
    out.emplace_back("fp32_masters", FlattenTensors(fp32_params_));
  }
  // initialized_ and total_ are the same on every rank (Layout runs
  // everywhere).
  if (!slowmo_ || !initialized_) return out;
  const int64_t n = total_;
  // Each slice once: its owner's (memory-efficient), else the first
  // master's (every master holds all of it).
  torch::Tensor both = torch::zeros({2 * n}, StateOptions(torch::kFloat));
  const int64_t len = portion_end_ - portion_start_;
  const bool contributes = options_.slowmo_memory_efficient()
                               ? len > 0 && momentum_.defined()
                               : master_rank_ == 0 && momentum_.defined();
  if (contributes) {
    both.narrow(0, portion_start_, len).copy_(momentum_);
    both.narrow(0, n + portion_start_, len).copy_(old_params_);
  }
  comm::CollectiveOptions opts;
  opts.timeout = internals_.collective_timeout;
  CONCORD_RETURN_IF_ERROR(
      Wait(comm_->AllreduceSum(both, opts), "slow-momentum gather"));
  out.emplace_back("slow_momentum", both.narrow(0, 0, n));
  out.emplace_back("old_params", both.narrow(0, n, n));
  return out;
}

absl::Status SlowMo::ResumeState(const NamedTensors* saved,
                                 torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  if (saved == nullptr) {
    initialized_ = false;
    momentum_ = old_params_ = torch::Tensor();
    replica_momentum_ = replica_old_params_ = torch::Tensor();
    resume_rows_.clear();
    return absl::OkStatus();
  }
  std::map<std::string, torch::Tensor> by_name(saved->begin(), saved->end());
  auto get = [&](const char* key) -> torch::Tensor {
    auto it = by_name.find(key);
    return it == by_name.end() ? torch::Tensor() : it->second;
  };
  const torch::Tensor updates = get("updates");
  const torch::Tensor weight = get("push_sum_weight");
  const torch::Tensor numerator = get("push_sum_numerator");
  if (!updates.defined() || updates.numel() != 1 || !weight.defined() ||
      weight.numel() != 1 || !numerator.defined() || numerator.numel() != 1) {
    return absl::FailedPreconditionError(
        "the checkpoint has no SlowMo state for it (was it saved without "
        "SlowMo?)");
  }
  const torch::Tensor masters = get("fp32_masters");
  const int64_t master_numel = fp32_params_.empty() ? 0 : UnitOffsets().back();
  if (masters.defined() != !fp32_params_.empty() ||
      (masters.defined() && masters.numel() != master_numel)) {
    return absl::FailedPreconditionError(
        absl::StrCat("fp32 masters: ", masters.defined() ? masters.numel() : 0,
                     " elements in the checkpoint, ", master_numel, " here"));
  }
  const torch::Tensor u = get("slow_momentum");
  const torch::Tensor x_old = get("old_params");
  if (u.defined() != x_old.defined() ||
      (u.defined() && u.numel() != x_old.numel())) {
    return absl::FailedPreconditionError(
        "slow momentum and old parameters do not match in the checkpoint");
  }
  const bool momentum = slowmo_ && u.defined();
  if (momentum) {
    std::vector<size_t> order;
    std::vector<double> lr;
    CONCORD_RETURN_IF_ERROR(MapOptimizer(optimizer, &order, &lr));
    int64_t n = 0;
    for (size_t i : order) n += Units()[i].numel();
    if (u.numel() != n) {
      return absl::FailedPreconditionError(
          absl::StrCat("slow momentum of ", u.numel(),
                       " elements in the checkpoint; the optimizer steps ", n));
    }
  }
  std::vector<torch::Tensor> rows;
  CONCORD_RETURN_IF_ERROR(CheckRankState(by_name, optimizer, &rows));
  // Everything fits: take it.
  resume_rows_ = std::move(rows);
  num_updates_ = updates.item<int64_t>();
  ps_weight_ = weight.reshape({1}).to(ps_weight_.options()).clone();
  is_numerator_ = numerator.item<int64_t>() != 0;
  if (masters.defined()) {
    UnflattenInto(masters.to(fp32_params_.front().options()), fp32_params_);
  }
  replica_start_ = replica_end_ = 0;
  replica_momentum_ = replica_old_params_ = torch::Tensor();
  initialized_ = momentum;
  if (!momentum) {
    momentum_ = old_params_ = torch::Tensor();
    return absl::OkStatus();
  }
  // The whole vector, as its one owner until Reshard.
  total_ = u.numel();
  portion_start_ = 0;
  portion_end_ = total_;
  momentum_ = u.to(StateOptions(torch::kFloat)).clone();
  old_params_ = x_old.to(StateOptions(torch::kFloat)).clone();
  return absl::OkStatus();
}

}  // namespace concord::slowmo
