// concord-train: trains a TorchScript module on tensor data with Concord's
// DistributedDataParallel. Run it under `concord-run`; alone it trains as a
// world of one.
//
// Exit status: 0 done; 2 bad flags or inputs (one line on stderr, before any
// training); 1 a failure while training.

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "tools/train_data.h"
#include "worker/ddp/distributed_data_parallel.h"
#include "worker/session.h"
#include "worker/syncbn/sync_batch_norm.h"

namespace {

using concord::train::Loss;

struct Flags {
  std::string model;
  std::string data;
  std::string loss = "cross_entropy";
  std::string optimizer = "sgd";
  double lr = 0.01;
  double momentum = 0;
  double weight_decay = 0;
  int64_t batch_size = 32;
  int64_t epochs = 1;
  bool shuffle = false;
  uint64_t seed = 0;
  std::string output;
  std::string metrics_out;
  int64_t log_interval = 10;
  std::string log_level = "info";
  // DDP (PyTorch's and apex's options).
  double bucket_cap_mb = 25;
  bool find_unused_parameters = false;
  bool static_graph = false;
  int64_t grad_accum = 1;
  std::string comm_hook;
  bool gradient_as_bucket_view = false;
  bool no_broadcast_buffers = false;
  std::vector<std::string> ignore;
  bool delay_allreduce = false;
  bool allreduce_always_fp32 = false;
  double predivide_factor = 1.0;
  bool no_gradient_average = false;
  int64_t message_size = 0;
  std::vector<std::string> allreduce_trigger_params;
  bool sync_bn = false;
};

[[noreturn]] void Fail(int code, const std::string& message) {
  std::cerr << "concord-train: " << message << std::endl;
  std::exit(code);
}

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  CLI::App app{"Trains a TorchScript model with Concord DDP."};
  app.add_option("--model", f.model,
                 "TorchScript module (torch.jit.save), or builtin:cnn")
      ->required();
  app.add_option("--data", f.data,
                 "dict {'inputs': Tensor, 'targets': Tensor} (torch.save)")
      ->required();
  app.add_option("--loss", f.loss)
      ->check(CLI::IsMember({"cross_entropy", "mse"}));
  app.add_option("--optimizer", f.optimizer)->check(CLI::IsMember({"sgd"}));
  app.add_option("--lr", f.lr)->check(CLI::PositiveNumber);
  app.add_option("--momentum", f.momentum)->check(CLI::Range(0.0, 1.0));
  app.add_option("--weight-decay", f.weight_decay)
      ->check(CLI::NonNegativeNumber);
  app.add_option("--batch-size", f.batch_size, "samples per rank and step")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_option("--epochs", f.epochs)
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_flag("--shuffle", f.shuffle, "shuffle every epoch (seeded)");
  app.add_option("--seed", f.seed);
  app.add_option("--output", f.output,
                 "write every named parameter and buffer here at the end");
  app.add_option("--metrics-out", f.metrics_out, "write step-time JSON here");
  app.add_option("--log-interval", f.log_interval,
                 "steps between progress lines")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_option("--log-level", f.log_level)
      ->check(CLI::IsMember({"debug", "info", "warn", "error"}));
  auto* ddp = app.add_option_group("DDP", "DistributedDataParallel options");
  auto* cap =
      ddp->add_option("--bucket-cap-mb", f.bucket_cap_mb,
                      "bucket size cap in MiB (PyTorch's bucket_cap_mb)")
          ->check(CLI::PositiveNumber);
  ddp->add_flag("--find-unused-parameters", f.find_unused_parameters);
  ddp->add_flag("--static-graph", f.static_graph);
  ddp->add_option("--grad-accum", f.grad_accum,
                  "micro-batches per optimizer step (K-1 under no_sync)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  ddp->add_option("--comm-hook", f.comm_hook,
                  "allreduce, fp16, bf16 or powersgd[:RANK[:START_ITER]]");
  ddp->add_flag("--gradient-as-bucket-view", f.gradient_as_bucket_view);
  ddp->add_flag("--no-broadcast-buffers", f.no_broadcast_buffers);
  ddp->add_option("--ignore", f.ignore,
                  "parameter or buffer left out of DDP (repeatable)");
  ddp->add_flag("--delay-allreduce", f.delay_allreduce, "apex: no overlap");
  ddp->add_flag("--allreduce-always-fp32", f.allreduce_always_fp32);
  ddp->add_option("--predivide-factor", f.predivide_factor,
                  "apex gradient_predivide_factor")
      ->check(CLI::PositiveNumber);
  ddp->add_flag("--no-gradient-average", f.no_gradient_average,
                "apex gradient_average=False: sum, do not average");
  auto* message = ddp->add_option("--message-size", f.message_size,
                                  "apex: bucket threshold in elements")
                      ->check(CLI::PositiveNumber);
  ddp->add_option("--allreduce-trigger-params", f.allreduce_trigger_params,
                  "apex: parameters whose gradient closes a bucket");
  message->excludes(cap);
  app.add_flag("--sync-bn", f.sync_bn,
               "SyncBatchNorm (C++-frontend models only: refused for "
               "TorchScript)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    std::exit(app.exit(e));
  } catch (const CLI::ParseError& e) {
    Fail(2, e.what());
  }
  return f;
}

