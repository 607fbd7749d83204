#pragma once
// What the docs' public-API snippets use without making it (declared, never
// defined: the snippets are compiled, not linked).
#include <concord/concord.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace snippet_context {

struct NetImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x);
};
TORCH_MODULE(Net);

struct Args {
  std::string data;
  int64_t epochs = 1;
};
extern Args args;
extern std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
extern concord::DistributedDataParallel<Net> ddp;

}  // namespace snippet_context

using namespace snippet_context;  // NOLINT
