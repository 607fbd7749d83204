// concord-train: trains a TorchScript module on tensor data with Concord's
// DistributedDataParallel. Run it under `concord-run`; alone it trains as a
// world of one.
//
// Exit status: 0 done; 2 bad flags or inputs (one line on stderr, before any
// training); 1 a failure while training.

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "common/environment.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "concord/concord.h"
#include "tools/fault_injection.h"
#include "tools/progress.h"
#include "tools/slowmo_flags.h"
#include "tools/train_data.h"
#include "tools/train_flags.h"

namespace {

using concord::train::Loss;

using Flags = concord::train::TrainFlags;

// The progress output (ConcordTrainMain's); null before it exists.
concord::train::Progress* progress_output = nullptr;

[[noreturn]] void Fail(int code, const std::string& message) {
  if (progress_output != nullptr) progress_output->BreakLine();
  std::cerr << "concord-train: " << message << std::endl;
  std::exit(code);
}

int64_t BatchesOf(int64_t samples, int64_t batch) {
  return (samples + batch - 1) / batch;
}

// Bytes this process has written (Linux /proc/self/io "wchar": every
// write/writev, which is how Gloo sends; gRPC's sendmsg is not counted);
// -1 where it cannot be read.
int64_t BytesWritten() {
  std::ifstream io("/proc/self/io");
  std::string key;
  int64_t value = 0;
  while (io >> key >> value) {
    if (key == "wchar:") return value;
  }
  return -1;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

// What concord-train reads and checks before it joins the job: a bad input
// never starts one (exit 2 with one line).
struct Prepared {
  Loss loss = Loss::kCrossEntropy;
  std::optional<torch::jit::Module> script;  // a TorchScript --model
  torch::nn::Sequential net{nullptr};        // or a built-in one
  concord::train::Dataset data;
  std::vector<std::pair<std::string, torch::Tensor>> named_params,
      named_buffers;
  concord::DdpOptions ddp;
  concord::JobOptions job;
  torch::Device device = torch::kCPU;  // where the model trains
  int max_workers = 1;                 // the environment's, before joining
};

// The library names the JobOptions field it was given ("JobOptions::device
// cuda:3: ...", "JobOptions::checkpoints.every: ..."); concord-train names
// the flag that set it ("--device cuda:3: ..."). A message about the
// environment names its variable already.
std::string FlagMessage(const std::string& message) {
  static const std::pair<absl::string_view, absl::string_view> kFlags[] = {
      {"JobOptions::device", "--device"},
      {"JobOptions::backend", "--backend"},
      {"JobOptions::checkpoints.", "--checkpoint-"},
      {"JobOptions::trace_file", "--trace"}};
  for (const auto& [field, flag] : kFlags) {
    if (absl::StartsWith(message, field)) {
      return absl::StrCat(flag, message.substr(field.size()));
    }
  }
  return message;
}

// The job's flags over the environment's values (concord-run's).
concord::JobOptions JobOptionsOf(const Flags& flags) {
  concord::JobOptions job;
  if (!flags.device.empty()) job.device(flags.device);
  if (!flags.backend.empty()) job.backend(flags.backend);
  concord::CheckpointOptions checkpoints;
  if (flags.checkpoint_dir) checkpoints.dir(*flags.checkpoint_dir);
  if (flags.checkpoint_every) checkpoints.every(*flags.checkpoint_every);
  if (flags.checkpoint_keep) checkpoints.keep(*flags.checkpoint_keep);
  if (flags.no_resume) checkpoints.resume(false);
  // Its own loop writes parameters and optimizer state only in the
  // optimizer's step, after the backward: see Note [Overlapped snapshots].
  // CONCORD_CHECKPOINT_OVERLAP=0 says otherwise.
  if (std::getenv(std::string(concord::env::kCheckpointOverlap.name).c_str()) ==
      nullptr) {
    checkpoints.overlap(true);
  }
  job.checkpoints(checkpoints);
  return job;
}

Prepared Prepare(const Flags& flags) {
  Prepared in;
  // The job as the flags and what concord-run set (the launcher's
  // contract, docs/cli.md) describe it, planned on this machine before
  // anything is loaded: a bad flag, value or device joins nothing;
  // see Note [Worker device]. The job is then given the device itself, so
  // that it does not resolve `auto` again.
  in.job = JobOptionsOf(flags);
  concord::JobPlan plan;
  try {
    plan = concord::plan_job(in.job);
  } catch (const concord::Error& e) {
    Fail(2, FlagMessage(e.message()));
  }
  in.loss = flags.loss == "mse" ? Loss::kMse : Loss::kCrossEntropy;
  const bool builtin = absl::StartsWith(flags.model, "builtin:");
  if (!builtin) {
    // The same arithmetic with every LibTorch (see Note [LibTorch versions]).
    concord::disable_torchscript_cpu_fusion();
    auto loaded = concord::train::LoadModel(flags.model);
    if (!loaded.ok()) Fail(2, std::string(loaded.status().message()));
    in.script = std::move(*loaded);
    if (flags.sync_bn) {
      // A scripted BatchNorm's forward is compiled TorchScript: no C++
      // module can take its place (convert_sync_batchnorm needs the C++
      // frontend), and Python's nn.SyncBatchNorm is not scriptable.
      Fail(2, "--sync-bn: " + flags.model +
                  " is TorchScript, whose BatchNorm layers can't be swapped "
                  "from C++; use --model builtin:cnn, or "
                  "concord::convert_sync_batchnorm in a C++-frontend program");
    }
  }
  auto data = concord::train::LoadData(flags.data, in.loss);
  if (!data.ok()) Fail(2, std::string(data.status().message()));
  in.data = *std::move(data);
  if (builtin) {
    auto made = concord::train::BuiltinModel(flags.model, in.data, in.loss,
                                             flags.seed, flags.data);
    if (!made.ok()) Fail(2, std::string(made.status().message()));
    in.net = *made;
  } else if (auto st = concord::train::CheckModelFitsData(
                 *in.script, in.data, in.loss, flags.model, flags.data);
             !st.ok()) {
    Fail(2, std::string(st.message()));
  }
  // `auto` without a GPU says so once.
  if (!plan.device_note.empty()) {
    std::cerr << "concord-train: " << FlagMessage(plan.device_note)
              << std::endl;
  }
  in.max_workers = plan.max_workers;
  in.device = plan.device;
  in.job.device(in.device.str());
  if (in.script) {
    in.script->to(in.device);
  } else {
    in.net->to(in.device);
  }
  // Names and tensors of the model, whichever kind it is.
  if (in.script) {
    for (const auto& p : in.script->named_parameters(/*recurse=*/true)) {
      in.named_params.emplace_back(p.name, p.value);
    }
    for (const auto& b : in.script->named_buffers(/*recurse=*/true)) {
      in.named_buffers.emplace_back(b.name, b.value);
    }
  } else {
    for (const auto& p : in.net->named_parameters(/*recurse=*/true)) {
      in.named_params.emplace_back(p.key(), p.value());
    }
    for (const auto& b : in.net->named_buffers(/*recurse=*/true)) {
      in.named_buffers.emplace_back(b.key(), b.value());
    }
  }
  {
    // Names given to DDP must exist in the model (checked again by DDP,
    // but then on every rank after joining).
    std::set<std::string> params, state;
    for (const auto& [name, t] : in.named_params) {
      params.insert(name);
      state.insert(name);
    }
    for (const auto& [name, t] : in.named_buffers) state.insert(name);
    for (const auto& name : flags.ddp.params_and_buffers_to_ignore()) {
      if (state.count(name) == 0) {
        Fail(2, absl::StrCat("--ignore ", name, ": --model ", flags.model,
                             " has no such parameter or buffer"));
      }
    }
    for (const auto& name : flags.ddp.allreduce_trigger_params()) {
      if (params.count(name) == 0) {
        Fail(2, absl::StrCat("--allreduce-trigger-params ", name, ": --model ",
                             flags.model, " has no such parameter"));
      }
    }
  }
  in.ddp = flags.ddp;
  try {
    in.ddp.validate();
  } catch (const concord::Error& e) {
    const std::string hook = "DdpOptions::comm_hook: ";
    Fail(2, absl::StartsWith(e.message(), hook)
                ? "--comm-hook: " + e.message().substr(hook.size())
                : e.message());
  }
  // The timeline: --trace alone, or the file concord-run --trace gave.
  if (!flags.trace.empty() && !plan.trace_file.empty()) {
    Fail(2,
         "--trace: concord-run --trace collects this worker's timeline "
         "already; give --trace to one of them");
  }
  if (!flags.trace.empty() && in.max_workers > 1) {
    Fail(2, absl::StrFormat(
                "--trace %s: the job's %d workers would all write this file; "
                "give --trace to concord-run (it merges the workers' "
                "timelines) or set CONCORD_TRACE_FILE per worker",
                flags.trace, in.max_workers));
  }
  if (!flags.trace.empty()) in.job.trace_file(flags.trace);
  return in;
}

// The run's figures for --metrics-out.
struct RunFigures {
  int64_t batches = 0;  // forward/backward passes, micro-batches included
  int64_t samples_done = 0;
  double seconds = 0;
  double mean_ms = 0, median_ms = 0;  // step time without warm-up
  // Each step this process committed and its whole time, in order (the
  // first steps included).
  std::vector<std::pair<int64_t, double>> step_ms;
  double last_loss = 0;
  int64_t written = -1;  // bytes written while training; -1: unknown
  // Per re-form: when the first step after it was done (Unix us).
  std::vector<int64_t> first_step_after_reform;
};

// Bytes of optimizer state this rank keeps: a ZeroRedundancyOptimizer's
// state_bytes(), else every parameter's state tensors (not its step count).
int64_t OptimizerStateBytes(const torch::optim::Optimizer& optimizer) {
  namespace optim = torch::optim;
  if (const auto* zero =
          dynamic_cast<const concord::ZeroRedundancyOptimizer*>(&optimizer)) {
    return zero->state_bytes();
  }
  int64_t bytes = 0;
  auto add = [&bytes](const torch::Tensor& t) {
    if (t.defined()) bytes += static_cast<int64_t>(t.nbytes());
  };
  for (const auto& [key, s] : optimizer.state()) {
    if (const auto* sgd = dynamic_cast<const optim::SGDParamState*>(s.get())) {
      add(sgd->momentum_buffer());
    } else if (const auto* adam =
                   dynamic_cast<const optim::AdamParamState*>(s.get())) {
      add(adam->exp_avg());
      add(adam->exp_avg_sq());
      add(adam->max_exp_avg_sq());
    } else if (const auto* adamw =
                   dynamic_cast<const optim::AdamWParamState*>(s.get())) {
      add(adamw->exp_avg());
      add(adamw->exp_avg_sq());
      add(adamw->max_exp_avg_sq());
    } else if (const auto* rms =
                   dynamic_cast<const optim::RMSpropParamState*>(s.get())) {
      add(rms->square_avg());
      add(rms->momentum_buffer());
      add(rms->grad_avg());
    } else if (const auto* ada =
                   dynamic_cast<const optim::AdagradParamState*>(s.get())) {
      add(ada->sum());
    }
  }
  return bytes;
}

// --metrics-out: the authoritative rank's figures as JSON.
void WriteMetrics(const Flags& flags, const concord::Job& job,
                  const concord::ElasticState& state,
                  const torch::optim::Optimizer& optimizer,
                  const concord::DdpStats& stats, const RunFigures& run) {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  nlohmann::json m = {
      {"algorithm", flags.slowmo.algorithm},
      {"world_size", job.world_size()},
      {"generation", job.generation()},
      {"reforms", state.reforms()},
      {"bucket_bytes", stats.bucket_bytes},
      {"bucket_rebuilds", stats.bucket_rebuilds},
      {"initial_bucket_params", stats.initial_bucket_params},
      {"bucket_params", stats.bucket_params},
      {"forward_compute_us", stats.forward_compute_us},
      {"backward_compute_us", stats.backward_compute_us},
      {"backward_comm_us", stats.backward_comm_us},
      {"overlap_us", stats.overlap_us},
      {"steps", run.batches},
      {"optimizer_steps", state.step()},
      {"optimizer_state_bytes", OptimizerStateBytes(optimizer)},
      {"peak_rss_bytes", static_cast<int64_t>(usage.ru_maxrss) * 1024},
      {"step_time_ms_mean", run.mean_ms},
      {"step_time_ms_median", run.median_ms},
      {"step_times_ms", run.step_ms},
      {"samples_per_second", run.samples_done / run.seconds},
      {"final_loss", run.last_loss},
      {"bytes_written", run.written},
      {"bytes_written_per_step", run.written < 0 || state.step() == 0
                                     ? -1.0
                                     : static_cast<double>(run.written) /
                                           static_cast<double>(state.step())}};
  nlohmann::json reforms = nlohmann::json::array();
  const auto& records = state.reform_log();
  for (size_t i = 0; i < records.size(); ++i) {
    const auto& r = records[i];
    reforms.push_back(
        {{"reason", r.reason},
         {"generation", r.generation},
         {"world_size", r.world_size},
         {"started_unix_us", r.started_us},
         {"rendezvous_unix_us", r.rendezvous_us},
         {"synced_unix_us", r.synced_us},
         {"first_step_done_unix_us", i < run.first_step_after_reform.size()
                                         ? run.first_step_after_reform[i]
                                         : 0}});
  }
  m["reform_log"] = reforms;
  std::ofstream(flags.metrics_out) << m.dump(2) << "\n";
}

// Which samples a step trains on: fixed sharding gives every rank of the
// first generation a shard of its own (PyTorch's DistributedSampler without
// padding; a worker admitted later has none); elastic sharding is the
// ElasticSampler's windows over whoever is there.
class FixedShards {
 public:
  FixedShards(const Flags& flags, int64_t n, int shards)
      : flags_(flags), n_(n), shards_(shards), order_(static_cast<size_t>(n)) {
    // Shard 0 is the largest.
    steps_per_epoch_ = BatchesOf((n + shards - 1) / shards, flags.batch_size);
  }
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  int shards() const { return shards_; }

  // Shard j's batch at its step k (empty once it is done).
  std::vector<int64_t> Batch(int j, int64_t k) {
    const int64_t shard_size = (n_ - j + shards_ - 1) / shards_;
    const int64_t per_epoch = BatchesOf(shard_size, flags_.batch_size);
    if (per_epoch == 0 || k / per_epoch >= flags_.epochs) return {};
    const auto& o = OrderOf(k / per_epoch);
    const int64_t begin = (k % per_epoch) * flags_.batch_size;
    const int64_t len = std::min(flags_.batch_size, shard_size - begin);
    std::vector<int64_t> idx;
    for (int64_t i = begin; i < begin + len; ++i) {
      idx.push_back(o[static_cast<size_t>(j + i * shards_)]);
    }
    return idx;
  }

 private:
  // The epoch's order: PyTorch's DistributedSampler (seed + epoch).
  const std::vector<int64_t>& OrderOf(int64_t epoch) {
    if (order_epoch_ != epoch) {
      std::iota(order_.begin(), order_.end(), 0);
      if (flags_.shuffle) {
        auto gen =
            at::make_generator<at::CPUGeneratorImpl>(flags_.seed + epoch);
        torch::Tensor perm = torch::randperm(n_, gen, torch::kLong);
        std::copy(perm.data_ptr<int64_t>(), perm.data_ptr<int64_t>() + n_,
                  order_.begin());
      }
      order_epoch_ = epoch;
    }
    return order_;
  }

  const Flags& flags_;
  const int64_t n_;
  const int shards_;
  int64_t steps_per_epoch_ = 0;
  std::vector<int64_t> order_;
  int64_t order_epoch_ = -1;
};

// The training loop over a joined job, for either kind of model
// (`Model`: torch::nn::Sequential or torch::jit::Module): the constructor
// wraps the model in DDP and makes the optimizer and the elastic state, Run
// trains under run_elastic (fixed or elastic sharding) and Finish writes
// what the run made.
template <typename Model>
class Trainer {
 public:
  Trainer(const Flags& flags, Prepared& in, concord::Job& job, Model model,
          concord::train::Progress& progress)
      : flags_(flags),
        in_(in),
        job_(job),
        progress_(progress),
        n_(in.data.size()),
        fixed_(flags.sharding == "fixed"),
        fault_(concord::train::FaultInjection::FromEnvironment()),
        ddp_(std::move(model), job, in.ddp),
        optimizer_(MakeOptimizer(flags, Trainable(in), job)),
        sampler_(static_cast<size_t>(n_), job,
                 concord::ElasticSamplerOptions()
                     .shuffle(flags.shuffle)
                     .seed(static_cast<uint64_t>(flags.seed))),
        // Fixed sharding: this worker's shard is its rank in the first
        // generation it trains in.
        shard_(job.rank()),
        shards_(flags, n_, job.world_size()) {
    if (flags.zero_options.overlap_with_ddp()) {
      // --zero-overlap: the optimizer steps in DDP's backward.
      auto& zero = dynamic_cast<concord::ZeroRedundancyOptimizer&>(*optimizer_);
      ddp_->register_comm_hook(
          flags.zero_overlap == "interleaved"
              ? concord::hook_with_zero_step_interleaved(
                    concord::allreduce_hook, ddp_, zero,
                    flags.zero_shard_buckets)
              : concord::hook_with_zero_step(concord::allreduce_hook, ddp_,
                                             zero, flags.zero_shard_buckets));
    }
    if (fault_.Armed("backward") && !optimizer_->param_groups().empty() &&
        !optimizer_->param_groups()[0].params().empty()) {
      // The first parameter's gradient comes last in backward: by then
      // buckets are in flight.
      optimizer_->param_groups()[0].params().front().register_hook(
          [this](const torch::Tensor&) { fault_.MaybeDie("backward"); });
    }
    const auto elastic_options =
        concord::ElasticStateOptions()
            .divide_by_initial_world_size(
                !flags.no_divide_by_initial_world_size)
            .throw_on_early_termination(flags.throw_on_early_termination)
            // A newcomer has no fixed shard: the world only shrinks.
            .admit_workers(!fixed_);
    if (fixed_) {
      state_.emplace(ddp_, *optimizer_, elastic_options);
    } else {
      state_.emplace(ddp_, *optimizer_, sampler_, elastic_options);
    }
    // The "forward" fault point: after the step agreement, before DDP's
    // buffer broadcast and the model's forward (SyncBatchNorm's allgather).
    state_->on_step_begin([this](int64_t step) {
      fault_.step = step;
      fault_.MaybeDie("forward");
    });
    if (!flags.sample_log.empty() && !fixed_) {
      const std::string path =
          absl::StrCat(flags.sample_log, "/", job.worker_id(), ".samples");
      sample_log_.open(path, std::ios::app);
      if (!sample_log_) Fail(2, "--sample-log: cannot write " + path);
    }
  }

  // Trains to the end (or until this worker left); exit 1 when the job
  // failed.
  void Run() {
    start_ = std::chrono::steady_clock::now();
    if (job_.rank() == job_.authoritative_rank()) {
      progress_.PrintLine(absl::StrFormat(
          "concord-train: %d samples, world size %d, generation %d, %s "
          "sharding, %d epochs",
          n_, job_.world_size(), job_.generation(), flags_.sharding,
          flags_.epochs));
    }
    const int64_t written_before = BytesWritten();
    try {
      concord::run_elastic(*state_, [&] {
        if (fixed_) {
          TrainFixed();
        } else {
          TrainElastic();
        }
      });
    } catch (const concord::Error& e) {
      job_.finish(false, e.message());
      Fail(1, e.what());
    }
    run_.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_)
            .count();
    // Gloo's traffic and the few progress lines written while training.
    run_.written = written_before < 0 ? -1 : BytesWritten() - written_before;
  }

  // The outputs, the metrics and the last line; the job finished.
  int Finish() {
    concord::ElasticState& state = *state_;
    if (left_) {
      progress_.PrintLine(absl::StrFormat(
          "concord-train: worker %s ran out of data after step %d and left "
          "the job",
          job_.worker_id(), state.step()));
      return 0;
    }
    std::vector<std::pair<std::string, torch::Tensor>> named_state =
        in_.named_params;
    named_state.insert(named_state.end(), in_.named_buffers.begin(),
                       in_.named_buffers.end());
    if (!flags_.output_per_worker.empty()) {
      const std::string path =
          absl::StrCat(flags_.output_per_worker, "/", job_.worker_id(), ".pt");
      if (auto st = concord::train::SaveState(named_state, path); !st.ok()) {
        Fail(1, std::string(st.message()));
      }
    }
    if (job_.rank() == job_.authoritative_rank()) {
      // Step time without warm-up (the first steps allocate and connect).
      std::vector<double> timed;
      for (size_t i = run_.step_ms.size() > 2 ? 2 : 0; i < run_.step_ms.size();
           ++i) {
        timed.push_back(run_.step_ms[i].second);
      }
      run_.mean_ms = timed.empty()
                         ? 0
                         : std::accumulate(timed.begin(), timed.end(), 0.0) /
                               static_cast<double>(timed.size());
      run_.median_ms = Median(timed);
      if (!flags_.output.empty()) {
        if (auto st = concord::train::SaveState(named_state, flags_.output);
            !st.ok()) {
          Fail(1, std::string(st.message()));
        }
      }
      if (!flags_.metrics_out.empty()) {
        WriteMetrics(flags_, job_, state, *optimizer_, ddp_->stats(), run_);
      }
      progress_.PrintLine(absl::StrFormat(
          "concord-train: done: %d steps in %.2f s, %.1f samples/s, mean step "
          "%.2f ms, final loss %.6f, generation %d, world size %d%s",
          state.step(), run_.seconds, run_.samples_done / run_.seconds,
          run_.mean_ms, run_.last_loss, job_.generation(), job_.world_size(),
          flags_.output.empty() ? ""
                                : absl::StrCat(", wrote ", flags_.output)));
    }
    job_.finish(true);
    return 0;
  }

 private:
  static constexpr bool kScript = std::is_same_v<Model, torch::jit::Module>;

  // --optimizer's, sharded over the ranks with --zero.
  template <typename Optimizer, typename Options>
  static std::unique_ptr<torch::optim::Optimizer> Make(
      const Flags& flags, std::vector<torch::Tensor> params,
      const Options& options, const concord::Job& job) {
    if (flags.zero) {
      return std::make_unique<concord::ZeroRedundancyOptimizer>(
          std::move(params), options, job, flags.zero_options);
    }
    return std::make_unique<Optimizer>(std::move(params), options);
  }
  static std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(
      const Flags& flags, std::vector<torch::Tensor> params,
      const concord::Job& job) {
    if (flags.optimizer == "adam") {
      return Make<torch::optim::Adam>(
          flags, std::move(params),
          torch::optim::AdamOptions(flags.lr).weight_decay(flags.weight_decay),
          job);
    }
    if (flags.optimizer == "adamw") {
      return Make<torch::optim::AdamW>(
          flags, std::move(params),
          torch::optim::AdamWOptions(flags.lr).weight_decay(flags.weight_decay),
          job);
    }
    return Make<torch::optim::SGD>(flags, std::move(params),
                                   torch::optim::SGDOptions(flags.lr)
                                       .momentum(flags.momentum)
                                       .weight_decay(flags.weight_decay),
                                   job);
  }

  // The optimizer takes every trainable parameter, also those DDP ignores
  // (they train on their local gradient, as in PyTorch).
  static std::vector<torch::Tensor> Trainable(const Prepared& in) {
    std::vector<torch::Tensor> trainable;
    for (const auto& [name, p] : in.named_params) {
      if (p.requires_grad()) trainable.push_back(p);
    }
    return trainable;
  }

  torch::Tensor Forward(const torch::Tensor& x) {
    if constexpr (kScript) {
      return ddp_->forward(std::vector<c10::IValue>{x}).toTensor();
    } else {
      return ddp_->forward(x);
    }
  }
  std::pair<torch::Tensor, torch::Tensor> ToDevice(const torch::Tensor& index) {
    return std::make_pair(
        in_.data.inputs.index_select(0, index).to(in_.device),
        in_.data.targets.index_select(0, index).to(in_.device));
  }

  // The job's optimizer steps at the current world size (elastic sharding:
  // the rest of the epoch and the epochs after it are split over the ranks
  // there are now).
  int64_t TotalSteps() {
    if (fixed_) return shards_.steps_per_epoch() * flags_.epochs;
    const concord::ElasticState& state = *state_;
    const int world = job_.world_size();
    int64_t total = state.step();
    if (state.epoch() < flags_.epochs) {
      total += concord::train::StepsToEpochEnd(
                   n_, static_cast<int64_t>(sampler_.position()), world,
                   flags_.batch_size, flags_.grad_accum) +
               (flags_.epochs - state.epoch() - 1) *
                   concord::train::StepsToEpochEnd(
                       n_, 0, world, flags_.batch_size, flags_.grad_accum);
    }
    return total;
  }

  // After a committed step: every --log-interval steps (and the last on a
  // terminal), on the authoritative rank. `epoch`: the step's (0-based; the
  // state may have moved on to the next).
  void Report(int64_t epoch, double sps) {
    if (job_.rank() != job_.authoritative_rank()) return;
    const int64_t step = state_->step();
    // A bar also shows the last step.
    if (step % flags_.log_interval != 0 &&
        !(progress_.terminal() && step == TotalSteps())) {
      return;
    }
    concord::train::ProgressLine line;
    line.epoch = epoch + 1;
    line.epochs = flags_.epochs;
    line.step = step;
    line.total_steps = TotalSteps();
    line.loss = run_.last_loss;
    line.samples_per_second = sps;
    line.generation = job_.generation();
    line.world_size = job_.world_size();
    progress_.Update(line);
  }

  // One optimizer step on `index`, the job taking `job_samples` in it. The
  // step agreement runs in the first forward of a step (the library's).
  // Returns the samples a second so far.
  double TakeStep(const torch::Tensor& index, int64_t job_samples) {
    fault_.Pace();
    fault_.MaybeBusy(state_->step() + 1);
    step_start_ = std::chrono::steady_clock::now();
    const auto [x, y] = ToDevice(index);
    fault_.step = state_->step() + 1;
    torch::Tensor l = concord::train::ComputeLoss(in_.loss, Forward(x), y);
    {
      concord::TraceScope span(job_, "backward");
      l.backward();
    }
    if (!flags_.zero_options.overlap_with_ddp()) {
      concord::TraceScope span(job_, "optimizer");
      optimizer_->step();
    }
    fault_.MaybeDie("optimizer");
    // Zeroed, not dropped, whatever the LibTorch version's default:
    // PyTorch's zero_grad(set_to_none=False).
    concord::zero_grad(*optimizer_, /*set_to_none=*/false);
    ++run_.batches;
    run_.samples_done += job_samples;
    run_.last_loss = l.item<double>();
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_)
            .count();
    return elapsed > 0 ? run_.samples_done / elapsed : 0;
  }

