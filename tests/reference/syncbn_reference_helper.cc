// syncbn_reference_helper --in IN.pt --out OUT.pt
// concord-run ... -- syncbn_reference_helper --in IN.pt --out PREFIX --session
//
// The C++ half of test_syncbn_reference.py and test_syncbn_cuda_reference.py.
// IN.pt (torch.save) is a dict:
//   x, g: (S, N, C, *) float32 (S steps of the concatenated batch and the
//         gradient of the output), sizes: (W,) int64 rank batch sizes,
//   weight, bias: (C,), momentum: () float64 (< 0: none, cumulative),
//   eps: () float64, channels_last: () int64.
// Each rank runs one concord::SyncBatchNorm on its slice of every step.
//
// Without --session: W ranks as threads of this process over real Gloo
// (loopback), on the CPU, and OUT.pt holds
//   y, dx: like x (rank slices concatenated), dw, db: (S, C) summed over
//   ranks, running_mean, running_var: (C,), num_batches_tracked: ().
// With --session: this process is one worker of a Concord job (concord-run
// sets the environment; CONCORD_DEVICE and CONCORD_BACKEND choose the device
// and the communicator, e.g. cuda:0 and gloo for several processes sharing
// one GPU, which threads cannot do: LibTorch runs every backward on a device
// in one thread, so one rank's SyncBatchNorm backward would wait for a peer
// queued behind it). The job must have W workers; rank r writes
// PREFIX.rank<r>.pt with its own y, dx: (S, n_r, C, *), dw, db: (S, C) and
// the running statistics, all on the CPU.
// Exit status 0, or 1 with one line on stderr (2 for a bad command line).

#include <torch/torch.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <mutex>
#include <thread>

#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/comm/store.h"
#include "worker/session.h"
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

c10::Dict<c10::IValue, c10::IValue> LoadInputs(const std::string& in_path) {
  std::ifstream in(in_path, std::ios::binary);
  TORCH_CHECK(in, "cannot open ", in_path);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                          std::istreambuf_iterator<char>());
  return torch::pickle_load(bytes).toGenericDict();
}

// One rank's results, on the CPU.
struct RankResult {
  std::vector<torch::Tensor> y, dx;  // a tensor per step
  torch::Tensor dw, db;              // (S, C)
  torch::Tensor running_mean, running_var, batches;
};

// Rank `rank` of sizes.numel() on its slice of every step, on `device`.
RankResult RunRank(const c10::Dict<c10::IValue, c10::IValue>& dict, int rank,
                   std::shared_ptr<concord::comm::Communicator> comm,
                   const torch::Device& device) {
  const torch::Tensor x = Get(dict, "x"), g = Get(dict, "g");
  const torch::Tensor sizes = Get(dict, "sizes");
  const double momentum = Get(dict, "momentum").item<double>();
  const bool channels_last = Get(dict, "channels_last").item<int64_t>() != 0;
  const int64_t steps = x.size(0), channels = x.size(2);
  torch::nn::BatchNormOptions options(channels);
  options.eps(Get(dict, "eps").item<double>());
  options.momentum(momentum < 0 ? c10::optional<double>() : momentum);

  concord::comm::CollectiveOptions collective;
  collective.timeout = absl::Seconds(30);
  concord::SyncBatchNorm bn(options, std::make_shared<concord::SyncBnGroup>(
                                         std::move(comm), collective));
  bn->to(device);
  {
    torch::NoGradGuard no_grad;
    bn->weight.copy_(Get(dict, "weight"));
    bn->bias.copy_(Get(dict, "bias"));
  }
  const int64_t offset = sizes.narrow(0, 0, rank).sum().item<int64_t>();
  const int64_t n = sizes[rank].item<int64_t>();
  RankResult out;
  out.dw = torch::zeros({steps, channels});
  out.db = torch::zeros({steps, channels});
  for (int64_t s = 0; s < steps; ++s) {
    bn->zero_grad();
    torch::Tensor xs = x[s].narrow(0, offset, n).to(device);
    if (channels_last) xs = ChannelsLast(xs);
    xs.requires_grad_(true);
    torch::Tensor y = bn->forward(xs);
    (y * g[s].narrow(0, offset, n).to(device)).sum().backward();
    out.y.push_back(y.detach().cpu().contiguous());
    out.dx.push_back(xs.grad().cpu().contiguous());
    out.dw[s].copy_(bn->weight.grad().cpu());
    out.db[s].copy_(bn->bias.grad().cpu());
  }
  out.running_mean = bn->running_mean.cpu();
  out.running_var = bn->running_var.cpu();
  out.batches = bn->num_batches_tracked.cpu();
  return out;
}

