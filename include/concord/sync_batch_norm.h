#pragma once
// concord::SyncBatchNorm: PyTorch's nn.SyncBatchNorm (and apex's) for the
// LibTorch C++ frontend, and convert_sync_batchnorm.
//
//   Net net;                                        // has BatchNorm2d layers
//   net = concord::convert_sync_batchnorm(net);     // now SyncBatchNorm
//   concord::DistributedDataParallel ddp(net, job); // binds them to the job
//
// A SyncBatchNorm takes its training statistics over the whole job's batch:
// the DistributedDataParallel that wraps the model binds every
// SyncBatchNorm in it to the job's ranks, and after every re-form to the
// new generation's (run_elastic). Outside a DistributedDataParallel it
// normalises with the local batch's statistics, as BatchNorm does.
//
// SyncBatchNorm for the LibTorch C++ frontend: batch normalisation whose
// training statistics are taken over the whole group's batch (PyTorch's
// nn.SyncBatchNorm, apex's SyncBatchNorm), over Concord's communicators.
//
// Every rank of the group must run the same SyncBN layers in the same order
// in forward and backward (including a rank whose batch is empty); a rank
// that skips one leaves its peers waiting until the collective's timeout,
// which then fails as concord::Error (UNAVAILABLE) out of forward/backward.
//
// Dtypes: input float32, float16 or bfloat16; parameters and buffers
// float32 (fp16/bf16 activations with an fp32 layer, as apex allows);
// statistics are float32. Input (N, C), (N, C, L), (N, C, H, W) or
// (N, C, D, H, W), contiguous or channels-last (channels innermost); the
// output has the input's layout.

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <ostream>
#include <type_traits>

#include "concord/error.h"

namespace concord {

namespace detail {
class SyncBnGroup;  // the ranks a layer reduces over (worker/syncbn)
}  // namespace detail

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  // PyTorch's defaults: eps 1e-5, momentum 0.1, affine, running stats.
  explicit SyncBatchNormImpl(
      const torch::nn::BatchNormOptions& options,
      std::shared_ptr<detail::SyncBnGroup> group = nullptr);
  explicit SyncBatchNormImpl(int64_t num_features)
      : SyncBatchNormImpl(torch::nn::BatchNormOptions(num_features)) {}

  // Note [SyncBN arithmetic]
  // ~~~~~~~~~~~~~~~~~~~~~~~~
  // Training forward, per layer and call:
  //   1. each rank computes per-channel (mean, m2, count) of its local batch
  //      with Welford's algorithm (kernels/syncbn.h; CUDA kernels for CUDA
  //      tensors, CPU twins otherwise);
  //   2. ONE allgather of that (2C + 1)-float row;
  //   3. every rank combines the rows by Chan's count-weighted parallel
  //      Welford update in rank order (identical result on every rank; a rank
  //      with an empty batch contributes count 0);
  //   4. y = (x - mean) * invstd * weight + bias, invstd from the biased
  //      variance; running stats take the unbiased variance m2 / (count - 1)
  //      with `momentum` (none: cumulative average over num_batches_tracked).
  // Backward: each rank reduces (sum_dy, sum_dy_xmu) over its batch, ONE
  // allreduce sums them, and the input gradient is the element-wise pass with
  // the global sums. weight/bias gradients are this rank's contributions
  // (sum_dy_xmu * invstd and sum_dy), as in PyTorch: DDP then averages them
  // like every other gradient.
  // Eval mode with running stats: plain batch norm, no communication. Eval
  // mode without running stats: batch statistics of the local batch, no
  // communication (PyTorch's rule).

  // Training: see Note [SyncBN arithmetic]. Throws c10::Error for a bad input
  // (dims, channels, dtype; "Expected more than 1 value per channel when
  // training" when the group's batch has one element per channel) and
  // concord::Error when a collective fails.
  torch::Tensor forward(const torch::Tensor& input);

  void reset() override;
  void reset_parameters();
  void reset_running_stats();
  void pretty_print(std::ostream& stream) const override;

  // Inside Concord: the ranks it reduces over (DistributedDataParallel sets
  // it). Shared by clone(): a clone belongs to the same job.
  const std::shared_ptr<detail::SyncBnGroup>& group() const { return group_; }
  void set_group(std::shared_ptr<detail::SyncBnGroup> group);

  // Inside Concord (convert_sync_batchnorm): shares these tensors (PyTorch's
  // conversion assigns the same Parameter objects, so an optimizer built
  // before still owns them). Shapes must match num_features; undefined
  // where absent.
  void AdoptState(const torch::Tensor& weight, const torch::Tensor& bias,
                  const torch::Tensor& running_mean,
                  const torch::Tensor& running_var,
                  const torch::Tensor& num_batches_tracked);

  torch::nn::BatchNormOptions options;
  torch::Tensor weight;
  torch::Tensor bias;
  torch::Tensor running_mean;
  torch::Tensor running_var;
  torch::Tensor num_batches_tracked;

 private:
  std::shared_ptr<detail::SyncBnGroup> group_;
};

TORCH_MODULE(SyncBatchNorm);

// PyTorch's SyncBatchNorm.convert_sync_batchnorm(module): every
// torch::nn::BatchNorm{1,2,3}d in the tree under `module` becomes a
// SyncBatchNorm with its options, sharing its parameters and buffers (an
// optimizer made before still owns them). Returns `module`, or a new
// SyncBatchNorm when `module` itself is a BatchNorm. Call it before
// DistributedDataParallel wraps the model.
//
// C++ caveat (none in Python): a layer is found through its parent's
// registered children. Sequential, ModuleList and ModuleDict are rebound in
// place, so their forward uses the new layer. A module that calls a
// BatchNorm through its own typed member (`torch::nn::BatchNorm2d bn;`)
// keeps calling the old one, which the member type cannot hold: declare such
// members as concord::SyncBatchNorm, or hold the layers in a container.
std::shared_ptr<torch::nn::Module> convert_sync_batchnorm(
    std::shared_ptr<torch::nn::Module> module);

// For a module holder (`Net net; net = convert_sync_batchnorm(net);`): the
// same holder, its layers converted in place. Throws Error
// (kInvalidArgument) when the holder's module is itself a BatchNorm (use the
// overload above).
template <typename Holder, typename = std::enable_if_t<std::is_base_of_v<
                               torch::detail::ModuleHolderIndicator, Holder>>>
Holder convert_sync_batchnorm(Holder module) {
  auto converted = convert_sync_batchnorm(
      std::static_pointer_cast<torch::nn::Module>(module.ptr()));
  if (converted != module.ptr()) {
    throw Error(ErrorCode::kInvalidArgument,
                "convert_sync_batchnorm: the module is itself a BatchNorm, "
                "which its holder cannot hold as a SyncBatchNorm: pass "
                "module.ptr()");
  }
  return module;
}

}  // namespace concord
