// train_parts.cpp — the pieces dp_train's steps are made of (see train_parts.h): each works alone,
// so that the steps read as the run's order of events.
#include "train_parts.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <sstream>
#include <sys/resource.h>
#include <unistd.h>

#include "address_space.h"
#include "dp/io/image_folder.h"
#include "dp/io/text.h"
#include "dp/models/registry.h"
#include "dp/runtime/device.h"

namespace dp_train {
namespace {

// a * b, or UsageError naming `what` when it does not fit in 64 bits.
std::uint64_t times(std::uint64_t a, std::uint64_t b, const char* what) {
  std::uint64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) throw UsageError(fmt::format("{} does not fit in 64 bits", what));
  return out;
}
std::uint64_t plus(std::uint64_t a, std::uint64_t b, const char* what) {
  std::uint64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) throw UsageError(fmt::format("{} does not fit in 64 bits", what));
  return out;
}

std::string gib(std::uint64_t bytes) { return fmt::format("{:.1f} GiB", static_cast<double>(bytes) / (1u << 30)); }

// The threads a run starts on `devices` devices: each device's streams, and a training and an
// evaluation loader per device with their --workers.
std::uint64_t run_threads(const Options& o, std::uint64_t devices) {
  return devices * (dp::tools::kThreadsPerSimDevice + 2 * (1 + static_cast<std::uint64_t>(o.workers)));
}

}  // namespace

