// syncbn_reference_helper --in IN.pt --out OUT.pt
//
// The C++ half of test_syncbn_reference.py. IN.pt (torch.save) is a dict:
//   x, g: (S, N, C, *) float32 (S steps of the concatenated batch and the
//         gradient of the output), sizes: (W,) int64 rank batch sizes,
//   weight, bias: (C,), momentum: () float64 (< 0: none, cumulative),
//   eps: () float64, channels_last: () int64.
// Runs W ranks as threads over real Gloo (loopback), each with one
// concord::SyncBatchNorm on its slice of every step, and writes OUT.pt:
//   y, dx: like x (rank slices concatenated), dw, db: (S, C) summed over
//   ranks, running_mean, running_var: (C,), num_batches_tracked: ().
// Exit status 0, or 1 with one line on stderr.

#include <torch/torch.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <mutex>
#include <thread>

#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/comm/store.h"
#include "worker/state_dict_file.h"
#include "worker/syncbn/sync_batch_norm.h"

namespace {

torch::Tensor Get(const c10::Dict<c10::IValue, c10::IValue>& d,
                  const std::string& key) {
  auto it = d.find(c10::IValue(key));
  TORCH_CHECK(it != d.end(), "missing key ", key);
  return it->value().toTensor();
}

torch::Tensor ChannelsLast(const torch::Tensor& x) {
  std::vector<int64_t> perm{0};
  for (int64_t d = 2; d < x.dim(); ++d) perm.push_back(d);
  perm.push_back(1);
  std::vector<int64_t> inverse(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inverse[perm[i]] = int64_t(i);
  return x.permute(perm).contiguous().permute(inverse);
}

int Run(const std::string& in_path, const std::string& out_path) {
  std::ifstream in(in_path, std::ios::binary);
  TORCH_CHECK(in, "cannot open ", in_path);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                          std::istreambuf_iterator<char>());
  const auto dict = torch::pickle_load(bytes).toGenericDict();
  const torch::Tensor x = Get(dict, "x"), g = Get(dict, "g");
  const torch::Tensor sizes = Get(dict, "sizes");
  const double momentum = Get(dict, "momentum").item<double>();
  const bool channels_last = Get(dict, "channels_last").item<int64_t>() != 0;
  const int world = static_cast<int>(sizes.numel());
  const int64_t steps = x.size(0), channels = x.size(2);

  torch::nn::BatchNormOptions options(channels);
  options.eps(Get(dict, "eps").item<double>());
  options.momentum(momentum < 0 ? c10::optional<double>() : momentum);

  std::vector<std::vector<torch::Tensor>> y(world), dx(world);
  torch::Tensor dw = torch::zeros({steps, channels});
  torch::Tensor db = torch::zeros({steps, channels});
  torch::Tensor running_mean, running_var, batches;
  std::mutex mu;
  std::vector<std::string> errors;
  concord::comm::InMemoryStore store;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        concord::comm::GlooOptions gloo;
        gloo.rank = rank;
        gloo.size = world;
        gloo.generation = 1;
        gloo.connect_timeout = absl::Seconds(30);
        auto comm = concord::comm::GlooCommunicator::Create(gloo, &store);
        TORCH_CHECK(comm.ok(), comm.status().ToString());
        concord::comm::CollectiveOptions collective;
        collective.timeout = absl::Seconds(30);
        concord::SyncBatchNorm bn(
            options,
            std::make_shared<concord::SyncBnGroup>(
                std::shared_ptr<concord::comm::Communicator>(std::move(*comm)),
                collective));
        {
          torch::NoGradGuard no_grad;
          bn->weight.copy_(Get(dict, "weight"));
          bn->bias.copy_(Get(dict, "bias"));
        }
        const int64_t offset = sizes.narrow(0, 0, rank).sum().item<int64_t>();
        const int64_t n = sizes[rank].item<int64_t>();
        for (int64_t s = 0; s < steps; ++s) {
          bn->zero_grad();
          torch::Tensor xs = x[s].narrow(0, offset, n).clone();
          if (channels_last) xs = ChannelsLast(xs);
          xs.requires_grad_(true);
          torch::Tensor out = bn->forward(xs);
          (out * g[s].narrow(0, offset, n)).sum().backward();
          std::lock_guard<std::mutex> lock(mu);
          y[rank].push_back(out.detach().contiguous());
          dx[rank].push_back(xs.grad().contiguous());
          dw[s] += bn->weight.grad();
          db[s] += bn->bias.grad();
        }
        if (rank == 0) {
          running_mean = bn->running_mean.clone();
          running_var = bn->running_var.clone();
          batches = bn->num_batches_tracked.clone();
        }
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back(e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  if (!errors.empty()) {
    std::cerr << "syncbn_reference_helper: " << errors.front() << std::endl;
    return 1;
  }
  std::vector<torch::Tensor> y_steps, dx_steps;
  for (int64_t s = 0; s < steps; ++s) {
    std::vector<torch::Tensor> ys, dxs;
    for (int r = 0; r < world; ++r) {
      ys.push_back(y[r][s]);
      dxs.push_back(dx[r][s]);
    }
    y_steps.push_back(torch::cat(ys));
    dx_steps.push_back(torch::cat(dxs));
  }
  const absl::Status saved =
      concord::SaveStateDict({{"y", torch::stack(y_steps)},
                              {"dx", torch::stack(dx_steps)},
                              {"dw", dw},
                              {"db", db},
                              {"running_mean", running_mean},
                              {"running_var", running_var},
                              {"num_batches_tracked", batches}},
                             out_path);
  if (!saved.ok()) {
    std::cerr << "syncbn_reference_helper: " << saved.message() << std::endl;
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5 || std::string(argv[1]) != "--in" ||
      std::string(argv[3]) != "--out") {
    std::cerr << "usage: syncbn_reference_helper --in IN.pt --out OUT.pt"
              << std::endl;
    return 2;
  }
  try {
    return Run(argv[2], argv[4]);
  } catch (const std::exception& e) {
    std::cerr << "syncbn_reference_helper: " << e.what() << std::endl;
    return 1;
  }
}
