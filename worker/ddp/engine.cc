#include "worker/ddp/engine.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "worker/comm/coalesced.h"

namespace concord::ddp {
namespace {

comm::CollectiveOptions CollectiveOpts(const ReducerInternals& internals) {
  comm::CollectiveOptions c;
  c.timeout = internals.collective_timeout;
  return c;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(
    std::shared_ptr<torch::nn::Module> module,
    std::shared_ptr<comm::Communicator> comm, int authoritative_rank,
    concord::DdpOptions options, ReducerInternals internals) {
  if (module == nullptr) return absl::InvalidArgumentError("null module");
  Named named;
  for (const auto& item : module->named_parameters(/*recurse=*/true)) {
    named.params.emplace_back(item.key(), item.value());
  }
  for (const auto& item : module->named_buffers(/*recurse=*/true)) {
    named.buffers.emplace_back(item.key(), item.value());
  }
  return Init(std::move(named), std::move(comm), authoritative_rank,
              std::move(options), std::move(internals));
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(
    torch::jit::Module module, std::shared_ptr<comm::Communicator> comm,
    int authoritative_rank, concord::DdpOptions options,
    ReducerInternals internals) {
  Named named;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    named.params.emplace_back(item.name, item.value);
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    named.buffers.emplace_back(item.name, item.value);
  }
  auto ddp = Init(std::move(named), std::move(comm), authoritative_rank,
                  std::move(options), std::move(internals));
  if (ddp.ok()) (*ddp)->script_ = std::move(module);
  return ddp;
}

namespace {

std::string Describe(const std::string& kind, const std::string& name,
                     const torch::Tensor& t) {
  return absl::StrCat(
      kind, " '", name, "' ", std::string(c10::toString(t.scalar_type())), " ",
      c10::str(t.sizes()), t.requires_grad() ? " requires_grad" : "");
}

// Every rank checks its model against the authoritative rank's description
// and all learn whether any differs, so that they fail together instead of
// hanging in a broadcast of mismatched sizes.
absl::Status VerifySameModel(comm::Communicator& comm, int root,
                             const std::vector<std::string>& mine,
                             const comm::CollectiveOptions& opts) {
  if (comm.size() == 1) return absl::OkStatus();
  std::string text;
  for (const auto& line : mine) absl::StrAppend(&text, line, "\n");
  std::string theirs = text;
  CONCORD_RETURN_IF_ERROR(comm::BroadcastBytes(comm, root, &theirs, opts));
  std::string difference;
  if (theirs != text) {
    std::vector<std::string> lines =
        absl::StrSplit(theirs, '\n', absl::SkipEmpty());
    size_t i = 0;
    while (i < lines.size() && i < mine.size() && lines[i] == mine[i]) ++i;
    difference = absl::StrCat("entry ", i, ": this rank has ",
                              i < mine.size() ? mine[i] : "nothing",
                              ", the authoritative rank ", root, " has ",
                              i < lines.size() ? lines[i] : "nothing");
  }
  torch::Tensor mismatches =
      torch::tensor({difference.empty() ? 0 : 1}, torch::kInt);
  CONCORD_RETURN_IF_ERROR(comm.AllreduceSum(mismatches, opts)->Wait());
  const int count = mismatches.item<int>();
  if (count == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("ranks wrap different models (", count, " of ", comm.size(),
                   " differ from the authoritative rank)",
                   difference.empty() ? "" : absl::StrCat("; ", difference)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Init(
    Named named, std::shared_ptr<comm::Communicator> comm,
    int authoritative_rank, concord::DdpOptions options,
    ReducerInternals internals) {
  if (comm == nullptr) return absl::InvalidArgumentError("null communicator");
  if (authoritative_rank < 0 || authoritative_rank >= comm->size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "authoritative rank ", authoritative_rank, " out of range"));
  }
  const std::vector<std::string>& ignore =
      options.params_and_buffers_to_ignore();
  std::set<std::string> ignored(ignore.begin(), ignore.end());
  std::set<std::string> known;
  for (const auto& [name, t] : named.params) known.insert(name);
  for (const auto& [name, t] : named.buffers) known.insert(name);
  for (const auto& name : ignore) {
    if (known.count(name) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot ignore '", name, "': no such parameter or buffer"));
    }
  }
  std::unique_ptr<Engine> ddp(new Engine());
  ddp->comm_ = comm;
  ddp->authoritative_rank_ = authoritative_rank;
  std::vector<torch::Tensor> synced;  // broadcast at creation
  std::vector<std::string> description;
  std::vector<std::string> trainable_names;
  for (const auto& [name, p] : named.params) {
    if (ignored.count(name)) continue;
    synced.push_back(p);
    description.push_back(Describe("parameter", name, p));
    if (p.requires_grad()) {
      ddp->params_.push_back(p);
      trainable_names.push_back(name);
    }
  }
  for (const auto& [name, b] : named.buffers) {
    if (ignored.count(name)) continue;
    ddp->buffers_.push_back(b);
    description.push_back(Describe("buffer", name, b));
  }
  if (ddp->params_.empty()) {
    return absl::InvalidArgumentError(
        "the module has no parameter that requires grad (outside `ignore`)");
  }

  internals.authoritative_rank = authoritative_rank;
  internals.trigger_params.clear();
  for (const auto& name : options.allreduce_trigger_params()) {
    auto it = std::find(trainable_names.begin(), trainable_names.end(), name);
    if (it == trainable_names.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "allreduce trigger '", name, "' is not a trainable parameter"));
    }
    internals.trigger_params.push_back(
        static_cast<size_t>(it - trainable_names.begin()));
  }
  CONCORD_RETURN_IF_ERROR(
      ddp::Reducer::Validate(options, internals, /*has_hook=*/false));
  ddp->options_ = options;
  ddp->internals_ = internals;

  synced.insert(synced.end(), ddp->buffers_.begin(), ddp->buffers_.end());
  ddp->synced_ = std::move(synced);
  ddp->description_ = std::move(description);
  CONCORD_RETURN_IF_ERROR(ddp->VerifyAndBroadcast());
  ddp->named_ = std::move(named);
  ddp->reducer_ = std::make_unique<ddp::Reducer>(
      ddp->params_, std::move(trainable_names), comm, std::move(options),
      std::move(internals));
  return ddp;
}

absl::Status Engine::VerifyAndBroadcast() {
  const comm::CollectiveOptions opts = CollectiveOpts(internals_);
  CONCORD_RETURN_IF_ERROR(
      VerifySameModel(*comm_, authoritative_rank_, description_, opts));
  // Every rank starts from the authoritative rank's model.
  if (absl::Status s =
          comm::BroadcastCoalesced(*comm_, synced_, authoritative_rank_, opts);
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("broadcast of the model from "
                                               "the authoritative rank "
                                               "failed: ",
                                               s.message()));
  }
  return absl::OkStatus();
}

absl::Status Engine::Rebind(std::shared_ptr<comm::Communicator> comm,
                            int authoritative_rank) {
  if (comm == nullptr) return absl::InvalidArgumentError("null communicator");
  if (authoritative_rank < 0 || authoritative_rank >= comm->size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "authoritative rank ", authoritative_rank, " out of range"));
  }
  comm_ = comm;
  authoritative_rank_ = authoritative_rank;
  if (trace_)
    trace_->SetGeneration(comm->generation(), comm->rank(), comm->size());
  reducer_->Rebind(std::move(comm), authoritative_rank);
  // The next forward broadcasts buffers again, as after creation.
  require_forward_param_sync_ = true;
  return VerifyAndBroadcast();
}

