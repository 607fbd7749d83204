#include "worker/comm/store.h"

#include <gtest/gtest.h>

#include <thread>

namespace concord::comm {
namespace {

TEST(StoreTest, GetWaitsForSet) {
  InMemoryStore store;
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ASSERT_TRUE(store.Set("a", "1").ok());
    ASSERT_TRUE(store.Set("b", "2").ok());
  });
  auto values = store.Get({"a", "b"}, absl::Seconds(10));
  setter.join();
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_EQ(*values, (std::vector<std::string>{"1", "2"}));
}

TEST(StoreTest, GetTimesOut) {
  InMemoryStore store;
  auto values = store.Get({"never"}, absl::Milliseconds(20));
  EXPECT_EQ(values.status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(StoreTest, PrefixStoreIsolatesKeys) {
  InMemoryStore base;
  PrefixStore a("a/", &base), b("b/", &base);
  ASSERT_TRUE(a.Set("k", "from a").ok());
  ASSERT_TRUE(b.Set("k", "from b").ok());
  EXPECT_EQ(a.Get({"k"}, absl::Seconds(1))->front(), "from a");
  EXPECT_EQ(b.Get({"k"}, absl::Seconds(1))->front(), "from b");
  EXPECT_EQ(base.Get({"a/k"}, absl::Seconds(1))->front(), "from a");
  EXPECT_EQ(base.Set("", "x").code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace concord::comm
