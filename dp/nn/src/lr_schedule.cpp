// lr_schedule.cpp — torch's closed forms, written in its evaluation order (each product and
// quotient rounded where Python rounds it), so the values match torch's bit for bit.
#include "dp/nn/lr_schedule.h"

#include <cmath>
#include <fmt/format.h>
#include <numbers>

#include "dp/runtime/error.h"

namespace dp {

LrSchedule LrSchedule::constant() {
  return LrSchedule([](double base, std::int64_t) { return base; });
}

LrSchedule LrSchedule::step(std::int64_t step_size, double gamma) {
  if (step_size < 1) throw InvalidArgument(fmt::format("StepLR: step_size must be >= 1, got {}", step_size));
  if (!std::isfinite(gamma) || gamma < 0.0) throw InvalidArgument(fmt::format("StepLR: invalid gamma {}", gamma));
  return LrSchedule([=](double base, std::int64_t t) {
    return base * std::pow(gamma, static_cast<double>(t / step_size));  // base_lr * gamma ** (t // step_size)
  });
}

LrSchedule LrSchedule::cosine(std::int64_t t_max, double eta_min) {
  if (t_max < 1) throw InvalidArgument(fmt::format("CosineAnnealingLR: T_max must be >= 1, got {}", t_max));
  if (!std::isfinite(eta_min) || eta_min < 0.0)
    throw InvalidArgument(fmt::format("CosineAnnealingLR: invalid eta_min {}", eta_min));
  return LrSchedule([=](double base, std::int64_t t) {
    // eta_min + (base_lr - eta_min) * (1 + math.cos(math.pi * t / T_max)) / 2
    return eta_min + (base - eta_min) *
                         (1.0 + std::cos(std::numbers::pi * static_cast<double>(t) / static_cast<double>(t_max))) / 2.0;
  });
}

LrSchedule LrSchedule::linear(double start_factor, double end_factor, std::int64_t total_iters) {
  // torch.optim.lr_scheduler.LinearLR's own checks.
  if (!(start_factor > 0.0 && start_factor <= 1.0))
    throw InvalidArgument(fmt::format("LinearLR: start_factor must be in (0, 1], got {}", start_factor));
  if (!(end_factor >= 0.0 && end_factor <= 1.0))
    throw InvalidArgument(fmt::format("LinearLR: end_factor must be in [0, 1], got {}", end_factor));
  if (total_iters < 1) throw InvalidArgument(fmt::format("LinearLR: total_iters must be >= 1, got {}", total_iters));
  return LrSchedule([=](double base, std::int64_t t) {
    // base_lr * (start + (end - start) * min(total_iters, t) / total_iters)
    return base * (start_factor + (end_factor - start_factor) * static_cast<double>(std::min(total_iters, t)) /
                                      static_cast<double>(total_iters));
  });
}

LrSchedule LrSchedule::sequential(std::vector<LrSchedule> schedules, std::vector<std::int64_t> milestones) {
  if (schedules.empty() || milestones.size() + 1 != schedules.size())
    throw InvalidArgument(fmt::format("SequentialLR: {} schedules need {} milestones, got {}", schedules.size(),
                                      schedules.empty() ? 0 : schedules.size() - 1, milestones.size()));
  for (std::size_t i = 0; i < milestones.size(); ++i)
    if (milestones[i] < 1 || (i > 0 && milestones[i] <= milestones[i - 1]))
      throw InvalidArgument("SequentialLR: milestones must be >= 1 and increasing");
  return LrSchedule(
      [schedules = std::move(schedules), milestones = std::move(milestones)](double base, std::int64_t t) {
        // bisect_right(milestones, t): the schedule whose span holds t; its own t starts at the milestone.
        std::size_t i = 0;
        while (i < milestones.size() && milestones[i] <= t) ++i;
        return schedules[i].lr(base, i == 0 ? t : t - milestones[i - 1]);
      });
}

double LrSchedule::lr(double base_lr, std::int64_t t) const {
  if (t < 0) throw InvalidArgument(fmt::format("learning-rate schedule at step {}", t));
  return f_(base_lr, t);
}

}  // namespace dp
