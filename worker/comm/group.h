#pragma once
// Communicators over a subset of one generation's ranks (SlowMo's intra-node
// and node-master groups, see Note [Node hierarchy] in
// worker/slowmo/hierarchy.h).

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"

namespace concord::comm {

class GroupFactory {
 public:
  virtual ~GroupFactory() = default;
  // Connects a communicator over `members` (ranks of `parent`, ascending,
  // containing parent.rank()); this rank's rank in it is its index in
  // `members`, its generation parent's. Every member calls it with the same
  // `name` and `members`, concurrently (it blocks until all are
  // connected); `name` must be unique among the groups of the generation.
  // The group lives in parent's generation: it is given up (aborted) when
  // that generation ends, like the parent. Errors: INVALID_ARGUMENT (bad
  // members), ABORTED (the generation is over), UNAVAILABLE /
  // DEADLINE_EXCEEDED (a member did not connect).
  virtual absl::StatusOr<std::shared_ptr<Communicator>> CreateGroup(
      const Communicator& parent, const std::string& name,
      const std::vector<int>& members) = 0;
};

// `members`' checks, shared by the implementations.
inline absl::Status CheckGroupMembers(const Communicator& parent,
                                      const std::vector<int>& members) {
  bool mine = false;
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i] < 0 || members[i] >= parent.size() ||
        (i > 0 && members[i] <= members[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("group members must be ascending ranks of ",
                       parent.size(), ", got ", members[i], " at ", i));
    }
    mine |= members[i] == parent.rank();
  }
  if (!mine) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", parent.rank(), " is not in its group"));
  }
  return absl::OkStatus();
}

}  // namespace concord::comm
