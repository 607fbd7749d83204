#pragma once
// concord::slowmo::SlowMo: fairscale's SlowMoDistributedDataParallel
// (experimental/nn/data_parallel/gossip) for LibTorch, with its arithmetic,
// and elastic: its state follows the authoritative rank and is re-sharded
// when the membership changes.
//
// Usage (with DDP for the initial broadcast and re-forming, gradients left
// local as fairscale leaves them with one process per node):
//   auto ddp = *ddp::Engine::Create(net, comm, auth_rank);
//   torch::optim::SGD opt(ddp->parameters(), lr);
//   auto slowmo = *slowmo::SlowMo::Create(ddp->parameters(), ddp->AllBuffers(),
//                                         comm, auth_rank, options,
//                                         session.get());  // node groups
//   state.Attach(slowmo.get(), &opt, "slowmo/net");  // elastic::State
//   per step:
//     auto no_sync = ddp->NoSync();
//     CONCORD_RETURN_IF_ERROR(slowmo->PrepareForward());  // buffers; de-bias
//     loss = forward; loss.backward();
//     CONCORD_RETURN_IF_ERROR(slowmo->AfterBackward());  // node; numerators
//     opt.step(); ++state.step; state.Commit();
//     CONCORD_RETURN_IF_ERROR(slowmo->PerformSlowMo(opt));

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"
#include "worker/comm/group.h"
#include "worker/elastic/state.h"
#include "worker/slowmo/gossip_graph.h"
#include "worker/slowmo/options.h"

namespace concord::slowmo {

class SlowMo final : public elastic::Participant {
 public:
  // `params`: the module's parameters (what is averaged or gossiped), all of
  // one floating dtype and device; `buffers`: the module's buffers
  // (broadcast before every forward when internals.broadcast_buffers).
  // `groups` (needed with options.nprocs_per_node() > 1, must outlive this)
  // makes the node groups of each generation (see Note [Node hierarchy]); they
  // are connected at the first call that needs them in a generation (no
  // collective here). Errors: those of ValidateOptions, INVALID_ARGUMENT (no
  // parameters, mixed dtypes or devices, a bad authoritative rank, no
  // `groups` for a hierarchy), FAILED_PRECONDITION (a gossip graph that does
  // not exist for this world size).
  static absl::StatusOr<std::unique_ptr<SlowMo>> Create(
      std::vector<torch::Tensor> params, std::vector<torch::Tensor> buffers,
      std::shared_ptr<comm::Communicator> comm, int authoritative_rank,
      concord::SlowMoOptions options, SlowMoInternals internals = {},
      comm::GroupFactory* groups = nullptr);

  // Note [Push-sum]
  // ~~~~~~~~~~~~~~~
  // Between steps the parameters hold push-sum numerators x and the rank a
  // weight w (1 at the start). PrepareForward divides the parameters by w (the
  // de-biased estimate z = x/w the model computes with); AfterBackward
  // multiplies them back, so the optimizer applies the gradient at z to x. A
  // gossip round with k = peers_per_itr out-peers and uniform mixing
  // (fairscale's UniformMixing, lo = 1/(k+1)) sends [x, w] to each out-peer and
  // sets x ← (x + Σ_in x_j)·lo, w ← (w + Σ_in w_j)·lo, which is fairscale's
  // arithmetic (its lazy mixing) and keeps Σx and Σw over the ranks (every rank
  // keeps lo and sends lo to each of its k out-peers). fairscale does not send
  // w on regular graphs, assuming every in-peer's weight equals its own;
  // Concord sends it (one element), so the sums stay exact for any weights.
  // push_sum=false is fairscale's PushPull: no weight (in-degree must equal
  // out-degree, the mixing being doubly stochastic).

