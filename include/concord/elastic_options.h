#pragma once
// concord::ElasticStateOptions: how an ElasticState (concord/elastic.h) runs
// the step agreement. A plain struct the library's elastic state
// (worker/elastic/state.h) keeps as given. Only <torch/arg.h> (the TORCH_ARG
// accessors) from LibTorch.

#include <torch/arg.h>

namespace concord {

// How an ElasticState runs the step agreement (see Note [Step agreement]).
struct ElasticStateOptions {
  // PyTorch's join(divide_by_initial_world_size=True): after ranks left
  // with join(), gradient sums are still divided by the world size the job
  // started with (their share counts as zeros); false: by the ranks left.
  TORCH_ARG(bool, divide_by_initial_world_size) = true;
  // PyTorch's join(throw_on_early_termination=True): when any rank runs
  // out, every rank throws (kFailedPrecondition) instead of going on.
  TORCH_ARG(bool, throw_on_early_termination) = false;
  // Workers waiting to join are admitted at step boundaries. false: the
  // world only shrinks (a loop whose ranks own fixed shards of the data,
  // which a newcomer would not have).
  TORCH_ARG(bool, admit_workers) = true;
  // A step that fails again after a re-form that changed nothing (the same
  // members, no step committed since) is re-formed again at most this many
  // times, waiting 0.2 s, 0.4 s, ... (at most 5 s) before each; then
  // run_elastic throws kFailedPrecondition naming the step and the error
  // (see Note [Re-form loops]). A re-form that lost or admitted a worker starts
  // the count again. At least 1.
  TORCH_ARG(int, max_repeated_failures) = 3;
};

}  // namespace concord
