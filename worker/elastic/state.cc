#include "worker/elastic/state.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <optional>
#include <sstream>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/environment.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/comm/coalesced.h"
#include "worker/error.h"

namespace concord::elastic {
namespace {

absl::Status Annotate(const absl::Status& s, const std::string& what) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

int64_t ReadInt(torch::serialize::InputArchive& archive, const char* key) {
  c10::IValue v;
  if (!archive.try_read(key, v) || !v.isInt()) {
    throw std::runtime_error(absl::StrCat("missing '", key, "'"));
  }
  return v.toInt();
}

// Every rank's `mine` (the same length on each), one row per rank.
absl::StatusOr<torch::Tensor> AllgatherInts(
    comm::Communicator& comm, const std::vector<int64_t>& mine,
    const comm::CollectiveOptions& opts) {
  torch::Tensor in = torch::tensor(mine, torch::kLong);
  torch::Tensor out = torch::empty({comm.size(), in.numel()}, torch::kLong);
  CONCORD_RETURN_IF_ERROR(comm.Allgather(out, in, opts)->Wait());
  return out;
}

}  // namespace

State::State(worker::Session* session, concord::ElasticStateOptions options)
    : session_(session), options_(options), random_(session->torch_device()) {
  options_.max_repeated_failures(std::max(1, options_.max_repeated_failures()));
}

State::State(worker::Session* session, ddp::Engine* ddp,
             torch::optim::Optimizer* optimizer,
             concord::ElasticStateOptions options)
    : State(session, options) {
  AddModel("model", ddp);
  AddOptimizer("optimizer", optimizer);
}

State::~State() {
  self_.reset();
  FenceCheckpoint();
}

void State::AddModel(const std::string& name, ddp::Engine* ddp) {
  models_.push_back(Model{name, ddp});
  for (const auto& b : ddp->AllBuffers()) {
    buffers_.push_back(b);
    committed_.buffers.push_back(b.clone());
  }
  // See Note [Elastic step]: an optimizer may step only once the step's
  // collectives are known to have succeeded.
  ddp->SetBlockingWait(true);
  // See Note [Overlapped snapshots]: nothing writes a parameter before its
  // gradient exists.
  ddp->SetGradientObserver([self = std::weak_ptr<State*>(self_)] {
    if (const std::shared_ptr<State*> state = self.lock()) {
      (*state)->FenceCheckpoint();
    }
  });
}

void State::AddOptimizer(const std::string& name,
                         torch::optim::Optimizer* optimizer) {
  Optimizer o;
  o.name = name;
  o.optimizer = optimizer;
  optimizers_.push_back(std::move(o));
}

void State::Attach(Participant* participant, torch::optim::Optimizer* optimizer,
                   const std::string& name) {
  participants_.push_back(Attached{participant, optimizer, name, {}});
}

absl::Status State::AddGenerator(const std::string& name,
                                 at::Generator generator) {
  return random_.Add(name, std::move(generator));
}

void State::OnReset(std::function<void(const ResetInfo&)> callback) {
  callbacks_.push_back(std::move(callback));
}

void State::Watch::Start(const torch::optim::Optimizer& optimizer) {
  signature = checkpoint::OptimizerSnapshot::Signature(optimizer);
  early_this_step = false;
}

bool State::Watch::Changed(const torch::optim::Optimizer& optimizer) const {
  return checkpoint::OptimizerSnapshot::Signature(optimizer) != signature;
}

bool State::Watch::Observe(const torch::optim::Optimizer& optimizer) {
  if (early_this_step || !Changed(optimizer)) return false;
  early_this_step = true;
  if (timing == Timing::kEarly) return false;
  timing = Timing::kEarly;
  return true;
}

void State::Watch::Commit(const torch::optim::Optimizer& optimizer) {
  if (timing == Timing::kUnseen && !early_this_step && Changed(optimizer)) {
    timing = Timing::kLate;
  }
}

void State::StartStep() {
  for (Optimizer& o : optimizers_) {
    o.watch.Start(*o.optimizer);
    o.copied = o.watch.timing != Timing::kLate;
    if (o.copied) o.copy.Take(*o.optimizer);
  }
  for (Attached& a : participants_) {
    if (a.optimizer != nullptr) a.watch.Start(*a.optimizer);
    a.participant->BeginStep(step, a.watch.timing == Timing::kLate);
  }
  in_step_ = true;
}

void State::ObserveCollective() {
  if (!in_step_) return;
  for (Optimizer& o : optimizers_) {
    if (o.watch.Observe(*o.optimizer)) {
      Log()->debug(
          "optimizer '{}' steps before a later collective of step {}: it is "
          "copied at the start of every step from now on",
          o.name, step + 1);
    }
  }
  for (Attached& a : participants_) {
    if (a.optimizer != nullptr) a.watch.Observe(*a.optimizer);
  }
}

void State::Commit() { CommitState(/*may_checkpoint=*/true); }

void State::CommitState(bool may_checkpoint) {
  if (in_step_) {
    for (Optimizer& o : optimizers_) o.watch.Commit(*o.optimizer);
    for (Attached& a : participants_) {
      if (a.optimizer != nullptr) a.watch.Commit(*a.optimizer);
    }
    in_step_ = false;
  }
  committed_.step = step;
  committed_.epoch = epoch;
  committed_.position = position;
  committed_.values.clear();
  for (const auto& [name, v] : values) committed_.values[name] = v.clone();
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < buffers_.size(); ++i) {
    committed_.buffers[i].copy_(buffers_[i]);
  }
  // See Note [Each rank's randomness].
  committed_.random = random_.Capture();
  session_->ReportCommittedStep(step);
  // See Note [Checkpoints]: once per step (next_epoch commits the same step
  // again), never for the state a Sync just took.
  if (checkpointer_ != nullptr) {
    if (may_checkpoint && step != checkpointed_step_ &&
        checkpointer_->Due(step)) {
      // See Note [Participants in checkpoints]: after their update.
      if (participants_.empty()) {
        TakeCheckpoint(/*wait=*/false);
      } else {
        deferred_ = session_->generation();
      }
    } else if (may_checkpoint && step > 0 && !region_prepared_) {
      // The region made now, off the step that takes the first checkpoint
      // (its optimizers have their state by now).
      region_prepared_ = true;
      checkpointer_->Prepare(Capture(RandomnessPlaceholder()));
    }
    checkpointed_step_ = step;
  }
}

