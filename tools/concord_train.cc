// concord-train: trains a TorchScript module on tensor data with Concord's
// DistributedDataParallel. Run it under `concord-run`; alone it trains as a
// world of one.
//
// Exit status: 0 done; 2 bad flags or inputs (one line on stderr, before any
// training); 1 a failure while training.

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
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
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "tools/fault_injection.h"
#include "tools/progress.h"
#include "tools/slowmo_flags.h"
#include "tools/train_data.h"
#include "tools/train_flags.h"
#include "worker/ddp/engine.h"
#include "worker/elastic/state.h"
#include "worker/session.h"
#include "worker/slowmo/slowmo.h"
#include "worker/syncbn/sync_batch_norm.h"
#include "worker/torch_compat.h"
#include "worker/trace/recorder.h"

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

concord::ddp::EngineOptions DdpOptionsFrom(const Flags& f) {
  concord::ddp::EngineOptions o;
  o.bucket_cap_bytes = static_cast<int64_t>(f.bucket_cap_mb * 1024 * 1024);
  // Note [LibTorch versions]: PyTorch 2.x's first bucket follows a
  // user-given cap.
  if (concord::compat::kFirstBucketFollowsUserCap && f.bucket_cap_given) {
    o.first_bucket_bytes = o.bucket_cap_bytes;
  }
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
  concord::ddp::EngineOptions ddp_options;
  concord::worker::WorkerOptions options;
  torch::Device device = torch::kCPU;               // where the model trains
  std::shared_ptr<concord::trace::Recorder> trace;  // --trace, if any
};

// Note [Worker device]: --device and --backend (else the environment's)
// resolved on this machine; `options` then names the device itself, so the
// session does not resolve `auto` again. A device or backend that is not
// there is exit 2 with one line; `auto` without a GPU says so once.
torch::Device ResolveTrainDevice(const Flags& flags,
                                 concord::worker::WorkerOptions& options) {
  if (!flags.device.empty()) {
    options.device = *concord::ParseDeviceRequest(flags.device);
  }
  if (!flags.backend.empty()) {
    options.backend = *concord::ParseBackendRequest(flags.backend);
  }
  auto resolved = concord::worker::ResolveWorkerDevice(options);
  if (!resolved.ok()) {
    Fail(2, absl::StrCat(flags.device.empty() ? "CONCORD_DEVICE: " : "--",
                         resolved.status().message()));
  }
  if (!resolved->note.empty()) {
    std::cerr << "concord-train: "
              << (flags.device.empty() ? "CONCORD_DEVICE: " : "--")
              << resolved->note << std::endl;
  }
  const concord::WorkerDevice& device = resolved->device;
  auto backend = concord::worker::ResolveBackend(options, device);
  if (!backend.ok()) {
    Fail(2, absl::StrCat(flags.backend.empty() ? "CONCORD_BACKEND: " : "--",
                         backend.status().message()));
  }
  options.device.kind = device.is_cuda() ? concord::DeviceRequest::Kind::kCuda
                                         : concord::DeviceRequest::Kind::kCpu;
  options.device.index = device.index;
  if (!device.is_cuda()) return torch::kCPU;
  return torch::Device(torch::kCUDA,
                       static_cast<torch::DeviceIndex>(device.index));
}

