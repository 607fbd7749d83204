#include "concord/elastic.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <optional>

#include "absl/strings/str_cat.h"
#include "api/internal.h"
#include "common/job_ended.h"
#include "common/logging.h"
#include "worker/elastic/state.h"
#include "worker/error.h"

namespace concord {
namespace detail {
namespace {

// Thrown by the step agreement when it re-formed to admit workers: the
// loop starts over from the commit in the new generation. Not an
// std::exception, so that a program's catch of those does not take it.
struct Restart {};

}  // namespace

class ElasticCore {
 public:
  ElasticCore(const Job& job, const ElasticStateOptions& options)
      : job_(job),
        admit_workers_(options.admit_workers()),
        state_(&job.state()->session(), Checked(options)) {
    JobState& js = *job_.state();
    if (js.elastic != nullptr) {
      throw Error(ErrorCode::kAlreadyExists,
                  "ElasticState: this job has one already");
    }
    // A re-form rebinds every module, which drops its comm hook; the
    // sampler goes on from the authoritative rank's position; and the step
    // the loop starts again begins with the agreement, as a newcomer's
    // first step does (without it the survivors would skip the agreement a
    // newcomer runs, and their collectives would pair up wrongly).
    state_.OnReset([this](const elastic::ResetInfo& info) {
      for (DdpCore::Impl* m : models_) m->Rebound();
      ToSampler();
      job_.state()->step_open = false;
      TraceReform(info.step);
      HistoryRestore();
    });
    js.elastic = this;
    js.step_open = false;
  }
  ~ElasticCore() {
    JobState& js = *job_.state();
    js.elastic = nullptr;
    js.step_open = false;
  }

  elastic::State& state() { return state_; }
  const elastic::State& state() const { return state_; }

  void AddModel(const std::string& name, DdpCore::Impl& ddp) {
    CheckAdd(name, "a DistributedDataParallel");
    if (ddp.job.state() != job_.state()) {
      throw Error(ErrorCode::kInvalidArgument,
                  absl::StrCat("ElasticState::add('", name,
                               "'): the module belongs to another Job"));
    }
    for (const DdpCore::Impl* other : job_.state()->ddps) {
      if (other != &ddp && other->name == name) {
        throw Error(ErrorCode::kAlreadyExists,
                    absl::StrCat("ElasticState::add('", name,
                                 "'): another module has that name"));
      }
    }
    ddp.name = name;
  }

  void AddOptimizer(const std::string& name,
                    torch::optim::Optimizer& optimizer) {
    CheckAdd(name, "an optimizer");
    for (const auto& [other, o] : optimizers_) {
      if (other == name) {
        throw Error(ErrorCode::kAlreadyExists,
                    absl::StrCat("ElasticState::add('", name,
                                 "'): another optimizer has that name"));
      }
      if (o == &optimizer) {
        throw Error(
            ErrorCode::kAlreadyExists,
            absl::StrCat("ElasticState::add('", name,
                         "'): the optimizer was added as '", other, "'"));
      }
    }
    optimizers_.emplace_back(name, &optimizer);
  }

  // See Note [Each rank's randomness] in worker/checkpoint/content.h.
  void AddGenerator(const std::string& name, at::Generator generator) {
    CheckAdd(name, "a generator");
    if (absl::Status s = state_.AddGenerator(name, std::move(generator));
        !s.ok()) {
      throw Error(
          ErrorCode::kInvalidArgument,
          absl::StrCat("ElasticState::add('", name, "'): ", s.message()));
    }
  }

  void SetSampler(std::shared_ptr<SamplerState> sampler) {
    CheckAdd("sampler", "a sampler");
    if (sampler_ != nullptr) {
      throw Error(ErrorCode::kAlreadyExists,
                  "ElasticState::add: the state has a sampler already");
    }
    if (sampler->job.state() != job_.state()) {
      throw Error(ErrorCode::kInvalidArgument,
                  "ElasticState: the sampler belongs to another Job");
    }
    sampler_ = std::move(sampler);
  }

