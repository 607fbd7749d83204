// The coordinator core's newer decisions, driven by a fake clock: request
// validation, worker binding, min_workers formation, the end-of-data
// agreement, drain/stop, operator views and export/restore.

#include <gmock/gmock.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "coordinator/core.h"
#include "coordinator_requests.h"

namespace concord::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

using testing::EndOfDataReq;
using testing::HeartbeatReq;
using testing::JoinReq;
using testing::kJob;
using testing::LeaveReq;
using testing::RejoinReq;
using testing::Secret;
using testing::Spec;
using testing::Worker;

// Records equal but for heartbeat times, which RestoreJob does not take
// (timers restart from the restore time). Proto maps serialise in no fixed
// order: compare as messages.
bool SameRecord(const v1::JobRecord& a, const v1::JobRecord& b) {
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

TEST_F(CoordinatorDecisionsTest,
       BadRequestsAreInvalidArgumentAndChangeNothing) {
  const int64_t gen = FormGeneration(2);
  const uint64_t version = core_.version();
  const std::string before = Snapshot();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<std::pair<std::string, absl::Status>> results;
  auto join = [&](std::function<void(v1::JoinRequest&)> f) {
    v1::JoinRequest r = JoinReq(Spec(2), "new");
    f(r);
    return core_.Join(r);
  };
  auto hb = [&](std::function<void(v1::HeartbeatRequest&)> f) {
    v1::HeartbeatRequest r = HeartbeatReq(Worker(0), gen);
    f(r);
    return core_.Heartbeat(r).status();
  };
  results = {
      {"job id charset",
       join([](auto& r) { r.mutable_spec()->set_job_id("a/b"); })},
      {"job id dot", join([](auto& r) { r.mutable_spec()->set_job_id(".."); })},
      {"long worker id",
       join([](auto& r) { r.set_worker_id(std::string(129, 'x')); })},
      {"short secret", join([](auto& r) { r.set_worker_secret("short"); })},
      {"negative step", join([](auto& r) { r.set_committed_step(-1); })},
      {"long host", join([](auto& r) { r.set_host(std::string(300, 'h')); })},
      {"wait too long",
       join([](auto& r) { r.set_wait_timeout_ms(1LL << 40); })},
      {"settle >= rendezvous",
       join([](auto& r) { r.mutable_spec()->set_settle_ms(300000); })},
      {"negative settle",
       join([](auto& r) { r.mutable_spec()->set_settle_ms(-1); })},
      {"hb nan rate", hb([&](auto& r) { r.set_samples_per_second(nan); })},
      {"hb negative step", hb([](auto& r) { r.set_step(-3); })},
      {"hb negative generation", hb([](auto& r) { r.set_generation(-1); })},
      {"hb negative ddp",
       hb([](auto& r) { r.mutable_ddp()->set_forward_ms(-1); })},
      {"hb missing secret", hb([](auto& r) { r.clear_worker_secret(); })},
  };
  v1::LeaveRequest leave;
  leave.set_job_id(kJob);
  leave.set_worker_id(Worker(0));
  leave.set_worker_secret(Secret(Worker(0)));
  leave.set_generation(gen);
  leave.set_reason(static_cast<v1::LeaveReason>(99));
  results.emplace_back("leave reason", core_.Leave(leave).status());
  v1::KvSetRequest kv;
  kv.set_job_id(kJob);
  kv.set_worker_id(Worker(0));
  kv.set_worker_secret(Secret(Worker(0)));
  kv.set_generation(gen);
  kv.set_key(std::string(2000, 'k'));
  results.emplace_back("long key", core_.KvSet(kv));
  kv.set_key("k");
  kv.set_value(std::string((4 << 20) + 1, 'v'));
  results.emplace_back("big value", core_.KvSet(kv));
  v1::KvGetRequest get;
  get.set_job_id(kJob);
  get.set_worker_id(Worker(0));
  get.set_worker_secret(Secret(Worker(0)));
  get.set_generation(gen);
  results.emplace_back("no keys", core_.KvGet(get).status());
  results.emplace_back(
      "eod negative",
      core_.ReportEndOfData(EndOfDataReq(Worker(0), gen, -1)).status());
  v1::ListEventsRequest events;
  events.set_job_id(kJob);
  events.set_limit(5000);
  results.emplace_back("events limit", core_.ListEvents(events).status());
  v1::DrainWorkerRequest drain;
  drain.set_job_id(kJob);
  results.emplace_back("drain no worker", core_.DrainWorker(drain).status());
  v1::StopJobRequest stop;
  stop.set_job_id("bad id!");
  results.emplace_back("stop bad id", core_.StopJob(stop).status());

  for (const auto& [name, status] : results) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_FALSE(status.message().empty()) << name;
  }
  EXPECT_EQ(core_.version(), version);
  EXPECT_EQ(Snapshot(), before);
  EXPECT_EQ(core_.job_count(), 1u);
}

TEST_F(CoordinatorDecisionsTest, AWorkerIdIsBoundToItsProcess) {
  const int64_t gen = FormGeneration(2);
  v1::HeartbeatRequest forged = HeartbeatReq(Worker(0), gen);
  forged.set_worker_secret(Secret("impostor"));
  EXPECT_EQ(core_.Heartbeat(forged).status().code(),
            absl::StatusCode::kPermissionDenied);
  v1::JoinRequest steal = JoinReq(Spec(2), Worker(1));
  steal.set_worker_secret(Secret("impostor"));
  EXPECT_EQ(core_.Join(steal).code(), absl::StatusCode::kPermissionDenied);

  // A worker of another job cannot act in this one under its own name
  // (not a member) nor under a member's name (wrong secret).
  v1::JobSpec other = Spec(1);
  other.set_job_id("other");
  ASSERT_TRUE(core_.Join(JoinReq(other, "x")).ok());
  v1::KvSetRequest kv;
  kv.set_job_id(kJob);
  kv.set_generation(gen);
  kv.set_key("gloo/0");
  kv.set_worker_id("x");
  kv.set_worker_secret(Secret("x"));
  EXPECT_EQ(core_.KvSet(kv).code(), absl::StatusCode::kNotFound);
  kv.set_worker_id(Worker(0));
  EXPECT_EQ(core_.KvSet(kv).code(), absl::StatusCode::kPermissionDenied);

  // After w1 is declared failed its id is free for a new process.
  for (int t = 0; t < 11; ++t) {
    clock_.Advance(absl::Seconds(1));
    ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(0), gen)).ok());
    core_.Tick();
  }
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_TRUE(core_.Join(steal).ok());
}