std::vector<int> parse_int_list(const std::string& text, const char* flag) {
  std::vector<int> out;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t comma = text.find(',', pos);
    const std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    try {
      std::size_t used = 0;
      const int value = std::stoi(item, &used);
      if (used != item.size()) throw std::invalid_argument(item);
      out.push_back(value);
    } catch (const std::exception&) {
      throw UsageError(fmt::format("{} '{}': '{}' is not an integer", flag, text, item));
    }
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

double lr_at(const Options& o, int world, long step, const dp::LrSchedule& schedule) {
  const double target = o.scale_lr ? o.lr * world : o.lr;
  if (o.warmup_steps <= 0 || step >= o.warmup_steps) return schedule.lr(target, step - std::max(0L, o.warmup_steps));
  const double start = o.scale_lr ? o.lr : target / static_cast<double>(o.warmup_steps);
  return start + (target - start) * static_cast<double>(step) / static_cast<double>(o.warmup_steps);
}

dp::OptimizerOptions optimizer_options(const Options& o, double lr) {
  if (o.optimizer == dp::tools::OptimizerKind::adamw)
    return dp::AdamWOptions{lr, o.beta1, o.beta2, o.eps, o.weight_decay};
  return dp::SgdOptions{static_cast<float>(lr), o.momentum, static_cast<float>(o.weight_decay), o.nesterov};
}

long resolved_t_max(const Options& o, long last_step) {
  return o.t_max.value_or(std::max(1L, last_step - std::max(0L, o.warmup_steps)));
}

dp::LrSchedule make_schedule(const Options& o, long last_step) {
  try {
    if (o.schedule == Schedule::step) return dp::LrSchedule::step(o.step_size, o.gamma);
    if (o.schedule == Schedule::cosine) return dp::LrSchedule::cosine(resolved_t_max(o, last_step), o.eta_min);
    return dp::LrSchedule::constant();
  } catch (const dp::Error& e) {
    throw UsageError(fmt::format("--schedule {}: {}", to_string(o.schedule), e.what()));
  }
}

void check_schedule(const Options& o, int world, long end_step, const dp::LrSchedule& schedule) {
  const double last = lr_at(o, world, end_step - 1, schedule);
  if (!(std::fabs(last) <= std::numeric_limits<float>::max()))
    throw UsageError(
        fmt::format("--schedule {}: the learning rate of step {} would be {:g}, past the largest float "
                    "({:g}): a smaller --gamma or fewer steps",
                    to_string(o.schedule), end_step, last, std::numeric_limits<float>::max()));
}

std::string ids_of(const std::vector<int>& v) { return fmt::format("{}", fmt::join(v, ",")); }

namespace {

// A comma list of finite floats, or nothing when it is not one.
std::optional<std::vector<float>> parse_floats(const std::string& text) {
  std::vector<float> values;
  std::size_t begin = 0;
  try {
    for (;;) {
      const std::size_t comma = text.find(',', begin);
      const std::string item = text.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
      std::size_t used = 0;
      const float v = std::stof(item, &used);
      if (item.empty() || used != item.size() || !std::isfinite(v)) return std::nullopt;
      values.push_back(v);
      if (comma == std::string::npos) return values;
      begin = comma + 1;
    }
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace

Normalization parse_normalize(const std::string& text) {
  const std::size_t slash = text.find('/');
  std::optional<std::vector<float>> mean, std;
  if (slash == std::string::npos) {
    const auto both = parse_floats(text);
    if (both && both->size() == 2) mean = {{(*both)[0]}}, std = {{(*both)[1]}};
  } else {
    mean = parse_floats(text.substr(0, slash));
    std = parse_floats(text.substr(slash + 1));
  }
  const bool stds_positive = std && std::all_of(std->begin(), std->end(), [](float v) { return v > 0.0f; });
  if (!mean || !std || mean->size() != std->size() || !stds_positive)
    throw UsageError(fmt::format(
        "--normalize '{}': expected MEAN,STD or MEANS/STDS (as many of each, e.g. 0.485,0.456,0.406/0.229,0.224,0.225)"
        " with finite means and stds > 0",
        text));
  return Normalization{*mean, *std};
}

Normalization Normalization::for_channels(std::size_t channels) const {
  if (mean.size() == channels) return *this;
  if (mean.size() == 1)
    return Normalization{std::vector<float>(channels, mean[0]), std::vector<float>(channels, std[0])};
  throw UsageError(
      fmt::format("--normalize gives {} means and stds; the images have {} channel(s)", mean.size(), channels));
}

std::string duration_text(double seconds) {
  if (seconds < 60) return fmt::format("{:.1f} s", seconds);
  const auto whole = static_cast<long>(seconds + 0.5);
  if (whole < 3600) return fmt::format("{}m {:02}s", whole / 60, whole % 60);
  return fmt::format("{}h {:02}m", whole / 3600, (whole % 3600) / 60);
}

double since(std::chrono::steady_clock::time_point from) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - from).count();
}

MetricsLog::~MetricsLog() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsLog::write(const nlohmann::json& record) {
  if (path_.empty()) return;
  if (fd_ < 0) {
    // O_NOFOLLOW and O_NONBLOCK: a symbolic link or a FIFO put there since the checks is refused,
    // never followed or waited on.
    fd_ = ::open(path_.c_str(),
                 O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | (append_ ? 0 : O_TRUNC), 0644);
    if (fd_ < 0) throw dp::Error(fmt::format("--metrics-json {}: cannot open ({})", path_, std::strerror(errno)));
  }
  const std::string line = record.dump() + "\n";
  if (::write(fd_, line.data(), line.size()) != static_cast<ssize_t>(line.size()))
    throw dp::Error(fmt::format("--metrics-json {}: write failed ({})", path_, std::strerror(errno)));
}

int sample_token(std::span<const float> logits, double temperature, int top_k, double u) {
  const std::size_t n = logits.size();
  double cutoff = -std::numeric_limits<double>::infinity();
  if (top_k > 0 && static_cast<std::size_t>(top_k) < n) {
    std::vector<float> sorted(logits.begin(), logits.end());
    std::nth_element(sorted.begin(), sorted.begin() + (top_k - 1), sorted.end(), std::greater<>());
    cutoff = sorted[static_cast<std::size_t>(top_k - 1)];
  }
  const double top = *std::max_element(logits.begin(), logits.end());
  std::vector<double> weights(n, 0.0);
  double total = 0.0;
  for (std::size_t i = 0; i < n; ++i)
    if (logits[i] >= cutoff) total += weights[i] = std::exp((logits[i] - top) / temperature);
  double below = 0.0;
  std::size_t last = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (weights[i] == 0.0) continue;
    below += weights[i] / total;
    last = i;
    if (u < below) return static_cast<int>(i);
  }
  return static_cast<int>(last);  // u within rounding of 1
}

dp::EvalTotals evaluate(dp::Engine& engine, dp::Runtime& runtime, std::shared_ptr<const dp::SampleSource> test,
                        int batch_size, int workers, std::vector<std::int32_t>* predictions) {
  const int shards = engine.world_size(), local = engine.batches_per_forward();
  std::vector<std::vector<std::vector<std::int64_t>>> plans(static_cast<std::size_t>(local));
  // Global rank 0's shard is the longest: every process takes as many steps as it needs.
  const std::size_t batch = static_cast<std::size_t>(batch_size);
  const std::size_t steps = (dp::eval_shard(test->size(), shards, 0).size() + batch - 1) / batch;
  for (int l = 0; l < local; ++l) {
    const auto mine = dp::eval_shard(test->size(), shards, engine.first_rank() + l);
    auto& plan = plans[static_cast<std::size_t>(l)];
    for (std::size_t begin = 0; begin < mine.size(); begin += static_cast<std::size_t>(batch_size))
      plan.emplace_back(mine.begin() + static_cast<std::ptrdiff_t>(begin),
                        mine.begin() + static_cast<std::ptrdiff_t>(
                                           std::min(mine.size(), begin + static_cast<std::size_t>(batch_size))));
  }
  for (auto& plan : plans) plan.resize(steps);  // empty batches for the ranks whose shard is shorter
  const auto order = plans;                     // which sample each prediction belongs to
  // One loader for every local rank, step after step, rank after rank: its threads do not grow with them.
  std::vector<std::vector<std::int64_t>> in_turn;
  for (std::size_t k = 0; k < steps; ++k)
    for (auto& plan : plans) in_turn.push_back(std::move(plan[k]));
  dp::LoaderOptions options;
  options.workers = workers;
  options.depth = 2 * local;
  dp::BatchLoader loader(runtime, test, std::move(in_turn), options);
  if (predictions) predictions->assign(test->size(), -1);
  dp::EvalTotals totals;
  std::vector<std::int32_t> classes;
  for (std::size_t k = 0; k < steps; ++k) {
    std::vector<dp::Batch> batches;
    for (int l = 0; l < local; ++l) batches.push_back(loader.next());
    classes.clear();
    totals += engine.evaluate(batches, predictions ? &classes : nullptr);
    if (!predictions) continue;
    std::size_t at = 0;
    for (const auto& plan : order)
      for (const std::int64_t sample : plan[k]) (*predictions)[static_cast<std::size_t>(sample)] = classes[at++];
  }
  return totals;
}

// A --save checkpoint holds at least every parameter in fp32: a file-size limit (ulimit -f) below
// that is refused before any work, not found at the save.
void check_file_size_limit(const Options& o, std::uint64_t params) {
  rlimit limit{};
  if (o.save.empty() || ::getrlimit(RLIMIT_FSIZE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return;
  const std::uint64_t bytes = times(params, 4, "the checkpoint");
  if (bytes > limit.rlim_cur)
    throw UsageError(
        fmt::format("--save {}: the checkpoint takes more than {} bytes ({} parameters), past the file-size limit "
                    "(ulimit -f) of {} bytes",
                    o.save, bytes, params, limit.rlim_cur));
}

void check_memory(const Options& o, const std::vector<int>& hidden, const std::vector<int>& ids, bool cuda,
                  int processes) {
  const std::uint64_t devices = ids.size(), batch = static_cast<std::uint64_t>(o.batch_size);
  const std::uint64_t shards = o.mode == dp::EngineKind::ddp ? devices * static_cast<std::uint64_t>(processes) : 1;
  if (times(batch, shards, "the global batch") > static_cast<std::uint64_t>(std::numeric_limits<int>::max()))
    throw UsageError(fmt::format("--batch-size {} x {} device(s): a global batch of {} samples is more than {}",
                                 o.batch_size, shards, batch * shards, std::numeric_limits<int>::max()));
  const dp::models::ModelSpec& model = dp::models::model_spec(o.model);
  const dp::models::ModelArgs args = model_args(o, hidden);
  const std::uint64_t params = as_usage_error([&] { return model.param_count(args); });
  check_file_size_limit(o, params);
  const std::uint64_t sample_elements = model.input_elements(args);
  const auto classes = static_cast<std::uint64_t>(model.num_classes(args));
  const std::uint64_t rows = o.mode == dp::EngineKind::dp ? (batch + devices - 1) / devices : batch;  // per device
  // The optimizer's state buffers per parameter: AdamW's two moments, SGD's momentum, or none.
  const std::uint64_t state_buffers = o.optimizer == dp::tools::OptimizerKind::adamw ? 2 : o.momentum > 0 ? 1 : 0;
  const std::uint64_t per_device = plus(times(times(params, 4, "the model"), 2 + state_buffers, "the model"),
                                        times(rows, (sample_elements + classes) * 4, "the batch"), "the device memory");
  const std::uint64_t samples = o.data.empty() ? o.synthetic.value_or(2048) : 0;
  std::uint64_t host =
      plus(times(samples, dp::Dataset{}.sample_pixels() + sizeof(std::int64_t), "the data set"),
           times(times(3 * shards, batch, "the staging"), sample_elements * 4 + 8, "the staging"), "the host memory");
  if (!cuda) host = plus(host, times(per_device, devices, "the devices' memory"), "the host memory");
  // ZeRO in one process keeps two host copies of the parameters and optimizer state (Note [ZeRO's
  // host copies], dp/engines/src/zero.cpp).
  if (o.zero > 0 && o.zero_host_copies && processes == 1 && devices > 1)
    host = plus(host, times(times(params, 8, "ZeRO's host copies"), 1 + state_buffers, "ZeRO's host copies"),
                "the host memory");
  const std::uint64_t host_memory = dp::Runtime::host_memory_bytes();
  if (host_memory > 0 && host > host_memory)
    throw UsageError(
        fmt::format("this run needs at least {} of host memory ({} parameters, {} samples{}), the host "
                    "has {}",
                    gib(host), params, samples, cuda ? "" : ", the simulated devices' memory", gib(host_memory)));
  dp::tools::check_address_space(
      host, cuda ? 0 : devices, run_threads(o, devices),
      fmt::format("{} parameters, {} samples{}", params, samples, cuda ? "" : ", the simulated devices' memory"));
  const std::uint64_t capacity = dp::RuntimeOptions{}.sim_capacity_bytes;
  if (!cuda && per_device > capacity)
    throw UsageError(fmt::format("this run needs at least {} per device ({} parameters), a simulated device holds {}",
                                 gib(per_device), params, gib(capacity)));
}

dp::models::ModelArgs model_args(const Options& o, const std::vector<int>& hidden) {
  dp::models::ModelArgs args = dp::tools::shape_model_args(o);
  args.hidden = hidden;
  args.num_classes = o.num_classes.value_or(args.num_classes);
  args.image_size = o.image_size;
  return args;
}

std::string data_identity(const dp::SampleSource& set) {
  std::uint64_t hash = 0;
  if (const auto* mnist = dynamic_cast<const dp::DatasetSource*>(&set)) {
    const dp::Dataset& data = mnist->data();
    const std::string_view pixels(reinterpret_cast<const char*>(data.pixels.data()), data.pixels.size());
    hash = dp::tools::fingerprint(pixels);
  } else if (const auto* folder = dynamic_cast<const dp::ImageFolder*>(&set)) {
    std::string listing;
    for (std::size_t i = 0; i < folder->size(); ++i) {
      std::error_code ec;
      const auto& path = folder->path(i);
      listing += fmt::format("{}\n{}\n", path, std::filesystem::file_size(path, ec));
    }
    hash = dp::tools::fingerprint(listing);
  }
  std::vector<std::int64_t> labels(set.size());
  for (std::size_t i = 0; i < set.size(); ++i) labels[i] = set.label(i);
  const std::string_view label_bytes(reinterpret_cast<const char*>(labels.data()),
                                     labels.size() * sizeof(std::int64_t));
  return fmt::format("{} samples of {} classes, {:016x}", set.size(), set.num_classes(),
                     hash ^ (dp::tools::fingerprint(label_bytes) << 1));
}

std::vector<std::pair<std::string, std::string>> configuration(const Options& o, const std::vector<int>& ids, bool cuda,
                                                               const dp::SampleSource* data,
                                                               const dp::SampleSource* test) {
  const auto file = [](const std::string& path) {
    if (path.empty()) return std::string("none");
    std::ifstream in(path, std::ios::binary);
    std::stringstream bytes;
    bytes << in.rdbuf();
    return fmt::format("{:016x}", dp::tools::fingerprint(bytes.str()));
  };
  const bool takes_hidden = dp::models::model_spec(o.model).takes(dp::models::ModelArg::hidden);
  std::vector<std::pair<std::string, std::string>> fields = {
      {"backend", cuda ? "cuda" : "sim"},
      {"devices per process", fmt::format("{}", ids.size())},
      {"--mode", std::string(dp::to_string(o.mode))},
      {"--model", fmt::format("{} {} dropout {} classes {}", o.model, takes_hidden ? o.hidden : "", o.dropout,
                              o.num_classes.value_or(0))},
      {"--epochs", fmt::format("{}", o.epochs.value_or(0))},
      {"optimizer", fmt::format("lr {} momentum {} wd {} nesterov {} betas {} {} eps {} scale-lr {}", o.lr, o.momentum,
                                o.weight_decay, o.nesterov, o.beta1, o.beta2, o.eps, o.scale_lr)},
      {"schedule", fmt::format("{} warm-up {} step {} gamma {} t-max {} eta-min {}", to_string(o.schedule),
                               o.warmup_steps, o.step_size, o.gamma, o.t_max.value_or(0), o.eta_min)},
      {"--label-smoothing", fmt::format("{}", o.label_smoothing)},
      {"--seed, --no-shuffle", fmt::format("{} {}", o.seed, o.no_shuffle)},
      {"--normalize", o.normalize},
      {"images", fmt::format("size {} resize {}", o.image_size, o.resize.value_or(0))},
      {"evaluation", test ? "on, " + data_identity(*test) : "off"},
      {"training data", data ? data_identity(*data) : "none"},
      {"--init", file(o.init)},
      {"--resume", file(o.resume)}};
  for (auto& field : dp::tools::shared_configuration(o)) fields.push_back(std::move(field));
  return fields;
}

}  // namespace dp_train
