#pragma once
// What api/zero.cc and api/zero_overlap.cc share of
// concord::ZeroRedundancyOptimizer (include/concord/zero.h): its Impl.

#include <torch/torch.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "concord/comm_hook.h"
#include "concord/error.h"
#include "concord/zero.h"
#include "worker/checkpoint/content.h"
#include "worker/checkpoint/optimizer_snapshot.h"
#include "worker/comm/communicator.h"
#include "worker/elastic/state.h"
#include "worker/trace/recorder.h"
#include "worker/zero/partition.h"

namespace concord {

namespace optim = torch::optim;

namespace zero_api {
inline constexpr const char* kName = "ZeroRedundancyOptimizer";
// Throws Error with `message` after the class's name.
[[noreturn]] inline void Fail(ErrorCode code, const std::string& message) {
  throw Error(code, absl::StrCat(kName, ": ", message));
}
// The parts of a step on the job's timeline (see Note [ZeRO on the
// timeline] in api/zero.cc).
inline constexpr const char* kCopySpan = "zero copy";
inline constexpr const char* kUpdateSpan = "zero update";
inline constexpr const char* kMirrorSpan = "zero mirror";
inline constexpr const char* kBroadcastSpan = "zero broadcast";
// Every group's options from `from` to `to` (the same number of groups).
inline void CopyOptions(const std::vector<optim::OptimizerParamGroup>& from,
                        std::vector<optim::OptimizerParamGroup>& to) {
  for (size_t g = 0; g < from.size() && g < to.size(); ++g) {
    if (from[g].has_options()) to[g].set_options(from[g].options().clone());
  }
}
}  // namespace zero_api

struct ZeroRedundancyOptimizer::Impl final : elastic::Participant {
  ZeroRedundancyOptimizer* self;
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

  // See Note [Elastic ZeRO]: set while an ElasticState holds it, by that
  // name.
  bool elastic = false;
  std::string name;
  // This generation's mirrors (rank -> its mirror) and the optimizer
  // stepping the shards this rank mirrors (null: none).
  std::vector<int> mirror_of;
  std::unique_ptr<optim::Optimizer> mirror;
  // This generation's members' nodes, by rank.
  std::vector<std::string> nodes;
  // The committed step the step being taken started from, whether the
  // local update ran, and the shards as they were at its start (`copied`:
  // kept by this step's update).
  int64_t base = 0;
  bool stepped = false;
  bool copied = false;
  // Whether this step's update of the mirrored shards moved their state
  // alone, their parameters left to their owners' broadcasts (see Note
  // [ZeRO mirrors] in worker/zero/partition.h).
  bool mirror_deferred = false;
  // Whether this step keeps its start (see Note [Elastic ZeRO]): not when
  // every member steps every shard and the State sees the step's update
  // come after its last collective (BeginStep's `late`).
  bool keep_start = true;
  // Under run_elastic, set by BeginStep: whether every member steps every
  // shard, its own or as a mirror (zero::EveryRankStepsAll); nobody
  // broadcasts then.
  bool steps_all = false;
  checkpoint::OptimizerSnapshot own_copy, mirror_copy;
  // A checkpoint this rank resumed, by parameter index (the others: none),
  // and whether this rank holds nothing the job can use.
  std::optional<std::map<int64_t, NamedTensors>> resumed;
  bool empty = false;
  // What ranks leaving at the end of their data handed to this one (see
  // HandOver), and the committed step it is of.
  std::map<int64_t, NamedTensors> adopted;
  int64_t adopted_step = -1;

  Impl(ZeroRedundancyOptimizer* s, const Job& j, const ZeroOptions& o,
       OptimizerFactory m)
      : self(s), job(j), options(o), make(std::move(m)) {}

  std::vector<optim::OptimizerParamGroup>& groups() {
    return self->param_groups();
  }
  // The local optimizers over the shards of `ranks` under `partition`,
  // with the groups' options.
  std::unique_ptr<optim::Optimizer> MakeOver(const zero::Partition& partition,
                                             const std::vector<int>& ranks);
  // Parameter indices (state_dict's) this rank steps: its own shard, then
  // the ones it mirrors.
  std::vector<int64_t> Held() const;
  // Every held parameter's state, by index (CPU tensors).
  std::map<int64_t, NamedTensors> HeldState() const;
  std::vector<int> Mirrored() const;
  // The mirrors of `partition`'s shards over the members' `nodes` (see
  // Note [ZeRO mirrors]).
  std::vector<int> MirrorsFor(const zero::Partition& partition,
                              const std::vector<std::string>& nodes);
  int64_t Offset(size_t group) const;

