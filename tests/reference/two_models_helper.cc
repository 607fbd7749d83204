// concord-run --standalone --nproc W -- two_models_helper --in IN.pt
//     --out PREFIX
//
// The C++ half of test_two_models_reference.py: a GAN-like program on the
// public API (<concord/concord.h> only), two DistributedDataParallel modules
// in one job, each worker a rank over Gloo on the CPU. IN.pt (torch.save,
// written by the test) is a dict:
//   g.param.<i>, g.buffer.<i>, d.param.<i>, d.buffer.<i>: the generator's and
//       the discriminator's initial parameters and buffers, in registration
//       order;
//   real: (S, W, B, 16) every step's real samples of every rank,
//   real_labels: (S, W, B) their (smoothed) labels, noise: (S, W, B, 8);
//   lr, momentum: () float64 (SGD's);
//   hook: () int64: 1 registers a communication hook with state on the
//       discriminator (the bucket divided by the world size, allreduced,
//       times 0.5 on the odd calls of the hook's own counter);
//   plain: () int64: 1 gives DDP std::make_shared<Net>() of plain
//       `struct Net : torch::nn::Module`s; 0 the usual holders (a
//       TORCH_MODULE generator, an nn::Sequential discriminator).
// Every step (S of them): discriminator.zero_grad(); D(real) backward;
// fake = G(noise); D(fake.detach()) backward; D's optimizer steps;
// generator.zero_grad(); D(fake) backward through D and G; G's optimizer
// steps; commit (in run_elastic, with an ElasticState holding both).
// Rank r writes PREFIX.rank<r>.pt (torch.load-able): its final g.param.<i>,
// g.buffer.<i>, d.param.<i>, d.buffer.<i>, and hook_calls (int64).
// Exit status 0, or 1 with one line on stderr (2 for a bad command line).

#include <concord/concord.h>
#include <torch/torch.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

namespace {

constexpr int64_t kNoise = 8, kHidden = 32, kData = 16;

// A plain module (no TORCH_MODULE): Linear, BatchNorm1d, ReLU, Linear, Tanh.
struct GeneratorNet : torch::nn::Module {
  GeneratorNet()
      : fc1(register_module("fc1", torch::nn::Linear(kNoise, kHidden))),
        bn(register_module("bn", torch::nn::BatchNorm1d(kHidden))),
        fc2(register_module("fc2", torch::nn::Linear(kHidden, kData))) {}
  torch::Tensor forward(torch::Tensor x) {
    return torch::tanh(fc2(torch::relu(bn(fc1(x)))));
  }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear fc2;
};
// The holder form of the same module.
TORCH_MODULE_IMPL(Generator, GeneratorNet);

// A plain module: Linear, BatchNorm1d, LeakyReLU(0.2), Linear, Sigmoid.
struct DiscriminatorNet : torch::nn::Module {
  DiscriminatorNet()
      : fc1(register_module("fc1", torch::nn::Linear(kData, kHidden))),
        bn(register_module("bn", torch::nn::BatchNorm1d(kHidden))),
        fc2(register_module("fc2", torch::nn::Linear(kHidden, 1))) {}
  torch::Tensor forward(torch::Tensor x) {
    return torch::sigmoid(fc2(torch::leaky_relu(bn(fc1(x)), 0.2)));
  }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear fc2;
};
// The same as an nn::Sequential (the holder form).
torch::nn::Sequential DiscriminatorSequential() {
  using namespace torch::nn;
  return Sequential(Linear(kData, kHidden), BatchNorm1d(kHidden),
                    LeakyReLU(LeakyReLUOptions().negative_slope(0.2)),
                    Linear(kHidden, 1), Sigmoid());
}

using Dict = c10::Dict<c10::IValue, c10::IValue>;

torch::Tensor Get(const Dict& d, const std::string& key) {
  auto it = d.find(c10::IValue(key));
  TORCH_CHECK(it != d.end(), "missing key ", key);
  return it->value().toTensor();
}

Dict Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "cannot open ", path);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                          std::istreambuf_iterator<char>());
  return torch::pickle_load(bytes).toGenericDict();
}

// Copies the initial parameters and buffers named `prefix`.<kind>.<i>.
void Init(torch::nn::Module& module, const Dict& in,
          const std::string& prefix) {
  torch::NoGradGuard no_grad;
  auto params = module.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].copy_(Get(in, prefix + ".param." + std::to_string(i)));
  }
  auto buffers = module.buffers();
  for (size_t i = 0; i < buffers.size(); ++i) {
    buffers[i].copy_(Get(in, prefix + ".buffer." + std::to_string(i)));
  }
}

