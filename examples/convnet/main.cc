// A convnet with BatchNorm trained with SyncBatchNorm and SlowMo (fairscale's
// SlowMoDistributedDataParallel: LocalSGD with slow momentum), elastic:
// every worker concord-run starts trains on its share of Fashion-MNIST,
// the BatchNorm statistics are those of the whole job's batch, parameters
// are averaged every few steps instead of gradients every step, and the job
// goes on when workers die or join. The lines that a LibTorch program
// without Concord would not have are marked "// concord".
//
//   python3 examples/mnist/prepare_data.py DATA
//   concord-run --standalone --nproc 3 --min-workers 2 --max-restarts 1
//       -- ./concord-convnet --data DATA [--epochs N] [--batch-size B]
//       [--train-samples N] [--test-samples N] [--localsgd-frequency K]
//       [--slowmo-frequency F]
//
// Each worker prints, at the end, one line
//   concord-convnet: rank R world W steps S reforms F test_accuracy A
//       param_sum P running_stats_sum B
// (on one line). SyncBatchNorm keeps the running statistics equal on every
// rank (B is the same everywhere; plain BatchNorm's would differ);
// parameters are equal right after each average.
#include <concord/concord.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

namespace {

torch::nn::Sequential ConvNet() {
  using namespace torch::nn;
  return Sequential(Conv2d(Conv2dOptions(1, 16, 3).padding(1).bias(false)),
                    BatchNorm2d(16), ReLU(), MaxPool2d(MaxPool2dOptions(2)),
                    Conv2d(Conv2dOptions(16, 32, 3).padding(1).bias(false)),
                    BatchNorm2d(32), ReLU(), MaxPool2d(MaxPool2dOptions(2)),
                    Flatten(), Linear(32 * 7 * 7, 10), LogSoftmax(1));
}

struct Args {
  std::string data;
  int64_t epochs = 3;
  int64_t batch_size = 64;
  int64_t train_samples = 60000;
  int64_t test_samples = 10000;
  int64_t log_interval = 10;
  int64_t localsgd_frequency = 3;
  int64_t slowmo_frequency = 12;
};

[[noreturn]] void Fail(int code, const std::string& message) {
  std::cerr << "concord-convnet: " << message << "\n";
  std::exit(code);
}

Args ParseArgs(int argc, char** argv) {
  Args a;
  const std::string usage =
      " (usage: concord-convnet --data DIR [--epochs N] [--batch-size B] "
      "[--train-samples N] [--test-samples N] [--log-interval N] "
      "[--localsgd-frequency K] [--slowmo-frequency F])";
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) Fail(2, "incomplete argument: " + flag + usage);
    const std::string value = argv[++i];
    if (flag == "--data") {
      a.data = value;
      continue;
    }
    char* end = nullptr;
    const long long v = std::strtoll(value.c_str(), &end, 10);
    if (value.empty() || *end != '\0' || v < 1 || v > 1000000) {
      Fail(2, flag + ": not a number in 1..1000000: " + value);
    }
    if (flag == "--epochs")
      a.epochs = v;
    else if (flag == "--batch-size")
      a.batch_size = v;
    else if (flag == "--train-samples")
      a.train_samples = v;
    else if (flag == "--test-samples")
      a.test_samples = v;
    else if (flag == "--log-interval")
      a.log_interval = v;
    else if (flag == "--localsgd-frequency")
      a.localsgd_frequency = v;
    else if (flag == "--slowmo-frequency")
      a.slowmo_frequency = v;
    else
      Fail(2, "unknown argument: " + flag + usage);
  }
  if (a.data.empty()) Fail(2, "--data is required" + usage);
  return a;
}