// Rank r of W takes samples r, r+W, ... of `order`.
std::vector<int64_t> Shard(const std::vector<int64_t>& order, int rank,
                           int world) {
  std::vector<int64_t> shard;
  for (size_t i = static_cast<size_t>(rank); i < order.size(); i += world) {
    shard.push_back(order[i]);
  }
  return shard;
}

concord::DdpOptions DdpOptionsFrom(const Flags& f) {
  concord::DdpOptions o;
  o.bucket_cap_bytes = static_cast<int64_t>(f.bucket_cap_mb * 1024 * 1024);
  o.find_unused_parameters = f.find_unused_parameters;
  o.static_graph = f.static_graph;
  o.gradient_as_bucket_view = f.gradient_as_bucket_view;
  o.broadcast_buffers = !f.no_broadcast_buffers;
  o.ignore = f.ignore;
  o.delay_allreduce = f.delay_allreduce;
  o.allreduce_always_fp32 = f.allreduce_always_fp32;
  o.gradient_predivide_factor = f.predivide_factor;
  o.gradient_average = !f.no_gradient_average;
  o.message_size = f.message_size;
  o.allreduce_trigger_params = f.allreduce_trigger_params;
  return o;
}

// What a heartbeat tells the coordinator about the last synchronised step.
concord::v1::DdpTimings Timings(const concord::ddp::ReducerStats& stats,
                                double step_ms) {
  concord::v1::DdpTimings t;
  t.set_step_ms(step_ms);
  t.set_forward_ms(stats.forward_compute_us / 1e3);
  t.set_backward_ms(stats.backward_compute_us / 1e3);
  // Communication not hidden behind backward.
  t.set_allreduce_wait_ms(
      std::max<int64_t>(0, stats.backward_comm_us - stats.overlap_us) / 1e3);
  t.set_buckets(static_cast<int32_t>(stats.bucket_bytes.size()));
  return t;
}

