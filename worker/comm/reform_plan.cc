#include "worker/comm/reform_plan.h"

#include <set>

#include "absl/strings/str_cat.h"

namespace concord::comm {

absl::string_view HowName(ReformPlan::How how) {
  switch (how) {
    case ReformPlan::How::kShrink:
      return "shrink";
    case ReformPlan::How::kSplit:
      return "split";
    case ReformPlan::How::kNewInit:
      return "new init";
  }
  return "new init";
}

std::vector<std::string> NextRankLabels(
    const std::vector<std::string>& previous, int64_t previous_generation,
    int64_t generation, int world_size,
    const std::optional<RankChange>& change) {
  std::vector<std::string> next;
  if (change.has_value() && change->order_kept &&
      change->previous_generation == previous_generation &&
      change->previous_world_size == static_cast<int>(previous.size())) {
    const std::set<int> departed(change->departed.begin(),
                                 change->departed.end());
    for (int r = 0; r < static_cast<int>(previous.size()); ++r) {
      if (departed.count(r) == 0) next.push_back(previous[r]);
    }
    if (static_cast<int>(next.size()) > world_size) next.clear();
  }
  for (int r = static_cast<int>(next.size()); r < world_size; ++r) {
    next.push_back(absl::StrCat("g", generation, "r", r));
  }
  return next;
}

ReformPlan PlanNextCommunicator(const GenerationChange& c) {
  ReformPlan plan;
  auto init = [&](std::string why) {
    plan = ReformPlan();
    plan.why = std::move(why);
    return plan;
  };
  if (c.backend != Backend::kNccl) {
    return init("gloo connects every generation anew");
  }
  if (!c.parent_usable) {
    return init("the previous communicator was aborted");
  }
  const std::set<std::string> before(c.previous.begin(), c.previous.end());
  const std::set<std::string> after(c.next.begin(), c.next.end());
  if (before.size() != c.previous.size() || after.size() != c.next.size()) {
    return init("a worker id appears twice");
  }
  int joined = 0;
  for (const std::string& id : c.next) joined += before.count(id) == 0;
  if (joined > 0) {
    return init(
        absl::StrCat(joined, " worker", joined == 1 ? "" : "s", " joined"));
  }
  // The survivors, in their old order, must be the new ranks.
  std::vector<std::string> survivors;
  for (int r = 0; r < static_cast<int>(c.previous.size()); ++r) {
    if (after.count(c.previous[r]) > 0) {
      survivors.push_back(c.previous[r]);
    } else {
      plan.excluded.push_back(r);
    }
  }
  if (survivors != c.next) {
    return init("the new ranks are not the survivors in their old order");
  }
  if (c.next.empty()) return init("nobody is left");
  const int gone = static_cast<int>(plan.excluded.size());
  const bool clean = !c.parent_failed && (gone == 0 || c.departed_cleanly);
  // ncclCommShrink leaves out at least one rank (NCCL refuses an empty list:
  // seen with 2.28 on a GPU), so the same members always split or init.
  if (gone > 0 && c.nccl_version >= kNcclShrinkVersion) {
    plan.how = ReformPlan::How::kShrink;
    plan.abort_in_flight = !clean;
    plan.why = absl::StrCat(gone, " rank", gone == 1 ? "" : "s", " gone",
                            clean ? ", cleanly" : ", not cleanly: abort mode");
    return plan;
  }
  if (gone == 0 && clean) {
    plan.how = ReformPlan::How::kSplit;
    plan.why = "the same members, nothing failed";
    return plan;
  }
  if (gone == 0) {
    return init(
        "a collective failed and nobody left: no split of a failed "
        "communicator, and ncclCommShrink needs a rank to leave out");
  }
  return init(absl::StrCat("members are gone and NCCL ", c.nccl_version,
                           " has no ncclCommShrink"));
}

}  // namespace concord::comm
