// actors/deadlines.h on its own: many deadlines, a few wake-ups, none late,
// and a wake-up that is not one of its own (a peer's message) ends nothing
// early and changes no count of the armed ones.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <vector>

#include "actors/deadlines.h"

namespace disagg {
namespace {

using namespace std::chrono_literals;
using Set = DeadlineSet<int>;

TEST(DeadlineSet, ADayOfDeadlinesASecondApartNeedsAFewWakeupsAndNoneIsLate) {
  Set set;
  const Clock::time_point now = Clock::now();
  std::vector<Clock::time_point> armed;
  for (int i = 0; i < 1000; ++i)
    if (auto at = set.add(now + 24h - i * 1s, i, now)) armed.push_back(*at);
  EXPECT_EQ(set.size(), 1000u);
  EXPECT_GE(armed.size(), 1u);
  EXPECT_LE(armed.size(), 3u) << "of 1000 deadlines";
  EXPECT_EQ(set.wakeups(), armed.size());
  EXPECT_LE(*std::min_element(armed.begin(), armed.end()), now + 24h - 999s) << "none by the earliest deadline";
  // Each wake-up a deadline sees is at most its deadline, and one is exactly it.
  const Clock::time_point deadline = now + 3s;
  std::optional<Clock::time_point> at = set.add(deadline, -1, now);
  ASSERT_TRUE(at);
  std::vector<Set::Entry> due;
  int wakeups = 0;
  Clock::time_point clock = now;
  while (at && due.empty()) {
    ASSERT_LE(*at, deadline);
    clock = *at;  // (the timer fires on time)
    at = set.fired(*at, clock, due);
    ++wakeups;
  }
  ASSERT_EQ(due.size(), 1u);
  EXPECT_EQ(due[0].second, -1);
  EXPECT_EQ(clock, deadline) << "not served on time";
  EXPECT_LE(wakeups, 12);
}

TEST(DeadlineSet, ARemovedDeadlineIsNeverDue) {
  Set set;
  const Clock::time_point now = Clock::now();
  const auto at = set.add(now + 5ms, 7, now);
  ASSERT_TRUE(at);
  set.remove(now + 5ms, 7);
  EXPECT_EQ(set.size(), 0u);
  std::vector<Set::Entry> due;
  EXPECT_FALSE(set.fired(*at, now + 1s, due));
  EXPECT_TRUE(due.empty());
  EXPECT_EQ(set.wakeups(), 0u);
}

// A wake-up for a time still ahead (a timer never fires early, so it is
// not ours), for the very time an armed one has, ends only what is due and
// leaves that one counted: the owner arms no second timer for it.
TEST(DeadlineSet, AWakeupNotItsOwnEndsNothingEarlyAndArmsNothing) {
  Set set;
  const Clock::time_point now = Clock::now();
  const auto at = set.add(now + 1h, 1, now);
  ASSERT_TRUE(at);
  ASSERT_EQ(set.wakeups(), 1u);
  std::vector<Set::Entry> due;
  for (const Clock::time_point forged : {*at, now + 2h, Clock::time_point::max(), Clock::time_point{}}) {
    EXPECT_FALSE(set.fired(forged, now, due));
    EXPECT_TRUE(due.empty());
    EXPECT_EQ(set.size(), 1u);
    EXPECT_EQ(set.wakeups(), 1u);
  }
  // Its own, on time: the deadline ends.
  Clock::time_point clock = *at;
  std::optional<Clock::time_point> next = *at;
  while (next && due.empty()) {
    clock = *next;
    next = set.fired(*next, clock, due);
  }
  ASSERT_EQ(due.size(), 1u);
  EXPECT_EQ(clock, now + 1h);
  EXPECT_EQ(set.wakeups(), 0u);
}

}  // namespace
}  // namespace disagg
