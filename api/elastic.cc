#include "concord/elastic.h"

#include <ATen/CPUGeneratorImpl.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <algorithm>
#include <numeric>
#include <optional>

#include "absl/strings/str_cat.h"
#include "api/internal.h"
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
  ElasticCore(DdpCore& ddp, torch::optim::Optimizer& optimizer,
              std::shared_ptr<SamplerState> sampler,
              const ElasticStateOptions& options)
      : ddp_(ddp.impl()),
        sampler_(std::move(sampler)),
        admit_workers_(options.admit_workers()),
        state_(&ddp_.job.state()->session(), ddp_.engine.get(), &optimizer,
               ElasticOptionsFrom(options)) {
    if (sampler_ != nullptr && sampler_->job.state() != ddp_.job.state()) {
      throw Error(ErrorCode::kInvalidArgument,
                  "ElasticState: the sampler belongs to another Job");
    }
    if (ddp_.begin_step) {
      throw Error(ErrorCode::kAlreadyExists,
                  "ElasticState: this DistributedDataParallel has one already");
    }
    // A re-form rebinds DDP, which drops its comm hook; the sampler goes on
    // from the authoritative rank's position; and the step the loop starts
    // again begins with the agreement, as a newcomer's first step does
    // (without it the survivors would skip the agreement a newcomer runs,
    // and their collectives would pair up wrongly).
    state_.OnReset([this](const elastic::ResetInfo& info) {
      ddp_.Rebound();
      ToSampler();
      ddp_.step_open = false;
      TraceReform(info.step);
      HistoryRestore();
    });
    // SlowMo's state follows the authoritative rank too, and a committed
    // step's owed average is finished in the new generation.
    if (ddp_.slowmo != nullptr) state_.Attach(ddp_.slowmo.get());
    ddp_.begin_step = [this] { BeginStep(); };
    ddp_.join = [this] { return Join(); };
  }
  ~ElasticCore() {
    ddp_.begin_step = nullptr;
    ddp_.join = nullptr;
  }

  elastic::State& state() { return state_; }

  void Commit() {
    const auto& history = ddp_.job.state()->session().history();
    std::optional<trace::CommitRecord> record;
    if (history) record = HistoryCommit();
    ++state_.step;
    if (sampler_ != nullptr) {
      sampler_->committed = sampler_->cursor;
      state_.position = static_cast<int64_t>(sampler_->cursor);
    }
    state_.Commit();
    if (record) history->Commit(*record);
    if (ddp_.step_open) ReportStep();
    ddp_.step_open = false;
  }

  void OnStepBegin(std::function<void(int64_t)> callback) {
    on_step_begin_ = std::move(callback);
  }

  const std::vector<ReformRecord>& ReformLog() {
    const auto& records = state_.reform_records();
    while (reform_log_.size() < records.size()) {
      const elastic::ReformRecord& r = records[reform_log_.size()];
      reform_log_.push_back(ReformRecord{r.reason, r.generation, r.world_size,
                                         r.started_us, r.rendezvous_us,
                                         r.synced_us});
    }
    return reform_log_;
  }

  void NextEpoch() {
    ++state_.epoch;
    state_.position = 0;
    ToSampler();
    state_.Commit();
    ddp_.step_open = false;
  }

  // The state's epoch and committed position, as the sampler's.
  void ToSampler() {
    if (sampler_ == nullptr) return;
    if (sampler_->epoch != state_.epoch) sampler_->order_epoch = -1;
    sampler_->epoch = state_.epoch;
    sampler_->committed = sampler_->cursor =
        static_cast<size_t>(std::max<int64_t>(state_.position, 0));
  }

  void OnReset(std::function<void(const ResetInfo&)> callback) {
    state_.OnReset(
        [callback = std::move(callback)](const elastic::ResetInfo& r) {
          ResetInfo info;
          info.generation = r.generation;
          info.rank = r.rank;
          info.world_size = r.world_size;
          info.previous_world_size = r.previous_world_size;
          info.step = r.step;
          info.reason = r.reason;
          callback(info);
        });
  }

  // run_elastic: the first Sync, then `train` under elastic::Run.
  void Run(const std::function<void()>& train) {
    ThrowIfError(state_.Sync());
    ToSampler();
    HistoryRestore();
    ThrowIfError(elastic::Run(state_, [&](elastic::State&) -> absl::Status {
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
          ddp_.step_open = true;
        }
      }
    }));
    // SGP's push-sum keeps parameters as numerators between steps: the
    // model the program saves is the de-biased one.
    if (ddp_.slowmo != nullptr) ddp_.slowmo->Debias();
  }

 private:
  static elastic::ElasticOptions ElasticOptionsFrom(
      const ElasticStateOptions& o) {
    elastic::ElasticOptions e;
    e.divide_by_initial_world_size = o.divide_by_initial_world_size();
    e.throw_on_early_termination = o.throw_on_early_termination();
    return e;
  }

  // Note [Step agreement]: before the first forward of a step. Workers are
  // admitted while the epoch has a sample left for each rank there could
  // be (else a newcomer's share of the last window would be empty).
  void BeginStep() {
    const int64_t reforms = state_.reforms();
    const bool admit =
        admit_workers_ &&
        (sampler_ == nullptr ||
         sampler_->size - sampler_->committed >=
             static_cast<size_t>(std::max(1, ddp_.job.max_workers())));
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
    if (const auto& trace = ddp_.job.state()->trace()) {
      trace->SetStep(state_.step + 1);
    }
    if (on_step_begin_) on_step_begin_(state_.step + 1);
    if (state_.reforms() != reforms && sampler_ != nullptr) throw Restart{};
  }

  // After a committed step: its timings for the coordinator's status (the
  // next heartbeat carries them) and its span on the timeline.
  void ReportStep() {
    const int64_t now = trace::NowMicros();
    const ddp::ReducerStats& stats = ddp_.engine->stats();
    v1::DdpTimings t;
    t.set_step_ms(static_cast<double>(now - step_start_us_) / 1e3);
    t.set_forward_ms(static_cast<double>(stats.forward_compute_us) / 1e3);
    t.set_backward_ms(static_cast<double>(stats.backward_compute_us) / 1e3);
    // Communication not hidden behind backward.
    t.set_allreduce_wait_ms(static_cast<double>(std::max<int64_t>(
                                0, stats.backward_comm_us - stats.overlap_us)) /
                            1e3);
    // After the gradients were written back: the optimizer step and what
    // the loop did before commit() (none when this step reduced nothing).
    if (stats.backward_done_unix_us >= step_start_us_) {
      t.set_optimizer_ms(
          static_cast<double>(now - stats.backward_done_unix_us) / 1e3);
    }
    t.set_buckets(static_cast<int32_t>(stats.bucket_bytes.size()));
    ddp_.job.state()->session().ReportDdpTimings(t);
    if (const auto& trace = ddp_.job.state()->trace()) {
      trace->Complete("step", trace::Recorder::kTrainThread, step_start_us_,
                      now, {{"step", state_.step}});
    }
  }

  // The re-form just done on the new rank's track: from the failure (or
  // the agreement) to the state received, the rendezvous inside it.
  void TraceReform(int64_t step) {
    const auto& trace = ddp_.job.state()->trace();
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

  // Note [History files]: the record of the step about to be committed
  // (state_.step + 1): its window, and the parameters after it.
  trace::CommitRecord HistoryCommit() const {
    const worker::Session& session = ddp_.job.state()->session();
    trace::CommitRecord r;
    r.generation = session.generation();
    r.rank = session.rank();
    r.world_size = session.world_size();
    r.step = state_.step + 1;
    r.epoch = state_.epoch;
    // SlowMo's workers hold different parameters between averages.
    r.replicated = ddp_.slowmo == nullptr;
    r.digest = ParameterDigest();
    if (sampler_ != nullptr) {
      std::vector<int64_t>& window = r.samples.emplace();
      if (sampler_->order_epoch == sampler_->epoch) {
        window.assign(sampler_->order.begin() +
                          static_cast<std::ptrdiff_t>(sampler_->committed),
                      sampler_->order.begin() +
                          static_cast<std::ptrdiff_t>(sampler_->cursor));
      }
    }
    return r;
  }

  // The state this worker goes on from (after the first Sync and every
  // re-form).
  void HistoryRestore() {
    const worker::Session& session = ddp_.job.state()->session();
    if (const auto& history = session.history()) {
      history->Restore(session.generation(), state_.step, state_.epoch,
                       ParameterDigest(), ddp_.slowmo == nullptr);
    }
  }

  // The bytes of every parameter, hashed (Note [History files]).
  uint64_t ParameterDigest() const {
    uint64_t digest = trace::kDigestSeed;
    for (const torch::Tensor& p : ddp_.engine->parameters()) {
      const torch::Tensor host = p.detach().to(torch::kCPU).contiguous();
      digest = trace::DigestBytes(digest, host.data_ptr(), host.nbytes());
    }
    return digest;
  }

  // DistributedDataParallelImpl::join: this rank's data is over.
  bool Join() {
    auto decision = state_.BeginStep(/*has_data=*/false, admit_workers_);
    ThrowIfError(decision.status());
    // kLeft: this rank left the job, the others go on without it; kDone:
    // every rank ran out, training is over everywhere.
    ddp_.joined = true;
    return *decision == elastic::StepDecision::kLeft;
  }

  DdpCore::Impl& ddp_;
  std::shared_ptr<SamplerState> sampler_;
  const bool admit_workers_;
  elastic::State state_;
  int64_t step_start_us_ = 0;  // the step's agreement done (Unix us)
  std::function<void(int64_t)> on_step_begin_;
  std::vector<ReformRecord> reform_log_;
};

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
  s.cursor = s.committed;
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
  return indices;
}

void ElasticSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("epoch", c10::IValue(state_->epoch));
  archive.write("position", c10::IValue(static_cast<int64_t>(state_->cursor)));
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
  state_->committed = state_->cursor = static_cast<size_t>(position.toInt());
}

int64_t ElasticSampler::epoch() const { return state_->epoch; }
size_t ElasticSampler::position() const { return state_->cursor; }
size_t ElasticSampler::size() const { return state_->size; }

std::vector<size_t> ElasticSampler::since_commit() const {
  const detail::SamplerState& s = *state_;
  std::vector<size_t> out;
  if (s.order_epoch != s.epoch) return out;  // nothing handed out yet
  for (size_t i = s.committed; i < s.cursor; ++i) {
    out.push_back(static_cast<size_t>(s.order[i]));
  }
  return out;
}

ElasticState::ElasticState(detail::DdpCore& ddp,
                           torch::optim::Optimizer& optimizer,
                           std::shared_ptr<detail::SamplerState> sampler,
                           const ElasticStateOptions& options)
    : core_(std::make_unique<detail::ElasticCore>(
          ddp, optimizer, std::move(sampler), options)) {}

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
