#include "concord/job.h"

#include <exception>

#include "absl/strings/str_cat.h"
#include "api/internal.h"
#include "common/auth.h"
#include "common/environment.h"
#include "common/job_defaults.h"
#include "common/logging.h"
#include "worker/error.h"

namespace concord {
namespace {

int64_t Millis(std::chrono::milliseconds d) { return d.count(); }

void ThrowInvalid(const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, message);
}

// A parsed JobOptions field, or kInvalidArgument naming it.
template <typename T>
T Parsed(const char* field, absl::StatusOr<T> value) {
  if (!value.ok()) {
    ThrowInvalid(
        absl::StrCat("JobOptions::", field, ": ", value.status().message()));
  }
  return *std::move(value);
}

void CheckPositive(const char* name,
                   const std::optional<std::chrono::milliseconds>& d) {
  if (d.has_value() && d->count() <= 0) {
    ThrowInvalid(absl::StrCat("Timeouts::", name, ": must be positive, got ",
                              d->count(), " ms"));
  }
}

// The environment's options (WorkerOptions::FromEnvironment) with what
// `o` sets on top. Throws kInvalidArgument naming the field.
worker::WorkerOptions Resolve(const JobOptions& o) {
  auto env = worker::WorkerOptions::FromEnvironment();
  ThrowIfError(env.status());
  worker::WorkerOptions w = *std::move(env);
  if (o.coordinator()) w.coordinator = *o.coordinator();
  if (o.token()) {
    if (auto st = ValidateToken(*o.token()); !st.ok()) {
      ThrowInvalid(absl::StrCat("JobOptions::token: ", st.message()));
    }
    w.token = *o.token();
  }
  if (!w.coordinator.empty() && w.token.empty()) {
    ThrowInvalid(
        "JobOptions::token: a coordinator needs a worker token (or "
        "CONCORD_TOKEN_FILE)");
  }
  if (o.job_id()) {
    if (o.job_id()->empty()) ThrowInvalid("JobOptions::job_id: empty");
    w.spec.set_job_id(*o.job_id());
  }
  if (o.worker_id()) {
    if (o.worker_id()->empty()) ThrowInvalid("JobOptions::worker_id: empty");
    w.worker_id = *o.worker_id();
  }
  if (o.min_workers()) {
    if (*o.min_workers() < 1) ThrowInvalid("JobOptions::min_workers: < 1");
    w.spec.set_min_workers(*o.min_workers());
    if (!o.max_workers() && w.spec.max_workers() < *o.min_workers()) {
      w.spec.set_max_workers(*o.min_workers());
    }
  }
  if (o.max_workers()) {
    if (*o.max_workers() < w.spec.min_workers()) {
      ThrowInvalid(absl::StrCat("JobOptions::max_workers: ", *o.max_workers(),
                                " is below min_workers ",
                                w.spec.min_workers()));
    }
    w.spec.set_max_workers(*o.max_workers());
  }
  if (o.stragglers()) {
    if (const std::string problem =
            StragglerPolicyProblem(*o.stragglers(), "JobOptions::stragglers");
        !problem.empty()) {
      ThrowInvalid(problem);
    }
    w.spec.set_stragglers(*o.stragglers());
  }
  if (o.straggler_cooldown()) {
    if (o.straggler_cooldown()->count() <= 0) {
      ThrowInvalid(
          absl::StrCat("JobOptions::straggler_cooldown: must be positive, got ",
                       o.straggler_cooldown()->count(), " ms"));
    }
    w.spec.set_straggler_cooldown_ms(Millis(*o.straggler_cooldown()));
  }
  if (o.device()) w.device = Parsed("device", ParseDeviceRequest(*o.device()));
  if (o.trace_file()) {
    if (o.trace_file()->empty()) ThrowInvalid("JobOptions::trace_file: empty");
    w.trace_file = *o.trace_file();
  }
  if (o.history_file()) {
    if (o.history_file()->empty()) {
      ThrowInvalid("JobOptions::history_file: empty");
    }
    w.history_file = *o.history_file();
  }
  if (o.log_level()) {
    Parsed("log_level", ParseLogLevel(*o.log_level()));
    w.log_level = *o.log_level();
  }
  if (o.backend()) {
    w.backend = Parsed("backend", ParseBackendRequest(*o.backend()));
  }
  const CheckpointOptions& c = o.checkpoints();
  if (c.dir()) w.checkpoint.dir = *c.dir();
  if (c.every()) w.checkpoint.every = *c.every();
  if (c.keep()) w.checkpoint.keep = *c.keep();
  if (c.resume()) w.checkpoint.resume = *c.resume();
  if (c.overlap()) w.checkpoint.overlap = *c.overlap();
  if (auto st = checkpoint::Validate(w.checkpoint, "JobOptions::checkpoints.");
      !st.ok()) {
    ThrowInvalid(std::string(st.message()));
  }
  const Timeouts& t = o.timeouts();
  CheckPositive("rendezvous", t.rendezvous());
  CheckPositive("collective", t.collective());
  CheckPositive("heartbeat_interval", t.heartbeat_interval());
  CheckPositive("heartbeat_timeout", t.heartbeat_timeout());
  if (t.rendezvous()) {
    w.join_timeout = absl::Milliseconds(Millis(*t.rendezvous()));
    w.spec.set_rendezvous_timeout_ms(Millis(*t.rendezvous()));
  }
  if (t.collective()) {
    w.collective_timeout = absl::Milliseconds(Millis(*t.collective()));
  }
  if (t.heartbeat_interval()) {
    w.spec.set_heartbeat_interval_ms(Millis(*t.heartbeat_interval()));
  }
  if (t.heartbeat_timeout()) {
    w.spec.set_heartbeat_timeout_ms(Millis(*t.heartbeat_timeout()));
  }
  if (t.hang()) {
    w.spec.set_hang_timeout_ms(t.hang()->count() < 0 ? -1 : Millis(*t.hang()));
  }
  // The pair in force (the environment's, with the options on top).
  if (const std::string problem = HeartbeatTimeoutProblem(
          w.spec.heartbeat_interval_ms(), w.spec.heartbeat_timeout_ms(),
          t.heartbeat_interval() ? "JobOptions::timeouts.heartbeat_interval"
                                 : std::string(env::kHeartbeatIntervalMs.name),
          t.heartbeat_timeout() ? "JobOptions::timeouts.heartbeat_timeout"
                                : std::string(env::kHeartbeatTimeoutMs.name));
      !problem.empty()) {
    ThrowInvalid(problem);
  }
  return w;
}

Timeouts InForce(const worker::WorkerOptions& w) {
  using std::chrono::milliseconds;
  return Timeouts()
      .rendezvous(milliseconds(absl::ToInt64Milliseconds(w.join_timeout)))
      .collective(milliseconds(absl::ToInt64Milliseconds(w.collective_timeout)))
      .heartbeat_interval(milliseconds(w.spec.heartbeat_interval_ms()))
      .heartbeat_timeout(milliseconds(w.spec.heartbeat_timeout_ms()))
      .hang(milliseconds(w.spec.hang_timeout_ms()));
}

// Where a device or backend request came from, before a message that names
// it ("device cuda:1: ..."): the option when set, else the variable.
std::string RequestSource(bool option, const env::Variable& variable) {
  return option ? "JobOptions::" : absl::StrCat(variable.name, ": ");
}

// `o` resolved (Resolve's `w`) on this machine: the device and backend a
// Job would use, or kFailedPrecondition naming the request's source.
JobPlan PlanOf(const JobOptions& o, const worker::WorkerOptions& w) {
  JobPlan plan;
  auto device = worker::ResolveWorkerDevice(w);
  if (!device.ok()) {
    throw Error(
        ErrorCode::kFailedPrecondition,
        absl::StrCat(RequestSource(o.device().has_value(), env::kDevice),
                     device.status().message()));
  }
  if (!device->note.empty()) {
    plan.device_note = absl::StrCat(
        RequestSource(o.device().has_value(), env::kDevice), device->note);
  }
  auto backend = worker::ResolveBackend(w, device->device);
  if (!backend.ok()) {
    throw Error(
        ErrorCode::kFailedPrecondition,
        absl::StrCat(RequestSource(o.backend().has_value(), env::kBackend),
                     backend.status().message()));
  }
  if (device->device.is_cuda()) {
    plan.device = c10::Device(
        c10::kCUDA, static_cast<c10::DeviceIndex>(device->device.index));
  }
  plan.backend = std::string(BackendName(*backend));
  plan.elastic = !w.coordinator.empty();
  plan.job_id = w.spec.job_id();
  plan.worker_id = w.worker_id;
  plan.local_rank = w.local_rank < 0 && !plan.elastic ? 0 : w.local_rank;
  plan.min_workers = w.spec.min_workers();
  plan.max_workers = w.spec.max_workers();
  plan.trace_file = w.trace_file;
  plan.timeouts = InForce(w);
  return plan;
}

}  // namespace