void Put(Dict& out, torch::nn::Module& module, const std::string& prefix) {
  auto params = module.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    out.insert(prefix + ".param." + std::to_string(i),
               params[i].detach().clone());
  }
  auto buffers = module.buffers();
  for (size_t i = 0; i < buffers.size(); ++i) {
    out.insert(prefix + ".buffer." + std::to_string(i), buffers[i].clone());
  }
}

// PyTorch's register_comm_hook(state, hook) with a state of its own.
struct HalvingState {
  int64_t calls = 0;
};

// The program: `generator` and `discriminator` are what DDP wraps (holders
// or shared_ptrs); gen and disc the torch::nn::Module inside each.
template <typename G, typename D>
int Train(const Dict& in, const std::string& prefix, G generator,
          D discriminator, torch::nn::Module& gen, torch::nn::Module& disc) {
  Init(gen, in, "g");
  Init(disc, in, "d");
  concord::Job job;
  concord::DistributedDataParallel generator_ddp(generator, job);
  concord::DistributedDataParallel discriminator_ddp(discriminator, job);
  auto hook_state = std::make_shared<HalvingState>();
  if (Get(in, "hook").item<int64_t>() != 0) {
    discriminator_ddp->register_comm_hook(
        hook_state, [](HalvingState& s, concord::GradBucket& bucket) {
          concord::ProcessGroup& group = bucket.process_group();
          torch::Tensor t = bucket.buffer().div_(group.size());
          const double factor = ++s.calls % 2 ? 0.5 : 1.0;
          return group.allreduce(t).then(
              [factor](torch::Tensor sum) { return sum.mul_(factor); });
        });
  }
  const double lr = Get(in, "lr").item<double>();
  const double momentum = Get(in, "momentum").item<double>();
  torch::optim::SGD g_opt(generator_ddp->parameters(),
                          torch::optim::SGDOptions(lr).momentum(momentum));
  torch::optim::SGD d_opt(discriminator_ddp->parameters(),
                          torch::optim::SGDOptions(lr).momentum(momentum));
  concord::ElasticState state(job);
  state.add("generator", generator_ddp)
      .add("discriminator", discriminator_ddp)
      .add("generator_optimizer", g_opt)
      .add("discriminator_optimizer", d_opt);

  const torch::Tensor real = Get(in, "real"), labels = Get(in, "real_labels");
  const torch::Tensor noise = Get(in, "noise");
  const int64_t steps = real.size(0);
  TORCH_CHECK(real.size(1) == job.world_size(), "the inputs are for ",
              real.size(1), " ranks, the job has ", job.world_size());
  concord::run_elastic(state, [&] {
    while (state.step() < steps) {
      const int64_t s = state.step(), r = job.rank();
      disc.zero_grad(/*set_to_none=*/false);
      torch::Tensor out = discriminator_ddp->forward(real[s][r]).view({-1});
      torch::binary_cross_entropy(out, labels[s][r]).backward();
      torch::Tensor fake = generator_ddp->forward(noise[s][r]);
      out = discriminator_ddp->forward(fake.detach()).view({-1});
      torch::binary_cross_entropy(out, torch::zeros_like(out)).backward();
      d_opt.step();
      gen.zero_grad(/*set_to_none=*/false);
      out = discriminator_ddp->forward(fake).view({-1});
      torch::binary_cross_entropy(out, torch::ones_like(out)).backward();
      g_opt.step();
      state.commit();
    }
  });

  Dict result(c10::StringType::get(), c10::TensorType::get());
  Put(result, gen, "g");
  Put(result, disc, "d");
  result.insert("hook_calls", torch::tensor(hook_state->calls));
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(result));
  const std::string path =
      prefix + ".rank" + std::to_string(job.rank()) + ".pt";
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  TORCH_CHECK(f.good(), "cannot write ", path);
  job.finish();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5 || std::string(argv[1]) != "--in" ||
      std::string(argv[3]) != "--out") {
    std::cerr << "usage: two_models_helper --in IN.pt --out PREFIX"
              << std::endl;
    return 2;
  }
  try {
    torch::set_num_threads(1);
    const Dict in = Load(argv[2]);
    const std::string prefix = argv[4];
    if (Get(in, "plain").item<int64_t>() != 0) {
      auto generator = std::make_shared<GeneratorNet>();
      auto discriminator = std::make_shared<DiscriminatorNet>();
      return Train(in, prefix, generator, discriminator, *generator,
                   *discriminator);
    }
    Generator generator;
    torch::nn::Sequential discriminator = DiscriminatorSequential();
    return Train(in, prefix, generator, discriminator, *generator,
                 *discriminator);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    std::cerr << "two_models_helper: " << what.substr(0, what.find('\n'))
              << std::endl;
    return 1;
  }
}
