#pragma once
// Elastic training: Horovod's elastic API (hvd.elastic.run, a State with
// commit(), ElasticSampler) for a LibTorch loop, on Concord's generations.
//
//   concord::ElasticSampler sampler(dataset.size().value(), job);
//   auto loader = torch::data::make_data_loader(
//       dataset, sampler, torch::data::DataLoaderOptions().batch_size(64));
//   concord::ElasticState state(ddp, optimizer, sampler);
//   concord::run_elastic(state, [&] {
//     for (; state.epoch() < epochs; state.next_epoch()) {
//       for (auto& batch : *loader) {
//         ... forward through ddp, backward, optimizer.step() ...
//         state.commit();                    // this step is done
//       }
//     }
//   });
//
// A step is transactional (see Note [Elastic step] in worker/elastic/state.h):
// when a peer dies or the coordinator ends the generation, the collective in
// flight fails, run_elastic restores the last commit (model, optimizer,
// counters, sampler position, buffers and the user's values), re-forms with
// whoever is there — survivors and newcomers — gives every rank the
// authoritative rank's state, rebinds every DDP of the job (its comm hook
// and its SyncBatchNorm layers), runs the reset callbacks and calls the loop
// again. A step may hold several models and optimizers (a GAN's): see
// ElasticState. A step that keeps failing with nothing changed ends the loop
// (ElasticStateOptions::max_repeated_failures).
// The loop goes on from the committed position: the sampler splits the rest
// of the epoch over the new world, so no sample is skipped or trained twice.
// Workers waiting to join are admitted at a step boundary (the first forward
// after a commit); when that re-forms, a loop with an ElasticSampler starts
// over from the commit (its batch was the old world's share), a loop over
// the rank's own data goes on with its batch. Ranks whose own data runs out
// unevenly leave with ddp->join() (PyTorch's join).

#include <ATen/core/Generator.h>
#include <torch/arg.h>
#include <torch/data/samplers/base.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "concord/ddp.h"
#include "concord/elastic_events.h"
#include "concord/elastic_options.h"
#include "concord/job.h"

namespace concord {

namespace detail {
struct SamplerState;
class ElasticCore;
}  // namespace detail

struct ElasticSamplerOptions {
  // PyTorch's DistributedSampler: a new permutation every epoch from
  // seed + epoch (the same on every rank), or the dataset's order.
  TORCH_ARG(bool, shuffle) = true;
  TORCH_ARG(uint64_t, seed) = 0;
};

// A torch::data sampler for make_data_loader: each batch is this rank's
// share of the job's next window of world_size × batch_size samples of the
// epoch (rank r takes every world_size-th from the r-th); a tail too small
// to give every rank a sample joins the last window. The world is the job's
// current one, so after a re-form the rest of the epoch is split over
// whoever is there. A handle: the loader's copy and yours are one sampler.
// The position it goes on from after a failure is the last commit's. A
// loader with workers (DataLoaderOptions::workers) prefetches ahead of the
// loop: concord/data.h makes LibTorch's loader tell the sampler which
// windows the loop took (see Note [Prefetching loaders]).
class ElasticSampler : public torch::data::samplers::Sampler<> {
 public:
  ElasticSampler(size_t dataset_size, const Job& job,
                 const ElasticSamplerOptions& options = {});

  // Rewinds to the committed position of the current epoch (the loader
  // calls it when a loop starts over it). A new size starts a new order.
  void reset(c10::optional<size_t> new_size = c10::nullopt) override;
  // This rank's indices of the next window; none at the end of the epoch.
  c10::optional<std::vector<size_t>> next(size_t batch_size) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  int64_t epoch() const;
  // Samples of the epoch handed out to the job so far (all ranks), up to
  // the last window the loop took.
  size_t position() const;
  size_t size() const;
  // The job's samples (every rank's) handed out since the last commit, in
  // the epoch's order: what the step being taken trains on, for an audit
  // log of which sample each step consumed.
  std::vector<size_t> since_commit() const;

  // Inside Concord (ElasticState, the DataLoader of concord/data.h): a
  // loader now says which windows the loop took; the loop took the oldest
  // window handed out that it had not taken.
  void track_loader();
  void window_taken();
  const std::shared_ptr<detail::SamplerState>& state() const { return state_; }

