// loss.cu — launchers for dp/kernels/loss.h: one thread per sample, then a split reduction for the mean.
// On sim, invalid targets are also reported as an error by the stream (see CheckTargets).
#include "checks.h"
#include "dp/kernels/launch.h"
#include "dp/kernels/loss.h"

namespace dp::kernels {
namespace {

// sim only: a kernel cannot throw, but the simulated stream can fail like a faulting kernel.
// Runs on the stream thread because the targets are device memory that only stream-ordered work
// may read. It is queued after the kernels (which write NaN for a bad sample rather than index
// out of bounds), so what they write does not depend on when the failure is noticed: a launch
// on a stream that has already failed would be refused.
struct CheckTargets {
  const char* op;
  const std::int64_t* targets;
  index_t n;
  int classes;
  void operator()() const {
    for (index_t i = 0; i < n; ++i)
      if (targets[i] < 0 || targets[i] >= classes) checks::bad_target(op, targets[i], i, classes);
  }
};

// Queued last; the launches before it have checked the targets operand.
void check_targets_on_sim(const Stream& stream, const char* op, int n, int classes, const std::int64_t* targets) {
  if (stream.backend() == Backend::sim && n > 0)
    kernel_api::enqueue_host(stream, op, CheckTargets{op, targets, n, classes});
}

}  // namespace

void cross_entropy_forward(const Stream& stream, int n, int classes, const float* logits, const std::int64_t* targets,
                           float* per_sample, float* loss) {
  const char* op = "cross_entropy_forward";
  checks::cross_entropy(op, n, classes);
  const index_t elements = static_cast<index_t>(n) * classes;
  // All operands up front: a bad call queues nothing, not a kernel without its reduction.
  check_operands(stream, op,
                 {operand(logits, elements), operand(targets, n), operand(per_sample, n), operand(loss, 1)});
  launch(stream, op, n, CrossEntropyRow{logits, targets, classes, per_sample},
         {operand(logits, elements), operand(targets, n), operand(per_sample, n)});
  launch_row_reduce<float>(stream, "cross_entropy_mean", 1, n, PerSampleTerm{per_sample},
                           StoreMean{loss, static_cast<float>(n)}, {operand(per_sample, n), operand(loss, 1)});
  check_targets_on_sim(stream, op, n, classes, targets);
}

void cross_entropy_backward(const Stream& stream, int n, int classes, const float* logits, const std::int64_t* targets,
                            float dloss, int mean_over, float* dlogits) {
  const char* op = "cross_entropy_backward";
  checks::cross_entropy(op, n, classes, mean_over);
  const index_t elements = static_cast<index_t>(n) * classes;
  launch(stream, op, n,
         CrossEntropyBackwardRow{logits, targets, classes, dloss / static_cast<float>(mean_over), dlogits},
         {operand(logits, elements), operand(targets, n), operand(dlogits, elements)});
  check_targets_on_sim(stream, op, n, classes, targets);
}

}  // namespace dp::kernels
