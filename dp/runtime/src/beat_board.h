// beat_board.h — what a process group knows of its peers' beats (ProcessGroup::start_beats),
// whatever carries them (the env:// store, MPI messages): each peer's counter, when it last moved,
// when this process last looked, and what the peer said of itself. A peer's silence is counted
// between two looks that saw its counter still, so a stop of this process is no silence of its
// peers. Private to the runtime; the group guards it with its own mutex.
#pragma once

#include <chrono>
#include <string>
#include <string_view>
#include <vector>

#include "dp/runtime/process_group.h"

namespace dp::detail {

class BeatBoard {
 public:
  using Clock = std::chrono::steady_clock;

  // A beat as it travels: "<counter> <status>".
  static std::string text(long long count, std::string_view status);

  // Every process of `processes` heard from now.
  void start(int processes);
  // The beat thread's round at `now`. A round long after the last one means this process itself
  // stood still (stopped, starved) and its peers' beats could not reach it: their silence counts
  // from now.
  void round(Clock::time_point now);
  // Process p's beat `text` (text()'s form), read at `now`.
  void heard(int p, std::string_view text, Clock::time_point now);
  // Looked for process p's beat at `now`, with nothing new to read.
  void looked(int p, Clock::time_point now) { peers_.at(static_cast<std::size_t>(p)).read = now; }
  // Every process but `self`. `unanswering`: a process whose silence is also the requests it
  // leaves unanswered (env://: process 0, which serves the store), counted up to `now`; -1: none.
  std::vector<ProcessGroup::PeerBeat> peers(int self, Clock::time_point now, int unanswering = -1) const;

 private:
  struct Peer {
    long long count = -1;
    Clock::time_point moved, read;  // when `count` last changed; when this process last looked
    std::string status;
  };
  std::vector<Peer> peers_;  // by process
  Clock::time_point last_round_;
};

}  // namespace dp::detail
