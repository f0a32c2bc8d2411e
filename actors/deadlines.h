// Many deadlines served by a few timers. A CAF 0.17 timer (delayed_send)
// cannot be cancelled: one per request or reservation stays pending until
// its time, long after what it guarded ended, so at a steady rate of long
// deadlines an actor's pending timers and their memory grow with the rate
// times the deadline. A DeadlineSet keeps the deadlines (removed as what
// they guard ends) and the wake-ups armed for them: a deadline `left` away
// is served by any wake-up armed in [w, deadline], where w is the deadline
// rounded down to a power-of-two step of at most left / 8 (exact under a
// millisecond). Each wake-up hands out what is due and names the next one
// to arm. Never late; a deadline sees about log8 of its time left in ms
// wake-ups (9 for a day); at any time at most ~10 are pending per power of
// two of time left, a few hundred in all, whatever the rate.
//
// CAF-free: the owner arms each wake-up it is told to (a delayed_send to
// itself carrying the time) and calls fired() when it comes.
#pragma once
#include <algorithm>
#include <cstdint>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "actors/timing.h"

namespace disagg {

template <class Key>
class DeadlineSet {
 public:
  using Entry = std::pair<Clock::time_point, Key>;

  // Adds `key`'s deadline: the time of a wake-up to arm for it, or nullopt
  // when one armed already serves it.
  std::optional<Clock::time_point> add(Clock::time_point deadline, Key key, Clock::time_point now) {
    entries_.emplace(deadline, std::move(key));
    return arm(deadline, now);
  }

  // What it guarded ended first (a deadline never added: nothing).
  void remove(Clock::time_point deadline, const Key& key) { entries_.erase({deadline, key}); }

  // A wake-up armed for `at` came: the entries due by `now` (out of the
  // set, earliest first) go to `due`; returns the next wake-up to arm, if
  // one is needed. A wake-up for a time still ahead (not one of ours: a
  // timer never fires early) ends nothing that is not due and leaves the
  // armed ones counted, so a forged one can neither end a deadline early
  // nor make the owner arm more.
  std::optional<Clock::time_point> fired(Clock::time_point at, Clock::time_point now, std::vector<Entry>& due) {
    if (at <= now)
      if (auto armed = wakeups_.find(at); armed != wakeups_.end()) wakeups_.erase(armed);
    while (!entries_.empty() && entries_.begin()->first <= now) {
      due.push_back(std::move(entries_.extract(entries_.begin()).value()));
    }
    if (entries_.empty()) return std::nullopt;
    return arm(entries_.begin()->first, now);
  }

  size_t size() const { return entries_.size(); }      // deadlines kept
  size_t wakeups() const { return wakeups_.size(); }  // timers pending

  // The wake-up a deadline is armed with now (see the top of this file).
  static Clock::time_point wakeup_for(Clock::time_point deadline, Clock::time_point now) {
    const int64_t left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now).count();
    if (left < 1000000) return deadline;
    const uint64_t most = uint64_t(left / 8);
    const int64_t step = int64_t(uint64_t{1} << (63 - __builtin_clzll(most)));  // <= left / 8
    const int64_t at = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline.time_since_epoch()).count();
    return Clock::time_point(std::chrono::duration_cast<Clock::duration>(std::chrono::nanoseconds(at - at % step)));
  }

 private:
  std::optional<Clock::time_point> arm(Clock::time_point deadline, Clock::time_point now) {
    const Clock::time_point w = wakeup_for(deadline, now);
    if (auto armed = wakeups_.lower_bound(w); armed != wakeups_.end() && *armed <= deadline) return std::nullopt;
    wakeups_.insert(w);
    return w;
  }

  std::set<Entry> entries_;
  std::multiset<Clock::time_point> wakeups_;  // one per timer pending
};

// Arms the wake-up a DeadlineSet asks for (when it asks), as a timer to
// `self` carrying its time: (atom, steady clock ticks). CAF's delayed_send
// is the owner's (this header includes no CAF).
template <class Self, class Atom>
void arm_wakeup(Self self, std::optional<Clock::time_point> at, Atom atom) {
  if (!at) return;
  self->delayed_send(self, std::max(Clock::duration::zero(), *at - Clock::now()), atom,
                     int64_t(at->time_since_epoch().count()));
}

// The time a wake-up message carries.
inline Clock::time_point wakeup_time(int64_t ticks) { return Clock::time_point(Clock::duration(ticks)); }

}  // namespace disagg
