#pragma once
// concord::Job: this process's place in a training job — what torchrun's
// environment plus `init_process_group` are to a PyTorch program.
//
//   concord::Job job;                      // joins: blocks until a generation
//   model->to(job.device());               //   forms
//   ... train ...
//   job.finish();                          // tells the coordinator: done
//
// Under `concord-run` the job comes from the environment it sets (CONCORD_*,
// docs/cli.md); without it the program runs alone, a world of one. Anything
// set in JobOptions overrides the environment. A Job is a handle: copies
// share one membership (DistributedDataParallel keeps one).

#include <c10/core/Device.h>
#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace concord {

namespace detail {
class JobState;
}  // namespace detail
namespace trace {
class Recorder;
}  // namespace trace

// Every timeout of a job, in one place. Defaults are the launcher's
// (concord-run --rendezvous-timeout, --collective-timeout,
// --heartbeat-interval, --heartbeat-timeout, which reach the worker as
// CONCORD_*_MS variables); a value set here wins over both.
struct Timeouts {
  // Waiting for a generation to form: the first join and every re-form
  // (CONCORD_RENDEZVOUS_TIMEOUT_MS; default 5 min).
  TORCH_ARG(std::optional<std::chrono::milliseconds>, rendezvous);
  // One collective (allreduce, broadcast) before it fails and the job
  // re-forms without whoever did not take part
  // (CONCORD_COLLECTIVE_TIMEOUT_MS; default 5 min).
  TORCH_ARG(std::optional<std::chrono::milliseconds>, collective);
  // How often the worker tells the coordinator it is alive, and after how
  // long without that the coordinator drops it (CONCORD_HEARTBEAT_*_MS;
  // defaults 1 s and 10 s). The first worker to join sets them for the job.
  TORCH_ARG(std::optional<std::chrono::milliseconds>, heartbeat_interval);
  TORCH_ARG(std::optional<std::chrono::milliseconds>, heartbeat_timeout);
  // After how long a member that holds the others up in a collective while
  // making no progress of its own (no step, no collective, no CPU) is taken
  // out as hung, and the others go on without it (docs/reliability.md,
  // "Hangs"; CONCORD_HANG_TIMEOUT_MS). Zero (the default): derived from the
  // job's step times (5 x the step time, at least 5 s; 60 s before a
  // worker's first steps); negative: never (the collective timeout stays).
  // The first worker to join sets it for the job.
  TORCH_ARG(std::optional<std::chrono::milliseconds>, hang);
};

// Durable checkpoints of run_elastic's state (docs/api.md "Checkpoints"):
// what concord-run's --checkpoint-dir, --checkpoint-every,
// --checkpoint-keep and --no-resume say, which reach the worker as
// CONCORD_CHECKPOINT_* variables; a value set here wins over them.
struct CheckpointOptions {
  // Where they go: DIR/<job id>/step-<N>/ (CONCORD_CHECKPOINT_DIR; default
  // none: no checkpoints).
  TORCH_ARG(std::optional<std::string>, dir);
  // A checkpoint at the commit of every step that is a multiple of this
  // (CONCORD_CHECKPOINT_EVERY; required with a dir, at least 1).
  TORCH_ARG(std::optional<int64_t>, every);
  // Complete checkpoints kept on disk (CONCORD_CHECKPOINT_KEEP; default 3).
  TORCH_ARG(std::optional<int>, keep);
  // Whether a job whose workers hold no committed step (all are new: every
  // worker died, or the job was started again with the same job id) goes
  // on from the newest checkpoint (CONCORD_CHECKPOINT_RESUME; default
  // true).
  TORCH_ARG(std::optional<bool>, resume);
  // Whether parameters and optimizer state are copied into the memory
  // snapshot while the next step's forward runs rather than during the
  // commit (CONCORD_CHECKPOINT_OVERLAP; default false): the commit then
  // stalls only for the buffers and the user's values. Only for a step that
  // writes parameters and optimizer state in an optimizer step after its
  // backward (not, say, weights clamped before the forward: an in-place
  // write caught there drops that checkpoint, and later ones are copied
  // during the commit; one through .data() is not caught).
  TORCH_ARG(std::optional<bool>, overlap);
};

