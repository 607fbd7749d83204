#pragma once
// concord::DdpOptions: PyTorch's DistributedDataParallel arguments and
// apex's, taken by concord::DistributedDataParallel (concord/ddp.h). The one
// home of DDP's options and defaults: concord-train sets them from its flags,
// and the library's own options (worker/ddp/reducer.h, engine.h) take their
// defaults from this struct. Only <torch/arg.h> (the TORCH_ARG accessors)
// from LibTorch.

#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "concord/slowmo_options.h"

namespace concord {

// PyTorch's DistributedDataParallel arguments, and apex's.
struct DdpOptions {
  // Bucket size in MiB (PyTorch's bucket_cap_mb; default 25). The first
  // bucket holds 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES) — or, with
  // LibTorch 2.x as PyTorch 2.x does, the cap when one is given.
  TORCH_ARG(std::optional<double>, bucket_cap_mb);
  // Before every forward, buffers (BatchNorm statistics) from the
  // authoritative rank.
  TORCH_ARG(bool, broadcast_buffers) = true;
  // Parameters that got no gradient in a backward are reduced as zeros
  // (the model has branches a step may not take).
  TORCH_ARG(bool, find_unused_parameters) = false;
  // The graph is the same every step: unused parameters found once.
  TORCH_ARG(bool, static_graph) = false;
  // `.grad` are views into the buckets (no copy; PyTorch's option).
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  // Parameters and buffers left alone (not broadcast, not reduced), by
  // qualified name: PyTorch's _set_params_and_buffers_to_ignore.
  TORCH_ARG(std::vector<std::string>, params_and_buffers_to_ignore);
  // A built-in communication hook in place of the default allreduce:
  // "allreduce", "fp16", "bf16", "powersgd[:RANK[:START_ITER]]" (PyTorch's
  // allreduce_hook, fp16_compress_hook, bf16_compress_hook, powerSGD_hook);
  // empty: none. Kept across re-forms.
  TORCH_ARG(std::string, comm_hook);
  // fairscale's SlowMoDistributedDataParallel in place of the per-step
  // gradient average: gradients stay local (or are averaged over the
  // node), and ddp->perform_slowmo(optimizer) after every optimizer step
  // averages the parameters. broadcast_buffers applies; no comm_hook.
  TORCH_ARG(std::optional<SlowMoOptions>, slowmo);
  // apex.parallel.DistributedDataParallel's: message_size (elements per
  // bucket, 0: PyTorch's bucketing), delay_allreduce (everything after
  // backward), allreduce_always_fp32, gradient_average,
  // gradient_predivide_factor, allreduce_trigger_params (by name).
  TORCH_ARG(int64_t, message_size) = 0;
  TORCH_ARG(bool, delay_allreduce) = false;
  TORCH_ARG(bool, allreduce_always_fp32) = false;
  TORCH_ARG(bool, gradient_average) = true;
  TORCH_ARG(double, gradient_predivide_factor) = 1.0;
  TORCH_ARG(std::vector<std::string>, allreduce_trigger_params);

 public:
  // Throws Error (kInvalidArgument) for what DistributedDataParallel's
  // constructor would refuse without looking at the model: contradictory
  // options, an unknown comm_hook, SlowMo values out of range. A program
  // checks its flags with it before joining a job.
  void validate() const;
};

}  // namespace concord