  void Commit() {
    const auto& history = job_.state()->session().history();
    std::optional<trace::CommitRecord> record;
    if (history) record = HistoryCommit();
    ++state_.step;
    if (sampler_ != nullptr) {
      sampler_->committed = sampler_->Consumed();
      state_.position = static_cast<int64_t>(sampler_->committed);
    }
    state_.Commit();
    if (record) history->Commit(*record);
    JobState& js = *job_.state();
    if (js.step_open) ReportStep();
    js.step_open = false;
  }

  void OnStepBegin(std::function<void(int64_t)> callback) {
    on_step_begin_ = std::move(callback);
  }

  const std::vector<ReformRecord>& ReformLog() const {
    return state_.reform_records();
  }

  void NextEpoch() {
    ++state_.epoch;
    state_.position = 0;
    ToSampler();
    state_.Commit();
    job_.state()->step_open = false;
  }

  // The state's epoch and committed position, as the sampler's.
  void ToSampler() {
    if (sampler_ == nullptr) return;
    if (sampler_->epoch != state_.epoch) sampler_->order_epoch = -1;
    sampler_->epoch = state_.epoch;
    sampler_->Rewind(
        static_cast<size_t>(std::max<int64_t>(state_.position, 0)));
  }

  void OnReset(std::function<void(const ResetInfo&)> callback) {
    state_.OnReset(std::move(callback));
  }

  // run_elastic: the job's modules and the state's optimizers into the
  // elastic state, the first Sync, then `train` under elastic::Run.
  void Run(const std::function<void()>& train) {
    if (running_) {
      throw Error(ErrorCode::kFailedPrecondition,
                  "run_elastic: the state runs already (call it once)");
    }
    Start();
    ThrowIfError(state_.Sync());
    ToSampler();
    HistoryRestore();
    absl::Status done =
        elastic::Run(state_, [&](elastic::State&) -> absl::Status {
          for (;;) {
            try {
              train();
              return absl::OkStatus();
            } catch (const Restart&) {
              // The agreement re-formed (admitted workers): its Sync and the
              // reset callback already put the state and the sampler at the
              // commit. The agreement of this step already ran in the new
              // generation (with the newcomers' first one): the loop starts
              // over without another.
              job_.state()->step_open = true;
            }
          }
        });
    if (!done.ok()) {
      // Taken out (hung, stopped) and back after the end: nothing to do.
      ExitIfJobSucceeded(done, job_.state()->session().options().worker_id);
      // The job's status says why (a re-form loop, a failed rendezvous).
      job_.state()->Finish(false, std::string(done.message()));
      ThrowIfError(done);
    }
    // See Note [Checkpoints]: the job's final state is its newest checkpoint.
    state_.SaveFinal();
    // SGP's push-sum keeps parameters as numerators between steps: the
    // model the program saves is the de-biased one.
    for (DdpCore::Impl* m : models_) {
      if (m->slowmo != nullptr) m->slowmo->Debias();
    }
  }

  // See Note [Step agreement]: before the first forward of a step. Workers are
  // admitted while the epoch has a sample left for each rank there could
  // be (else a newcomer's share of the last window would be empty).
  void BeginStep() {
    if (!running_) {
      throw Error(ErrorCode::kFailedPrecondition,
                  "forward of a module of an ElasticState outside run_elastic");
    }
    const int64_t reforms = state_.reforms();
    const bool admit =
        admit_workers_ &&
        (sampler_ == nullptr ||
         sampler_->size - sampler_->committed >=
             static_cast<size_t>(std::max(1, job_.max_workers())));
    auto decision = state_.BeginStep(/*has_data=*/true, admit);
    ThrowIfError(decision.status());
    if (*decision != elastic::StepDecision::kRun) {
      throw Error(ErrorCode::kInternal,
                  "step agreement: a rank without data in run_elastic");
    }
    // The agreement re-formed (workers admitted, or ranks that ran out of
    // data left). The batch an ElasticSampler handed out for this step was
    // the old world's share: the loop starts over from the commit. A loop
    // over the rank's own data goes on with its batch (PyTorch's join: each
    // rank's inputs are its own).
    step_start_us_ = trace::NowMicros();
    if (const auto& trace = job_.state()->trace()) {
      trace->SetStep(state_.step + 1);
    }
    if (on_step_begin_) on_step_begin_(state_.step + 1);
    if (state_.reforms() != reforms && sampler_ != nullptr) throw Restart{};
  }

