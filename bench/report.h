// report.h — what dp_bench shows of its runs: the tables on standard output, the JSON report and
// the Chrome/Perfetto trace of the measured steps.
#pragma once

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
};

// Prints the tables, then writes --trace and --json where asked (process 0 alone calls it). The
// trace is laid out first: it assigns each run's trace offset, which the JSON reports.
void report(const Options& o, const Setup& setup, std::vector<Run>& runs);

}  // namespace dp_bench