int64_t BatchesOf(int64_t samples, int64_t batch) {
  return (samples + batch - 1) / batch;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

int Train(const Flags& flags) {
  const Loss loss = flags.loss == "mse" ? Loss::kMse : Loss::kCrossEntropy;
  // Validate everything before joining: a bad input never starts a job.
  const bool builtin = absl::StartsWith(flags.model, "builtin:");
  std::optional<torch::jit::Module> script;
  if (!builtin) {
    auto loaded = concord::train::LoadModel(flags.model);
    if (!loaded.ok()) Fail(2, std::string(loaded.status().message()));
    script = std::move(*loaded);
    if (flags.sync_bn) {
      // A scripted BatchNorm's forward is compiled TorchScript: no C++
      // module can take its place (ConvertSyncBatchNorm needs the C++
      // frontend), and Python's nn.SyncBatchNorm is not scriptable.
      Fail(2, "--sync-bn: " + flags.model +
                  " is TorchScript, whose BatchNorm layers can't be swapped "
                  "from C++; use --model builtin:cnn, or "
                  "concord::ConvertSyncBatchNorm in a C++-frontend program");
    }
  }
  auto data = concord::train::LoadData(flags.data, loss);
  if (!data.ok()) Fail(2, std::string(data.status().message()));
  torch::nn::Sequential net{nullptr};
  if (builtin) {
    auto made = concord::train::BuiltinModel(flags.model, *data, loss,
                                             flags.seed, flags.data);
    if (!made.ok()) Fail(2, std::string(made.status().message()));
    net = *made;
  } else if (auto st = concord::train::CheckModelFitsData(
                 *script, *data, loss, flags.model, flags.data);
             !st.ok()) {
    Fail(2, std::string(st.message()));
  }
  // Names and tensors of the model, whichever kind it is.
  std::vector<std::pair<std::string, torch::Tensor>> named_params,
      named_buffers;
  if (script) {
    for (const auto& p : script->named_parameters(/*recurse=*/true)) {
      named_params.emplace_back(p.name, p.value);
    }
    for (const auto& b : script->named_buffers(/*recurse=*/true)) {
      named_buffers.emplace_back(b.name, b.value);
    }
  } else {
    for (const auto& p : net->named_parameters(/*recurse=*/true)) {
      named_params.emplace_back(p.key(), p.value());
    }
    for (const auto& b : net->named_buffers(/*recurse=*/true)) {
      named_buffers.emplace_back(b.key(), b.value());
    }
  }
  {
    // Names given to DDP must exist in the model (checked again by DDP,
    // but then on every rank after joining).
    std::set<std::string> params, state;
    for (const auto& [name, t] : named_params) {
      params.insert(name);
      state.insert(name);
    }
    for (const auto& [name, t] : named_buffers) state.insert(name);
    for (const auto& name : flags.ignore) {
      if (state.count(name) == 0) {
        Fail(2, absl::StrCat("--ignore ", name, ": --model ", flags.model,
                             " has no such parameter or buffer"));
      }
    }
    for (const auto& name : flags.allreduce_trigger_params) {
      if (params.count(name) == 0) {
        Fail(2, absl::StrCat("--allreduce-trigger-params ", name, ": --model ",
                             flags.model, " has no such parameter"));
      }
    }
  }
  concord::DdpOptions ddp_options = DdpOptionsFrom(flags);
  if (auto st = concord::DistributedDataParallel::ValidateOptions(
          ddp_options, !flags.comm_hook.empty());
      !st.ok()) {
    Fail(2, std::string(st.message()));
  }
  if (!flags.comm_hook.empty()) {
    // A world of one is enough to check the name.
    auto hook = concord::ddp::MakeCommHook(flags.comm_hook, nullptr);
    if (!hook.ok()) {
      Fail(2, absl::StrCat("--comm-hook: ", hook.status().message()));
    }
  }
  auto options = concord::worker::WorkerOptions::FromEnvironment();
  if (!options.ok()) Fail(2, std::string(options.status().message()));

  auto session = concord::worker::Session::Start(*options);
  if (!session.ok()) {
    Fail(1, absl::StrCat("cannot join the job: ", session.status().ToString()));
  }
  concord::worker::Session& s = **session;
  const int rank = s.rank();
  const int world = s.world_size();
  const bool leader = rank == s.authoritative_rank();

  const int64_t n = data->size();
  // Every rank must run the same number of steps (uneven inputs need the
  // join protocol of the elastic worker).
  const int64_t steps_per_epoch =
      BatchesOf((n + world - 1) / world, flags.batch_size);
  for (int r = 0; r < world; ++r) {
    const int64_t mine = (n - r + world - 1) / world;
    if (BatchesOf(mine, flags.batch_size) != steps_per_epoch) {
      s.Finish(false, "uneven inputs").IgnoreError();
      Fail(2, absl::StrFormat(
                  "--data %s: %d samples over %d ranks with --batch-size %d "
                  "give rank 0 %d batches but rank %d %d; uneven inputs are "
                  "not supported yet",
                  flags.data, n, world, flags.batch_size, steps_per_epoch, r,
                  BatchesOf(mine, flags.batch_size)));
    }
  }

  ddp_options.collective_timeout = options->collective_timeout;
  std::shared_ptr<concord::SyncBnGroup> sync_bn_group;
  absl::StatusOr<std::unique_ptr<concord::DistributedDataParallel>> ddp;
  if (script) {
    script->train();
    ddp = concord::DistributedDataParallel::Create(
        *script, s.shared_communicator(), s.authoritative_rank(), ddp_options);
  } else {
    if (flags.sync_bn) {
      concord::comm::CollectiveOptions bn_options;
      bn_options.timeout = options->collective_timeout;
      sync_bn_group = std::make_shared<concord::SyncBnGroup>(
          s.shared_communicator(), bn_options);
      concord::ConvertSyncBatchNorm(net.ptr(), sync_bn_group);
    }
    net->train();
    ddp = concord::DistributedDataParallel::Create(
        net.ptr(), s.shared_communicator(), s.authoritative_rank(),
        ddp_options);
  }
  if (!ddp.ok()) Fail(1, ddp.status().ToString());
  auto forward = [&](const torch::Tensor& x) -> torch::Tensor {
    if (script) return (*ddp)->Forward({x}).toTensor();
    return (*ddp)->Forward([&] { return net->forward(x); });
  };
  if (!flags.comm_hook.empty()) {
    concord::comm::CollectiveOptions hook_options;
    hook_options.timeout = options->collective_timeout;
    auto hook = concord::ddp::MakeCommHook(
        flags.comm_hook, s.shared_communicator(), hook_options);
    if (!hook.ok())
      Fail(2, absl::StrCat("--comm-hook: ", hook.status().message()));
    if (auto st = (*ddp)->RegisterCommHook(*hook); !st.ok()) {
      Fail(2, absl::StrCat("--comm-hook: ", st.message()));
    }
  }
  // The optimizer takes every trainable parameter, also those DDP ignores
  // (they train on their local gradient, as in PyTorch).
  std::vector<torch::Tensor> trainable;
  for (const auto& [name, p] : named_params) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  torch::optim::SGD optimizer(trainable, torch::optim::SGDOptions(flags.lr)
                                             .momentum(flags.momentum)
                                             .weight_decay(flags.weight_decay));

  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  const int64_t total_steps = steps_per_epoch * flags.epochs;
  std::vector<double> step_ms;
  double last_loss = 0;
  int64_t step = 0;
  int64_t samples_done = 0;
  const auto start = std::chrono::steady_clock::now();
  if (leader) {
    std::cout << absl::StrFormat(
                     "concord-train: %d samples, world size %d, generation "
                     "%d, %d steps per epoch, %d epochs",
                     n, world, s.generation(), steps_per_epoch, flags.epochs)
              << std::endl;
  }
  for (int64_t epoch = 0; epoch < flags.epochs; ++epoch) {
    if (flags.shuffle) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(flags.seed + epoch);
      torch::Tensor perm = torch::randperm(n, gen, torch::kLong);
      std::copy(perm.data_ptr<int64_t>(), perm.data_ptr<int64_t>() + n,
                order.begin());
    }
    const std::vector<int64_t> shard = Shard(order, rank, world);
    const torch::Tensor shard_index = torch::tensor(shard, torch::kLong);
    for (int64_t b = 0; b < steps_per_epoch; ++b) {
      const auto t0 = std::chrono::steady_clock::now();
      const int64_t begin = b * flags.batch_size;
      const int64_t len =
          std::min<int64_t>(flags.batch_size, shard_index.size(0) - begin);
      const torch::Tensor idx = shard_index.narrow(0, begin, len);
      const torch::Tensor x = data->inputs.index_select(0, idx);
      const torch::Tensor y = data->targets.index_select(0, idx);

      // Gradient accumulation: K-1 micro-batches under no_sync, then a
      // synchronised one and the optimizer step (also at the epoch's end).
      const bool step_now =
          (b + 1) % flags.grad_accum == 0 || b + 1 == steps_per_epoch;
      torch::Tensor l;
      double optimizer_ms = 0;
      if (step_now) {
        l = concord::train::ComputeLoss(loss, forward(x), y);
        l.backward();
        const auto t_opt = std::chrono::steady_clock::now();
        optimizer.step();
        optimizer_ms = std::chrono::duration<double, std::milli>(
                           std::chrono::steady_clock::now() - t_opt)
                           .count();
        optimizer.zero_grad();
      } else {
        auto no_sync = (*ddp)->NoSync();
        l = concord::train::ComputeLoss(loss, forward(x), y);
        l.backward();
      }

      const auto t1 = std::chrono::steady_clock::now();
      step_ms.push_back(
          std::chrono::duration<double, std::milli>(t1 - t0).count());
      if (step_now) {
        concord::v1::DdpTimings timings =
            Timings((*ddp)->stats(), step_ms.back());
        timings.set_optimizer_ms(optimizer_ms);
        s.ReportDdpTimings(timings);
      }
      ++step;
      // Global samples of this step: every rank's batch at index b.
      for (int r = 0; r < world; ++r) {
        const int64_t shard_r = (n - r + world - 1) / world;
        samples_done += std::max<int64_t>(
            0, std::min<int64_t>(flags.batch_size, shard_r - begin));
      }
      last_loss = l.item<double>();
      const double elapsed = std::chrono::duration<double>(t1 - start).count();
      const double sps = elapsed > 0 ? samples_done / elapsed : 0;
      s.ReportProgress(step, sps);
      if (leader && (step % flags.log_interval == 0 || step == total_steps)) {
        std::cout << absl::StrFormat(
                         "epoch %d/%d step %d/%d loss %.6f samples/s %.1f",
                         epoch + 1, flags.epochs, step, total_steps, last_loss,
                         sps)
                  << std::endl;
      }
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  if (leader) {
    // Step time without warm-up (the first steps allocate and connect).
    std::vector<double> timed(step_ms.begin() + (step_ms.size() > 2 ? 2 : 0),
                              step_ms.end());
    const double mean = timed.empty()
                            ? 0
                            : std::accumulate(timed.begin(), timed.end(), 0.0) /
                                  static_cast<double>(timed.size());
    if (!flags.output.empty()) {
      if (auto st =
              concord::train::SaveState((*ddp)->NamedState(), flags.output);
          !st.ok()) {
        Fail(1, std::string(st.message()));
      }
    }
    if (!flags.metrics_out.empty()) {
      const auto& stats = (*ddp)->stats();
      nlohmann::json m = {{"world_size", world},
                          {"bucket_bytes", stats.bucket_bytes},
                          {"bucket_rebuilds", stats.rebuilds},
                          {"forward_compute_us", stats.forward_compute_us},
                          {"backward_compute_us", stats.backward_compute_us},
                          {"backward_comm_us", stats.backward_comm_us},
                          {"overlap_us", stats.overlap_us},
                          {"steps", step},
                          {"step_time_ms_mean", mean},
                          {"step_time_ms_median", Median(timed)},
                          {"samples_per_second", samples_done / seconds},
                          {"final_loss", last_loss}};
      std::ofstream(flags.metrics_out) << m.dump(2) << "\n";
    }
    std::cout << absl::StrFormat(
                     "concord-train: done: %d steps in %.2f s, %.1f "
                     "samples/s, mean step %.2f ms, final loss %.6f%s",
                     step, seconds, samples_done / seconds, mean, last_loss,
                     flags.output.empty()
                         ? ""
                         : absl::StrCat(", wrote ", flags.output))
              << std::endl;
  }
  if (auto st = s.Finish(true, ""); !st.ok()) {
    spdlog::warn("leaving the job: {}", st.ToString());
  }
  return 0;
}

}  // namespace

int ConcordTrainMain(int argc, char** argv) {
  const Flags flags = ParseFlags(argc, argv);
  concord::InitLogging("concord-train", flags.log_level);
  try {
    return Train(flags);
  } catch (const concord::Error& e) {
    Fail(1, e.status().ToString());
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    Fail(1, what.substr(0, what.find('\n')));
  } catch (const std::exception& e) {
    Fail(1, e.what());
  }
}