  // Before a forward (fairscale's forward pre-hook): broadcasts the
  // buffers from the authoritative rank, then (SGP) de-biases the
  // parameters (see Note [Push-sum]). Errors: those of the broadcast
  // (retryable; the parameters are untouched then).
  absl::Status PrepareForward();
  // After backward: with a node hierarchy, the gradients are averaged over
  // the node (one allreduce; an undefined gradient counts as zeros and
  // becomes them); SGP: back to numerators. Errors: those of the node's
  // allreduce and of connecting the generation's groups (retryable; the
  // gradients are untouched then).
  absl::Status AfterBackward();
  // SGP: the de-biased parameters without a buffer broadcast (before
  // saving the model). No-op for LocalSGD.
  void Debias();

  // Note [SlowMo step]
  // ~~~~~~~~~~~~~~~~~~
  // PerformSlowMo is fairscale's perform_slowmo, called once after every
  // optimizer step (update n = 0, 1, ...):
  //   - LocalSGD: when (n+1) % localsgd_frequency == 0, parameters are
  //     divided by the world size and allreduced (skipped when a
  //     memory-efficient slow step follows: its reduce averages already).
  //   - SGP: every update (but not on memory-efficient slow steps, and
  //     replaced by the LocalSGD average when slowmo_sgp_average_params and a
  //     slow step is due), one push-sum gossip round (see Note [Push-sum]).
  //   - Slow momentum, when enabled (slowmo_lr != 1 or slowmo_momentum != 0)
  //     and (n+1) % slowmo_frequency == 0, per element with the inner
  //     optimizer's current learning rate γ of the element's group:
  //       u ← β·u − x/γ + x_old/γ;  x_old ← x_old − α·γ·u;  x ← x_old
  //     Memory-efficient: the flat parameter vector (optimizer order) is cut
  //     into min(world, slowmo_num_shards) slices of ceil(total/shards)
  //     elements; rank s owns slice s: every rank divides by the world size,
  //     each slice is reduced to its owner, the owner updates u and x_old for
  //     its slice and broadcasts the new x back. Otherwise every rank updates
  //     its whole vector locally.
  //     Each slice has a replica (see Note [Shard replicas]).
  //   With a node hierarchy (see Note [Node hierarchy] in hierarchy.h), "world"
  //   above is the node masters' group: the others average their gradients
  //   with their node in AfterBackward and take their master's parameters
  //   (and push-sum weight) at the end of every update that changed them.
  //   x_old and u are created at the first call, from the parameters after the
  //   first optimizer step (as fairscale does).
  // A step is transactional (see Note [Elastic step]): everything is computed
  // into temporaries and written into the parameters, u, x_old and the push-sum
  // weight only after every collective succeeded; a failure leaves the
  // update pending. Since the optimizer step itself cannot be undone, the
  // caller commits the elastic state after optimizer.step() and before
  // PerformSlowMo: the committed step then owes its averaging, and SyncState
  // (run by elastic::State::Sync after the re-form) performs it in the new
  // generation.

  // See Note [SlowMo step]. The optimizer's parameters must be among `params`
  // (or the fp32 masters, see Note [fp16 masters])
  // and fp32 when slow momentum is on. Blocks on the step's collectives.
  // Errors: INVALID_ARGUMENT (optimizer parameters), those of Work::Wait
  // (retryable: the update stays pending, nothing changed).
  absl::Status PerformSlowMo(torch::optim::Optimizer& optimizer);

  // Note [fp16 masters]
  // ~~~~~~~~~~~~~~~~~~~
  // fairscale's perform_slowmo(optimizer, fp32_params). With fp16 module
  // parameters the optimizer (fairseq's FP16Optimizer, apex amp) steps fp32
  // master copies and copies them into the fp16 parameters; SetFp32Params gives
  // SlowMo those masters (one per parameter, in `params` order, or one flat
  // tensor of every element in that order). Then, per update, element-wise,
  // with W the number of participants (nodes):
  //   averaging = a gossip round or an exact average this update;
  //   1. if averaging: (exact average only) p16 ← (p16 / W) · W in fp16 (the
  //      rounding loss now, not in the allreduce); p32 ← p32 − float(p16):
  //      p32 holds the error of the communicated fp16 value;
  //   2. the gossip round / average on the fp16 parameters (as without
  //      masters);
  //   3. if averaging: p32 ← p32 + float(p16) (error feedback);
  //   4. slow momentum on the optimizer's parameters, i.e. the fp32 masters
  //      (u and x_old are fp32, sharded or not, as above);
  //   5. if averaging or a slow step: p16 ← half(p32).
  // SGP: the masters hold push-sum numerators throughout (de-biasing divides
  // the fp16 parameters only). With a node hierarchy the master's p32 is
  // broadcast to its node and every rank sets p16 ← half(p32). The masters are
  // the user's optimizer state but not in the model: SyncState broadcasts them
  // from the authoritative rank (every rank must call SetFp32Params before
  // elastic::State::Sync), and a restarted slow-momentum slice takes x_old
  // from them.