TEST_F(CoordinatorDecisionsTest, MinWorkersFormAfterTheSettlePeriod) {
  const v1::JobSpec spec = Spec(4, 2);  // settle: the 2 s default
  ASSERT_TRUE(core_.Join(JoinReq(spec, "a")).ok());
  clock_.Advance(absl::Seconds(5));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);  // 1 < min
  ASSERT_TRUE(core_.Join(JoinReq(spec, "b")).ok());
  clock_.Advance(absl::Milliseconds(1500));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);  // settling
  ASSERT_TRUE(core_.Join(JoinReq(spec, "c")).ok());        // restarts it
  clock_.Advance(absl::Milliseconds(1999));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  clock_.Advance(absl::Milliseconds(1));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  auto a = core_.GetAssignment(kJob, "c");
  ASSERT_TRUE(a.ok() && a->has_value());
  EXPECT_EQ((*a)->world_size, 3);
  EXPECT_EQ((*a)->rank, 2);
}

TEST_F(CoordinatorDecisionsTest, TooFewWorkersFailTheJobWithAClearReason) {
  v1::JobSpec spec = Spec(4, 3);
  spec.set_rendezvous_timeout_ms(30000);
  ASSERT_TRUE(core_.Join(JoinReq(spec, "a")).ok());
  ASSERT_TRUE(core_.Join(JoinReq(spec, "b")).ok());
  clock_.Advance(absl::Seconds(31));
  core_.Tick();
  v1::GetJobRequest get;
  get.set_job_id(kJob);
  auto status = core_.GetJob(get);
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(status->failure(),
            "rendezvous timed out after 30s with 2 worker(s) waiting; "
            "min_workers is 3");
}

TEST_F(CoordinatorDecisionsTest, EndOfDataBoundaryMovesTheRestOn) {
  const int64_t gen = FormGeneration(3);
  for (int i = 0; i < 3; ++i)
    ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(i), gen, 5)).ok());
  // Behind a committed step: refused, nothing changes.
  EXPECT_EQ(
      core_.ReportEndOfData(EndOfDataReq(Worker(2), gen, 4)).status().code(),
      absl::StatusCode::kInvalidArgument);
  auto first = core_.ReportEndOfData(EndOfDataReq(Worker(1), gen, 9));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->boundary_step(), 9);
  EXPECT_THAT(first->leaving(), ElementsAre(Worker(1)));
  // An earlier end moves the boundary down while nobody has passed it.
  auto second = core_.ReportEndOfData(EndOfDataReq(Worker(2), gen, 7));
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->boundary_step(), 7);
  EXPECT_THAT(second->leaving(), ElementsAre(Worker(2)));

  auto hb = core_.Heartbeat(HeartbeatReq(Worker(0), gen, 7));
  ASSERT_TRUE(hb.ok());
  EXPECT_EQ(hb->boundary_step(), 7);
  ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(1), gen, 7)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(2), gen, 7)).ok());
  // Everyone committed step 7: w2 leaves, w0 and w1 re-form.
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  v1::LeaveRequest leave;
  leave.set_job_id(kJob);
  leave.set_worker_id(Worker(2));
  leave.set_worker_secret(Secret(Worker(2)));
  leave.set_generation(gen);
  leave.set_reason(v1::LEAVE_REASON_COMPLETED);
  EXPECT_TRUE(core_.Leave(leave).ok());  // harmless after the boundary
  ASSERT_TRUE(core_.Join(JoinReq(Spec(3), Worker(1), 7)).ok());
  ASSERT_TRUE(core_.Join(JoinReq(Spec(3), Worker(0), 7)).ok());
  clock_.Advance(absl::Seconds(2));
  core_.Tick();
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  auto a = core_.GetAssignment(kJob, Worker(0));
  ASSERT_TRUE(a.ok() && a->has_value());
  EXPECT_EQ((*a)->world_size, 2);

  // Both run out at the same step: the job succeeds.
  const int64_t next = gen + 1;
  ASSERT_TRUE(core_.ReportEndOfData(EndOfDataReq(Worker(0), next, 12)).ok());
  ASSERT_TRUE(core_.ReportEndOfData(EndOfDataReq(Worker(1), next, 12)).ok());
  ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(0), next, 12)).ok());
  ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(1), next, 12)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_SUCCEEDED);
}

