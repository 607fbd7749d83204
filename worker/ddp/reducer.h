#pragma once
// Gradient bucketing and overlapped allreduce (PyTorch's Reducer).
//
// Note [Reducer flow]: a hook on every trainable parameter fires when
// backward has computed its gradient. The hook writes grad / world_size into
// the parameter's slot of its bucket (PyTorch divides while copying); when a
// bucket's last gradient arrives, the bucket and every full bucket before it
// are allreduced asynchronously (in bucket order, the same on every rank),
// while backward goes on. The first hook of a backward also queues a final
// callback on the autograd engine; it runs when backward is done, waits for
// every bucket and writes the averaged gradients into `param.grad`.
//
// Threads: hooks and the final callback run on the autograd thread of the
// backward call; the collectives run on the communicator's thread. A failed
// collective surfaces as a concord::Error thrown out of `backward()`.

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "worker/comm/communicator.h"

namespace concord::ddp {

struct ReducerOptions {
  int64_t first_bucket_bytes = 1 << 20;
  int64_t bucket_cap_bytes = 25 << 20;
  absl::Duration collective_timeout = absl::Minutes(5);
};

// What a bucket holds, for logging and tests.
struct BucketInfo {
  std::vector<size_t> params;  // indices into the reducer's parameters
  int64_t bytes = 0;
};

class Reducer {
 public:
  // `params` are the trainable parameters in the module's order; `names` are
  // used in error messages. Registers the hooks.
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
          std::shared_ptr<comm::Communicator> comm, ReducerOptions options);
  // Removes the hooks; waits (bounded) for collectives still in flight.
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Arms the reducer for the next backward. Called before every forward
  // whose backward must be synchronised; a backward without it accumulates
  // gradients locally (like `no_sync()`).
  void PrepareForBackward();

  std::vector<BucketInfo> buckets() const;
  // Completed synchronised backward passes.
  int64_t iterations() const { return iterations_; }

 private:
  struct Bucket {
    at::Tensor flat;
    std::vector<size_t> params;
    std::vector<at::Tensor> views;  // per param, shaped like it
    size_t pending = 0;
    std::shared_ptr<comm::Work> work;
  };
  struct Slot {
    size_t bucket = 0;
    size_t index_in_bucket = 0;
    bool ready = false;
  };

  void OnGradReady(size_t param, const at::Tensor& grad);
  void LaunchReadyBuckets();
  void FinalizeBackward();

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::shared_ptr<comm::Communicator> comm_;
  ReducerOptions options_;
  double div_factor_;
  std::vector<Bucket> buckets_;
  std::vector<Slot> slots_;
  std::vector<unsigned> hook_handles_;

  bool armed_ = false;              // PrepareForBackward seen
  bool callback_queued_ = false;    // final callback queued this backward
  size_t next_bucket_ = 0;          // first bucket not yet launched
  int64_t iterations_ = 0;
};

}  // namespace concord::ddp