  // DistributedDataParallelImpl::join: this rank's data is over.
  bool Join() {
    auto decision = state_.BeginStep(/*has_data=*/false, admit_workers_);
    ThrowIfError(decision.status());
    // kLeft: this rank left the job, the others go on without it; kDone:
    // every rank ran out, training is over everywhere.
    job_.state()->joined = true;
    return *decision == elastic::StepDecision::kLeft;
  }

 private:
  // The options as given, once checked.
  static const ElasticStateOptions& Checked(const ElasticStateOptions& o) {
    if (o.max_repeated_failures() < 1) {
      throw Error(ErrorCode::kInvalidArgument,
                  absl::StrCat("ElasticStateOptions::max_repeated_failures: "
                               "must be at least 1, got ",
                               o.max_repeated_failures()));
    }
    return o;
  }

  void CheckAdd(const std::string& name, const char* what) const {
    if (running_) {
      throw Error(ErrorCode::kFailedPrecondition,
                  absl::StrCat("ElasticState::add: ", what,
                               " after run_elastic started"));
    }
    if (name.empty()) {
      throw Error(ErrorCode::kInvalidArgument,
                  absl::StrCat("ElasticState::add: ", what, " needs a name"));
    }
  }

  // See Note [Several models]: the job's modules as of now, in the order they
  // were made (a newcomer makes them in that order: its Creates meet the
  // survivors' Rebinds), and the optimizers in the order added.
  void Start() {
    models_ = job_.state()->ddps;
    for (DdpCore::Impl* m : models_) state_.AddModel(m->name, m->engine.get());
    for (const auto& [name, optimizer] : optimizers_) {
      // See Note [Elastic ZeRO] in api/zero.cc: sharded state is a
      // participant's, not the authoritative rank's to send.
      if (auto* zero = dynamic_cast<ZeroRedundancyOptimizer*>(optimizer)) {
        state_.Attach(ZeroParticipant(*zero, name), zero,
                      absl::StrCat("zero/", name));
      } else {
        state_.AddOptimizer(name, optimizer);
      }
    }
    for (DdpCore::Impl* m : models_) {
      torch::optim::Optimizer* owner = OptimizerOf(*m);
      if (m->slowmo != nullptr &&
          dynamic_cast<ZeroRedundancyOptimizer*>(owner) != nullptr) {
        throw Error(ErrorCode::kFailedPrecondition,
                    absl::StrCat("run_elastic: ", m->Describe(),
                                 " runs SlowMo, whose optimizer must be an "
                                 "unsharded one, not a "
                                 "ZeroRedundancyOptimizer"));
      }
      if (m->slowmo != nullptr) {
        if (owner == nullptr) {
          throw Error(ErrorCode::kFailedPrecondition,
                      absl::StrCat("run_elastic: ", m->Describe(),
                                   " runs SlowMo, and no optimizer of the "
                                   "ElasticState steps its parameters (add "
                                   "it)"));
        }
        // SlowMo's state follows the authoritative rank too, and a
        // committed step's owed average is finished in the new generation.
        state_.Attach(m->slowmo.get(), owner, absl::StrCat("slowmo/", m->name));
      } else if (m->powersgd_participant != nullptr && owner != nullptr) {
        // See Note [PowerSGD across re-forms].
        state_.Attach(m->powersgd_participant.get(), owner,
                      absl::StrCat("powersgd/", m->name));
        m->powersgd_attached = true;
      } else if (owner == nullptr) {
        Log()->warn(
            "run_elastic: no optimizer of the ElasticState steps the "
            "parameters of {}: a newcomer starts that optimizer from "
            "nothing (ElasticState::add it)",
            m->Describe());
      }
    }
    running_ = true;
  }

