#include "worker/ddp/comm_hooks.h"

#include <ATen/ATen.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "worker/ddp/powersgd.h"
#include "worker/tensor_ops.h"

namespace concord::ddp {
namespace {

CommHook CompressHook(at::ScalarType wire_dtype,
                      std::shared_ptr<comm::Communicator> comm,
                      comm::CollectiveOptions options) {
  return [comm = std::move(comm), options,
          wire_dtype](GradBucket& bucket) -> std::shared_ptr<comm::Work> {
    // PyTorch's fp16/bf16_compress_hook: cast, divide in the wire type,
    // allreduce, cast back (see Note [Kernels in the worker] for the casts).
    at::Tensor compressed = CastTo(bucket.buffer, wire_dtype)
                                .div_(static_cast<double>(comm->size()));
    auto work = comm->AllreduceSum(compressed, options);
    at::Tensor buffer = bucket.buffer;
    return comm::Then(std::move(work), [buffer, compressed]() mutable {
      CastInto(compressed, buffer);
      return absl::OkStatus();
    });
  };
}

}  // namespace

CommHook AllreduceHook(std::shared_ptr<comm::Communicator> comm,
                       comm::CollectiveOptions options) {
  return [comm = std::move(comm),
          options](GradBucket& bucket) -> std::shared_ptr<comm::Work> {
    bucket.buffer.div_(static_cast<double>(comm->size()));
    return comm->AllreduceSum(bucket.buffer, options);
  };
}

CommHook Fp16CompressHook(std::shared_ptr<comm::Communicator> comm,
                          comm::CollectiveOptions options) {
  return CompressHook(at::kHalf, std::move(comm), options);
}

CommHook Bf16CompressHook(std::shared_ptr<comm::Communicator> comm,
                          comm::CollectiveOptions options) {
  return CompressHook(at::kBFloat16, std::move(comm), options);
}

absl::StatusOr<CommHook> MakeCommHook(const std::string& name,
                                      std::shared_ptr<comm::Communicator> comm,
                                      comm::CollectiveOptions options) {
  if (name == "allreduce") return AllreduceHook(std::move(comm), options);
  if (name == "fp16") return Fp16CompressHook(std::move(comm), options);
  if (name == "bf16") return Bf16CompressHook(std::move(comm), options);
  if (absl::StartsWith(name, "powersgd")) {
    auto parsed = ParsePowerSgd(name);
    if (!parsed.ok()) return parsed.status();
    return PowerSgdHook(std::make_shared<PowerSgdState>(*parsed),
                        std::move(comm), options);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown communication hook '", name,
                   "' (allreduce, fp16, bf16, powersgd[:RANK[:START_ITER]])"));
}

}  // namespace concord::ddp
