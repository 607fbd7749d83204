// SlowMo's part of the elastic state (see Note [SlowMo step], "Beyond
// fairscale"): SyncState after a re-form takes the authoritative rank's
// counters, push-sum weight and fp32 masters, and Reshard re-assembles the
// slow-momentum slices (from owners or their replicas) over the new world;
// CheckpointState and ResumeState put the same state in checkpoints (see Note
// [Participants in checkpoints] in worker/elastic/state.h).

#include <algorithm>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/slowmo/slowmo.h"
#include "worker/tensor_ops.h"

namespace concord::slowmo {

absl::Status SlowMo::Reshard(int root, int64_t root_updates,
                             bool root_initialized, int64_t my_updates,
                             torch::optim::Optimizer& optimizer) {
  comm::CollectiveOptions opts;
  opts.timeout = options_.collective_timeout;
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
  if (!options_.slowmo_memory_efficient) {
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
        options_.base_algorithm == BaseAlgorithm::kSgp) {
      x = x.mul(ps_weight_);
    }
    x_old = torch::where(lost, x, x_old);
    u = torch::where(lost, torch::zeros_like(u), u);
    Log()->warn(
        "slow momentum: {} of {} elements lost with their owner{}; they "
        "restart from the current parameters",
        lost_count, n,
        options_.slowmo_memory_efficient ? " and its replica" : "s");
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
  opts.timeout = options_.collective_timeout;
  int64_t master_numel = -1;  // none
  if (!fp32_params_.empty()) master_numel = UnitOffsets().back();
  torch::Tensor header =
      torch::tensor({num_updates_, int64_t{initialized_ ? 1 : 0},
                     int64_t{is_numerator_ ? 1 : 0}, master_numel},
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

absl::StatusOr<NamedTensors> SlowMo::CheckpointState() {
  torch::NoGradGuard no_grad;
  NamedTensors out;
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
  const bool contributes = options_.slowmo_memory_efficient
                               ? len > 0 && momentum_.defined()
                               : master_rank_ == 0 && momentum_.defined();
  if (contributes) {
    both.narrow(0, portion_start_, len).copy_(momentum_);
    both.narrow(0, n + portion_start_, len).copy_(old_params_);
  }
  comm::CollectiveOptions opts;
  opts.timeout = options_.collective_timeout;
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
  // Everything fits: take it.
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
