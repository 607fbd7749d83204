#pragma once
// Communicator over Gloo (TCP): CPU tensors in place, CUDA tensors staged
// through pinned host memory (see Note [CUDA tensors over Gloo]).
//
// Rendezvous exchanges Gloo's addresses through a comm::Store (the
// coordinator's key-value store in a job). Collectives run one at a time, in
// issue order, on a dedicated thread; Gloo exceptions are caught there and
// reported through the Work, never thrown across threads.

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/job_defaults.h"
#include "worker/comm/communicator.h"
#include "worker/comm/group.h"
#include "worker/comm/store.h"

namespace gloo {
class Context;
}

namespace concord::comm {

class ShmAllreduce;

struct GlooOptions {
  int rank = 0;
  int size = 1;
  int64_t generation = 0;
  // Address this rank listens on for its peers (e.g. "127.0.0.1").
  std::string hostname = "127.0.0.1";
  // Bound on the rendezvous (connecting the full mesh).
  absl::Duration connect_timeout = kDefaultCollectiveTimeout;
  // Sum allreduces of float32, float64, int32 and int64, and broadcasts,
  // through shared memory when every rank is on this host and every rank
  // asks for it; Gloo's results, bit for bit:
  // see Note [Shared-memory allreduce];
  // see Note [Shared-memory broadcast].
  // Workers: on unless CONCORD_SHM=0.
  bool shared_memory = false;
  // Most keys one read of the store may name (the coordinator's KvGet takes
  // 4096): the rendezvous reads its tables in Gets of at most this many.
  int keys_per_get = 1024;
};

class GlooCommunicator final : public Communicator {
 public:
  // Connects the full mesh; blocks until every rank has joined.
  // Errors: INVALID_ARGUMENT (rank/size), UNAVAILABLE (a peer did not come or
  // the network failed), DEADLINE_EXCEEDED, ABORTED (the store's generation
  // ended).
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Create(
      const GlooOptions& options, Store* store);
  ~GlooCommunicator() override;

  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  int64_t generation() const override { return options_.generation; }
  // Whether sum allreduces and broadcasts go through shared memory
  // (GlooOptions).
  bool uses_shared_memory() const { return shm_ != nullptr; }

  // Supported dtypes: float32, float64, float16, bfloat16 (summed in float,
  // rounded per step), int32, int64, uint8.
  std::shared_ptr<Work> AllreduceSum(at::Tensor tensor,
                                     const CollectiveOptions& options) override;
  std::shared_ptr<Work> Broadcast(at::Tensor tensor, int root,
                                  const CollectiveOptions& options) override;
  // Dtypes as for AllreduceSum.
  std::shared_ptr<Work> ReduceSum(at::Tensor tensor, int root,
                                  const CollectiveOptions& options) override;
  // Any dtype (bytes are moved). Sends and receives go over Gloo's pairs
  // with unbound buffers, the slot derived from the operation's tag.
  std::shared_ptr<Work> Exchange(at::Tensor send, std::vector<int> to,
                                 std::vector<at::Tensor> recv,
                                 std::vector<int> from,
                                 const CollectiveOptions& options) override;
  // Any dtype (bytes are moved).
  std::shared_ptr<Work> Allgather(at::Tensor output, at::Tensor input,
                                  const CollectiveOptions& options) override;
  // Fails every queued and running collective (ABORTED) and closes the
  // connections to every peer: Gloo then fails the operation in flight here
  // and at the peers waiting on this rank.
  void Abort() override;

 private:
  GlooOptions options_;
  std::shared_ptr<gloo::Context> context_;
  std::unique_ptr<ShmAllreduce> shm_;
  GlooCommunicator(const GlooOptions& options,
                   std::shared_ptr<gloo::Context> context,
                   std::unique_ptr<ShmAllreduce> shm);
  // Runs `op(tag)` on the communication thread; its status completes the work.
  std::shared_ptr<Work> Enqueue(std::function<absl::Status(uint32_t)> op);
  void Loop();

  std::mutex mu_;
  std::condition_variable cv_;
  struct Task {
    std::function<absl::Status(uint32_t)> op;
    std::shared_ptr<class PromiseWork> work;
  };
  std::deque<Task> queue_;
  bool stopping_ = false;
  bool aborted_ = false;
  std::shared_ptr<class PromiseWork> running_;  // the task in flight
  uint32_t next_tag_ = 0;
  std::thread thread_;
};

// Groups of Gloo communicators that rendezvous through one store, under
// "group/<generation>/<name>/" (ranks as threads in tests; a Session keeps
// its own, which also aborts them with their generation). Never aborts
// anything itself.
class GlooGroupFactory final : public GroupFactory {
 public:
  // `store` must outlive the factory; `base` gives hostname and the
  // connect timeout (rank, size and generation are the group's).
  GlooGroupFactory(Store* store, GlooOptions base)
      : store_(store), base_(std::move(base)) {}
  absl::StatusOr<std::shared_ptr<Communicator>> CreateGroup(
      const Communicator& parent, const std::string& name,
      const std::vector<int>& members) override;

 private:
  Store* store_;
  GlooOptions base_;
};

}  // namespace concord::comm
