#pragma once
// Shared by the SlowMo translation units (internal; not a public header).

#include <torch/torch.h>

#include <vector>

namespace concord::slowmo {

// The tensors' values as one contiguous vector (a copy).
inline torch::Tensor Flatten(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& t : tensors) flat.push_back(t.reshape({-1}));
  return torch::cat(flat);
}

}  // namespace concord::slowmo
