#pragma once
// LibTorch's DataLoader over an ElasticSampler, with loader workers.
//
// Note [Prefetching loaders]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch::data::make_data_loader(dataset, sampler, options) with
// options.workers(N) asks the sampler for up to max_jobs windows ahead of
// the loop, so a sampler's own position runs ahead of the batches the loop
// trained on; and a loop cut short (an exception out of a step: a re-form)
// leaves batches in flight, on which LibTorch's next begin() throws
// "Attempted to get a new DataLoader iterator while another iterator is not
// yet exhausted". For an ElasticSampler this header specialises
// torch::data::StatelessDataLoader (what make_data_loader makes for it), so
// that programs keep LibTorch's own calls:
//  - the sampler is told which windows the loop took (the loader hands
//    batches out in the order it asked for them): a commit holds the
//    position of the last batch the loop took, not of the last one
//    prefetched;
//  - begin() first drops what is in flight (their windows were the old
//    world's shares), then starts from the sampler's committed position,
//    split over the current world.
// Every sample of an epoch is then trained once with workers(N) as with
// workers(0). Unordered delivery (enforce_ordering(false)) with workers
// cannot say which windows were taken: it is refused when the loader is
// made (Error kInvalidArgument).

#include <torch/data/dataloader.h>
#include <torch/data/iterator.h>

#include <memory>
#include <utility>
#include <vector>

#include "concord/elastic.h"
#include "concord/error.h"

namespace torch {
namespace data {

template <typename Dataset>
class StatelessDataLoader<Dataset, concord::ElasticSampler>
    : public DataLoaderBase<Dataset, typename Dataset::BatchType,
                            std::vector<size_t>> {
 public:
  using super =
      DataLoaderBase<Dataset, typename Dataset::BatchType, std::vector<size_t>>;
  using typename super::BatchRequestType;
  using typename super::BatchType;

  StatelessDataLoader(Dataset dataset, concord::ElasticSampler sampler,
                      DataLoaderOptions options)
      : super(std::move(options)), sampler_(std::move(sampler)) {
    if (this->options_.workers > 0 && !this->options_.enforce_ordering) {
      throw concord::Error(
          concord::ErrorCode::kInvalidArgument,
          "a DataLoader over an ElasticSampler with workers needs "
          "DataLoaderOptions::enforce_ordering (the default): the sampler "
          "must know which windows the loop took");
    }
    sampler_.track_loader();
    for (size_t w = 0; w < this->options_.workers; ++w) {
      this->workers_.emplace_back(
          [this, dataset]() mutable { this->worker_thread(dataset); });
    }
    if (this->options_.workers == 0) {
      this->main_thread_dataset_ =
          std::make_unique<Dataset>(std::move(dataset));
    }
  }

  // LibTorch's begin(), after dropping what a loop cut short left in flight.
  Iterator<BatchType> begin() {
    this->shuttle_.drain();
    this->reset();
    return Iterator<BatchType>(
        std::make_unique<detail::ValidIterator<BatchType>>(
            [this] { return this->next_taken(); }));
  }

 private:
  void reset() override {
    sampler_.reset();
    super::reset();
  }

  optional<BatchRequestType> get_batch_request() override {
    auto indices = sampler_.next(this->options_.batch_size);
    if (!indices || (indices->size() < this->options_.batch_size &&
                     this->options_.drop_last)) {
      return nullopt;
    }
    return indices;
  }

  // The next batch; the sampler learns the loop took its window.
  optional<BatchType> next_taken() {
    optional<BatchType> batch = this->next();
    if (batch) sampler_.window_taken();
    return batch;
  }

  concord::ElasticSampler sampler_;
};

}  // namespace data
}  // namespace torch
