#pragma once
// concord::DistributedDataParallel: PyTorch's DDP for LibTorch modules.
//
// Wraps a C++-frontend `torch::nn::Module` or a TorchScript
// `torch::jit::Module`. On creation it broadcasts parameters and buffers from
// the authoritative rank; before every forward (with grad enabled) it
// broadcasts buffers again (PyTorch's broadcast_buffers=True); backward
// averages gradients with bucketed allreduce overlapping the rest of
// backward (see Note [Reducer flow]).
//
// Usage (TorchScript):
//   auto ddp = DistributedDataParallel::Create(module, comm, auth_rank);
//   auto out = (*ddp)->Forward({x}).toTensor();
//   loss.backward();            // gradients are averaged when this returns
//   optimizer.step();
// Usage (C++ frontend):
//   auto out = (*ddp)->Forward([&] { return net->forward(x); });
//
// Not thread-safe: one training thread drives it.

#include <torch/script.h>
#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"
#include "worker/ddp/reducer.h"
#include "worker/error.h"

namespace concord {

struct DdpOptions {
  // PyTorch's defaults: dist._DEFAULT_FIRST_BUCKET_BYTES and bucket_cap_mb=25.
  int64_t first_bucket_bytes = 1 << 20;
  int64_t bucket_cap_bytes = 25 << 20;
  bool broadcast_buffers = true;
  absl::Duration collective_timeout = absl::Minutes(5);
};

class DistributedDataParallel {
 public:
  // Blocks on the initial broadcast. Errors: INVALID_ARGUMENT (no trainable
  // parameter, bad authoritative rank), those of Work::Wait.
  static absl::StatusOr<std::unique_ptr<DistributedDataParallel>> Create(
      std::shared_ptr<torch::nn::Module> module,
      std::shared_ptr<comm::Communicator> comm, int authoritative_rank,
      DdpOptions options = {});
  static absl::StatusOr<std::unique_ptr<DistributedDataParallel>> Create(
      torch::jit::Module module, std::shared_ptr<comm::Communicator> comm,
      int authoritative_rank, DdpOptions options = {});

  // Everything a forward needs first: buffer broadcast and arming the
  // reducer (when grad mode is enabled). Errors: those of Work::Wait.
  absl::Status PrepareForward();

  // TorchScript: PrepareForward, then module.forward(inputs).
  // Throws concord::Error when PrepareForward fails.
  c10::IValue Forward(std::vector<c10::IValue> inputs);

  // C++ frontend: PrepareForward, then `forward()` (the module's own call).
  template <typename Fn>
  auto Forward(Fn&& forward) -> decltype(forward()) {
    ThrowIfError(PrepareForward());
    return forward();
  }

  // Trainable parameters, in the module's order (what the optimizer takes).
  const std::vector<torch::Tensor>& parameters() const { return params_; }
  // Every named parameter and buffer (trainable or not).
  std::vector<std::pair<std::string, torch::Tensor>> NamedState() const;
  const ddp::Reducer& reducer() const { return *reducer_; }
  comm::Communicator& communicator() { return *comm_; }
  int authoritative_rank() const { return authoritative_rank_; }

 private:
  struct Named {
    std::vector<std::pair<std::string, torch::Tensor>> params;
    std::vector<std::pair<std::string, torch::Tensor>> buffers;
  };
  static absl::StatusOr<std::unique_ptr<DistributedDataParallel>> Init(
      Named named, std::shared_ptr<comm::Communicator> comm,
      int authoritative_rank, DdpOptions options);
  DistributedDataParallel() = default;

  std::optional<torch::jit::Module> script_;
  Named named_;
  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> buffers_;
  std::shared_ptr<comm::Communicator> comm_;
  int authoritative_rank_ = 0;
  DdpOptions options_;
  std::unique_ptr<ddp::Reducer> reducer_;
};

}  // namespace concord