void State::SaveFinal() {
  // The final state, whatever the last checkpoint holds (the due one of
  // this step may have been skipped, or taken before next_epoch moved the
  // epoch on): the same on every run that trained the same steps.
  deferred_.reset();
  // A rank that left is in no generation to gather with.
  if (checkpointer_ == nullptr || step == 0 || left_) return;
  // Every rank takes part (the ranks' generators are gathered: see Note
  // [Each rank's randomness]); a writer whose last snapshot is this state
  // writes nothing. See Note [Writes from the worker]: without a node agent,
  // it is on disk (and told) before the worker leaves.
  TakeCheckpoint(/*wait=*/true);
  checkpointer_->Flush();
}

void State::TakeCheckpoint(bool wait) {
  worker::Session::Busy busy(session_, "checkpoint");
  absl::StatusOr<NamedTensors> random = GatherRandomness();
  if (!random.ok()) {
    Log()->warn(
        "checkpoint of step {} not taken: gathering the ranks' random "
        "generators: {}",
        committed_.step, std::string(random.status().message()));
    return;
  }
  NamedTensors gathered = *std::move(random);
  for (const Attached& a : participants_) {
    absl::StatusOr<NamedTensors> part =
        a.participant->CheckpointState(*a.optimizer);
    if (!part.ok()) {
      Log()->warn("checkpoint of step {} not taken: gathering {}: {}",
                  committed_.step, a.name,
                  std::string(part.status().message()));
      return;
    }
    for (auto& [key, t] : *part) {
      gathered.emplace_back(absl::StrCat(a.name, "/", key), std::move(t));
    }
  }
  std::vector<checkpoint::OptimizerContent> sharded;
  for (const Attached& a : participants_) {
    if (a.participant->OptimizerName().empty()) continue;
    absl::StatusOr<checkpoint::OptimizerContent> whole =
        a.participant->CheckpointOptimizer(placement_);
    if (!whole.ok()) {
      Log()->warn("checkpoint of step {} not taken: gathering {}: {}",
                  committed_.step, a.participant->OptimizerName(),
                  std::string(whole.status().message()));
      return;
    }
    sharded.push_back(*std::move(whole));
  }
  // See Note [Shards copied where they are]: every rank goes on to
  // PlaceShards, whether its writer saves or not.
  const bool in_place = !sharded.empty() && placement_.AnyInPlace();
  checkpointer_->Fence();  // the last one counted in last_saved
  const checkpoint::Counters& last = checkpointer_->last_saved();
  checkpoint::Content content;
  if (last.step == committed_.step && last.epoch == committed_.epoch &&
      last.position == committed_.position) {
    // SaveFinal: this is the newest already.
    if (in_place) PlaceShards(content, /*saved=*/false);
    return;
  }
  // See Note [Participants in checkpoints].
  for (const Attached& a : participants_) {
    if (divergence_said_ || session_->rank() != 0) break;
    const std::string why = a.participant->CheckpointDivergence(*a.optimizer);
    if (why.empty()) continue;
    divergence_said_ = true;
    Log()->warn(
        "checkpoint of step {}: {}: it holds one rank's, so a resume from it "
        "goes on as after a re-form, not as this run does (said once)",
        committed_.step, why);
  }
  content = Capture(std::move(gathered), std::move(sharded));
  // See Note [Overlapped snapshots]: parameters and optimizer state may be
  // copied while the next step's forward runs.
  std::vector<torch::Tensor> deferred;
  if (checkpointer_->config().overlap) {
    for (const Model& m : models_) {
      const auto& params = m.engine->parameters();
      deferred.insert(deferred.end(), params.begin(), params.end());
    }
    for (const checkpoint::OptimizerContent& o : content.optimizers) {
      for (const auto& [index, tensors] : o.state) {
        for (const auto& [name, t] : tensors) deferred.push_back(t);
      }
    }
  }
  checkpointer_->Save(content, wait, deferred);
  if (in_place) PlaceShards(content, /*saved=*/true);
}

