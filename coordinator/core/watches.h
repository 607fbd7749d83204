#pragma once
// A job's workers' WatchMembership streams, one part of the coordinator's
// core (core.h): how many each worker has open and when its last one was
// lost, so that an expected survivor whose connection broke is dropped
// without waiting for heartbeat_timeout (see Note [Re-forming] in core.h).
// Transient: never exported, never persisted; open streams outlive a
// replaced record. Time is passed in.

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "absl/time/time.h"

namespace concord::coordinator {

class Watches {
 public:
  // A stream of `worker_id` is open: it is not lost.
  void Opened(const std::string& worker_id);
  // A stream of `worker_id` closed at `now`, `lost` when its client went
  // away. `bound`: whether the worker id is still bound (see Note [Worker
  // binding] in core.h); with no stream left open, an unbound worker is
  // forgotten. Returns false when nothing is left to consider: no stream of
  // the worker was open (a close without an open is ignored), or it was
  // forgotten.
  bool Closed(const std::string& worker_id, bool lost, bool bound,
              absl::Time now);
  // `worker_id` is bound anew: a lost stream of an earlier holder of the id
  // says nothing about this process.
  void Rebound(const std::string& worker_id);
  // Forgets the workers with no stream open whose binding was released
  // since (no longer in `bindings`). Only those are looked at: it costs
  // nothing per open stream.
  void ForgetReleased(const std::map<std::string, std::string>& bindings);

  // When the last stream of `worker_id` was lost, while it has none open;
  // nullopt when it never watched since its binding, closed its last
  // normally, or is watching now.
  std::optional<absl::Time> LostAt(const std::string& worker_id) const;
  // The workers whose last stream was lost (LostAt may still say nullopt for
  // one with another stream open).
  const std::set<std::string>& lost() const { return lost_; }
  // The streams of `worker_id` open now.
  int64_t open(const std::string& worker_id) const;
  // Workers tracked (with a stream open, or bound with none).
  size_t size() const { return watches_.size(); }

 private:
  struct WatchState {
    int64_t open = 0;
    // When its last stream was lost; unset while one is open, after a
    // normal close, or once the worker id is bound anew.
    std::optional<absl::Time> lost_at;
  };
  // Sets (or, with nullopt, clears) the worker's lost_at, keeping lost_ in
  // step.
  void SetLost(const std::string& worker_id, WatchState& watch,
               std::optional<absl::Time> at);

  // By worker id, while the worker has a stream open or is bound.
  std::map<std::string, WatchState> watches_;
  // The workers in watches_ whose lost_at is set.
  std::set<std::string> lost_;
  // The workers in watches_ with no stream open: ForgetReleased forgets them
  // once their binding is released.
  std::set<std::string> idle_;
};

}  // namespace concord::coordinator