// What a Job joins. Unset fields come from the environment, then from the
// defaults named.
struct JobOptions {
  // host:port of the coordinator (CONCORD_COORDINATOR); none: run alone.
  TORCH_ARG(std::optional<std::string>, coordinator);
  // The worker token (CONCORD_TOKEN_FILE names a file holding it, or
  // CONCORD_TOKEN); required with a coordinator.
  TORCH_ARG(std::optional<std::string>, token);
  // The job's name (CONCORD_JOB_ID; default "default").
  TORCH_ARG(std::optional<std::string>, job_id);
  // This worker's name, unique in the job (CONCORD_WORKER_ID; default
  // host-pid).
  TORCH_ARG(std::optional<std::string>, worker_id);
  // The job runs with min_workers..max_workers workers
  // (CONCORD_MIN_WORKERS, CONCORD_MAX_WORKERS; default 1 and min_workers).
  TORCH_ARG(std::optional<int>, min_workers);
  TORCH_ARG(std::optional<int>, max_workers);
  // What is done with a member persistently slower than the others
  // (docs/reliability.md, "Stragglers"): "report" names it (the default);
  // "evict" also takes it out while the job is faster without it and keeps
  // min_workers, for a cool-down (CONCORD_STRAGGLERS). The first worker to
  // join sets it for the job.
  TORCH_ARG(std::optional<std::string>, stragglers);
  // How long an evicted straggler waits before it may join again, doubled
  // at each later eviction (CONCORD_STRAGGLER_COOLDOWN_MS; default 60 s).
  TORCH_ARG(std::optional<std::chrono::milliseconds>, straggler_cooldown);
  // "cpu", "cuda" (cuda:<local rank>) or "cuda:N" (CONCORD_DEVICE; default
  // cpu). A device that is not there is an error (kFailedPrecondition).
  TORCH_ARG(std::optional<std::string>, device);
  // "auto" (NCCL on CUDA where this Concord has it, else Gloo), "gloo" or
  // "nccl" (CONCORD_BACKEND; default auto).
  TORCH_ARG(std::optional<std::string>, backend);
  // A timeline of this worker in Chrome's trace-event format (Perfetto,
  // chrome://tracing): steps, forward, backward, each bucket's allreduce,
  // re-forms, and the program's own TraceScopes (CONCORD_TRACE_FILE, which
  // `concord-run --trace` sets per worker and merges; default none). A file
  // that cannot be created is kInvalidArgument, before joining.
  TORCH_ARG(std::optional<std::string>, trace_file);
  // This worker's history, appended as JSON lines: the generations it
  // joined, the state it went on from after each re-form, every committed
  // step with a digest of the parameters and the samples it took
  // (CONCORD_HISTORY_FILE, which `concord-run --history DIR` sets per
  // worker; default none). For audits and tests: a commit hashes every
  // parameter. A file that cannot be opened is kInvalidArgument, before
  // joining.
  TORCH_ARG(std::optional<std::string>, history_file);
  // How much Concord logs, on standard error (never standard output, which
  // is the program's): "trace", "debug", "info", "warn", "error",
  // "critical" or "off" (CONCORD_LOG_LEVEL; default info). A bad name is
  // kInvalidArgument, before joining.
  TORCH_ARG(std::optional<std::string>, log_level);
  TORCH_ARG(Timeouts, timeouts);
  TORCH_ARG(CheckpointOptions, checkpoints);
};

