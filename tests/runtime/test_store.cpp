// test_store.cpp — the env:// store (dp/runtime/env/tcp_store.h, Note [store security]) against
// strangers and mistakes, with real sockets on 127.0.0.1: what it listens on, connections that never
// say hello, garbage, announced giant values, floods, running out of descriptors, a duplicate RANK,
// another WORLD_SIZE, a job token, and a foreign program on MASTER_PORT.
#include <arpa/inet.h>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fmt/format.h>
#include <fstream>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <string>
#include <sys/resource.h>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include "dp/runtime/error.h"
#include "store_protocol.h"
#include "tcp_store.h"
#include "test_util.h"

namespace dp::detail {
namespace {

using namespace std::chrono_literals;

int next_port() { return test::free_tcp_port(); }

// 127.0.0.1:port.
sockaddr_in loopback(int port) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<std::uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return address;
}

// A raw TCP client of 127.0.0.1:port, as a stranger would connect (-1 when refused).
int raw_connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  const sockaddr_in address = loopback(port);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// A raw TCP listener on 127.0.0.1:port, as another program on MASTER_PORT would be (-1 when it cannot).
int raw_listen(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  const sockaddr_in address = loopback(port);
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0 || ::listen(fd, 4) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

void send_bytes(int fd, const std::string& bytes) { (void)::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL); }
std::string u32(std::uint32_t n) { return std::string(reinterpret_cast<const char*>(&n), sizeof n); }

// Whether the server closed `fd` (recv sees the end) within `limit`.
bool closed_within(int fd, std::chrono::milliseconds limit) {
  timeval tv{static_cast<time_t>(limit.count() / 1000), static_cast<suseconds_t>((limit.count() % 1000) * 1000)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char byte = 0;
  for (;;) {
    const ssize_t n = ::recv(fd, &byte, 1, 0);
    if (n == 0) return true;
    if (n < 0) return errno == ECONNRESET;
  }
}

std::string text_of(const std::optional<std::vector<char>>& value) {
  return value ? std::string(value->begin(), value->end()) : std::string("(none)");
}

TcpStore client(int port, int rank, int world = 2, const std::string& token = "", std::chrono::milliseconds t = 5s) {
  return TcpStore("127.0.0.1", port, rank, world, token, t);
}

TEST(Store, ListensOnMasterAddrOnly) {
  const int port = next_port();
  TcpStore server("127.0.0.1", port, 0, 2, "", 5s);
  // /proc/net/tcp: the listening socket (state 0A) on the port, and its local address.
  std::ifstream table("/proc/net/tcp");
  std::string line, found;
  const std::string hex_port = fmt::format(":{:04X}", port);
  while (std::getline(table, line))
    if (line.find(hex_port + " ") != std::string::npos && line.find(" 0A ") != std::string::npos) found = line;
  ASSERT_FALSE(found.empty()) << "no listener on port " << port;
  EXPECT_NE(found.find("0100007F" + hex_port), std::string::npos) << "listens beyond loopback: " << found;
  std::ifstream table6("/proc/net/tcp6");
  while (std::getline(table6, line)) EXPECT_EQ(line.find(hex_port + " "), std::string::npos) << line;
  EXPECT_THROW(TcpStore("192.0.2.1", next_port(), 0, 2, "", 1s), Error) << "an address of another machine";
}

TEST(Store, StrangersChangeNothing) {
  const int port = next_port();
  TcpStore server("127.0.0.1", port, 0, 2, "", 5s);
  rusage before{};
  ::getrusage(RUSAGE_SELF, &before);
  std::vector<int> strangers;
  strangers.push_back(raw_connect(port));  // connects and closes
  ::close(strangers.back());
  strangers.back() = raw_connect(port);  // garbage
  send_bytes(strangers.back(), "GET / HTTP/1.1\r\nHost: x\r\n\r\n");
  strangers.push_back(raw_connect(port));  // a 5-byte request announcing 1 GiB
  send_bytes(strangers.back(), "H" + u32(1u << 30));
  strangers.push_back(raw_connect(port));  // a set before any hello
  send_bytes(strangers.back(), "S" + u32(6) + "dp/dea" + u32(1) + "x");
  strangers.push_back(raw_connect(port));  // a hello announcing a giant token
  const std::string key = store::hello_key(1, 2);
  send_bytes(strangers.back(), "H" + u32(static_cast<std::uint32_t>(key.size())) + key + u32(1u << 31));
  for (std::size_t i = 1; i < strangers.size(); ++i) EXPECT_TRUE(closed_within(strangers[i], 2s)) << i;
  for (int fd : strangers) ::close(fd);
  for (int i = 0; i < 64; ++i) ::close(raw_connect(port));  // a flood of connect-and-close
  rusage after{};
  ::getrusage(RUSAGE_SELF, &after);
  EXPECT_LT(after.ru_maxrss - before.ru_maxrss, 100 * 1024) << "KiB grown: an announced length was allocated";
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(text_of(server.try_get(TcpStore::kDeadKey)), "(none)");
  EXPECT_EQ(text_of(server.try_get(TcpStore::kRefusedKey)), "(none)");
  TcpStore rank1 = client(port, 1);  // the real process still joins and works
  rank1.set("k", {'v'});
  EXPECT_EQ(text_of(server.try_get("k")), "v");
}

TEST(Store, ASilentConnectionIsDroppedAfterTheHelloTime) {
  const int port = next_port();
  TcpStore server("127.0.0.1", port, 0, 2, "", 5s);
  const int fd = raw_connect(port);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(closed_within(fd, std::chrono::seconds(TcpStore::kHelloSeconds + 3)));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::seconds(TcpStore::kHelloSeconds - 1));
  ::close(fd);
  EXPECT_EQ(text_of(server.try_get(TcpStore::kDeadKey)), "(none)");
}

// A hello has one deadline for the whole message: a connection that trickles a byte every second
// (each recv in time) is still dropped after kHelloSeconds; and slow strangers filling every slot
// cannot keep a process of the job out: the oldest leaves for each newcomer.
TEST(Store, TrickledHellosNeitherHoldASlotNorKeepTheRanksOut) {
  const int port = next_port();
  TcpStore server("127.0.0.1", port, 0, 2, "s3cret", 5s);
  const int trickler = raw_connect(port);
  const auto start = std::chrono::steady_clock::now();
  // A real hello's key, a byte a second: each read in time, the whole far past the deadline.
  const std::string key = store::hello_key(1, 2);
  ASSERT_GT(key.size(), static_cast<std::size_t>(TcpStore::kHelloSeconds + 3));
  send_bytes(trickler, "H" + u32(static_cast<std::uint32_t>(key.size())));
  bool closed = false;
  for (std::size_t i = 0; i < key.size() && !closed; ++i) {
    send_bytes(trickler, key.substr(i, 1));
    closed = closed_within(trickler, 1s);
  }
  EXPECT_TRUE(closed);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(TcpStore::kHelloSeconds + 2));
  ::close(trickler);
  std::vector<int> slow;
  for (int i = 0; i < 16; ++i) {
    slow.push_back(raw_connect(port));
    send_bytes(slow.back(), "H");
  }
  TcpStore rank1 = client(port, 1, 2, "s3cret");  // gets in at once, every slot held
  server.set("k", {'v'});
  EXPECT_EQ(text_of(rank1.try_get("k")), "v");
  for (const int fd : slow) ::close(fd);
}