TEST_F(CoordinatorDecisionsTest, DrainEndsTheGenerationAndStopEndsTheJob) {
  const int64_t gen = FormGeneration(3);
  v1::DrainWorkerRequest drain;
  drain.set_job_id(kJob);
  drain.set_worker_id(Worker(1));
  drain.set_reason("maintenance");
  auto drained = core_.DrainWorker(drain);
  ASSERT_TRUE(drained.ok()) << drained.status();
  EXPECT_EQ(drained->ended_generation(), gen);
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(core_.Join(JoinReq(Spec(3), Worker(1))).code(),
            absl::StatusCode::kFailedPrecondition);
  drain.set_worker_id("nobody");
  EXPECT_EQ(core_.DrainWorker(drain).status().code(),
            absl::StatusCode::kNotFound);

  v1::StopJobRequest stop;
  stop.set_job_id(kJob);
  stop.set_reason("bad data");
  auto stopped = core_.StopJob(stop);
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ(stopped->state(), v1::JOB_STATE_STOPPED);
  const absl::Status join = core_.Join(JoinReq(Spec(3), Worker(0)));
  EXPECT_EQ(join.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(join.message(), HasSubstr("stopped by an operator: bad data"));
  EXPECT_TRUE(core_.StopJob(stop).ok());  // idempotent

  v1::ListEventsRequest events;
  events.set_job_id(kJob);
  auto all = core_.ListEvents(events);
  ASSERT_TRUE(all.ok());
  ASSERT_GE(all->events_size(), 3);
  EXPECT_EQ(all->events(0).seq(), 1);
  std::vector<std::string> kinds;
  for (const auto& e : all->events()) kinds.push_back(e.kind());
  EXPECT_THAT(kinds, ::testing::Contains("drain"));
  EXPECT_EQ(kinds.back(), "stop");
  events.set_after_seq(all->events(all->events_size() - 2).seq());
  auto tail = core_.ListEvents(events);
  ASSERT_TRUE(tail.ok());
  ASSERT_EQ(tail->events_size(), 1);
  EXPECT_EQ(tail->events(0).kind(), "stop");
}

TEST_F(CoordinatorDecisionsTest, GetJobShowsMembersAndHealth) {
  const int64_t gen = FormGeneration(2);
  clock_.Advance(absl::Seconds(3));
  v1::HeartbeatRequest hb = HeartbeatReq(Worker(1), gen, 42);
  hb.set_samples_per_second(123.5);
  hb.mutable_ddp()->set_allreduce_wait_ms(2.5);
  ASSERT_TRUE(core_.Heartbeat(hb).ok());
  clock_.Advance(absl::Milliseconds(500));
  v1::GetJobRequest get;
  get.set_job_id(kJob);
  auto status = core_.GetJob(get);
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->generation(), gen);
  ASSERT_EQ(status->members_size(), 2);
  EXPECT_EQ(status->members(0).last_heartbeat_age_ms(), 3500);
  EXPECT_EQ(status->members(1).last_heartbeat_age_ms(), 500);
  EXPECT_EQ(status->members(1).committed_step(), 42);
  EXPECT_EQ(status->members(1).samples_per_second(), 123.5);
  EXPECT_EQ(status->members(1).ddp().allreduce_wait_ms(), 2.5);
  EXPECT_EQ(status->authoritative_rank(), 0);
  EXPECT_FALSE(status->recent_events().empty());
  get.set_job_id("missing");
  EXPECT_EQ(core_.GetJob(get).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(core_.ListJobs().jobs_size(), 1);
}

TEST_F(CoordinatorDecisionsTest, ExportAndRestoreKeepEverything) {
  const int64_t gen = FormGeneration(2);
  ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(0), gen, 8)).ok());
  ASSERT_TRUE(core_.ReportEndOfData(EndOfDataReq(Worker(1), gen, 20)).ok());
  EXPECT_THAT(core_.TakeDirtyJobs(), ElementsAre(kJob));
  EXPECT_TRUE(core_.TakeDirtyJobs().empty());
  auto record = core_.ExportJob(kJob);
  ASSERT_TRUE(record.has_value());

  FakeClock later(clock_.Now() + absl::Hours(1));
  Core restored(&later);
  ASSERT_TRUE(restored.RestoreJob(*record).ok());
  EXPECT_TRUE(SameRecord(*restored.ExportJob(kJob), *record));
  EXPECT_EQ(restored.CurrentGeneration(kJob), gen);
  EXPECT_EQ(restored.State(kJob), v1::JOB_STATE_RUNNING);
  // Members get a full timeout to reconnect, and keep their binding.
  restored.Tick();
  EXPECT_EQ(restored.State(kJob), v1::JOB_STATE_RUNNING);
  v1::HeartbeatRequest forged = HeartbeatReq(Worker(0), gen);
  forged.set_worker_secret(Secret("impostor"));
  EXPECT_EQ(restored.Heartbeat(forged).status().code(),
            absl::StatusCode::kPermissionDenied);
  auto hb = restored.Heartbeat(HeartbeatReq(Worker(0), gen, 9));
  ASSERT_TRUE(hb.ok());
  EXPECT_EQ(hb->boundary_step(), 20);
  // New events continue the sequence.
  ASSERT_TRUE(restored
                  .Leave([&] {
                    v1::LeaveRequest r;
                    r.set_job_id(kJob);
                    r.set_worker_id(Worker(0));
                    r.set_worker_secret(Secret(Worker(0)));
                    r.set_generation(gen);
                    r.set_reason(v1::LEAVE_REASON_ERROR);
                    return r;
                  }())
                  .ok());
  const auto events = restored.Events(kJob);
  for (size_t i = 1; i < events.size(); ++i) {
    EXPECT_EQ(events[i].seq, events[i - 1].seq + 1);
  }
  // A record behind the current generation is refused.
  ASSERT_TRUE(restored.Join(JoinReq(Spec(2), Worker(0))).ok());
  ASSERT_TRUE(restored.Join(JoinReq(Spec(2), "w9")).ok());
  ASSERT_TRUE(restored.Join(JoinReq(Spec(2), Worker(1))).ok());
  EXPECT_EQ(restored.CurrentGeneration(kJob), gen + 1);
  EXPECT_EQ(restored.RestoreJob(*record).code(),
            absl::StatusCode::kFailedPrecondition);
}

// ---- Note [Re-forming] -----------------------------------------------------

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

TEST_F(CoordinatorReformTest,
       AReformRequestEndsTheGenerationAndSurvivorsFormAtOnce) {
  const int64_t gen = FormSettled(3, 4);
  ASSERT_EQ(gen, 1);
  const v1::JobSpec spec = Spec(4);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(i), gen, 5)).ok());
  }
  // Without naming its generation a member cannot join again.
  EXPECT_EQ(core_.Join(JoinReq(spec, Worker(1), 5)).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);

  ASSERT_TRUE(core_
                  .Join(RejoinReq(spec, Worker(1), gen, 5,
                                  "allreduce failed: connection reset"))
                  .ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen);
  const std::vector<Event> ended = EventsOf("generation");
  ASSERT_FALSE(ended.empty());
  EXPECT_EQ(ended.back().message,
            "generation 1 ended: worker w1 asked to re-form: allreduce failed: "
            "connection reset; expecting w0, w1, w2 to join again");
  // The requester waits; the others learn with ABORTED and join again.
  auto w1 = core_.GetAssignment(kJob, Worker(1));
  ASSERT_TRUE(w1.ok());
  EXPECT_FALSE(w1->has_value());
  EXPECT_EQ(core_.GetAssignment(kJob, Worker(0)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(HeartbeatCode(Worker(0), gen), absl::StatusCode::kAborted);
  EXPECT_THAT(Expected(), ElementsAre(Worker(0), Worker(2)));
  EXPECT_THAT(Waiting(), ElementsAre(Worker(1)));

  // Naming the ended generation (or none) is a plain join; no settle wait
  // once every survivor is back, although max_workers (4) are not there.
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(2), gen, 5)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_THAT(Expected(), ElementsAre(Worker(0)));
  ASSERT_TRUE(core_.Join(JoinReq(spec, Worker(0), 5)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(1), Worker(2)));
  EXPECT_TRUE(Expected().empty());

  // A member naming an older generation, or a completed member naming its
  // own, is still ALREADY_EXISTS.
  EXPECT_EQ(core_.Join(RejoinReq(spec, Worker(0), gen, 5)).code(),
            absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(2), gen + 1, v1::LEAVE_REASON_COMPLETED))
          .ok());
  EXPECT_EQ(core_.Join(RejoinReq(spec, Worker(2), gen + 1, 5)).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
}

TEST_F(CoordinatorReformTest, RanksKeepTheLongestLivedOrderAndJoinersGoLast) {
  const int64_t gen = FormSettled(3, 4);
  const v1::JobSpec spec = Spec(4);
  clock_.Advance(absl::Seconds(1));
  ASSERT_TRUE(core_.Join(JoinReq(spec, "newcomer")).ok());
  // The survivors come back in reverse order; the newcomer joined before
  // any of them came back, but after they first joined.
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(2), gen, 3, "admit")).ok());
  clock_.Advance(absl::Milliseconds(100));
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 3)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(0), gen, 3)).ok());
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(),
              ElementsAre(Worker(0), Worker(1), Worker(2), "newcomer"));
  EXPECT_EQ(Status().authoritative_rank(), 0);

  // The order holds over a further re-form in which w0 fails: the first-join
  // times are kept across re-joins.
  const int64_t next = gen + 1;
  clock_.Advance(absl::Seconds(3));
  for (const std::string& w : {Worker(1), Worker(2), std::string("newcomer")}) {
    ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(w, next, 9)).ok());
  }
  clock_.Advance(absl::Seconds(7) + absl::Milliseconds(1));
  core_.Tick();
  ASSERT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  ASSERT_TRUE(core_.Join(JoinReq(spec, "late")).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, "newcomer", next, 9)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(2), next, 9)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), next, 9)).ok());
  EXPECT_EQ(core_.CurrentGeneration(kJob), next + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(1), Worker(2), "newcomer", "late"));
}

