// Auth and validation through the real gRPC server: every method of both
// services refuses a call without credentials, with an unknown token and
// with the other role's token, and changes nothing; a worker cannot speak
// for another worker or job; bad requests are INVALID_ARGUMENT.

#include <gmock/gmock.h>
#include <google/protobuf/descriptor.h>
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "tests/coordinator/test_util.h"

namespace concord::coordinator {
namespace {

using namespace ::concord::coordinator::testing;  // NOLINT
using ::testing::HasSubstr;

enum class Needs { kWorker, kOperator };

struct Method {
  const char* name;
  Needs role;
  std::function<grpc::Status(grpc::ClientContext*)> call;
};

class AuthTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { spdlog::set_level(spdlog::level::warn); }

  void SetUp() override {
    auto server = Server::Start(Options());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    worker_ = v1::WorkerService::NewStub(Channel(server_->address()));
    agent_ = v1::AgentService::NewStub(Channel(server_->address()));
    operator_ = v1::OperatorService::NewStub(Channel(server_->address()));
  }

  // Every RPC of the three services, with well-formed requests.
  std::vector<Method> Methods() {
    auto* w = worker_.get();
    auto* a = agent_.get();
    auto* o = operator_.get();
    return {
        {"Join", Needs::kWorker,
         [w](grpc::ClientContext* c) {
           v1::JoinResponse r;
           return w->Join(c, JoinReq("job", 1, 1, "w0", 100), &r);
         }},
        {"Heartbeat", Needs::kWorker,
         [w](grpc::ClientContext* c) {
           v1::HeartbeatRequest q;
           q.set_job_id("job");
           q.set_worker_id("w0");
           q.set_worker_secret(Secret("w0"));
           q.set_generation(1);
           v1::HeartbeatResponse r;
           return w->Heartbeat(c, q, &r);
         }},
        {"Leave", Needs::kWorker,
         [w](grpc::ClientContext* c) {
           v1::LeaveRequest q;
           q.set_job_id("job");
           q.set_worker_id("w0");
           q.set_worker_secret(Secret("w0"));
           q.set_generation(1);
           q.set_reason(v1::LEAVE_REASON_ERROR);
           v1::LeaveResponse r;
           return w->Leave(c, q, &r);
         }},
        {"KvSet", Needs::kWorker,
         [w](grpc::ClientContext* c) {
           v1::KvSetRequest q;
           q.set_job_id("job");
           q.set_worker_id("w0");
           q.set_worker_secret(Secret("w0"));
           q.set_generation(1);
           q.set_key("k");
           v1::KvSetResponse r;
           return w->KvSet(c, q, &r);
         }},
        {"ReportCheckpoint", Needs::kWorker,
         [w](grpc::ClientContext* c) {
           v1::ReportCheckpointRequest q;
           q.set_job_id("job");
           q.set_worker_id("w0");
           q.set_worker_secret(Secret("w0"));
           // Refused past auth as a bad field (a worker reports no memory
           // snapshot), not for a path outside a folder.
           q.mutable_report()->set_step(10);
           q.mutable_report()->set_memory(true);
           q.mutable_report()->set_node("n");
           v1::ReportCheckpointResponse r;
           return w->ReportCheckpoint(c, q, &r);
         }},
        {"KvGet", Needs::kWorker,
         [w](grpc::ClientContext* c) {
           v1::KvGetRequest q;
           q.set_job_id("job");
           q.set_worker_id("w0");
           q.set_worker_secret(Secret("w0"));
           q.set_generation(1);
           q.add_keys("k");
           q.set_wait_timeout_ms(100);
           v1::KvGetResponse r;
           return w->KvGet(c, q, &r);
         }},
        {"WatchMembership", Needs::kWorker,
         [w](grpc::ClientContext* c) {
           v1::WatchMembershipRequest q;
           q.set_job_id("job");
           q.set_worker_id("w0");
           q.set_worker_secret(Secret("w0"));
           auto reader = w->WatchMembership(c, q);
           v1::MembershipUpdate u;
           while (reader->Read(&u)) {
             c->TryCancel();
           }
           return reader->Finish();
         }},
        {"Node", Needs::kWorker,
         [a](grpc::ClientContext* c) {
           auto stream = a->Node(c);
           v1::NodeRequest q;
           q.set_job_id("job");
           v1::WatchedWorker* w0 = q.add_add();
           w0->set_worker_id("w0");
           w0->set_worker_secret(Secret("w0"));
           stream->Write(q);
           stream->WritesDone();
           v1::NodeUpdate u;
           while (stream->Read(&u)) {
           }
           return stream->Finish();
         }},
        {"ListJobs", Needs::kOperator,
         [o](grpc::ClientContext* c) {
           v1::ListJobsResponse r;
           return o->ListJobs(c, {}, &r);
         }},
        {"GetJob", Needs::kOperator,
         [o](grpc::ClientContext* c) {
           v1::GetJobRequest q;
           q.set_job_id("job");
           v1::JobStatus r;
           return o->GetJob(c, q, &r);
         }},
        {"ListEvents", Needs::kOperator,
         [o](grpc::ClientContext* c) {
           v1::ListEventsRequest q;
           q.set_job_id("job");
           v1::ListEventsResponse r;
           return o->ListEvents(c, q, &r);
         }},
        {"DrainWorker", Needs::kOperator,
         [o](grpc::ClientContext* c) {
           v1::DrainWorkerRequest q;
           q.set_job_id("job");
           q.set_worker_id("w0");
           v1::DrainWorkerResponse r;
           return o->DrainWorker(c, q, &r);
         }},
        {"StopJob", Needs::kOperator,
         [o](grpc::ClientContext* c) {
           v1::StopJobRequest q;
           q.set_job_id("job");
           v1::StopJobResponse r;
           return o->StopJob(c, q, &r);
         }},
    };
  }

