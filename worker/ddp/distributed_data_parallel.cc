#include "worker/ddp/distributed_data_parallel.h"

#include "absl/strings/str_cat.h"
#include "worker/comm/coalesced.h"

namespace concord {
namespace {

comm::CollectiveOptions CollectiveOpts(const DdpOptions& o) {
  comm::CollectiveOptions c;
  c.timeout = o.collective_timeout;
  return c;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DistributedDataParallel>>
DistributedDataParallel::Create(std::shared_ptr<torch::nn::Module> module,
                                std::shared_ptr<comm::Communicator> comm,
                                int authoritative_rank, DdpOptions options) {
  if (module == nullptr) return absl::InvalidArgumentError("null module");
  Named named;
  for (const auto& item : module->named_parameters(/*recurse=*/true)) {
    named.params.emplace_back(item.key(), item.value());
  }
  for (const auto& item : module->named_buffers(/*recurse=*/true)) {
    named.buffers.emplace_back(item.key(), item.value());
  }
  return Init(std::move(named), std::move(comm), authoritative_rank, options);
}

absl::StatusOr<std::unique_ptr<DistributedDataParallel>>
DistributedDataParallel::Create(torch::jit::Module module,
                                std::shared_ptr<comm::Communicator> comm,
                                int authoritative_rank, DdpOptions options) {
  Named named;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    named.params.emplace_back(item.name, item.value);
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    named.buffers.emplace_back(item.name, item.value);
  }
  auto ddp =
      Init(std::move(named), std::move(comm), authoritative_rank, options);
  if (ddp.ok()) (*ddp)->script_ = std::move(module);
  return ddp;
}

absl::StatusOr<std::unique_ptr<DistributedDataParallel>>
DistributedDataParallel::Init(Named named,
                              std::shared_ptr<comm::Communicator> comm,
                              int authoritative_rank, DdpOptions options) {
  if (comm == nullptr) return absl::InvalidArgumentError("null communicator");
  if (authoritative_rank < 0 || authoritative_rank >= comm->size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "authoritative rank ", authoritative_rank, " out of range"));
  }
  std::unique_ptr<DistributedDataParallel> ddp(new DistributedDataParallel());
  ddp->comm_ = comm;
  ddp->authoritative_rank_ = authoritative_rank;
  ddp->options_ = options;
  std::vector<torch::Tensor> all_params;
  std::vector<std::string> trainable_names;
  for (const auto& [name, p] : named.params) {
    all_params.push_back(p);
    if (p.requires_grad()) {
      ddp->params_.push_back(p);
      trainable_names.push_back(name);
    }
  }
  for (const auto& [name, b] : named.buffers) ddp->buffers_.push_back(b);
  if (ddp->params_.empty()) {
    return absl::InvalidArgumentError(
        "the module has no parameter that requires grad");
  }
  ddp->named_ = std::move(named);

  // Every rank starts from the authoritative rank's model.
  std::vector<torch::Tensor> state = all_params;
  state.insert(state.end(), ddp->buffers_.begin(), ddp->buffers_.end());
  if (absl::Status s = comm::BroadcastCoalesced(
          *comm, state, authoritative_rank, CollectiveOpts(options));
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("initial broadcast of the model "
                                               "failed: ",
                                               s.message()));
  }

  ddp::ReducerOptions reducer_options;
  reducer_options.first_bucket_bytes = options.first_bucket_bytes;
  reducer_options.bucket_cap_bytes = options.bucket_cap_bytes;
  reducer_options.collective_timeout = options.collective_timeout;
  ddp->reducer_ = std::make_unique<ddp::Reducer>(
      ddp->params_, std::move(trainable_names), comm, reducer_options);
  return ddp;
}

absl::Status DistributedDataParallel::PrepareForward() {
  if (!torch::GradMode::is_enabled()) return absl::OkStatus();
  if (options_.broadcast_buffers && !buffers_.empty()) {
    absl::Status s = comm::BroadcastCoalesced(
        *comm_, buffers_, authoritative_rank_, CollectiveOpts(options_));
    if (!s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat("buffer broadcast failed: ", s.message()));
    }
  }
  reducer_->PrepareForBackward();
  return absl::OkStatus();
}

c10::IValue DistributedDataParallel::Forward(std::vector<c10::IValue> inputs) {
  if (!script_.has_value()) {
    ThrowIfError(absl::FailedPreconditionError(
        "Forward(inputs) is for TorchScript modules; use Forward(fn)"));
  }
  ThrowIfError(PrepareForward());
  return script_->forward(std::move(inputs));
}

std::vector<std::pair<std::string, torch::Tensor>>
DistributedDataParallel::NamedState() const {
  auto out = named_.params;
  out.insert(out.end(), named_.buffers.begin(), named_.buffers.end());
  return out;
}

}  // namespace concord