void State::PlaceShards(checkpoint::Content& content, bool saved) {
  using Holes = checkpoint::Checkpointer::HoleState;
  std::shared_ptr<comm::Communicator> comm = session_->shared_communicator();
  comm::CollectiveOptions opts;
  opts.timeout = session_->options().collective_timeout;
  const int me = comm->rank();
  const auto r = static_cast<size_t>(me);
  const bool writer = placement_.writer_of[r] == me;
  const Holes holes = saved ? checkpointer_->holes() : Holes::kSkipped;
  // What each writer did with its snapshot.
  std::string did;
  if (writer) {
    did = holes == Holes::kLaidOut
              ? absl::StrCat("laid ", ::getpid(), " ", committed_.step)
          : holes == Holes::kFailed ? "failed"
                                    : "skipped";
  }
  const auto fail = [&](const absl::Status& s) {
    Log()->warn("checkpoint of step {}: copying the shards: {}",
                committed_.step, std::string(s.message()));
    if (writer) checkpointer_->Filled(s);
  };
  absl::StatusOr<std::vector<std::string>> writers_did =
      comm::AllgatherStrings(*comm, did, opts);
  if (!writers_did.ok()) return fail(writers_did.status());
  // This rank's shard into its node's snapshot.
  std::string filled;
  int64_t step = 0;
  int32_t pid = 0;
  const std::string& mine =
      (*writers_did)[static_cast<size_t>(placement_.writer_of[r])];
  if (!writer && placement_.in_place[r] &&
      std::sscanf(mine.c_str(), "laid %d %" SCNd64, &pid, &step) == 2) {
    absl::StatusOr<checkpoint::Content> laid =
        checkpointer_->LaidOut(step, pid);
    absl::Status s = laid.status();
    for (const Attached& a : participants_) {
      if (!s.ok()) break;
      if (!a.participant->OptimizerName().empty()) {
        s = a.participant->FillShard(*laid);
      }
    }
    if (!s.ok()) filled = absl::StrCat("rank ", me, ": ", s.message());
  }
  absl::StatusOr<std::vector<std::string>> fills =
      comm::AllgatherStrings(*comm, filled, opts);
  if (!fills.ok()) return fail(fills.status());
  if (writer && holes == Holes::kLaidOut) {
    absl::Status all = absl::OkStatus();
    std::vector<int> ranks;
    for (size_t p = 0; p < fills->size(); ++p) {
      if (placement_.writer_of[p] != me || p == r) continue;
      ranks.push_back(static_cast<int>(p));
      if (all.ok() && !(*fills)[p].empty()) {
        all = absl::InternalError((*fills)[p]);
      }
    }
    if (all.ok() && !in_place_said_) {
      in_place_said_ = true;
      Log()->info(
          "checkpoint of step {}: ranks {} copied their optimizer shards into "
          "this node's snapshot themselves (said once)",
          committed_.step, absl::StrJoin(ranks, ","));
    }
    checkpointer_->Filled(all);
  }
  // See Note [Writes from the worker]: a writer whose memory stage failed
  // gets its node's shards as bytes after all, and writes to disk itself.
  ShardPlacement bytes = placement_;
  bytes.writers.clear();
  for (int w : placement_.writers) {
    if ((*writers_did)[static_cast<size_t>(w)] == "failed") {
      bytes.writers.push_back(w);
    }
  }
  if (bytes.writers.empty()) return;
  std::fill(bytes.in_place.begin(), bytes.in_place.end(), false);
  for (const Attached& a : participants_) {
    const std::string name = a.participant->OptimizerName();
    if (name.empty()) continue;
    absl::StatusOr<checkpoint::OptimizerContent> whole =
        a.participant->CheckpointOptimizer(bytes);
    if (!whole.ok()) return fail(whole.status());
    for (checkpoint::OptimizerContent& o : content.optimizers) {
      if (o.name == name) o = *whole;
    }
  }
  if (writer && holes == Holes::kFailed) checkpointer_->WriteFilled(content);
}

absl::StatusOr<NamedTensors> State::GatherRandomness() {
  std::shared_ptr<comm::Communicator> comm = session_->shared_communicator();
  comm::CollectiveOptions opts;
  opts.timeout = session_->options().collective_timeout;
  const torch::Tensor row = committed_.random.contiguous();
  CONCORD_ASSIGN_OR_RETURN(
      const std::vector<std::string> rows,
      comm::AllgatherStrings(
          *comm,
          std::string(reinterpret_cast<const char*>(row.data_ptr<uint8_t>()),
                      static_cast<size_t>(row.numel())),
          opts));
  for (const std::string& r : rows) {
    if (r.size() == static_cast<size_t>(row.numel())) continue;
    if (!random_differs_said_ && comm->rank() == 0) {
      random_differs_said_ = true;
      Log()->warn(
          "checkpoint of step {}: the ranks' random generators differ ({} "
          "bytes here, {} on another rank): it keeps only its writer's, so a "
          "resume from it does not draw what this run draws (said once)",
          committed_.step, row.numel(), r.size());
    }
    return NamedTensors{};
  }
  torch::Tensor table = torch::empty(
      {static_cast<int64_t>(rows.size()), row.numel()}, torch::kUInt8);
  for (size_t r = 0; r < rows.size(); ++r) {
    std::memcpy(table[static_cast<int64_t>(r)].data_ptr<uint8_t>(),
                rows[r].data(), rows[r].size());
  }
  return NamedTensors{{"rng/ranks", table},
                      {"rng/sizes", torch::tensor(random_.Sizes())}};
}

NamedTensors State::RandomnessPlaceholder() const {
  const int64_t width = random_.RowBytes();
  return {{"rng/ranks",
           torch::zeros({session_->world_size(), width}, torch::kUInt8)},
          {"rng/sizes", torch::tensor(random_.Sizes())}};
}