  int JobCount() {
    v1::ListJobsResponse r;
    EXPECT_TRUE(operator_->ListJobs(Ctx(kOperatorToken).get(), {}, &r).ok());
    return r.jobs_size();
  }

  std::unique_ptr<Server> server_;
  std::unique_ptr<v1::WorkerService::Stub> worker_;
  std::unique_ptr<v1::AgentService::Stub> agent_;
  std::unique_ptr<v1::OperatorService::Stub> operator_;
};

TEST_F(AuthTest, EveryMethodRefusesMissingUnknownAndWrongRoleTokens) {
  const std::vector<Method> methods = Methods();
  // The table covers every method the two services have.
  const auto* pool = google::protobuf::DescriptorPool::generated_pool();
  ASSERT_EQ(
      static_cast<int>(methods.size()),
      pool->FindServiceByName("concord.v1.WorkerService")->method_count() +
          pool->FindServiceByName("concord.v1.AgentService")->method_count() +
          pool->FindServiceByName("concord.v1.OperatorService")
              ->method_count());
  for (const Method& m : methods) {
    const grpc::Status none = m.call(Ctx("").get());
    EXPECT_EQ(none.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << m.name << ": " << none.error_message();
    const grpc::Status unknown = m.call(Ctx("not-a-known-token-at-all").get());
    EXPECT_EQ(unknown.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << m.name;
    auto raw = std::make_unique<grpc::ClientContext>();
    raw->AddMetadata("authorization", kWorkerToken);  // no "Bearer "
    EXPECT_EQ(m.call(raw.get()).error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << m.name;
    const std::string wrong =
        m.role == Needs::kWorker ? kOperatorToken : kWorkerToken;
    const grpc::Status role = m.call(Ctx(wrong).get());
    EXPECT_EQ(role.error_code(), grpc::StatusCode::PERMISSION_DENIED)
        << m.name << ": " << role.error_message();
    EXPECT_THAT(role.error_message(), HasSubstr(m.name));
  }
  EXPECT_EQ(JobCount(), 0);  // nothing was created or changed
  // With the right token each method gets past auth.
  for (const Method& m : Methods()) {
    const std::string right =
        m.role == Needs::kWorker ? kWorkerToken : kOperatorToken;
    const grpc::Status s = m.call(Ctx(right).get());
    EXPECT_NE(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << m.name;
    EXPECT_NE(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << m.name;
  }
}

TEST_F(AuthTest, AWorkerCannotSpeakForAnotherWorkerOrJob) {
  v1::JoinResponse joined;
  ASSERT_TRUE(
      worker_
          ->Join(Ctx(kWorkerToken).get(), JoinReq("job", 1, 1, "w0"), &joined)
          .ok());
  // w0's id with another process's secret.
  v1::HeartbeatRequest hb;
  hb.set_job_id("job");
  hb.set_worker_id("w0");
  hb.set_worker_secret(Secret("intruder"));
  hb.set_generation(joined.generation());
  v1::HeartbeatResponse hb_response;
  const grpc::Status forged =
      worker_->Heartbeat(Ctx(kWorkerToken).get(), hb, &hb_response);
  EXPECT_EQ(forged.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(forged.error_message(), HasSubstr("bound to another"));
  v1::JoinResponse stolen;
  v1::JoinRequest steal = JoinReq("job", 1, 1, "w0", 100);
  steal.set_worker_secret(Secret("intruder"));
  EXPECT_EQ(worker_->Join(Ctx(kWorkerToken).get(), steal, &stolen).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);

  // A member of another job writes into this job's store: refused.
  v1::JoinResponse other;
  ASSERT_TRUE(
      worker_
          ->Join(Ctx(kWorkerToken).get(), JoinReq("other", 1, 1, "x"), &other)
          .ok());
  v1::KvSetRequest kv;
  kv.set_job_id("job");
  kv.set_generation(joined.generation());
  kv.set_key("gloo/0");
  kv.set_worker_id("x");
  kv.set_worker_secret(Secret("x"));
  v1::KvSetResponse unused;
  EXPECT_EQ(worker_->KvSet(Ctx(kWorkerToken).get(), kv, &unused).error_code(),
            grpc::StatusCode::NOT_FOUND);
  kv.set_worker_id("w0");
  EXPECT_EQ(worker_->KvSet(Ctx(kWorkerToken).get(), kv, &unused).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  // The real w0 is unaffected.
  hb.set_worker_secret(Secret("w0"));
  EXPECT_TRUE(
      worker_->Heartbeat(Ctx(kWorkerToken).get(), hb, &hb_response).ok());
}

TEST_F(AuthTest, BadRequestsAreInvalidArgumentOverTheWire) {
  v1::JoinResponse r;
  for (auto mutate : std::vector<std::function<void(v1::JoinRequest&)>>{
           [](auto& q) { q.set_worker_secret(""); },
           [](auto& q) { q.set_worker_id("has space"); },
           [](auto& q) { q.mutable_spec()->set_job_id(std::string(200, 'j')); },
           [](auto& q) { q.set_wait_timeout_ms(-1); },
           [](auto& q) { q.mutable_spec()->set_max_workers(200000); },
       }) {
    v1::JoinRequest q = JoinReq("job", 1, 1, "w0", 100);
    mutate(q);
    const grpc::Status s = worker_->Join(Ctx(kWorkerToken).get(), q, &r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << s.error_message();
    EXPECT_FALSE(s.error_message().empty());
  }
  v1::GetJobRequest get;
  get.set_job_id("../etc");
  v1::JobStatus status;
  EXPECT_EQ(
      operator_->GetJob(Ctx(kOperatorToken).get(), get, &status).error_code(),
      grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(JobCount(), 0);
}

}  // namespace
}  // namespace concord::coordinator