void Save(const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
          const std::string& path) {
  const absl::Status saved = concord::SaveStateDict(tensors, path);
  TORCH_CHECK(saved.ok(), saved.message());
}

// Every rank a thread of this process, on the CPU.
int RunThreads(const std::string& in_path, const std::string& out_path) {
  const auto dict = LoadInputs(in_path);
  const int world = static_cast<int>(Get(dict, "sizes").numel());
  const int64_t steps = Get(dict, "x").size(0);
  std::vector<RankResult> results(static_cast<size_t>(world));
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
        results[static_cast<size_t>(rank)] = RunRank(
            dict, rank,
            std::shared_ptr<concord::comm::Communicator>(std::move(*comm)),
            torch::kCPU);
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
  torch::Tensor dw = torch::zeros_like(results[0].dw);
  torch::Tensor db = torch::zeros_like(results[0].db);
  for (int64_t s = 0; s < steps; ++s) {
    std::vector<torch::Tensor> ys, dxs;
    for (const RankResult& r : results) {
      ys.push_back(r.y[static_cast<size_t>(s)]);
      dxs.push_back(r.dx[static_cast<size_t>(s)]);
    }
    y_steps.push_back(torch::cat(ys));
    dx_steps.push_back(torch::cat(dxs));
  }
  for (const RankResult& r : results) {
    dw += r.dw;
    db += r.db;
  }
  Save({{"y", torch::stack(y_steps)},
        {"dx", torch::stack(dx_steps)},
        {"dw", dw},
        {"db", db},
        {"running_mean", results[0].running_mean},
        {"running_var", results[0].running_var},
        {"num_batches_tracked", results[0].batches}},
       out_path);
  return 0;
}

// This process is one worker of a Concord job.
int RunSession(const std::string& in_path, const std::string& prefix) {
  const auto dict = LoadInputs(in_path);
  const int world = static_cast<int>(Get(dict, "sizes").numel());
  auto options = concord::worker::WorkerOptions::FromEnvironment();
  TORCH_CHECK(options.ok(), options.status().ToString());
  auto started = concord::worker::Session::Start(*options);
  TORCH_CHECK(started.ok(), "cannot join: ", started.status().ToString());
  std::unique_ptr<concord::worker::Session> session = std::move(*started);
  TORCH_CHECK(session->world_size() == world, "the job has ",
              session->world_size(), " workers, the inputs ", world, " ranks");
  const int rank = session->rank();
  RankResult r = RunRank(dict, rank, session->shared_communicator(),
                         session->torch_device());
  Save({{"y", torch::stack(r.y)},
        {"dx", torch::stack(r.dx)},
        {"dw", r.dw},
        {"db", r.db},
        {"running_mean", r.running_mean},
        {"running_var", r.running_var},
        {"num_batches_tracked", r.batches}},
       prefix + ".rank" + std::to_string(rank) + ".pt");
  const absl::Status finished = session->Finish(true, "");
  TORCH_CHECK(finished.ok(), finished.ToString());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const bool session = argc == 6 && std::string(argv[5]) == "--session";
  if ((argc != 5 && !session) || std::string(argv[1]) != "--in" ||
      std::string(argv[3]) != "--out") {
    std::cerr << "usage: syncbn_reference_helper --in IN.pt --out OUT.pt "
                 "[--session]"
              << std::endl;
    return 2;
  }
  try {
    return session ? RunSession(argv[2], argv[4])
                   : RunThreads(argv[2], argv[4]);
  } catch (const std::exception& e) {
    std::cerr << "syncbn_reference_helper: " << e.what() << std::endl;
    return 1;
  }
}