  // After the commit: the first step of a generation is logged, SlowMo
  // averages (see Note [SlowMo step]: a failure here leaves the committed
  // step owing its average, which the re-form finishes), progress goes out.
  void AfterCommit(int64_t epoch, double sps) {
    concord::ElasticState& state = *state_;
    const size_t reforms = state.reform_log().size();
    if (run_.first_step_after_reform.size() < reforms) {
      run_.first_step_after_reform.resize(reforms,
                                          absl::ToUnixMicros(absl::Now()));
      spdlog::info("step {} done: the first in generation {}, world size {}",
                   state.step(), job_.generation(), job_.world_size());
    }
    Report(epoch, sps);
    if (flags_.ddp.slowmo()) {
      fault_.MaybeDie("slowmo");
      ddp_->perform_slowmo(*optimizer_);
    }
    job_.report_progress(state.step(), sps, run_.last_loss);
    // A step's time is whole: forward, backward, the optimizer, the commit
    // and SlowMo's averaging (a DDP step's communication is in its
    // backward, SlowMo's here).
    run_.step_ms.emplace_back(
        state.step(), std::chrono::duration<double, std::milli>(
                          std::chrono::steady_clock::now() - step_start_)
                          .count());
  }

  void TrainFixed() {
    concord::ElasticState& state = *state_;
    for (;;) {
      std::vector<int64_t> mine = shards_.Batch(shard_, state.step());
      if (mine.empty()) {
        left_ = ddp_->join();
        return;
      }
      int64_t job_samples = 0;
      for (int j = 0; j < shards_.shards(); ++j) {
        job_samples +=
            static_cast<int64_t>(shards_.Batch(j, state.step()).size());
      }
      const int64_t epoch =
          state.step() / std::max<int64_t>(1, shards_.steps_per_epoch());
      const double sps =
          TakeStep(torch::tensor(mine, torch::kLong), job_samples);
      state.commit();
      AfterCommit(epoch, sps);
    }
  }