  // See Note [fp16 masters]: SetFp32Params(fp32_params), then the above
  // (fairscale's perform_slowmo(optimizer, fp32_params)); on
  // INVALID_ARGUMENT the previous masters are kept and nothing changed.
  absl::Status PerformSlowMo(torch::optim::Optimizer& optimizer,
                             std::vector<torch::Tensor> fp32_params);
  // See Note [fp16 masters]: the fp32 master copies the optimizer steps, kept
  // (by reference) for every later update and re-form. Errors:
  // INVALID_ARGUMENT when they are not float32 on the parameters' device,
  // or neither one per parameter with the same numel nor one tensor of
  // every element (nothing changed then).
  absl::Status SetFp32Params(std::vector<torch::Tensor> fp32_params);
  const std::vector<torch::Tensor>& fp32_params() const { return fp32_params_; }

  // elastic::Participant: moves to `comm`, takes the authoritative rank's
  // update count, push-sum weight and (non-sharded) u and x_old, connects
  // the node groups of the new generation, re-shards u and x_old over the
  // new world (or masters) from the shards and replicas the survivors hold
  // (see Note [Shard replicas]; a slice whose owner and replica are both gone
  // restarts: u = 0, x_old = x), rebuilds the gossip graph for the new
  // world size, and performs the update `step` still owes (see Note [SlowMo
  // step]). With fp32 masters (see Note [fp16 masters]) it first broadcasts
  // them from the authoritative rank. Every rank of the generation calls it
  // after the model was broadcast. Errors: those of the collectives,
  // FAILED_PRECONDITION when the update count and `step` disagree, or (on
  // every rank) when the ranks' fp32 masters differ in size or presence.
  absl::Status SyncState(std::shared_ptr<comm::Communicator> comm,
                         int authoritative_rank, int64_t step,
                         torch::optim::Optimizer& optimizer) override;

  // elastic::Participant, see Note [Participants in checkpoints]: "updates",
  // "push_sum_weight", "push_sum_numerator", "fp32_masters" (with masters)
  // and, once slow momentum started, the whole "slow_momentum" and
  // "old_params" (optimizer order, fp32) gathered from their owners (one
  // allreduce of both over the generation, on every rank). See Note [Each
  // rank's optimizer state]: with more than one node and an optimizer with
  // per-parameter state, "rank_optimizer/<index>/<key>" too.
  absl::StatusOr<NamedTensors> CheckpointState(
      const torch::optim::Optimizer& optimizer) override;
  // The rank that loaded a checkpoint holds the whole slow momentum as if it
  // owned every slice (SyncState re-shards it), and each rank's optimizer
  // state for SyncState to hand out; the others drop theirs.
  absl::Status ResumeState(const NamedTensors* saved,
                           torch::optim::Optimizer& optimizer) override;
  // Between the nodes (or ranks), after the last update: an optimizer's
  // per-parameter state always differs (gradients are not averaged), said
  // unless the last CheckpointState kept each rank's; the parameters unless
  // that update averaged them (LocalSGD's allreduce or a memory-efficient
  // slow step; SGP's gossip never does).
  std::string CheckpointDivergence(
      const torch::optim::Optimizer& optimizer) const override;