absl::Status State::ResumeRandomness(int winner, comm::Communicator& comm,
                                     const comm::CollectiveOptions& opts) {
  std::string bytes;
  if (comm.rank() == winner && resumed_rows_.defined()) {
    const torch::Tensor t = resumed_rows_.contiguous();
    bytes.assign(reinterpret_cast<const char*>(t.data_ptr<uint8_t>()),
                 static_cast<size_t>(t.numel()));
  }
  resumed_rows_ = torch::Tensor();
  CONCORD_RETURN_IF_ERROR(comm::BroadcastBytes(comm, winner, &bytes, opts));
  if (bytes.empty()) return absl::OkStatus();  // none: "rng/cpu" was taken
  const int64_t width = random_.RowBytes();
  const int64_t rows =
      static_cast<int64_t>(bytes.size()) / std::max<int64_t>(width, 1);
  if (width == 0 || rows * width != static_cast<int64_t>(bytes.size())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the checkpoint's random states (", bytes.size(),
        " bytes) are not rows of this program's (", width, " bytes)"));
  }
  // Rank r takes row r; one beyond the checkpoint's world keeps its own.
  if (comm.rank() >= rows) return absl::OkStatus();
  torch::Tensor row = torch::empty({width}, torch::kUInt8);
  std::memcpy(row.data_ptr<uint8_t>(),
              bytes.data() + static_cast<size_t>(comm.rank() * width),
              static_cast<size_t>(width));
  return random_.Apply(row);
}

void State::FenceCheckpoint() {
  if (checkpointer_ != nullptr) checkpointer_->Fence();
}

checkpoint::Content State::Capture(
    NamedTensors participants,
    std::vector<checkpoint::OptimizerContent> sharded) const {
  checkpoint::Content c;
  c.counters.step = committed_.step;
  c.counters.epoch = committed_.epoch;
  c.counters.position = committed_.position;
  c.counters.world_size = session_->world_size();
  c.counters.generation = session_->generation();
  c.counters.run = session_->run();
  for (const Model& m : models_) {
    c.modules.emplace_back(m.name, m.engine->NamedState());
  }
  for (const Optimizer& o : optimizers_) {
    c.optimizers.push_back(checkpoint::CaptureOptimizer(o.name, *o.optimizer));
  }
  for (auto& o : sharded) c.optimizers.push_back(std::move(o));
  for (const auto& [name, v] : committed_.values) {
    c.extra.emplace_back(absl::StrCat("values/", name), v);
  }
  c.extra.emplace_back("rng/cpu", checkpoint::CpuRngState());
  // The same buckets after a resume: the same sums, bit for bit.
  for (const Model& m : models_) {
    c.extra.emplace_back(absl::StrCat("layout/", m.name),
                         m.engine->ReducerLayout());
  }
  for (auto& entry : participants) c.extra.push_back(std::move(entry));
  return c;
}

absl::Status State::Apply(const checkpoint::Content& content) {
  checkpoint::Live live;
  for (const Model& m : models_) {
    live.modules.emplace_back(m.name, m.engine->NamedState());
  }
  for (const Optimizer& o : optimizers_) {
    live.optimizers.emplace_back(o.name, o.optimizer);
  }
  // See Note [Each rank's randomness]: every rank's generators, which must
  // fit this program's before anything changes.
  torch::Tensor rows;
  for (const auto& [key, t] : content.extra) {
    if (key == "rng/ranks") rows = t;
  }
  if (rows.defined()) {
    std::vector<int64_t> sizes;
    for (const auto& [key, t] : content.extra) {
      if (key != "rng/sizes") continue;
      const torch::Tensor s = t.to(torch::kLong).contiguous();
      sizes.assign(s.data_ptr<int64_t>(), s.data_ptr<int64_t>() + s.numel());
    }
    CONCORD_RETURN_IF_ERROR(random_.Fits(sizes));
    const int64_t width = random_.RowBytes();  // the same sizes: Fits
    if (rows.scalar_type() != torch::kUInt8 || rows.dim() != 2 ||
        rows.size(1) != width || rows.size(0) < 1) {
      return absl::FailedPreconditionError(absl::StrCat(
          "its ranks' random states are ", checkpoint::DescribeTensor(rows),
          ", not rows of ", width, " bytes"));
    }
  }
  using Values = std::map<std::string, torch::Tensor>;
  CONCORD_ASSIGN_OR_RETURN(Values restored, checkpoint::ApplyTo(content, live));
  resumed_rows_ = rows;
  step = content.counters.step;
  epoch = content.counters.epoch;
  position = content.counters.position;
  values = std::move(restored);
  std::vector<NamedTensors> parts(participants_.size());
  for (const auto& [key, t] : content.extra) {
    if (key == "rng/cpu" && !rows.defined()) {
      CONCORD_RETURN_IF_ERROR(checkpoint::SetCpuRngState(t));
    }
    for (const Model& m : models_) {
      if (key == absl::StrCat("layout/", m.name)) {
        CONCORD_RETURN_IF_ERROR(
            Annotate(m.engine->SetReducerLayout(t),
                     absl::StrCat("module '", m.name, "'")));
      }
    }
    for (size_t i = 0; i < participants_.size(); ++i) {
      const std::string prefix = absl::StrCat(participants_[i].name, "/");
      if (absl::StartsWith(key, prefix)) {
        parts[i].emplace_back(key.substr(prefix.size()), t);
      }
    }
  }
  // See Note [Participants in checkpoints].
  for (size_t i = 0; i < participants_.size(); ++i) {
    const Attached& a = participants_[i];
    CONCORD_RETURN_IF_ERROR(
        Annotate(a.participant->ResumeState(&parts[i], *a.optimizer), a.name));
  }
  for (const Attached& a : participants_) {
    const std::string name = a.participant->OptimizerName();
    if (name.empty()) continue;
    const checkpoint::OptimizerContent* saved = nullptr;
    for (const auto& o : content.optimizers) {
      if (o.name == name) saved = &o;
    }
    if (saved == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("it has no optimizer named '", name, "'"));
    }
    CONCORD_RETURN_IF_ERROR(a.participant->ResumeOptimizer(*saved));
  }
  return absl::OkStatus();
}

