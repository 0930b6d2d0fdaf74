// dp_train — trains the reference MLP, ConvNet or ResNet-8 on one device, with DataParallel or with
// DDP, on GPUs or simulated devices; this file runs the command line (train_cli.h) and turns what
// fails into exit codes.
#include <cstdio>
#include <exception>
#include <fmt/format.h>
#include <string>

#include "address_space.h"
#include "dp_job.h"
#include "exit_codes.h"
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
  int code = 0;
  try {
    code = run(o);
  } catch (const dp::tools::PeerFailed& e) {
    code = e.code;  // agreed with the others; the failing process said why
  } catch (...) {
    // What failed, naming the process, host and global ranks under mpirun; the exit code of its cause.
    const std::exception_ptr error = std::current_exception();
    code = g_job.failed(dp::tools::report_failure("dp_train", g_job.where(error), error));
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
