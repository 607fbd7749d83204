// A job's events alone, on a fake clock (coordinator/core/event_log.h):
// numbered, bounded, paged, persisted. Through the whole core:
// coordinator_history_test.cc and coordinator_watch_test.cc.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "coordinator/core/event_log.h"

namespace concord::coordinator {
namespace {

class EventLogTest : public ::testing::Test {
 protected:
  // Adds `n` events a second apart, "e<seq>".
  void AddEvents(int n) {
    for (int i = 0; i < n; ++i) {
      clock_.Advance(absl::Seconds(1));
      log_.Add(clock_.Now(), "join", "w0",
               absl::StrCat("e", log_.last_seq() + 1));
    }
  }

  FakeClock clock_{absl::FromUnixSeconds(1700000000)};
  EventLog log_;
};

TEST_F(EventLogTest, EventsAreNumberedFromOneInOrder) {
  EXPECT_TRUE(log_.empty());
  EXPECT_EQ(log_.last_seq(), 0);
  Event& e = log_.Add(clock_.Now(), "generation", "", "formed");
  e.generation = 3;
  e.members = {"w0", "w1"};
  AddEvents(2);
  ASSERT_EQ(log_.all().size(), 3u);
  EXPECT_EQ(log_.all()[0].seq, 1);
  EXPECT_EQ(log_.all()[0].generation, 3);
  EXPECT_EQ(log_.all()[0].time, absl::FromUnixSeconds(1700000000));
  EXPECT_EQ(log_.back().seq, 3);
  EXPECT_EQ(log_.back().message, "e3");
  EXPECT_EQ(log_.last_seq(), 3);
}

// The oldest are dropped beyond kMax; the numbers go on, and a reader behind
// learns how many it lost.
TEST_F(EventLogTest, TheOldestAreDroppedAndCounted) {
  AddEvents(static_cast<int>(EventLog::kMax) + 5);
  ASSERT_EQ(log_.all().size(), EventLog::kMax);
  EXPECT_EQ(log_.all().front().seq, 6);
  EXPECT_EQ(log_.last_seq(), static_cast<int64_t>(EventLog::kMax) + 5);
  int64_t lost = -1;
  std::vector<Event> after = log_.After(2, &lost);
  EXPECT_EQ(lost, 3);  // 3, 4 and 5
  EXPECT_EQ(after.size(), EventLog::kMax);
  after = log_.After(log_.last_seq() - 2, &lost);
  EXPECT_EQ(lost, 0);
  ASSERT_EQ(after.size(), 2u);
  EXPECT_EQ(after[0].seq, log_.last_seq() - 1);
  EXPECT_TRUE(log_.After(log_.last_seq(), &lost).empty());
  EXPECT_EQ(lost, 0);
}

TEST_F(EventLogTest, PagesAndRecentEvents) {
  AddEvents(30);
  std::vector<v1::Event> page = log_.Page(10, 5);
  ASSERT_EQ(page.size(), 5u);
  EXPECT_EQ(page[0].seq(), 11);
  EXPECT_EQ(page[4].message(), "e15");
  EXPECT_EQ(page[0].time_unix_ms(), (1700000000 + 11) * int64_t{1000});
  EXPECT_EQ(log_.Page(28, 100).size(), 2u);
  EXPECT_TRUE(log_.Page(30, 100).empty());
  std::vector<v1::Event> recent = log_.Recent(20);
  ASSERT_EQ(recent.size(), 20u);
  EXPECT_EQ(recent.front().seq(), 11);
  EXPECT_EQ(recent.back().seq(), 30);
  EXPECT_EQ(log_.Recent(100).size(), 30u);
}

// See Note [Persistence] in core.h: the events and the next number come
// back (a generation's members are not persisted); the next number is never
// behind the last event.
TEST_F(EventLogTest, EventsSurviveExportAndRestore) {
  log_.Add(clock_.Now(), "generation", "", "formed").members = {"w0"};
  AddEvents(3);
  v1::JobRecord record;
  log_.Export(record);
  ASSERT_EQ(record.events_size(), 4);
  EXPECT_EQ(record.next_event_seq(), 5);
  EventLog restored;
  restored.Restore(record);
  ASSERT_EQ(restored.all().size(), 4u);
  EXPECT_EQ(restored.all()[1].message, "e2");
  EXPECT_EQ(restored.all()[1].time, log_.all()[1].time);
  EXPECT_TRUE(restored.all()[0].members.empty());
  EXPECT_EQ(restored.Add(clock_.Now(), "job", "", "next").seq, 5);

  record.set_next_event_seq(2);  // behind its events
  EventLog behind;
  behind.Restore(record);
  EXPECT_EQ(behind.last_seq(), 4);
  record.clear_events();
  record.set_next_event_seq(0);  // a record without
  EventLog none;
  none.Restore(record);
  EXPECT_EQ(none.Add(clock_.Now(), "job", "", "first").seq, 1);
}

}  // namespace
}  // namespace concord::coordinator
