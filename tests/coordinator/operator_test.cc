// The operator service, membership push, health and metrics through the
// real gRPC server on loopback.

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "health.grpc.pb.h"
#include "tests/coordinator/test_util.h"
#include "worker/coordinator_client.h"

namespace concord::coordinator {
namespace {

using namespace ::concord::coordinator::testing;  // NOLINT
using ::testing::HasSubstr;

class OperatorTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { spdlog::set_level(spdlog::level::warn); }

  void SetUp() override {
    ServerOptions options = Options();
    options.metrics_address = "127.0.0.1:0";
    options.health_address = "127.0.0.1:0";
    auto server = Server::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    operator_ = v1::OperatorService::NewStub(Channel(server_->address()));
  }

  std::unique_ptr<worker::CoordinatorClient> Client(const std::string& id) {
    return std::make_unique<worker::CoordinatorClient>(
        server_->address(),
        worker::ClientIdentity{kWorkerToken, id, Secret(id), {}});
  }

  // Joins `ids` concurrently into job `job` (min = max = ids.size()).
  std::vector<v1::JoinResponse> JoinAll(
      const std::string& job,
      const std::vector<worker::CoordinatorClient*>& clients) {
    std::vector<v1::JoinResponse> out(clients.size());
    std::vector<std::thread> threads;
    const int n = static_cast<int>(clients.size());
    for (size_t i = 0; i < clients.size(); ++i) {
      threads.emplace_back([&, i] {
        auto r = clients[i]->Join(
            JoinReq(job, n, n, clients[i]->identity().worker_id),
            absl::Seconds(10));
        ASSERT_TRUE(r.ok()) << r.status();
        out[i] = *r;
      });
    }
    for (auto& t : threads) t.join();
    return out;
  }

  v1::JobStatus GetJob(const std::string& job) {
    v1::GetJobRequest q;
    q.set_job_id(job);
    v1::JobStatus status;
    const grpc::Status s =
        operator_->GetJob(Ctx(kOperatorToken).get(), q, &status);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return status;
  }

  std::unique_ptr<Server> server_;
  std::unique_ptr<v1::OperatorService::Stub> operator_;
};

TEST_F(OperatorTest, StatusDrainStopAndPushedMembership) {
  auto a = Client("a");
  auto b = Client("b");
  const auto joined = JoinAll("train", {a.get(), b.get()});
  const int64_t gen = joined[0].generation();
  ASSERT_EQ(gen, 1);

  // Heartbeats carry progress and DDP timings into the status.
  v1::HeartbeatRequest hb;
  hb.set_job_id("train");
  hb.set_generation(gen);
  hb.set_step(17);
  hb.set_samples_per_second(250);
  hb.mutable_ddp()->set_step_ms(40);
  hb.mutable_ddp()->set_allreduce_wait_ms(3);
  ASSERT_TRUE(b->Heartbeat(hb, absl::Seconds(5)).ok());

  worker::MembershipWatcher watch(a.get(), "train");
  auto first = watch.WaitFor(
      [&](const v1::MembershipUpdate& u) { return u.generation() == gen; },
      absl::Seconds(10));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->is_member());
  EXPECT_EQ(first->world_size(), 2);
  // Workers are not sent the member table (worker.proto, include_members).
  EXPECT_EQ(first->members_size(), 0);

