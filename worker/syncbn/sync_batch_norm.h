#pragma once
// SyncBatchNorm's inside: the group of ranks its layers reduce over, and
// the conversion with an explicit group. The module itself, and its
// arithmetic, are public: include/concord/sync_batch_norm.h (see Note
// [SyncBN arithmetic] there).

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "concord/sync_batch_norm.h"
#include "worker/comm/communicator.h"

namespace concord {
namespace detail {

// The communicator SyncBN layers use, shared by all layers of a model so
// that a new generation's communicator is installed once for all of them.
// Thread-safe; a layer takes the communicator at the start of each training
// forward and keeps it for that call's backward.
class SyncBnGroup {
 public:
  // `communicator` may be null: statistics over the local batch only (a
  // world of one).
  explicit SyncBnGroup(
      std::shared_ptr<comm::Communicator> communicator = nullptr,
      comm::CollectiveOptions options = {});

  // Installs the communicator of a new generation (the elastic loop
  // calls this after re-forming): later forwards use the new group. Must
  // not be called while a forward or backward of this group is running.
  void SetCommunicator(std::shared_ptr<comm::Communicator> communicator);
  std::shared_ptr<comm::Communicator> communicator() const;
  const comm::CollectiveOptions& options() const { return options_; }

 private:
  mutable std::mutex mu_;
  std::shared_ptr<comm::Communicator> communicator_;
  comm::CollectiveOptions options_;
};

}  // namespace detail

using detail::SyncBnGroup;

// convert_sync_batchnorm with the layers' group given (null: a group of
// their own, bound to no communicator): concord-train and the tests give
// one. `replaced` (optional) receives the qualified names of the replaced
// modules ("" for the root).
std::shared_ptr<torch::nn::Module> ConvertSyncBatchNorm(
    std::shared_ptr<torch::nn::Module> root, std::shared_ptr<SyncBnGroup> group,
    std::vector<std::string>* replaced = nullptr);

}  // namespace concord
