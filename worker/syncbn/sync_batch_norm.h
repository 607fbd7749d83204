#pragma once
// SyncBatchNorm for the LibTorch C++ frontend: batch normalisation whose
// training statistics are taken over the whole group's batch (PyTorch's
// nn.SyncBatchNorm, apex's SyncBatchNorm), over Concord's communicators.
//
// Note [SyncBN arithmetic]
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
#include <mutex>
#include <string>
#include <vector>

#include "worker/comm/communicator.h"

namespace concord {

// The communicator SyncBN layers use, shared by all layers of a model so
// that a new generation's communicator is installed once for all of them.
// Thread-safe; a layer takes the communicator at the start of each training
// forward and keeps it for that call's backward.
class SyncBnGroup {
 public:
  // `communicator` may be null: statistics over the local batch only (a
  // world of one).
  explicit SyncBnGroup(
      std::shared_ptr<comm::Communicator> communicator = nullptr,
      comm::CollectiveOptions options = {});

  // Installs the communicator of a new generation (the elastic loop
  // calls this after re-forming): later forwards use the new group. Must
  // not be called while a forward or backward of this group is running.
  void SetCommunicator(std::shared_ptr<comm::Communicator> communicator);
  std::shared_ptr<comm::Communicator> communicator() const;
  const comm::CollectiveOptions& options() const { return options_; }

 private:
  mutable std::mutex mu_;
  std::shared_ptr<comm::Communicator> communicator_;
  comm::CollectiveOptions options_;
};

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  // PyTorch's defaults: eps 1e-5, momentum 0.1, affine, running stats.
  explicit SyncBatchNormImpl(const torch::nn::BatchNormOptions& options,
                             std::shared_ptr<SyncBnGroup> group = nullptr);
  explicit SyncBatchNormImpl(int64_t num_features)
      : SyncBatchNormImpl(torch::nn::BatchNormOptions(num_features)) {}

  // Training: Note [SyncBN arithmetic]. Throws c10::Error for a bad input
  // (dims, channels, dtype; "Expected more than 1 value per channel when
  // training" when the group's batch has one element per channel) and
  // concord::Error when a collective fails.
  torch::Tensor forward(const torch::Tensor& input);

  void reset() override;
  void reset_parameters();
  void reset_running_stats();
  void pretty_print(std::ostream& stream) const override;

  // The group is shared by clone() (a clone belongs to the same job).
  const std::shared_ptr<SyncBnGroup>& group() const { return group_; }
  void set_group(std::shared_ptr<SyncBnGroup> group);

  // Shares these tensors (PyTorch's convert_sync_batchnorm assigns the same
  // Parameter objects, so an optimizer built before conversion still owns
  // them). Shapes must match num_features; undefined where absent.
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
  std::shared_ptr<SyncBnGroup> group_;
};

TORCH_MODULE(SyncBatchNorm);

// Replaces every torch::nn::BatchNorm{1,2,3}d in the tree under `root` with a
// SyncBatchNorm of the same options that shares its parameters and buffers,
// all using `group`. Returns the converted root: `root` itself, or a new
// SyncBatchNorm when `root` is a BatchNorm. `replaced` (optional) receives
// the qualified names of the replaced modules.
//
// C++ caveat (none in Python): a module is found through its parent's
// registered children. Sequential, ModuleList and ModuleDict are rebound in
// place, so their forward uses the new layer. A custom module that calls a
// BatchNorm through its own typed member (`torch::nn::BatchNorm2d bn_`)
// keeps calling the old layer: the member cannot hold a SyncBatchNorm. Build
// such modules with concord::SyncBatchNorm directly (or a member of type
// std::shared_ptr<torch::nn::Module> re-read from named_children()), or hold
// their BatchNorms in containers. Call it once, before the optimizer and
// DDP see the model (the parameters are shared, so either order works for
// the optimizer; DDP must wrap the converted model).
std::shared_ptr<torch::nn::Module> ConvertSyncBatchNorm(
    std::shared_ptr<torch::nn::Module> root, std::shared_ptr<SyncBnGroup> group,
    std::vector<std::string>* replaced = nullptr);

}  // namespace concord