  v1::JobStatus status = GetJob("train");
  EXPECT_EQ(status.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(status.generation(), gen);
  ASSERT_EQ(status.members_size(), 2);
  const v1::MemberStatus& mb = status.members(0).worker_id() == "b"
                                   ? status.members(0)
                                   : status.members(1);
  EXPECT_EQ(mb.committed_step(), 17);
  EXPECT_EQ(mb.samples_per_second(), 250);
  EXPECT_EQ(mb.ddp().allreduce_wait_ms(), 3);
  EXPECT_EQ(mb.host(), "127.0.0.1");
  EXPECT_LT(mb.last_heartbeat_age_ms(), 10000);
  EXPECT_GE(status.recent_events_size(), 3);

  v1::ListJobsResponse jobs;
  ASSERT_TRUE(operator_->ListJobs(Ctx(kOperatorToken).get(), {}, &jobs).ok());
  ASSERT_EQ(jobs.jobs_size(), 1);
  EXPECT_EQ(jobs.jobs(0).job_id(), "train");

  // Draining b ends the generation; a learns by push, not by polling.
  v1::DrainWorkerRequest drain;
  drain.set_job_id("train");
  drain.set_worker_id("b");
  drain.set_reason("node maintenance");
  v1::DrainWorkerResponse drained;
  ASSERT_TRUE(
      operator_->DrainWorker(Ctx(kOperatorToken).get(), drain, &drained).ok());
  EXPECT_EQ(drained.ended_generation(), gen);
  auto ended = watch.WaitFor(
      [](const v1::MembershipUpdate& u) { return !u.is_member(); },
      absl::Seconds(10));
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_EQ(ended->state(), v1::JOB_STATE_RENDEZVOUS);
  auto rejoin = b->Join(JoinReq("train", 2, 2, "b"), absl::Seconds(5));
  EXPECT_EQ(rejoin.status().code(), absl::StatusCode::kFailedPrecondition);

  v1::ListEventsRequest events;
  events.set_job_id("train");
  v1::ListEventsResponse listed;
  ASSERT_TRUE(
      operator_->ListEvents(Ctx(kOperatorToken).get(), events, &listed).ok());
  bool saw_drain = false;
  for (const auto& e : listed.events()) {
    if (e.kind() == "drain") {
      saw_drain = true;
      EXPECT_EQ(e.worker_id(), "b");
      EXPECT_THAT(e.message(), HasSubstr("node maintenance"));
    }
  }
  EXPECT_TRUE(saw_drain);

  // Stopping the job ends the watch stream with the reason.
  v1::StopJobRequest stop;
  stop.set_job_id("train");
  stop.set_reason("enough");
  v1::StopJobResponse stopped;
  ASSERT_TRUE(
      operator_->StopJob(Ctx(kOperatorToken).get(), stop, &stopped).ok());
  auto last = watch.WaitFor(
      [](const v1::MembershipUpdate& u) {
        return u.state() == v1::JOB_STATE_STOPPED;
      },
      absl::Seconds(10));
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_THAT(last->failure(), HasSubstr("enough"));
  EXPECT_EQ(GetJob("train").state(), v1::JOB_STATE_STOPPED);
}

TEST_F(OperatorTest, HealthAndMetrics) {
  auto health = grpc::health::v1::Health::NewStub(Channel(server_->address()));
  for (const char* service :
       {"", "concord.v1.WorkerService", "concord.v1.AgentService",
        "concord.v1.OperatorService"}) {
    grpc::health::v1::HealthCheckRequest q;
    q.set_service(service);
    grpc::health::v1::HealthCheckResponse r;
    const grpc::Status s = health->Check(Ctx("").get(), q, &r);
    ASSERT_TRUE(s.ok()) << service << ": " << s.error_message();
    EXPECT_EQ(r.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }

  ASSERT_GT(server_->health_port(), 0);
  EXPECT_THAT(HttpGet(server_->health_port(), "/healthz"), HasSubstr("200 OK"));

  v1::ListJobsResponse jobs;
  ASSERT_TRUE(operator_->ListJobs(Ctx(kOperatorToken).get(), {}, &jobs).ok());
  ASSERT_GT(server_->metrics_port(), 0);
  const std::string metrics = HttpGet(server_->metrics_port(), "/metrics");
  EXPECT_THAT(metrics, HasSubstr("concord_rpc_total"));
  EXPECT_THAT(metrics, HasSubstr("method=\"ListJobs\""));
  EXPECT_THAT(metrics, HasSubstr("concord_jobs{state=\"JOB_STATE_RUNNING\"}"));
  EXPECT_THAT(metrics, HasSubstr("concord_rpc_duration_seconds"));
}

}  // namespace
}  // namespace concord::coordinator