Prepared Prepare(const Flags& flags) {
  Prepared in;
  in.loss = flags.loss == "mse" ? Loss::kMse : Loss::kCrossEntropy;
  const bool builtin = absl::StartsWith(flags.model, "builtin:");
  if (!builtin) {
    // The same arithmetic with every LibTorch (Note [LibTorch versions]).
    concord::compat::UnfusedTorchScriptOnCpu();
    auto loaded = concord::train::LoadModel(flags.model);
    if (!loaded.ok()) Fail(2, std::string(loaded.status().message()));
    in.script = std::move(*loaded);
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
  auto options = concord::worker::WorkerOptions::FromEnvironment();
  if (!options.ok()) Fail(2, std::string(options.status().message()));
  in.options = *std::move(options);
  in.device = ResolveTrainDevice(flags, in.options);
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
  in.ddp_options = DdpOptionsFrom(flags);
  if (auto st = concord::ddp::Engine::ValidateOptions(in.ddp_options,
                                                      !flags.comm_hook.empty());
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
  // The timeline: --trace alone, or the file concord-run --trace gave.
  if (!flags.trace.empty() && !in.options.trace_file.empty()) {
    Fail(2,
         "--trace: concord-run --trace collects this worker's timeline "
         "already; give --trace to one of them");
  }
  if (!flags.trace.empty() && in.options.spec.max_workers() > 1) {
    Fail(2, absl::StrFormat(
                "--trace %s: the job's %d workers would all write this file; "
                "give --trace to concord-run (it merges the workers' "
                "timelines) or set CONCORD_TRACE_FILE per worker",
                flags.trace, in.options.spec.max_workers()));
  }
  if (const std::string& path =
          flags.trace.empty() ? in.options.trace_file : flags.trace;
      !path.empty()) {
    auto made = concord::trace::Recorder::Create(path, in.options.worker_id);
    if (!made.ok()) {
      Fail(2,
           absl::StrCat(flags.trace.empty() ? "CONCORD_TRACE_FILE" : "--trace",
                        ": ", made.status().message()));
    }
    in.trace = *std::move(made);
  }
  return in;
}

// The run's figures for --metrics-out.
struct RunFigures {
  int64_t batches = 0;  // forward/backward passes, micro-batches included
  int64_t samples_done = 0;
  double seconds = 0;
  double mean_ms = 0, median_ms = 0;  // step time without warm-up
  double last_loss = 0;
  int64_t written = -1;  // bytes written while training; -1: unknown
  // Per re-form: when the first step after it was done (Unix us).
  std::vector<int64_t> first_step_after_reform;
};

// --metrics-out: the authoritative rank's figures as JSON.
void WriteMetrics(const Flags& flags, const concord::worker::Session& s,
                  const concord::elastic::State& state,
                  const concord::ddp::ReducerStats& stats,
                  const RunFigures& run) {
  nlohmann::json m = {
      {"algorithm", flags.slowmo.algorithm},
      {"world_size", s.world_size()},
      {"generation", s.generation()},
      {"reforms", state.reforms()},
      {"bucket_bytes", stats.bucket_bytes},
      {"bucket_rebuilds", stats.rebuilds},
      {"initial_bucket_params", stats.initial_bucket_params},
      {"bucket_params", stats.bucket_params},
      {"forward_compute_us", stats.forward_compute_us},
      {"backward_compute_us", stats.backward_compute_us},
      {"backward_comm_us", stats.backward_comm_us},
      {"overlap_us", stats.overlap_us},
      {"steps", run.batches},
      {"optimizer_steps", state.step},
      {"step_time_ms_mean", run.mean_ms},
      {"step_time_ms_median", run.median_ms},
      {"samples_per_second", run.samples_done / run.seconds},
      {"final_loss", run.last_loss},
      {"bytes_written", run.written},
      {"bytes_written_per_step", run.written < 0 || state.step == 0
                                     ? -1.0
                                     : static_cast<double>(run.written) /
                                           static_cast<double>(state.step)}};
  nlohmann::json reforms = nlohmann::json::array();
  const auto& records = state.reform_records();
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

int Train(const Flags& flags, concord::train::Progress& progress) {
  Prepared in = Prepare(flags);
  const Loss loss = in.loss;
  std::optional<torch::jit::Module>& script = in.script;
  torch::nn::Sequential& net = in.net;
  const concord::train::Dataset& data = in.data;
  const auto& named_params = in.named_params;
  const auto& named_buffers = in.named_buffers;
  concord::ddp::EngineOptions& ddp_options = in.ddp_options;
  const concord::worker::WorkerOptions& options = in.options;
  const std::shared_ptr<concord::trace::Recorder>& trace = in.trace;

  auto session = concord::worker::Session::Start(options);
  if (!session.ok()) {
    // A worker started (or restarted) after the others finished: the job
    // is done, and so is this worker.
    if (absl::IsFailedPrecondition(session.status()) &&
        absl::StrContains(session.status().message(),
                          "has already succeeded")) {
      std::cout << "concord-train: " << session.status().message()
                << "; nothing left to do" << std::endl;
      return 0;
    }
    Fail(1, absl::StrCat("cannot join the job: ", session.status().ToString()));
  }
  concord::worker::Session& s = **session;
  const int64_t n = data.size();
  const bool fixed = flags.sharding == "fixed";
  if (!fixed && n < options.spec.max_workers()) {
    s.Finish(false, "too few samples").IgnoreError();
    Fail(2, absl::StrFormat("--data %s: %d samples cannot feed up to %d "
                            "ranks (--sharding elastic needs a sample per "
                            "rank and step)",
                            flags.data, n, options.spec.max_workers()));
  }
  // Fixed sharding: this worker's shard is its rank in the first generation
  // it trains in (a worker admitted later has none).
  const int shard = s.rank();
  const int shards = s.world_size();
  concord::train::FaultInjection fault =
      concord::train::FaultInjection::FromEnvironment();

  ddp_options.collective_timeout = options.collective_timeout;
  std::shared_ptr<concord::SyncBnGroup> sync_bn_group;
  absl::StatusOr<std::unique_ptr<concord::ddp::Engine>> ddp;
  if (script) {
    script->train();
    ddp = concord::ddp::Engine::Create(*script, s.shared_communicator(),
                                       s.authoritative_rank(), ddp_options);
  } else {
    if (flags.sync_bn) {
      concord::comm::CollectiveOptions bn_options;
      bn_options.timeout = options.collective_timeout;
      sync_bn_group = std::make_shared<concord::SyncBnGroup>(
          s.shared_communicator(), bn_options);
      concord::ConvertSyncBatchNorm(net.ptr(), sync_bn_group);
    }
    net->train();
    ddp = concord::ddp::Engine::Create(net.ptr(), s.shared_communicator(),
                                       s.authoritative_rank(), ddp_options);
  }
  if (!ddp.ok()) Fail(1, ddp.status().ToString());
  (*ddp)->SetTraceRecorder(trace);
  auto forward = [&](const torch::Tensor& x) -> torch::Tensor {
    if (script) return (*ddp)->Forward({x}).toTensor();
    return (*ddp)->Forward([&] { return net->forward(x); });
  };
  auto register_hook = [&]() {
    if (flags.comm_hook.empty()) return;
    concord::comm::CollectiveOptions hook_options;
    hook_options.timeout = options.collective_timeout;
    auto hook = concord::ddp::MakeCommHook(
        flags.comm_hook, s.shared_communicator(), hook_options);
    if (!hook.ok())
      Fail(2, absl::StrCat("--comm-hook: ", hook.status().message()));
    if (auto st = (*ddp)->RegisterCommHook(*hook); !st.ok()) {
      Fail(2, absl::StrCat("--comm-hook: ", st.message()));
    }
  };
  register_hook();
  // The optimizer takes every trainable parameter, also those DDP ignores
  // (they train on their local gradient, as in PyTorch).
  std::vector<torch::Tensor> trainable;
  for (const auto& [name, p] : named_params) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  torch::optim::SGD optimizer(trainable, torch::optim::SGDOptions(flags.lr)
                                             .momentum(flags.momentum)
                                             .weight_decay(flags.weight_decay));
  if (fault.Armed("backward") && !trainable.empty()) {
    // The first parameter's gradient comes last in backward: by then
    // buckets are in flight.
    trainable.front().register_hook(
        [&fault](const torch::Tensor&) { fault.MaybeDie("backward"); });
  }

  concord::elastic::ElasticOptions elastic_options;
  elastic_options.divide_by_initial_world_size =
      !flags.no_divide_by_initial_world_size;
  elastic_options.throw_on_early_termination = flags.throw_on_early_termination;
  concord::elastic::State state(&s, ddp->get(), &optimizer, elastic_options);
  // SlowMo (--algorithm other than ddp): gradients stay local (DDP under
  // no_sync keeps the broadcasts and the re-forming), the parameters are
  // averaged after the step (Note [SlowMo step]).
  std::unique_ptr<concord::slowmo::SlowMo> slowmo;
  if (flags.slowmo_options) {
    concord::slowmo::SlowMoOptions o = *flags.slowmo_options;
    o.collective_timeout = options.collective_timeout;
    o.broadcast_buffers = !flags.no_broadcast_buffers;
    o.node_id = options.node_id;
    // The buffers DDP keeps equal (not those it was told to ignore).
    std::vector<torch::Tensor> buffers;
    for (const auto& [name, b] : named_buffers) {
      if (std::find(flags.ignore.begin(), flags.ignore.end(), name) ==
          flags.ignore.end()) {
        buffers.push_back(b);
      }
    }
    auto made = concord::slowmo::SlowMo::Create(trainable, buffers,
                                                s.shared_communicator(),
                                                s.authoritative_rank(), o, &s);
    if (!made.ok()) {
      s.Finish(false, std::string(made.status().message())).IgnoreError();
      Fail(1, absl::StrCat("--algorithm ", flags.slowmo.algorithm, ": ",
                           made.status().message()));
    }
    slowmo = std::move(*made);
    state.Attach(slowmo.get());
  }
  state.OnReset([&](const concord::elastic::ResetInfo& info) {
    if (sync_bn_group) sync_bn_group->SetCommunicator(s.shared_communicator());
    register_hook();
    if (trace && !state.reform_records().empty()) {
      // The re-form on the new rank's track: from the failure (or the
      // agreement) to the state received, the rendezvous inside it.
      const auto& r = state.reform_records().back();
      const concord::trace::Args args = {{"generation", r.generation},
                                         {"world_size", r.world_size},
                                         {"step", info.step}};
      trace->Complete("re-form", concord::trace::Recorder::kTrainThread,
                      r.started_us, r.synced_us, args);
      trace->Complete("rendezvous", concord::trace::Recorder::kTrainThread,
                      r.started_us, r.rendezvous_us, args);
    }
  });
  if (auto st = state.Sync(); !st.ok()) Fail(1, st.ToString());

  // This worker's batch of the next step, the samples the whole job takes
  // in it, and whether the epoch ends with it.
  struct Batch {
    torch::Tensor index;
    int64_t job_samples = 0;
  };
  std::vector<int64_t> order(static_cast<size_t>(n));
  int64_t order_epoch = -1;
  auto order_of = [&](int64_t epoch) -> const std::vector<int64_t>& {
    if (order_epoch != epoch) {
      std::iota(order.begin(), order.end(), 0);
      if (flags.shuffle) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(flags.seed + epoch);
        torch::Tensor perm = torch::randperm(n, gen, torch::kLong);
        std::copy(perm.data_ptr<int64_t>(), perm.data_ptr<int64_t>() + n,
                  order.begin());
      }
      order_epoch = epoch;
    }
    return order;
  };
  const int64_t fixed_steps_per_epoch = [&] {
    // Shard 0 is the largest.
    return BatchesOf((n + shards - 1) / shards, flags.batch_size);
  }();
  // Fixed sharding: shard j's batch at its step k (empty once it is done).
  auto fixed_batch = [&](int j, int64_t k) -> std::vector<int64_t> {
    const int64_t shard_size = (n - j + shards - 1) / shards;
    const int64_t per_epoch = BatchesOf(shard_size, flags.batch_size);
    if (per_epoch == 0 || k / per_epoch >= flags.epochs) return {};
    const auto& o = order_of(k / per_epoch);
    const int64_t begin = (k % per_epoch) * flags.batch_size;
    const int64_t len = std::min(flags.batch_size, shard_size - begin);
    std::vector<int64_t> idx;
    for (int64_t i = begin; i < begin + len; ++i) {
      idx.push_back(o[static_cast<size_t>(j + i * shards)]);
    }
    return idx;
  };
  // Elastic sharding: the job's next window of the epoch, split over the
  // ranks there are now; a tail too small to give every rank a sample goes
  // with this step.
  auto elastic_batch = [&](int64_t epoch, int64_t position) -> Batch {
    const int world = s.world_size();
    const int rank = s.rank();
    const int64_t remaining = n - position;
    int64_t take = std::min<int64_t>(world * flags.batch_size, remaining);
    if (remaining - take < world) take = remaining;
    const auto& o = order_of(epoch);
    std::vector<int64_t> idx;
    for (int64_t i = rank; i < take; i += world) {
      idx.push_back(o[static_cast<size_t>(position + i)]);
    }
    return Batch{torch::tensor(idx, torch::kLong), take};
  };

  std::ofstream sample_log;
  if (!flags.sample_log.empty() && !fixed) {
    const std::string path =
        absl::StrCat(flags.sample_log, "/", options.worker_id, ".samples");
    sample_log.open(path, std::ios::app);
    if (!sample_log) Fail(2, "--sample-log: cannot write " + path);
  }
  std::vector<double> step_ms;
  double last_loss = 0;
  int64_t samples_done = 0;
  int64_t batches = 0;  // forward/backward passes, micro-batches included
  // Per re-form: when the first step after it was done (Unix us).
  std::vector<int64_t> first_step_after_reform;
  bool left = false;
  const auto start = std::chrono::steady_clock::now();
  if (s.rank() == s.authoritative_rank()) {
    progress.PrintLine(absl::StrFormat(
        "concord-train: %d samples, world size %d, generation %d, %s "
        "sharding, %d epochs",
        n, s.world_size(), s.generation(), flags.sharding, flags.epochs));
  }
  // The job's optimizer steps at the current world size (elastic sharding:
  // the rest of the epoch and the epochs after it are split over the ranks
  // there are now).
  auto total_steps = [&](const concord::elastic::State& st) -> int64_t {
    if (fixed) return fixed_steps_per_epoch * flags.epochs;
    const int world = s.world_size();
    int64_t total = st.step;
    if (st.epoch < flags.epochs) {
      total += concord::train::StepsToEpochEnd(
                   n, st.position, world, flags.batch_size, flags.grad_accum) +
               (flags.epochs - st.epoch - 1) *
                   concord::train::StepsToEpochEnd(
                       n, 0, world, flags.batch_size, flags.grad_accum);
    }
    return total;
  };
  // After a committed step: every --log-interval steps (and the last on a
  // terminal), on the authoritative rank.
  // `epoch`: the step's (0-based; the state may have moved on to the next).
  auto report = [&](const concord::elastic::State& st, int64_t epoch,
                    double sps) {
    if (s.rank() != s.authoritative_rank()) return;
    // A bar also shows the last step.
    if (st.step % flags.log_interval != 0 &&
        !(progress.terminal() && st.step == total_steps(st))) {
      return;
    }
    concord::train::ProgressLine line;
    line.epoch = epoch + 1;
    line.epochs = flags.epochs;
    line.step = st.step;
    line.total_steps = total_steps(st);
    line.loss = last_loss;
    line.samples_per_second = sps;
    line.generation = s.generation();
    line.world_size = s.world_size();
    progress.Update(line);
  };

  auto take_step = [&](concord::elastic::State& st, const Batch& batch) {
    fault.Pace();
    const auto t0 = std::chrono::steady_clock::now();
    const torch::Tensor x =
        data.inputs.index_select(0, batch.index).to(in.device);
    const torch::Tensor y =
        data.targets.index_select(0, batch.index).to(in.device);
    fault.step = st.step + 1;
    if (trace) trace->SetStep(st.step + 1);
    concord::trace::Recorder::Span step_span(trace, "step");
    fault.MaybeDie("forward");
    std::optional<concord::ddp::Engine::NoSyncGuard> local;
    if (slowmo) {
      local.emplace(ddp->get());
      concord::ThrowIfError(slowmo->PrepareForward());
    }
    torch::Tensor l = concord::train::ComputeLoss(loss, forward(x), y);
    {
      concord::trace::Recorder::Span span(trace, "backward");
      l.backward();
    }
    if (slowmo) concord::ThrowIfError(slowmo->AfterBackward());
    const auto t_opt = std::chrono::steady_clock::now();
    {
      concord::trace::Recorder::Span span(trace, "optimizer");
      optimizer.step();
    }
    fault.MaybeDie("optimizer");
    const double optimizer_ms = std::chrono::duration<double, std::milli>(
                                    std::chrono::steady_clock::now() - t_opt)
                                    .count();
    // Zeroed, not dropped, whatever the LibTorch version's default (Note
    // [LibTorch versions]): PyTorch's zero_grad(set_to_none=False).
    concord::compat::ZeroGrad(optimizer, /*set_to_none=*/false);
    ++st.step;
    ++batches;
    if (first_step_after_reform.size() < st.reform_records().size()) {
      first_step_after_reform.resize(st.reform_records().size(),
                                     absl::ToUnixMicros(absl::Now()));
      spdlog::info("step {} done: the first in generation {}, world size {}",
                   st.step, s.generation(), s.world_size());
    }
    samples_done += batch.job_samples;
    last_loss = l.item<double>();
    const auto t1 = std::chrono::steady_clock::now();
    step_ms.push_back(
        std::chrono::duration<double, std::milli>(t1 - t0).count());
    concord::v1::DdpTimings timings = Timings((*ddp)->stats(), step_ms.back());
    timings.set_optimizer_ms(optimizer_ms);
    s.ReportDdpTimings(timings);
    const double elapsed = std::chrono::duration<double>(t1 - start).count();
    return elapsed > 0 ? samples_done / elapsed : 0;
  };

  // SlowMo's part of the step, after the commit (Note [SlowMo step]): a
  // failure here leaves the committed step owing its average, which the
  // re-form finishes.
  auto average = [&]() -> absl::Status {
    if (!slowmo) return absl::OkStatus();
    fault.MaybeDie("slowmo");
    concord::trace::Recorder::Span span(trace, "slowmo");
    return slowmo->PerformSlowMo(optimizer);
  };

  // Gradient accumulation (elastic sharding): K-1 micro-batches under
  // no_sync, then a synchronised one and the optimizer step (also at the
  // epoch's end); a failure goes back to the first of the K.
  auto train = [&](concord::elastic::State& st) -> absl::Status {
    if (fixed) {
      for (;;) {
        std::vector<int64_t> mine = fixed_batch(shard, st.step);
        CONCORD_ASSIGN_OR_RETURN(auto decision,
                                 st.BeginStep(!mine.empty(), /*admit=*/false));
        if (decision == concord::elastic::StepDecision::kLeft) {
          left = true;
          return absl::OkStatus();
        }
        if (decision == concord::elastic::StepDecision::kDone) {
          return absl::OkStatus();
        }
        int64_t job = 0;
        for (int j = 0; j < shards; ++j) {
          job += static_cast<int64_t>(fixed_batch(j, st.step).size());
        }
        st.epoch = st.step / std::max<int64_t>(1, fixed_steps_per_epoch);
        const double sps =
            take_step(st, Batch{torch::tensor(mine, torch::kLong), job});
        st.Commit();
        report(st, st.epoch, sps);
        CONCORD_RETURN_IF_ERROR(average());
        s.ReportProgress(st.step, sps, last_loss);
      }
    }
    while (st.epoch < flags.epochs) {
      // Admitting workers is safe while the epoch has a sample for each
      // rank there could be.
      const bool admit = n - st.position >= options.spec.max_workers();
      CONCORD_ASSIGN_OR_RETURN(auto decision,
                               st.BeginStep(/*has_data=*/true, admit));
      (void)decision;                  // every rank has data: always kRun
      int64_t position = st.position;  // committed with the step
      for (int64_t micro = 1; micro < flags.grad_accum; ++micro) {
        const Batch batch = elastic_batch(st.epoch, position);
        if (position + batch.job_samples >= n) break;  // the epoch's last
        auto no_sync = (*ddp)->NoSync();
        if (trace) trace->SetStep(st.step + 1);
        const torch::Tensor x =
            data.inputs.index_select(0, batch.index).to(in.device);
        const torch::Tensor y =
            data.targets.index_select(0, batch.index).to(in.device);
        torch::Tensor l = concord::train::ComputeLoss(loss, forward(x), y);
        concord::trace::Recorder::Span span(trace, "backward");
        l.backward();
        position += batch.job_samples;
        samples_done += batch.job_samples;
        ++batches;
      }
      const Batch batch = elastic_batch(st.epoch, position);
      const double sps = take_step(st, batch);
      if (sample_log.is_open()) {
        sample_log << st.step << " " << st.epoch;
        const auto& o = order_of(st.epoch);
        for (int64_t i = st.position; i < position + batch.job_samples; ++i) {
          sample_log << " " << o[static_cast<size_t>(i)];
        }
      }
      const int64_t step_epoch = st.epoch;
      st.position = position + batch.job_samples;
      if (st.position >= n) {
        ++st.epoch;
        st.position = 0;
      }
      st.Commit();
      if (sample_log.is_open()) sample_log << std::endl;  // committed
      report(st, step_epoch, sps);
      CONCORD_RETURN_IF_ERROR(average());
      s.ReportProgress(st.step, sps, last_loss);
    }
    return absl::OkStatus();
  };
  const int64_t written_before = BytesWritten();
  if (absl::Status st = concord::elastic::Run(state, train); !st.ok()) {
    s.Finish(false, std::string(st.message())).IgnoreError();
    Fail(1, st.ToString());
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  // Gloo's traffic and the few progress lines written while training.
  const int64_t written =
      written_before < 0 ? -1 : BytesWritten() - written_before;
  // SGP: the model is the de-biased estimate.
  if (slowmo) slowmo->Debias();
  if (left) {
    progress.PrintLine(absl::StrFormat(
        "concord-train: worker %s ran out of data after step %d and left the "
        "job",
        options.worker_id, state.step));
    return 0;
  }
  if (!flags.output_per_worker.empty()) {
    const std::string path =
        absl::StrCat(flags.output_per_worker, "/", options.worker_id, ".pt");
    if (auto st = concord::train::SaveState((*ddp)->NamedState(), path);
        !st.ok()) {
      Fail(1, std::string(st.message()));
    }
  }
  if (s.rank() == s.authoritative_rank()) {
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
      WriteMetrics(
          flags, s, state, (*ddp)->stats(),
          RunFigures{batches, samples_done, seconds, mean, Median(timed),
                     last_loss, written, first_step_after_reform});
    }
    progress.PrintLine(absl::StrFormat(
        "concord-train: done: %d steps in %.2f s, %.1f samples/s, mean step "
        "%.2f ms, final loss %.6f, generation %d, world size %d%s",
        state.step, seconds, samples_done / seconds, mean, last_loss,
        s.generation(), s.world_size(),
        flags.output.empty() ? "" : absl::StrCat(", wrote ", flags.output)));
  }
  if (auto st = s.Finish(true, ""); !st.ok()) {
    spdlog::warn("leaving the job: {}", st.ToString());
  }
  return 0;
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
