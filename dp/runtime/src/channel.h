// channel.h — point-to-point messages between the processes of a ProcessGroup, for the runtime's
// communicators (the sim ring's transport between processes). Private to the runtime.
#pragma once

#include <cstddef>
#include <functional>
#include <span>
#include <string_view>

namespace dp::detail {

class Channel {
 public:
  struct Message {
    void* data = nullptr;  // send: read; receive: written
    std::size_t bytes = 0;
    int process = 0;  // the peer
    int tag = 0;      // in [0, max_tag()]; messages of one (peer, tag) pair arrive in order
  };
  virtual ~Channel() = default;
  virtual int max_tag() const = 0;
  // Posts every send and receive, then waits until all have completed. Any number of threads may
  // exchange at once. Throws Error naming `what` when aborted() turns true or the group's timeout
  // passes first (pending receives are cancelled, so no buffer is written after the throw).
  virtual void exchange(std::span<const Message> sends, std::span<const Message> receives,
                        const std::function<bool()>& aborted, std::string_view what) = 0;
};

}  // namespace dp::detail