  // Note [Each rank's optimizer state]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // SlowMo averages parameters, not gradients, so an optimizer's
  // per-parameter state (SGD's momentum, Adam's moments) is each rank's own
  // (each node's, with a hierarchy), and the checkpoint's optimizer file
  // holds its writer's. So that a resume goes on as the uninterrupted run
  // does, CheckpointState also gathers every rank's (one Allgather per dtype
  // and device, after one that checks that every rank's state has the same
  // entries and sizes; it keeps none when they differ, and
  // CheckpointDivergence says so): "rank_optimizer/<index>/<key>", of shape
  // [world, *shape], row r rank r's, in PyTorch's numbering (see Note
  // [Checkpoint format]). At a resume the loading rank checks them against
  // the optimizer state it loaded (ResumeState), and SyncState broadcasts
  // them: rank r below the saved world size takes row r, every other rank
  // keeps the loaded state, as a joiner takes the authoritative rank's. The
  // cost: the world size times the optimizer state in each checkpoint, and
  // its gather in the step's stall.

  // Inspection (tests, logs).
  bool slowmo_enabled() const { return slowmo_; }
  int64_t num_updates() const { return num_updates_; }
  bool initialized() const { return initialized_; }
  int num_shards() const { return num_shards_; }
  int64_t portion_start() const { return portion_start_; }
  int64_t portion_end() const { return portion_end_; }
  // This rank's slice of u and x_old ([portion_start, portion_end) of the
  // flat optimizer-order vector; undefined before the first update and on
  // ranks that own no shard).
  const torch::Tensor& momentum_buffer() const { return momentum_; }
  const torch::Tensor& old_params() const { return old_params_; }
  // The slice this rank keeps a replica of (see Note [Shard replicas]):
  // [replica_start, replica_end), empty when none.
  int64_t replica_start() const { return replica_start_; }
  int64_t replica_end() const { return replica_end_; }
  const torch::Tensor& replica_momentum() const { return replica_momentum_; }
  const torch::Tensor& replica_old_params() const {
    return replica_old_params_;
  }
  // See Note [Node hierarchy], as of the last connected generation: nodes
  // (= world size without a hierarchy), whether this rank is its node's
  // master, its node's size.
  int num_nodes() const { return num_nodes_; }
  bool is_master() const { return master_rank_ >= 0; }
  int node_size() const { return node_ ? node_->size() : 1; }
  double ps_weight() const { return ps_weight_.item<double>(); }
  bool is_ps_numerator() const { return is_numerator_; }
  int64_t gossip_round() const { return gossip_round_; }
  const std::optional<GossipGraph>& graph() const { return graph_; }
  const concord::SlowMoOptions& options() const { return options_; }

