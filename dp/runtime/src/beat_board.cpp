// beat_board.cpp — the peers' beats as a process group sees them.
#include "beat_board.h"

#include <algorithm>
#include <cstdlib>
#include <fmt/format.h>

namespace dp::detail {

std::string BeatBoard::text(long long count, std::string_view status) { return fmt::format("{} {}", count, status); }

void BeatBoard::start(int processes) {
  const auto now = Clock::now();
  peers_.assign(static_cast<std::size_t>(processes), Peer{-1, now, now, {}});
  last_round_ = now;
}

void BeatBoard::round(Clock::time_point now) {
  // Beats come every second and a round waits at most a second for its answers.
  if (now - last_round_ > std::chrono::milliseconds(2500))
    for (Peer& p : peers_) p.moved = now;
  last_round_ = now;
}

void BeatBoard::heard(int p, std::string_view text, Clock::time_point now) {
  Peer& peer = peers_.at(static_cast<std::size_t>(p));
  const std::size_t space = text.find(' ');
  const long long count = std::atoll(std::string(text.substr(0, space)).c_str());
  if (count != peer.count) peer.moved = now;
  peer.count = count;
  peer.read = now;
  peer.status = space == std::string_view::npos ? std::string() : std::string(text.substr(space + 1));
}

std::vector<ProcessGroup::PeerBeat> BeatBoard::peers(int self, Clock::time_point now, int unanswering) const {
  const auto seconds = [](Clock::duration d) { return std::max(0.0, std::chrono::duration<double>(d).count()); };
  std::vector<ProcessGroup::PeerBeat> out;
  for (int p = 0; p < static_cast<int>(peers_.size()); ++p) {
    if (p == self) continue;
    const Peer& peer = peers_[static_cast<std::size_t>(p)];
    out.push_back({p, seconds((p == unanswering ? now : peer.read) - peer.moved), peer.status});
  }
  return out;
}

}  // namespace dp::detail
