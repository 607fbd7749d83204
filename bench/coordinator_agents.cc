#include "bench/coordinator_agents.h"

#include <algorithm>

namespace concord::bench {

// A Join of `w` to its job of `job_size` workers.
v1::JoinRequest JoinRequestOf(const Worker& w, size_t job_size,
                              int64_t previous_generation) {
  v1::JoinRequest request;
  request.mutable_spec()->set_job_id(w.job);
  // The first generation forms when all have joined; the next as soon as
  // every survivor is back.
  request.mutable_spec()->set_min_workers(1);
  request.mutable_spec()->set_max_workers(static_cast<int32_t>(job_size));
  request.mutable_spec()->set_settle_ms(300000);
  request.mutable_spec()->set_heartbeat_interval_ms(1000);
  // Long enough that the first job's members outlive the later joins.
  request.mutable_spec()->set_heartbeat_timeout_ms(600000);
  request.mutable_spec()->set_rendezvous_timeout_ms(600000);
  request.set_worker_id(w.id);
  request.set_worker_secret(w.secret);
  request.set_host("127.0.0.1");
  request.set_wait_timeout_ms(300000);
  request.set_previous_generation(previous_generation);
  return request;
}

// Joins workers[first, first + n) (their job's) through their simulated
// agents, opening the agents' streams (and watches) when `open`; returns
// the seconds from the first join sent to the last answer, or -1.
double JoinAllThroughAgents(std::vector<Worker>& workers,
                            std::vector<std::unique_ptr<SimAgent>>& agents,
                            AgentTracker* tracker, size_t first, size_t n,
                            size_t job_size, int64_t previous_generation,
                            size_t per_agent, const std::string& token) {
  const SteadyClock::time_point start = SteadyClock::now();
  const int64_t before = tracker->answered();
  const int64_t failed_before = tracker->failed();
  int64_t sent = 0;
  if (previous_generation == 0) {
    for (size_t a = first; a < first + n; a += per_agent) {
      std::vector<size_t> mine;
      for (size_t i = a; i < std::min(a + per_agent, first + n); ++i) {
        mine.push_back(i);
      }
      agents.push_back(
          std::make_unique<SimAgent>(&workers, std::move(mine), tracker));
      agents.back()->Open(token);
      sent += agents.back()->Join(first, n, job_size, 0, /*watch=*/true);
    }
  } else {
    for (auto& agent : agents) {
      const std::vector<size_t>& mine = agent->mine();
      if (mine.back() < first || mine.front() >= first + n) continue;
      sent += agent->Join(first, n, job_size, previous_generation, false);
    }
  }
  if (!tracker->AwaitAnswers(before + sent)) return -1;
  const double seconds = Seconds(SteadyClock::now() - start);
  if (tracker->failed() > failed_before) {
    std::fprintf(stderr, "joins through agents failed: %s\n",
                 tracker->first_error().c_str());
    return -1;
  }
  return seconds;
}

}  // namespace concord::bench
