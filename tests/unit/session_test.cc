// Session against a real coordinator served in this process (gRPC on
// loopback), and alone: what it answers between generations, and the
// progress its heartbeat carries.
#include "worker/session.h"

#include <gtest/gtest.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <memory>
#include <type_traits>
#include <utility>

#include "coordinator/server.h"
#include "worker/ddp/engine.h"
#include "worker/elastic/state.h"

namespace concord::worker {
namespace {

constexpr char kWorkerToken[] = "worker-token-0123456789";
constexpr char kOperatorToken[] = "operator-token-0123456789";

std::unique_ptr<coordinator::Server> StartCoordinator() {
  coordinator::ServerOptions options;
  options.worker_token = kWorkerToken;
  options.operator_token = kOperatorToken;
  auto server = coordinator::Server::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

WorkerOptions OneWorkerJob(const std::string& address) {
  WorkerOptions options;
  options.coordinator = address;
  options.token = kWorkerToken;
  options.worker_id = "w0";
  options.spec.set_job_id("session-test");
  options.spec.set_min_workers(1);
  options.spec.set_max_workers(1);
  options.join_timeout = absl::Seconds(2);
  options.collective_timeout = absl::Seconds(10);
  return options;
}

// Before: rank(), world_size() and generation() read through the current
// communicator, which a failed Reform leaves null (a crash).
TEST(SessionTest, AFailedReformLeavesTheLastGenerationsNumbers) {
  spdlog::set_level(spdlog::level::warn);
  auto server = StartCoordinator();
  ASSERT_NE(server, nullptr);
  auto session = Session::Start(OneWorkerJob(server->address()));
  ASSERT_TRUE(session.ok()) << session.status();
  const int64_t formed = (*session)->generation();
  EXPECT_GE(formed, 1);
  EXPECT_EQ((*session)->rank(), 0);
  EXPECT_EQ((*session)->world_size(), 1);

  server.reset();  // the coordinator goes away: the next generation cannot form
  const absl::Status reformed = (*session)->Reform(0, "test: coordinator gone");
  EXPECT_FALSE(reformed.ok());
  EXPECT_EQ((*session)->shared_communicator(), nullptr);
  EXPECT_EQ((*session)->rank(), 0);
  EXPECT_EQ((*session)->world_size(), 1);
  EXPECT_GE((*session)->generation(), formed);
}

// Before: Session::communicator() returned a reference to the current
// generation's communicator, which a Reform destroys under its holder. Only
// the shared_ptr form remains.
template <typename T, typename = void>
struct HasCommunicatorReference : std::false_type {};
template <typename T>
struct HasCommunicatorReference<
    T, std::void_t<decltype(std::declval<T&>().communicator())>>
    : std::is_reference<decltype(std::declval<T&>().communicator())> {};

TEST(SessionTest, NoReferenceToTheCommunicatorOutlivesAReform) {
  EXPECT_FALSE(HasCommunicatorReference<Session>::value);
}

// Before: State::Commit reported the step with a throughput of 0 and no
// loss, overwriting what the training loop had just reported.
TEST(SessionTest, CommitKeepsTheReportedThroughputAndLoss) {
  auto session = Session::Start(WorkerOptions{});  // alone
  ASSERT_TRUE(session.ok()) << session.status();
  auto net = std::make_shared<torch::nn::LinearImpl>(3, 2);
  auto ddp = ddp::Engine::Create(net, (*session)->shared_communicator(), 0);
  ASSERT_TRUE(ddp.ok()) << ddp.status();
  torch::optim::SGD opt((*ddp)->parameters(), 0.1);
  elastic::State state(session->get(), ddp->get(), &opt);
  ASSERT_TRUE(state.Sync().ok());

  (*session)->ReportProgress(6, 250.0, 0.5);
  state.step = 7;
  state.Commit();
  const Session::Progress p = (*session)->progress();
  EXPECT_EQ(p.step, 7);
  EXPECT_EQ(p.samples_per_second, 250.0);
  ASSERT_TRUE(p.loss.has_value());
  EXPECT_EQ(*p.loss, 0.5);
}

}  // namespace
}  // namespace concord::worker