// The store holds at most kMaxStoredBytes: a process (or a stranger in a free rank slot) that
// stores more is dropped, and the store's memory stays bounded.
TEST(Store, TheStoreIsBounded) {
  const int port = next_port();
  TcpStore server("127.0.0.1", port, 0, 3, "", 5s);
  TcpStore greedy = client(port, 2, 3);
  const std::vector<char> mib(std::size_t{1} << 20, 'x');
  bool dropped = false;
  for (int i = 0; i < 100 && !dropped; ++i) {
    try {
      greedy.set("key" + std::to_string(i), mib);
      (void)greedy.try_get("key0");  // the reply that says whether it was kept
    } catch (const Error&) {
      dropped = true;
    }
  }
  EXPECT_TRUE(dropped);
  TcpStore rank1 = client(port, 1, 3);
  rank1.set("small", {'s'});
  EXPECT_EQ(text_of(server.try_get("small")), "s");
}

TEST(Store, OnlyAProcessThatSaidHelloCanBeDead) {
  const int port = next_port();
  TcpStore server("127.0.0.1", port, 0, 3, "", 5s);
  const int fd = raw_connect(port);
  const std::string key = store::hello_key(2, 3);
  send_bytes(fd, "H" + u32(static_cast<std::uint32_t>(key.size())) + key + u32(0));
  char reply = 0;
  ASSERT_EQ(::recv(fd, &reply, 1, MSG_WAITALL), 1);
  EXPECT_EQ(reply, 'h');
  ::close(fd);  // gone without a goodbye
  for (int i = 0; i < 50 && !server.try_get(TcpStore::kDeadKey); ++i) std::this_thread::sleep_for(20ms);
  EXPECT_EQ(text_of(server.try_get(TcpStore::kDeadKey)), "2");
}