  // The state's optimizer that holds the module's first parameter.
  torch::optim::Optimizer* OptimizerOf(const DdpCore::Impl& m) const {
    const auto& params = m.engine->parameters();
    if (params.empty()) return nullptr;
    for (const auto& [name, optimizer] : optimizers_) {
      for (const auto& group : optimizer->param_groups()) {
        for (const torch::Tensor& p : group.params()) {
          if (p.is_same(params.front())) return optimizer;
        }
      }
    }
    return nullptr;
  }

  // After a committed step: its timings for the coordinator's status (the
  // next heartbeat carries them) and its span on the timeline. The first
  // module's reducer speaks for the step.
  void ReportStep() {
    const int64_t now = trace::NowMicros();
    v1::DdpTimings t;
    t.set_step_ms(static_cast<double>(now - step_start_us_) / 1e3);
    if (!models_.empty()) {
      const ddp::ReducerStats& stats = models_.front()->engine->stats();
      t.set_forward_ms(static_cast<double>(stats.forward_compute_us) / 1e3);
      t.set_backward_ms(static_cast<double>(stats.backward_compute_us) / 1e3);
      // Communication not hidden behind backward.
      t.set_allreduce_wait_ms(
          static_cast<double>(
              std::max<int64_t>(0, stats.backward_comm_us - stats.overlap_us)) /
          1e3);
      // After the gradients were written back: the optimizer step and what
      // the loop did before commit() (none when this step reduced nothing).
      if (stats.backward_done_unix_us >= step_start_us_) {
        t.set_optimizer_ms(
            static_cast<double>(now - stats.backward_done_unix_us) / 1e3);
      }
      int32_t buckets = 0;
      for (const DdpCore::Impl* m : models_) {
        buckets += static_cast<int32_t>(m->engine->stats().bucket_bytes.size());
      }
      t.set_buckets(buckets);
    }
    job_.state()->session().ReportDdpTimings(t);
    if (const auto& trace = job_.state()->trace()) {
      trace->Complete("step", trace::Recorder::kTrainThread, step_start_us_,
                      now, {{"step", state_.step}});
    }
  }

  // The re-form just done on the new rank's track: from the failure (or
  // the agreement) to the state received, the rendezvous inside it.
  void TraceReform(int64_t step) {
    const auto& trace = job_.state()->trace();
    if (!trace || state_.reform_records().empty()) return;
    const elastic::ReformRecord& r = state_.reform_records().back();
    const trace::Args args = {{"generation", r.generation},
                              {"world_size", r.world_size},
                              {"step", step}};
    trace->Complete("re-form", trace::Recorder::kTrainThread, r.started_us,
                    r.synced_us, args);
    trace->Complete("rendezvous", trace::Recorder::kTrainThread, r.started_us,
                    r.rendezvous_us, args);
  }

  // See Note [History files]: the record of the step about to be committed
  // (state_.step + 1): its window, and the parameters after it.
  trace::CommitRecord HistoryCommit() const {
    const worker::Session& session = job_.state()->session();
    trace::CommitRecord r;
    r.generation = session.generation();
    r.rank = session.rank();
    r.world_size = session.world_size();
    r.step = state_.step + 1;
    r.epoch = state_.epoch;
    // SlowMo's workers hold different parameters between averages.
    r.replicated = std::none_of(
        models_.begin(), models_.end(),
        [](const DdpCore::Impl* m) { return m->slowmo != nullptr; });
    r.digest = ParameterDigest();
    if (sampler_ != nullptr) {
      std::vector<int64_t>& window = r.samples.emplace();
      if (sampler_->order_epoch == sampler_->epoch) {
        window.assign(sampler_->order.begin() +
                          static_cast<std::ptrdiff_t>(sampler_->committed),
                      sampler_->order.begin() +
                          static_cast<std::ptrdiff_t>(sampler_->Consumed()));
      }
    }
    return r;
  }