double TestAccuracy(torch::nn::Sequential& model, const std::string& data,
                    int64_t samples, torch::Device device) {
  torch::data::datasets::MNIST test(data,
                                    torch::data::datasets::MNIST::Mode::kTest);
  const int64_t n = std::min<int64_t>(samples, test.size().value());
  auto images = torch::data::transforms::Normalize<>(
      0.2860, 0.3530)(test.images().narrow(0, 0, n));
  auto targets = test.targets().narrow(0, 0, n);
  torch::NoGradGuard no_grad;
  model->eval();  // the running statistics, the job's own
  int64_t correct = 0;
  for (int64_t begin = 0; begin < n; begin += 1000) {
    const int64_t len = std::min<int64_t>(1000, n - begin);
    auto output = model->forward(images.narrow(0, begin, len).to(device));
    correct += output.argmax(1)
                   .eq(targets.narrow(0, begin, len).to(device))
                   .sum()
                   .item<int64_t>();
  }
  model->train();
  return static_cast<double>(correct) / static_cast<double>(n);
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = ParseArgs(argc, argv);
  torch::manual_seed(1);
  try {
    concord::Job job;  // concord
    const torch::Device device = job.device();
    auto model = ConvNet();
    model = concord::convert_sync_batchnorm(model);  // concord
    model->to(device);
    concord::DistributedDataParallel ddp(  // concord
        model, job,
        concord::DdpOptions()
            // SyncBatchNorm keeps the statistics equal: nothing to broadcast.
            .broadcast_buffers(false)
            .slowmo(concord::SlowMoOptions()
                        .localsgd_frequency(args.localsgd_frequency)
                        .slowmo_frequency(args.slowmo_frequency)
                        .slowmo_momentum(0.5)));

    auto train_dataset =
        torch::data::datasets::MNIST(args.data)
            .map(torch::data::transforms::Normalize<>(0.2860, 0.3530))
            .map(torch::data::transforms::Stack<>());
    const size_t train_size = static_cast<size_t>(
        std::min<int64_t>(args.train_samples, train_dataset.size().value()));
    concord::ElasticSampler sampler(train_size, job);  // concord
    auto train_loader = torch::data::make_data_loader(
        std::move(train_dataset), sampler,
        torch::data::DataLoaderOptions().batch_size(
            static_cast<size_t>(args.batch_size)));

    torch::optim::SGD optimizer(ddp->parameters(),
                                torch::optim::SGDOptions(0.05).momentum(0.9));
    concord::ElasticState state(ddp, optimizer, sampler);  // concord

    concord::run_elastic(state, [&] {  // concord
      for (; state.epoch() < args.epochs; state.next_epoch()) {
        int64_t batch_idx = 0;
        for (auto& batch : *train_loader) {
          auto data = batch.data.to(device), targets = batch.target.to(device);
          optimizer.zero_grad();
          auto loss = torch::nll_loss(ddp->forward(data), targets);
          loss.backward();  // local gradients: SlowMo averages parameters
          optimizer.step();
          state.commit();                  // concord
          ddp->perform_slowmo(optimizer);  // concord
          if (job.rank() == 0 && batch_idx++ % args.log_interval == 0) {
            std::printf("Train Epoch: %ld [%5zu/%5zu] world %d Loss: %.4f\n",
                        static_cast<long>(state.epoch() + 1),
                        sampler.position(), train_size, job.world_size(),
                        loss.item<float>());
            std::fflush(stdout);
          }
        }
      }
    });  // concord

    const double accuracy =
        TestAccuracy(model, args.data, args.test_samples, device);
    double param_sum = 0, stats_sum = 0;
    for (const auto& p : model->parameters()) {
      param_sum += p.sum().item<double>();
    }
    for (const auto& b : model->named_buffers()) {
      if (b.key().find("running_") != std::string::npos) {
        stats_sum += b.value().sum().item<double>();
      }
    }
    std::printf(
        "concord-convnet: rank %d world %d device %s steps %ld reforms %ld "
        "test_accuracy %.4f param_sum %.17g running_stats_sum %.17g\n",
        job.rank(), job.world_size(), device.str().c_str(),
        static_cast<long>(state.step()), static_cast<long>(state.reforms()),
        accuracy, param_sum, stats_sum);
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
