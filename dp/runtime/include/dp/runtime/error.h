// dp/runtime/error.h — the exception types every dp entry point throws.
// A library throws (it never aborts the embedding process); destructors never throw.
#pragma once

#include <cstddef>
#include <exception>
#include <stdexcept>
#include <string>

namespace dp {

// Base of every error dp raises. The message is complete on its own: it names the device,
// the request or the file involved, so a caller can print e.what() and exit.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A device allocation that would exceed the device's capacity (sim) or that the driver refused (cuda).
class OutOfMemory : public Error {
 public:
  OutOfMemory(int device, std::size_t requested, std::size_t in_use, std::size_t capacity);
  int device() const noexcept { return device_; }
  std::size_t requested() const noexcept { return requested_; }

 private:
  int device_;
  std::size_t requested_;
};

// An operation touched memory that does not live on the device of the stream it runs on
// (a real GPU faults or reads garbage; the simulator refuses it before it runs).
class DeviceMismatch : public Error {
 public:
  using Error::Error;
};

// An operation that CUDA forbids while a stream is being captured into a graph (a host
// synchronisation, a pageable copy, an allocation, a wait on work outside the capture), or a
// capture that cannot end (a stream forked into it never joined back, an invalidated capture).
class CaptureError : public Error {
 public:
  using Error::Error;
};

// A bad argument or configuration (shape, size, device index, option value).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// Input data that cannot be read as what it should be: a truncated, corrupt or foreign file, an image
// past the decompression-bomb limit. The user's input, as InvalidArgument is (exit code 2).
class DataError : public Error {
 public:
  using Error::Error;
};

// A value that must be finite is NaN or infinite: a diverged model about to be saved, a checkpoint
// holding NaN. Programs map it to "training diverged" (dp_train: exit code 3).
class NonFiniteError : public Error {
 public:
  using Error::Error;
};

// A collective that stopped because its communicator was aborted, after another member (a device
// or a process) failed: a consequence, not a cause. Where several devices failed, DeviceGroup::run
// reports a cause first.
class CollectiveAborted : public Error {
 public:
  using Error::Error;
};

// The ranks issued different collectives at one point of their sequence (a desync: another
// operation, count, dtype, root or purpose), found before the operation ran: the message names the
// ranks, the step, the sequence number, both signatures and both call sites.
class CollectiveMismatch : public Error {
 public:
  using Error::Error;
};

// Another process of the job is gone (ended, killed, unreachable) while this one needed it;
// `process()` is which, where known (-1: not).
class PeerLost : public Error {
 public:
  explicit PeerLost(const std::string& message, int process = -1) : Error(message), process_(process) {}
  int process() const noexcept { return process_; }

 private:
  int process_;
};

// A wait for another device or process passed DP_TIMEOUT_S (the peer may be alive but stuck).
class CollectiveTimeout : public Error {
 public:
  using Error::Error;
};

// A device is gone: on cuda an error that leaves its context unusable (an uncorrectable ECC error,
// an illegal address or launch failure: every later call there fails the same way), on either
// backend a device lost on purpose (Device::lose, DP_FAULT lose@dN). Its memory is gone with it; the
// other devices of the process are untouched.
class DeviceLost : public Error {
 public:
  // `device` -1: the device that failed is the one the failing call ran on (a WorkerError names it).
  DeviceLost(int device, const std::string& message) : Error(message), device_(device) {}
  int device() const noexcept { return device_; }

 private:
  int device_;
};

// The replicas of a model, which must hold the same bits, do not: silent corruption (a bit flipped
// in memory, a faulty unit), found by comparing their fingerprints (EngineOptions::check_replicas).
// The message names the device that differs and the first tensor that does.
class ReplicaMismatch : public Error {
 public:
  using Error::Error;
};

// What DeviceGroup::run throws when work failed on a member: names the device, keeps the cause.
class WorkerError : public Error {
 public:
  WorkerError(int device, const std::string& message, std::exception_ptr cause, int failed_devices);
  int device() const noexcept { return device_; }
  std::exception_ptr cause() const noexcept { return cause_; }
  int failed_devices() const noexcept { return failed_; }

 private:
  int device_;
  std::exception_ptr cause_;
  int failed_;
};

// The exit code a program reports for an error (dp's tools do; docs/training.md's table): 2 for bad
// input or a configuration that does not fit (InvalidArgument, OutOfMemory, a failed host
// allocation), 3 for non-finite values (NonFiniteError), 4 for a desync (CollectiveMismatch), 5 for
// a lost peer (PeerLost), 6 for a timeout (CollectiveTimeout), 7 for a lost device (DeviceLost), 8 for
// replicas that differ (ReplicaMismatch), 1 for anything else. A WorkerError is judged by its
// cause, so a failure on one device of several gets the code it gets on one device.
int exit_code(const std::exception_ptr& error) noexcept;

// The error's what() ("unknown exception" for one that is no std::exception).
std::string message_of(const std::exception_ptr& error);

}  // namespace dp
