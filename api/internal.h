#pragma once
// What the public API's handles hold (include/concord/*.h declare them
// opaque): libconcord's own, never installed.

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "concord/comm_hook.h"
#include "concord/ddp.h"
#include "concord/elastic.h"
#include "concord/job.h"
#include "concord/zero.h"
#include "worker/checkpoint/content.h"
#include "worker/ddp/engine.h"
#include "worker/ddp/powersgd.h"
#include "worker/elastic/powersgd_participant.h"
#include "worker/session.h"
#include "worker/slowmo/slowmo.h"
#include "worker/syncbn/sync_batch_norm.h"
#include "worker/trace/recorder.h"

namespace concord::detail {

class ElasticCore;

class JobState {
 public:
  JobState(std::unique_ptr<worker::Session> session, Timeouts timeouts,
           std::shared_ptr<trace::Recorder> trace)
      : session_(std::move(session)),
        timeouts_(std::move(timeouts)),
        trace_(std::move(trace)),
        faults_(session_->options().test_faults) {}
  // Finishes the membership when nobody did (Job::finish).
  ~JobState();
  JobState(const JobState&) = delete;
  JobState& operator=(const JobState&) = delete;

  worker::Session& session() const { return *session_; }
  const Timeouts& timeouts() const { return timeouts_; }
  // JobOptions::trace_file's timeline; null without one.
  const std::shared_ptr<trace::Recorder>& trace() const { return trace_; }
  void Finish(bool ok, const std::string& message);

  // See Note [Several models]: the job's DistributedDataParallel modules, in
  // the order they were made (each adds itself when made, removes itself
  // when destroyed). Training thread.
  std::vector<DdpCore::Impl*> ddps;
  int ddps_made = 0;
  // The ElasticState over the job (at most one), while it lives: its step
  // agreement runs before the first forward of a step of any module
  // (step_open false: the last step was committed), its join() is every
  // module's, and it watches their collectives (see Note [Early optimizer
  // steps] in worker/elastic/state.h).
  ElasticCore* elastic = nullptr;
  bool step_open = false;
  bool joined = false;  // join() returned: no more steps
  // CONCORD_TEST_FAULT (worker/test_fault.h).
  worker::TestFaults& faults() { return faults_; }

 private:
  std::unique_ptr<worker::Session> session_;
  Timeouts timeouts_;
  std::shared_ptr<trace::Recorder> trace_;
  worker::TestFaults faults_;
  std::mutex mu_;
  bool finished_ = false;  // guarded by mu_
};

struct DdpCore::Impl {
  Job job;
  DdpOptions options;
  // See Note [Several models]: the name messages, the history and the
  // elastic state use (ElasticState::add's, else "ddp<N>" for the N-th
  // made), and the wrapped module's type, for messages.
  std::string name;
  std::string type;
  std::unique_ptr<ddp::Engine> engine;
  // The wrapped C++-frontend module (null for TorchScript), and the group
  // of its SyncBatchNorm layers (null: it has none).
  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<SyncBnGroup> sync_bn;
  // A user's communication hook (register_comm_hook), kept across
  // re-forms; null: none, or DdpOptions::comm_hook's.
  std::function<ddp::CommHook(std::shared_ptr<comm::Communicator>)> user_hook;
  // DdpOptions::comm_hook "powersgd...": its state and its part of the
  // elastic state (see Note [PowerSGD across re-forms]). Kept across re-forms
  // once run_elastic attached it (`powersgd_attached`); made again with
  // each hook otherwise (every rank alike).
  std::shared_ptr<ddp::PowerSgdState> powersgd;
  std::unique_ptr<elastic::PowerSgdParticipant> powersgd_participant;
  bool powersgd_attached = false;
  // DdpOptions::slowmo: SlowMo over the engine's parameters (the engine
  // then never reduces gradients), its AfterBackward queued by gradient
  // hooks at the end of every backward.
  std::unique_ptr<slowmo::SlowMo> slowmo;
  std::vector<std::pair<torch::Tensor, unsigned>> slowmo_hooks;
  bool after_backward_queued = false;
  int64_t forward_start_us = 0;  // the timeline's "forward" span