// What a Job with some JobOptions would be on this machine, resolved from
// the options, the environment and the CUDA devices visible, without
// joining (plan_job): torchrun's environment as this worker would read it.
// A Job made with the same options in the same process gets these values.
struct JobPlan {
  // Where the model and batches go (Job::device()): `cuda` and `auto`
  // resolved against the local rank and the devices visible;
  // see Note [Worker device] in worker/device.h.
  c10::Device device = c10::kCPU;
  // "gloo" or "nccl" (Job::backend()), `auto` resolved for `device`.
  std::string backend;
  // When `auto` found no CUDA device and falls back to the CPU: the one line
  // that says so, naming where the request came from ("JobOptions::device
  // auto: ..." or "CONCORD_DEVICE: device auto: ..."); empty otherwise. Job
  // logs it as a warning.
  std::string device_note;
  // Whether a coordinator runs the job (Job::elastic()).
  bool elastic = false;
  std::string job_id;
  std::string worker_id;  // Job::worker_id()
  int local_rank = 0;     // Job::local_rank()
  int min_workers = 1;
  int max_workers = 1;
  // The timeline's file (JobOptions::trace_file, else CONCORD_TRACE_FILE);
  // empty: none. Not created here: Job makes it, before joining.
  std::string trace_file;
  // The timeouts in force, every field set (Job::timeouts()).
  Timeouts timeouts;
};

// Plans the job `options` and the environment describe, without joining it
// or touching a file: what fails here fails the same way in Job's
// constructor, before it contacts anyone. For a launcher or a tool that
// checks its flags before it loads a model. Throws Error: kInvalidArgument
// (a bad option or CONCORD_* value, naming it, as Job does),
// kFailedPrecondition (the device or backend is not there, naming where the
// request came from: "JobOptions::device cuda:1: ..." for an option,
// "CONCORD_DEVICE: device cuda:1: ..." for the variable; the same for the
// backend).
JobPlan plan_job(const JobOptions& options = {});

class Job {
 public:
  // Joins the job JobOptions and the environment describe; blocks until a
  // generation forms (at most the rendezvous timeout). Throws Error:
  // kInvalidArgument (a bad option or CONCORD_* value, naming it),
  // kFailedPrecondition (the device is not there, NCCL asked for where
  // this build has none: plan_job's errors; the job failed or was stopped),
  // kDeadlineExceeded (no generation formed in time),
  // kUnavailable (the coordinator cannot be reached),
  // kPermissionDenied / kUnauthenticated (the token was refused).
  explicit Job(const JobOptions& options = {});

  // This worker's rank, the world size and the generation number, of the
  // generation it is in now (after a re-form that failed: of the last one).
  int rank() const;
  int world_size() const;
  int64_t generation() const;
  // The rank whose model and state the others take after the generation
  // formed (the survivor with the most progress).
  int authoritative_rank() const;
  // This worker's rank among the workers of its node (concord-run's
  // CONCORD_LOCAL_RANK or torchrun's LOCAL_RANK; 0 when alone, -1 when
  // unknown).
  int local_rank() const;
  // Where this worker's model and batches go.
  c10::Device device() const;
  // "gloo" or "nccl".
  std::string backend() const;
  // Whether a coordinator runs the job (false: a world of one).
  bool elastic() const;
  // This worker's name, and the job's bounds on its world size.
  const std::string& worker_id() const;
  int min_workers() const;
  int max_workers() const;
  // The timeouts in force, every field set.
  const Timeouts& timeouts() const;

  // Progress for operators (`concordctl status`): the last step, this
  // worker's throughput and, when finite, its loss; carried by the next
  // heartbeat. Cheap; any thread.
  void report_progress(int64_t step, double samples_per_second,
                       std::optional<double> loss = std::nullopt);

  // Tells the coordinator this worker is done (`ok`) or failed, with a
  // reason; stops heartbeating. Idempotent. When the last handle goes
  // without it, the job is finished ok — or failed, when the handle goes
  // while an exception unwinds the stack.
  void finish(bool ok = true, const std::string& message = "");

  // Inside Concord (DistributedDataParallel, the elastic loop).
  const std::shared_ptr<detail::JobState>& state() const { return state_; }

 private:
  std::shared_ptr<detail::JobState> state_;
};

// Times a scope of the training thread on the job's timeline
// (JobOptions::trace_file), tagged with the step being taken:
//
//   { concord::TraceScope scope(job, "optimizer"); optimizer.step(); }
//
// Nothing (one pointer test) when the job has no timeline. `name` must
// outlive the scope (a literal).
class TraceScope {
 public:
  TraceScope(const Job& job, const char* name);
  ~TraceScope();
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  trace::Recorder* recorder_;
  const char* name_;
  int64_t start_us_;
};

}  // namespace concord