TEST_F(CoordinatorReformTest, AuthoritativeRankIsTheHighestCommittedStep) {
  const int64_t gen = FormSettled(4, 4);
  const v1::JobSpec spec = Spec(4);
  // Committed steps come from the re-joins: w2 and w3 are ahead, and w2 is
  // the longer-lived of the two.
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(3), gen, 11, "r")).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(0), gen, 10)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 10)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(2), gen, 11)).ok());
  ASSERT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_EQ(Status().authoritative_rank(), 2);
  auto a = core_.GetAssignment(kJob, Worker(3));
  ASSERT_TRUE(a.ok() && a->has_value());
  EXPECT_EQ((*a)->rank, 3);
  EXPECT_EQ((*a)->authoritative_rank, 2);
  EXPECT_EQ((*a)->members[3].committed_step(), 11);
  EXPECT_THAT(core_.Events(kJob).back().message,
              HasSubstr("authoritative rank 2"));
}

TEST_F(CoordinatorReformTest,
       ADeadSurvivorIsDroppedAfterTheHeartbeatTimeoutAndTheRestForm) {
  const int64_t gen = FormSettled(3, 3);  // heartbeat timeout: 10 s
  const v1::JobSpec spec = Spec(3);
  // w2 dies after one heartbeat; its communicator fails the others 2 s
  // later.
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(i), gen, 4)).ok());
  }
  clock_.Advance(absl::Seconds(2));
  ASSERT_TRUE(
      core_.Join(RejoinReq(spec, Worker(0), gen, 4, "peer w2 gone")).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 4)).ok());
  EXPECT_THAT(Expected(), ElementsAre(Worker(2)));
  clock_.Advance(absl::Seconds(8));  // w2 silent for exactly 10 s
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  clock_.Advance(absl::Milliseconds(1));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(1)));
  const std::vector<Event> failures = EventsOf("failure");
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_EQ(failures[0].worker_id, Worker(2));
  EXPECT_EQ(failures[0].message,
            "did not join again after generation 1 ended: no heartbeat for "
            "10.001s (timeout 10s)");
  // Its binding is released: a restarted w2 (new secret) joins and waits.
  v1::JoinRequest restarted = JoinReq(spec, Worker(2));
  restarted.set_worker_secret(Secret("w2-restarted"));
  ASSERT_TRUE(core_.Join(restarted).ok());
  auto hb = core_.Heartbeat(HeartbeatReq(Worker(0), gen + 1));
  ASSERT_TRUE(hb.ok());
  EXPECT_EQ(hb->waiting_workers(), 1);
}

TEST_F(CoordinatorReformTest, AStaleHeartbeatKeepsASlowSurvivorExpected) {
  const int64_t gen = FormSettled(3, 3);
  const v1::JobSpec spec = Spec(3);
  clock_.Advance(absl::Seconds(2));
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(0), gen, 4, "slow")).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 4)).ok());
  clock_.Advance(absl::Seconds(6));
  // w2 still heartbeats its ended generation: refused, but alive.
  v1::HeartbeatRequest forged = HeartbeatReq(Worker(2), gen);
  forged.set_worker_secret(Secret("impostor"));
  EXPECT_EQ(core_.Heartbeat(forged).status().code(),
            absl::StatusCode::kPermissionDenied);
  const uint64_t membership = core_.membership_version();
  EXPECT_EQ(HeartbeatCode(Worker(2), gen), absl::StatusCode::kAborted);
  EXPECT_EQ(core_.membership_version(), membership);  // not persisted
  EXPECT_EQ(HeartbeatCode(Worker(2), gen + 1), absl::StatusCode::kAborted);
  clock_.Advance(absl::Seconds(9));  // 17 s after its last member heartbeat
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  ASSERT_EQ(Status().expected_size(), 1);
  EXPECT_EQ(Status().expected(0).worker_id(), Worker(2));
  EXPECT_EQ(Status().expected(0).rank(), -1);
  EXPECT_EQ(Status().expected(0).last_heartbeat_age_ms(), 9000);
  EXPECT_TRUE(EventsOf("failure").empty());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(2), gen, 4)).ok());
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(1), Worker(2)));
}

TEST_F(CoordinatorReformTest, BelowMinWorkersTheRendezvousTimeoutFailsTheJob) {
  v1::JobSpec spec = Spec(3, 3);
  spec.set_rendezvous_timeout_ms(30000);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(core_.Join(JoinReq(spec, Worker(i))).ok());
  }
  const int64_t gen = core_.CurrentGeneration(kJob);
  ASSERT_EQ(gen, 1);
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(2), gen, v1::LEAVE_REASON_ERROR)).ok());
  EXPECT_THAT(Expected(), ElementsAre(Worker(0), Worker(1)));
  // Every survivor is back, but 2 < min_workers: wait for joiners.
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(0), gen)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  clock_.Advance(absl::Seconds(30));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  clock_.Advance(absl::Milliseconds(1));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_FAILED);
  EXPECT_EQ(Status().failure(),
            "rendezvous timed out after 30s with 2 worker(s) waiting; "
            "min_workers is 3");
  const absl::Status join = core_.Join(RejoinReq(spec, Worker(0), gen));
  EXPECT_EQ(join.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(join.message(), HasSubstr("rendezvous timed out"));
}

TEST_F(CoordinatorReformTest, TheRendezvousTimeoutNamesMissingSurvivors) {
  // A heartbeat timeout longer than the rendezvous timeout: the rendezvous
  // gives up on a silent survivor first.
  for (const int min : {1, 2}) {
    SCOPED_TRACE(min);
    FakeClock clock;
    Core core(&clock);
    v1::JobSpec spec = Spec(2, min);
    spec.set_heartbeat_timeout_ms(60000);
    spec.set_rendezvous_timeout_ms(30000);
    ASSERT_TRUE(core.Join(JoinReq(spec, Worker(0))).ok());
    ASSERT_TRUE(core.Join(JoinReq(spec, Worker(1))).ok());
    ASSERT_EQ(core.CurrentGeneration(kJob), 1);
    ASSERT_TRUE(core.Join(RejoinReq(spec, Worker(0), 1, 0, "w1 gone")).ok());
    clock.Advance(absl::Seconds(30) + absl::Milliseconds(1));
    core.Tick();
    if (min == 1) {
      // Enough are waiting: the generation forms without w1.
      EXPECT_EQ(core.State(kJob), v1::JOB_STATE_RUNNING);
      EXPECT_EQ(core.CurrentGeneration(kJob), 2);
      auto a = core.GetAssignment(kJob, Worker(0));
      ASSERT_TRUE(a.ok() && a->has_value());
      EXPECT_EQ((*a)->world_size, 1);
      const std::vector<Event> events = core.Events(kJob);
      EXPECT_TRUE(std::any_of(events.begin(), events.end(), [](const Event& e) {
        return e.kind == "failure" && e.worker_id == "w1";
      }));
    } else {
      v1::GetJobRequest get;
      get.set_job_id(kJob);
      auto status = core.GetJob(get);
      ASSERT_TRUE(status.ok());
      EXPECT_EQ(status->state(), v1::JOB_STATE_FAILED);
      EXPECT_EQ(status->failure(),
                "rendezvous timed out after 30s with 1 worker(s) waiting; "
                "min_workers is 2; survivor(s) w1 of generation 1 did not "
                "join again");
      EXPECT_EQ(status->expected_size(), 0);
    }
  }
}

