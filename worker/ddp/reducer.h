#pragma once
// Gradient bucketing and overlapped allreduce (PyTorch's Reducer, with
// apex's options).
//
// Note [Reducer flow]
// ~~~~~~~~~~~~~~~~~~~
// A hook on every trainable parameter fires when backward has computed its
// gradient. The hook writes the gradient — scaled by 1/world_size on PyTorch's
// default path, as PyTorch does while copying — into the parameter's slot of
// its bucket; when a bucket's last gradient arrives, the bucket and every full
// bucket before it are launched (in bucket order, the same on every rank) while
// backward goes on. The first hook of a backward also queues a final callback
// on the autograd engine; it runs when backward is done: it marks unused
// parameters ready (find_unused_parameters), launches what is left, waits for
// every bucket and writes the reduced gradients into `param.grad` (or makes
// `param.grad` a view of the bucket). After the first synchronised iteration
// the buckets are rebuilt once from the order in which gradients became ready,
// in the authoritative rank's order (broadcast), so that every rank agrees on
// the layout.
//
// Threads: hooks and the final callback run on the autograd thread of the
// backward call; collectives run on the communicator's thread. A failed
// collective surfaces as a concord::Error thrown out of `backward()`.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/job_defaults.h"
#include "concord/ddp_options.h"
#include "worker/comm/communicator.h"
#include "worker/ddp/comm_hooks.h"

namespace concord::trace {
class Recorder;
class WorkTracer;
}  // namespace concord::trace

namespace concord::ddp {

// What the reducer runs with besides the user's concord::DdpOptions (the
// one home of DDP's options and their defaults, concord/ddp_options.h): what
// only the inside sets, never a user.
struct ReducerInternals {
  // Source of the rebuilt bucket layout.
  int authoritative_rank = 0;
  absl::Duration collective_timeout = kDefaultCollectiveTimeout;
  // See Note [Stream-ordered waits] in worker/comm/work.h: false (c10d's
  // default), the end of backward makes the current stream wait for the
  // buckets and returns; true (TORCH_NCCL_BLOCKING_WAIT), the host waits
  // for every bucket and a failure throws from backward, before the
  // optimizer can step: what a transactional elastic step needs.
  bool blocking_wait = false;
  // apex's allreduce_trigger_params, resolved to indices into the
  // reducer's parameters (the engine resolves the names).
  std::vector<size_t> trigger_params;
  // The first bucket's byte cap in place of what DdpOptions::bucket_cap_mb
  // means (tests make buckets of one gradient); unset: BucketCapsOf's.
  std::optional<int64_t> first_bucket_bytes;
};

// The byte caps of the first bucket and of the later ones.
struct BucketCaps {
  int64_t first = 0;
  int64_t later = 0;
};

// PyTorch's: dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB) and bucket_cap_mb
// (25 when unset); with LibTorch 2.x the first bucket takes a given cap
// too (see Note [LibTorch versions] in worker/torch_compat.h).
// INVALID_ARGUMENT for a bucket_cap_mb that is not a size in MiB.
absl::StatusOr<BucketCaps> BucketCapsOf(const concord::DdpOptions& options,
                                        const ReducerInternals& internals);

// What a bucket holds, for logging and tests.
struct BucketInfo {
  std::vector<size_t> params;  // indices into the reducer's parameters
  int64_t bytes = 0;
};

// PyTorch's _get_ddp_logging_data, the parts a C++ user needs. Times are of
// the last synchronised iteration, in microseconds.
struct ReducerStats {
  int64_t iterations = 0;  // completed synchronised backward passes
  int64_t rebuilds = 0;
  std::vector<int64_t> bucket_bytes;
  // The buckets' parameters by name, as built first and as now (after the
  // rebuild): what PyTorch's reference run reports as initial_bucket_params
  // and bucket_params.
  std::vector<std::vector<std::string>> initial_bucket_params;
  std::vector<std::vector<std::string>> bucket_params;
  int64_t forward_compute_us = 0;     // armed -> first gradient ready
  int64_t backward_compute_us = 0;    // first -> last gradient ready
  int64_t backward_comm_us = 0;       // first launch -> all reduced
  int64_t overlap_us = 0;             // communication during backward compute
  int64_t backward_done_unix_us = 0;  // the gradients written back
  std::vector<std::string> unused_parameters;  // globally, last iteration
};

class Reducer {
 public:
  // `params` are the trainable parameters in the module's order; `names` are
  // used in error messages. Registers the hooks. INVALID_ARGUMENT through
  // `Validate` for contradictory options.
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
          std::shared_ptr<comm::Communicator> comm, concord::DdpOptions options,
          ReducerInternals internals);
  // Removes the hooks; waits (bounded) for collectives still in flight.
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // INVALID_ARGUMENT for options that contradict each other (with a
  // communication hook: `has_hook`) or a value out of range.
  static absl::Status Validate(const concord::DdpOptions& options,
                               const ReducerInternals& internals,
                               bool has_hook);

  // Replaces the default reduction (see Note [DDP Communication Hook]).
  // FAILED_PRECONDITION once a hook is set or apex scaling options are on.
  absl::Status RegisterCommHook(CommHook hook);

  // Arms the reducer for the next backward; rebuilds the buckets once after
  // the first synchronised iteration (a collective: every rank calls it at
  // the same point). A backward that is not armed accumulates gradients
  // locally (no_sync). Errors: those of the layout broadcast.
  absl::Status PrepareForBackward();
  // For timing: the forward has finished (the loss is being computed).
  void MarkForwardDone();

