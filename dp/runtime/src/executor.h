// executor.h — a persistent thread that runs tasks in submission order.
// It is the sim backend's stream engine and every backend's per-device worker thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace dp::detail {

class SerialExecutor {
 public:
  using Task = std::function<void()>;

  // `on_start` runs first on the new thread (cuda: make the device current once).
  explicit SerialExecutor(std::string name, Task on_start = {});
  ~SerialExecutor();  // drains the queue, then joins
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  // Returns the ticket of the task: it has run once completed() >= ticket. `after` runs with the
  // completion count, under the executor's lock: it must be short and must not call back into it.
  std::uint64_t post(Task task, Task after = {});
  std::uint64_t completed() const;
  std::uint64_t submitted() const;
  void wait_for(std::uint64_t ticket) const;  // blocks until the task with that ticket has run
  void wait_idle() const;                     // blocks until everything posted so far has run
  bool on_this_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

  // The first exception a task threw (tasks after it still run). Sticky until taken.
  std::exception_ptr take_error();
  bool has_error() const;
  // The first exception any task threw, never cleared; only for the executor's own thread (a task
  // asking whether the work before it failed), which is the only writer.
  std::exception_ptr failure_seen_by_tasks() const { return failure_; }

 private:
  void loop(Task on_start);

  std::string name_;
  mutable std::mutex mutex_;
  mutable std::condition_variable work_cv_;
  mutable std::condition_variable done_cv_;
  std::deque<std::pair<Task, Task>> queue_;
  std::uint64_t submitted_ = 0;
  std::uint64_t completed_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
  std::exception_ptr failure_;  // written by the executor's thread only
  std::thread thread_;
};

}  // namespace dp::detail
