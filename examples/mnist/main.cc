// pytorch/examples' cpp/mnist, elastic: the same model, optimizer,
// normalisation and DataLoader, trained by every worker concord-run starts,
// going on when workers die or join. The lines that a LibTorch program
// without Concord would not have are marked "// concord".
//
//   python3 examples/mnist/prepare_data.py DATA      # idx files (see there)
//   concord-run --standalone --nproc 3 --min-workers 2 --max-restarts 1
//       -- ./concord-mnist --data DATA [--epochs N] [--batch-size B]
//       [--train-samples N] [--test-samples N]      (one command)
//
// Each worker prints, at the end, one line
//   concord-mnist: rank R world W generation G steps S reforms F
//       test_accuracy A param_sum P
// (on one line): the workers' parameters are equal, so P is the same on all.
#include <concord/concord.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

namespace {

// The model of pytorch/examples' cpp/mnist.
struct NetImpl : torch::nn::Module {
  NetImpl()
      : conv1(torch::nn::Conv2dOptions(1, 10, /*kernel_size=*/5)),
        conv2(torch::nn::Conv2dOptions(10, 20, /*kernel_size=*/5)),
        fc1(320, 50),
        fc2(50, 10) {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("conv2_drop", conv2_drop);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }

  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(torch::max_pool2d(conv1->forward(x), 2));
    x = torch::relu(
        torch::max_pool2d(conv2_drop->forward(conv2->forward(x)), 2));
    x = x.view({-1, 320});
    x = torch::relu(fc1->forward(x));
    x = torch::dropout(x, /*p=*/0.5, /*train=*/is_training());
    x = fc2->forward(x);
    return torch::log_softmax(x, /*dim=*/1);
  }

  torch::nn::Conv2d conv1;
  torch::nn::Conv2d conv2;
  torch::nn::Dropout2d conv2_drop;
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Net);

struct Args {
  std::string data;
  int64_t epochs = 10;
  int64_t batch_size = 64;
  int64_t train_samples = 60000;
  int64_t test_samples = 10000;
  int64_t log_interval = 10;
};

[[noreturn]] void Fail(int code, const std::string& message) {
  std::cerr << "concord-mnist: " << message << "\n";
  std::exit(code);
}

Args ParseArgs(int argc, char** argv) {
  Args a;
  const std::string usage =
      " (usage: concord-mnist --data DIR [--epochs N] [--batch-size B] "
      "[--train-samples N] [--test-samples N] [--log-interval N])";
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
    else
      Fail(2, "unknown argument: " + flag + usage);
  }
  if (a.data.empty()) Fail(2, "--data is required" + usage);
  return a;
}

// Accuracy on the first `samples` test images (each worker evaluates the
// same model on the same images, so all agree; no collectives).
double TestAccuracy(Net& model, const std::string& data, int64_t samples,
                    torch::Device device) {
  torch::data::datasets::MNIST test(data,
                                    torch::data::datasets::MNIST::Mode::kTest);
  const int64_t n = std::min<int64_t>(samples, test.size().value());
  auto images = torch::data::transforms::Normalize<>(
      0.1307, 0.3081)(test.images().narrow(0, 0, n));
  auto targets = test.targets().narrow(0, 0, n);
  torch::NoGradGuard no_grad;
  model->eval();
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
    Net model;
    model->to(device);
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

    torch::optim::SGD optimizer(ddp->parameters(),
                                torch::optim::SGDOptions(0.01).momentum(0.5));
    concord::ElasticState state(ddp, optimizer, sampler);  // concord

    concord::run_elastic(state, [&] {  // concord
      for (; state.epoch() < args.epochs; state.next_epoch()) {
        int64_t batch_idx = 0;
        for (auto& batch : *train_loader) {
          auto data = batch.data.to(device), targets = batch.target.to(device);
          optimizer.zero_grad();
          auto output = ddp->forward(data);
          auto loss = torch::nll_loss(output, targets);
          loss.backward();
          optimizer.step();
          state.commit();  // concord
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
    double param_sum = 0;
    for (const auto& p : model->parameters()) {
      param_sum += p.sum().item<double>();
    }
    std::printf(
        "concord-mnist: rank %d world %d device %s generation %ld steps %ld "
        "reforms %ld test_accuracy %.4f param_sum %.17g\n",
        job.rank(), job.world_size(), device.str().c_str(),
        static_cast<long>(job.generation()), static_cast<long>(state.step()),
        static_cast<long>(state.reforms()), accuracy, param_sum);
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
