#include "worker/comm/store.h"

#include <gtest/gtest.h>

#include <thread>

#include "counting_store.h"

namespace concord::comm {
namespace {

using concord::testing::CountingStore;

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

// Every rank sets its key, then reads every other rank's, a key at a time
// (connectFullMesh's order): one Get per rank through the table.
TEST(RankTableStoreTest, ReadsATableInOneGetAndAnswersTheRestFromMemory) {
  constexpr int kRanks = 16;
  CountingStore counting;
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&counting, r] {
      RankTableStore store(&counting, kRanks, {"rank_", ""});
      ASSERT_TRUE(store.Set("rank_" + std::to_string(r), "host").ok());
      ASSERT_TRUE(
          store.Set(std::to_string(r), "addr" + std::to_string(r)).ok());
      for (int i = 0; i < kRanks; ++i) {
        if (i == r) continue;
        auto host = store.Get({"rank_" + std::to_string(i)}, absl::Seconds(30));
        ASSERT_TRUE(host.ok()) << host.status();
        EXPECT_EQ(host->front(), "host");
        auto addr = store.Get({std::to_string(i)}, absl::Seconds(30));
        ASSERT_TRUE(addr.ok()) << addr.status();
        EXPECT_EQ(addr->front(), "addr" + std::to_string(i));
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(counting.sets, 2 * kRanks);
  EXPECT_EQ(counting.gets, 2 * kRanks);  // was 2 * kRanks * (kRanks - 1)
}

// Values larger than the batch go in several Gets, sized by this rank's own
// value; keys of no table, and numbers that are not ranks, pass through.
TEST(RankTableStoreTest, BatchesLargeValuesAndPassesOtherKeysThrough) {
  CountingStore counting;
  RankTableStore store(&counting, 8, {"t/"}, /*keys_per_get=*/1024,
                       /*batch_bytes=*/300);
  for (int r = 0; r < 8; ++r) {
    ASSERT_TRUE(
        store.Set("t/" + std::to_string(r), std::string(100, 'a' + r)).ok());
  }
  ASSERT_EQ(counting.sets, 8);
  auto v = store.Get({"t/5"}, absl::Seconds(5));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->front(), std::string(100, 'f'));
  EXPECT_EQ(counting.gets, 3);  // 3 + 3 + 2 keys of 100 bytes
  EXPECT_EQ(counting.keys_read, 8);
  EXPECT_EQ(store.Get({"t/0", "t/7"}, absl::Seconds(5))->back(),
            std::string(100, 'h'));
  EXPECT_EQ(counting.gets, 3);

  ASSERT_TRUE(counting.base.Set("t/08", "x").ok());
  ASSERT_TRUE(counting.base.Set("t/9", "y").ok());
  ASSERT_TRUE(counting.base.Set("other", "z").ok());
  for (const char* key : {"t/08", "t/9", "other"}) {
    EXPECT_TRUE(store.Get({key}, absl::Seconds(5)).ok()) << key;
  }
  EXPECT_EQ(counting.gets, 6);
  // A table whose key is never set times out like the key itself would.
  RankTableStore missing(&counting, 9, {"t/"});
  EXPECT_EQ(missing.Get({"t/0"}, absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  // No Get names more keys than the store takes in one read.
  CountingStore small;
  for (int r = 0; r < 5; ++r) {
    ASSERT_TRUE(small.base.Set("k" + std::to_string(r), "v").ok());
  }
  RankTableStore limited(&small, 5, {"k"}, /*keys_per_get=*/2);
  ASSERT_TRUE(limited.Get({"k4"}, absl::Seconds(5)).ok());
  EXPECT_EQ(small.gets, 3);  // 2 + 2 + 1 keys
}

}  // namespace
}  // namespace concord::comm
