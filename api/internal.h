#pragma once
// What the public API's handles hold (include/concord/*.h declare them
// opaque): libconcord's own, never installed.

#include <functional>
#include <memory>
#include <mutex>

#include "concord/ddp.h"
#include "concord/elastic.h"
#include "concord/job.h"
#include "worker/ddp/engine.h"
#include "worker/session.h"
#include "worker/slowmo/slowmo.h"
#include "worker/syncbn/sync_batch_norm.h"
#include "worker/trace/recorder.h"

namespace concord::detail {

class JobState {
 public:
  JobState(std::unique_ptr<worker::Session> session, Timeouts timeouts,
           std::shared_ptr<trace::Recorder> trace)
      : session_(std::move(session)),
        timeouts_(std::move(timeouts)),
        trace_(std::move(trace)) {}
  // Finishes the membership when nobody did (Job::finish).
  ~JobState();
  JobState(const JobState&) = delete;
  JobState& operator=(const JobState&) = delete;

  worker::Session& session() const { return *session_; }
  const Timeouts& timeouts() const { return timeouts_; }
  // JobOptions::trace_file's timeline; null without one.
  const std::shared_ptr<trace::Recorder>& trace() const { return trace_; }
  void Finish(bool ok, const std::string& message);

 private:
  std::unique_ptr<worker::Session> session_;
  Timeouts timeouts_;
  std::shared_ptr<trace::Recorder> trace_;
  std::mutex mu_;
  bool finished_ = false;  // guarded by mu_
};

struct DdpCore::Impl {
  Job job;
  DdpOptions options;
  std::unique_ptr<ddp::Engine> engine;
  // The wrapped C++-frontend module (null for TorchScript), and the group
  // of its SyncBatchNorm layers (null: it has none).
  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<SyncBnGroup> sync_bn;
  // DdpOptions::slowmo: SlowMo over the engine's parameters (the engine
  // then never reduces gradients), its AfterBackward queued by gradient
  // hooks at the end of every backward.
  std::unique_ptr<slowmo::SlowMo> slowmo;
  std::vector<std::pair<torch::Tensor, unsigned>> slowmo_hooks;
  bool after_backward_queued = false;
  // Set by an ElasticState: the step agreement, run before the first
  // forward of a step (step_open false: the last step was committed), and
  // DistributedDataParallelImpl::join's.
  std::function<void()> begin_step;
  std::function<bool()> join;  // true: this rank left, others go on
  bool step_open = false;
  int64_t forward_start_us = 0;  // the timeline's "forward" span
  bool joined = false;           // join() returned: no more steps

  Impl(const Job& j, const DdpOptions& o);
  // Checks the options, then `create(communicator, authoritative rank,
  // engine options)` makes the engine; the hook follows (api/ddp.cc).
  template <typename Create>
  void Init(Create create);
  // DdpOptions::comm_hook on the current generation's communicator.
  void RegisterHook();
  // Every SyncBatchNorm in `module` reduces over the job's ranks.
  void BindSyncBatchNorm();
  // DdpOptions::slowmo (checked and converted by Init): makes `slowmo` and
  // its hooks.
  void StartSlowMo(const slowmo::SlowMoOptions& slowmo_options);
  void RemoveSlowMoHooks();
  // After a re-form rebound the engine: the comm hook and the SyncBatchNorm
  // layers on the new generation's communicator.
  void Rebound();
  // The job's collective timeout.
  comm::CollectiveOptions CollectiveOptions() const;
  // The current generation's; kFailedPrecondition between generations.
  std::shared_ptr<comm::Communicator> Communicator() const;
};

// ElasticSampler's shared state.
struct SamplerState {
  size_t size = 0;
  ElasticSamplerOptions options;
  Job job;
  int64_t epoch = 0;
  size_t committed = 0;  // the position the last commit holds
  size_t cursor = 0;     // the end of the last window handed out
  // The epoch's order (identity without shuffle), made when first needed.
  std::vector<int64_t> order;
  int64_t order_epoch = -1;

  SamplerState(size_t n, ElasticSamplerOptions o, Job j)
      : size(n), options(o), job(std::move(j)) {}
};

}  // namespace concord::detail
