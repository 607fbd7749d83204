#pragma once
// concord-bench-coordinator's simulated workers and node agents: a worker's
// identity and connection, and an agent's Node stream carrying its workers'
// joins, watches and heartbeats as concord-run sends them (see Note [Node
// agents] in agent/node_agent.h). Benchmark code, not a test.

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_auth.h"
#include "concord/v1/agent.grpc.pb.h"
#include "concord/v1/worker.grpc.pb.h"

namespace concord::bench {

namespace v1 = concord::v1;
using SteadyClock = std::chrono::steady_clock;

struct Worker {
  std::string job;
  std::string id;
  std::string secret;
  int64_t generation = 0;
  bool dead = false;  // left (the re-form's death)
  v1::WorkerService::Stub* stub = nullptr;
  v1::AgentService::Stub* agent = nullptr;  // its node agent's connection
};

inline double Seconds(SteadyClock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// A Join of `w` to its job of `job_size` workers.
v1::JoinRequest JoinRequestOf(const Worker& w, size_t job_size,
                              int64_t previous_generation);

// What the simulated agents' streams have answered so far.
class AgentTracker {
 public:
  void Answered(bool ok, const std::string& error) {
    std::lock_guard<std::mutex> lock(mu_);
    ++answered_;
    if (!ok && failed_++ == 0) first_error_ = error;
    cv_.notify_all();
  }
  void Views(int n) { views_ += n; }
  void StreamDone() {
    std::lock_guard<std::mutex> lock(mu_);
    ++done_;
    cv_.notify_all();
  }
  // Waits until `answers` joins were answered in all (false after 10 min).
  bool AwaitAnswers(int64_t answers) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::minutes(10),
                        [&] { return answered_ >= answers; });
  }
  void AwaitStreamsDone(int64_t streams) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::minutes(1),
                 [&] { return done_ >= streams; });
  }
  int64_t answered() {
    std::lock_guard<std::mutex> lock(mu_);
    return answered_;
  }
  int64_t failed() {
    std::lock_guard<std::mutex> lock(mu_);
    return failed_;
  }
  std::string first_error() {
    std::lock_guard<std::mutex> lock(mu_);
    return first_error_;
  }
  int64_t views() const { return views_.load(); }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t answered_ = 0, failed_ = 0, done_ = 0;
  std::string first_error_;
  std::atomic<int64_t> views_{0};
};

// Heartbeat answers that came back on the simulated agents' streams.
struct StreamHeartbeatStats {
  std::mutex mu;
  std::vector<double> latency_ms;  // per message, sent after measure_from
  int64_t answered = 0;
  int64_t errors = 0;
  std::string first_error;
};

// A simulated node agent's Node stream (agent.proto): its workers' joins,
// heartbeats and membership watches, as concord-run sends them. Writes go
// one at a time; what is sent meanwhile goes in the next.
// What a worker's heartbeat says it is doing (WorkerProgress, see Note
// [Hangs] in coordinator/core/hang_rule.h): as a training worker's, a
// collective in flight for a few milliseconds, the CPU moving.
inline void FillProgress(int64_t step, v1::WorkerProgress* p) {
  p->set_generation(1);
  p->set_collectives(3 * step + 2);
  p->set_pending_seq(3 * step + 2);
  p->set_pending_kind("allreduce");
  p->set_pending_ms(3);
  p->set_last_kind("allreduce");
  p->set_last_ago_ms(5);
  p->set_cpu_ms(900 * step);
  p->set_step_ms(20.5);
  p->set_pid(4242);
}
// What a node agent adds to it (see Note [What the agent sees] in
// agent/process_view.h): the process running, its CPU moving, a GPU busy.
inline void FillProcess(int64_t step, v1::ProcessView* v) {
  v->set_state("running");
  v->set_cpu_ms(900 * step);
  v->set_gpu_percent(85);
}

