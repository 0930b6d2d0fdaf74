// loss.cu — launchers for dp/kernels/loss.h: one thread per sample, then a split reduction for the mean
// (of the per-sample terms, or of torch's two label-smoothing terms as a pair).
// On sim, invalid targets are also reported as an error by the stream (see CheckTargets).
#include "checks.h"
#include "dp/kernels/detail/launch.h"
#include "dp/kernels/loss.h"

namespace dp::kernels {
namespace {
// n >= 0 and classes > 0; mean_over > 0 (when given, backward).
void check_cross_entropy(const char* op, int n, int classes, int mean_over = 1) {
  if (n < 0 || classes <= 0) checks::fail({op, ": need n >= 0 and classes > 0, got n=", n, " classes=", classes});
  if (mean_over <= 0) checks::fail({op, ": mean_over must be > 0, got ", mean_over});
}
// label_smoothing in [0, 1] (torch's check).
void check_label_smoothing(const char* op, double label_smoothing) {
  if (!(label_smoothing >= 0.0 && label_smoothing <= 1.0))
    checks::fail({op, ": label_smoothing must be between 0.0 and 1.0, got ", label_smoothing});
}
// A target outside [0, classes) (sim reports it from the stream).
[[noreturn]] void bad_target(const char* op, std::int64_t target, std::int64_t sample, int classes) {
  checks::fail({op, ": target ", target, " of sample ", sample, " is outside [0, ", classes, ")"});
}
}  // namespace

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
      if (targets[i] < 0 || targets[i] >= classes) bad_target(op, targets[i], i, classes);
  }
};

// Queued last; the launches before it have checked the targets operand.
void check_targets_on_sim(const Stream& stream, const char* op, int n, int classes, const std::int64_t* targets) {
  if (stream.backend() == Backend::sim && n > 0)
    kernel_api::enqueue_host(stream, op, CheckTargets{op, targets, n, classes});
}

}  // namespace

void cross_entropy_forward(const Stream& stream, int n, int classes, const float* logits, const std::int64_t* targets,
                           float* per_sample, float* loss, double label_smoothing) {
  const char* op = "cross_entropy_forward";
  check_cross_entropy(op, n, classes);
  check_label_smoothing(op, label_smoothing);
  const index_t elements = static_cast<index_t>(n) * classes;
  // All operands up front: a bad call queues nothing, not a kernel without its reduction.
  check_operands(stream, op,
                 {operand(logits, elements), operand(targets, n), operand(per_sample, n), operand(loss, 1)});
  if (label_smoothing == 0.0) {
    launch(stream, op, n, CrossEntropyRow{logits, targets, classes, per_sample},
           {operand(logits, elements), operand(targets, n), operand(per_sample, n)});
    launch_row_reduce<float>(stream, "cross_entropy_mean", 1, n, PerSampleTerm{per_sample},
                             StoreMean{loss, static_cast<float>(n)}, {operand(per_sample, n), operand(loss, 1)});
  } else {
    // torch's factors: Python-double arithmetic, rounded to float when they meet a float tensor.
    const float one_minus_eps = static_cast<float>(1.0 - label_smoothing);
    const float eps_over_classes = static_cast<float>(label_smoothing / classes);
    launch(stream, op, n,
           SmoothedCrossEntropyRow{logits, targets, classes, one_minus_eps, eps_over_classes, per_sample},
           {operand(logits, elements), operand(targets, n), operand(per_sample, n)});
    launch_row_reduce<SmoothedTerms>(stream, "cross_entropy_mean", 1, n,
                                     SmoothedTermsOfSample{logits, targets, classes},
                                     StoreSmoothedMean{loss, static_cast<float>(n), one_minus_eps, eps_over_classes},
                                     {operand(logits, elements), operand(targets, n), operand(loss, 1)});
  }
  check_targets_on_sim(stream, op, n, classes, targets);
}

void cross_entropy_backward(const Stream& stream, int n, int classes, const float* logits, const std::int64_t* targets,
                            float dloss, int mean_over, float* dlogits, double label_smoothing) {
  const char* op = "cross_entropy_backward";
  check_cross_entropy(op, n, classes, mean_over);
  check_label_smoothing(op, label_smoothing);
  const index_t elements = static_cast<index_t>(n) * classes;
  // The target distribution's two values, in double then rounded once: exactly 1 and 0 when eps = 0.
  const double off = label_smoothing / classes;
  launch(stream, op, n,
         CrossEntropyBackwardRow{logits, targets, classes, dloss / static_cast<float>(mean_over),
                                 static_cast<float>(1.0 - label_smoothing + off), static_cast<float>(off), dlogits},
         {operand(logits, elements), operand(targets, n), operand(dlogits, elements)});
  check_targets_on_sim(stream, op, n, classes, targets);
}

void cross_entropy_forward_backward(const Stream& stream, int n, int classes, In logits, const std::int64_t* targets,
                                    float* per_sample, float* loss, float dloss, int mean_over, Out dlogits,
                                    double label_smoothing) {
  const char* op = "cross_entropy_forward_backward";
  check_cross_entropy(op, n, classes, mean_over);
  check_label_smoothing(op, label_smoothing);
  checks::same_storage(op, {logits.bf16, dlogits.bf16});
  const index_t elements = static_cast<index_t>(n) * classes;
  // The factors of both entry points, computed as they compute them.
  const float scale = dloss / static_cast<float>(mean_over);
  const double off = label_smoothing / classes;
  const float target_on = static_cast<float>(1.0 - label_smoothing + off), target_off = static_cast<float>(off);
  with_storage(logits.bf16, [&](auto storage) {
    using T = decltype(storage);
    const T* x = logits.as<T>();
    T* dx = dlogits.as<T>();
    if (label_smoothing == 0.0) {
      launch_row_reduce<float>(
          stream, op, 1, n,
          CrossEntropyForwardBackwardTerm<T>{x, targets, classes, scale, target_on, target_off, per_sample, dx},
          StoreMean{loss, static_cast<float>(n)},
          {operand(x, elements), operand(targets, n), operand(per_sample, n), operand(loss, 1), operand(dx, elements)});
    } else {
      const float one_minus_eps = static_cast<float>(1.0 - label_smoothing);
      const float eps_over_classes = static_cast<float>(label_smoothing / classes);
      launch_row_reduce<SmoothedTerms>(
          stream, op, 1, n,
          SmoothedCrossEntropyForwardBackwardTerm<T>{x, targets, classes, one_minus_eps, eps_over_classes, scale,
                                                     target_on, target_off, per_sample, dx},
          StoreSmoothedMean{loss, static_cast<float>(n), one_minus_eps, eps_over_classes},
          {operand(x, elements), operand(targets, n), operand(per_sample, n), operand(loss, 1), operand(dx, elements)});
    }
  });
  check_targets_on_sim(stream, op, n, classes, targets);
}

}  // namespace dp::kernels