 private:
  std::shared_ptr<detail::SamplerState> state_;
};

// The training state run_elastic keeps transactional (see Note [Elastic step],
// see Note [Several models]): the job's DistributedDataParallel modules, the
// optimizers and the sampler added to it, the counters and the user's
// values. Horovod's TorchState, with any number of models and optimizers:
//
//   concord::ElasticState state(job);
//   state.add("generator", generator).add("discriminator", discriminator)
//       .add("generator_optimizer", g_opt)
//       .add("discriminator_optimizer", d_opt)
//       .add(sampler);
//
// Every DistributedDataParallel of the job made before run_elastic starts
// is the state's, added or not (each must outlive run_elastic): each re-form
// rebinds them all (with their comm hooks and SyncBatchNorm layers), in the
// order they were made; add names one (for messages, the history). An optimizer
// is the state's only once added: its state is committed and restored with the
// step and sent to newcomers. A step may run any number of forwards, backwards
// and optimizer steps; when any collective of it fails, every module and
// optimizer goes back to the last commit, also an optimizer that stepped
// before the failure (see Note [Early optimizer steps]), and the step is taken
// again in the next generation: no update is applied twice or lost.
class ElasticState {
 public:
  // An empty state over `job`: add modules, optimizers and a sampler.
  // Throws Error: kAlreadyExists when the job has an ElasticState already;
  // kInvalidArgument for a bad option.
  explicit ElasticState(const Job& job,
                        const ElasticStateOptions& options = {});
  // One module and its optimizer (and sampler): add("model", ddp),
  // add("optimizer", optimizer), add(sampler). They must outlive the state.
  template <typename M>
  ElasticState(DistributedDataParallel<M>& ddp,
               torch::optim::Optimizer& optimizer,
               const ElasticStateOptions& options = {})
      : ElasticState(ddp->job(), options) {
    add("model", ddp).add("optimizer", optimizer);
  }
  template <typename M>
  ElasticState(DistributedDataParallel<M>& ddp,
               torch::optim::Optimizer& optimizer,
               const ElasticSampler& sampler,
               const ElasticStateOptions& options = {})
      : ElasticState(ddp->job(), options) {
    add("model", ddp).add("optimizer", optimizer).add(sampler);
  }
  ~ElasticState();
  ElasticState(const ElasticState&) = delete;
  ElasticState& operator=(const ElasticState&) = delete;

  // Adds (names) a module, an optimizer, the sampler; each must outlive
  // the state. Every rank adds the same, in the same order, before
  // run_elastic. Throws Error: kInvalidArgument (an empty name, a module
  // or sampler of another Job), kAlreadyExists (a name taken, an optimizer
  // added twice, a second sampler), kFailedPrecondition (after run_elastic
  // started).
  template <typename M>
  ElasticState& add(const std::string& name, DistributedDataParallel<M>& ddp) {
    return add_module(name, ddp->core());
  }
  ElasticState& add(const std::string& name,
                    torch::optim::Optimizer& optimizer);
  ElasticState& add(const ElasticSampler& sampler);
  ElasticState& add_module(const std::string& name, detail::DdpCore& ddp);
  // A random generator of the program's own (a GAN's noise, an
  // augmentation's): committed with every step and kept per rank in every
  // checkpoint, as the default CPU generator and the rank's CUDA device's
  // are (see Note [Each rank's randomness]): a failed step draws again what
  // it drew, and a job resumed from a checkpoint draws on each rank what it
  // would have drawn. Every rank adds the same generators, in the same
  // order. Throws Error kInvalidArgument for an undefined generator, one
  // added already or a name taken; as for the others after run_elastic.
  ElasticState& add(const std::string& name, at::Generator generator);

  // Optimizer steps committed, and the epoch.
  int64_t step() const;
  int64_t epoch() const;
  // The user's own tensors, committed and restored with the rest and sent
  // to newcomers (Horovod's state attributes).
  std::map<std::string, torch::Tensor>& values();

  // The step just taken is done: step + 1, the sampler's position, the
  // buffers and values are what a failure goes back to. Cheap (no
  // communication).
  void commit();
  // The epoch is over: epoch + 1, the sampler starts it from 0; committed.
  void next_epoch();
  // After every re-form (Horovod's reset callbacks): rescale the learning
  // rate, and so on.
  void on_reset(std::function<void(const ResetInfo&)> callback);
  // Before the first forward of every step, once the step agreement ran
  // (and before DDP's buffer broadcast), with the step being taken
  // (committed + 1): per-step setup such as a learning-rate schedule.
  void on_step_begin(std::function<void(int64_t step)> callback);
  // Re-forms so far, and each one's record.
  int64_t reforms() const;
  const std::vector<ReformRecord>& reform_log() const;

  detail::ElasticCore& core() { return *core_; }

 private:
  std::unique_ptr<detail::ElasticCore> core_;
};

// Runs `train` until it returns; when a collective fails (a retryable
// concord::Error out of forward or backward) or workers are admitted,
// restores the last commit, re-forms and calls `train` again. Every rank
// calls it once after making its state (newcomers too). On return, SGP's
// push-sum parameters are de-biased (the model to save). Throws Error:
// kFailedPrecondition when the job failed or re-forming timed out; what
// `train` throws that is not retryable.
void run_elastic(ElasticState& state, const std::function<void()>& train);

}  // namespace concord
