#include "worker/slowmo/slowmo.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/comm/coalesced.h"
#include "worker/slowmo/hierarchy.h"
#include "worker/tensor_ops.h"

namespace concord::slowmo {

// What update n does (fairscale's _should_* predicates).
struct SlowMo::Plan {
  bool slow = false;       // slow momentum step
  bool allreduce = false;  // exact parameter average
  bool gossip = false;     // one push-sum round
};

absl::StatusOr<std::unique_ptr<SlowMo>> SlowMo::Create(
    std::vector<torch::Tensor> params, std::vector<torch::Tensor> buffers,
    std::shared_ptr<comm::Communicator> comm, int authoritative_rank,
    concord::SlowMoOptions options, SlowMoInternals internals,
    comm::GroupFactory* groups) {
  CONCORD_RETURN_IF_ERROR(ValidateOptions(options, internals));
  if (comm == nullptr) return absl::InvalidArgumentError("no communicator");
  if (options.nprocs_per_node() > 1 && groups == nullptr) {
    return absl::InvalidArgumentError(
        "nprocs_per_node > 1 needs a group factory for the node groups");
  }
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
  s->graph_type_ = *GraphOf(options);
  s->options_ = std::move(options);
  s->internals_ = std::move(internals);
  const concord::SlowMoOptions& o = s->options_;
  // fairscale: slow momentum off is slowmo_lr = 1 and slowmo_momentum = 0.
  s->slowmo_ = o.slowmo_lr() != 1.0 || o.slowmo_momentum() != 0.0;
  s->slowmo_lr_ = s->slowmo_ ? o.slowmo_lr() : 1.0;
  s->slowmo_momentum_ = s->slowmo_ ? o.slowmo_momentum() : 0.0;
  s->ps_weight_ = torch::ones({1}, s->params_[0].options());
  s->groups_ = groups;
  s->num_nodes_ = s->comm_->size();
  s->master_rank_ = s->comm_->rank();
  // With a hierarchy the graph is over the nodes, known once connected.
  if (o.nprocs_per_node() == 1) CONCORD_RETURN_IF_ERROR(s->RebuildGraph());
  return s;
}

absl::Status SlowMo::RebuildGraph() {
  gossip_round_ = 0;
  if (options_.base_algorithm() != BaseAlgorithm::kSgp) return absl::OkStatus();
  auto graph =
      GossipGraph::Create(graph_type_, num_nodes_, options_.peers_per_itr());
  if (!graph.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("SGP over ", num_nodes_,
                     options_.nprocs_per_node() > 1 ? " nodes: " : " ranks: ",
                     graph.status().message()));
  }
  graph_ = std::move(*graph);
  return absl::OkStatus();
}

absl::Status SlowMo::EnsureGroups() {
  if (groups_for_.lock() == comm_) return absl::OkStatus();
  node_.reset();
  masters_ = comm_;
  num_nodes_ = comm_->size();
  master_rank_ = comm_->rank();
  if (options_.nprocs_per_node() > 1) {
    comm::CollectiveOptions opts;
    opts.timeout = internals_.collective_timeout;
    std::vector<std::string> ids(1, internals_.node_id);
    if (comm_->size() > 1) {
      absl::StatusOr<std::vector<std::string>> all =
          comm::AllgatherStrings(*comm_, internals_.node_id, opts);
      if (!all.ok()) {
        return absl::Status(
            all.status().code(),
            absl::StrCat("SlowMo node ids: ", all.status().message()));
      }
      ids = *std::move(all);
    }
    const NodeLayout layout = GroupNodes(ids, options_.nprocs_per_node());
    const int me = comm_->rank();
    const std::vector<int>& node = layout.nodes[static_cast<size_t>(
        layout.node_of[static_cast<size_t>(me)])];
    num_nodes_ = static_cast<int>(layout.masters.size());
    master_rank_ = -1;
    for (int m = 0; m < num_nodes_; ++m) {
      if (layout.masters[static_cast<size_t>(m)] == me) master_rank_ = m;
    }
    if (node.size() > 1) {
      CONCORD_ASSIGN_OR_RETURN(
          node_, groups_->CreateGroup(
                     *comm_, absl::StrCat("slowmo-node-", node[0]), node));
    }
    if (master_rank_ < 0) {
      masters_.reset();
    } else if (num_nodes_ < comm_->size()) {
      CONCORD_ASSIGN_OR_RETURN(
          masters_,
          groups_->CreateGroup(*comm_, "slowmo-masters", layout.masters));
    }
    Log()->info(
        "SlowMo: generation {}: {} node(s) over {} ranks; rank {} is {} of "
        "a node of {}",
        comm_->generation(), num_nodes_, comm_->size(), me,
        master_rank_ >= 0 ? "the master" : "a member", node.size());
    CONCORD_RETURN_IF_ERROR(RebuildGraph());
  }
  groups_for_ = comm_;
  return absl::OkStatus();
}