  // The state this worker goes on from (after the first Sync and every
  // re-form).
  void HistoryRestore() {
    const worker::Session& session = job_.state()->session();
    const std::optional<elastic::State::Resumed> resumed = state_.TakeResumed();
    if (const auto& history = session.history()) {
      const bool replicated = std::none_of(
          models_.begin(), models_.end(),
          [](const DdpCore::Impl* m) { return m->slowmo != nullptr; });
      const uint64_t digest = ParameterDigest();
      if (resumed) {
        history->Resume(session.generation(), resumed->step, resumed->source,
                        digest, replicated);
      }
      history->Restore(session.generation(), state_.step, state_.epoch, digest,
                       replicated);
    }
  }

  // The bytes of every parameter of every module, hashed (see Note [History
  // files]).
  uint64_t ParameterDigest() const {
    uint64_t digest = trace::kDigestSeed;
    for (const DdpCore::Impl* m : models_) {
      for (const torch::Tensor& p : m->engine->parameters()) {
        const torch::Tensor host = p.detach().to(torch::kCPU).contiguous();
        digest = trace::DigestBytes(digest, host.data_ptr(), host.nbytes());
      }
    }
    return digest;
  }

  Job job_;
  const bool admit_workers_;
  elastic::State state_;
  std::vector<std::pair<std::string, torch::optim::Optimizer*>> optimizers_;
  std::shared_ptr<SamplerState> sampler_;
  // See Note [Several models]: the job's modules when run_elastic started.
  std::vector<DdpCore::Impl*> models_;
  bool running_ = false;
  int64_t step_start_us_ = 0;  // the step's agreement done (Unix us)
  std::function<void(int64_t)> on_step_begin_;
};

void ExitIfJobSucceeded(const absl::Status& status,
                        const std::string& worker_id) {
  if (!IsJobSucceeded(status)) return;
  // One line, then out: the stack's objects (the session's threads) are not
  // unwound, as for a worker the launcher ends.
  Log()->flush();
  std::fprintf(stderr,
               "concord: worker %s was out when its job ended (%s): "
               "nothing left to do, exiting\n",
               worker_id.c_str(), std::string(status.message()).c_str());
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(0);
}

int64_t ElasticStep(const ElasticCore& elastic) {
  return elastic.state().step + 1;
}
void ObserveCollective(ElasticCore& elastic) {
  elastic.state().ObserveCollective();
}
void BeginElasticStep(ElasticCore& elastic) { elastic.BeginStep(); }
bool JoinElastic(ElasticCore& elastic) { return elastic.Join(); }

}  // namespace detail

ElasticSampler::ElasticSampler(size_t dataset_size, const Job& job,
                               const ElasticSamplerOptions& options)
    : state_(
          std::make_shared<detail::SamplerState>(dataset_size, options, job)) {}

void ElasticSampler::reset(c10::optional<size_t> new_size) {
  detail::SamplerState& s = *state_;
  if (new_size.has_value() && *new_size != s.size) {
    s.size = *new_size;
    s.order_epoch = -1;
    s.committed = 0;
  }
  s.Rewind(s.committed);
}

c10::optional<std::vector<size_t>> ElasticSampler::next(size_t batch_size) {
  detail::SamplerState& s = *state_;
  if (s.cursor >= s.size || batch_size == 0) return c10::nullopt;
  if (s.order_epoch != s.epoch) {
    s.order.resize(s.size);
    if (s.options.shuffle()) {
      // PyTorch's DistributedSampler: randperm with seed + epoch.
      auto gen = at::make_generator<at::CPUGeneratorImpl>(
          s.options.seed() + static_cast<uint64_t>(s.epoch));
      torch::Tensor perm =
          torch::randperm(static_cast<int64_t>(s.size), gen, torch::kLong);
      std::copy(perm.data_ptr<int64_t>(), perm.data_ptr<int64_t>() + s.size,
                s.order.begin());
    } else {
      std::iota(s.order.begin(), s.order.end(), int64_t{0});
    }
    s.order_epoch = s.epoch;
  }
  const size_t world = static_cast<size_t>(s.job.world_size());
  const size_t rank = static_cast<size_t>(s.job.rank());
  const size_t remaining = s.size - s.cursor;
  size_t take = std::min(world * batch_size, remaining);
  if (remaining - take < world) take = remaining;  // the tail joins in
  std::vector<size_t> indices;
  for (size_t i = rank; i < take; i += world) {
    indices.push_back(static_cast<size_t>(s.order[s.cursor + i]));
  }
  s.cursor += take;
  if (s.tracked) s.ahead.push_back(s.cursor);
  return indices;
}

void ElasticSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("epoch", c10::IValue(state_->epoch));
  archive.write("position",
                c10::IValue(static_cast<int64_t>(state_->Consumed())));
  archive.write("size", c10::IValue(static_cast<int64_t>(state_->size)));
}