TEST_F(CoordinatorReformTest, EndOfDataLeaveBeforeTheOthersRejoin) {
  const int64_t gen = FormSettled(3, 3);
  const v1::JobSpec spec = Spec(3);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(i), gen, 20)).ok());
  }
  auto left =
      core_.Leave(LeaveReq(Worker(2), gen, v1::LEAVE_REASON_END_OF_DATA));
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(left->state(), v1::JOB_STATE_RENDEZVOUS);
  const std::vector<Event> leaves = EventsOf("leave");
  ASSERT_EQ(leaves.size(), 1u);
  EXPECT_EQ(leaves[0].worker_id, Worker(2));
  EXPECT_EQ(leaves[0].message, "ran out of data at step 20");
  EXPECT_THAT(EventsOf("generation").back().message,
              HasSubstr("worker w2 ran out of data at step 20"));
  EXPECT_THAT(Expected(), ElementsAre(Worker(0), Worker(1)));
  // A repeated Leave changes nothing.
  const std::string before = Snapshot();
  const uint64_t version = core_.version();
  auto again =
      core_.Leave(LeaveReq(Worker(2), gen, v1::LEAVE_REASON_END_OF_DATA));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(core_.version(), version);
  EXPECT_EQ(Snapshot(), before);

  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 20)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(0), gen, 20)).ok());
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(1)));
  EXPECT_TRUE(
      core_.Leave(LeaveReq(Worker(2), gen, v1::LEAVE_REASON_END_OF_DATA)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  // w2's binding is released.
  v1::JoinRequest restarted = JoinReq(spec, Worker(2));
  restarted.set_worker_secret(Secret("w2-restarted"));
  EXPECT_TRUE(core_.Join(restarted).ok());
}

TEST_F(CoordinatorReformTest, EndOfDataLeaveAfterTheOthersRejoin) {
  const int64_t gen = FormSettled(3, 3);
  const v1::JobSpec spec = Spec(3);
  // The members agreed that w2's data ends at step 20; w0 and w1 are
  // quicker to re-form than w2 to leave.
  ASSERT_TRUE(
      core_.Join(RejoinReq(spec, Worker(0), gen, 20, "w2 out of data")).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 20)).ok());
  EXPECT_THAT(Expected(), ElementsAre(Worker(2)));
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  // A Leave naming another generation than its own is still refused.
  EXPECT_EQ(
      core_.Leave(LeaveReq(Worker(2), gen - 1, v1::LEAVE_REASON_END_OF_DATA))
          .status()
          .code(),
      absl::StatusCode::kAborted);
  auto left =
      core_.Leave(LeaveReq(Worker(2), gen, v1::LEAVE_REASON_END_OF_DATA));
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(left->state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(1)));
  EXPECT_EQ(EventsOf("leave").back().message,
            "ran out of data at step 0, after generation 1 ended");
  EXPECT_TRUE(
      core_.Leave(LeaveReq(Worker(2), gen, v1::LEAVE_REASON_END_OF_DATA)).ok());
}

TEST_F(CoordinatorReformTest, TheJobSucceedsWhenTheLastWorkerRunsOutOfData) {
  // Both run out at the same boundary; the second Leave finds its generation
  // already ended.
  const int64_t gen = FormSettled(2, 2);
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(0), gen, v1::LEAVE_REASON_END_OF_DATA)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  auto last =
      core_.Leave(LeaveReq(Worker(1), gen, v1::LEAVE_REASON_END_OF_DATA));
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(core_.Events(kJob).back().message,
            "job succeeded after generation 1: every worker ran out of data "
            "or completed");
  EXPECT_TRUE(
      core_.Leave(LeaveReq(Worker(1), gen, v1::LEAVE_REASON_END_OF_DATA)).ok());
  clock_.Advance(absl::Hours(1));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_SUCCEEDED);
}

TEST_F(CoordinatorReformTest, TheLastMemberRunningOutOfDataEndsTheJob) {
  const int64_t gen = FormSettled(2, 3);
  const v1::JobSpec spec = Spec(3);
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(0), gen, v1::LEAVE_REASON_END_OF_DATA)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 30)).ok());
  ASSERT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(1)));
  // A waiting worker keeps the job going...
  ASSERT_TRUE(core_.Join(JoinReq(spec, "spare")).ok());
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(1), gen + 1, v1::LEAVE_REASON_END_OF_DATA))
          .ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  // ...until it runs out of data too.
  ASSERT_TRUE(
      core_.Leave(LeaveReq("spare", 0, v1::LEAVE_REASON_END_OF_DATA)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_SUCCEEDED);
}

TEST_F(CoordinatorReformTest, AWaitingWorkerOutlivesAnEndOfDataBoundary) {
  const int64_t gen = FormSettled(2, 3);
  ASSERT_TRUE(core_.Join(JoinReq(Spec(3), "spare")).ok());
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(core_.ReportEndOfData(EndOfDataReq(Worker(i), gen, 5)).ok());
  }
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(i), gen, 5)).ok());
  }
  // Both members left at the boundary, but the job goes on with the spare.
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_TRUE(Expected().empty());
  clock_.Advance(absl::Seconds(2));
  core_.Tick();
  ASSERT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre("spare"));
  ASSERT_TRUE(
      core_.Leave(LeaveReq("spare", gen + 1, v1::LEAVE_REASON_END_OF_DATA))
          .ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_SUCCEEDED);
}

TEST_F(CoordinatorReformTest, AWorkerStillWaitingWhenTheJobSucceedsIsToldSo) {
  const int64_t gen = FormSettled(2, 2);
  // At max_workers: the newcomer waits for a generation that never comes.
  ASSERT_TRUE(core_.Join(JoinReq(Spec(2), "late")).ok());
  ASSERT_TRUE(core_.GetAssignment(kJob, "late").ok());  // waiting: no error yet
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(
        core_.Leave(LeaveReq(Worker(i), gen, v1::LEAVE_REASON_COMPLETED)).ok());
  }
  ASSERT_EQ(core_.State(kJob), v1::JOB_STATE_SUCCEEDED);
  const auto late = core_.GetAssignment(kJob, "late");
  EXPECT_TRUE(absl::IsFailedPrecondition(late.status())) << late.status();
  EXPECT_THAT(std::string(late.status().message()),
              ::testing::HasSubstr("has already succeeded"));
}