  // elastic::Participant (see Note [Elastic ZeRO]).
  absl::Status SyncState(std::shared_ptr<comm::Communicator> comm,
                         int authoritative_rank, int64_t step,
                         torch::optim::Optimizer& optimizer) override;
  absl::StatusOr<NamedTensors> CheckpointState(
      const torch::optim::Optimizer& optimizer) override;
  absl::Status ResumeState(const NamedTensors* saved,
                           torch::optim::Optimizer& optimizer) override;
  std::string OptimizerName() const override { return name; }
  bool HandsOver() const override { return true; }
  absl::Status HandOver(comm::Communicator& comm,
                        const std::vector<bool>& leaving,
                        int64_t step) override;
  absl::StatusOr<checkpoint::OptimizerContent> CheckpointOptimizer(
      const elastic::ShardPlacement& placement) override;
  absl::Status FillShard(const checkpoint::Content& laid) override;
  absl::Status ResumeOptimizer(
      const checkpoint::OptimizerContent& saved) override;
  void BeginStep(int64_t step, bool late) override;
  void RestoreStep() override;
  // A step's update of this rank's shards (see Note [Elastic ZeRO]): under
  // run_elastic TakeParams copies the parameters of the shards it holds,
  // then Update steps `o` (`local` or `mirror`) keeping the state from
  // before (`own_copy`, `mirror_copy`); elsewhere Update is o.step().
  void TakeParams();
  torch::Tensor Update(optim::Optimizer& o,
                       optim::Optimizer::LossClosure closure = nullptr);
  // An unsharded optimizer of the wrapped kind over every parameter, with
  // the groups' options and no state.
  // See Note [Shards copied where they are] in worker/elastic/state.h:
  // this rank's shard of the last CheckpointOptimizer, for FillShard.
  std::map<int64_t, NamedTensors> shard_;
  std::unique_ptr<optim::Optimizer> MakeWhole();

  // Times a part of the step on the job's timeline (see Note [ZeRO on the
  // timeline] in api/zero.cc); nothing without a trace file.
  trace::Recorder::Span Traced(std::string_view part) const {
    return trace::Recorder::Span(job.state()->trace(), part);
  }

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
  // ZeroOptions::overlap_with_ddp (see Note [ZeRO overlapped with DDP] in
  // api/zero_overlap.cc).
  struct Overlap {
    // PyTorch's _OverlapStatus.
    enum class Status { kUninitialized, kCollecting, kInitialized };
    Status status = Status::kUninitialized;
    // The DDP the hook was made for (null: none yet).
    detail::DdpCore* ddp = nullptr;
    bool shard_buckets = false;
    bool warned = false;  // step() said it does nothing
    // Each DDP bucket's parameters, as indices into the group's.
    std::vector<std::vector<int>> buckets;
    zero::BucketAssignment assignment;
    // Each run's parameters, flat (their data are views into it).
    std::vector<torch::Tensor> flats;
    // The backward under way: the futures and gradients of the buckets
    // this rank steps a run of (its own, or one it mirrors), the
    // broadcasts issued, the buckets seen.
    struct Pending {
      Future future;
      torch::Tensor buffer;
      std::vector<torch::Tensor> gradients;
    };
    std::map<size_t, Pending> pending;
    std::vector<std::shared_ptr<comm::Work>> broadcasts;
    size_t seen = 0;
  };
  Overlap overlap;
  bool overlapped() const { return options.overlap_with_ddp(); }
  // kFailedPrecondition naming `what` until the overlap knows its shards.
  void CheckOverlapReady(const char* what) const;
  // PyTorch's _hook_with_zero_step_setup, for each bucket of a backward.
  void OverlapSetup(bool ddp_rebuilt, const GradBucket& bucket);
  // PyTorch's _init_zero_for_overlap: the shards from DDP's buckets, and
  // the optimizers over this rank's.
  void OverlapInit();
  // The shards of `overlap.buckets` over `world` ranks: the assignment and
  // each run's flat tensor; the partition they make. Marks the overlap
  // initialized.
  zero::Partition OverlapLayout(int world);
  // Under run_elastic (see Note [Elastic ZeRO overlapped with DDP] in
  // api/zero_overlap.cc): DDP's buckets from its layout once it has rebuilt
  // them and the job has committed `step` >= 2; false: not yet.
  bool OverlapBucketsFromDdp(int64_t step);
  // Whether this rank steps `run` (its own or a mirrored one), and a run
  // of bucket `b`.
  bool Steps(const zero::BucketRun& run) const;
  bool Holds(size_t b) const;
  // A bucket's index and its reduced gradients.
  using ReducedBucket = std::pair<size_t, const std::vector<torch::Tensor>*>;
  // Steps this rank's runs of the `reduced` buckets, its own and those it
  // mirrors, with their gradients: one step of each wrapped optimizer.
  void OverlapStep(const std::vector<ReducedBucket>& reduced);
  // Sends bucket `b`'s runs from their ranks (asynchronous).
  void OverlapBroadcast(size_t b);
  // Waits for the backward's broadcasts; ends its per-backward state.
  void OverlapFinish();

  // kFailedPrecondition once the job left the generation `comm` is of.
  void CheckWorld() const;
  // CONCORD_TEST_FAULT's "zero" point (worker/test_fault.h), under
  // run_elastic: after the local update, before the broadcasts.
  void ReachedFault();
  // Every rank's parameters from the rank that stepped them.
  void SyncParams(const std::vector<optim::OptimizerParamGroup>& groups);
};

}  // namespace concord
