// pytorch/examples' cpp/dcgan, elastic: the same generator (a TORCH_MODULE
// of ConvTranspose2d, BatchNorm2d and ReLU ending in Tanh), discriminator
// (an nn::Sequential of Conv2d, BatchNorm2d and LeakyReLU ending in
// Sigmoid), two Adam optimizers and the same step, on Fashion-MNIST, with
// both models in DistributedDataParallel and one ElasticState holding both
// models, both optimizers and the sampler. The channels are a quarter of
// upstream's so that a CPU run of a few hundred steps takes seconds. The
// lines that a LibTorch program without Concord would not have are marked
// "// concord".
//
//   python3 examples/mnist/prepare_data.py DATA      # idx files (see there)
//   concord-run --standalone --nproc 3 --min-workers 2 --max-restarts 1
//       -- ./concord-dcgan --data DATA [--epochs N] [--batch-size B]
//       [--train-samples N] [--log-interval N] [--seed S] [--out DIR]
//       [--noise global|step]   (one command)
//
// The step's random numbers (label smoothing and noise) come from the
// global generators, as upstream's, each rank's seeded by its rank. concord:
// they are part of every commit and, per rank, of every checkpoint (see
// Note [Each rank's randomness] in worker/checkpoint/content.h): a step cut
// off by a failure is taken again drawing what it drew, and a job resumed
// from a checkpoint draws on each rank what it would have drawn. After a
// re-form a survivor goes on with its own stream under its new rank, so
// which streams train on which shards depends on which rank died. With
// --noise step they come instead from a generator seeded by (seed, step,
// rank): the run is then a function of the commits, the step numbers and
// the ranks alone, the same whichever worker dies (the test of the four
// fault points compares such runs).
//
// A step trains the discriminator on real images and on the generator's
// fakes, steps its optimizer, then trains the generator through the
// discriminator and steps the generator's optimizer; only then is the step
// committed. When a worker dies anywhere in it (even after the
// discriminator's optimizer stepped), run_elastic puts both models and both
// optimizers back to the last commit and the survivors take the step again
// (see Note [Early optimizer steps] in worker/elastic/state.h).
//
// Each worker prints, at the end, one line
//   concord-dcgan: rank R world W device D generation G steps S reforms F
//       d_loss L g_loss L generator_sum P generator_crc C
//       discriminator_sum P discriminator_crc C
// (on one line): the workers' parameters are equal, so the sums and the
// CRC-32s of the parameters' bytes are the same on all. Rank 0 writes
// generator-checkpoint.pt, discriminator-checkpoint.pt and dcgan-sample.pt
// (10 images in [0, 1]) into --out, as upstream's checkpoints.
#include <ATen/CPUGeneratorImpl.h>
#include <concord/concord.h>
#include <torch/torch.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

namespace {

// The size of the noise vector fed to the generator.
constexpr int64_t kNoiseSize = 100;
// The discriminator's first and the generator's last hidden channels
// (upstream: 64).
constexpr int64_t kChannels = 16;

// upstream's DCGANGenerator: 1x1 noise -> 4x4 -> 7x7 -> 14x14 -> 28x28.
struct DCGANGeneratorImpl : torch::nn::Module {
  explicit DCGANGeneratorImpl(int64_t noise_size)
      : conv1(torch::nn::ConvTranspose2dOptions(noise_size, 4 * kChannels, 4)
                  .bias(false)),
        batch_norm1(4 * kChannels),
        conv2(torch::nn::ConvTranspose2dOptions(4 * kChannels, 2 * kChannels, 3)
                  .stride(2)
                  .padding(1)
                  .bias(false)),
        batch_norm2(2 * kChannels),
        conv3(torch::nn::ConvTranspose2dOptions(2 * kChannels, kChannels, 4)
                  .stride(2)
                  .padding(1)
                  .bias(false)),
        batch_norm3(kChannels),
        conv4(torch::nn::ConvTranspose2dOptions(kChannels, 1, 4)
                  .stride(2)
                  .padding(1)
                  .bias(false)) {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("conv3", conv3);
    register_module("conv4", conv4);
    register_module("batch_norm1", batch_norm1);
    register_module("batch_norm2", batch_norm2);
    register_module("batch_norm3", batch_norm3);
  }

  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(batch_norm1(conv1(x)));
    x = torch::relu(batch_norm2(conv2(x)));
    x = torch::relu(batch_norm3(conv3(x)));
    x = torch::tanh(conv4(x));
    return x;
  }

  torch::nn::ConvTranspose2d conv1;
  torch::nn::BatchNorm2d batch_norm1;
  torch::nn::ConvTranspose2d conv2;
  torch::nn::BatchNorm2d batch_norm2;
  torch::nn::ConvTranspose2d conv3;
  torch::nn::BatchNorm2d batch_norm3;
  torch::nn::ConvTranspose2d conv4;
};
TORCH_MODULE(DCGANGenerator);

