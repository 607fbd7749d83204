// A TorchScript model saved from Python (model.py export), fine-tuned in
// C++ by every worker concord-run starts, elastic: the convolutional
// features are frozen, the head is trained on all ten classes, and the
// result is saved as TorchScript again for Python (model.py evaluate).
// The lines that a LibTorch program without Concord would not have are
// marked "// concord".
//
//   python3 examples/mnist/prepare_data.py DATA
//   python3 examples/torchscript/model.py export DATA model.pt
//   concord-run --standalone --nproc 3 --min-workers 2 --max-restarts 1
//       -- ./concord-finetune --model model.pt --data DATA --out tuned.pt
//       [--epochs N] [--batch-size B] [--train-samples N] [--lr X]
//   python3 examples/torchscript/model.py evaluate DATA tuned.pt
//       --base model.pt
//
// Each worker prints, at the end, one line
//   concord-finetune: rank R world W steps S reforms F trainable T
//       frozen Z param_sum P
// (on one line); rank 0 writes --out.
#include <concord/concord.h>
#include <torch/csrc/jit/passes/tensorexpr_fuser.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

namespace {

struct Args {
  std::string model, data, out;
  int64_t epochs = 2;
  int64_t batch_size = 64;
  int64_t train_samples = 60000;
  int64_t log_interval = 10;
  double lr = 0.05;
  std::string freeze = "features.";  // parameters frozen, by name prefix
};

[[noreturn]] void Fail(int code, const std::string& message) {
  std::cerr << "concord-finetune: " << message << "\n";
  std::exit(code);
}

int64_t Count(const std::string& flag, const std::string& value) {
  char* end = nullptr;
  const long long v = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || v < 1 || v > 1000000) {
    Fail(2, flag + ": not a number in 1..1000000: " + value);
  }
  return v;
}

Args ParseArgs(int argc, char** argv) {
  Args a;
  const std::string usage =
      " (usage: concord-finetune --model FILE --data DIR --out FILE "
      "[--epochs N] [--batch-size B] [--train-samples N] [--lr X] "
      "[--log-interval N] [--freeze PREFIX])";
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) Fail(2, "incomplete argument: " + flag + usage);
    const std::string value = argv[++i];
    if (flag == "--model") {
      a.model = value;
    } else if (flag == "--data") {
      a.data = value;
    } else if (flag == "--out") {
      a.out = value;
    } else if (flag == "--freeze") {
      a.freeze = value;
    } else if (flag == "--lr") {
      char* end = nullptr;
      a.lr = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !(a.lr > 0 && a.lr < 10)) {
        Fail(2, "--lr: not a number in (0, 10): " + value);
      }
    } else if (flag == "--epochs") {
      a.epochs = Count(flag, value);
    } else if (flag == "--batch-size") {
      a.batch_size = Count(flag, value);
    } else if (flag == "--train-samples") {
      a.train_samples = Count(flag, value);
    } else if (flag == "--log-interval") {
      a.log_interval = Count(flag, value);
    } else {
      Fail(2, "unknown argument: " + flag + usage);
    }
  }
  if (a.model.empty() || a.data.empty() || a.out.empty()) {
    Fail(2, "--model, --data and --out are required" + usage);
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = ParseArgs(argc, argv);
  torch::manual_seed(1);
  try {
    concord::Job job;  // concord
    const torch::Device device = job.device();
    // LibTorch 2.x built with LLVM (Debian's) fuses CPU TorchScript graphs
    // with its TensorExpr compiler once the profiling runs are over; on this
    // model (frozen convolutions) that stalls the third step for minutes.
    // PyTorch's own builds have no LLVM and never fuse on the CPU.
    torch::jit::setTensorExprFuserEnabled(false);
    torch::jit::Module model;
    try {
      model = torch::jit::load(args.model, device);
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      Fail(2, args.model + ": not a TorchScript model: " +
                  what.substr(0, what.find('\n')));
    }
    model.train();
    // Frozen before DDP wraps the model, as with PyTorch's DDP: only the
    // parameters that require grad are reduced.
    std::vector<torch::Tensor> trainable;
    int64_t frozen = 0;
    for (const auto& p : model.named_parameters(/*recurse=*/true)) {
      if (p.name.rfind(args.freeze, 0) == 0) {
        p.value.requires_grad_(false);
        ++frozen;
      } else {
        trainable.push_back(p.value);
      }
    }
    if (trainable.empty()) Fail(2, "--freeze " + args.freeze + " froze all");
    concord::DistributedDataParallel ddp(model, job);  // concord

    auto train_dataset =
        torch::data::datasets::MNIST(args.data)
            .map(torch::data::transforms::Normalize<>(0.1307, 0.3081))
            .map(torch::data::transforms::Stack<>());
    const size_t train_size = static_cast<size_t>(
        std::min<int64_t>(args.train_samples, train_dataset.size().value()));
    concord::ElasticSampler sampler(train_size, job);  // concord
    auto train_loader = torch::data::make_data_loader(
        std::move(train_dataset), sampler,
        torch::data::DataLoaderOptions().batch_size(
            static_cast<size_t>(args.batch_size)));

    torch::optim::SGD optimizer(
        trainable, torch::optim::SGDOptions(args.lr).momentum(0.9));
    concord::ElasticState state(ddp, optimizer, sampler);  // concord

    concord::run_elastic(state, [&] {  // concord
      for (; state.epoch() < args.epochs; state.next_epoch()) {
        int64_t batch_idx = 0;
        for (auto& batch : *train_loader) {
          auto data = batch.data.to(device), targets = batch.target.to(device);
          optimizer.zero_grad();
          auto output = ddp->forward({data}).toTensor();
          auto loss = torch::nll_loss(output, targets);
          loss.backward();
          optimizer.step();
          state.commit();  // concord
          if (job.rank() == 0 && batch_idx++ % args.log_interval == 0) {
            std::printf(
                "Fine-tune Epoch: %ld [%5zu/%5zu] world %d Loss: %.4f\n",
                static_cast<long>(state.epoch() + 1), sampler.position(),
                train_size, job.world_size(), loss.item<float>());
            std::fflush(stdout);
          }
        }
      }
    });  // concord

    double param_sum = 0;
    for (const auto& p : model.parameters()) {
      param_sum += p.sum().item<double>();
    }
    if (job.rank() == 0) {  // concord: one writer
      model.save(args.out);
    }
    std::printf(
        "concord-finetune: rank %d world %d device %s steps %ld reforms %ld "
        "trainable %zu frozen %ld param_sum %.17g\n",
        job.rank(), job.world_size(), device.str().c_str(),
        static_cast<long>(state.step()), static_cast<long>(state.reforms()),
        trainable.size(), static_cast<long>(frozen), param_sum);
    std::fflush(stdout);
    job.finish();  // concord
  } catch (const concord::Error& e) {
    Fail(1, e.what());
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    Fail(1, what.substr(0, what.find('\n')));
  }
  return 0;
}
