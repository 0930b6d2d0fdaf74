// replica_health.cpp — what the replicas of a ReplicaEngine say about themselves: which holds the
// last step whole after a device or process was lost (Engine::survivor, with the count of updates
// each device completed), whether they still hold the same bits (EngineOptions::check_replicas:
// fingerprints made on their devices), and the corruption DP_FAULT makes to test it.
#include <algorithm>
#include <cstring>
#include <fmt/format.h>
#include <functional>
#include <optional>

#include "dp/engines/replica_engine.h"
#include "dp/kernels/fingerprint.h"
#include "dp/kernels/ops.h"
#include "dp/runtime/error.h"
#include "dp/runtime/fault.h"
#include "rank_optimizers.h"
#include "replica_rank.h"

namespace dp {

void ReplicaEngine::restart_update_counts(std::int64_t steps) {
  counted_from_ = steps;
  group_.run([&](int r) {
    // Updates completed, the 1 added per update, and the count when the buffers were last copied.
    float* count = rank(r).updates_done.as<float>();
    kernels::fill(rank(r).compute, count, 1, 0.0f);
    kernels::fill(rank(r).compute, count + 1, 1, 1.0f);
    kernels::fill(rank(r).compute, count + 2, 1, -1.0f);
  });
}

std::optional<Engine::Survivor> ReplicaEngine::survivor() {
  // ZeRO's optimizer state is spread over the ranks, the lost one's part with it, unless the ranks
  // keep host copies of their parts (one process: Note [ZeRO's host copies], zero.cpp). Under
  // several processes each judges its own ranks (a lost peer process leaves them all).
  const bool zero = options_.zero > 0;
  if (zero && !updates_->keeps()) return std::nullopt;
  // Note [a survivor's state]
  // Every survivor holds the parameters and optimizer state of the steps it completed (the update
  // follows the reduction, which needs every rank's gradients); under ZeRO the host copies hold the
  // latest steps every rank completed. The buffers (running statistics) are the state's only where
  // they are rank 0's of that step: rank 0's own (every rank's, where the step ends with rank 0's:
  // fixed shards), when no later step has begun there; or a rank's copy of rank 0's, taken as the
  // next step began, after the buffers' broadcast from rank 0 (in stream order: a step whose
  // broadcast failed never took its copy, which then still names the step before). The latest step
  // whose whole state survives is the one to go on from. Stream order is what makes this hold: on
  // the sim a failed collective stops the work behind it on that stream, as a faulting kernel stops
  // a CUDA context.
  const bool buffers = rank(0).model->buffers_bytes() > 0;
  // The step that failed may still wait in a collective for what will never come.
  abort_communicators();
  const std::vector<Holding> held = holdings();
  // The latest step whose whole state survives: each survivor's own (its update count) or, under
  // ZeRO, one the host copies hold; and a survivor holding that step's buffers.
  std::vector<std::int64_t> steps = zero ? updates_->kept_steps() : std::vector<std::int64_t>{};
  if (!zero)
    for (const Holding& h : held) steps.push_back(h.done);
  std::ranges::sort(steps, std::greater<>());
  const Holding* best = nullptr;
  std::int64_t best_steps = -1;
  bool from_copy = false;
  for (const std::int64_t step : steps) {
    for (const Holding& h : held) {
      if (!zero && h.done != step) continue;
      if (!buffers || h.own == step || h.copy == step) {
        best = &h, best_steps = step, from_copy = buffers && h.own != step;
        break;
      }
    }
    if (best) break;
  }
  if (!best) return std::nullopt;
  Rank& mine = rank(best->r);
  Device& device = group_.device(best->r);
  if (from_copy) {
    const Stream writer = device.create_stream();
    writer.copy(mine.model->buffers_flat(), mine.step_start_buffers.data(), mine.model->buffers_bytes());
    writer.synchronize();
  }
  Optimizer* optimizer = zero ? updates_->restore_kept(best_steps, best->r, *mine.model) : mine.optimizer;
  optimizer->set_steps(best_steps);
  return Survivor{mine.model, optimizer, best_steps, group_.device_ids()[static_cast<std::size_t>(best->r)]};
}

std::vector<ReplicaEngine::Holding> ReplicaEngine::holdings() {
  std::vector<Holding> held;
  for (int r = 0; r < group_.size(); ++r) {
    Device& device = group_.device(r);
    if (device.lost()) continue;
    Rank& mine = rank(r);
    try {
      // The failure a survivor's streams saw (a collective aborted for the lost device) is the
      // step's, reported there; here only the end of their work matters.
      mine.compute.synchronize();
    } catch (...) {
    }
    try {
      synchronize_rank(r);
    } catch (...) {
    }
    float counts[3] = {};
    try {
      const Stream reader = device.create_stream();
      reader.copy(counts, mine.updates_done.as<float>(), sizeof(counts));
    } catch (...) {
      continue;
    }
    Holding h{r, counted_from_ + static_cast<std::int64_t>(counts[0]), {}, {}};
    // A step began after the last one completed here when its copy ran (so its forward may have
    // too); else nothing has touched the buffers since that step.
    const bool copied = counts[2] >= 0 && mine.step_start_buffers.size() > 0;
    const bool began_another = copied && counts[2] == counts[0];
    const bool global_rank0 = comm_->first_rank() + r == 0;
    if (!began_another && (global_rank0 || buffers_end_steps_as_rank0s())) h.own = h.done;
    if (copied && (global_rank0 || replicas_share_buffers()))
      h.copy = counted_from_ + static_cast<std::int64_t>(counts[2]);
    held.push_back(h);
  }
  return held;
}

void ReplicaEngine::inject_update_faults() {
  FaultPlan& faults = FaultPlan::from_environment();
  if (!faults.has(FaultKind::flip_param)) return;
  run_ranks([&](int r) {
    Rank& mine = rank(r);
    const std::int64_t step = mine.optimizer->steps();
    if (!faults.take(FaultKind::flip_param, processes_->rank(), fault_devices_[static_cast<std::size_t>(r)], step))
      return;
    // Bit 22 (the mantissa's highest) of the parameter in the middle of the flat buffer: a value
    // off by up to half of itself, still finite, as a flipped bit in memory leaves it.
    auto* middle = reinterpret_cast<std::uint32_t*>(mine.model->params_flat() + mine.model->param_count() / 2);
    kernels::flip_bit(mine.compute, middle, 22);
  });
}

std::vector<ReplicaEngine::Part> ReplicaEngine::fingerprint_parts(int r) const {
  const Rank& mine = rank(r);
  std::vector<Part> parts{{"parameters", mine.model->params_flat()}};
  // Under ZeRO each rank holds its own part of the optimizer state: nothing to compare.
  if (options_.zero == 0)
    for (const Optimizer::StateBuffer& state : mine.optimizer->state())
      parts.push_back({fmt::format("optimizer {}", state.name), state.data});
  return parts;
}

std::vector<std::uint64_t> ReplicaEngine::gather_fingerprints(
    std::size_t per_rank, const std::function<void(int r, std::uint64_t* out)>& enqueue) {
  std::vector<std::uint64_t> local(per_rank * static_cast<std::size_t>(group_.size()));
  run_ranks([&](int r) {
    Rank& mine = rank(r);
    std::uint64_t* out = mine.fingerprints.get<std::uint64_t>(group_.device(r), per_rank);
    enqueue(r, out);
    // Pageable: returns once written, after the step's update in stream order.
    mine.compute.copy(local.data() + static_cast<std::size_t>(r) * per_rank, out, per_rank * sizeof(std::uint64_t));
  });
  return processes_->all_gather(std::span<const std::uint64_t>(local));
}

namespace {

// Which of `values` (one per global rank) differ from the most common one, when more than half
// agree on it (the odd ones out); else none is the majority and every rank is named.
struct Odd {
  std::vector<std::size_t> ranks;
  bool majority = true;
};
Odd odd_ones(const std::vector<std::uint64_t>& values) {
  std::size_t best = 0, best_count = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    const auto count = static_cast<std::size_t>(std::count(values.begin(), values.end(), values[i]));
    if (count > best_count) best = i, best_count = count;
  }
  Odd odd;
  if (best_count == values.size()) return odd;
  odd.majority = 2 * best_count > values.size();
  for (std::size_t i = 0; i < values.size(); ++i)
    if (!odd.majority || values[i] != values[best]) odd.ranks.push_back(i);
  return odd;
}

}  // namespace