absl::Status State::MakeCheckpointer() {
  auto made = checkpoint::Checkpointer::Create(
      session_->options().checkpoint, session_->options().spec.job_id());
  if (!made.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoints: ", made.status().message()));
  }
  checkpointer_ = *std::move(made);
  // See Note [Writes from the worker].
  checkpointer_->OnReport(
      [session = session_](const checkpoint::PersistReport& report) {
        session->ReportCheckpoint(
            checkpoint::ReportOf(report, session->options().node_id));
      });
  checkpointer_->OnSaved([this](const checkpoint::Counters& saved) {
    if (const auto& history = session_->history()) {
      history->Checkpoint(saved.generation, saved.step, saved.epoch,
                          checkpointer_->persists());
    }
  });
  return absl::OkStatus();
}

ShardPlacement ShardPlacement::Over(const std::vector<std::string>& nodes,
                                    const std::vector<std::string>& regions,
                                    bool as_bytes) {
  ShardPlacement p;
  std::unordered_map<std::string, int> writer_of_node;
  for (size_t r = 0; r < nodes.size(); ++r) {
    const auto [at, added] =
        writer_of_node.emplace(nodes[r], static_cast<int>(r));
    if (added) p.writers.push_back(static_cast<int>(r));
    const int writer = at->second;
    p.writer_of.push_back(writer);
    // See Note [Shards copied where they are]: the node's region, mapped by
    // this rank and its writer alike.
    p.in_place.push_back(!as_bytes && !regions[r].empty() &&
                         regions[r] == regions[static_cast<size_t>(writer)]);
  }
  return p;
}

absl::Status State::SyncCheckpoints(int* root) {
  const checkpoint::Config& config = session_->options().checkpoint;
  if (!config.enabled()) return absl::OkStatus();
  if (checkpointer_ == nullptr) CONCORD_RETURN_IF_ERROR(MakeCheckpointer());
  std::shared_ptr<comm::Communicator> comm = session_->shared_communicator();
  comm::CollectiveOptions opts;
  opts.timeout = session_->options().collective_timeout;
  const int me = comm->rank();
  // Who writes this node's snapshot: its lowest rank. Each rank's node and
  // its region's path (empty: its own memory), one allgather.
  const std::string& node = session_->options().node_id;
  CONCORD_ASSIGN_OR_RETURN(
      const std::vector<std::string> said,
      comm::AllgatherStrings(
          *comm, absl::StrCat(node.size(), ":", node, config.memory), opts));
  std::vector<std::string> nodes, regions;
  for (const std::string& s : said) {
    const size_t colon = s.find(':');
    const size_t length = std::stoul(s.substr(0, colon));
    nodes.push_back(s.substr(colon + 1, length));
    regions.push_back(s.substr(colon + 1 + length));
  }
  // A benchmark's other side: every shard as bytes.
  int64_t as_bytes = 0;
  if (!env::GetInt(env::kTestShardsAsBytes, &as_bytes).ok()) as_bytes = 0;
  placement_ = ShardPlacement::Over(nodes, regions, as_bytes == 1);
  const bool writes = placement_.writer_of[static_cast<size_t>(me)] == me;
  checkpointer_->SetRole(/*writes_memory=*/writes, /*persists=*/me == 0);
  region_prepared_ = false;
  CONCORD_ASSIGN_OR_RETURN(const ResumeChoice choice,
                           ChooseResume(*comm, nodes, opts));
  if (choice.winner < 0) return absl::OkStatus();
  CONCORD_RETURN_IF_ERROR(ResumeFrom(choice, *comm, opts));
  LogResume(choice, nodes, me);
  tainted_ = false;
  *root = choice.winner;
  resumed_ = Resumed{choice.memory ? "memory" : "disk", choice.step};
  return absl::OkStatus();
}

absl::StatusOr<State::ResumeChoice> State::ChooseResume(
    comm::Communicator& comm, const std::vector<std::string>& nodes,
    const comm::CollectiveOptions& opts) {
  ResumeChoice choice;
  // Does a member hold a committed step? Then it goes on from that.
  CONCORD_ASSIGN_OR_RETURN(
      torch::Tensor held,
      AllgatherInts(comm, {tainted_ ? int64_t{0} : step}, opts));
  if (held.max().item<int64_t>() > 0) return choice;
  // Nobody does: the newest checkpoint any rank can offer, memory first at
  // the same step, then the lowest rank. The disk's is offered by the lowest
  // rank on the node that wrote the one the coordinator named (see Note [Resume
  // source]), else by rank 0 from its directory.
  std::optional<checkpoint::Checkpointer::Named> named;
  int disk_rank = 0;
  if (const auto& from = session_->resume_from(); from.has_value()) {
    named = checkpoint::Checkpointer::Named{from->step(), from->path(),
                                            from->run()};
    const auto on_node = std::find(nodes.begin(), nodes.end(), from->node());
    if (on_node != nodes.end()) {
      disk_rank = static_cast<int>(on_node - nodes.begin());
    }
  }
  // See Note [Runs] in coordinator/core/core.h: --no-resume takes this run's
  // own checkpoints only, and the newest is by run, then step.
  // (A coordinator that names no run: nothing, as --no-resume did before.)
  const int64_t only_run = session_->options().checkpoint.resume ? 0
                           : session_->run() != 0 ? session_->run()
                                                  : -1;
  choice.mine = checkpointer_->FindCandidate(
      /*disk=*/comm.rank() == disk_rank, named, only_run);
  const bool in_memory =
      choice.mine && absl::StartsWith(choice.mine->source, "memory");
  CONCORD_ASSIGN_OR_RETURN(
      torch::Tensor offers,
      AllgatherInts(
          comm,
          {choice.mine ? choice.mine->content.counters.run : 0,
           choice.mine ? choice.mine->step : int64_t{-1}, in_memory ? 1 : 0},
          opts));
  int64_t best_memory = 0, best_run = 0;
  for (int r = 0; r < comm.size(); ++r) {
    const int64_t run = offers[r][0].item<int64_t>();
    const int64_t s = offers[r][1].item<int64_t>();
    const int64_t m = offers[r][2].item<int64_t>();
    if (s <= 0) continue;
    const auto key = std::make_tuple(run, s, m);
    if (choice.winner < 0 ||
        key > std::make_tuple(best_run, choice.step, best_memory)) {
      choice.winner = r;
      choice.step = s;
      best_run = run;
      best_memory = m;
    }
  }
  choice.memory = best_memory != 0;
  return choice;
}