class SimAgent final
    : public grpc::ClientBidiReactor<v1::NodeRequest, v1::NodeUpdate> {
 public:
  SimAgent(std::vector<Worker>* workers, std::vector<size_t> mine,
           AgentTracker* tracker)
      : workers_(workers), mine_(std::move(mine)), tracker_(tracker) {}

  const std::vector<size_t>& mine() const { return mine_; }

  void Open(const std::string& token) {
    concord::AddBearerToken(context_, token);
    (*workers_)[mine_.front()].agent->async()->Node(&context_, this);
    AddHold();
    StartRead(&read_);
    StartCall();
  }
  // Joins those of its workers in [first, first + n) that are alive,
  // naming `previous_generation`; with `watch`, also starts watching all
  // of them. Returns how many joins it sent.
  int Join(size_t first, size_t n, size_t job_size, int64_t previous_generation,
           bool watch) {
    v1::NodeRequest request;
    request.set_job_id((*workers_)[mine_.front()].job);
    for (size_t k = 0; k < mine_.size(); ++k) {
      const Worker& w = (*workers_)[mine_[k]];
      if (watch) {
        v1::WatchedWorker* add = request.add_add();
        add->set_worker_id(w.id);
        add->set_worker_secret(w.secret);
      }
      if (mine_[k] < first || mine_[k] >= first + n || w.dead) continue;
      v1::NodeJoin* join = request.add_joins();
      join->set_id(k);
      *join->mutable_request() =
          JoinRequestOf(w, job_size, previous_generation);
    }
    const int joins = request.joins_size();
    Write(std::move(request));
    return joins;
  }
  // One message with the heartbeats of its live workers; the answers go to
  // `stats` (the message's latency when sent after `measure_from`).
  // Returns how many heartbeats it sent.
  int Heartbeat(int64_t step, SteadyClock::time_point measure_from,
                StreamHeartbeatStats* stats, bool progress) {
    v1::NodeRequest request;
    const uint64_t seq = next_seq_++;
    for (size_t k = 0; k < mine_.size(); ++k) {
      const Worker& w = (*workers_)[mine_[k]];
      if (w.dead) continue;
      v1::NodeHeartbeat* heartbeat = request.add_heartbeats();
      heartbeat->set_id(seq * kIdsPerMessage + k);
      v1::HeartbeatRequest* r = heartbeat->mutable_request();
      r->set_job_id(w.job);
      r->set_worker_id(w.id);
      r->set_worker_secret(w.secret);
      r->set_generation(w.generation);
      r->set_step(step);
      r->set_samples_per_second(1000.0);
      if (progress) {
        FillProgress(step, r->mutable_progress());
        FillProcess(step, heartbeat->mutable_process());
      }
    }
    const int sent = request.heartbeats_size();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stats_ = stats;
      const SteadyClock::time_point now = SteadyClock::now();
      if (now >= measure_from) sent_at_[seq] = now;
    }
    Write(std::move(request));
    return sent;
  }
  void Close() {
    context_.TryCancel();
    RemoveHold();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    tracker_->Views(read_.views_size());
    for (const v1::JoinResult& r : read_.joins()) {
      if (r.code() == 0) {
        (*workers_)[mine_[r.id()]].generation = r.response().generation();
      }
      tracker_->Answered(r.code() == 0,
                         absl::StrCat(r.code(), ": ", r.message()));
    }
    if (read_.heartbeats_size() > 0) {
      const SteadyClock::time_point now = SteadyClock::now();
      StreamHeartbeatStats* stats;
      std::vector<double> latencies;
      {
        std::lock_guard<std::mutex> lock(mu_);
        stats = stats_;
        for (const v1::HeartbeatResult& r : read_.heartbeats()) {
          auto it = sent_at_.find(r.id() / kIdsPerMessage);
          if (it == sent_at_.end()) continue;
          latencies.push_back(1e3 * Seconds(now - it->second));
          sent_at_.erase(it);
        }
      }
      std::lock_guard<std::mutex> lock(stats->mu);
      stats->latency_ms.insert(stats->latency_ms.end(), latencies.begin(),
                               latencies.end());
      for (const v1::HeartbeatResult& r : read_.heartbeats()) {
        ++stats->answered;
        if (r.code() != 0 && stats->errors++ == 0) {
          stats->first_error = absl::StrCat(r.code(), ": ", r.message());
        }
      }
    }
    StartRead(&read_);
  }
  void OnWriteDone(bool /*ok*/) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (queued_.ByteSizeLong() == 0) {
        writing_ = false;
        return;
      }
      write_ = std::move(queued_);
      queued_.Clear();
    }
    StartWrite(&write_);
  }
  void OnDone(const grpc::Status& /*status*/) override {
    tracker_->StreamDone();
  }

 private:
  static constexpr uint64_t kIdsPerMessage = 1 << 16;

  // Writes `request`, or queues it behind the write in flight.
  void Write(v1::NodeRequest request) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (writing_) {
        queued_.MergeFrom(request);
        return;
      }
      writing_ = true;
      write_ = std::move(request);
    }
    // Outside the lock: gRPC may run a reaction on this thread.
    StartWrite(&write_);
  }

  std::vector<Worker>* workers_;
  const std::vector<size_t> mine_;
  AgentTracker* tracker_;
  grpc::ClientContext context_;
  v1::NodeUpdate read_;
  std::atomic<uint64_t> next_seq_{0};
  std::mutex mu_;
  v1::NodeRequest write_;                                // in flight
  v1::NodeRequest queued_;                               // guarded by mu_
  bool writing_ = false;                                 // guarded by mu_
  std::map<uint64_t, SteadyClock::time_point> sent_at_;  // by message
  StreamHeartbeatStats* stats_ = nullptr;                // guarded by mu_
};

// Joins workers[first, first + n) (their job's) through their simulated
// agents, opening the agents' streams (and watches) when `open`; returns
// the seconds from the first join sent to the last answer, or -1.
double JoinAllThroughAgents(std::vector<Worker>& workers,
                            std::vector<std::unique_ptr<SimAgent>>& agents,
                            AgentTracker* tracker, size_t first, size_t n,
                            size_t job_size, int64_t previous_generation,
                            size_t per_agent, const std::string& token);

}  // namespace concord::bench