TEST_F(CoordinatorReformTest, CompletedMembersAreNotExpected) {
  const int64_t gen = FormSettled(3, 3);
  const v1::JobSpec spec = Spec(3);
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(0), gen, v1::LEAVE_REASON_COMPLETED)).ok());
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(1), gen, v1::LEAVE_REASON_ERROR)).ok());
  EXPECT_THAT(Expected(), ElementsAre(Worker(2)));
  EXPECT_TRUE(
      core_.Leave(LeaveReq(Worker(0), gen, v1::LEAVE_REASON_COMPLETED)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(2), gen)).ok());
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(2)));
}

TEST_F(CoordinatorReformTest, AnErrorLeaveOrADrainDropsAnExpectedSurvivor) {
  const int64_t gen = FormSettled(4, 4);
  const v1::JobSpec spec = Spec(4);
  // A drained member is not expected.
  v1::DrainWorkerRequest drain;
  drain.set_job_id(kJob);
  drain.set_worker_id(Worker(3));
  ASSERT_TRUE(core_.DrainWorker(drain).ok());
  EXPECT_THAT(Expected(), ElementsAre(Worker(0), Worker(1), Worker(2)));
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(0), gen)).ok());
  // An expected survivor leaving with an error, or drained, is dropped.
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(1), gen, v1::LEAVE_REASON_ERROR)).ok());
  EXPECT_THAT(Expected(), ElementsAre(Worker(2)));
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  drain.set_worker_id(Worker(2));
  auto drained = core_.DrainWorker(drain);
  ASSERT_TRUE(drained.ok());
  EXPECT_EQ(drained->ended_generation(), 0);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0)));
  EXPECT_EQ(core_.Join(RejoinReq(spec, Worker(2), gen)).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(CoordinatorReformTest, WaitingWorkersIsWhatTheNextGenerationAdmits) {
  const int64_t gen = FormSettled(2, 3);
  const v1::JobSpec spec = Spec(3);
  auto hb = core_.Heartbeat(HeartbeatReq(Worker(0), gen));
  ASSERT_TRUE(hb.ok());
  EXPECT_EQ(hb->waiting_workers(), 0);
  EXPECT_EQ(WaitingWorkersSeenBy(Worker(0)), 0);

  // A join while running changes what watchers see.
  const uint64_t membership = core_.membership_version();
  ASSERT_TRUE(core_.Join(JoinReq(spec, "x")).ok());
  EXPECT_GT(core_.membership_version(), membership);
  EXPECT_EQ(core_.Heartbeat(HeartbeatReq(Worker(0), gen))->waiting_workers(),
            1);
  EXPECT_EQ(WaitingWorkersSeenBy(Worker(1)), 1);
  EXPECT_EQ(WaitingWorkersSeenBy("x"), 1);
  // Room for one more only.
  ASSERT_TRUE(core_.Join(JoinReq(spec, "y")).ok());
  EXPECT_EQ(core_.Heartbeat(HeartbeatReq(Worker(0), gen))->waiting_workers(),
            1);

  // The members re-form to let x in; during the rendezvous it is 0.
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(0), gen, 0, "admit x")).ok());
  EXPECT_EQ(WaitingWorkersSeenBy(Worker(0)), 0);
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen)).ok());
  ASSERT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(1), "x"));
  EXPECT_THAT(Waiting(), ElementsAre("y"));
  // At max_workers nobody more can be admitted.
  EXPECT_EQ(
      core_.Heartbeat(HeartbeatReq(Worker(0), gen + 1))->waiting_workers(), 0);
  EXPECT_EQ(WaitingWorkersSeenBy("y"), 0);
}

TEST_F(CoordinatorReformTest, BadReformRequestsAreInvalidAndChangeNothing) {
  const int64_t gen = FormSettled(2, 2);
  const v1::JobSpec spec = Spec(2);
  const uint64_t version = core_.version();
  const std::string before = Snapshot();
  std::vector<std::pair<std::string, absl::Status>> results = {
      {"member, generation ahead",
       core_.Join(RejoinReq(spec, Worker(0), gen + 1))},
      {"newcomer, generation ahead",
       core_.Join(RejoinReq(spec, "new", gen + 5))},
      {"negative previous generation",
       core_.Join(RejoinReq(spec, Worker(0), -1))},
      {"long reason",
       core_.Join(RejoinReq(spec, Worker(0), gen, 0, std::string(4097, 'r')))},
      {"reason not UTF-8",
       core_.Join(RejoinReq(spec, Worker(0), gen, 0, "cut \xe2\x82"))},
  };
  v1::JobSpec other = Spec(2);
  other.set_job_id("unknown");
  results.emplace_back("unknown job, generation ahead",
                       core_.Join(RejoinReq(other, "w", 1)));
  for (const auto& [name, status] : results) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_FALSE(status.message().empty()) << name;
  }
  EXPECT_THAT(std::string(results[0].second.message()),
              HasSubstr("previous_generation 2 is ahead"));
  EXPECT_EQ(core_.version(), version);
  EXPECT_EQ(Snapshot(), before);
  EXPECT_EQ(core_.job_count(), 1u);
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  // The longest reason allowed is fine.
  EXPECT_TRUE(
      core_.Join(RejoinReq(spec, Worker(0), gen, 0, std::string(4096, 'r')))
          .ok());
}

