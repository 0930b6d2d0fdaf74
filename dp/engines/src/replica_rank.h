// replica_rank.h — one local rank of a ReplicaEngine: its replica, loss, compute stream, inputs and
// the floats its losses land in.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "batches.h"
#include "dp/engines/engine.h"
#include "dp/nn/loss.h"
#include "dp/nn/model.h"
#include "dp/nn/optim.h"
#include "dp/runtime/scratch.h"
#include "input_ring.h"

namespace dp::engines {

struct ReplicaRank {
  Model* model = nullptr;
  Optimizer* optimizer = nullptr;  // the RankOptimizers' of this rank
  std::unique_ptr<CrossEntropyLoss> loss;
  Stream compute;
  StagedBatch batch;  // eager forwards' (forward_backward, evaluation)
  // A step's batches, one slot per step in flight: a ring per batch the rank takes per step.
  std::vector<std::unique_ptr<InputRing>> rings;
  Scratch grad_output;
  std::uint64_t accumulated_samples = 0;         // forwarded since the last optimizer step
  BatchNormSync bn_sync;                         // sync_batchnorm: this rank's view of the BN collective
  PinnedBuffer host_loss;                        // per pipeline slot, a float per batch; pinned: copied asynchronously
  std::array<Event, kStepsInFlight> loss_ready;  // per slot: host_loss written
  std::array<Event, kStepsInFlight> step_done;   // per slot: the rank's step has run
  // What a lost device leaves the survivors to go on from (ReplicaEngine::survivor): two floats,
  // the optimizer updates completed here since the count began (exact to 2^24) and the constant 1
  // it adds; and the buffers as the step began (after their broadcast from rank 0).
  DeviceBuffer updates_done;
  Scratch step_start_buffers;
  Scratch fingerprints;  // EngineOptions::check_replicas: one per part (or per tensor) compared

  // Where the loss of the rank's `index`-th batch of pipeline slot `slot` lands.
  float* loss_slot(int slot, int index, int per_step) {
    return host_loss.as<float>() + static_cast<std::size_t>(slot * per_step + index);
  }
};

}  // namespace dp::engines
