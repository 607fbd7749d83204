#pragma once
// concord-train's inputs: a TorchScript model file and a tensor data file,
// validated before any training starts.

#include <torch/script.h>
#include <torch/torch.h>

#include <string>

#include "absl/status/statusor.h"

namespace concord::train {

enum class Loss { kCrossEntropy, kMse };

struct Dataset {
  torch::Tensor inputs;   // (N, ...)
  torch::Tensor targets;  // (N) int64 class ids, or (N, ...) floats
  int64_t size() const { return inputs.size(0); }
};

// Loads a module written by Python's torch.jit.save. INVALID_ARGUMENT with a
// one-line message naming `path` when it is missing or not TorchScript.
absl::StatusOr<torch::jit::Module> LoadModel(const std::string& path);

// Loads {'inputs': Tensor, 'targets': Tensor} written by Python's
// torch.save. INVALID_ARGUMENT naming `path` for a missing file, another
// format, missing keys, non-tensors or a length mismatch, or targets of the
// wrong kind for `loss`.
absl::StatusOr<Dataset> LoadData(const std::string& path, Loss loss);

// `--model builtin:cnn`: the demo's CNN (examples/make_demo.py's DemoNet)
// in the C++ frontend, for (N, C, H, W) inputs with H, W multiples of 4 and
// integer class targets; initialised from `seed`. A C++-frontend model can
// have its BatchNorm layers converted to SyncBatchNorm. INVALID_ARGUMENT
// naming the flag and the data file when the data does not fit.
absl::StatusOr<torch::nn::Sequential> BuiltinModel(
    const std::string& name, const Dataset& data, Loss loss, uint64_t seed,
    const std::string& data_path);

// Runs the model (eval mode, no grad, no state change) on the first samples
// and checks that its output fits the targets under `loss`.
// INVALID_ARGUMENT naming both files otherwise.
absl::Status CheckModelFitsData(torch::jit::Module& model, const Dataset& data,
                                Loss loss, const std::string& model_path,
                                const std::string& data_path);

// The loss of one batch, mean reduction (PyTorch's defaults).
torch::Tensor ComputeLoss(Loss loss, const torch::Tensor& output,
                          const torch::Tensor& targets);

// Writes `state` as a dict name -> tensor that Python's torch.load reads.
absl::Status SaveState(
    const std::vector<std::pair<std::string, torch::Tensor>>& state,
    const std::string& path);

}  // namespace concord::train