TEST_F(CoordinatorReformTest, ExportAndRestoreKeepSurvivorsAndFinished) {
  const int64_t gen = FormSettled(3, 3);
  const v1::JobSpec spec = Spec(3);
  ASSERT_TRUE(
      core_.Leave(LeaveReq(Worker(2), gen, v1::LEAVE_REASON_END_OF_DATA)).ok());
  clock_.Advance(absl::Seconds(1));
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 6)).ok());
  auto record = core_.ExportJob(kJob);
  ASSERT_TRUE(record.has_value());
  ASSERT_EQ(record->expected_size(), 2);
  EXPECT_EQ(record->expected(0).worker_id(), Worker(0));
  EXPECT_EQ(record->expected(0).rank(), -1);
  EXPECT_EQ(record->waiting(0).joined_unix_ms(),
            record->expected(1).joined_unix_ms());
  EXPECT_THAT(record->finished(), ElementsAre(Worker(2)));

  FakeClock later(clock_.Now() + absl::Hours(1));
  Core restored(&later);
  ASSERT_TRUE(restored.RestoreJob(*record).ok());
  EXPECT_TRUE(SameRecord(*restored.ExportJob(kJob), *record));
  // The finished worker's Leave is still a no-op.
  EXPECT_TRUE(
      restored.Leave(LeaveReq(Worker(2), gen, v1::LEAVE_REASON_END_OF_DATA))
          .ok());
  // w0's timer restarted from the restore time.
  later.Advance(absl::Seconds(10));
  restored.Tick();
  EXPECT_EQ(restored.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  // A copy restored alongside drops w0 once that timer runs out.
  {
    FakeClock clock(later.Now() - absl::Seconds(10));
    Core copy(&clock);
    ASSERT_TRUE(copy.RestoreJob(*record).ok());
    clock.Advance(absl::Seconds(10) + absl::Milliseconds(1));
    copy.Tick();
    EXPECT_EQ(copy.State(kJob), v1::JOB_STATE_RUNNING);
    EXPECT_EQ(copy.CurrentGeneration(kJob), gen + 1);
  }
  // w0 comes back and keeps its rank ahead of w1 (first-join times), and
  // only with its own secret.
  v1::JoinRequest forged = RejoinReq(spec, Worker(0), gen, 6);
  forged.set_worker_secret(Secret("impostor"));
  EXPECT_EQ(restored.Join(forged).code(), absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(restored.Join(RejoinReq(spec, Worker(0), gen, 6)).ok());
  EXPECT_EQ(restored.CurrentGeneration(kJob), gen + 1);
  auto a = restored.GetAssignment(kJob, Worker(0));
  ASSERT_TRUE(a.ok() && a->has_value());
  EXPECT_EQ((*a)->rank, 0);
  EXPECT_EQ((*a)->members[1].worker_id(), Worker(1));
}

TEST_F(CoordinatorReformTest, RestoreRefusesInconsistentSurvivors) {
  const int64_t gen = FormSettled(2, 2);
  ASSERT_TRUE(core_.Join(RejoinReq(Spec(2), Worker(0), gen, 1, "r")).ok());
  const v1::JobRecord good = *core_.ExportJob(kJob);
  ASSERT_EQ(good.expected_size(), 2);
  ASSERT_EQ(good.state(), v1::JOB_STATE_RENDEZVOUS);
  const std::vector<std::pair<std::string, std::function<void(v1::JobRecord&)>>>
      cases = {
          {"expected while running",
           [](v1::JobRecord& r) { r.set_state(v1::JOB_STATE_RUNNING); }},
          {"expected with members",
           [&](v1::JobRecord& r) {
             *r.add_members() = r.expected(1);
             r.mutable_members(0)->set_rank(0);
             r.mutable_expected()->RemoveLast();
           }},
          {"expected before any generation",
           [](v1::JobRecord& r) { r.set_generation(0); }},
          {"expected twice",
           [](v1::JobRecord& r) { *r.add_expected() = r.expected(0); }},
          {"expected unbound",
           [](v1::JobRecord& r) { r.mutable_bindings()->erase("w1"); }},
          {"expected drained", [](v1::JobRecord& r) { r.add_drained("w1"); }},
          {"expected finished", [](v1::JobRecord& r) { r.add_finished("w1"); }},
          {"expected bad id",
           [](v1::JobRecord& r) {
             r.mutable_expected(1)->set_worker_id("bad id");
           }},
          {"finished bad id", [](v1::JobRecord& r) { r.add_finished(""); }},
          {"waiting twice",
           [](v1::JobRecord& r) { *r.add_waiting() = r.waiting(0); }},
      };
  for (const auto& [name, mutate] : cases) {
    v1::JobRecord bad = good;
    mutate(bad);
    FakeClock clock;
    Core fresh(&clock);
    EXPECT_EQ(fresh.RestoreJob(bad).code(), absl::StatusCode::kInvalidArgument)
        << name;
    EXPECT_EQ(fresh.job_count(), 0u) << name;
  }
  FakeClock clock;
  Core fresh(&clock);
  EXPECT_TRUE(fresh.RestoreJob(good).ok());
}

// ---- Note [Re-forming]: lost watch streams ---------------------------------

class CoordinatorWatchTest : public CoordinatorReformTest {
 protected:
  // Every member of `gen` watches and heartbeats (at step 4).
  void WatchAndHeartbeat(int n, int64_t gen) {
    for (int i = 0; i < n; ++i) {
      core_.WatchOpened(kJob, Worker(i));
      ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(i), gen, 4)).ok());
    }
  }
};

TEST_F(CoordinatorWatchTest, ADeadSurvivorsLostWatchDropsItAfterTheGrace) {
  const int64_t gen = FormSettled(3, 3);  // interval 1 s: grace 1 s
  const v1::JobSpec spec = Spec(3);
  WatchAndHeartbeat(3, gen);
  clock_.Advance(absl::Milliseconds(300));
  // w2 is killed: its connection closes, and its communicator fails the
  // others, which join again at once.
  core_.WatchClosed(kJob, Worker(2), /*lost=*/true);
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);  // not for a member
  clock_.Advance(absl::Milliseconds(10));
  ASSERT_TRUE(
      core_.Join(RejoinReq(spec, Worker(0), gen, 4, "peer w2 gone")).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 4)).ok());
  EXPECT_THAT(Expected(), ElementsAre(Worker(2)));
  clock_.Advance(absl::Milliseconds(989));  // lost 999 ms ago
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_TRUE(EventsOf("failure").empty());
  const uint64_t membership = core_.membership_version();
  (void)core_.TakeDirtyJobs();
  clock_.Advance(absl::Milliseconds(1));
  core_.Tick();
  // 1.3 s after w2's last heartbeat, far from the 10 s timeout.
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(1)));
  EXPECT_GT(core_.membership_version(), membership);
  EXPECT_THAT(core_.TakeDirtyJobs(), ElementsAre(kJob));
  const std::vector<Event> failures = EventsOf("failure");
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_EQ(failures[0].worker_id, Worker(2));
  EXPECT_EQ(failures[0].message,
            "did not join again after generation 1 ended: its connection to "
            "the coordinator broke (watch stream lost for 1s, grace 1s)");
  // Its binding is released: a restarted w2 (new secret) joins and waits.
  v1::JoinRequest restarted = JoinReq(spec, Worker(2));
  restarted.set_worker_secret(Secret("w2-restarted"));
  ASSERT_TRUE(core_.Join(restarted).ok());
  EXPECT_THAT(Waiting(), ElementsAre(Worker(2)));
}

TEST_F(CoordinatorWatchTest, TheGraceIsTheHeartbeatIntervalWithinBounds) {
  for (const auto& [interval_ms, grace] :
       std::vector<std::pair<int, absl::Duration>>{
           {20, absl::Milliseconds(100)},
           {250, absl::Milliseconds(250)},
           {5000, absl::Seconds(1)}}) {
    SCOPED_TRACE(interval_ms);
    FakeClock clock;
    Core core(&clock);
    v1::JobSpec spec = Spec(2);
    spec.set_heartbeat_interval_ms(interval_ms);
    spec.set_heartbeat_timeout_ms(30000);
    ASSERT_TRUE(core.Join(JoinReq(spec, Worker(0))).ok());
    ASSERT_TRUE(core.Join(JoinReq(spec, Worker(1))).ok());
    const int64_t gen = core.CurrentGeneration(kJob);
    ASSERT_EQ(gen, 1);
    core.WatchOpened(kJob, Worker(1));
    core.WatchClosed(kJob, Worker(1), /*lost=*/true);
    ASSERT_TRUE(core.Join(RejoinReq(spec, Worker(0), gen, 0, "w1 gone")).ok());
    clock.Advance(grace - absl::Milliseconds(1));
    core.Tick();
    EXPECT_EQ(core.State(kJob), v1::JOB_STATE_RENDEZVOUS);
    clock.Advance(absl::Milliseconds(1));
    core.Tick();
    EXPECT_EQ(core.State(kJob), v1::JOB_STATE_RUNNING);
    EXPECT_EQ(core.CurrentGeneration(kJob), gen + 1);
  }
}

