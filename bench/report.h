// report.h — what dp_bench shows of its runs: the tables on standard output, the JSON report and
// the Chrome/Perfetto trace of the measured steps.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "measure.h"
#include "options.h"

namespace dp_bench {

// The job as the JSON report describes it, besides the options and the runs; the members are
// named as the report's keys (report.cpp writes them by name).
struct Setup {
  std::string backend;
  int devices = 0;  // per process
  int processes = 1;
  std::vector<std::string> device_names;
  bool busy_time_available = false;  // records_spans()
  // sim, two or more devices: one cache line's round trip between the host cores of devices 0 and
  // 1, in ns (core_round_trip_ns); 0: not measured.
  double core_round_trip_ns = 0;
};

// Prints the tables, then writes --trace and --json where asked (process 0 alone calls it). The
// trace is laid out first: it assigns each run's trace offset, which the JSON reports.
// `recovery`: the run that lost a device, where DP_FAULT planned it (measure_recovery).
void report(const Options& o, const Setup& setup, std::vector<Run>& runs, const std::optional<Recovery>& recovery);

}  // namespace dp_bench
