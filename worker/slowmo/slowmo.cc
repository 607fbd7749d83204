#include "worker/slowmo/slowmo.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/comm/coalesced.h"

namespace concord::slowmo {
namespace {

// The parameters' values as one contiguous vector (a copy).
torch::Tensor Flatten(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& t : tensors) flat.push_back(t.reshape({-1}));
  return torch::cat(flat);
}

}  // namespace

// What update n does (fairscale's _should_* predicates).
struct SlowMo::Plan {
  bool slow = false;       // slow momentum step
  bool allreduce = false;  // exact parameter average
  bool gossip = false;     // one push-sum round
};

absl::StatusOr<std::unique_ptr<SlowMo>> SlowMo::Create(
    std::vector<torch::Tensor> params, std::vector<torch::Tensor> buffers,
    std::shared_ptr<comm::Communicator> comm, int authoritative_rank,
    SlowMoOptions options) {
  CONCORD_RETURN_IF_ERROR(ValidateOptions(options));
  if (comm == nullptr) return absl::InvalidArgumentError("no communicator");
  if (authoritative_rank < 0 || authoritative_rank >= comm->size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("authoritative rank ", authoritative_rank,
                     " out of range for world size ", comm->size()));
  }
  if (params.empty()) {
    return absl::InvalidArgumentError("SlowMo needs at least one parameter");
  }
  for (const auto& p : params) {
    if (!p.defined() || !p.is_floating_point() ||
        p.scalar_type() != params[0].scalar_type() ||
        p.device() != params[0].device()) {
      return absl::InvalidArgumentError(
          "SlowMo's parameters must be floating point, of one dtype and on "
          "one device");
    }
  }
  std::unique_ptr<SlowMo> s(new SlowMo());
  s->params_ = std::move(params);
  s->buffers_ = std::move(buffers);
  s->comm_ = std::move(comm);
  s->authoritative_rank_ = authoritative_rank;
  s->options_ = options;
  // fairscale: slow momentum off is slowmo_lr = 1 and slowmo_momentum = 0.
  s->slowmo_ = options.slowmo_lr != 1.0 || options.slowmo_momentum != 0.0;
  s->slowmo_lr_ = s->slowmo_ ? options.slowmo_lr : 1.0;
  s->slowmo_momentum_ = s->slowmo_ ? options.slowmo_momentum : 0.0;
  s->ps_weight_ = torch::ones({1}, s->params_[0].options());
  CONCORD_RETURN_IF_ERROR(s->RebuildGraph());
  return s;
}

absl::Status SlowMo::RebuildGraph() {
  gossip_round_ = 0;
  if (options_.base_algorithm != BaseAlgorithm::kSgp) return absl::OkStatus();
  auto graph = GossipGraph::Create(options_.graph, comm_->size(),
                                   options_.peers_per_itr);
  if (!graph.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SGP over ", comm_->size(), " ranks: ", graph.status().message()));
  }
  graph_ = std::move(*graph);
  return absl::OkStatus();
}

SlowMo::Plan SlowMo::PlanFor(int64_t update) const {
  Plan plan;
  plan.slow = slowmo_ && (update + 1) % options_.slowmo_frequency == 0;
  const bool skip = options_.slowmo_memory_efficient && plan.slow;
  const bool sgp = options_.base_algorithm == BaseAlgorithm::kSgp;
  const bool localsgd_due =
      options_.base_algorithm == BaseAlgorithm::kLocalSgd &&
      (update + 1) % options_.localsgd_frequency == 0;
  plan.allreduce = (sgp && plan.slow && options_.slowmo_sgp_average_params) ||
                   (localsgd_due && !skip);
  plan.gossip = sgp && !skip && !plan.allreduce;
  return plan;
}

absl::Status SlowMo::Wait(std::shared_ptr<comm::Work> work,
                          const char* what) const {
  absl::Status s = work->Wait();
  if (s.ok()) return s;
  return absl::Status(
      s.code(), absl::StrCat("SlowMo ", what, " (update ", num_updates_ + 1,
                             "): ", s.message()));
}

absl::Status SlowMo::PrepareForward() {
  if (options_.broadcast_buffers && !buffers_.empty()) {
    comm::CollectiveOptions opts;
    opts.timeout = options_.collective_timeout;
    absl::Status s =
        comm::BroadcastCoalesced(*comm_, buffers_, authoritative_rank_, opts);
    if (!s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat("SlowMo buffer broadcast: ", s.message()));
    }
  }
  Debias();
  return absl::OkStatus();
}