absl::Status State::ResumeFrom(const ResumeChoice& choice,
                               comm::Communicator& comm,
                               const comm::CollectiveOptions& opts) {
  const int winner = choice.winner;
  // The winner loads it and says whether it fits, so that every rank fails
  // with the same line when it does not.
  std::string error;
  if (comm.rank() == winner) {
    if (absl::Status applied = Apply(choice.mine->content); !applied.ok()) {
      error = absl::StrCat("resuming from ", choice.mine->source, ": ",
                           applied.message());
    }
  }
  CONCORD_RETURN_IF_ERROR(comm::BroadcastBytes(comm, winner, &error, opts));
  if (!error.empty()) return absl::FailedPreconditionError(error);
  CONCORD_RETURN_IF_ERROR(ResumeRandomness(winner, comm, opts));
  if (comm.rank() != winner) {
    for (const Attached& a : participants_) {
      CONCORD_RETURN_IF_ERROR(
          a.participant->ResumeState(nullptr, *a.optimizer));
    }
  }
  for (const Model& m : models_) {
    std::vector<torch::Tensor> tensors;
    for (const auto& [name, t] : m.engine->NamedState()) tensors.push_back(t);
    CONCORD_RETURN_IF_ERROR(
        comm::BroadcastCoalesced(comm, tensors, winner, opts));
    torch::Tensor layout = m.engine->ReducerLayout();
    CONCORD_RETURN_IF_ERROR(comm.Broadcast(layout, winner, opts)->Wait());
    CONCORD_RETURN_IF_ERROR(m.engine->SetReducerLayout(layout));
  }
  return absl::OkStatus();
}

void State::LogResume(const ResumeChoice& choice,
                      const std::vector<std::string>& nodes, int me) const {
  // See Note [Resume source]: the memory snapshot the coordinator named, if
  // that is what won.
  std::string named_memory;
  if (const auto& memory = session_->resume_memory(); memory.has_value()) {
    if (choice.memory && memory->step() == choice.step &&
        nodes[choice.winner] == memory->node()) {
      named_memory = ", as the coordinator named";
    } else if (me == 0 && choice.step < memory->step()) {
      Log()->warn(
          "generation {}: the coordinator named step {} in the memory of {}; "
          "no rank there offered it (its node agent's memory is gone?)",
          session_->generation(), memory->step(), memory->node());
    }
  }
  if (me == choice.winner) {
    Log()->info(
        "generation {}: no member holds a committed step; resuming from "
        "step {} of the checkpoint in {}{}",
        session_->generation(), choice.step, choice.mine->source, named_memory);
  } else {
    Log()->info(
        "generation {}: no member holds a committed step; resuming from "
        "step {} of a checkpoint rank {} loaded ({})",
        session_->generation(), choice.step, choice.winner,
        choice.memory ? "its node's memory" : "disk");
  }
}

void State::Restore() {
  FenceCheckpoint();  // before the optimizer's state is put back
  step = committed_.step;
  epoch = committed_.epoch;
  position = committed_.position;
  values.clear();
  for (const auto& [name, v] : committed_.values) values[name] = v.clone();
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < buffers_.size(); ++i) {
    buffers_[i].copy_(committed_.buffers[i]);
  }
  // See Note [Each rank's randomness]: the step taken again draws what it
  // drew.
  if (committed_.random.defined()) {
    if (absl::Status s = random_.Apply(committed_.random); !s.ok()) {
      Log()->warn("the committed random generators not put back: {}",
                  std::string(s.message()));
    }
  }
  if (!in_step_) return;
  in_step_ = false;
  for (Attached& a : participants_) {
    // Changed before the failed collective: it changes early.
    if (a.optimizer != nullptr && a.watch.Changed(*a.optimizer)) {
      a.watch.timing = Timing::kEarly;
    }
    a.participant->RestoreStep();
  }
  for (Optimizer& o : optimizers_) {
    // Stepped before the failed collective: it steps early.
    const bool stepped = o.watch.Changed(*o.optimizer);
    if (stepped) o.watch.timing = Timing::kEarly;
    if (o.copied) {
      o.copy.Restore(*o.optimizer);
    } else if (stepped) {
      Log()->warn(
          "optimizer '{}' stepped before a collective of step {} that failed, "
          "in the first step it did so: its update is taken again when the "
          "step is (Note [Early optimizer steps])",
          o.name, step + 1);
    }
  }
}

