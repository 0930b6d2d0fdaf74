// test_lr_schedule.cpp — dp::LrSchedule against torch.optim.lr_scheduler's closed forms, bit for bit
// as the float an optimizer uses (goldens: tests/golden/make_lr_goldens.py), and its refusals.
#include <cmath>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dp/io/safetensors.h"
#include "dp/nn/lr_schedule.h"
#include "dp/runtime/error.h"
#include "test_util.h"

namespace dp {
namespace {

TEST(LrSchedule, MatchesTorchClosedFormsBitForBit) {
  const auto golden = safetensors::read(test::golden_path("lr_schedules"));
  const auto params = [&](const std::string& name) { return nlohmann::json::parse(golden.metadata.at(name)); };
  const auto expect_case = [&](const std::string& name, const LrSchedule& schedule) {
    const auto want = golden.at(name).to_f32();
    const double base = params(name).at("base");
    ASSERT_FALSE(want.empty());
    for (std::size_t t = 0; t < want.size(); ++t)
      EXPECT_EQ(static_cast<float>(schedule.lr(base, static_cast<std::int64_t>(t))), want[t]) << name << " t=" << t;
  };
  const auto step = params("step"), cosine = params("cosine"), linear = params("linear"),
             warm = params("warmup_cosine");
  expect_case("step", LrSchedule::step(step.at("step_size"), step.at("gamma")));
  expect_case("cosine", LrSchedule::cosine(cosine.at("t_max"), cosine.at("eta_min")));
  expect_case("linear",
              LrSchedule::linear(linear.at("start_factor"), linear.at("end_factor"), linear.at("total_iters")));
  expect_case("warmup_cosine",
              LrSchedule::sequential({LrSchedule::linear(warm.at("start_factor"), 1.0, warm.at("total_iters")),
                                      LrSchedule::cosine(warm.at("t_max"))},
                                     {warm.at("milestone")}));
}

TEST(LrSchedule, ClosedFormsByHand) {
  EXPECT_EQ(LrSchedule::constant().lr(0.3, 1000), 0.3);
  EXPECT_DOUBLE_EQ(LrSchedule::step(2, 0.5).lr(1.0, 5), 0.25);         // 0.5^(5 // 2)
  EXPECT_DOUBLE_EQ(LrSchedule::cosine(4).lr(1.0, 2), 0.5);             // halfway down
  EXPECT_NEAR(LrSchedule::cosine(4, 0.1).lr(1.0, 4), 0.1, 1e-15);      // at T_max: eta_min
  EXPECT_DOUBLE_EQ(LrSchedule::linear(0.5, 1.0, 4).lr(2.0, 2), 1.5);   // 2 * (0.5 + 0.5 * 2 / 4)
  EXPECT_DOUBLE_EQ(LrSchedule::linear(0.5, 1.0, 4).lr(2.0, 99), 2.0);  // held at end_factor
}

TEST(LrSchedule, RefusesWhatTorchRefuses) {
  EXPECT_THROW(LrSchedule::step(0), InvalidArgument);
  EXPECT_THROW(LrSchedule::step(3, std::nan("")), InvalidArgument);
  EXPECT_THROW(LrSchedule::cosine(0), InvalidArgument);
  EXPECT_THROW(LrSchedule::linear(0.0), InvalidArgument) << "start_factor must be > 0";
  EXPECT_THROW(LrSchedule::linear(0.5, 1.5), InvalidArgument);
  EXPECT_THROW(LrSchedule::linear(0.5, 1.0, 0), InvalidArgument);
  EXPECT_THROW(LrSchedule::sequential({LrSchedule::constant(), LrSchedule::constant()}, {}), InvalidArgument);
  EXPECT_THROW(LrSchedule::sequential({LrSchedule::constant(), LrSchedule::constant(), LrSchedule::constant()}, {5, 5}),
               InvalidArgument);
  EXPECT_THROW(LrSchedule::constant().lr(0.1, -1), InvalidArgument);
}

}  // namespace
}  // namespace dp
