#pragma once
// What the docs' snippets of Concord's internal library use without making
// it (declared, never defined: the snippets are compiled, not linked).
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/status_macros.h"
#include "worker/comm/communicator.h"
#include "worker/ddp/engine.h"
#include "worker/elastic/state.h"
#include "worker/session.h"
#include "worker/slowmo/slowmo.h"

namespace snippet_context {

struct NetImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x);
};
TORCH_MODULE(Net);

extern Net net;
extern std::unique_ptr<concord::worker::Session> session;
extern std::unique_ptr<concord::ddp::Engine> ddp;
extern torch::optim::SGD opt, optimizer;
extern concord::elastic::State state;
extern std::shared_ptr<concord::comm::Communicator> comm;
extern std::shared_ptr<concord::comm::Communicator> new_communicator;
extern int auth_rank;
extern int64_t epochs, epoch_size, world, batch, steps;
extern std::string worker_id;
extern std::vector<torch::Tensor> p16, p32, buffers;
extern concord::SlowMoOptions options;
extern torch::Tensor x, loss;
// The step's forward and loss, as the program computes them.
torch::Tensor compute_loss();

}  // namespace snippet_context

using namespace snippet_context;  // NOLINT
