// A job's workers' watch streams alone, on a fake clock
// (coordinator/core/watches.h; see Note [Re-forming] in
// coordinator/core/core.h). What the core does with a lost stream:
// coordinator_watch_test.cc.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "absl/time/time.h"
#include "common/clock.h"
#include "coordinator/core/watches.h"

namespace concord::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

class WatchesTest : public ::testing::Test {
 protected:
  FakeClock clock_{absl::FromUnixSeconds(1700000000)};
  std::map<std::string, std::string> bindings_{{"w0", "s0"}, {"w1", "s1"}};
  Watches watches_;
};

TEST_F(WatchesTest, ALostStreamIsRememberedUntilAnotherOpens) {
  EXPECT_FALSE(watches_.LostAt("w0").has_value());  // never watched
  watches_.Opened("w0");
  EXPECT_EQ(watches_.open("w0"), 1);
  EXPECT_FALSE(watches_.LostAt("w0").has_value());  // watching
  EXPECT_TRUE(
      watches_.Closed("w0", /*lost=*/true, /*bound=*/true, clock_.Now()));
  EXPECT_EQ(watches_.LostAt("w0"), clock_.Now());
  EXPECT_THAT(watches_.lost(), ElementsAre("w0"));
  clock_.Advance(absl::Seconds(1));
  watches_.Opened("w0");
  EXPECT_FALSE(watches_.LostAt("w0").has_value());
  EXPECT_THAT(watches_.lost(), IsEmpty());
  // A normal close is no loss.
  EXPECT_TRUE(
      watches_.Closed("w0", /*lost=*/false, /*bound=*/true, clock_.Now()));
  EXPECT_FALSE(watches_.LostAt("w0").has_value());
  EXPECT_EQ(watches_.open("w0"), 0);
}

// With two streams open, losing one is no loss yet.
TEST_F(WatchesTest, AnotherOpenStreamKeepsTheWorker) {
  watches_.Opened("w0");
  watches_.Opened("w0");
  EXPECT_TRUE(watches_.Closed("w0", true, true, clock_.Now()));
  EXPECT_FALSE(watches_.LostAt("w0").has_value());
  EXPECT_EQ(watches_.open("w0"), 1);
  clock_.Advance(absl::Seconds(2));
  EXPECT_TRUE(watches_.Closed("w0", true, true, clock_.Now()));
  EXPECT_EQ(watches_.LostAt("w0"), clock_.Now());
}

TEST_F(WatchesTest, ACloseWithoutAnOpenIsIgnored) {
  EXPECT_FALSE(watches_.Closed("w0", true, true, clock_.Now()));
  EXPECT_EQ(watches_.size(), 0u);
  watches_.Opened("w0");
  EXPECT_TRUE(watches_.Closed("w0", true, true, clock_.Now()));
  EXPECT_FALSE(watches_.Closed("w0", true, true, clock_.Now()));
  EXPECT_EQ(watches_.open("w0"), 0);
}

// An unbound worker's last close forgets it; a bound one's is forgotten
// once its binding is released; a new binding clears an old loss.
TEST_F(WatchesTest, ReleasedWorkersAreForgotten) {
  watches_.Opened("w9");
  EXPECT_FALSE(watches_.Closed("w9", true, /*bound=*/false, clock_.Now()));
  EXPECT_EQ(watches_.size(), 0u);
  EXPECT_THAT(watches_.lost(), IsEmpty());

  watches_.Opened("w0");
  watches_.Opened("w1");
  watches_.Closed("w0", true, true, clock_.Now());
  watches_.Closed("w1", true, true, clock_.Now());
  watches_.ForgetReleased(bindings_);
  EXPECT_EQ(watches_.size(), 2u);
  bindings_.erase("w0");
  watches_.ForgetReleased(bindings_);
  EXPECT_EQ(watches_.size(), 1u);
  EXPECT_THAT(watches_.lost(), ElementsAre("w1"));
  watches_.Rebound("w1");
  EXPECT_FALSE(watches_.LostAt("w1").has_value());
  EXPECT_THAT(watches_.lost(), IsEmpty());
  EXPECT_EQ(watches_.size(), 1u);
  watches_.Rebound("w7");  // no stream: nothing
  EXPECT_EQ(watches_.size(), 1u);
}

}  // namespace
}  // namespace concord::coordinator
