// train_cli.h — dp_train's command line: its flags, their checks and each optimizer's defaults,
// read into Options (the checks that need the whole configuration are run()'s: train_run.h).
#pragma once

#include "train_run.h"

namespace dp_train {

enum class Parsed {
  run,      // Options are filled in
  help,     // --help: printed, nothing to run
  refused,  // a bad command line: the message naming the flag is printed
};
Parsed parse_command_line(int argc, const char* const* argv, Options& o);

}  // namespace dp_train
