#include "tools/train_flags.h"

#include <CLI/CLI.hpp>

#include "common/status_macros.h"

namespace concord::train {

namespace {

// The model, its data, the optimizer, the loop and what it writes.
void AddTrainingFlags(CLI::App& app, TrainFlags& f) {
  app.add_option("--model", f.model,
                 "TorchScript module (torch.jit.save), or builtin:cnn")
      ->required();
  app.add_option("--data", f.data,
                 "dict {'inputs': Tensor, 'targets': Tensor} (torch.save)")
      ->required();
  app.add_option("--loss", f.loss)
      ->check(CLI::IsMember({"cross_entropy", "mse"}));
  app.add_option("--optimizer", f.optimizer,
                 "LibTorch's SGD (with --momentum), Adam or AdamW (betas "
                 "0.9 and 0.999, eps 1e-8)")
      ->check(CLI::IsMember({"sgd", "adam", "adamw"}));
  app.add_option("--lr", f.lr)->check(CLI::PositiveNumber);
  app.add_option("--momentum", f.momentum, "SGD's")
      ->check(CLI::Range(0.0, 1.0));
  app.add_flag("--zero", f.zero,
               "shard the optimizer state over the ranks "
               "(ZeroRedundancyOptimizer, PyTorch's partition)");
  app.add_flag_callback(
      "--zero-bucket-view",
      [&f] { f.zero_options.parameters_as_bucket_view(true); },
      "with --zero: each rank's parameters in one flat tensor "
      "(parameters_as_bucket_view)");
  app.add_option("--zero-overlap", f.zero_overlap,
                 "with --zero: step inside DDP's backward as each bucket is "
                 "reduced (overlap_with_ddp, PyTorch's hook_with_zero_step or "
                 "hook_with_zero_step_interleaved); the first two steps "
                 "update nothing")
      ->check(CLI::IsMember({"step", "interleaved"}));
  app.add_flag("--zero-shard-buckets", f.zero_shard_buckets,
               "with --zero-overlap: split DDP's buckets over the ranks to "
               "even out the shards (shard_buckets)");
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
  app.add_option("--trace", f.trace,
                 "write this worker's timeline (Chrome trace-event JSON: "
                 "forward, backward, each bucket's allreduce, optimizer) "
                 "here; for a job of several workers give --trace to "
                 "concord-run, which merges theirs");
}

void AddDdpFlags(CLI::App& app, TrainFlags& f) {
  auto* ddp = app.add_option_group("DDP", "DistributedDataParallel options");
  DdpOptions& o = f.ddp;
  CLI::Option* cap =
      ddp->add_option_function<double>(
             "--bucket-cap-mb", [&o](const double& mb) { o.bucket_cap_mb(mb); },
             "bucket size cap in MiB (PyTorch's bucket_cap_mb; default 25)")
          ->check(CLI::PositiveNumber);
  ddp->add_flag("--find-unused-parameters", o.find_unused_parameters());
  ddp->add_flag("--static-graph", o.static_graph());
  ddp->add_option("--grad-accum", f.grad_accum,
                  "micro-batches per optimizer step (K-1 under no_sync)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  ddp->add_option("--comm-hook", o.comm_hook(),
                  "allreduce, fp16, bf16 or powersgd[:RANK[:START_ITER]]");
  ddp->add_flag("--gradient-as-bucket-view", o.gradient_as_bucket_view());
  ddp->add_flag_callback("--no-broadcast-buffers",
                         [&o] { o.broadcast_buffers(false); });
  ddp->add_option("--ignore", o.params_and_buffers_to_ignore(),
                  "parameter or buffer left out of DDP (repeatable)");
  ddp->add_flag("--delay-allreduce", o.delay_allreduce(), "apex: no overlap");
  ddp->add_flag("--allreduce-always-fp32", o.allreduce_always_fp32());
  ddp->add_option("--predivide-factor", o.gradient_predivide_factor(),
                  "apex gradient_predivide_factor")
      ->check(CLI::PositiveNumber);
  ddp->add_flag_callback(
      "--no-gradient-average", [&o] { o.gradient_average(false); },
      "apex gradient_average=False: sum, do not average");
  auto* message = ddp->add_option("--message-size", o.message_size(),
                                  "apex: bucket threshold in elements")
                      ->check(CLI::PositiveNumber);
  ddp->add_option("--allreduce-trigger-params", o.allreduce_trigger_params(),
                  "apex: parameters whose gradient closes a bucket");
  message->excludes(cap);
}

void AddElasticFlags(CLI::App& app, TrainFlags& f) {
  auto* elastic = app.add_option_group("Elastic", "membership changes");
  elastic
      ->add_option("--sharding", f.sharding,
                   "elastic: every step the job takes the next world x "
                   "batch samples of the epoch and splits them over the "
                   "ranks there are (re-sharded when ranks leave, die or "
                   "join; nothing skipped or seen twice); fixed: rank r of "
                   "the first generation keeps samples r, r+W, ... of every "
                   "epoch (PyTorch's DistributedSampler without padding) and "
                   "leaves when its data runs out (PyTorch's join)")
      ->check(CLI::IsMember({"elastic", "fixed"}));
  elastic->add_flag("--no-divide-by-initial-world-size",
                    f.no_divide_by_initial_world_size,
                    "after ranks ran out of data, average over the ranks left");
  elastic->add_flag("--throw-on-early-termination",
                    f.throw_on_early_termination,
                    "fail every rank when the first one runs out of data");
  elastic->add_option("--output-per-worker", f.output_per_worker,
                      "every worker that finishes training writes its final "
                      "state to DIR/<worker id>.pt");
  elastic->add_option("--sample-log", f.sample_log,
                      "every worker appends a line 'STEP EPOCH SAMPLE...' "
                      "with the job's samples of each step it commits to "
                      "DIR/<worker id>.samples (elastic sharding)");
}

void AddCheckpointFlags(CLI::App& app, TrainFlags& f) {
  auto* checkpoints = app.add_option_group(
      "Checkpoints", "durable state (default: concord-run's --checkpoint-*)");
  checkpoints->add_option("--checkpoint-dir", f.checkpoint_dir,
                          "write checkpoints to DIR/<job id>/step-<N>/ and "
                          "resume from the newest one when no worker holds "
                          "the job's state");
  checkpoints
      ->add_option("--checkpoint-every", f.checkpoint_every,
                   "a checkpoint every this many steps")
      ->check(CLI::PositiveNumber);
  checkpoints
      ->add_option("--checkpoint-keep", f.checkpoint_keep,
                   "complete checkpoints kept (default 3)")
      ->check(CLI::PositiveNumber);
  checkpoints->add_flag("--no-resume", f.no_resume,
                        "this run starts afresh: it resumes only from its "
                        "own checkpoints");
}

void AddDeviceFlags(CLI::App& app, TrainFlags& f) {
  app.add_option("--device", f.device,
                 "cpu, cuda (cuda:<local rank>), cuda:N or auto (a GPU when "
                 "there is one); default: $CONCORD_DEVICE, else cpu");
  app.add_option("--backend", f.backend,
                 "the communicator: auto (nccl on a GPU, else gloo), gloo "
                 "(also for processes sharing a GPU) or nccl; default: "
                 "$CONCORD_BACKEND, else auto");
  app.add_flag("--sync-bn", f.sync_bn,
               "SyncBatchNorm (C++-frontend models only: refused for "
               "TorchScript)");
}

// What CLI11's per-flag checks cannot see: flags that do not go together.
// (The job's flags, --device, --backend and --checkpoint-*, go to
// concord::plan_job with the environment's values: concord-train's
// Prepare.)
absl::Status Check(TrainFlags& f) {
  if (f.sharding == "fixed" && f.grad_accum > 1) {
    return absl::InvalidArgumentError(
        "--grad-accum: gradient accumulation needs --sharding elastic");
  }
  if (f.momentum != 0 && f.optimizer != "sgd") {
    return absl::InvalidArgumentError(
        "--momentum applies to --optimizer sgd only");
  }
  if (f.zero_options.parameters_as_bucket_view() && !f.zero) {
    return absl::InvalidArgumentError("--zero-bucket-view needs --zero");
  }
  if (!f.zero_overlap.empty() && !f.zero) {
    return absl::InvalidArgumentError("--zero-overlap needs --zero");
  }
  if (f.zero_shard_buckets && f.zero_overlap.empty()) {
    return absl::InvalidArgumentError(
        "--zero-shard-buckets needs --zero-overlap");
  }
  if (!f.zero_overlap.empty()) {
    if (f.zero_options.parameters_as_bucket_view()) {
      return absl::InvalidArgumentError(
          "--zero-bucket-view does not apply with --zero-overlap (each "
          "bucket's share is flat already)");
    }
    if (!f.ddp.comm_hook().empty()) {
      return absl::InvalidArgumentError(
          "--comm-hook: --zero-overlap's hook reduces with allreduce");
    }
    f.zero_options.overlap_with_ddp(true);
  }
  auto slowmo = concord::train::SlowMoOptionsFrom(f.slowmo);
  if (!slowmo.ok()) return slowmo.status();
  f.ddp.slowmo(*slowmo);
  if (f.ddp.slowmo()) {
    // No gradient is reduced between averages: DDP's gradient options do
    // not apply.
    if (!f.ddp.comm_hook().empty()) {
      return absl::InvalidArgumentError(
          "--comm-hook applies to --algorithm ddp only (" + f.slowmo.algorithm +
          " reduces no gradients)");
    }
    if (f.grad_accum > 1) {
      return absl::InvalidArgumentError(
          "--grad-accum applies to --algorithm ddp only");
    }
    if (f.zero) {
      return absl::InvalidArgumentError(
          "--zero applies to --algorithm ddp only (" + f.slowmo.algorithm +
          " steps an unsharded optimizer)");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TrainFlags> ParseTrainFlags(int argc, char** argv) {
  TrainFlags f;
  CLI::App app{"Trains a TorchScript model with Concord DDP."};
  AddTrainingFlags(app, f);
  AddDdpFlags(app, f);
  AddElasticFlags(app, f);
  AddCheckpointFlags(app, f);
  concord::train::AddSlowMoFlags(app, &f.slowmo);
  AddDeviceFlags(app, f);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    std::exit(app.exit(e));
  } catch (const CLI::ParseError& e) {
    return absl::InvalidArgumentError(e.what());
  }
  CONCORD_RETURN_IF_ERROR(Check(f));
  return f;
}

}  // namespace concord::train
