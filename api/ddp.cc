#include "concord/ddp.h"

#include <torch/csrc/autograd/engine.h>

#include <algorithm>
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

// What SlowMo runs with besides the user's options, checked with them
// (kInvalidArgument "SlowMoOptions: ...").
slowmo::SlowMoInternals SlowMoInternalsOf(
    const DdpOptions& d, std::string node_id,
    std::chrono::milliseconds collective) {
  slowmo::SlowMoInternals internals;
  internals.broadcast_buffers = d.broadcast_buffers();
  internals.node_id = std::move(node_id);
  internals.collective_timeout = absl::Milliseconds(collective.count());
  if (absl::Status valid = slowmo::ValidateOptions(*d.slowmo(), internals);
      !valid.ok()) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("SlowMoOptions: ", valid.message()));
  }
  return internals;
}

}  // namespace
}  // namespace concord::detail

namespace concord {

void DdpOptions::validate() const {
  ThrowIfError(ddp::Engine::ValidateOptions(*this, !comm_hook().empty()));
  if (slowmo()) {
    detail::SlowMoInternalsOf(
        *this, "", std::chrono::milliseconds(kDefaultCollectiveTimeoutMs));
  }
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

void zero_grad(torch::optim::Optimizer& optimizer, bool set_to_none) {
  compat::ZeroGrad(optimizer, set_to_none);
}

void disable_torchscript_cpu_fusion() { compat::UnfusedTorchScriptOnCpu(); }

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
  // Checked before anything is made.
  ThrowIfError(
      ddp::Engine::ValidateOptions(options, !options.comm_hook().empty()));
  std::optional<slowmo::SlowMoInternals> slowmo_internals;
  if (options.slowmo()) {
    slowmo_internals =
        SlowMoInternalsOf(options, job.state()->session().options().node_id,
                          *job.timeouts().collective());
  }
  ddp::ReducerInternals internals;
  internals.collective_timeout =
      absl::Milliseconds(job.timeouts().collective()->count());
  auto created = create(Communicator(), job.authoritative_rank(), internals);
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
  if (slowmo_internals) StartSlowMo(*slowmo_internals);
}

void DdpCore::Impl::StartSlowMo(const slowmo::SlowMoInternals& internals) {
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
  auto made = slowmo::SlowMo::Create(
      engine->parameters(), buffers, Communicator(), job.authoritative_rank(),
      *options.slowmo(), internals, &job.state()->session());
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
  impl_->Init([&](auto comm, int authoritative, const auto& internals) {
    return ddp::Engine::Create(std::move(module), std::move(comm),
                               authoritative, options, internals);
  });
}

DdpCore::DdpCore(const torch::jit::Module& module, const Job& job,
                 const DdpOptions& options)
    : impl_(std::make_unique<Impl>(job, options)) {
  impl_->Register(module.type()->name() ? module.type()->name()->qualifiedName()
                                        : "torch::jit::Module");
  impl_->Init([&](auto comm, int authoritative, const auto& internals) {
    return ddp::Engine::Create(module, std::move(comm), authoritative, options,
                               internals);
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