  // The sampler's next window: its indices and how many samples the job
  // takes in it.
  std::pair<torch::Tensor, int64_t> NextWindow() {
    const size_t before = sampler_.position();
    auto mine = sampler_.next(static_cast<size_t>(flags_.batch_size));
    std::vector<int64_t> idx(mine->begin(), mine->end());
    return std::make_pair(torch::tensor(idx, torch::kLong),
                          static_cast<int64_t>(sampler_.position() - before));
  }

  // Gradient accumulation: K-1 micro-batches under no_sync, then a
  // synchronised one and the optimizer step (also at the epoch's end); a
  // failure goes back to the first of the K.
  void TrainElastic() {
    concord::ElasticState& state = *state_;
    while (state.epoch() < flags_.epochs) {
      auto window = NextWindow();
      for (int64_t micro = 1;
           micro < flags_.grad_accum && sampler_.position() < sampler_.size();
           ++micro) {
        auto no_sync = ddp_->no_sync();
        const auto [x, y] = ToDevice(window.first);
        torch::Tensor l = concord::train::ComputeLoss(in_.loss, Forward(x), y);
        {
          concord::TraceScope span(job_, "backward");
          l.backward();
        }
        run_.samples_done += window.second;
        ++run_.batches;
        window = NextWindow();
      }
      const double sps = TakeStep(window.first, window.second);
      const int64_t step_epoch = state.epoch();
      if (sample_log_.is_open()) {
        sample_log_ << state.step() + 1 << " " << step_epoch;
        for (size_t i : sampler_.since_commit()) sample_log_ << " " << i;
      }
      state.commit();
      if (sample_log_.is_open()) sample_log_ << std::endl;  // committed
      if (sampler_.position() >= sampler_.size()) state.next_epoch();
      AfterCommit(step_epoch, sps);
    }
  }