TEST(Store, ADuplicateRankIsRefusedAndTheJobGoesOn) {
  const int port = next_port();
  TcpStore server("127.0.0.1", port, 0, 2, "", 5s);
  TcpStore rank1 = client(port, 1);
  try {
    TcpStore again = client(port, 1);
    FAIL() << "a second RANK=1 joined";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("RANK 1 is already in the job"), std::string::npos) << e.what();
  }
  rank1.set("still", {'o', 'k'});
  EXPECT_EQ(text_of(server.try_get("still")), "ok");
  EXPECT_EQ(text_of(server.try_get(TcpStore::kDeadKey)), "(none)");
}

TEST(Store, AnotherWorldSizeIsRefusedAtOnceOnBothSides) {
  const int port = next_port();
  TcpStore server("127.0.0.1", port, 0, 2, "", 5s);
  const auto start = std::chrono::steady_clock::now();
  try {
    TcpStore other = client(port, 1, 3);
    FAIL() << "WORLD_SIZE 3 joined a job of 2";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("WORLD_SIZE 3, process 0 has 2"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  EXPECT_NE(text_of(server.try_get(TcpStore::kRefusedKey)).find("WORLD_SIZE 3"), std::string::npos);
}

TEST(Store, WithATokenNoOneWithoutItGetsIn) {
  const int port = next_port();
  TcpStore server("127.0.0.1", port, 0, 2, "s3cret", 5s);
  server.set("nccl id", {'x'});
  for (const std::string token : {"", "wrong!"}) {
    try {
      TcpStore stranger = client(port, 1, 2, token);
      FAIL() << "joined with token '" << token << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("DP_JOB_TOKEN differs"), std::string::npos) << e.what();
    }
  }
  // A raw client cannot get a key before a hello, nor forge an abort.
  const int fd = raw_connect(port);
  send_bytes(fd, "G" + u32(7) + "nccl id");
  EXPECT_TRUE(closed_within(fd, 2s));
  ::close(fd);
  TcpStore rank1 = client(port, 1, 2, "s3cret");
  EXPECT_EQ(text_of(rank1.try_get("nccl id")), "x");
}

TEST(Store, AForeignProgramOnMasterPortIsNamed) {
  // A listener that accepts and never answers, then one that answers something else.
  for (const std::string& answer : {std::string(), std::string("HTTP/1.1 400 Bad Request\r\n\r\n")}) {
    const int port = next_port();
    const int listener = raw_listen(port);
    ASSERT_GE(listener, 0);
    std::thread foreign([&] {
      const int fd = ::accept(listener, nullptr, nullptr);
      if (!answer.empty()) send_bytes(fd, answer);
      std::this_thread::sleep_for(3s);
      ::close(fd);
    });
    const auto start = std::chrono::steady_clock::now();
    try {
      TcpStore rank1 = client(port, 1, 2, "", 1s);
      FAIL() << "joined a foreign program";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("is not process 0 of a dp job"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, 2500ms) << "answer '" << answer << "'";
    foreign.join();
    ::close(listener);
  }
}

TEST(Store, RunningOutOfDescriptorsDoesNotEndTheServer) {
#ifdef DP_UBSAN_NEEDS_DESCRIPTORS
  GTEST_SKIP() << "clang's UBSan probes a vtable's memory through a pipe: with no descriptor left it reports "
                  "a false 'invalid vptr' for the server's next thread (runs in the Release and TSan builds)";
#endif
  const int port = next_port();
  TcpStore server("127.0.0.1", port, 0, 2, "", 5s);
  rlimit saved{};
  ::getrlimit(RLIMIT_NOFILE, &saved);
  std::vector<int> held;
  rlimit low = saved;
  low.rlim_cur = static_cast<rlim_t>(::dup(0) + 8);  // a few descriptors above those open now
  ::close(static_cast<int>(low.rlim_cur) - 8);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  for (int fd; (fd = raw_connect(port)) >= 0 && held.size() < 64;) held.push_back(fd);
  std::this_thread::sleep_for(300ms);  // the server's accept meets EMFILE meanwhile
  for (int fd : held) ::close(fd);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
  TcpStore rank1 = client(port, 1);
  rank1.set("after", {'1'});
  EXPECT_EQ(text_of(server.try_get("after")), "1");
}

// A brief request (the processes' beats) gives up on a slow process 0 after its limit, without
// holding the connection, and the next request reads and drops the late answer before its own:
// no request ever gets another's answer. A lowered limit also cuts a request already waiting.
TEST(Store, ABriefRequestGivesUpAndItsLateAnswerIsDropped) {
  const int port = next_port();
  const int listener = raw_listen(port);
  ASSERT_GE(listener, 0);
  // A process 0 that answers in order, each answer `delay` late: the hello at once.
  std::thread slow([&] {
    const int fd = ::accept(listener, nullptr, nullptr);
    const auto bytes = [&](std::size_t n) {
      std::string b(n, '\0');
      return n == 0 || ::recv(fd, b.data(), n, MSG_WAITALL) == static_cast<ssize_t>(n) ? b : std::string();
    };
    const auto blob = [&] {
      std::uint32_t n = 0;
      std::memcpy(&n, bytes(4).data(), 4);
      return bytes(n);
    };
    const auto request = [&] {
      const std::string op = bytes(1);
      const std::string key = blob();
      if (op == "H" || op == "S") (void)blob();
      return op + key;
    };
    EXPECT_EQ(request().substr(0, 1), "H");
    send_bytes(fd, "h" + u32(static_cast<std::uint32_t>(std::strlen(store::kMagic))) + store::kMagic);
    EXPECT_EQ(request(), "Sbeat");  // the brief set: answered 700 ms late
    std::this_thread::sleep_for(700ms);
    send_bytes(fd, "k");
    EXPECT_EQ(request(), "Gx");  // the next request's own
    send_bytes(fd, "f" + u32(5) + "value");
    EXPECT_EQ(request(), "Gy");  // left unanswered: the limit lowered meanwhile ends its wait
    std::this_thread::sleep_for(3s);
    ::close(fd);
  });
  TcpStore rank1 = client(port, 1, 2, "", 10s);
  std::vector<std::optional<std::vector<char>>> values;
  auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(rank1.try_brief("beat", {'1'}, {"dp/beat/0"}, values, 300ms));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 650ms);
  EXPECT_EQ(text_of(rank1.try_get("x")), "value");
  start = std::chrono::steady_clock::now();
  std::thread lower([&] {
    std::this_thread::sleep_for(1500ms);
    rank1.limit_wait(1s);
  });
  EXPECT_THROW((void)rank1.try_get("y"), CollectiveTimeout);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2500ms) << "the lowered limit did not cut the wait";
  lower.join();
  slow.join();
  ::close(listener);
}

TEST(StoreProtocol, HelloKeysAreExact) {
  store::Hello hello;
  EXPECT_TRUE(store::parse_hello_key(store::hello_key(3, 8), hello));
  EXPECT_EQ(hello.rank, 3);
  EXPECT_EQ(hello.world_size, 8);
  for (const std::string bad : {"dp-store 1 3", "dp-store 1 3 8 ", "dp-store 1 -1 8", "dp-store 1 3 0",
                                "dp-store 2 3 8", "dp-store 1 03 8", "dp-store 1 3 +8", ""})
    EXPECT_FALSE(store::parse_hello_key(bad, hello)) << "'" << bad << "'";
}

}  // namespace
}  // namespace dp::detail