JobPlan plan_job(const JobOptions& options) {
  return PlanOf(options, Resolve(options));
}

namespace detail {

JobState::~JobState() {
  // The last handle went: a program that returned from main is done; one
  // unwinding an exception failed.
  if (std::uncaught_exceptions() > 0) {
    Finish(false, "the program ended with an exception");
  } else {
    Finish(true, "");
  }
}

void JobState::Finish(bool ok, const std::string& message) {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return;
  finished_ = true;
  if (auto st = session_->Finish(ok, message); !st.ok()) {
    Log()->warn("finish: {}", st.ToString());
  }
}

}  // namespace detail

Job::Job(const JobOptions& options) {
  worker::WorkerOptions resolved = Resolve(options);
  // The device and backend, checked before anything is made: plan_job's
  // errors (the session resolves them again, to the same).
  PlanOf(options, resolved);
  if (!resolved.log_level.empty()) {
    Log()->set_level(*ParseLogLevel(resolved.log_level));  // checked
  }
  // The timeline's file is made before joining: a bad path joins nothing.
  std::shared_ptr<trace::Recorder> trace;
  if (!resolved.trace_file.empty()) {
    auto made =
        trace::Recorder::Create(resolved.trace_file, resolved.worker_id);
    if (!made.ok()) {
      ThrowInvalid(absl::StrCat(options.trace_file() ? "JobOptions::trace_file"
                                                     : env::kTraceFile.name,
                                ": ", made.status().message()));
    }
    trace = *std::move(made);
  }
  auto session = worker::Session::Start(resolved);
  detail::ExitIfJobSucceeded(session.status(), resolved.worker_id);
  ThrowIfError(session.status());
  state_ = std::make_shared<detail::JobState>(
      *std::move(session), InForce(resolved), std::move(trace));
}