void SlowMo::Debias() {
  if (options_.base_algorithm != BaseAlgorithm::kSgp || !is_numerator_) return;
  torch::NoGradGuard no_grad;
  for (auto& p : params_) p.div_(ps_weight_);
  is_numerator_ = false;
}

void SlowMo::AfterBackward() {
  if (options_.base_algorithm != BaseAlgorithm::kSgp || is_numerator_) return;
  torch::NoGradGuard no_grad;
  for (auto& p : params_) p.mul_(ps_weight_);
  is_numerator_ = true;
}

absl::Status SlowMo::MapOptimizer(torch::optim::Optimizer& optimizer,
                                  std::vector<size_t>* index,
                                  std::vector<double>* lr) const {
  for (auto& group : optimizer.param_groups()) {
    const double group_lr = group.options().get_lr();
    if (!(group_lr > 0.0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "slow momentum divides by the learning rate, which is ", group_lr));
    }
    for (const auto& p : group.params()) {
      size_t i = 0;
      while (i < params_.size() &&
             params_[i].unsafeGetTensorImpl() != p.unsafeGetTensorImpl()) {
        ++i;
      }
      if (i == params_.size()) {
        return absl::InvalidArgumentError(
            "the optimizer has a parameter SlowMo was not given");
      }
      if (p.scalar_type() != torch::kFloat) {
        return absl::InvalidArgumentError(
            "slow momentum runs in fp32: the optimizer's parameters must be "
            "float32");
      }
      index->push_back(i);
      lr->push_back(group_lr);
    }
  }
  if (index->empty()) {
    return absl::InvalidArgumentError("the optimizer has no parameters");
  }
  return absl::OkStatus();
}

void SlowMo::Layout(int64_t total) {
  total_ = total;
  const int world = comm_->size();
  const int rank = comm_->rank();
  num_shards_ = options_.slowmo_memory_efficient
                    ? std::min(world, options_.slowmo_num_shards)
                    : 1;
  portion_length_ = (total + num_shards_ - 1) / num_shards_;
  if (!options_.slowmo_memory_efficient) {
    portion_start_ = 0;
    portion_end_ = total;
  } else if (rank < num_shards_) {
    portion_start_ = std::min<int64_t>(rank * portion_length_, total);
    portion_end_ = std::min<int64_t>((rank + 1) * portion_length_, total);
  } else {
    portion_start_ = portion_end_ = 0;
  }
}

absl::Status SlowMo::Gossip(torch::Tensor& flat, torch::Tensor& weight) {
  const GossipPeers peers = graph_->PeersAt(comm_->rank(), gossip_round_);
  const bool push_sum = options_.push_sum;
  if (!push_sum && peers.in.size() != peers.out.size()) {
    return absl::FailedPreconditionError(
        "push-pull gossip needs as many in-peers as out-peers");
  }
  const int64_t n = flat.numel();
  torch::Tensor message = push_sum ? torch::cat({flat, weight}) : flat;
  std::vector<torch::Tensor> received;
  for (size_t i = 0; i < peers.in.size(); ++i) {
    received.push_back(torch::empty_like(message));
  }
  comm::CollectiveOptions opts;
  opts.timeout = options_.collective_timeout;
  CONCORD_RETURN_IF_ERROR(Wait(
      comm_->Exchange(message, peers.out, received, peers.in, opts), "gossip"));
  // fairscale's lazy uniform mixing: (own + sum of received) * lo, with lo
  // = 1/(k+1) as a float32 tensor.
  const torch::Tensor lo =
      torch::tensor({1.0 / (static_cast<double>(peers.out.size()) + 1.0)},
                    torch::kFloat)
          .to(flat.options());
  torch::Tensor sum;
  if (received.size() == 1) {
    sum = received[0];
  } else {
    sum = torch::zeros_like(message);
    for (const auto& r : received) sum.add_(r);
  }
  flat = (flat + sum.narrow(0, 0, n)).mul_(lo);
  if (push_sum) weight = (weight + sum.narrow(0, n, 1)).mul_(lo);
  return absl::OkStatus();
}

