// dp_train — trains the reference MLP, ConvNet or ResNet-8 on one device, with DataParallel or with
// DDP, on GPUs or simulated devices; this file runs the command line (train_cli.h) and turns what
// fails into exit codes.
#include <cstdio>
#include <exception>
#include <fmt/format.h>
#include <string>

#include "address_space.h"
#include "dp/runtime/fault.h"
#include "dp/runtime/flight_record.h"
#include "dp_job.h"
#include "exit_codes.h"
#include "flight.h"
#include "train_cli.h"
#include "train_run.h"

namespace dp_train {

int train_main(int argc, char** argv) {
  Options o;
  switch (parse_command_line(argc, argv, o)) {
    case Parsed::help: return g_job.agree(dp::kStopWithoutError).value_or(0);
    case Parsed::refused:  // every bad command line is exit code 2, as bad files are
      return g_job.failed(2);
    case Parsed::run: break;
  }
  dp::tools::FlightContext& flight = dp::tools::flight_context();
  flight.tool = "dp_train";
  flight.process = g_job.processes() ? g_job.processes()->rank() : 0;
  flight.beside = o.save;
  dp::set_stuck_worker_handler(dp::tools::end_with_stuck_worker);
  int code = 0;
  try {
    // The environment's failure settings, refused before any work when malformed (exit 2).
    dp::FaultPlan::from_environment();
    (void)dp::collectives_checked();
    code = run(o);
  } catch (const dp::tools::PeerFailed& e) {
    code = e.code;  // agreed with the others; the failing process said why
  } catch (...) {
    // What failed, naming the process, host and global ranks under mpirun; the exit code of its cause.
    const std::exception_ptr error = std::current_exception();
    const int mine = dp::tools::report_failure("dp_train", g_job.where(error), error);
    if (dp::tools::leaves_flight_record(mine)) dp::tools::write_flight_record(fmt::format("exit code {}", mine));
    code = g_job.failed(mine);
  }
  return code;
}

}  // namespace dp_train

int main(int argc, char** argv) {
  // Line-buffered even into a file or pipe: a run killed (SIGKILL, an OOM kill, a scheduler's time
  // limit) keeps every progress line it printed, not only the 4 KiB blocks already flushed.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  dp::tools::keep_malloc_to_one_arena();
  dp::tools::fail_writes_past_the_file_size_limit();
  // The job first: under mpirun every way out, a bad command line included, goes through the
  // processes' agreement (an early exit would leave the others waiting for this one).
  try {
    dp_train::g_job.start();
  } catch (const std::exception& e) {
    fmt::print(stderr, "dp_train: error: {}\n", e.what());
    return 2;
  }
  const int code = dp_train::train_main(argc, argv);
  dp_train::g_job.end();  // MPI_Finalize, when under mpirun
  return dp::tools::leave(code);
}
