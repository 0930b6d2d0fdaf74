// run_settings.h — what a checkpoint says about the run that saved it (its "dp.<key>" metadata), so
// that --resume, --init and --eval-only continue or evaluate that run without its flags repeated,
// as a PyTorch user's checkpoint dict carries the model's configuration and the optimizer's and
// scheduler's state_dicts (lr, momentum, T_max, ...).
#pragma once

#include <map>
#include <string>

#include "train_options.h"

namespace dp_train {

// The tags --save writes: the model and its input normalisation, the loss, the optimizer's
// hyper-parameters (its kind is the training state's own "dp.optimizer"), and the lr schedule with its resolved T_max
// (`t_max`: what the run's cosine schedule used, --t-max or the run's planned length after warm-up).
std::map<std::string, std::string> run_settings(const Options& o, long t_max);

// Takes from the checkpoint `path` (its metadata `tags`) every setting the command line did not
// give: the model, hidden sizes, normalisation, Dropout and label smoothing always; the optimizer
// kind for --resume and --init; its hyper-parameters and the schedule (T_max, warm-up) for --resume
// only. A given flag that contradicts the checkpoint is refused where the model could not hold it
// (--model, --hidden: unless --init-non-strict) or resume its state (--optimizer), and otherwise
// noted, the given value winning (--lr, --normalize, ...). Says which settings it took.
void adopt_run_settings(Options& o, const std::string& path, const std::map<std::string, std::string>& tags,
                        bool resuming);

}  // namespace dp_train
