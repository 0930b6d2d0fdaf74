// flight.h — the tools' side of the flight record (dp/runtime/flight_record.h): on an abnormal end
// (a desync, a timeout, a lost peer, a device stuck for good, an internal failure of a job that ran
// collectives) each process writes its record, dp-flight-<process>.json, into DP_FLIGHT_DIR (else
// beside --save, else the working directory) and prints one line naming where each device stands.
// scripts/flight_record.py merges the processes' files into one table. Header-only.
#pragma once

#include <cstdio>
#include <exception>
#include <filesystem>
#include <fmt/format.h>
#include <string>

#include "dp/io/atomic_file.h"
#include "dp/runtime/device_group.h"
#include "dp/runtime/error.h"
#include "dp/runtime/flight_record.h"

namespace dp::tools {

struct FlightContext {
  const char* tool = "dp";
  int process = 0;
  std::string beside;  // --save, whose directory holds the record without DP_FLIGHT_DIR
};

inline FlightContext& flight_context() {
  static FlightContext context;
  return context;
}

// Whether an end with `code` (dp::exit_code's) leaves a record: not for bad input (2), a diverged
// run (3) or success; and only once collectives were issued.
inline bool leaves_flight_record(int code) {
  return code != 0 && code != 2 && code != 3 && !FlightRecorder::process().entries().empty();
}

// Writes the record and prints where it is and its summary; never throws.
inline void write_flight_record(std::string_view reason) noexcept {
  const FlightContext& c = flight_context();
  try {
    const std::filesystem::path save(c.beside);
    const std::string dir = flight_dir(c.beside.empty() ? std::string() : save.parent_path().string());
    const std::string path =
        (std::filesystem::path(dir.empty() ? "." : dir) / fmt::format("dp-flight-{}.json", c.process)).string();
    const FlightRecorder& record = FlightRecorder::process();
    write_atomically(path, record.json(c.process, reason));
    std::fprintf(stderr, "%s: flight record of process %d: %s; %s\n", c.tool, c.process, path.c_str(),
                 record.summary(c.process).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: the flight record could not be written: %s\n", c.tool, e.what());
  }
}

// DeviceGroup's stuck-worker handler for the tools: the failure, the record, the failure's code.
[[noreturn]] inline void end_with_stuck_worker(const std::exception_ptr& failure, const std::string& stuck) {
  const std::string what = message_of(failure);
  std::fprintf(stderr, "%s: error: %s; %s does not return (stuck for good): ending the process\n",
               flight_context().tool, what.c_str(), stuck.c_str());
  write_flight_record(fmt::format("{}; {} stuck", what, stuck));
  std::fflush(nullptr);
  std::_Exit(exit_code(failure));
}

}  // namespace dp::tools
