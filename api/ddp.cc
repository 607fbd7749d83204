#include "concord/ddp.h"

#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "api/internal.h"
#include "worker/ddp/comm_hooks.h"
#include "worker/ddp/engine.h"
#include "worker/error.h"
#include "worker/torch_compat.h"

namespace concord::detail {
namespace {

int64_t MiB(const char* name, double mb) {
  if (!(mb > 0) || !std::isfinite(mb) || mb > 1024 * 1024) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("DdpOptions::", name,
                             ": not a size in MiB in (0, 1048576]: ", mb));
  }
  return static_cast<int64_t>(std::llround(mb * 1024 * 1024));
}

// The public options as the engine takes them (one field each; the
// engine checks what contradicts).
ddp::EngineOptions EngineOptionsFrom(const DdpOptions& o,
                                     const Timeouts& timeouts) {
  ddp::EngineOptions e;
  if (o.bucket_cap_mb()) {
    e.reducer.bucket_cap_bytes = MiB("bucket_cap_mb", *o.bucket_cap_mb());
    // See Note [LibTorch versions] in worker/torch_compat.h.
    if (compat::kFirstBucketFollowsUserCap) {
      e.reducer.first_bucket_bytes = e.reducer.bucket_cap_bytes;
    }
  }
  e.broadcast_buffers = o.broadcast_buffers();
  e.reducer.find_unused_parameters = o.find_unused_parameters();
  e.reducer.static_graph = o.static_graph();
  e.reducer.gradient_as_bucket_view = o.gradient_as_bucket_view();
  e.ignore = o.params_and_buffers_to_ignore();
  e.reducer.message_size = o.message_size();
  e.reducer.delay_allreduce = o.delay_allreduce();
  e.reducer.allreduce_always_fp32 = o.allreduce_always_fp32();
  e.reducer.gradient_average = o.gradient_average();
  e.reducer.gradient_predivide_factor = o.gradient_predivide_factor();
  e.allreduce_trigger_params = o.allreduce_trigger_params();
  e.reducer.collective_timeout =
      absl::Milliseconds(timeouts.collective()->count());
  if (o.slowmo()) {
    if (!o.comm_hook().empty()) {
      throw Error(ErrorCode::kInvalidArgument,
                  "DdpOptions: comm_hook and slowmo exclude each other (SlowMo "
                  "does not average gradients every step)");
    }
    // SlowMo broadcasts the buffers before every forward itself.
    e.broadcast_buffers = false;
  }
  return e;
}

slowmo::SlowMoOptions SlowMoOptionsFrom(const DdpOptions& d,
                                        std::string node_id,
                                        std::chrono::milliseconds collective) {
  absl::StatusOr<slowmo::SlowMoOptions> s = slowmo::FromPublic(*d.slowmo());
  if (!s.ok()) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("SlowMoOptions: ", s.status().message()));
  }
  s->broadcast_buffers = d.broadcast_buffers();
  s->node_id = std::move(node_id);
  s->collective_timeout = absl::Milliseconds(collective.count());
  if (absl::Status valid = slowmo::ValidateOptions(*s); !valid.ok()) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("SlowMoOptions: ", valid.message()));
  }
  return *std::move(s);
}

}  // namespace
}  // namespace concord::detail

namespace concord {

void DdpOptions::validate() const {
  const auto any_timeout = std::chrono::minutes(5);
  ddp::EngineOptions engine = detail::EngineOptionsFrom(
      *this, Timeouts().collective(std::chrono::milliseconds(any_timeout)));
  if (slowmo()) detail::SlowMoOptionsFrom(*this, "", any_timeout);
  ThrowIfError(ddp::Engine::ValidateOptions(engine, !comm_hook().empty()));
  if (!comm_hook().empty()) {
    // The name and its arguments; a world of one is enough to check them.
    auto hook = ddp::MakeCommHook(comm_hook(), nullptr);
    if (!hook.ok()) {
      throw Error(
          ErrorCode::kInvalidArgument,
          absl::StrCat("DdpOptions::comm_hook: ", hook.status().message()));
    }
  }
}

}  // namespace concord

