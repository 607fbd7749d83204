#include "worker/comm/next_communicator.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace concord::comm {
namespace {

// What one member says of its old communicator: "<usable><failed>:<gen>".
std::string Say(const DerivableCommunicator* parent) {
  if (parent == nullptr) return "00:0";
  return absl::StrCat(parent->usable() ? "1" : "0",
                      parent->failed() ? "1" : "0", ":", parent->generation());
}

struct Said {
  bool usable = false;
  bool failed = false;
  int64_t generation = 0;
};

absl::StatusOr<Said> Parse(const std::string& text) {
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  Said s;
  if (parts.size() != 2 || parts[0].size() != 2 ||
      !absl::SimpleAtoi(parts[1], &s.generation)) {
    return absl::InternalError(
        absl::StrCat("malformed re-form agreement entry '", text, "'"));
  }
  s.usable = parts[0][0] == '1';
  s.failed = parts[0][1] == '1';
  return s;
}

// The agreed facts (see the header): rank 0 decides, everyone reads.
absl::StatusOr<Said> Agree(const NextCommunicatorRequest& r,
                           const DerivableCommunicator* parent, Store* store) {
  if (absl::Status s = store->Set(absl::StrCat("reform/", r.rank), Say(parent));
      !s.ok()) {
    return s;
  }
  const std::string agreed_key = "reform/agreed";
  if (r.rank == 0) {
    const absl::Time deadline = absl::Now() + r.timeout;
    const size_t chunk = static_cast<size_t>(std::max(1, r.keys_per_get));
    std::vector<std::string> all;
    for (size_t first = 0; first < r.next.size(); first += chunk) {
      std::vector<std::string> keys;
      for (size_t i = first; i < std::min(r.next.size(), first + chunk); ++i) {
        keys.push_back(absl::StrCat("reform/", i));
      }
      absl::StatusOr<std::vector<std::string>> got = store->Get(
          keys, std::max(absl::ZeroDuration(), deadline - absl::Now()));
      if (!got.ok()) return got.status();
      all.insert(all.end(), got->begin(), got->end());
    }
    Said agreed;
    agreed.usable = true;
    for (size_t i = 0; i < all.size(); ++i) {
      absl::StatusOr<Said> one = Parse(all[i]);
      if (!one.ok()) return one.status();
      agreed.usable &= one->usable && one->generation > 0 &&
                       (i == 0 || one->generation == agreed.generation);
      agreed.failed |= one->failed;
      if (i == 0) agreed.generation = one->generation;
    }
    if (absl::Status s =
            store->Set(agreed_key, absl::StrCat(agreed.usable ? "1" : "0",
                                                agreed.failed ? "1" : "0", ":",
                                                agreed.generation));
        !s.ok()) {
      return s;
    }
    return agreed;
  }
  absl::StatusOr<std::vector<std::string>> agreed =
      store->Get({agreed_key}, r.timeout);
  if (!agreed.ok()) return agreed.status();
  return Parse(agreed->front());
}

}  // namespace

absl::StatusOr<NextCommunicator> MakeNextCommunicator(
    const NextCommunicatorRequest& request,
    std::shared_ptr<Communicator> parent, Store* store,
    const std::function<absl::StatusOr<std::unique_ptr<Communicator>>()>&
        connect) {
  auto* derivable = dynamic_cast<DerivableCommunicator*>(parent.get());
  NextCommunicator out;
  GenerationChange change;
  change.backend = request.backend;
  change.nccl_version = request.nccl_version;
  change.previous = request.previous;
  change.next = request.next;
  change.departed_cleanly = request.departed_cleanly;
  if (request.backend == Backend::kNccl) {
    absl::StatusOr<Said> agreed = Agree(request, derivable, store);
    if (!agreed.ok()) {
      if (parent != nullptr) parent->Abort();
      return agreed.status();
    }
    change.parent_usable = agreed->usable && derivable != nullptr;
    change.parent_failed = agreed->failed;
  }
  out.plan = PlanNextCommunicator(change);
  absl::StatusOr<std::unique_ptr<Communicator>> made;
  switch (out.plan.how) {
    case ReformPlan::How::kShrink:
      made = derivable->Shrink(out.plan.excluded, out.plan.abort_in_flight,
                               request.generation, request.timeout);
      break;
    case ReformPlan::How::kSplit:
      made = derivable->Split(/*color=*/0, /*key=*/request.rank,
                              request.generation, request.timeout);
      break;
    case ReformPlan::How::kNewInit:
      if (parent != nullptr) parent->Abort();
      made = connect();
      break;
  }
  if (!made.ok() || *made == nullptr) {
    if (parent != nullptr) parent->Abort();
    if (made.ok()) {
      return absl::InternalError("the derivation gave no communicator");
    }
    return made.status();
  }
  out.communicator = *std::move(made);
  return out;
}

}  // namespace concord::comm