TEST_F(CoordinatorWatchTest, ASurvivorLostForLongerThanTheGraceGoesAtOnce) {
  // The watch was lost before the generation ended (say rank 0 was busy
  // checkpointing): the re-form drops w2 right away, and the last survivor
  // back forms the generation without waiting for a tick.
  const int64_t gen = FormSettled(3, 3);
  const v1::JobSpec spec = Spec(3);
  WatchAndHeartbeat(3, gen);
  core_.WatchClosed(kJob, Worker(2), /*lost=*/true);
  clock_.Advance(absl::Seconds(2));
  ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(0), gen, 4)).ok());
  ASSERT_TRUE(
      core_.Join(RejoinReq(spec, Worker(0), gen, 4, "peer w2 gone")).ok());
  EXPECT_THAT(Expected(), ElementsAre(Worker(1)));
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 4)).ok());
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(1)));
  const std::vector<Event> failures = EventsOf("failure");
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_THAT(failures[0].message, HasSubstr("watch stream lost for 2s"));
}

TEST_F(CoordinatorWatchTest, ASurvivorThatReconnectsOrHeartbeatsIsKept) {
  const int64_t gen = FormSettled(3, 3);
  const v1::JobSpec spec = Spec(3);
  WatchAndHeartbeat(3, gen);
  // w1's watcher reconnects within the grace; w2's loses its stream but w2
  // heartbeats afterwards (its watcher is still backing off).
  core_.WatchClosed(kJob, Worker(1), /*lost=*/true);
  core_.WatchClosed(kJob, Worker(2), /*lost=*/true);
  clock_.Advance(absl::Milliseconds(500));
  core_.WatchOpened(kJob, Worker(1));
  ASSERT_TRUE(
      core_.Join(RejoinReq(spec, Worker(0), gen, 4, "slow peers")).ok());
  clock_.Advance(absl::Milliseconds(100));
  EXPECT_EQ(HeartbeatCode(Worker(2), gen), absl::StatusCode::kAborted);
  clock_.Advance(absl::Seconds(5));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_THAT(Expected(), ElementsAre(Worker(1), Worker(2)));
  EXPECT_TRUE(EventsOf("failure").empty());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(2), gen, 4)).ok());
  ASSERT_TRUE(core_.Join(RejoinReq(spec, Worker(1), gen, 4)).ok());
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen + 1);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0), Worker(1), Worker(2)));
}

TEST_F(CoordinatorWatchTest, WithoutALostWatchASurvivorWaitsForTheTimeout) {
  const int64_t gen = FormSettled(3, 3);
  const v1::JobSpec spec = Spec(3);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(i), gen, 4)).ok());
  }
  // w1 never watched; w2's stream ended normally (and an unmatched close
  // for w1 is ignored).
  core_.WatchOpened(kJob, Worker(2));
  core_.WatchClosed(kJob, Worker(2), /*lost=*/false);
  core_.WatchClosed(kJob, Worker(1), /*lost=*/true);
  ASSERT_TRUE(
      core_.Join(RejoinReq(spec, Worker(0), gen, 4, "peers gone")).ok());
  clock_.Advance(absl::Seconds(10));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RENDEZVOUS);
  EXPECT_THAT(Expected(), ElementsAre(Worker(1), Worker(2)));
  clock_.Advance(absl::Milliseconds(1));
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(Ranks(), ElementsAre(Worker(0)));
  for (const Event& e : EventsOf("failure")) {
    EXPECT_THAT(e.message, HasSubstr("no heartbeat for 10.001s"));
  }
  EXPECT_EQ(EventsOf("failure").size(), 2u);
}

TEST_F(CoordinatorWatchTest, ALostWatchOfARunningMemberEndsNothing) {
  const int64_t gen = FormSettled(3, 3);
  WatchAndHeartbeat(3, gen);
  core_.WatchClosed(kJob, Worker(2), /*lost=*/true);
  for (int s = 0; s < 5; ++s) {
    clock_.Advance(absl::Seconds(1));
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(i), gen, 4 + s)).ok());
    }
    core_.Tick();
  }
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(core_.CurrentGeneration(kJob), gen);
  EXPECT_TRUE(EventsOf("failure").empty());
  // Heartbeats after the loss keep it an expected survivor once the
  // generation ends.
  ASSERT_TRUE(core_.Join(RejoinReq(Spec(3), Worker(0), gen, 8, "r")).ok());
  clock_.Advance(absl::Seconds(2));
  core_.Tick();
  EXPECT_THAT(Expected(), ElementsAre(Worker(1), Worker(2)));
}

TEST_F(CoordinatorWatchTest, WatchCallsForUnknownIdsChangeNothing) {
  const int64_t gen = FormSettled(2, 2);
  const uint64_t version = core_.version();
  const uint64_t membership = core_.membership_version();
  const std::string before = Snapshot();
  (void)core_.TakeDirtyJobs();
  core_.WatchOpened("no-such-job", Worker(0));
  core_.WatchClosed("no-such-job", Worker(0), /*lost=*/true);
  core_.WatchClosed("no-such-job", Worker(0), /*lost=*/false);
  core_.WatchOpened(kJob, "stranger");
  core_.WatchClosed(kJob, "stranger", /*lost=*/true);
  core_.WatchClosed(kJob, "stranger", /*lost=*/true);
  core_.WatchOpened(kJob, "");
  core_.WatchClosed(kJob, "", /*lost=*/true);
  // Transient: members' streams are not part of the record either.
  core_.WatchOpened(kJob, Worker(0));
  core_.WatchClosed(kJob, Worker(0), /*lost=*/true);
  EXPECT_EQ(core_.job_count(), 1u);
  EXPECT_EQ(core_.version(), version);
  EXPECT_EQ(core_.membership_version(), membership);
  EXPECT_EQ(Snapshot(), before);
  EXPECT_TRUE(core_.TakeDirtyJobs().empty());
  clock_.Advance(absl::Seconds(5));
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(core_.Heartbeat(HeartbeatReq(Worker(i), gen)).ok());
  }
  core_.Tick();
  EXPECT_EQ(core_.State(kJob), v1::JOB_STATE_RUNNING);
  EXPECT_TRUE(EventsOf("failure").empty());
}

}  // namespace
}  // namespace concord::coordinator
