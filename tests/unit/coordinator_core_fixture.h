#pragma once
// The fixtures of the coordinator core's decision tests: a Core on a fake
// clock, a helper that forms a generation, a deterministic snapshot; for
// re-forming, views of members, survivors, waiting workers and events.

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include <string>
#include <vector>

#include "common/clock.h"
#include "coordinator/core/core.h"
#include "coordinator_requests.h"

namespace concord::coordinator::testing {

// Records equal but for heartbeat times, which RestoreJob does not take
// (timers restart from the restore time). Proto maps serialise in no fixed
// order: compare as messages.
inline bool SameRecord(const v1::JobRecord& a, const v1::JobRecord& b) {
  google::protobuf::util::MessageDifferencer differ;
  differ.IgnoreField(v1::MemberRecord::descriptor()->FindFieldByName(
      "last_heartbeat_unix_ms"));
  std::string report;
  differ.ReportDifferencesToString(&report);
  const bool same = differ.Compare(a, b);
  if (!same) ADD_FAILURE() << report;
  return same;
}

class CoordinatorDecisionsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { spdlog::set_level(spdlog::level::warn); }

  int64_t FormGeneration(int n) {
    for (int i = 0; i < n; ++i) {
      EXPECT_TRUE(core_.Join(JoinReq(Spec(n), Worker(i))).ok());
    }
    EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
    return core_.CurrentGeneration(kJob);
  }

  // Proto maps serialise in no fixed order unless asked to.
  std::string Snapshot() {
    auto record = core_.ExportJob(kJob);
    if (!record) return "";
    std::string out;
    {
      google::protobuf::io::StringOutputStream stream(&out);
      google::protobuf::io::CodedOutputStream coded(&stream);
      coded.SetSerializationDeterministic(true);
      record->SerializeToCodedStream(&coded);
    }
    return out;
  }

  FakeClock clock_;
  Core core_{&clock_};
};

// See Note [Re-forming]: a generation formed after the settle period, views of
// the job's members, survivors and waiting workers, its events.
class CoordinatorReformTest : public CoordinatorDecisionsTest {
 protected:
  // Joins w0..w{n-1} 10 ms apart into a job of max_workers `max` (min 1, the
  // default 2 s settle period) and lets generation 1 form.
  int64_t FormSettled(int n, int max) {
    for (int i = 0; i < n; ++i) {
      if (i > 0) clock_.Advance(absl::Milliseconds(10));
      EXPECT_TRUE(core_.Join(JoinReq(Spec(max), Worker(i))).ok());
    }
    clock_.Advance(absl::Seconds(2));
    core_.Tick();
    EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
    return core_.CurrentGeneration(kJob);
  }

  v1::JobStatus Status() {
    v1::GetJobRequest get;
    get.set_job_id(kJob);
    auto status = core_.GetJob(get);
    EXPECT_TRUE(status.ok()) << status.status();
    return status.ok() ? *status : v1::JobStatus();
  }

  // Worker ids of the current generation, by rank.
  std::vector<std::string> Ranks() {
    std::vector<std::string> ids;
    const v1::JobStatus status = Status();
    for (const auto& m : status.members()) ids.push_back(m.worker_id());
    return ids;
  }
  // Expected survivors that have not joined again.
  std::vector<std::string> Expected() {
    std::vector<std::string> ids;
    const v1::JobStatus status = Status();
    for (const auto& m : status.expected()) ids.push_back(m.worker_id());
    return ids;
  }
  std::vector<std::string> Waiting() {
    std::vector<std::string> ids;
    const v1::JobStatus status = Status();
    for (const auto& m : status.waiting()) ids.push_back(m.worker_id());
    return ids;
  }

  std::vector<Event> EventsOf(const std::string& kind) {
    std::vector<Event> out;
    for (const Event& e : core_.Events(kJob)) {
      if (e.kind == kind) out.push_back(e);
    }
    return out;
  }

  absl::StatusCode HeartbeatCode(const std::string& worker, int64_t gen,
                                 int64_t step = 0) {
    return core_.Heartbeat(HeartbeatReq(worker, gen, step)).status().code();
  }

  int32_t WaitingWorkersSeenBy(const std::string& worker) {
    v1::WatchMembershipRequest r;
    r.set_job_id(kJob);
    r.set_worker_id(worker);
    r.set_worker_secret(Secret(worker));
    auto update = core_.Membership(r);
    EXPECT_TRUE(update.ok()) << update.status();
    return update.ok() ? update->waiting_workers() : -1;
  }
};

constexpr char kKilled[] = "killed by signal 9 (SIGKILL)";

// Exited workers and checkpoint records (coordinator_exit_test.cc,
// coordinator_checkpoint_test.cc): a job whose workers only a report takes
// out.
class CoordinatorExitTest : public CoordinatorReformTest {
 protected:
  // A job of `n` workers with a 60 s heartbeat timeout (nothing but the
  // report can take a worker out within the test), generation 1 running.
  int64_t FormLong(int n, int min_workers = 1) {
    spec_ = Spec(n, min_workers);
    spec_.set_heartbeat_timeout_ms(60000);
    for (int i = 0; i < n; ++i) {
      EXPECT_TRUE(core_.Join(JoinReq(spec_, Worker(i))).ok());
    }
    EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
    return core_.CurrentGeneration(kJob);
  }

  absl::StatusOr<bool> Exited(const std::string& worker,
                              const std::string& how = kKilled) {
    return core_.WorkerExited(kJob, worker, Secret(worker), how);
  }

  v1::JobSpec spec_;
};

}  // namespace concord::coordinator::testing