  const Flags& flags_;
  Prepared& in_;
  concord::Job& job_;
  concord::train::Progress& progress_;
  const int64_t n_;
  const bool fixed_;
  concord::train::FaultInjection fault_;
  concord::DistributedDataParallel<Model> ddp_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  concord::ElasticSampler sampler_;
  std::optional<concord::ElasticState> state_;
  const int shard_;
  FixedShards shards_;
  std::ofstream sample_log_;
  RunFigures run_;
  std::chrono::steady_clock::time_point start_, step_start_;
  bool left_ = false;  // this worker ran out of data and left (fixed)
};

template <typename Model>
int TrainWith(const Flags& flags, Prepared& in, concord::Job& job, Model model,
              concord::train::Progress& progress) {
  Trainer<Model> trainer(flags, in, job, std::move(model), progress);
  trainer.Run();
  return trainer.Finish();
}

int Train(const Flags& flags, concord::train::Progress& progress) {
  Prepared in = Prepare(flags);
  std::optional<concord::Job> joined;
  try {
    joined.emplace(in.job);
  } catch (const concord::Error& e) {
    // (A worker started after the others finished never gets here: the
    // library says so and exits 0, see common/job_ended.h.)
    if (e.code() == concord::ErrorCode::kInvalidArgument) {
      // A bad flag or environment value (the trace file, ...): nothing
      // was joined.
      Fail(2, FlagMessage(e.message()));
    }
    Fail(1, absl::StrCat("cannot join the job: ", e.what()));
  }
  concord::Job& job = *joined;
  if (flags.sharding != "fixed" && in.data.size() < job.max_workers()) {
    job.finish(false, "too few samples");
    Fail(2, absl::StrFormat("--data %s: %d samples cannot feed up to %d "
                            "ranks (--sharding elastic needs a sample per "
                            "rank and step)",
                            flags.data, in.data.size(), job.max_workers()));
  }
  if (in.script) {
    in.script->train();
    return TrainWith(flags, in, job, *in.script, progress);
  }
  if (flags.sync_bn) in.net = concord::convert_sync_batchnorm(in.net);
  in.net->train();
  return TrainWith(flags, in, job, in.net, progress);
}

}  // namespace

int ConcordTrainMain(int argc, char** argv) {
  auto parsed = concord::train::ParseTrainFlags(argc, argv);
  if (!parsed.ok()) Fail(2, std::string(parsed.status().message()));
  const Flags flags = *std::move(parsed);
  concord::InitLogging("concord-train", flags.log_level);
  // Progress on a terminal is a bar redrawn in place; log lines (stderr)
  // first end its line.
  concord::train::Progress progress(std::cout, isatty(STDOUT_FILENO) == 1);
  for (auto& sink : spdlog::default_logger()->sinks()) {
    sink = progress.WrapSink(sink);
  }
  progress_output = &progress;
  try {
    return Train(flags, progress);
  } catch (const concord::Error& e) {
    Fail(1, e.what());
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    Fail(1, what.substr(0, what.find('\n')));
  } catch (const std::exception& e) {
    Fail(1, e.what());
  }
}