void State::SetDivisor() {
  const int world = session_->world_size();
  const double divisor = options_.divide_by_initial_world_size()
                             ? world + session_->finished_workers()
                             : world;
  for (const Model& m : models_) m.engine->SetGradientDivisor(divisor);
}

absl::Status State::SyncPayload(int root) {
  std::shared_ptr<comm::Communicator> comm = session_->shared_communicator();
  comm::CollectiveOptions opts;
  opts.timeout = session_->options().collective_timeout;
  std::string bytes;
  if (comm->rank() == root) {
    torch::serialize::OutputArchive archive;
    archive.write("step", c10::IValue(step));
    archive.write("epoch", c10::IValue(epoch));
    archive.write("position", c10::IValue(position));
    torch::serialize::OutputArchive optimizers;
    for (const Optimizer& o : optimizers_) {
      torch::serialize::OutputArchive one;
      o.optimizer->save(one);
      optimizers.write(o.name, one);
    }
    archive.write("optimizers", optimizers);
    torch::serialize::OutputArchive user;
    for (const auto& [name, v] : values) user.write(name, v);
    archive.write("values", user);
    std::ostringstream out;
    archive.save_to(out);
    bytes = out.str();
  }
  CONCORD_RETURN_IF_ERROR(comm::BroadcastBytes(*comm, root, &bytes, opts));
  if (comm->rank() == root) return absl::OkStatus();
  try {
    std::istringstream in(bytes);
    torch::serialize::InputArchive archive;
    archive.load_from(in);
    const int64_t s = ReadInt(archive, "step");
    const int64_t e = ReadInt(archive, "epoch");
    const int64_t p = ReadInt(archive, "position");
    torch::serialize::InputArchive optimizers;
    archive.read("optimizers", optimizers);
    torch::serialize::InputArchive user;
    archive.read("values", user);
    std::map<std::string, torch::Tensor> received;
    for (const std::string& name : user.keys()) {
      torch::Tensor t;
      user.read(name, t);
      received[name] = t;
    }
    for (Optimizer& o : optimizers_) {
      torch::serialize::InputArchive one;
      if (!optimizers.try_read(o.name, one)) {
        throw std::runtime_error(
            absl::StrCat("it has no optimizer named '", o.name, "'"));
      }
      o.optimizer->load(one);
    }
    step = s;
    epoch = e;
    position = p;
    values = std::move(received);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(
        "the authoritative rank's training state does not load here (is "
        "this the same program and optimizer?): ",
        e.what()));
  }
  return absl::OkStatus();
}

absl::Status State::Sync() {
  // See Note [Hangs] in coordinator/core/hang_rule.h: a checkpoint's read,
  // the state's broadcast to a newcomer.
  worker::Session::Busy busy(session_, "restore");
  FenceCheckpoint();  // before a broadcast writes the parameters
  int root = session_->authoritative_rank();
  CONCORD_RETURN_IF_ERROR(SyncCheckpoints(&root));
  for (const Model& m : models_) {
    CONCORD_RETURN_IF_ERROR(
        Annotate(m.engine->SyncReducerLayout(),
                 absl::StrCat("syncing the bucket layout of '", m.name, "'")));
  }
  CONCORD_RETURN_IF_ERROR(
      Annotate(SyncPayload(root), "syncing the training state"));
  for (const Attached& a : participants_) {
    CONCORD_RETURN_IF_ERROR(
        Annotate(a.participant->SyncState(session_->shared_communicator(), root,
                                          step, *a.optimizer),
                 "syncing attached state"));
  }
  SetDivisor();
  tainted_ = false;
  CommitState(/*may_checkpoint=*/false);
  return absl::OkStatus();
}

absl::StatusOr<StepDecision> State::BeginStep(bool has_data, bool admit) {
  // See Note [Participants in checkpoints]: the last commit's due checkpoint,
  // in the generation that committed it.
  if (deferred_.has_value()) {
    const bool same = *deferred_ == session_->generation();
    deferred_.reset();
    if (same) TakeCheckpoint(/*wait=*/false);
  }
  // After a re-form the new generation agrees again: a newcomer's first
  // BeginStep meets the survivors' second one.
  for (;;) {
    std::shared_ptr<comm::Communicator> comm = session_->shared_communicator();
    const int world = comm->size();
    torch::Tensor flags =
        torch::tensor({int64_t{has_data ? 1 : 0},
                       int64_t{admit && session_->reform_wanted() ? 1 : 0}},
                      torch::kLong);
    comm::CollectiveOptions opts;
    opts.timeout = session_->options().collective_timeout;
    CONCORD_RETURN_IF_ERROR(Annotate(comm->AllreduceSum(flags, opts)->Wait(),
                                     "step agreement failed"));
    const int64_t with_data = flags[0].item<int64_t>();
    const bool admitting = flags[1].item<int64_t>() > 0;
    if (with_data < world) {
      if (options_.throw_on_early_termination()) {
        return absl::FailedPreconditionError(
            absl::StrFormat("%d of %d ranks ran out of data before step %d "
                            "(throw_on_early_termination)",
                            world - with_data, world, step + 1));
      }
      if (with_data == 0) return StepDecision::kDone;
      CONCORD_RETURN_IF_ERROR(HandOver(*comm, has_data));
      if (!has_data) {
        CONCORD_RETURN_IF_ERROR(session_->LeaveAtEndOfData(step));
        left_ = true;
        return StepDecision::kLeft;
      }
      CONCORD_RETURN_IF_ERROR(
          Reform(absl::StrFormat("%d rank(s) ran out of data after step %d",
                                 world - with_data, step),
                 /*restore=*/false));
      continue;
    }
    if (!admitting) {
      StartStep();
      return StepDecision::kRun;
    }
    CONCORD_RETURN_IF_ERROR(
        Reform(absl::StrFormat("admitting waiting workers after step %d", step),
               /*restore=*/false));
  }
}

