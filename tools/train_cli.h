// train_cli.h — dp_train's command line: its flags (a table: tools/flags.h), their checks and each
// optimizer's defaults, read into Options (the checks that need the whole configuration are
// run()'s: train_run.h).
#pragma once

#include <string>
#include <vector>

#include "flags.h"
#include "train_options.h"

namespace dp_train {

enum class Parsed {
  run,      // Options are filled in
  help,     // --help: printed, nothing to run
  refused,  // a bad command line: the message naming the flag is printed
};
Parsed parse_command_line(int argc, const char* const* argv, Options& o);

// Every flag of dp_train, in --help's order (the flags a checkpoint records in the order
// run_settings() takes them back).
const std::vector<dp::tools::FlagGroup<Options>>& train_flags();

// The models that take an argument, for a refusal: "resnet18 or resnet34".
std::string models_taking(dp::models::ModelArg arg);
// Why the command line gives a flag of a model argument (its table's model_arg: --hidden, --heads)
// that --model does not take ("--heads applies to --model gpt"), or "".
std::string misapplied_model_flag(const Options& o);

}  // namespace dp_train
