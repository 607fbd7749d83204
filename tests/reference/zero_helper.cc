// concord-run --standalone --nproc W -- zero_helper --in IN.pt --out PREFIX
//     [--device DEVICE]
//
// The C++ half of test_zero_reference.py: a program on the public API
// (<concord/concord.h> only) training an MLP under DistributedDataParallel
// with a ZeroRedundancyOptimizer, each worker a rank over Gloo on the CPU,
// or with --device (JobOptions::device, e.g. cuda:0, and backend gloo: the
// ranks may share a GPU) on that device: the model and every batch moved to
// job.device(). A device that is not there fails the Job (one line, exit 1).
// IN.pt (torch.save, written by the test) is a dict:
//   param.<i>: the model's initial parameters, in registration order
//       (Linear(12, 24), Linear(24, 24), Linear(24, 3));
//   x: (S, W, B, 12) every step's inputs of every rank, y: (S, W, B, 3)
//       their targets;
//   optimizer: () int64: 0 SGD (lr, momentum), 1 Adam (lr);
//   lr, momentum: () float64;
//   bucket_view: () int64: ZeroOptions::parameters_as_bucket_view;
//   groups: () int64: 1 one parameter group; 2 the last layer's parameters
//       in a second group (lr / 2) added with add_param_group;
//   overlap: () int64: 0 none, 1 ZeroOptions::overlap_with_ddp with
//       hook_with_zero_step(allreduce_hook), 2 with
//       hook_with_zero_step_interleaved; shard_buckets: () int64 their
//       argument;
//   model: () int64: 0 the MLP above, 1 Linear(12, 512), ReLU,
//       Linear(512, 512), Tanh, Linear(512, 512), ReLU, Linear(512, 3);
//   bucket_cap_mb: () float64: DdpOptions::bucket_cap_mb, negative: unset.
// Every step: zero_grad; mse_loss(ddp(x[s][rank]), y[s][rank]).backward();
// optimizer.step() (not with overlap: backward steps). Then
// consolidate_state_dict(0) and, on rank 0, torch::save of the optimizer,
// loaded back into a plain LibTorch optimizer of the same kind over the model's
// parameters. Rank r writes PREFIX.rank<r>.pt: its final param.<i>, owner.<i>
// (the rank stepping parameter i), local.<i>.<key> (this rank's own optimizer
// state, for the parameters it steps), local_count (how many parameters
// this rank holds optimizer state for) and, on rank 0, state.<i>.<key> (the
// plain optimizer's state after loading the saved one). Then every rank
// calls concord::save_checkpoint(job, PREFIX.ckpt, S, {"optimizer"}): rank
// 0 writes PREFIX.ckpt/<job id>/step-<S>/optimizer.pt, every other rank its
// shard into it (see Note [Shards written where they are] in
// worker/checkpoint/disk.h). Keys: SGD's
// momentum_buffer; Adam's exp_avg, exp_avg_sq and step (int64).
// Exit status 0, or 1 with one line on stderr (2 for a bad command line).

#include <concord/concord.h>
#include <torch/torch.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace {

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

// A parameter's optimizer state by PyTorch's names.
void PutState(Dict& out, const std::string& prefix,
              const torch::optim::OptimizerParamState& s) {
  if (auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(&s)) {
    out.insert(prefix + ".momentum_buffer", sgd->momentum_buffer().clone());
  } else if (auto* adam =
                 dynamic_cast<const torch::optim::AdamParamState*>(&s)) {
    out.insert(prefix + ".exp_avg", adam->exp_avg().clone());
    out.insert(prefix + ".exp_avg_sq", adam->exp_avg_sq().clone());
    out.insert(prefix + ".step", torch::tensor(adam->step()));
  }
}

// `p`'s key in an optimizer's state(): the parameter's TensorImpl as a
// string in LibTorch 1.13, the pointer itself in 2.x.
template <typename Key>
Key KeyOf(const torch::Tensor& p) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream printed;  // c10::guts::to_string of 1.13
    printed << p.unsafeGetTensorImpl();
    return printed.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

torch::optim::OptimizerParamState* StateOf(torch::optim::Optimizer& o,
                                           const torch::Tensor& p) {
  auto& state = o.state();
  auto it =
      state.find(KeyOf<typename std::decay_t<decltype(state)>::key_type>(p));
  return it == state.end() ? nullptr : it->second.get();
}