// upstream's discriminator: 28x28 -> 14x14 -> 7x7 -> 3x3 -> 1x1.
torch::nn::Sequential Discriminator() {
  using namespace torch::nn;
  return Sequential(
      // Layer 1
      Conv2d(Conv2dOptions(1, kChannels, 4).stride(2).padding(1).bias(false)),
      LeakyReLU(LeakyReLUOptions().negative_slope(0.2)),
      // Layer 2
      Conv2d(Conv2dOptions(kChannels, 2 * kChannels, 4)
                 .stride(2)
                 .padding(1)
                 .bias(false)),
      BatchNorm2d(2 * kChannels),
      LeakyReLU(LeakyReLUOptions().negative_slope(0.2)),
      // Layer 3
      Conv2d(Conv2dOptions(2 * kChannels, 4 * kChannels, 4)
                 .stride(2)
                 .padding(1)
                 .bias(false)),
      BatchNorm2d(4 * kChannels),
      LeakyReLU(LeakyReLUOptions().negative_slope(0.2)),
      // Layer 4
      Conv2d(
          Conv2dOptions(4 * kChannels, 1, 3).stride(1).padding(0).bias(false)),
      Sigmoid());
}

struct Args {
  std::string data, out;
  int64_t epochs = 5;
  int64_t batch_size = 64;
  int64_t train_samples = 60000;
  int64_t log_interval = 10;
  int64_t seed = 1;
  std::string noise = "global";
};

[[noreturn]] void Fail(int code, const std::string& message) {
  std::cerr << "concord-dcgan: " << message << "\n";
  std::exit(code);
}

Args ParseArgs(int argc, char** argv) {
  Args a;
  const std::string usage =
      " (usage: concord-dcgan --data DIR [--epochs N] [--batch-size B] "
      "[--train-samples N] [--log-interval N] [--seed S] [--out DIR] "
      "[--noise global|step])";
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) Fail(2, "incomplete argument: " + flag + usage);
    const std::string value = argv[++i];
    if (flag == "--data" || flag == "--out") {
      (flag == "--data" ? a.data : a.out) = value;
      continue;
    }
    if (flag == "--noise") {
      if (value != "global" && value != "step") {
        Fail(2, "--noise: global or step, not " + value + usage);
      }
      a.noise = value;
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
    else if (flag == "--log-interval")
      a.log_interval = v;
    else if (flag == "--seed")
      a.seed = v;
    else
      Fail(2, "unknown argument: " + flag + usage);
  }
  if (a.data.empty()) Fail(2, "--data is required" + usage);
  return a;
}

// CRC-32 (zlib's, Python's zlib.crc32) of every parameter's bytes in order:
// equal on two ranks only when their parameters are equal bit for bit.
uint32_t ParameterCrc(torch::nn::Module& module) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  for (const auto& p : module.parameters()) {
    const torch::Tensor host = p.detach().to(torch::kCPU).contiguous();
    const auto* bytes = static_cast<const uint8_t*>(host.data_ptr());
    for (size_t i = 0; i < host.nbytes(); ++i) {
      crc = table[(crc ^ bytes[i]) & 0xFFu] ^ (crc >> 8);
    }
  }
  return crc ^ 0xFFFFFFFFu;
}