void ElasticSampler::load(torch::serialize::InputArchive& archive) {
  c10::IValue epoch, position, size;
  archive.read("epoch", epoch);
  archive.read("position", position);
  archive.read("size", size);
  if (size.toInt() != static_cast<int64_t>(state_->size) ||
      position.toInt() < 0 || position.toInt() > size.toInt()) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("ElasticSampler::load: saved for ", size.toInt(),
                             " samples at position ", position.toInt(),
                             ", this one has ", state_->size));
  }
  state_->epoch = epoch.toInt();
  state_->order_epoch = -1;
  state_->Rewind(static_cast<size_t>(position.toInt()));
}

void ElasticSampler::track_loader() {
  state_->tracked = true;
  state_->Rewind(state_->committed);
}

void ElasticSampler::window_taken() {
  detail::SamplerState& s = *state_;
  if (s.ahead.empty()) return;
  s.taken = s.ahead.front();
  s.ahead.pop_front();
}

int64_t ElasticSampler::epoch() const { return state_->epoch; }
size_t ElasticSampler::position() const { return state_->Consumed(); }
size_t ElasticSampler::size() const { return state_->size; }

std::vector<size_t> ElasticSampler::since_commit() const {
  const detail::SamplerState& s = *state_;
  std::vector<size_t> out;
  if (s.order_epoch != s.epoch) return out;  // nothing handed out yet
  for (size_t i = s.committed; i < s.Consumed(); ++i) {
    out.push_back(static_cast<size_t>(s.order[i]));
  }
  return out;
}

ElasticState::ElasticState(const Job& job, const ElasticStateOptions& options)
    : core_(std::make_unique<detail::ElasticCore>(job, options)) {}

ElasticState& ElasticState::add_module(const std::string& name,
                                       detail::DdpCore& ddp) {
  core_->AddModel(name, ddp.impl());
  return *this;
}

ElasticState& ElasticState::add(const std::string& name,
                                torch::optim::Optimizer& optimizer) {
  core_->AddOptimizer(name, optimizer);
  return *this;
}

ElasticState& ElasticState::add(const std::string& name,
                                at::Generator generator) {
  core_->AddGenerator(name, std::move(generator));
  return *this;
}

ElasticState& ElasticState::add(const ElasticSampler& sampler) {
  core_->SetSampler(sampler.state());
  return *this;
}

ElasticState::~ElasticState() = default;

int64_t ElasticState::step() const { return core_->state().step; }
int64_t ElasticState::epoch() const { return core_->state().epoch; }
std::map<std::string, torch::Tensor>& ElasticState::values() {
  return core_->state().values;
}
void ElasticState::commit() { core_->Commit(); }
void ElasticState::next_epoch() { core_->NextEpoch(); }
void ElasticState::on_reset(std::function<void(const ResetInfo&)> callback) {
  core_->OnReset(std::move(callback));
}
void ElasticState::on_step_begin(std::function<void(int64_t)> callback) {
  core_->OnStepBegin(std::move(callback));
}
int64_t ElasticState::reforms() const { return core_->state().reforms(); }
const std::vector<ReformRecord>& ElasticState::reform_log() const {
  return core_->ReformLog();
}

void run_elastic(ElasticState& state, const std::function<void()>& train) {
  state.core().Run(train);
}

}  // namespace concord