  // See Note [Re-forming in the worker] in worker/session.h: moves the reducer
  // to the next generation's communicator. Drops what the interrupted iteration
  // left (launched buckets, set-aside gradients; `.grad` of every parameter is
  // undefined afterwards), any communication hook (it belongs to the old
  // communicator: register one again) and the gradient divisor. No
  // collective.
  void Rebind(std::shared_ptr<comm::Communicator> comm, int authoritative_rank);
  // Takes the authoritative rank's bucket layout, rebuild state and
  // static-graph usage: a broadcast that every rank of a new generation
  // calls at the same point (survivors after Rebind, a newcomer after
  // creating its reducer). Errors: those of the broadcast.
  absl::Status SyncLayout();
  // The bucket layout, rebuild state and static-graph usage SyncLayout
  // sends, as a CPU int64 tensor (a checkpoint keeps it: a job resumed
  // from one reduces in the same buckets, so the same sums), and taking
  // one. INVALID_ARGUMENT for one of another number of parameters or not
  // an order of them.
  at::Tensor LayoutState() const;
  absl::Status SetLayoutState(const at::Tensor& state);
  // What the gradient sum is divided by on the default path (and apex's
  // average): the world size unless set (PyTorch's join semantics divide by
  // the initial world size while ranks that ran out of data shadow with
  // zeros). Must be positive.
  void SetGradientDivisor(double divisor);
  // ReducerInternals::blocking_wait, between iterations.
  void SetBlockingWait(bool blocking) { internals_.blocking_wait = blocking; }
  bool blocking_wait() const { return internals_.blocking_wait; }

  // Timeline (see Note [Trace files] in worker/trace/recorder.h): each bucket's
  // allreduce, from its launch to its completion, on the bucket's track,
  // and the final callback's wait for the buckets on the training track.
  // Null: off (the default). Call between iterations.
  void SetTraceRecorder(std::shared_ptr<trace::Recorder> recorder);

  // Called on the autograd thread before each bucket's collective of each
  // synchronised backward, with the bucket's launch index (0: the first);
  // kept across Rebind. Null: none. Call between iterations.
  void SetLaunchObserver(std::function<void(size_t)> observer) {
    launch_observer_ = std::move(observer);
  }
  // Called on the autograd thread at every parameter's gradient of every
  // backward, synchronised or not, before the gradient is used; kept across
  // Rebind. Null: none. Call between iterations.
  void SetGradientObserver(std::function<void()> observer) {
    gradient_observer_ = std::move(observer);
  }

  std::vector<BucketInfo> buckets() const;
  // Whether the buckets have their rebuilt layout (PyTorch's
  // _has_rebuilt_buckets): after the rebuild, or a layout taken from a peer
  // or a checkpoint that had one.
  bool rebuilt() const { return rebuilt_; }
  int64_t iterations() const { return stats_.iterations; }
  const ReducerStats& stats() const { return stats_; }

 private:
  using Clock = std::chrono::steady_clock;
  struct Bucket {
    at::Tensor flat;
    std::vector<size_t> params;
    std::vector<at::Tensor> views;  // per param, shaped like it
    size_t pending = 0;
    std::shared_ptr<comm::Work> work;
  };
  struct Slot {
    size_t bucket = 0;
    size_t index_in_bucket = 0;
    bool ready = false;
    bool used = false;  // got a gradient from backward this iteration
  };

  // Lays the buckets out in `order` (empty: PyTorch's initial layout).
  void Build(const std::vector<size_t>& order);
  // The pre/post scales for `divisor_`, for the path in use.
  void SetScales();
  absl::Status Rebuild();
  void OnGradReady(size_t param, const at::Tensor& grad);
  void MarkReady(size_t param);
  void LaunchReadyBuckets();
  std::shared_ptr<comm::Work> Launch(size_t index);
  void FinalizeBackward();
  absl::Status WaitAndWriteBack(const std::vector<bool>& globally_used);

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::shared_ptr<comm::Communicator> comm_;
  concord::DdpOptions options_;
  ReducerInternals internals_;
  BucketCaps caps_;
  CommHook hook_;
  std::function<void(size_t)> launch_observer_;
  std::function<void()> gradient_observer_;
  double divisor_ = 1.0;     // SetGradientDivisor
  double pre_scale_ = 1.0;   // applied while copying into the bucket
  double post_scale_ = 1.0;  // applied after the allreduce
  bool scale_in_fp32_ = false;
  bool pytorch_scaling_ = false;  // default path: no hook, no apex scaling

  std::vector<Bucket> buckets_;
  std::vector<Slot> slots_;
  std::vector<unsigned> hook_handles_;
  // Each parameter's `.grad` from before this backward, set aside by its
  // hook and written back (reduced) by the final callback.
  std::vector<at::Tensor> saved_grads_;

  bool armed_ = false;
  bool callback_queued_ = false;
  size_t next_bucket_ = 0;           // first bucket not yet launched
  std::vector<size_t> ready_order_;  // first iteration, for the rebuild
  bool rebuilt_ = false;
  std::vector<size_t> rebuilt_order_;  // the agreed order of the rebuild
  // static_graph: which parameters were globally used in iteration 1.
  std::vector<bool> static_used_;

  Clock::time_point t_armed_, t_first_ready_, t_last_ready_, t_first_launch_;
  ReducerStats stats_;

  // Tracing (null: off). A hook's work is timed until the final callback's
  // wait ends (its continuation may issue collectives, which only the
  // autograd thread may do); the communicator's own works by `work_tracer_`.
  std::shared_ptr<trace::Recorder> trace_;
  std::unique_ptr<trace::WorkTracer> work_tracer_;
  std::vector<int64_t> hook_launch_us_;  // per bucket, 0: not a hook's
};

}  // namespace concord::ddp
