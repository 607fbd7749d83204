// See Note [Unreachable peers], the worker's side: its reachability port and
// the probe of others', on real sockets.

#include "worker/reachability.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "worker/comm/work.h"

namespace concord::worker {
namespace {

// A loopback port nobody listens on (bound, then closed).
int ClosedPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

TEST(ReachabilityTest, AListenerAnswersAndARefusalCountsAsReachable) {
  auto listener = ProbeListener::Start("127.0.0.1");
  ASSERT_TRUE(listener.ok()) << listener.status();
  ASSERT_GT((*listener)->port(), 0);
  // Many probes: each connection is accepted and closed, none piles up.
  for (int round = 0; round < 3; ++round) {
    std::vector<std::pair<std::string, int>> endpoints(
        200, {"127.0.0.1", (*listener)->port()});
    endpoints.emplace_back("127.0.0.1", ClosedPort());  // host answers: RST
    const std::vector<bool> reachable =
        ProbeReachable(endpoints, absl::Seconds(5));
    ASSERT_EQ(reachable.size(), endpoints.size());
    for (bool r : reachable) EXPECT_TRUE(r);
  }
}

// A name that does not resolve, an address TCP cannot connect to (a
// multicast group). A silent host (a blackholed link) is the netfault
// scenarios' (tests/netfault: the probe times out).
TEST(ReachabilityTest, NoAnswerIsUnreachable) {
  const absl::Time start = absl::Now();
  const std::vector<bool> reachable = ProbeReachable(
      {{"no-such-host.invalid", 1}, {"224.0.0.1", 9}}, absl::Milliseconds(300));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(reachable, (std::vector<bool>{false, false}));
  EXPECT_TRUE(ProbeReachable({}, absl::Seconds(1)).empty());
}

TEST(ReachabilityTest, ABadHostIsAnError) {
  EXPECT_EQ(ProbeListener::Start("no-such-host.invalid").status().code(),
            absl::StatusCode::kUnavailable);
}

TEST(ReachabilityTest, WhichReformReasonsSuggestAnUnreachablePeer) {
  EXPECT_TRUE(SuggestsUnreachablePeer(
      "step agreement failed: gloo: [./gloo/transport/tcp/unbound_buffer.cc"
      ":133] Timed out waiting 8000ms for send operation to complete"));
  EXPECT_TRUE(SuggestsUnreachablePeer("DEADLINE_EXCEEDED: allreduce"));
  // The collective timeout's own words, from the work that timed out.
  comm::PromiseWork never_done;
  const absl::Status timed_out = never_done.Wait(absl::Milliseconds(1));
  ASSERT_EQ(timed_out.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(SuggestsUnreachablePeer(
      absl::StrCat("gradient allreduce failed: ", timed_out.message())));
  EXPECT_TRUE(SuggestsUnreachablePeer(
      "communicator of generation 3 did not connect: UNAVAILABLE: ..."));
  EXPECT_FALSE(SuggestsUnreachablePeer(
      "gloo: Read error [10.0.0.2]:1234: Connection reset by peer"));
  EXPECT_FALSE(SuggestsUnreachablePeer("workers wait to be admitted"));
  EXPECT_FALSE(SuggestsUnreachablePeer(""));
}

}  // namespace
}  // namespace concord::worker
