// executor.cpp — SerialExecutor: one thread, one FIFO, completion tickets.
#include "executor.h"

#include <pthread.h>
#include <utility>

namespace dp::detail {

SerialExecutor::SerialExecutor(std::string name, Task on_start) : name_(std::move(name)) {
  thread_ = std::thread([this, start = std::move(on_start)]() mutable { loop(std::move(start)); });
}

SerialExecutor::~SerialExecutor() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::uint64_t SerialExecutor::post(Task task, Task after) {
  std::uint64_t ticket;
  {
    std::lock_guard lock(mutex_);
    queue_.emplace_back(std::move(task), std::move(after));
    ticket = ++submitted_;
  }
  work_cv_.notify_one();
  return ticket;
}

std::uint64_t SerialExecutor::completed() const {
  std::lock_guard lock(mutex_);
  return completed_;
}

std::uint64_t SerialExecutor::submitted() const {
  std::lock_guard lock(mutex_);
  return submitted_;
}

void SerialExecutor::wait_for(std::uint64_t ticket) const {
  std::unique_lock lock(mutex_);
  done_cv_.wait(lock, [&] { return completed_ >= ticket; });
}

void SerialExecutor::wait_idle() const {
  std::unique_lock lock(mutex_);
  const std::uint64_t target = submitted_;
  done_cv_.wait(lock, [&] { return completed_ >= target; });
}

std::exception_ptr SerialExecutor::take_error() {
  std::lock_guard lock(mutex_);
  return std::exchange(error_, nullptr);
}

bool SerialExecutor::has_error() const {
  std::lock_guard lock(mutex_);
  return error_ != nullptr;
}

void SerialExecutor::loop(Task on_start) {
  // Named so that top -H, perf and gdb tell the streams and workers apart (the kernel keeps 15 bytes).
  pthread_setname_np(pthread_self(), name_.substr(0, 15).c_str());
  if (on_start) {
    try {
      on_start();
    } catch (...) {
      std::lock_guard lock(mutex_);
      error_ = std::current_exception();
    }
  }
  for (;;) {
    Task task, after;
    {
      std::unique_lock lock(mutex_);
      work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front().first);
      after = std::move(queue_.front().second);
      queue_.pop_front();
    }
    try {
      task();
    } catch (...) {
      if (!failure_) failure_ = std::current_exception();
      std::lock_guard lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
    task = nullptr;  // release captures before announcing completion
    {
      // `after` (an event's completion) runs in the same critical section as the count, so a
      // host that sees either one also sees the other.
      std::lock_guard lock(mutex_);
      ++completed_;
      if (after) after();
    }
    done_cv_.notify_all();
  }
}

}  // namespace dp::detail
