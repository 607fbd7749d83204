// The coordinator's indexed worker lists (coordinator/core/worker_list.h).

#include "coordinator/core/worker_list.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace concord::coordinator {
namespace {

struct W {
  std::string worker_id;
  bool back = false;
  int joined = 0;
};

std::vector<std::string> Ids(const WorkerList<W>& list) {
  std::vector<std::string> ids;
  for (const W& w : list) ids.push_back(w.worker_id);
  return ids;
}

TEST(WorkerListTest, FindsAddsAndRemovesByIdKeepingTheOrder) {
  WorkerList<W> list;
  for (int i = 0; i < 5; ++i) list.Add(W{"w" + std::to_string(i), false, i});
  ASSERT_NE(list.Find("w3"), nullptr);
  EXPECT_EQ(list.Find("w3")->joined, 3);
  EXPECT_EQ(list.Find("nobody"), nullptr);
  EXPECT_TRUE(list.Remove("w1"));
  EXPECT_FALSE(list.Remove("w1"));
  EXPECT_EQ(Ids(list), (std::vector<std::string>{"w0", "w2", "w3", "w4"}));
  // The index follows the elements that moved.
  for (const char* id : {"w0", "w2", "w3", "w4"}) {
    ASSERT_NE(list.Find(id), nullptr) << id;
    EXPECT_EQ(list.Find(id)->worker_id, id);
  }
  list.Find("w4")->joined = 40;
  EXPECT_EQ(list.Find("w4")->joined, 40);
  list.Clear();
  EXPECT_TRUE(list.empty());
  EXPECT_EQ(list.Find("w0"), nullptr);
}

TEST(WorkerListTest, CountsTheWorkersMarkedBack) {
  WorkerList<W> list;
  list.Add(W{"a"});
  list.Add(W{"b"});
  list.Add(W{"c", /*back=*/true});
  EXPECT_EQ(list.back_count(), 1u);
  list.MarkBack(list.Find("a"));
  list.MarkBack(list.Find("a"));  // idempotent
  EXPECT_EQ(list.back_count(), 2u);
  EXPECT_TRUE(list.Find("a")->back);
  list.Remove("c");
  EXPECT_EQ(list.back_count(), 1u);
  list.Remove("b");
  EXPECT_EQ(list.back_count(), 1u);
}

TEST(WorkerListTest, TakeFirstSortsStablyAndReindexesTheRest) {
  WorkerList<W> list;
  list.Add(W{"late", false, 9});
  list.Add(W{"x", true, 1});
  list.Add(W{"y", false, 1});
  list.Add(W{"early", false, 0});
  const std::vector<W> taken = list.TakeFirst(
      3, [](const W& a, const W& b) { return a.joined < b.joined; });
  ASSERT_EQ(taken.size(), 3u);
  EXPECT_EQ(taken[0].worker_id, "early");
  EXPECT_EQ(taken[1].worker_id, "x");  // ties keep their order
  EXPECT_EQ(taken[2].worker_id, "y");
  EXPECT_EQ(Ids(list), std::vector<std::string>{"late"});
  EXPECT_EQ(list.Find("x"), nullptr);
  ASSERT_NE(list.Find("late"), nullptr);
  EXPECT_EQ(list.back_count(), 0u);
  EXPECT_EQ(list.TakeFirst(5, [](const W&, const W&) { return false; }).size(),
            1u);
  EXPECT_TRUE(list.empty());
}

}  // namespace
}  // namespace concord::coordinator