 private:
  SlowMo() = default;
  struct Plan;
  Plan PlanFor(int64_t update) const;
  absl::Status Wait(std::shared_ptr<comm::Work> work, const char* what) const;
  // The optimizer's parameters as indices into params_, in group order,
  // with each group's learning rate.
  // With fp32 masters the indices are into fp32_params_ (see Note [fp16
  // masters]).
  absl::Status MapOptimizer(torch::optim::Optimizer& optimizer,
                            std::vector<size_t>* index,
                            std::vector<double>* lr) const;
  // The tensors the optimizer steps (params_ or fp32_params_) and their
  // offsets in their flat vector.
  const std::vector<torch::Tensor>& Units() const {
    return fp32_params_.empty() ? params_ : fp32_params_;
  }
  std::vector<int64_t> UnitOffsets() const;
  // Slow-momentum state, and every tensor that meets it (masks, exchange
  // buffers), lives on the parameters' device, in `dtype`.
  torch::TensorOptions StateOptions(torch::ScalarType dtype) const {
    return Units().front().options().dtype(dtype);
  }
  absl::Status Gossip(torch::Tensor& flat, torch::Tensor& weight);
  // The update's work between masters (see Note [SlowMo step]) on `flat` (in
  // params_ order), `weight`, and the slow-momentum state.
  struct SlowState;
  // `master32`: the flat fp32 masters (undefined without); `offset`: the
  // units' offsets (Units()).
  absl::Status MastersStep(const Plan& plan, torch::Tensor& flat,
                           torch::Tensor& master32, torch::Tensor& weight,
                           const std::vector<size_t>& order,
                           const std::vector<double>& lr,
                           const std::vector<int64_t>& offset,
                           SlowState& state);
  // See Note [Node hierarchy]: connects this generation's groups once.
  absl::Status EnsureGroups();
  void ToNumerators();
  void Layout(int64_t total);
  absl::Status Reshard(int authoritative_rank, int64_t root_updates,
                       bool root_initialized, int64_t my_updates,
                       torch::optim::Optimizer& optimizer);
  absl::Status RebuildGraph();
  // See Note [Each rank's optimizer state].
  absl::StatusOr<NamedTensors> GatherRankState(
      const torch::optim::Optimizer& optimizer);
  absl::Status CheckRankState(const std::map<std::string, torch::Tensor>& saved,
                              const torch::optim::Optimizer& optimizer,
                              std::vector<torch::Tensor>* rows) const;
  absl::Status ScatterRankState(int root, int64_t root_world,
                                int64_t root_numel,
                                torch::optim::Optimizer& optimizer);

  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> buffers_;
  std::vector<torch::Tensor> fp32_params_;  // See Note [fp16 masters]
  bool warned_fp16_ = false;
  std::shared_ptr<comm::Communicator> comm_;  // the generation's
  int authoritative_rank_ = 0;
  // See Note [Node hierarchy]: masters_ is comm_ without a hierarchy, the
  // masters' group on a master, null elsewhere; node_ is the node's group
  // (null for a node of one).
  comm::GroupFactory* groups_ = nullptr;
  std::weak_ptr<comm::Communicator> groups_for_;  // the comm_ they are of
  std::shared_ptr<comm::Communicator> masters_, node_;
  int num_nodes_ = 1;
  int master_rank_ = 0;  // rank in masters_, -1 on a non-master
  concord::SlowMoOptions options_;
  SlowMoInternals internals_;
  GraphType graph_type_ = GraphType::kNPeerDirectedExponential;  // sgp_graph
  bool slowmo_ = false;
  double slowmo_lr_ = 1.0;
  double slowmo_momentum_ = 0.0;
  int64_t num_updates_ = 0;

  // Slow momentum (see Note [SlowMo step]).
  bool initialized_ = false;
  int64_t total_ = 0;  // elements of the optimizer's parameters
  int num_shards_ = 1;
  int64_t portion_length_ = 0;
  int64_t portion_start_ = 0, portion_end_ = 0;
  torch::Tensor momentum_, old_params_;

  // Note [Shard replicas]
  // ~~~~~~~~~~~~~~~~~~~~~
  // With memory-efficient slow momentum the next rank, (s+1) mod world, keeps a
  // replica of slice s: after the broadcast it holds the new x = x_old of the
  // slice already, and the owner sends it its new u (one point-to-point message
  // of a slice: the whole vector once over the network per slow step). After a
  // membership change a slice is taken from its owner, or from its replica when
  // the owner is gone; it restarts (u = 0, x_old = x, logged) only when both
  // are gone.

  // See Note [Shard replicas].
  int64_t replica_start_ = 0, replica_end_ = 0;
  torch::Tensor replica_momentum_, replica_old_params_;

  // SGP (see Note [Push-sum]).
  std::optional<GossipGraph> graph_;
  int64_t gossip_round_ = 0;
  torch::Tensor ps_weight_;  // one element, the parameters' dtype
  bool is_numerator_ = false;

  // See Note [Each rank's optimizer state]: whether the last CheckpointState
  // kept each rank's; on a rank that loaded a checkpoint, until SyncState,
  // its rows (in CaptureOptimizer's order, each [saved world, *shape]).
  bool rank_state_saved_ = false;
  std::vector<torch::Tensor> resume_rows_;
};

}  // namespace concord::slowmo
