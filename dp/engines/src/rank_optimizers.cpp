// rank_optimizers.cpp — torch's DDP update: every rank clips and steps its all-reduced gradients.
#include "rank_optimizers.h"

#include "device_update.h"

namespace dp::engines {
namespace {

class WholeUpdates final : public RankOptimizers {
 public:
  WholeUpdates(const DeviceGroup& group, std::size_t params, const OptimizerOptions& optimizer, double clip) {
    for (int r = 0; r < group.size(); ++r)
      updates_.push_back(std::make_unique<DeviceUpdate>(group.device(r), params, optimizer, clip));
  }
  BucketReduction reduction() const override { return BucketReduction::all_reduce; }
  void step(int r, const Stream& stream, Model& model) override {
    // Every rank's gradients are the same after the all-reduce: so are their norms and updates.
    updates_[static_cast<std::size_t>(r)]->run(stream, model);
  }
  Optimizer& optimizer(int r) const override { return updates_.at(static_cast<std::size_t>(r))->optimizer(); }
  bool clips() const override { return updates_[0]->clips(); }
  std::optional<float> last_grad_norm() const override { return updates_[0]->last_grad_norm(); }
  void freeze(const std::vector<Optimizer::ParamRange>& frozen) override {
    for (auto& update : updates_) update->optimizer().freeze(frozen);
  }
  void exclude_from_weight_decay(const std::vector<Optimizer::ParamRange>& ranges) override {
    for (auto& update : updates_) update->optimizer().exclude_from_weight_decay(ranges);
  }
  std::vector<Optimizer*> whole() override {
    std::vector<Optimizer*> out;
    for (auto& update : updates_) out.push_back(&update->optimizer());
    return out;
  }

 private:
  std::vector<std::unique_ptr<DeviceUpdate>> updates_;
};

}  // namespace

std::unique_ptr<RankOptimizers> make_rank_optimizers(const DeviceGroup& group,
                                                     const std::shared_ptr<ProcessGroup>& processes,
                                                     const std::vector<GradBucket>& buckets, std::size_t params,
                                                     const OptimizerOptions& optimizer, const EngineOptions& options) {
  if (options.zero) return make_zero_optimizers(group, processes, buckets, params, optimizer, options);
  return std::make_unique<WholeUpdates>(group, params, optimizer, options.step.clip_grad_norm);
}

}  // namespace dp::engines