double ParameterSum(torch::nn::Module& module) {
  double sum = 0;
  for (const auto& p : module.parameters()) sum += p.sum().item<double>();
  return sum;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = ParseArgs(argc, argv);
  torch::manual_seed(1);
  try {
    concord::Job job;  // concord
    const torch::Device device = job.device();
    // concord: on a GPU, deterministic cuDNN kernels, so that a step taken
    // again after a re-form is the same computation (below).
    at::globalContext().setDeterministicCuDNN(true);
    at::globalContext().setBenchmarkCuDNN(false);

    DCGANGenerator generator(kNoiseSize);
    generator->to(device);
    torch::nn::Sequential discriminator = Discriminator();
    discriminator->to(device);
    // concord: both models data-parallel. DDP's default broadcast_buffers
    // keeps their BatchNorm statistics equal across ranks before every
    // forward, as PyTorch's DDP does. Every rank makes them in this order,
    // and a re-form rebinds them in it.
    concord::DistributedDataParallel generator_ddp(generator, job);
    concord::DistributedDataParallel discriminator_ddp(discriminator, job);

    auto dataset = torch::data::datasets::MNIST(args.data)
                       .map(torch::data::transforms::Normalize<>(0.5, 0.5))
                       .map(torch::data::transforms::Stack<>());
    const size_t train_size = static_cast<size_t>(
        std::min<int64_t>(args.train_samples, dataset.size().value()));
    concord::ElasticSampler sampler(train_size, job);  // concord
    auto data_loader = torch::data::make_data_loader(
        std::move(dataset), sampler,
        torch::data::DataLoaderOptions()
            .batch_size(static_cast<size_t>(args.batch_size))
            .workers(2));

    torch::optim::Adam generator_optimizer(
        generator_ddp->parameters(),
        torch::optim::AdamOptions(2e-4).betas(std::make_tuple(0.5, 0.999)));
    torch::optim::Adam discriminator_optimizer(
        discriminator_ddp->parameters(),
        torch::optim::AdamOptions(2e-4).betas(std::make_tuple(0.5, 0.999)));

    // Each rank draws its own noise (the models' initial weights, drawn
    // above, are rank 0's everywhere: DDP broadcasts them).
    torch::manual_seed(static_cast<uint64_t>(args.seed) * 1000 + 1 +
                       static_cast<uint64_t>(job.rank()));
    concord::ElasticState state(job);  // concord: everything a step changes
    state.add("generator", generator_ddp)
        .add("discriminator", discriminator_ddp)
        .add("generator_optimizer", generator_optimizer)
        .add("discriminator_optimizer", discriminator_optimizer)
        .add(sampler);

    double d_loss_last = 0, g_loss_last = 0;
    concord::run_elastic(state, [&] {  // concord
      for (; state.epoch() < args.epochs; state.next_epoch()) {
        int64_t batch_index = 0;
        for (torch::data::Example<>& batch : *data_loader) {
          // The global generators, or with --noise step one seeded by
          // (seed, step, rank) (see the top of this file).
          c10::optional<at::Generator> step_gen;
          if (args.noise == "step") {
            step_gen =
                at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(
                    args.seed + (state.step() + 1) * 1000 + job.rank()));
          }
          const int64_t n = batch.data.size(0);

          // Train discriminator with real images.
          discriminator->zero_grad();
          torch::Tensor real_images = batch.data.to(device);
          torch::Tensor real_labels =
              torch::empty(n).uniform_(0.8, 1.0, step_gen).to(device);
          torch::Tensor real_output = discriminator_ddp->forward(real_images)
                                          .reshape(real_labels.sizes());
          torch::Tensor d_loss_real =
              torch::binary_cross_entropy(real_output, real_labels);
          d_loss_real.backward();

          // Train discriminator with fake images.
          torch::Tensor noise =
              step_gen.has_value()
                  ? torch::randn({n, kNoiseSize, 1, 1}, step_gen).to(device)
                  : torch::randn({n, kNoiseSize, 1, 1}, device);
          torch::Tensor fake_images = generator_ddp->forward(noise);
          torch::Tensor fake_labels = torch::zeros(n, device);
          torch::Tensor fake_output =
              discriminator_ddp->forward(fake_images.detach())
                  .reshape(fake_labels.sizes());
          torch::Tensor d_loss_fake =
              torch::binary_cross_entropy(fake_output, fake_labels);
          d_loss_fake.backward();

          torch::Tensor d_loss = d_loss_real + d_loss_fake;
          discriminator_optimizer.step();

          // Train generator.
          generator->zero_grad();
          fake_labels.fill_(1);
          fake_output = discriminator_ddp->forward(fake_images)
                            .reshape(fake_labels.sizes());
          torch::Tensor g_loss =
              torch::binary_cross_entropy(fake_output, fake_labels);
          g_loss.backward();
          generator_optimizer.step();
          state.commit();  // concord: both models' step is done

          d_loss_last = d_loss.item<double>();
          g_loss_last = g_loss.item<double>();
          if (job.rank() == 0 && batch_index++ % args.log_interval == 0) {
            std::printf(
                "Train Epoch: %ld [%5zu/%5zu] world %d D_loss: %.4f | "
                "G_loss: %.4f\n",
                static_cast<long>(state.epoch() + 1), sampler.position(),
                train_size, job.world_size(), d_loss_last, g_loss_last);
            std::fflush(stdout);
          }
        }
      }
    });  // concord

    if (!args.out.empty() && job.rank() == 0) {  // concord: one writer
      std::filesystem::create_directories(args.out);
      torch::save(generator, args.out + "/generator-checkpoint.pt");
      torch::save(discriminator, args.out + "/discriminator-checkpoint.pt");
      torch::NoGradGuard no_grad;
      generator->eval();
      auto gen = at::make_generator<at::CPUGeneratorImpl>(
          static_cast<uint64_t>(args.seed));
      torch::Tensor samples = generator->forward(
          torch::randn({10, kNoiseSize, 1, 1}, gen).to(device));
      torch::save((samples.cpu() + 1.0) / 2.0, args.out + "/dcgan-sample.pt");
    }
    std::printf(
        "concord-dcgan: rank %d world %d device %s generation %ld steps %ld "
        "reforms %ld d_loss %.6f g_loss %.6f generator_sum %.17g "
        "generator_crc %08x discriminator_sum %.17g discriminator_crc %08x\n",
        job.rank(), job.world_size(), device.str().c_str(),
        static_cast<long>(job.generation()), static_cast<long>(state.step()),
        static_cast<long>(state.reforms()), d_loss_last, g_loss_last,
        ParameterSum(*generator),
        static_cast<unsigned>(ParameterCrc(*generator)),
        ParameterSum(*discriminator),
        static_cast<unsigned>(ParameterCrc(*discriminator)));
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
