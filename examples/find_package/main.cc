// Trains a small MLP with Concord's DDP, the way README's "Using the
// library" shows, against an installed Concord (find_package(Concord)),
// with nothing but <concord/concord.h>.
//
//   concord-run --standalone --nproc 2 -- ./concord-example [--steps N]
//       [--batch-size B]
//
// Every rank makes the same synthetic regression data (y = x·w + noise, 512
// samples); step s takes the world's batch of W·B samples from (s·W·B) mod
// (512 − W·B + 1) on, and rank r every W-th of them from the r-th. The ranks
// start from different random weights, which DDP replaces with the
// authoritative rank's (rank 0's in the first generation). Each rank prints
// its loss every 5 steps and, at the end, one line
//   concord-example: rank R world W steps S first_loss A last_loss B
//       param_sum C param_sq_sum D
// (on one line). The ranks' parameters are equal after training, so C and D
// are the same on every rank, and equal (up to rounding) to those of one
// process run alone with batch W·B.
#include <concord/concord.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(8, 16))),
        fc2(register_module("fc2", torch::nn::Linear(16, 1))) {}
  torch::Tensor forward(torch::Tensor x) {
    return fc2->forward(torch::relu(fc1->forward(x)));
  }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

[[noreturn]] void Fail(int code, const std::string& message) {
  std::cerr << "concord-example: " << message << "\n";
  std::exit(code);
}

struct Args {
  int steps = 40;
  int batch_size = 16;  // per rank
};

int ParsePositive(const char* flag, const char* text) {
  char* end = nullptr;
  long v = std::strtol(text, &end, 10);
  if (*text == '\0' || *end != '\0' || v < 1 || v > 100000) {
    Fail(2, std::string(flag) + ": not a number in 1..100000: " + text);
  }
  return static_cast<int>(v);
}

Args ParseArgs(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if ((flag == "--steps" || flag == "--batch-size") && i + 1 < argc) {
      int v = ParsePositive(argv[i], argv[i + 1]);
      (flag == "--steps" ? args.steps : args.batch_size) = v;
      ++i;
    } else {
      Fail(2, "unknown or incomplete argument: " + flag +
                  " (usage: concord-example [--steps N] [--batch-size B])");
    }
  }
  return args;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = ParseArgs(argc, argv);
  const int steps = args.steps;
  torch::set_num_threads(1);
  try {
    concord::Job job;  // joins the job concord-run describes, or runs alone
    const int rank = job.rank();
    const int world = job.world_size();

    // The same data on every rank.
    torch::manual_seed(0);
    const int64_t samples = 512;
    auto x = torch::randn({samples, 8});
    auto y = x.matmul(torch::randn({8, 1})) + 0.01 * torch::randn({samples, 1});
    const int64_t global_batch = int64_t{args.batch_size} * world;
    if (global_batch > samples) {
      job.finish(false, "--batch-size: the world's batch exceeds 512");
      Fail(2, "--batch-size: the world's batch exceeds 512");
    }

    // Different initial weights on every rank: DDP gives every rank the
    // authoritative rank's.
    torch::manual_seed(1000 + rank);
    Net net;
    concord::DistributedDataParallel ddp(net, job);
    torch::optim::SGD opt(ddp->parameters(), 0.05);

    double first_loss = 0, last_loss = 0;
    for (int step = 0; step < steps; ++step) {
      int64_t start = (step * global_batch) % (samples - global_batch + 1);
      auto rows = torch::arange(start + rank, start + global_batch, world);
      auto xb = x.index_select(0, rows), yb = y.index_select(0, rows);
      opt.zero_grad();
      auto loss = torch::mse_loss(ddp->forward(xb), yb);
      loss.backward();  // gradients are averaged over the ranks here
      opt.step();
      last_loss = loss.item<double>();
      if (step == 0) first_loss = last_loss;
      if (step % 5 == 0 || step == steps - 1) {
        std::printf("concord-example: rank %d step %d loss %.6f\n", rank, step,
                    last_loss);
      }
    }

    double param_sum = 0, param_sq_sum = 0;
    for (const auto& p : net->parameters()) {
      param_sum += p.sum().item<double>();
      param_sq_sum += p.square().sum().item<double>();
    }
    std::printf(
        "concord-example: rank %d world %d steps %d first_loss %.6f "
        "last_loss %.6f param_sum %.17g param_sq_sum %.17g\n",
        rank, world, steps, first_loss, last_loss, param_sum, param_sq_sum);
    std::fflush(stdout);
    job.finish();
  } catch (const concord::Error& e) {
    Fail(1, e.what());
  }
  return 0;
}
