// train_run.h — a training run of dp_train from its options: the checks made before any work, and
// run(), which takes the named steps of a run.
#pragma once

#include "train_options.h"

namespace dp_train {

// Every check run() makes before it reads a file or starts a device: the flags' combinations, the
// device choice, the learning rate, the memory the run needs. Throws UsageError.
void check_options(const Options& o);

// Trains (or evaluates, --eval-only) as the options say; returns the exit code of a run that stops
// by itself (3: a non-finite loss), throws what fails (dp_train.cpp turns it into its exit code).
int run(Options o);

}  // namespace dp_train
