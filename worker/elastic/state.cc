#include "worker/elastic/state.h"

#include <spdlog/spdlog.h>

#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
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

}  // namespace

State::State(worker::Session* session, ddp::Engine* ddp,
             torch::optim::Optimizer* optimizer, ElasticOptions options)
    : session_(session),
      ddp_(ddp),
      optimizer_(optimizer),
      options_(options),
      buffers_(ddp->AllBuffers()) {
  for (const auto& b : buffers_) committed_.buffers.push_back(b.clone());
  // Note [Elastic step]: the optimizer may step only once the step's
  // collectives are known to have succeeded.
  ddp_->SetBlockingWait(true);
}

void State::OnReset(std::function<void(const ResetInfo&)> callback) {
  callbacks_.push_back(std::move(callback));
}

void State::Commit() {
  committed_.step = step;
  committed_.epoch = epoch;
  committed_.position = position;
  committed_.values.clear();
  for (const auto& [name, v] : values) committed_.values[name] = v.clone();
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < buffers_.size(); ++i) {
    committed_.buffers[i].copy_(buffers_[i]);
  }
  session_->ReportCommittedStep(step);
}

void State::Restore() {
  step = committed_.step;
  epoch = committed_.epoch;
  position = committed_.position;
  values.clear();
  for (const auto& [name, v] : committed_.values) values[name] = v.clone();
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < buffers_.size(); ++i) {
    buffers_[i].copy_(committed_.buffers[i]);
  }
}

void State::SetDivisor() {
  const int world = session_->world_size();
  ddp_->SetGradientDivisor(options_.divide_by_initial_world_size
                               ? world + session_->finished_workers()
                               : world);
}

absl::Status State::SyncPayload() {
  std::shared_ptr<comm::Communicator> comm = session_->shared_communicator();
  const int root = session_->authoritative_rank();
  comm::CollectiveOptions opts;
  opts.timeout = session_->options().collective_timeout;
  std::string bytes;
  if (comm->rank() == root) {
    torch::serialize::OutputArchive archive;
    archive.write("step", c10::IValue(step));
    archive.write("epoch", c10::IValue(epoch));
    archive.write("position", c10::IValue(position));
    torch::serialize::OutputArchive optimizer;
    optimizer_->save(optimizer);
    archive.write("optimizer", optimizer);
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
    torch::serialize::InputArchive optimizer;
    archive.read("optimizer", optimizer);
    torch::serialize::InputArchive user;
    archive.read("values", user);
    std::map<std::string, torch::Tensor> received;
    for (const std::string& name : user.keys()) {
      torch::Tensor t;
      user.read(name, t);
      received[name] = t;
    }
    optimizer_->load(optimizer);
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
  CONCORD_RETURN_IF_ERROR(
      Annotate(ddp_->SyncReducerLayout(), "syncing the bucket layout"));
  CONCORD_RETURN_IF_ERROR(
      Annotate(SyncPayload(), "syncing the training state"));
  for (Participant* participant : participants_) {
    CONCORD_RETURN_IF_ERROR(
        Annotate(participant->SyncState(session_->shared_communicator(),
                                        session_->authoritative_rank(), step,
                                        *optimizer_),
                 "syncing attached state"));
  }
  SetDivisor();
  tainted_ = false;
  Commit();
  return absl::OkStatus();
}

absl::StatusOr<StepDecision> State::BeginStep(bool has_data, bool admit) {
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
      if (options_.throw_on_early_termination) {
        return absl::FailedPreconditionError(
            absl::StrFormat("%d of %d ranks ran out of data before step %d "
                            "(throw_on_early_termination)",
                            world - with_data, world, step + 1));
      }
      if (with_data == 0) return StepDecision::kDone;
      if (!has_data) {
        CONCORD_RETURN_IF_ERROR(session_->LeaveAtEndOfData(step));
        return StepDecision::kLeft;
      }
      CONCORD_RETURN_IF_ERROR(
          Reform(absl::StrFormat("%d rank(s) ran out of data after step %d",
                                 world - with_data, step),
                 /*restore=*/false));
      continue;
    }
    if (!admitting) return StepDecision::kRun;
    CONCORD_RETURN_IF_ERROR(
        Reform(absl::StrFormat("admitting waiting workers after step %d", step),
               /*restore=*/false));
  }
}

absl::Status State::Reform(const std::string& reason, bool restore) {
  const auto previous = session_->shared_communicator();
  const int previous_world = previous ? previous->size() : 0;
  ReformRecord record;
  record.reason = reason;
  record.started_us = absl::ToUnixMicros(absl::Now());
  std::string why = reason;
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
    record.rendezvous_us = absl::ToUnixMicros(absl::Now());
    const int root = session_->authoritative_rank();
    tainted_ = session_->rank() != root;
    absl::Status s = ddp_->Rebind(session_->shared_communicator(), root);
    if (s.ok()) s = Sync();
    if (s.ok()) break;
    if (!Retryable(s)) return s;
    spdlog::warn("re-forming again: {}", s.ToString());
    why = std::string(s.message());
    restore = true;
  }
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
  spdlog::info(
      "generation {}: rank {} of {} (was {} ranks), authoritative rank {}, "
      "going on from step {}",
      info.generation, info.rank, info.world_size, info.previous_world_size,
      info.authoritative_rank, info.step);
  for (const auto& callback : callbacks_) callback(info);
  return absl::OkStatus();
}

absl::Status Run(State& state,
                 const std::function<absl::Status(State&)>& train) {
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
    spdlog::warn("step {} failed ({}); re-forming", state.step + 1,
                 status.ToString());
    CONCORD_RETURN_IF_ERROR(
        state.Reform(std::string(status.message()), /*restore=*/true));
  }
}

}  // namespace concord::elastic