absl::Status SlowMo::PerformSlowMo(torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  if (options_.base_algorithm == BaseAlgorithm::kSgp) AfterBackward();
  const Plan plan = PlanFor(num_updates_);
  comm::CollectiveOptions opts;
  opts.timeout = options_.collective_timeout;
  const int world = comm_->size();
  const bool first_slow = slowmo_ && !initialized_;
  if (!plan.gossip && !plan.allreduce && !plan.slow && !first_slow) {
    // Nothing to exchange this update (LocalSGD between averages): the
    // parameters stay as the optimizer left them.
    ++num_updates_;
    return absl::OkStatus();
  }

  // Offsets of the parameters in `flat` (SlowMo's order).
  std::vector<int64_t> offset(params_.size() + 1, 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    offset[i + 1] = offset[i] + params_[i].numel();
  }
  std::vector<size_t> order;  // optimizer order -> index into params_
  std::vector<double> lr;
  if (plan.slow || first_slow) {
    CONCORD_RETURN_IF_ERROR(MapOptimizer(optimizer, &order, &lr));
  }
  auto optimizer_flat = [&](const torch::Tensor& flat) {
    std::vector<torch::Tensor> parts;
    for (size_t i : order) {
      parts.push_back(flat.narrow(0, offset[i], params_[i].numel()));
    }
    return torch::cat(parts);
  };

  torch::Tensor flat = Flatten(params_);
  torch::Tensor weight = ps_weight_.clone();
  // fairscale creates x_old at the first call, before any averaging.
  torch::Tensor momentum = momentum_, old_params = old_params_;
  bool initialized = initialized_;
  if (slowmo_ && !initialized) {
    torch::Tensor y = optimizer_flat(flat);
    Layout(y.numel());
    old_params =
        y.narrow(0, portion_start_, portion_end_ - portion_start_).clone();
    momentum = torch::zeros_like(old_params);
    initialized = true;
  }

  if (plan.gossip) CONCORD_RETURN_IF_ERROR(Gossip(flat, weight));
  if (plan.allreduce) {
    flat.div_(world);
    CONCORD_RETURN_IF_ERROR(
        Wait(comm_->AllreduceSum(flat, opts), "parameter average"));
  }

  torch::Tensor y;  // the optimizer's parameters after the slow step
  if (plan.slow) {
    y = optimizer_flat(flat);
    if (y.numel() != total_) {
      return absl::InvalidArgumentError(
          absl::StrCat("the optimizer's parameters changed: ", y.numel(),
                       " elements, slow momentum holds ", total_));
    }
    auto shard = [&](int s) {
      const int64_t start = std::min<int64_t>(s * portion_length_, total_);
      const int64_t end = std::min<int64_t>((s + 1) * portion_length_, total_);
      return y.narrow(0, start, end - start);
    };
    const bool sharded = options_.slowmo_memory_efficient;
    if (sharded) {
      // fairscale's "gather": every rank divides, each slice is reduced to
      // its owner.
      y.div_(world);
      std::vector<std::shared_ptr<comm::Work>> works;
      for (int s = 0; s < num_shards_; ++s) {
        works.push_back(comm_->ReduceSum(shard(s), s, opts));
      }
      for (auto& w : works) {
        CONCORD_RETURN_IF_ERROR(Wait(w, "slow-momentum reduce"));
      }
    }
    if (portion_end_ > portion_start_) {
      momentum = momentum.clone();
      old_params = old_params.clone();
      int64_t at = 0;  // element offset of the parameter in `y`
      for (size_t j = 0; j < order.size(); ++j) {
        const int64_t numel = params_[order[j]].numel();
        const int64_t lo = std::max(portion_start_, at);
        const int64_t hi = std::min(portion_end_, at + numel);
        if (hi > lo) {
          torch::Tensor x = y.narrow(0, lo, hi - lo);
          torch::Tensor u = momentum.narrow(0, lo - portion_start_, hi - lo);
          torch::Tensor x_old =
              old_params.narrow(0, lo - portion_start_, hi - lo);
          // fairscale's _perform_local_optimization, op for op.
          u.mul_(slowmo_momentum_)
              .sub_(x, 1.0 / lr[j])
              .add_(x_old, 1.0 / lr[j]);
          x_old.add_(u, -lr[j] * slowmo_lr_);
          x.copy_(x_old);
        }
        at += numel;
      }
    }
    if (sharded) {
      std::vector<std::shared_ptr<comm::Work>> works;
      for (int s = 0; s < num_shards_; ++s) {
        works.push_back(comm_->Broadcast(shard(s), s, opts));
      }
      for (auto& w : works) {
        CONCORD_RETURN_IF_ERROR(Wait(w, "slow-momentum broadcast"));
      }
    }
  }

  // Every collective succeeded: apply.
  std::vector<int64_t> y_offset(params_.size(), -1);
  if (y.defined()) {
    int64_t at = 0;
    for (size_t i : order) {
      y_offset[i] = at;
      at += params_[i].numel();
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t numel = params_[i].numel();
    torch::Tensor value = y_offset[i] >= 0 ? y.narrow(0, y_offset[i], numel)
                                           : flat.narrow(0, offset[i], numel);
    params_[i].copy_(value.view(params_[i].sizes()));
  }
  ps_weight_ = weight;
  momentum_ = momentum;
  old_params_ = old_params;
  initialized_ = initialized;
  if (plan.gossip) ++gossip_round_;
  ++num_updates_;
  return absl::OkStatus();
}

absl::Status SlowMo::Reshard(int root, int64_t root_updates,
                             bool root_initialized, int64_t my_updates,
                             torch::optim::Optimizer& optimizer) {
  comm::CollectiveOptions opts;
  opts.timeout = options_.collective_timeout;
  if (!slowmo_ || !root_initialized) {
    initialized_ = false;
    momentum_ = old_params_ = torch::Tensor();
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
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat);
  torch::Tensor u, x_old;
  if (!options_.slowmo_memory_efficient) {
    // Every rank holds everything: take the authoritative rank's.
    const bool mine = comm_->rank() == root;
    u = mine ? momentum_.clone() : torch::empty({n}, f32);
    x_old = mine ? old_params_.clone() : torch::empty({n}, f32);
    CONCORD_RETURN_IF_ERROR(
        Wait(comm_->Broadcast(u, root, opts), "slow-momentum broadcast"));
    CONCORD_RETURN_IF_ERROR(
        Wait(comm_->Broadcast(x_old, root, opts), "old-parameter broadcast"));
  } else {
    // Each surviving owner puts its slice where it belongs in the full
    // vectors; a sum then gives everyone the whole (each element has at
    // most one owner). Only owners whose state is that of the authoritative
    // rank's update count contribute.
    u = torch::zeros({n}, f32);
    x_old = torch::zeros({n}, f32);
    torch::Tensor owned = torch::zeros({n}, torch::kInt);
    if (initialized_ && my_updates == root_updates &&
        portion_end_ > portion_start_ && momentum_.defined()) {
      const int64_t len = portion_end_ - portion_start_;
      u.narrow(0, portion_start_, len).copy_(momentum_);
      x_old.narrow(0, portion_start_, len).copy_(old_params_);
      owned.narrow(0, portion_start_, len).fill_(1);
    }
    CONCORD_RETURN_IF_ERROR(
        Wait(comm_->AllreduceSum(u, opts), "slow-momentum re-shard"));
    CONCORD_RETURN_IF_ERROR(
        Wait(comm_->AllreduceSum(x_old, opts), "old-parameter re-shard"));
    CONCORD_RETURN_IF_ERROR(
        Wait(comm_->AllreduceSum(owned, opts), "re-shard ownership"));
    if (owned.max().item<int>() > 1) {
      return absl::InternalError("two ranks owned one slow-momentum element");
    }
    const torch::Tensor lost = owned.eq(0);
    const int64_t lost_count = lost.sum().item<int64_t>();
    if (lost_count > 0) {
      // Its owner is gone: slow momentum restarts there from the current
      // (authoritative) parameters.
      std::vector<size_t> order;
      std::vector<double> lr;
      CONCORD_RETURN_IF_ERROR(MapOptimizer(optimizer, &order, &lr));
      std::vector<torch::Tensor> parts;
      for (size_t i : order) parts.push_back(params_[i].reshape({-1}));
      torch::Tensor x = torch::cat(parts);
      // The slow step works on push-sum numerators.
      if (!is_numerator_ && options_.base_algorithm == BaseAlgorithm::kSgp) {
        x = x.mul(ps_weight_);
      }
      x_old = torch::where(lost, x, x_old);
      spdlog::warn(
          "slow momentum: {} of {} elements lost with their owner; they "
          "restart from the current parameters",
          lost_count, n);
    }
  }
  Layout(n);
  const int64_t len = portion_end_ - portion_start_;
  momentum_ = u.narrow(0, portion_start_, len).clone();
  old_params_ = x_old.narrow(0, portion_start_, len).clone();
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
  torch::Tensor header =
      torch::tensor({num_updates_, int64_t{initialized_ ? 1 : 0},
                     int64_t{is_numerator_ ? 1 : 0}},
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
  CONCORD_RETURN_IF_ERROR(Reshard(authoritative_rank, root_updates,
                                  root_initialized, my_updates, optimizer));
  num_updates_ = root_updates;
  CONCORD_RETURN_IF_ERROR(RebuildGraph());
  if (num_updates_ == step - 1) {
    spdlog::info("SlowMo: finishing update {} in generation {}", step,
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

}  // namespace concord::slowmo