namespace concord::detail {

DdpCore::Impl::Impl(const Job& j, const DdpOptions& o) : job(j), options(o) {}

void DdpCore::Impl::Register(std::string module_type) {
  JobState& js = *job.state();
  type = std::move(module_type);
  name = absl::StrCat("ddp", ++js.ddps_made);
  js.ddps.push_back(this);
}

DdpCore::Impl::~Impl() {
  auto& ddps = job.state()->ddps;
  ddps.erase(std::remove(ddps.begin(), ddps.end(), this), ddps.end());
}

std::string DdpCore::Impl::Describe() const {
  return absl::StrCat("DistributedDataParallel '", name, "' (", type, ")");
}

void DdpCore::Impl::CheckBound() const {
  const int64_t bound = engine->communicator().generation();
  const int64_t now = job.state()->session().generation();
  if (bound == now) return;
  throw Error(
      ErrorCode::kFailedPrecondition,
      absl::StrCat(Describe(), " is bound to generation ", bound,
                   ", which ended (the job is in generation ", now,
                   "): it was made while run_elastic ran, and a re-form "
                   "rebinds only the modules made before run_elastic "
                   "started; make it before"));
}

void DdpCore::Impl::OnCollective(worker::TestFault::Point point) {
  JobState& js = *job.state();
  if (js.elastic == nullptr) return;
  if (!js.faults().empty()) {
    js.faults().Reached(ElasticStep(*js.elastic), point, name);
  }
  ObserveCollective(*js.elastic);
}

template <typename Create>
void DdpCore::Impl::Init(Create create) {
  ddp::EngineOptions engine_options =
      EngineOptionsFrom(options, job.timeouts());
  // Checked before anything is made.
  std::optional<slowmo::SlowMoOptions> slowmo_options;
  if (options.slowmo()) {
    slowmo_options =
        SlowMoOptionsFrom(options, job.state()->session().options().node_id,
                          *job.timeouts().collective());
  }
  ThrowIfError(ddp::Engine::ValidateOptions(engine_options,
                                            !options.comm_hook().empty()));
  auto created =
      create(Communicator(), job.authoritative_rank(), engine_options);
  ThrowIfError(created.status());
  engine = *std::move(created);
  engine->SetTraceRecorder(job.state()->trace());
  engine->SetBackwardObserver([this](size_t bucket) {
    if (bucket == 0) OnCollective(worker::TestFault::Point::kBackward);
    JobState& js = *job.state();
    if (js.elastic != nullptr && !js.faults().empty()) {
      js.faults().Reached(ElasticStep(*js.elastic),
                          worker::TestFault::Point::kBucket, name);
    }
  });
  if (!options.comm_hook().empty()) RegisterHook();
  BindSyncBatchNorm();
  if (slowmo_options) StartSlowMo(*slowmo_options);
}

void DdpCore::Impl::StartSlowMo(const slowmo::SlowMoOptions& slowmo_options) {
  // The buffers DDP keeps equal (not those it was told to ignore).
  std::vector<torch::Tensor> all = engine->AllBuffers();
  const auto& ignore = options.params_and_buffers_to_ignore();
  std::vector<torch::Tensor> buffers;
  for (const auto& [name, t] : engine->NamedState()) {
    const bool buffer =
        std::any_of(all.begin(), all.end(),
                    [&t = t](const torch::Tensor& b) { return b.is_same(t); });
    if (buffer &&
        std::find(ignore.begin(), ignore.end(), name) == ignore.end()) {
      buffers.push_back(t);
    }
  }
  auto made = slowmo::SlowMo::Create(engine->parameters(), buffers,
                                     Communicator(), job.authoritative_rank(),
                                     slowmo_options, &job.state()->session());
  ThrowIfError(made.status());
  slowmo = *std::move(made);
  // Gradients stay local: fairscale's SlowMo module reduces none.
  engine->SetRequireBackwardGradSync(false);
  // fairscale queues its after-backward work from gradient hooks: the
  // first gradient of a backward queues AfterBackward at its end.
  for (const torch::Tensor& p : engine->parameters()) {
    torch::Tensor param = p;
    const unsigned handle = param.register_hook([this](const torch::Tensor&) {
      if (after_backward_queued) return;
      after_backward_queued = true;
      torch::autograd::Engine::get_default_engine().queue_callback([this] {
        after_backward_queued = false;
        ThrowIfError(slowmo->AfterBackward());
      });
    });
    slowmo_hooks.emplace_back(param, handle);
  }
}

void DdpCore::Impl::RemoveSlowMoHooks() {
  for (auto& [param, handle] : slowmo_hooks) param.remove_hook(handle);
  slowmo_hooks.clear();
}

comm::CollectiveOptions DdpCore::Impl::CollectiveOptions() const {
  comm::CollectiveOptions o;
  o.timeout = absl::Milliseconds(job.timeouts().collective()->count());
  return o;
}

void DdpCore::Impl::BindSyncBatchNorm() {
  if (module == nullptr) return;
  std::vector<std::shared_ptr<SyncBatchNormImpl>> layers;
  for (const auto& m : module->modules(/*include_self=*/true)) {
    if (auto layer = std::dynamic_pointer_cast<SyncBatchNormImpl>(m)) {
      layers.push_back(std::move(layer));
    }
  }
  if (layers.empty()) return;
  sync_bn = std::make_shared<SyncBnGroup>(Communicator(), CollectiveOptions());
  for (const auto& layer : layers) layer->set_group(sync_bn);
}

void DdpCore::Impl::Rebound() {
  if (!options.comm_hook().empty() || user_hook) RegisterHook();
  if (sync_bn != nullptr) sync_bn->SetCommunicator(Communicator());
}

void DdpCore::Impl::RegisterHook() {
  if (user_hook) {
    ThrowIfError(engine->RegisterCommHook(user_hook(Communicator())));
    return;
  }
  if (absl::StartsWith(options.comm_hook(), "powersgd")) {
    if (powersgd == nullptr || !powersgd_attached) {
      auto parsed = ddp::ParsePowerSgd(options.comm_hook());
      if (!parsed.ok()) {
        throw Error(
            ErrorCode::kInvalidArgument,
            absl::StrCat("DdpOptions::comm_hook: ", parsed.status().message()));
      }
      powersgd = std::make_shared<ddp::PowerSgdState>(*parsed);
      powersgd_participant = std::make_unique<elastic::PowerSgdParticipant>(
          powersgd, engine->parameters().front().options(),
          CollectiveOptions());
    }
    ThrowIfError(engine->RegisterCommHook(
        ddp::PowerSgdHook(powersgd, Communicator(), CollectiveOptions())));
    return;
  }
  auto hook = ddp::MakeCommHook(options.comm_hook(),
                                job.state()->session().shared_communicator(),
                                CollectiveOptions());
  if (!hook.ok()) {
    throw Error(
        ErrorCode::kInvalidArgument,
        absl::StrCat("DdpOptions::comm_hook: ", hook.status().message()));
  }
  ThrowIfError(engine->RegisterCommHook(*std::move(hook)));
}

std::shared_ptr<comm::Communicator> DdpCore::Impl::Communicator() const {
  auto comm = job.state()->session().shared_communicator();
  if (comm == nullptr) {
    throw Error(ErrorCode::kFailedPrecondition,
                "the job is between generations (a re-form failed)");
  }
  return comm;
}

DdpCore::DdpCore(std::shared_ptr<torch::nn::Module> module, const Job& job,
                 const DdpOptions& options)
    : impl_(std::make_unique<Impl>(job, options)) {
  impl_->module = module;
  impl_->Register(module->name());
  impl_->Init([&](auto comm, int authoritative, const auto& engine_options) {
    return ddp::Engine::Create(std::move(module), std::move(comm),
                               authoritative, engine_options);
  });
}

DdpCore::DdpCore(const torch::jit::Module& module, const Job& job,
                 const DdpOptions& options)
    : impl_(std::make_unique<Impl>(job, options)) {
  impl_->Register(module.type()->name() ? module.type()->name()->qualifiedName()
                                        : "torch::jit::Module");
  impl_->Init([&](auto comm, int authoritative, const auto& engine_options) {
    return ddp::Engine::Create(module, std::move(comm), authoritative,
                               engine_options);
  });
}

DdpCore::~DdpCore() { impl_->RemoveSlowMoHooks(); }

void DdpCore::before_forward() {
  JobState& js = *impl_->job.state();
  if (js.joined) {
    throw Error(ErrorCode::kFailedPrecondition,
                "forward after join(): this rank's data was over");
  }
  if (js.elastic != nullptr && !js.step_open) {
    BeginElasticStep(*js.elastic);
    js.step_open = true;
  }
  impl_->CheckBound();
  impl_->OnCollective(worker::TestFault::Point::kForward);
  // The timeline's "forward": the buffer broadcast and the module's own.
  if (js.trace()) impl_->forward_start_us = trace::NowMicros();
  ThrowIfError(impl_->engine->PrepareForward());
  if (impl_->slowmo != nullptr) {
    impl_->after_backward_queued = false;  // a failed backward dropped it
    ThrowIfError(impl_->slowmo->PrepareForward());
  }
}

void DdpCore::after_forward() {
  impl_->engine->ForwardDone();
  if (const auto& trace = impl_->job.state()->trace()) {
    trace->Complete("forward", trace::Recorder::kTrainThread,
                    impl_->forward_start_us, trace::NowMicros());
  }
}

void DdpCore::set_require_backward_grad_sync(bool sync) {
  impl_->engine->SetRequireBackwardGradSync(sync);
}

bool DdpCore::require_backward_grad_sync() const {
  return impl_->engine->require_backward_grad_sync();
}

bool DdpCore::join() {
  JobState& js = *impl_->job.state();
  if (js.elastic == nullptr) {
    throw Error(ErrorCode::kFailedPrecondition,
                "join: needs an ElasticState over this job (the step "
                "agreement is run_elastic's)");
  }
  if (js.step_open) {
    throw Error(ErrorCode::kFailedPrecondition,
                "join: the step begun by the last forward was not committed");
  }
  return JoinElastic(*js.elastic);
}

void DdpCore::perform_slowmo(torch::optim::Optimizer& optimizer) {
  if (impl_->slowmo == nullptr) {
    throw Error(ErrorCode::kFailedPrecondition,
                "perform_slowmo: this DistributedDataParallel has no "
                "DdpOptions::slowmo");
  }
  if (impl_->job.state()->elastic != nullptr && impl_->job.state()->step_open) {
    // See Note [SlowMo step]: the optimizer step cannot be undone, so the step
    // is committed first and a failed average is owed, not lost.
    throw Error(ErrorCode::kFailedPrecondition,
                "perform_slowmo: commit() the step first");
  }
  trace::Recorder::Span span(impl_->job.state()->trace(), "slowmo");
  ThrowIfError(impl_->slowmo->PerformSlowMo(optimizer));
}

void DdpCore::register_comm_hook(CommHook hook) {
  Impl& d = *impl_;
  if (hook == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                "register_comm_hook: an empty hook");
  }
  if (d.user_hook || !d.options.comm_hook().empty()) {
    throw Error(ErrorCode::kAlreadyExists,
                absl::StrCat("register_comm_hook: ", d.Describe(),
                             " has a communication hook already"));
  }
  if (d.slowmo != nullptr) {
    throw Error(ErrorCode::kFailedPrecondition,
                "register_comm_hook: SlowMo does not average gradients every "
                "step (DdpOptions::slowmo)");
  }
  auto make = [hook = std::move(hook), options = d.CollectiveOptions()](
                  std::shared_ptr<comm::Communicator> comm) {
    return ToEngineHook(hook, std::move(comm), options);
  };
  ThrowIfError(d.engine->RegisterCommHook(make(d.Communicator())));
  d.user_hook = std::move(make);
}

DdpStats DdpCore::stats() const {
  const ddp::ReducerStats& r = impl_->engine->stats();
  DdpStats s;
  s.iterations = r.iterations;
  s.bucket_rebuilds = r.rebuilds;
  s.bucket_bytes = r.bucket_bytes;
  s.initial_bucket_params = r.initial_bucket_params;
  s.bucket_params = r.bucket_params;
  s.forward_compute_us = r.forward_compute_us;
  s.backward_compute_us = r.backward_compute_us;
  s.backward_comm_us = r.backward_comm_us;
  s.overlap_us = r.overlap_us;
  s.unused_parameters = r.unused_parameters;
  return s;
}

const Job& DdpCore::job() const { return impl_->job; }

}  // namespace concord::detail