absl::Status State::HandOver(comm::Communicator& comm, bool has_data) {
  bool wanted = false;
  for (const Attached& a : participants_) {
    wanted = wanted || a.participant->HandsOver();
  }
  if (!wanted) return absl::OkStatus();
  torch::Tensor flags = torch::zeros({comm.size()}, torch::kLong);
  flags[comm.rank()] = has_data ? 0 : 1;
  comm::CollectiveOptions opts;
  opts.timeout = session_->options().collective_timeout;
  CONCORD_RETURN_IF_ERROR(
      Annotate(comm.AllreduceSum(flags, opts)->Wait(), "agreeing who leaves"));
  std::vector<bool> leaving(static_cast<size_t>(comm.size()));
  for (int r = 0; r < comm.size(); ++r) {
    leaving[static_cast<size_t>(r)] = flags[r].item<int64_t>() > 0;
  }
  for (const Attached& a : participants_) {
    if (!a.participant->HandsOver()) continue;
    CONCORD_RETURN_IF_ERROR(
        Annotate(a.participant->HandOver(comm, leaving, step),
                 absl::StrCat("handing over ", a.name)));
  }
  return absl::OkStatus();
}

absl::Status State::Reform(const std::string& reason, bool restore) {
  FenceCheckpoint();
  const auto previous = session_->shared_communicator();
  const int previous_world = previous ? previous->size() : 0;
  ReformRecord record;
  record.reason = reason;
  record.started_us = absl::ToUnixMicros(absl::Now());
  std::string why = reason;
  bool changed = false;
  for (;;) {
    if (restore) Restore();
    // A worker whose model may be half-received says so by claiming no
    // committed step: it must not be chosen to broadcast.
    if (absl::Status joined = session_->Reform(tainted_ ? 0 : step, why);
        !joined.ok()) {
      // Session::Reform already waited out the join timeout (or the job is
      // over): not something another re-form would fix.
      return absl::FailedPreconditionError(
          absl::StrCat("re-forming failed: ", joined.ToString()));
    }
    changed = changed || session_->members_changed();
    record.rendezvous_us = absl::ToUnixMicros(absl::Now());
    const int root = session_->authoritative_rank();
    tainted_ = session_->rank() != root;
    // See Note [Several models]: every module, in the order they were added.
    absl::Status s;
    for (const Model& m : models_) {
      s = Annotate(m.engine->Rebind(session_->shared_communicator(), root),
                   absl::StrCat("rebinding '", m.name, "'"));
      if (!s.ok()) break;
    }
    if (s.ok()) s = Sync();
    if (s.ok()) break;
    if (!Retryable(s)) return s;
    Log()->warn("re-forming again: {}", s.ToString());
    why = std::string(s.message());
    restore = true;
  }
  members_changed_ = changed;
  ++reforms_;
  record.synced_us = absl::ToUnixMicros(absl::Now());
  record.generation = session_->generation();
  record.world_size = session_->world_size();
  records_.push_back(record);
  ResetInfo info;
  info.generation = session_->generation();
  info.rank = session_->rank();
  info.world_size = session_->world_size();
  info.previous_world_size = previous_world;
  info.authoritative_rank = session_->authoritative_rank();
  info.step = step;
  info.reason = reason;
  Log()->info(
      "generation {}: rank {} of {} (was {} ranks), authoritative rank {}, "
      "going on from step {}",
      info.generation, info.rank, info.world_size, info.previous_world_size,
      info.authoritative_rank, info.step);
  for (const auto& callback : callbacks_) callback(info);
  return absl::OkStatus();
}

absl::Status Run(State& state,
                 const std::function<absl::Status(State&)>& train) {
  // See Note [Re-form loops].
  int64_t failed_step = -1;  // the committed step of the last failure
  int repeats = 0;
  for (;;) {
    absl::Status status;
    try {
      status = train(state);
    } catch (const Error& e) {
      status = ToStatus(e);
    }
    if (status.ok() || !Retryable(status) || !state.session().elastic()) {
      return status;
    }
    const bool again = state.step == failed_step && !state.members_changed();
    repeats = again ? repeats + 1 : 0;
    failed_step = state.step;
    if (repeats >= state.options().max_repeated_failures()) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "step %d failed %d times in a row, after re-forms that changed "
          "no member and with no step committed in between; giving up: %s",
          state.step + 1, repeats + 1, status.ToString()));
    }
    if (repeats > 0) {
      const int64_t wait =
          repeats > 5 ? 5000
                      : std::min<int64_t>(int64_t{200} << (repeats - 1), 5000);
      Log()->warn(
          "step {} failed again with the same members ({}); waiting "
          "{} ms before re-forming",
          state.step + 1, status.ToString(), wait);
      std::this_thread::sleep_for(std::chrono::milliseconds(wait));
    } else {
      Log()->warn("step {} failed ({}); re-forming", state.step + 1,
                  status.ToString());
    }
    CONCORD_RETURN_IF_ERROR(
        state.Reform(std::string(status.message()), /*restore=*/true));
  }
}

}  // namespace concord::elastic