// Note [replica fingerprints]
// Each part (the parameters, each optimizer state buffer) is fingerprinted on every replica's
// device (kernels::fingerprint: one read, a sum that no order changes) and the fingerprints, 8 bytes
// a part, gathered from every process. Only where they differ is more read: the part's tensors
// fingerprinted one by one, to name the first that differs. The replicas' buffers are not compared:
// under DDP each rank's running statistics are its own until rank 0's are broadcast.
void ReplicaEngine::check_replica_fingerprints() {
  const std::size_t parts = fingerprint_parts(0).size();
  const auto words = static_cast<kernels::index_t>(rank(0).model->param_count());
  const std::vector<std::uint64_t> all = gather_fingerprints(parts, [&](int r, std::uint64_t* out) {
    const std::vector<Part> mine = fingerprint_parts(r);
    for (std::size_t i = 0; i < mine.size(); ++i)
      kernels::fingerprint(rank(r).compute, words, reinterpret_cast<const std::uint32_t*>(mine[i].data), 0, out + i,
                           false);
  });
  const std::size_t ranks = all.size() / parts;
  for (std::size_t part = 0; part < parts; ++part) {
    std::vector<std::uint64_t> values;
    for (std::size_t g = 0; g < ranks; ++g) values.push_back(all[g * parts + part]);
    const Odd found = odd_ones(values);
    if (found.ranks.empty()) continue;
    const std::vector<std::size_t>& odd = found.ranks;
    // The part's tensors one by one, on every rank: the first that differs on an odd rank.
    const std::vector<TensorRef> tensors = rank(0).model->parameters();
    const std::vector<std::uint64_t> each = gather_fingerprints(tensors.size(), [&](int r, std::uint64_t* out) {
      const auto* data = reinterpret_cast<const std::uint32_t*>(fingerprint_parts(r)[part].data);
      for (std::size_t t = 0; t < tensors.size(); ++t)
        kernels::fingerprint(rank(r).compute, static_cast<kernels::index_t>(tensors[t].numel()),
                             data + tensors[t].offset, 0, out + t, false);
    });
    std::string tensor = "(no single tensor)";
    std::size_t other = 0;  // a rank of the majority, or rank 0's neighbour where none is
    while (other < ranks && found.majority && std::find(odd.begin(), odd.end(), other) != odd.end()) ++other;
    if (!found.majority) other = odd.front() == 0 ? 1 : 0;
    for (std::size_t t = 0; t < tensors.size(); ++t)
      if (each[odd.front() * tensors.size() + t] != each[other * tensors.size() + t]) {
        tensor = tensors[t].name;
        break;
      }
    const int local = group_.size();
    std::string who;
    for (const std::size_t g : odd) {
      const int process = static_cast<int>(g) / local, r = static_cast<int>(g) % local;
      who += fmt::format("{}global rank {} (device {}{})", who.empty() ? "" : ", ", g,
                         process == processes_->rank() ? group_.device_ids()[static_cast<std::size_t>(r)] : r,
                         processes_->size() > 1 ? fmt::format(" of process {}", process) : "");
    }
    const std::string which = found.majority
                                  ? fmt::format("{} {} other bits than the other {} of {} replicas", who,
                                                odd.size() == 1 ? "holds" : "hold", ranks - odd.size(), ranks)
                                  : fmt::format("no majority of the {} replicas agrees ({})", ranks, who);
    throw ReplicaMismatch(fmt::format(
        "silent corruption: after step {} the replicas' {} differ: {}, first in '{}' (compared every {} "
        "step(s)); nothing after this step is saved",
        rank(0).optimizer->steps(), fingerprint_parts(0)[part].name, which, tensor, options_.check_replicas));
  }
}

void ReplicaEngine::check_replicas_identical() {
  const std::size_t n = ranks_[0]->model->param_count();
  std::vector<std::vector<float>> values(ranks_.size(), std::vector<float>(n));
  group_.run([&](int r) {
    rank(r).compute.copy(values[static_cast<std::size_t>(r)].data(), rank(r).model->params_flat(), n * sizeof(float));
  });
  for (std::size_t r = 1; r < ranks_.size(); ++r) {
    if (std::memcmp(values[0].data(), values[r].data(), n * sizeof(float)) == 0) continue;
    for (const TensorRef& p : ranks_[0]->model->parameters())
      for (std::size_t i = 0; i < p.numel(); ++i)
        if (std::memcmp(&values[0][p.offset + i], &values[r][p.offset + i], sizeof(float)) != 0)
          throw Error(fmt::format(
              "replicas diverged: '{}'[{}] is {} on rank 0 (device {}) but {} on rank {} (device {})", p.name, i,
              values[0][p.offset + i], group_.device_ids()[0], values[r][p.offset + i], r, group_.device_ids()[r]));
  }
}

}  // namespace dp