void Engine::SetTraceRecorder(std::shared_ptr<trace::Recorder> recorder) {
  trace_ = std::move(recorder);
  if (trace_) {
    trace_->SetGeneration(comm_->generation(), comm_->rank(), comm_->size());
  }
  reducer_->SetTraceRecorder(trace_);
}

absl::Status Engine::ValidateOptions(const concord::DdpOptions& options,
                                     bool has_comm_hook) {
  if (options.slowmo() && !options.comm_hook().empty()) {
    return absl::InvalidArgumentError(
        "DdpOptions: comm_hook and slowmo exclude each other (SlowMo does not "
        "average gradients every step)");
  }
  return ddp::Reducer::Validate(options, ReducerInternals{}, has_comm_hook);
}

absl::Status Engine::RegisterCommHook(ddp::CommHook hook) {
  return reducer_->RegisterCommHook(std::move(hook));
}

absl::Status Engine::PrepareForward() {
  // PyTorch 1.13's forward: buffers are broadcast when the previous forward
  // was a synchronised one (or this is the first), whatever the grad mode;
  // the reducer is armed when this one is.
  const bool sync =
      torch::GradMode::is_enabled() && require_backward_grad_sync_;
  if (sync) CONCORD_RETURN_IF_ERROR(reducer_->PrepareForBackward());
  // With SlowMo, SlowMo broadcasts the buffers before every forward itself.
  if (options_.broadcast_buffers() && !options_.slowmo() &&
      require_forward_param_sync_ && !buffers_.empty()) {
    absl::Status s = comm::BroadcastCoalesced(
        *comm_, buffers_, authoritative_rank_, CollectiveOpts(internals_));
    if (!s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat("buffer broadcast failed: ", s.message()));
    }
  }
  require_forward_param_sync_ = sync;
  return absl::OkStatus();
}

c10::IValue Engine::Forward(std::vector<c10::IValue> inputs) {
  if (!script_.has_value()) {
    ThrowIfError(absl::FailedPreconditionError(
        "Forward(inputs) is for TorchScript modules; use Forward(fn)"));
  }
  trace::Recorder::Span span(trace_, "forward");
  ThrowIfError(PrepareForward());
  c10::IValue out = script_->forward(std::move(inputs));
  reducer_->MarkForwardDone();
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> Engine::NamedState() const {
  auto out = named_.params;
  out.insert(out.end(), named_.buffers.begin(), named_.buffers.end());
  return out;
}

}  // namespace concord::ddp
