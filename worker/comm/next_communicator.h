#pragma once
// The next generation's communicator, made as reform_plan.h says (see Note
// [Re-forming NCCL] in reform_plan.h), with the members agreeing on how.
//
// The plan depends on facts that can differ between members: the membership
// watcher may have aborted one member's old communicator and not another's,
// and one member may have seen a collective fail where another had not yet.
// Derivations (shrink, split) are collective over the old communicator, so
// every member must take the same path. The members agree through the new
// generation's store: each sets reform/<rank> to what it knows of its old
// communicator (usable, failed, its generation), rank 0 reads them all and
// sets reform/agreed (usable only if all are and all belong to the same
// generation; failed if any saw a failure), and every member makes the plan
// from the agreed facts: N + 1 writes and 2N - 1 reads in all. Gloo needs no
// agreement (it always connects anew) and does none.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/job_defaults.h"
#include "worker/comm/communicator.h"
#include "worker/comm/reform_plan.h"
#include "worker/comm/store.h"

namespace concord::comm {

// A communicator from which the next generation's can be derived (NCCL's:
// ncclCommShrink, ncclCommSplit). Tests implement it on CPU.
class DerivableCommunicator : public Communicator {
 public:
  // Not aborted: a derivation can start from it.
  virtual bool usable() const = 0;
  // One of its collectives failed or timed out.
  virtual bool failed() const = 0;
  // Every member that stays calls the same derivation, which spends this
  // communicator. See NcclCommunicator for the errors.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Shrink(
      const std::vector<int>& excluded, bool abort_in_flight,
      int64_t generation, absl::Duration timeout) = 0;
  // color < 0: this rank leaves (OK with null).
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Split(
      int color, int key, int64_t generation, absl::Duration timeout) = 0;
};

struct NextCommunicatorRequest {
  Backend backend = Backend::kGloo;
  int nccl_version = 0;  // NCCL_VERSION_CODE; 0 without NCCL
  // Worker ids by rank: the old generation's as this worker knew it (empty
  // for a worker that was in none), the new one's.
  std::vector<std::string> previous;
  std::vector<std::string> next;
  // Everyone gone left cleanly (end of data), as the coordinator counted.
  bool departed_cleanly = false;
  // This worker in the new generation.
  int rank = 0;
  int64_t generation = 0;
  absl::Duration timeout = kDefaultCollectiveTimeout;
  // Rank 0 reads the members' entries this many keys at a time (the
  // coordinator refuses a KvGet of more than 4096).
  int keys_per_get = 1024;
};

struct NextCommunicator {
  std::unique_ptr<Communicator> communicator;
  ReformPlan plan;
};

// Makes this member's communicator of the new generation. `parent`: its
// communicator of the old generation, or null; it is spent afterwards
// (derived from, or aborted). `store`: the new generation's. `connect`: a
// new initialisation. Errors: the agreement's (the store's, e.g. a member
// that never says: DEADLINE_EXCEEDED), the derivation's or connect's; the
// parent is aborted then too, so the next attempt initialises anew.
absl::StatusOr<NextCommunicator> MakeNextCommunicator(
    const NextCommunicatorRequest& request,
    std::shared_ptr<Communicator> parent, Store* store,
    const std::function<absl::StatusOr<std::unique_ptr<Communicator>>()>&
        connect);

}  // namespace concord::comm
