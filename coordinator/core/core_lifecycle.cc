// The life of a generation: watch streams, the tick (heartbeat, lost-watch
// and rendezvous timeouts), forming and ending generations, events and the
// dirty set. The requests that drive it are in core.cc.

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/job_defaults.h"
#include "coordinator/core/core.h"
#include "coordinator/core/core_internal.h"
#include "coordinator/core/core_validation.h"

namespace concord::coordinator {

using internal::Seconds;

namespace {

// See Note [Re-forming]: how long a lost watch stream may stay lost before its
// expected survivor is dropped.
absl::Duration WatchGrace(const v1::JobSpec& spec) {
  return std::clamp(absl::Milliseconds(spec.heartbeat_interval_ms()),
                    absl::Milliseconds(100), absl::Seconds(1));
}

}  // namespace

void Core::WatchOpened(const std::string& job_id,
                       const std::string& worker_id) {
  Job* job = FindJob(job_id);
  if (job == nullptr) return;
  job->watches.Opened(worker_id);
}

void Core::WatchClosed(const std::string& job_id, const std::string& worker_id,
                       bool lost) {
  Job* job = FindJob(job_id);
  if (job == nullptr) return;
  const bool bound = job->bindings.count(worker_id) > 0;
  if (!job->watches.Closed(worker_id, lost, bound, clock_->Now())) return;
  if (lost && DropDisconnected(*job)) {
    MaybeFormGeneration(*job);
    Changed(*job);
  }
}

bool Core::DropDisconnected(Job& job) {
  if (job.state != v1::JOB_STATE_RENDEZVOUS || job.expected.empty() ||
      job.watches.lost().empty()) {
    return false;
  }
  const absl::Time now = clock_->Now();
  const absl::Duration grace = WatchGrace(job.spec);
  std::vector<std::string> dropped;
  // Only a worker whose stream was lost can be dropped: look at those, not
  // at every survivor.
  for (const std::string& id : job.watches.lost()) {
    const MemberState* survivor = job.expected.Find(id);
    if (survivor == nullptr || survivor->back) continue;
    const MemberState& e = *survivor;
    const std::optional<absl::Time> lost = job.watches.LostAt(e.worker_id);
    if (!lost.has_value()) {
      continue;  // never watched (since its binding), or watching now
    }
    const absl::Time lost_at = *lost;
    // A heartbeat after the loss: alive, its watcher just reconnecting.
    if (e.last_heartbeat > lost_at || now - lost_at < grace) continue;
    dropped.push_back(e.worker_id);
    AddEvent(job, "failure", e.worker_id,
             absl::StrFormat("did not join again after generation %d ended: "
                             "its connection to the coordinator broke (watch "
                             "stream lost for %s, grace %s)",
                             job.generation, Seconds(now - lost_at),
                             Seconds(grace)));
  }
  for (const std::string& w : dropped) {
    job.bindings.erase(w);
    Forget(job, w);
  }
  return !dropped.empty();
}

void Core::Tick() {
  const absl::Time now = clock_->Now();
  for (auto& [job_id, job] : jobs_) {
    const absl::Duration heartbeat_timeout =
        absl::Milliseconds(job.spec.heartbeat_timeout_ms());
    // Streams of workers released since they closed.
    job.watches.ForgetReleased(job.bindings);
    if (job.state == v1::JOB_STATE_RUNNING) {
      std::vector<std::string> failed;  // in rank order
      for (const MemberState& m : job.members) {
        const absl::Duration silent = now - m.last_heartbeat;
        if (m.completed || silent <= heartbeat_timeout) continue;
        failed.push_back(m.worker_id);
        AddEvent(job, "failure", m.worker_id,
                 absl::StrFormat("no heartbeat for %s (timeout %s)",
                                 Seconds(silent), Seconds(heartbeat_timeout)));
      }
      if (!failed.empty()) {
        for (const std::string& w : failed) job.bindings.erase(w);
        EndGeneration(job,
                      absl::StrCat("worker(s) ", absl::StrJoin(failed, ", "),
                                   " stopped heartbeating"),
                      std::set<std::string>(failed.begin(), failed.end()));
        MaybeFormGeneration(job);
        Changed(job);
      } else if (TakeOutHung(job, now)) {
        MaybeFormGeneration(job);
        Changed(job);
      } else if (now - job.stragglers_checked >=
                     absl::Milliseconds(job.spec.heartbeat_interval_ms()) &&
                 CheckStragglers(job, now)) {
        MaybeFormGeneration(job);
        Changed(job);
      }
      if (!job.cooling.empty() && ReleaseHeld(job, now)) {
        // The members see a worker to admit (waiting_workers).
        Changed(job);
      }
    } else if (job.state == v1::JOB_STATE_RENDEZVOUS) {
      // See Note [Evicting stragglers]: those whose cool-down is over may be
      // admitted.
      const bool released = !job.cooling.empty() && ReleaseHeld(job, now);
      // See Note [Re-forming]: those whose connection broke are gone.
      const bool disconnected = DropDisconnected(job);
      // See Note [Formation]: expected survivors silent for too long are gone.
      std::vector<std::string> dropped;
      for (const MemberState& e : job.expected) {
        const absl::Duration silent = now - e.last_heartbeat;
        if (e.back || silent <= heartbeat_timeout) continue;
        dropped.push_back(e.worker_id);
        AddEvent(job, "failure", e.worker_id,
                 absl::StrFormat("did not join again after generation %d "
                                 "ended: no heartbeat for %s (timeout %s)",
                                 job.generation, Seconds(silent),
                                 Seconds(heartbeat_timeout)));
      }
      for (const std::string& w : dropped) {
        job.bindings.erase(w);
        Forget(job, w);
      }
      MaybeFormGeneration(job);
      const absl::Duration timeout =
          absl::Milliseconds(job.spec.rendezvous_timeout_ms());
      if (job.state == v1::JOB_STATE_RUNNING ||
          now - job.rendezvous_started <= timeout) {
        if (job.state == v1::JOB_STATE_RUNNING || !dropped.empty() ||
            disconnected || released) {
          Changed(job);
        }
        continue;
      }
      // The rendezvous timed out: form with whoever is waiting, if enough.
      std::vector<std::string> missing;
      for (const MemberState& e : job.expected) {
        if (!e.back) missing.push_back(e.worker_id);
      }
      const size_t min = MinWorkers(job);
      const size_t max = static_cast<size_t>(job.spec.max_workers());
      size_t eligible = Eligible(job);
      if (eligible < min && job.waiting.size() >= min) {
        // See Note [Evicting stragglers]: a slow worker is better than a
        // failed job; those held back are let in before their time.
        for (MemberState& w : job.waiting) {
          if (!w.held) continue;
          w.held = false;
          AddEvent(job, "join", w.worker_id,
                   "let in before the end of its cool-down as an evicted "
                   "straggler: without it the job would fall below "
                   "min_workers");
        }
        eligible = Eligible(job);
      }
      if (eligible >= min) {
        for (const std::string& w : missing) {
          AddEvent(job, "failure", w,
                   absl::StrFormat("did not join again after generation %d "
                                   "ended, within the rendezvous timeout %s",
                                   job.generation, Seconds(timeout)));
          job.bindings.erase(w);
          Forget(job, w);
        }
        FormGeneration(job, std::min(eligible, max));
        Changed(job);
        continue;
      }
      job.state = v1::JOB_STATE_FAILED;
      job.failure = absl::StrFormat(
          "rendezvous timed out after %s with %d worker(s) waiting; "
          "min_workers is %d",
          Seconds(timeout), eligible, MinWorkers(job));
      if (!missing.empty()) {
        absl::StrAppendFormat(
            &job.failure,
            "; survivor(s) %s of generation %d did not join again",
            absl::StrJoin(missing, ", "), job.generation);
      }
      // The bindings stay: a process of this run that comes back does not
      // start the job again (see Note [Starting again]).
      job.waiting.Clear();
      job.expected.Clear();
      AddEvent(job, "job", "", absl::StrCat("job failed: ", job.failure));
      Changed(job);
    }
  }
}

void Core::Forget(Job& job, const std::string& worker_id) {
  job.expected.Remove(worker_id);
  job.waiting.Remove(worker_id);
}

bool Core::MaybeSucceed(Job& job) {
  if (job.state != v1::JOB_STATE_RENDEZVOUS || job.generation == 0 ||
      !job.members.empty() || !job.expected.empty() || Eligible(job) > 0) {
    return false;
  }
  job.state = v1::JOB_STATE_SUCCEEDED;
  AddEvent(job, "job", "",
           absl::StrFormat("job succeeded after generation %d: every worker "
                           "ran out of data or completed",
                           job.generation));
  return true;
}

int32_t Core::WaitingWorkers(const Job& job) {
  if (job.state != v1::JOB_STATE_RUNNING) return 0;
  const int64_t room =
      std::max<int64_t>(0, int64_t{job.spec.max_workers()} -
                               static_cast<int64_t>(job.members.size()));
  return static_cast<int32_t>(
      std::min(room, static_cast<int64_t>(Eligible(job))));
}

// See Note [Formation].
// Workers that ran out of data are done, not missing: they count towards
// min_workers, so that the ranks with data left can finish alone.
size_t Core::MinWorkers(const Job& job) {
  const size_t min = static_cast<size_t>(job.spec.min_workers());
  return std::max<size_t>(
      1, min > job.finished.size() ? min - job.finished.size() : 1);
}

void Core::ExcludeUnreachable(Job& job) {
  for (;;) {
    // Pairs among the waiting workers that one of them reported.
    std::map<std::string, std::set<std::string>> pairs;
    for (const MemberState& w : job.waiting) {
      for (const std::string& u : w.unreachable) {
        if (job.waiting.Find(u) == nullptr) continue;
        pairs[w.worker_id].insert(u);
        pairs[u].insert(w.worker_id);
      }
    }
    if (pairs.empty()) return;
    // Younger: joined the job later; at the same time, the higher rank of
    // the generation that ended (a newcomer is younger than a survivor).
    auto age = [&job](const MemberState& w) {
      auto rank = job.ended_ranks.find(w.worker_id);
      return std::make_pair(w.joined, rank == job.ended_ranks.end()
                                          ? std::numeric_limits<int32_t>::max()
                                          : rank->second);
    };
    const MemberState* out = nullptr;
    size_t most = 0;
    for (const MemberState& w : job.waiting) {
      auto it = pairs.find(w.worker_id);
      if (it == pairs.end()) continue;
      const size_t n = it->second.size();
      if (out == nullptr || n > most || (n == most && age(w) > age(*out))) {
        out = &w;
        most = n;
      }
    }
    const std::string worker_id = out->worker_id;
    const std::string why = absl::StrCat(
        "unreachable from ", absl::StrJoin(pairs[worker_id], ", "),
        " (a network partition between workers): taken out of the job");
    job.drained.insert(worker_id);
    job.bindings.erase(worker_id);
    AddEvent(job, "drain", worker_id, why);
    Forget(job, worker_id);
  }
}

void Core::MaybeFormGeneration(Job& job) {
  if (job.state != v1::JOB_STATE_RENDEZVOUS) return;
  // Callers record the change (Changed) whatever happens here.
  DropDisconnected(job);
  const size_t max = static_cast<size_t>(job.spec.max_workers());
  const size_t min = MinWorkers(job);
  if (!job.expected.empty()) {
    // Survivors: as soon as all are back and there are enough, no settling.
    if (job.expected.back_count() < job.expected.size()) return;
    // Every survivor's report is in (see Note [Unreachable peers]).
    ExcludeUnreachable(job);
    const size_t eligible = Eligible(job);
    if (eligible < min) return;
    FormGeneration(job, std::min(eligible, max));
    return;
  }
  ExcludeUnreachable(job);
  const size_t eligible = Eligible(job);
  if (eligible >= max) {
    FormGeneration(job, max);
  } else if (eligible >= min && clock_->Now() - job.last_arrival >=
                                    absl::Milliseconds(job.spec.settle_ms())) {
    FormGeneration(job, eligible);
  }
}

void Core::FormGeneration(Job& job, size_t n) {
  FlushProgress(job);  // before the members change
  const absl::Time now = clock_->Now();
  // Survivors first, then by first-join time: the rank order.
  std::set<std::string> survivors;
  for (const MemberState& e : job.expected) survivors.insert(e.worker_id);
  job.members =
      job.waiting.TakeFirst(n, [&](const MemberState& a, const MemberState& b) {
        // Held workers last: `n` never reaches them.
        if (a.held != b.held) return b.held;
        const bool sa = survivors.count(a.worker_id) > 0;
        const bool sb = survivors.count(b.worker_id) > 0;
        if (sa != sb) return sa;
        return a.joined < b.joined;
      });
  job.expected.Clear();
  // Ranks follow first-join order, so a strict comparison in rank order
  // breaks ties in favour of the longest-lived member.
  job.authoritative_rank = 0;
  for (size_t i = 0; i < job.members.size(); ++i) {
    MemberState& m = job.members[i];
    m.rank = static_cast<int32_t>(i);
    m.last_heartbeat = now;
    // See Note [Hangs]: a new generation, a fresh start; what was in flight
    // belonged to the last one.
    m.health.Restart(m.committed_step, now);
    m.completed = false;
    m.unreachable.clear();
    if (m.committed_step > job.members[job.authoritative_rank].committed_step) {
      job.authoritative_rank = m.rank;
    }
  }
  ++job.generation;
  job.probe = std::exchange(job.probe_next, false);
  job.rank_change.reset();
  if (job.ended_generation != 0 && job.ended_generation + 1 == job.generation) {
    v1::RankChange& change = job.rank_change.emplace();
    change.set_previous_generation(job.ended_generation);
    change.set_previous_world_size(job.ended_world_size);
    std::vector<bool> stayed(static_cast<size_t>(job.ended_world_size));
    bool kept = true;
    bool newcomer_seen = false;
    int32_t last = -1;
    for (const MemberState& m : job.members) {
      // Only an expected survivor is the process that held the rank (an id
      // taken again by a new process is a newcomer).
      auto it = job.ended_ranks.find(m.worker_id);
      if (survivors.count(m.worker_id) == 0 || it == job.ended_ranks.end()) {
        newcomer_seen = true;
        continue;
      }
      kept = kept && !newcomer_seen && it->second > last;
      last = it->second;
      stayed[static_cast<size_t>(it->second)] = true;
    }
    for (size_t r = 0; r < stayed.size(); ++r) {
      if (!stayed[r]) change.add_departed(static_cast<int32_t>(r));
    }
    change.set_order_kept(kept);
  }
  job.ended_ranks.clear();
  job.kv.clear();
  // See Note [Resume source].
  const bool held =
      std::any_of(job.members.begin(), job.members.end(),
                  [](const MemberState& m) { return m.committed_step > 0; });
  const std::string source = job.checkpoints.NameResume(job.spec, held);
  job.state = v1::JOB_STATE_RUNNING;
  job.history.GenerationFormed(now, job.generation,
                               static_cast<int32_t>(job.members.size()));
  AddEvent(job, "generation", "",
           absl::StrFormat("generation %d formed with %d members, "
                           "authoritative rank %d%s",
                           job.generation, job.members.size(),
                           job.authoritative_rank, source));
  Event& formed = job.events.back();
  formed.generation = job.generation;
  formed.members.resize(job.members.size());
  for (const MemberState& m : job.members) {
    formed.members[static_cast<size_t>(m.rank)] = m.worker_id;
  }
}

void Core::EndGeneration(Job& job, const std::string& why,
                         const std::set<std::string>& removed) {
  // See Note [Re-forming]: the others are expected in the next generation. Each
  // must Join again, which is how a worker learns that its generation is gone
  // (see Note [Generations]); they stay bound (see Note [Worker binding]).
  FlushProgress(job);  // before the members change
  job.expected.Clear();
  job.ended_ranks.clear();
  job.ended_generation = job.generation;
  job.ended_world_size = static_cast<int32_t>(job.members.size());
  for (const MemberState& m : job.members) {
    job.ended_ranks.emplace(m.worker_id, m.rank);
  }
  std::vector<std::string> survivors;
  for (MemberState& m : job.members) {
    if (removed.count(m.worker_id) > 0) continue;
    if (m.completed) {
      job.finished.insert(m.worker_id);
      job.bindings.erase(m.worker_id);
      continue;
    }
    m.rank = -1;
    m.back = false;
    survivors.push_back(m.worker_id);
    job.expected.Add(std::move(m));
  }
  AddEvent(job, "generation", "",
           absl::StrFormat("generation %d ended: %s%s", job.generation, why,
                           survivors.empty()
                               ? ""
                               : absl::StrCat("; expecting ",
                                              absl::StrJoin(survivors, ", "),
                                              " to join again")));
  job.events.back().generation = job.generation;
  job.history.GenerationEnded(clock_->Now(), job.generation, why);
  job.members.clear();
  job.kv.clear();
  job.authoritative_rank = 0;
  job.state = v1::JOB_STATE_RENDEZVOUS;
  job.rendezvous_started = clock_->Now();
}

void Core::AddEvent(Job& job, std::string kind, std::string worker_id,
                    std::string message) {
  spdlog::info("job {}: {}{}{}: {}", job.spec.job_id(), kind,
               worker_id.empty() ? "" : " ", worker_id, message);
  if (kind == "failure") job.history.RecordFailure();
  job.events.Add(clock_->Now(), std::move(kind), std::move(worker_id),
                 std::move(message));
}

void Core::Changed(Job& job, bool persist, Concerns concerns) {
  ++version_;
  if (!persist) return;
  if (concerns == Concerns::kArrival) {
    dirty_arrivals_.insert(job.spec.job_id());
  } else {
    dirty_.insert(job.spec.job_id());
  }
  woken_.insert(job.spec.job_id());
  if (concerns != Concerns::kKv) {
    std::string key = ViewKey(job);
    if (key != job.view_key) {
      job.view_key = std::move(key);
      job.epochs.view = version_;
    }
  }
  if (concerns != Concerns::kArrival) job.epochs.kv = version_;
  if (concerns == Concerns::kAll) job.epochs.placement = version_;
}

std::vector<std::string> Core::TakeDirtyJobs(bool arrivals) {
  if (arrivals) dirty_.insert(dirty_arrivals_.begin(), dirty_arrivals_.end());
  std::vector<std::string> ids(dirty_.begin(), dirty_.end());
  // A saved record holds the arrivals too.
  for (const std::string& id : ids) dirty_arrivals_.erase(id);
  dirty_.clear();
  return ids;
}

std::vector<std::string> Core::TakeWokenJobs() {
  std::vector<std::string> ids(woken_.begin(), woken_.end());
  woken_.clear();
  return ids;
}

std::string Core::ViewKey(const Job& job) {
  std::string key =
      absl::StrCat(job.generation, "|", static_cast<int>(job.state), "|",
                   job.failure, "|", job.authoritative_rank, "|",
                   job.members.size(), "|", WaitingWorkers(job));
  return key;
}

std::optional<size_t> Core::MemberIndex(const Job& job,
                                        const std::string& worker_id) {
  if (job.member_index_generation != job.generation ||
      job.member_index_size != job.members.size()) {
    job.member_index.clear();
    for (size_t i = 0; i < job.members.size(); ++i) {
      job.member_index.emplace(job.members[i].worker_id, i);
    }
    job.member_index_generation = job.generation;
    job.member_index_size = job.members.size();
  }
  auto it = job.member_index.find(worker_id);
  if (it == job.member_index.end()) return std::nullopt;
  return it->second;
}

JobEpochs Core::Epochs(const std::string& job_id) const {
  const Job* job = FindJob(job_id);
  return job == nullptr ? JobEpochs{} : job->epochs;
}

std::vector<Event> Core::Events(const std::string& job_id) const {
  const Job* job = FindJob(job_id);
  if (job == nullptr) return {};
  return std::vector<Event>(job->events.all().begin(), job->events.all().end());
}

std::vector<Event> Core::EventsAfter(const std::string& job_id, int64_t after,
                                     int64_t* lost) const {
  *lost = 0;
  const Job* job = FindJob(job_id);
  if (job == nullptr) return {};
  return job->events.After(after, lost);
}

int64_t Core::LastEventSeq(const std::string& job_id) const {
  const Job* job = FindJob(job_id);
  return job == nullptr ? 0 : job->events.last_seq();
}

std::optional<v1::JobState> Core::State(const std::string& job_id) const {
  const Job* job = FindJob(job_id);
  if (job == nullptr) return std::nullopt;
  return job->state;
}

std::string Core::Failure(const std::string& job_id) const {
  const Job* job = FindJob(job_id);
  return job == nullptr ? std::string() : job->failure;
}

int64_t Core::CurrentGeneration(const std::string& job_id) const {
  const Job* job = FindJob(job_id);
  return job == nullptr ? 0 : job->generation;
}

}  // namespace concord::coordinator
