// checks.cpp — argument checks of the launchers (see checks.h), with their messages.
#include "checks.h"

#include <climits>
#include <cmath>
#include <fmt/format.h>
#include <limits>

#include "dp/kernels/optimizer.h"
#include "dp/runtime/error.h"
#include "dp/runtime/shape.h"

namespace dp::kernels {

namespace {

std::string describe(const Conv2dShape& s) {
  const std::int64_t x[] = {s.n, s.c_in, s.h, s.w}, weight[] = {s.c_out, s.c_in, s.kh, s.kw};
  return fmt::format("x {}, weight {}, stride {}, pad {}", format_shape(x), format_shape(weight), s.stride, s.pad);
}
std::string describe(const BatchNormShape& s) { return format_dims({{"N", s.n}, {"C", s.c}, {"H", s.h}, {"W", s.w}}); }
std::string describe(const Pool2dShape& s) {
  return format_dims(
      {{"N", s.n}, {"C", s.c}, {"H", s.h}, {"W", s.w}, {"kernel", s.kernel}, {"stride", s.stride}, {"pad", s.pad}});
}

}  // namespace

void validate(const SgdOptions& o) {
  // torch.optim.SGD's constructor checks, with the same meaning; `!(x >= 0)` also rejects NaN, and
  // the learning rate must be finite.
  if (!(o.lr >= 0.0f) || !std::isfinite(o.lr))
    throw InvalidArgument(fmt::format("SGD: invalid learning rate {}", o.lr));
  if (!(o.momentum >= 0.0f)) throw InvalidArgument(fmt::format("SGD: invalid momentum {}", o.momentum));
  if (!(o.weight_decay >= 0.0f)) throw InvalidArgument(fmt::format("SGD: invalid weight_decay {}", o.weight_decay));
  if (o.nesterov && o.momentum == 0.0f)
    throw InvalidArgument("SGD: nesterov momentum requires a momentum > 0 (and zero dampening)");
}

void validate(const AdamWOptions& o) {
  // torch.optim.AdamW's constructor checks, NaN and infinity refused too.
  const auto finite_at_least_0 = [](double v) { return std::isfinite(v) && v >= 0.0; };
  if (!finite_at_least_0(o.lr)) throw InvalidArgument(fmt::format("AdamW: invalid learning rate {}", o.lr));
  if (!finite_at_least_0(o.eps)) throw InvalidArgument(fmt::format("AdamW: invalid epsilon value {}", o.eps));
  if (!(o.beta1 >= 0.0 && o.beta1 < 1.0))
    throw InvalidArgument(fmt::format("AdamW: invalid beta parameter at index 0: {}", o.beta1));
  if (!(o.beta2 >= 0.0 && o.beta2 < 1.0))
    throw InvalidArgument(fmt::format("AdamW: invalid beta parameter at index 1: {}", o.beta2));
  if (!finite_at_least_0(o.weight_decay))
    throw InvalidArgument(fmt::format("AdamW: invalid weight_decay value {}", o.weight_decay));
}

namespace checks {

void adamw_step(std::int64_t step) {
  if (step < 1) throw InvalidArgument(fmt::format("adamw_step: step must be >= 1 (the first is 1), got {}", step));
}

void present(const char* op, NamedPointers pointers) {
  for (const auto& [what, ptr] : pointers)
    if (ptr == nullptr) throw InvalidArgument(fmt::format("{}: {} is null", op, what));
}

void conv2d(const char* op, const Conv2dShape& s) {
  auto fail = [&](const char* why) { throw InvalidArgument(fmt::format("{}: {} for {}", op, why, describe(s))); };
  if (s.n < 0 || s.c_in <= 0 || s.h <= 0 || s.w <= 0 || s.c_out <= 0 || s.kh <= 0 || s.kw <= 0)
    fail("non-positive extent");
  if (s.stride <= 0 || s.pad < 0) fail("stride must be >= 1 and padding >= 0");
  if (s.h + 2 * s.pad < s.kh || s.w + 2 * s.pad < s.kw) fail("kernel larger than the padded input");
}

void conv2d_int_range(const char* op, const Conv2dShape& s, std::int64_t largest_elements) {
  if (largest_elements > INT_MAX)
    throw InvalidArgument(
        fmt::format("{}: im2col path needs every tensor below 2^31 elements (col has {}) for {}; use a smaller batch",
                    op, largest_elements, describe(s)));
}

void batchnorm(const char* op, const BatchNormShape& s, bool training) {
  if (s.n < 0 || s.c < 0 || s.h < 0 || s.w < 0)
    throw InvalidArgument(fmt::format("{}: negative extent in shape {}", op, describe(s)));
  if (training && s.c > 0 && static_cast<std::int64_t>(s.n) * s.h * s.w < 2)
    throw InvalidArgument(
        fmt::format("{}: expected more than 1 value per channel when training, got shape {}", op, describe(s)));
}

void sync_batchnorm_count(const char* op, std::int64_t global_count, std::int64_t local_count) {
  if (global_count < 2 || global_count < local_count || global_count > (std::int64_t{1} << 24))
    throw InvalidArgument(
        fmt::format("{}: {} values per channel over all replicas (this one has {}): need at least "
                    "2, at least this replica's, and at most 2^24 (exact as a float)",
                    op, global_count, local_count));
}

void pool2d(const char* op, const Pool2dShape& s) {
  auto fail = [&](const char* why) { throw InvalidArgument(fmt::format("{}: {} in shape {}", op, why, describe(s))); };
  if (s.n < 0 || s.c < 0 || s.h < 0 || s.w < 0) fail("negative extent");
  if (s.kernel < 1 || s.stride < 1) fail("kernel and stride must be positive");
  if (s.pad < 0 || s.pad > s.kernel / 2) fail("pad must be in [0, kernel/2]");
  if (s.h + 2 * s.pad < s.kernel || s.w + 2 * s.pad < s.kernel) fail("output size is too small");
}

void maxpool(const char* op, const Pool2dShape& s) {
  pool2d(op, s);
  if (static_cast<std::int64_t>(s.h) * s.w > std::numeric_limits<std::int32_t>::max())
    throw InvalidArgument(fmt::format("{}: plane too large for argmax in shape {}", op, describe(s)));
}

void global_avgpool(const char* op, int n, int c, int hw) {
  if (n < 0 || c < 0 || hw < 1)
    throw InvalidArgument(fmt::format("{}: need n, c >= 0 and a non-empty plane, got n={} c={} hw={}", op, n, c, hw));
}

void dropout(const char* op, std::int64_t n, double p, std::int64_t element_offset) {
  // `!(p >= 0 && p <= 1)` also rejects NaN.
  if (!(p >= 0.0 && p <= 1.0))
    throw InvalidArgument(fmt::format("{}: dropout probability has to be between 0 and 1, but got {}", op, p));
  if (n < 0 || element_offset < 0)
    throw InvalidArgument(
        fmt::format("{}: need n >= 0 and element_offset >= 0, got n={} element_offset={}", op, n, element_offset));
}

void linear(const char* op, int n, int in, int out) {
  if (n < 0 || in < 0 || out < 0)
    throw InvalidArgument(fmt::format("{}: negative extent n={} in={} out={}", op, n, in, out));
}

void cross_entropy(const char* op, int n, int classes, int mean_over) {
  if (n < 0 || classes <= 0)
    throw InvalidArgument(fmt::format("{}: need n >= 0 and classes > 0, got n={} classes={}", op, n, classes));
  if (mean_over <= 0) throw InvalidArgument(fmt::format("{}: mean_over must be > 0, got {}", op, mean_over));
}

void label_smoothing(const char* op, double label_smoothing) {
  if (!(label_smoothing >= 0.0 && label_smoothing <= 1.0))
    throw InvalidArgument(fmt::format("{}: label_smoothing must be between 0.0 and 1.0, got {}", op, label_smoothing));
}

void bad_target(const char* op, std::int64_t target, std::int64_t sample, int classes) {
  throw InvalidArgument(fmt::format("{}: target {} of sample {} is outside [0, {})", op, target, sample, classes));
}

void sgd_buffer(std::int64_t n, float momentum, const float* buffer) {
  if (momentum != 0.0f && buffer == nullptr && n > 0)
    throw InvalidArgument(fmt::format("sgd_step: momentum {} needs a momentum buffer", momentum));
}

}  // namespace checks
}  // namespace dp::kernels
