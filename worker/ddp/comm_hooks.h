#pragma once
// DDP communication hooks (PyTorch's register_comm_hook).
//
// Note [DDP Communication Hook]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Without a hook the reducer writes grad / world_size into each bucket and
// allreduces it. With a hook, the reducer writes the plain (accumulated)
// gradients into the bucket and hands it to the hook when the bucket is full;
// the hook returns a Work that, once waited for successfully, has left the
// reduced gradients — averaged, as the hook decides — in `bucket.buffer`. Hooks
// run on the autograd thread, in bucket order, identically on every rank; they
// must issue the same collectives on every rank.

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"

namespace concord::ddp {

struct GradBucket {
  size_t index = 0;
  // One flat tensor of one dtype; the gradients are views into it.
  at::Tensor buffer;
  std::vector<at::Tensor> gradients;
  std::vector<at::Tensor> parameters;
  bool is_last = false;
};

using CommHook = std::function<std::shared_ptr<comm::Work>(GradBucket& bucket)>;

// PyTorch's allreduce_hook: buffer / world_size, then allreduce.
CommHook AllreduceHook(std::shared_ptr<comm::Communicator> comm,
                       comm::CollectiveOptions options = {});
// PyTorch's fp16_compress_hook: cast to float16, divide by world size,
// allreduce, cast back into the bucket.
CommHook Fp16CompressHook(std::shared_ptr<comm::Communicator> comm,
                          comm::CollectiveOptions options = {});
// PyTorch's bf16_compress_hook: the same in bfloat16.
CommHook Bf16CompressHook(std::shared_ptr<comm::Communicator> comm,
                          comm::CollectiveOptions options = {});

// Parses a --comm-hook value ("allreduce", "fp16", "bf16",
// "powersgd[:RANK[:START_ITER]]", PowerSGD's defaults otherwise: rank 1,
// start 1000). INVALID_ARGUMENT names the value otherwise.
absl::StatusOr<CommHook> MakeCommHook(const std::string& name,
                                      std::shared_ptr<comm::Communicator> comm,
                                      comm::CollectiveOptions options = {});

}  // namespace concord::ddp
