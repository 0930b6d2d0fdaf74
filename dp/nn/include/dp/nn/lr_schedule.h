// dp/nn/lr_schedule.h — learning-rate schedules as torch.optim.lr_scheduler computes them in closed
// form (each scheduler's _get_closed_form_lr), in double as Python does; an optimizer then takes
// the value as float, as torch's fp32 update does. t counts scheduler steps (epochs or optimizer
// steps: the caller's choice, as with torch's scheduler.step()).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace dp {

class LrSchedule {
 public:
  // The base learning rate throughout.
  static LrSchedule constant();
  // StepLR(step_size, gamma): base * gamma^(t // step_size).
  static LrSchedule step(std::int64_t step_size, double gamma = 0.1);
  // CosineAnnealingLR(T_max, eta_min): eta_min + (base - eta_min) * (1 + cos(pi * t / T_max)) / 2.
  static LrSchedule cosine(std::int64_t t_max, double eta_min = 0.0);
  // LinearLR(start_factor, end_factor, total_iters): base * (start + (end - start) * min(total, t) / total),
  // the usual warm-up.
  static LrSchedule linear(double start_factor = 1.0 / 3.0, double end_factor = 1.0, std::int64_t total_iters = 5);
  // SequentialLR(schedulers, milestones): schedules[i] from milestones[i - 1] on, its t restarting at 0
  // there (e.g. linear warm-up, then cosine). milestones: one fewer than schedules, increasing.
  static LrSchedule sequential(std::vector<LrSchedule> schedules, std::vector<std::int64_t> milestones);

  // The learning rate at step t >= 0 for a base learning rate `base_lr`.
  double lr(double base_lr, std::int64_t t) const;

 private:
  explicit LrSchedule(std::function<double(double, std::int64_t)> f) : f_(std::move(f)) {}
  std::function<double(double, std::int64_t)> f_;
};

}  // namespace dp