SlowMo::Plan SlowMo::PlanFor(int64_t update) const {
  Plan plan;
  plan.slow = slowmo_ && (update + 1) % options_.slowmo_frequency() == 0;
  const bool skip = options_.slowmo_memory_efficient() && plan.slow;
  const bool sgp = options_.base_algorithm() == BaseAlgorithm::kSgp;
  const bool localsgd_due =
      options_.base_algorithm() == BaseAlgorithm::kLocalSgd &&
      (update + 1) % options_.localsgd_frequency() == 0;
  plan.allreduce = (sgp && plan.slow && options_.slowmo_sgp_average_params()) ||
                   (localsgd_due && !skip);
  plan.gossip = sgp && !skip && !plan.allreduce;
  return plan;
}

std::string SlowMo::CheckpointDivergence(
    const torch::optim::Optimizer& optimizer) const {
  if (num_nodes_ <= 1) return {};
  if (!optimizer.state().empty() && !rank_state_saved_) {
    return "the optimizer's per-parameter state (momentum, moments) is each "
           "rank's own under SlowMo, which averages parameters, not "
           "gradients";
  }
  if (num_updates_ == 0) return {};
  const Plan plan = PlanFor(num_updates_ - 1);
  const bool localsgd = options_.base_algorithm() == BaseAlgorithm::kLocalSgd;
  if (plan.allreduce ||
      (localsgd && plan.slow && options_.slowmo_memory_efficient())) {
    return {};
  }
  if (!localsgd) return "SGP's gossip leaves the ranks' parameters unequal";
  return absl::StrCat("LocalSGD's parameters differ between averages (every ",
                      options_.localsgd_frequency(),
                      " updates; this is update ", num_updates_, ")");
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
  if (internals_.broadcast_buffers && !buffers_.empty()) {
    comm::CollectiveOptions opts;
    opts.timeout = internals_.collective_timeout;
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
  if (options_.base_algorithm() != BaseAlgorithm::kSgp || !is_numerator_)
    return;
  torch::NoGradGuard no_grad;
  for (auto& p : params_) p.div_(ps_weight_);
  is_numerator_ = false;
}

absl::Status SlowMo::AfterBackward() {
  torch::NoGradGuard no_grad;
  CONCORD_RETURN_IF_ERROR(EnsureGroups());
  if (node_) {
    // fairscale's backward hook: the node's average gradient.
    std::vector<torch::Tensor> grads;
    for (const auto& p : params_) {
      if (!p.requires_grad()) continue;
      grads.push_back(p.grad().defined() ? p.grad() : torch::zeros_like(p));
    }
    if (!grads.empty()) {
      torch::Tensor flat = FlattenTensors(grads).div_(node_->size());
      comm::CollectiveOptions opts;
      opts.timeout = internals_.collective_timeout;
      CONCORD_RETURN_IF_ERROR(
          Wait(node_->AllreduceSum(flat, opts), "node gradient average"));
      size_t k = 0;
      for (auto& p : params_) {
        if (!p.requires_grad()) continue;
        if (!p.grad().defined()) p.mutable_grad() = grads[k];
        ++k;
      }
      UnflattenInto(flat, grads);
    }
  }
  ToNumerators();
  return absl::OkStatus();
}

void SlowMo::ToNumerators() {
  if (options_.base_algorithm() != BaseAlgorithm::kSgp || is_numerator_) return;
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
    const std::vector<torch::Tensor>& units = Units();
    for (const auto& p : group.params()) {
      size_t i = 0;
      while (i < units.size() &&
             units[i].unsafeGetTensorImpl() != p.unsafeGetTensorImpl()) {
        ++i;
      }
      if (i == units.size()) {
        return absl::InvalidArgumentError(
            fp32_params_.empty()
                ? "the optimizer has a parameter SlowMo was not given"
                : "the optimizer has a parameter that is not one of the fp32 "
                  "masters SlowMo was given");
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

std::vector<int64_t> SlowMo::UnitOffsets() const {
  const std::vector<torch::Tensor>& units = Units();
  std::vector<int64_t> offset(units.size() + 1, 0);
  for (size_t i = 0; i < units.size(); ++i) {
    offset[i + 1] = offset[i] + units[i].numel();
  }
  return offset;
}

absl::Status SlowMo::SetFp32Params(std::vector<torch::Tensor> fp32_params) {
  int64_t total = 0;
  for (const auto& p : params_) total += p.numel();
  for (const auto& m : fp32_params) {
    if (!m.defined() || m.scalar_type() != torch::kFloat ||
        m.device() != params_[0].device()) {
      return absl::InvalidArgumentError(
          "fp32_params must be float32 tensors on the parameters' device");
    }
  }
  const bool flat = fp32_params.size() == 1 && fp32_params[0].numel() == total;
  bool paired = fp32_params.size() == params_.size();
  for (size_t i = 0; paired && i < params_.size(); ++i) {
    paired = fp32_params[i].numel() == params_[i].numel();
  }
  if (!flat && !paired) {
    int64_t given = 0;
    for (const auto& m : fp32_params) given += m.numel();
    return absl::InvalidArgumentError(absl::StrCat(
        "fp32_params must be one tensor per parameter with the same numel "
        "(",
        params_.size(), " parameters, ", total, " elements) or one tensor of ",
        total, " elements; got ", fp32_params.size(), " tensors of ", given,
        " elements"));
  }
  fp32_params_ = std::move(fp32_params);
  return absl::OkStatus();
}

absl::Status SlowMo::PerformSlowMo(torch::optim::Optimizer& optimizer,
                                   std::vector<torch::Tensor> fp32_params) {
  std::vector<torch::Tensor> previous = fp32_params_;
  CONCORD_RETURN_IF_ERROR(SetFp32Params(std::move(fp32_params)));
  absl::Status s = PerformSlowMo(optimizer);
  // Bad input (e.g. an optimizer that does not step these masters) changes
  // nothing; a failed collective keeps them for the retry and SyncState.
  if (absl::IsInvalidArgument(s)) fp32_params_ = std::move(previous);
  return s;
}

void SlowMo::Layout(int64_t total) {
  total_ = total;
  const int world = num_nodes_;
  const int rank = master_rank_;
  num_shards_ = options_.slowmo_memory_efficient()
                    ? std::min(world, options_.slowmo_num_shards())
                    : 1;
  portion_length_ = (total + num_shards_ - 1) / num_shards_;
  portion_start_ = portion_end_ = 0;
  replica_start_ = replica_end_ = 0;
  if (rank < 0) return;  // not a master: no slow-momentum state
  if (!options_.slowmo_memory_efficient()) {
    portion_end_ = total;
    return;
  }
  auto bound = [&](int64_t s) {
    return std::min<int64_t>(s * portion_length_, total);
  };
  if (rank < num_shards_) {
    portion_start_ = bound(rank);
    portion_end_ = bound(rank + 1);
  }
  // See Note [Shard replicas]: this rank keeps slice rank - 1.
  const int replicated = (rank + world - 1) % world;
  if (world >= 2 && replicated < num_shards_) {
    replica_start_ = bound(replicated);
    replica_end_ = bound(replicated + 1);
  }
}

absl::Status SlowMo::Gossip(torch::Tensor& flat, torch::Tensor& weight) {
  const GossipPeers peers = graph_->PeersAt(master_rank_, gossip_round_);
  const bool push_sum = options_.push_sum();
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
  opts.timeout = internals_.collective_timeout;
  CONCORD_RETURN_IF_ERROR(
      Wait(masters_->Exchange(message, peers.out, received, peers.in, opts),
           "gossip"));
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

// The slow-momentum state an update computes before applying it.
struct SlowMo::SlowState {
  torch::Tensor momentum, old_params;
  torch::Tensor replica_momentum, replica_old_params;
  bool initialized = false;
};

absl::Status SlowMo::PerformSlowMo(torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  if (fp32_params_.empty() && params_[0].scalar_type() == torch::kHalf &&
      !warned_fp16_) {
    // fairscale warns likewise.
    Log()->warn(
        "SlowMo: the parameters are fp16 and no fp32 masters were given "
        "(SetFp32Params): averaging them in fp16 loses precision");
    warned_fp16_ = true;
  }
  ToNumerators();
  const Plan plan = PlanFor(num_updates_);
  const bool first_slow = slowmo_ && !initialized_;
  if (!plan.gossip && !plan.allreduce && !plan.slow && !first_slow) {
    // Nothing to exchange this update (LocalSGD between averages): the
    // parameters stay as the optimizer left them.
    ++num_updates_;
    return absl::OkStatus();
  }
  CONCORD_RETURN_IF_ERROR(EnsureGroups());

  // Offsets of the parameters in `flat` (SlowMo's order).
  std::vector<int64_t> offset(params_.size() + 1, 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    offset[i + 1] = offset[i] + params_[i].numel();
  }
  // The tensors the optimizer steps: params_, or the fp32 masters (see Note
  // [fp16 masters]), with their offsets in their flat vector.
  const std::vector<torch::Tensor>& units = Units();
  const std::vector<int64_t> unit_offset = UnitOffsets();
  std::vector<size_t> order;  // optimizer order -> index into units
  std::vector<double> lr;
  if (plan.slow || first_slow) {
    CONCORD_RETURN_IF_ERROR(MapOptimizer(optimizer, &order, &lr));
  }

  torch::Tensor flat = FlattenTensors(params_);
  torch::Tensor master32 =
      fp32_params_.empty() ? torch::Tensor() : FlattenTensors(fp32_params_);
  torch::Tensor weight = ps_weight_.clone();
  SlowState state{momentum_, old_params_, replica_momentum_,
                  replica_old_params_, initialized_};
  // fairscale creates x_old at the first call, before any averaging.
  if (first_slow) {
    const torch::Tensor& source = master32.defined() ? master32 : flat;
    std::vector<torch::Tensor> parts;
    for (size_t i : order) {
      parts.push_back(source.narrow(0, unit_offset[i], units[i].numel()));
    }
    torch::Tensor y = torch::cat(parts);
    Layout(y.numel());
    state.old_params =
        y.narrow(0, portion_start_, portion_end_ - portion_start_).clone();
    state.momentum = torch::zeros_like(state.old_params);
    state.replica_old_params =
        y.narrow(0, replica_start_, replica_end_ - replica_start_).clone();
    state.replica_momentum = torch::zeros_like(state.replica_old_params);
    state.initialized = true;
  }

  // See Note [fp16 masters], 1: the error of the fp16 value communicated.
  const bool averaging = plan.gossip || plan.allreduce;
  if (master32.defined() && averaging) {
    if (plan.allreduce) flat.div_(num_nodes_).mul_(num_nodes_);
    master32.sub_(flat.to(torch::kFloat));
  }
  if (masters_ != nullptr) {
    CONCORD_RETURN_IF_ERROR(MastersStep(plan, flat, master32, weight, order, lr,
                                        unit_offset, state));
  }
  // See Note [Node hierarchy]: the node takes its master's result (with fp32
  // masters, the master's p32).
  const bool sgp = options_.base_algorithm() == BaseAlgorithm::kSgp;
  if (node_ != nullptr && (averaging || plan.slow)) {
    comm::CollectiveOptions opts;
    opts.timeout = internals_.collective_timeout;
    torch::Tensor& values = master32.defined() ? master32 : flat;
    const int64_t n = values.numel();
    torch::Tensor message =
        sgp ? torch::cat({values, weight.to(values.scalar_type())}) : values;
    CONCORD_RETURN_IF_ERROR(Wait(node_->Broadcast(message, 0, opts),
                                 "parameter broadcast in the node"));
    values = message.narrow(0, 0, n);
    if (sgp) {
      weight = message.narrow(0, n, 1).to(ps_weight_.scalar_type()).clone();
    }
  }
  // See Note [fp16 masters], 5.
  if (master32.defined() && (averaging || plan.slow)) flat.copy_(master32);

  // Every collective succeeded: apply.
  UnflattenInto(flat, params_);
  if (!fp32_params_.empty()) UnflattenInto(master32, fp32_params_);
  ps_weight_ = weight;
  momentum_ = state.momentum;
  old_params_ = state.old_params;
  replica_momentum_ = state.replica_momentum;
  replica_old_params_ = state.replica_old_params;
  initialized_ = state.initialized;
  if (plan.gossip) ++gossip_round_;
  ++num_updates_;
  return absl::OkStatus();
}

absl::Status SlowMo::MastersStep(const Plan& plan, torch::Tensor& flat,
                                 torch::Tensor& master32, torch::Tensor& weight,
                                 const std::vector<size_t>& order,
                                 const std::vector<double>& lr,
                                 const std::vector<int64_t>& offset,
                                 SlowState& state) {
  comm::Communicator& masters = *masters_;
  comm::CollectiveOptions opts;
  opts.timeout = internals_.collective_timeout;
  const int world = masters.size();
  if (plan.gossip) CONCORD_RETURN_IF_ERROR(Gossip(flat, weight));
  if (plan.allreduce) {
    flat.div_(world);
    CONCORD_RETURN_IF_ERROR(
        Wait(masters.AllreduceSum(flat, opts), "parameter average"));
  }
  // See Note [fp16 masters], 3: the average plus the error.
  if (master32.defined() && (plan.gossip || plan.allreduce)) {
    master32.add_(flat.to(torch::kFloat));
  }
  if (!plan.slow) return absl::OkStatus();

  // The optimizer's parameters, in its order (the fp32 masters if given).
  const std::vector<torch::Tensor>& units = Units();
  torch::Tensor& source = master32.defined() ? master32 : flat;
  std::vector<torch::Tensor> parts;
  for (size_t i : order) {
    parts.push_back(source.narrow(0, offset[i], units[i].numel()));
  }
  torch::Tensor y = torch::cat(parts);
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
  const bool sharded = options_.slowmo_memory_efficient();
  if (sharded) {
    // fairscale's "gather": every rank divides, each slice is reduced to
    // its owner.
    y.div_(world);
    std::vector<std::shared_ptr<comm::Work>> works;
    for (int s = 0; s < num_shards_; ++s) {
      works.push_back(masters.ReduceSum(shard(s), s, opts));
    }
    for (auto& w : works) {
      CONCORD_RETURN_IF_ERROR(Wait(w, "slow-momentum reduce"));
    }
  }
  if (portion_end_ > portion_start_) {
    state.momentum = state.momentum.clone();
    state.old_params = state.old_params.clone();
    int64_t at = 0;  // element offset of the parameter in `y`
    for (size_t j = 0; j < order.size(); ++j) {
      const int64_t numel = units[order[j]].numel();
      const int64_t lo = std::max(portion_start_, at);
      const int64_t hi = std::min(portion_end_, at + numel);
      if (hi > lo) {
        torch::Tensor x = y.narrow(0, lo, hi - lo);
        torch::Tensor u =
            state.momentum.narrow(0, lo - portion_start_, hi - lo);
        torch::Tensor x_old =
            state.old_params.narrow(0, lo - portion_start_, hi - lo);
        // fairscale's _perform_local_optimization, op for op.
        u.mul_(slowmo_momentum_).sub_(x, 1.0 / lr[j]).add_(x_old, 1.0 / lr[j]);
        x_old.add_(u, -lr[j] * slowmo_lr_);
        x.copy_(x_old);
      }
      at += numel;
    }
  }
  if (sharded) {
    std::vector<std::shared_ptr<comm::Work>> works;
    for (int s = 0; s < num_shards_; ++s) {
      works.push_back(masters.Broadcast(shard(s), s, opts));
    }
    for (auto& w : works) {
      CONCORD_RETURN_IF_ERROR(Wait(w, "slow-momentum broadcast"));
    }
    if (world >= 2) {
      // See Note [Shard replicas]: the new x of a slice is its new x_old; its
      // new u goes from the owner to the next rank.
      const int r = master_rank_;
      const auto f32 = StateOptions(torch::kFloat);
      torch::Tensor send = torch::zeros({portion_length_}, f32);
      std::vector<int> to, from;
      std::vector<torch::Tensor> recv;
      if (r < num_shards_) {
        to.push_back((r + 1) % world);
        send.narrow(0, 0, state.momentum.numel()).copy_(state.momentum);
      }
      const int replicated = (r + world - 1) % world;
      if (replicated < num_shards_) {
        from.push_back(replicated);
        recv.push_back(torch::empty({portion_length_}, f32));
      }
      // The peer lists are moved in (copying a one-element vector trips
      // GCC 14's -Warray-bounds, a false positive).
      const bool receives = !from.empty();
      CONCORD_RETURN_IF_ERROR(Wait(
          masters.Exchange(send, std::move(to), recv, std::move(from), opts),
          "slow-momentum replica"));
      if (receives) {
        const int64_t len = replica_end_ - replica_start_;
        state.replica_momentum = recv[0].narrow(0, 0, len).clone();
        state.replica_old_params = y.narrow(0, replica_start_, len).clone();
      }
    }
  }
  // Back into `source`.
  int64_t at = 0;
  for (size_t i : order) {
    const int64_t numel = units[i].numel();
    source.narrow(0, offset[i], numel).copy_(y.narrow(0, at, numel));
    at += numel;
  }
  return absl::OkStatus();
}

}  // namespace concord::slowmo