int Train(const Dict& in, const std::string& prefix,
          const std::string& device) {
  torch::nn::Sequential model;
  if (Get(in, "model").item<int64_t>() == 1) {
    model =
        torch::nn::Sequential(torch::nn::Linear(12, 512), torch::nn::ReLU(),
                              torch::nn::Linear(512, 512), torch::nn::Tanh(),
                              torch::nn::Linear(512, 512), torch::nn::ReLU(),
                              torch::nn::Linear(512, 3));
  } else {
    model = torch::nn::Sequential(torch::nn::Linear(12, 24), torch::nn::ReLU(),
                                  torch::nn::Linear(24, 24), torch::nn::Tanh(),
                                  torch::nn::Linear(24, 3));
  }
  {
    torch::NoGradGuard no_grad;
    auto params = model->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].copy_(Get(in, "param." + std::to_string(i)));
    }
  }
  concord::JobOptions job_options;
  if (!device.empty()) job_options.device(device).backend("gloo");
  concord::Job job(job_options);
  model->to(job.device());
  concord::DdpOptions ddp_options;
  const double cap = Get(in, "bucket_cap_mb").item<double>();
  if (cap >= 0) ddp_options.bucket_cap_mb(cap);
  concord::DistributedDataParallel ddp(model, job, ddp_options);
  const int64_t overlap = Get(in, "overlap").item<int64_t>();
  const bool shard_buckets = Get(in, "shard_buckets").item<int64_t>() != 0;
  const bool adam = Get(in, "optimizer").item<int64_t>() == 1;
  const double lr = Get(in, "lr").item<double>();
  const double momentum = Get(in, "momentum").item<double>();
  const bool two_groups = Get(in, "groups").item<int64_t>() == 2;
  const auto zero_options = concord::ZeroOptions()
                                .parameters_as_bucket_view(
                                    Get(in, "bucket_view").item<int64_t>() != 0)
                                .overlap_with_ddp(overlap != 0);
  std::vector<torch::Tensor> params = ddp->parameters();
  std::vector<torch::Tensor> last(params.end() - 2, params.end());
  if (two_groups) params.resize(params.size() - 2);
  std::unique_ptr<concord::ZeroRedundancyOptimizer> optimizer;
  if (adam) {
    optimizer = std::make_unique<concord::ZeroRedundancyOptimizer>(
        params, torch::optim::AdamOptions(lr), job, zero_options);
    if (two_groups) {
      optimizer->add_param_group(torch::optim::OptimizerParamGroup(
          last, std::make_unique<torch::optim::AdamOptions>(lr / 2)));
    }
  } else {
    optimizer = std::make_unique<concord::ZeroRedundancyOptimizer>(
        params, torch::optim::SGDOptions(lr).momentum(momentum), job,
        zero_options);
    if (two_groups) {
      optimizer->add_param_group(torch::optim::OptimizerParamGroup(
          last, std::make_unique<torch::optim::SGDOptions>(
                    torch::optim::SGDOptions(lr / 2).momentum(momentum))));
    }
  }

  if (overlap == 1) {
    ddp->register_comm_hook(concord::hook_with_zero_step(
        concord::allreduce_hook, ddp, *optimizer, shard_buckets));
  } else if (overlap == 2) {
    ddp->register_comm_hook(concord::hook_with_zero_step_interleaved(
        concord::allreduce_hook, ddp, *optimizer, shard_buckets));
  }

  const torch::Tensor x = Get(in, "x"), y = Get(in, "y");
  TORCH_CHECK(x.size(1) == job.world_size(), "the inputs are for ", x.size(1),
              " ranks, the job has ", job.world_size());
  const int64_t r = job.rank();
  for (int64_t s = 0; s < x.size(0); ++s) {
    optimizer->zero_grad();
    torch::mse_loss(ddp->forward(x[s][r].to(job.device())),
                    y[s][r].to(job.device()))
        .backward();
    if (overlap == 0) optimizer->step();
  }

  Dict result(c10::StringType::get(), c10::TensorType::get());
  const std::vector<torch::Tensor> all = model->parameters();
  const std::vector<int> owners = optimizer->owners();
  for (size_t i = 0; i < all.size(); ++i) {
    const std::string n = std::to_string(i);
    result.insert("param." + n, all[i].detach().clone());
    result.insert("owner." + n, torch::tensor(int64_t{owners[i]}));
    if (owners[i] == job.rank()) {
      auto* s = StateOf(optimizer->local_optimizer(), all[i]);
      TORCH_CHECK(s != nullptr, "no local state for parameter ", i);
      PutState(result, "local." + n, *s);
    }
  }
  result.insert("local_count",
                torch::tensor(static_cast<int64_t>(
                    optimizer->local_optimizer().state().size())));
  optimizer->consolidate_state_dict(0);
  if (job.rank() == 0) {
    const std::string saved = prefix + ".optimizer.pt";
    torch::save(*optimizer, saved);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (const auto& g : optimizer->param_groups()) {
      groups.emplace_back(g.params(), g.options().clone());
    }
    std::unique_ptr<torch::optim::Optimizer> plain;
    if (adam) {
      plain = std::make_unique<torch::optim::Adam>(groups,
                                                   torch::optim::AdamOptions());
    } else {
      plain = std::make_unique<torch::optim::SGD>(groups,
                                                  torch::optim::SGDOptions(lr));
    }
    torch::load(*plain, saved);
    for (size_t i = 0; i < all.size(); ++i) {
      auto* s = StateOf(*plain, all[i]);
      TORCH_CHECK(s != nullptr, "no saved state for parameter ", i);
      PutState(result, "state." + std::to_string(i), *s);
    }
  }
  // The same state in a plain loop's checkpoint (rank 0 writes it whole as
  // PyTorch's state_dict, each rank its own shard into the file).
  concord::CheckpointState checkpoint;
  checkpoint.add("optimizer", *optimizer);
  concord::save_checkpoint(job, prefix + ".ckpt", x.size(0), checkpoint);
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(result));
  const std::string path = prefix + ".rank" + std::to_string(r) + ".pt";
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  TORCH_CHECK(f.good(), "cannot write ", path);
  job.finish();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if ((argc != 5 && argc != 7) || std::string(argv[1]) != "--in" ||
      std::string(argv[3]) != "--out" ||
      (argc == 7 && std::string(argv[5]) != "--device")) {
    std::cerr << "usage: zero_helper --in IN.pt --out PREFIX [--device DEVICE]"
              << std::endl;
    return 2;
  }
  try {
    torch::set_num_threads(1);
    return Train(Load(argv[2]), argv[4], argc == 7 ? argv[6] : "");
  } catch (const std::exception& e) {
    const std::string what = e.what();
    std::cerr << "zero_helper: " << what.substr(0, what.find('\n'))
              << std::endl;
    return 1;
  }
}