int Job::rank() const { return state_->session().rank(); }
int Job::world_size() const { return state_->session().world_size(); }
int64_t Job::generation() const { return state_->session().generation(); }
int Job::authoritative_rank() const {
  return state_->session().authoritative_rank();
}
int Job::local_rank() const {
  const int local = state_->session().options().local_rank;
  return local < 0 && !elastic() ? 0 : local;
}
c10::Device Job::device() const { return state_->session().torch_device(); }
std::string Job::backend() const {
  return std::string(BackendName(state_->session().backend()));
}
bool Job::elastic() const { return state_->session().elastic(); }
const std::string& Job::worker_id() const {
  return state_->session().options().worker_id;
}
int Job::min_workers() const {
  return state_->session().options().spec.min_workers();
}
int Job::max_workers() const {
  return state_->session().options().spec.max_workers();
}
const Timeouts& Job::timeouts() const { return state_->timeouts(); }

void Job::report_progress(int64_t step, double samples_per_second,
                          std::optional<double> loss) {
  state_->session().ReportProgress(step, samples_per_second, loss);
}

void Job::finish(bool ok, const std::string& message) {
  state_->Finish(ok, message);
}

TraceScope::TraceScope(const Job& job, const char* name)
    : recorder_(job.state()->trace().get()),
      name_(name),
      start_us_(recorder_ != nullptr ? trace::NowMicros() : 0) {}

TraceScope::~TraceScope() {
  if (recorder_ != nullptr) {
    recorder_->Complete(name_, trace::Recorder::kTrainThread, start_us_,
                        trace::NowMicros());
  }
}

}  // namespace concord