  Impl(const Job& j, const DdpOptions& o);
  // Adds itself to the job's modules.
  void Register(std::string module_type);
  ~Impl();
  // Checks the options, then `create(communicator, authoritative rank,
  // engine options)` makes the engine; the hook follows (api/ddp.cc).
  template <typename Create>
  void Init(Create create);
  // DdpOptions::comm_hook, or the user's, on the current generation's
  // communicator.
  void RegisterHook();
  // Every SyncBatchNorm in `module` reduces over the job's ranks.
  void BindSyncBatchNorm();
  // DdpOptions::slowmo (checked by Init, with what the job adds): makes
  // `slowmo` and its hooks.
  void StartSlowMo(const slowmo::SlowMoInternals& internals);
  void RemoveSlowMoHooks();
  // After a re-form rebound the engine: the comm hook and the SyncBatchNorm
  // layers on the new generation's communicator.
  void Rebound();
  // A collective of this module is about to start (CONCORD_TEST_FAULT, the
  // elastic state's watch).
  void OnCollective(worker::TestFault::Point point);
  // kFailedPrecondition naming the module when its engine is bound to a
  // generation that ended (it was made while run_elastic ran: nothing
  // rebinds it).
  void CheckBound() const;
  // "'name' (Type)", for messages.
  std::string Describe() const;
  // The job's collective timeout.
  comm::CollectiveOptions CollectiveOptions() const;
  // The current generation's; kFailedPrecondition between generations.
  std::shared_ptr<comm::Communicator> Communicator() const;
};

// A Future's insides: the collective it waits for (null: done) and how its
// value follows once that is done.
struct FutureState {
  FutureState(std::shared_ptr<comm::Work> w, std::function<at::Tensor()> c)
      : work(std::move(w)), compute(std::move(c)) {}
  // The value, computed once (a `then` callback runs once however often
  // the value is asked for, as in PyTorch), after `work` is done.
  at::Tensor Value() {
    std::lock_guard<std::mutex> lock(mu);
    if (!computed) {
      value = compute();
      computed = true;
    }
    return value;
  }
  std::shared_ptr<comm::Work> work;
  std::function<at::Tensor()> compute;
  std::mutex mu;
  bool computed = false;  // guarded by mu
  at::Tensor value;       // guarded by mu
};
// A ProcessGroup's: one generation's communicator.
struct ProcessGroupState {
  std::shared_ptr<comm::Communicator> comm;
  comm::CollectiveOptions options;
};
// A program's hook as the reducer takes it, over `comm` (api/comm_hook.cc).
ddp::CommHook ToEngineHook(const CommHook& hook,
                           std::shared_ptr<comm::Communicator> comm,
                           comm::CollectiveOptions options);

// See common/job_ended.h: when `status` says the job has already succeeded,
// the worker `worker_id` (which was out: never admitted, or taken out as hung
// or stopped) says so in one line and the process exits 0; else nothing.
void ExitIfJobSucceeded(const absl::Status& status,
                        const std::string& worker_id);

// The ElasticState's side of a module's calls (api/elastic.cc): the step
// being taken (the committed one plus one), a collective about to start,
// the step agreement before a step's first forward, join().
int64_t ElasticStep(const ElasticCore& elastic);
// See Note [Elastic ZeRO] in api/zero.cc: the optimizer as a participant of
// the elastic state. Throws Error kFailedPrecondition for an optimizer with
// no PyTorch state_dict form.
elastic::Participant* ZeroParticipant(ZeroRedundancyOptimizer& zero,
                                      const std::string& name);
// concord::save_checkpoint's side of it (a loop without run_elastic):
// every rank's shard gathered on `root` alone, the whole state as an
// unsharded optimizer's named `name` there (PyTorch's state_dict; the state
// left empty elsewhere). Every rank calls it. Throws Error: those of the
// gather; kFailedPrecondition before an overlapped optimizer has its shards
// or for one with no PyTorch state_dict form.
// `in_file`: `root` gets the other ranks' shards as holes (their shapes and
// CRC-32s), which each rank then writes into the file itself (see Note
// [Shards written where they are] in worker/checkpoint/disk.h and
// ZeroShard).
checkpoint::OptimizerContent ZeroCheckpoint(ZeroRedundancyOptimizer& zero,
                                            const std::string& name, int root,
                                            bool in_file = false);
// What this rank holds of the last in_file ZeroCheckpoint's holes (CPU,
// contiguous, by parameter index and key), handed over once.
std::map<std::pair<int64_t, std::string>, at::Tensor> ZeroShard(
    ZeroRedundancyOptimizer& zero);
// The communicator a ZeroRedundancyOptimizer's collectives go over, and
// their options.
std::pair<comm::Communicator*, comm::CollectiveOptions> ZeroComm(
    ZeroRedundancyOptimizer& zero);
// concord::load_checkpoint's: `saved` (a whole optimizer's, sharded or
// not, in either format) checked against `zero`'s parameters and options
// without changing anything (FAILED_PRECONDITION naming what does not
// fit), then ZeroApply takes this rank's shards from it (cannot fail).
absl::StatusOr<std::shared_ptr<torch::optim::Optimizer>> ZeroCheck(
    ZeroRedundancyOptimizer& zero, const checkpoint::OptimizerContent& saved);
void ZeroApply(ZeroRedundancyOptimizer& zero,
               const torch::optim::Optimizer& whole);
void ObserveCollective(ElasticCore& elastic);
void BeginElasticStep(ElasticCore& elastic);
bool JoinElastic(ElasticCore& elastic);

// ElasticSampler's shared state.
struct SamplerState {
  size_t size = 0;
  ElasticSamplerOptions options;
  Job job;
  int64_t epoch = 0;
  size_t committed = 0;  // the position the last commit holds
  size_t cursor = 0;     // the end of the last window handed out
  // See Note [Prefetching loaders] in include/concord/data.h: a DataLoader with
  // workers asks for windows ahead of the loop. While one tracks this
  // sampler, `ahead` holds the ends of the windows handed out that the loop
  // has not taken yet and `taken` the end of the last one it took; without
  // one, a window is taken as it is handed out.
  bool tracked = false;
  std::deque<size_t> ahead;
  size_t taken = 0;
  // Where the loop is: what a commit holds.
  size_t Consumed() const { return tracked ? taken : cursor; }
  // Back to `position`: nothing handed out beyond it.
  void Rewind(size_t position) {
    committed = cursor = taken = position;
    ahead.clear();
  }
  // The epoch's order (identity without shuffle), made when first needed.
  std::vector<int64_t> order;
  int64_t order_epoch = -1;

  SamplerState(size_t n, ElasticSamplerOptions o, Job j)
      : size(n), options(o), job(std::move(j)) {}
};

}  // namespace concord::detail
