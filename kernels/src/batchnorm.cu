// batchnorm.cu — launchers for dp/kernels/batchnorm.h: two split reductions for the batch statistics
// (mean, then centred moments), one for the backward sums, elementwise passes for y and dx.
#include "checks.h"
#include "dp/kernels/batchnorm.h"
#include "dp/kernels/elementwise.h"
#include "dp/kernels/launch.h"

namespace dp::kernels {
namespace {

// The training forward's operands, plain and synchronised alike.
void check_forward_operands(const char* name, const float* x, const float* gamma, const float* beta, const float* y,
                            const float* save_mean, const float* save_invstd, const float* running_mean,
                            const float* running_var, const std::int64_t* num_batches_tracked) {
  checks::present(name, {{"x", x},
                         {"gamma", gamma},
                         {"beta", beta},
                         {"y", y},
                         {"save_mean", save_mean},
                         {"save_invstd", save_invstd},
                         {"running_mean", running_mean},
                         {"running_var", running_var},
                         {"num_batches_tracked", num_batches_tracked}});
}

// Once the statistics are in save_mean / save_invstd: y (relu(y) when a ReLU is fused).
void normalize(const Stream& stream, const BatchNormShape& shape, const float* x, const float* gamma, const float* beta,
               float* y, const float* save_mean, const float* save_invstd, bool relu) {
  const index_t c = shape.c, plane = static_cast<index_t>(shape.h) * shape.w;
  const index_t total = static_cast<index_t>(shape.n) * plane * c;
  launch_2d(stream, "batchnorm_normalize", static_cast<index_t>(shape.n) * c, plane,
            BnNormalize{ChannelElement{c, plane}, x, save_mean, save_invstd, gamma, beta, y, relu},
            {operand(x, total), operand(save_mean, c), operand(save_invstd, c), operand(gamma, c), operand(beta, c),
             operand(y, total)});
}

// The backward of both: this replica's sums into dgamma, dbeta and grad_sums, then (SyncBatchNorm)
// their sum over the replicas, then dx over `mean_count` values per channel.
void backward(const char* name, const Stream& stream, const BatchNormShape& shape, const float* x, const float* gamma,
              const float* save_mean, const float* save_invstd, const float* dy, float* dx, float* dgamma, float* dbeta,
              float* grad_sums, index_t mean_count, const AllReduceSum* all_reduce, const float* relu_y,
              bool accumulate) {
  checks::present(name, {{"x", x},
                         {"gamma", gamma},
                         {"save_mean", save_mean},
                         {"save_invstd", save_invstd},
                         {"dy", dy},
                         {"dgamma", dgamma},
                         {"dbeta", dbeta},
                         {"grad_sums", grad_sums}});
  const index_t c = shape.c, plane = static_cast<index_t>(shape.h) * shape.w;
  const index_t count = static_cast<index_t>(shape.n) * plane, total = count * c;
  const ChannelElement at{c, plane};
  // A fused ReLU's output is one more operand (total of them); an absent one is checked as nothing.
  const index_t relu_total = relu_y ? total : 0;
  launch_row_reduce<SumPair>(
      stream, "batchnorm_backward_sums", c, count, BnGradTerms{at, x, dy, save_mean, save_invstd, relu_y},
      BnStoreGradSums{c, dgamma, dbeta, grad_sums, accumulate},
      {operand(x, total), operand(dy, total), operand(save_mean, c), operand(save_invstd, c), operand(dgamma, c),
       operand(dbeta, c), operand(grad_sums, 2 * c), operand(relu_y, relu_total)});
  // Every replica calls the all-reduce, needed or not: the others wait for it.
  if (all_reduce) (*all_reduce)(grad_sums, 2 * static_cast<std::size_t>(c));
  if (dx == nullptr) return;
  const BnInputGradTerm term{x, dy, gamma, save_mean, save_invstd, 1.0f / static_cast<float>(mean_count), relu_y};
  launch_2d(stream, "batchnorm_backward_dx", static_cast<index_t>(shape.n) * c, plane,
            BnInputGrad{at, term, grad_sums, dx},
            {operand(x, total), operand(dy, total), operand(gamma, c), operand(save_mean, c), operand(save_invstd, c),
             operand(grad_sums, 2 * c), operand(dx, total), operand(relu_y, relu_total)});
}

}  // namespace

void batchnorm_forward_train(const Stream& stream, const BatchNormShape& shape, const float* x, const float* gamma,
                             const float* beta, float* y, float* save_mean, float* save_invstd, float* running_mean,
                             float* running_var, std::int64_t* num_batches_tracked, bool relu) {
  const char* name = "batchnorm_forward_train";
  checks::batchnorm(name, shape, true);
  check_forward_operands(name, x, gamma, beta, y, save_mean, save_invstd, running_mean, running_var,
                         num_batches_tracked);
  const index_t c = shape.c, plane = static_cast<index_t>(shape.h) * shape.w;
  const index_t count = static_cast<index_t>(shape.n) * plane, total = count * c;
  const ChannelElement at{c, plane};

  launch_row_reduce<float>(stream, "batchnorm_mean", c, count, ChannelValue{at, x},
                           BnStoreMean{save_mean, 1.0f / static_cast<float>(count)},
                           {operand(x, total), operand(save_mean, c)});
  launch_row_reduce<SumPair>(stream, "batchnorm_variance", c, count, BnCenteredMoments{at, x, save_mean},
                             BnStoreVariance{save_mean, save_invstd, running_mean, running_var, num_batches_tracked,
                                             static_cast<float>(count), shape.eps, shape.momentum},
                             {operand(x, total), operand(save_mean, c), operand(save_invstd, c),
                              operand(running_mean, c), operand(running_var, c), operand(num_batches_tracked, 1)});
  normalize(stream, shape, x, gamma, beta, y, save_mean, save_invstd, relu);
}

void batchnorm_forward_eval(const Stream& stream, const BatchNormShape& shape, const float* x, const float* gamma,
                            const float* beta, const float* running_mean, const float* running_var, float* y,
                            bool relu) {
  const char* name = "batchnorm_forward_eval";
  checks::batchnorm(name, shape, false);
  const index_t c = shape.c, plane = static_cast<index_t>(shape.h) * shape.w;
  const index_t total = static_cast<index_t>(shape.n) * c * plane;
  if (total == 0) return;
  checks::present(name, {{"x", x},
                         {"gamma", gamma},
                         {"beta", beta},
                         {"running_mean", running_mean},
                         {"running_var", running_var},
                         {"y", y}});
  launch_2d(stream, "batchnorm_forward_eval", static_cast<index_t>(shape.n) * c, plane,
            BnNormalizeEval{ChannelElement{c, plane}, shape.eps, x, running_mean, running_var, gamma, beta, y, relu},
            {operand(x, total), operand(running_mean, c), operand(running_var, c), operand(gamma, c), operand(beta, c),
             operand(y, total)});
}

void batchnorm_backward(const Stream& stream, const BatchNormShape& shape, const float* x, const float* gamma,
                        const float* save_mean, const float* save_invstd, const float* dy, float* dx, float* dgamma,
                        float* dbeta, float* grad_sums, const float* relu_y, bool accumulate) {
  const char* name = "batchnorm_backward";
  checks::batchnorm(name, shape, true);
  backward(name, stream, shape, x, gamma, save_mean, save_invstd, dy, dx, dgamma, dbeta, grad_sums,
           static_cast<index_t>(shape.n) * shape.h * shape.w, nullptr, relu_y, accumulate);
}

void sync_batchnorm_forward_train(const Stream& stream, const BatchNormShape& shape, const float* x, const float* gamma,
                                  const float* beta, float* y, float* save_mean, float* save_invstd,
                                  float* running_mean, float* running_var, std::int64_t* num_batches_tracked,
                                  float* scratch, index_t global_count, const AllReduceSum& all_reduce, bool relu) {
  const char* name = "sync_batchnorm_forward_train";
  checks::batchnorm(name, shape, false);  // a replica may hold one value per channel; the union may not
  checks::sync_batchnorm_count(name, global_count, static_cast<index_t>(shape.n) * shape.h * shape.w);
  check_forward_operands(name, x, gamma, beta, y, save_mean, save_invstd, running_mean, running_var,
                         num_batches_tracked);
  checks::present(name, {{"scratch", scratch}});
  const index_t c = shape.c, plane = static_cast<index_t>(shape.h) * shape.w;
  const index_t count = static_cast<index_t>(shape.n) * plane, total = count * c;
  const ChannelElement at{c, plane};
  const float m = static_cast<float>(global_count);

  // Sums, summed over the replicas, times 1/M: the mean of the union, as one device would form it.
  launch_row_reduce<float>(stream, "sync_batchnorm_sum", c, count, ChannelValue{at, x}, BnStoreMean{save_mean, 1.0f},
                           {operand(x, total), operand(save_mean, c)});
  all_reduce(save_mean, static_cast<std::size_t>(c));
  launch(stream, "sync_batchnorm_mean", c, Scale{1.0f / m, save_mean}, {operand(save_mean, c)});
  launch_row_reduce<SumPair>(stream, "sync_batchnorm_moments", c, count, BnCenteredMoments{at, x, save_mean},
                             BnStorePair{c, scratch},
                             {operand(x, total), operand(save_mean, c), operand(scratch, 2 * c)});
  all_reduce(scratch, 2 * static_cast<std::size_t>(c));
  const BnStoreVariance store{save_mean,           save_invstd, running_mean, running_var,
                              num_batches_tracked, m,           shape.eps,    shape.momentum};
  launch(stream, "sync_batchnorm_variance", c, BnFinishVariance{store, c, scratch},
         {operand(scratch, 2 * c), operand(save_mean, c), operand(save_invstd, c), operand(running_mean, c),
          operand(running_var, c), operand(num_batches_tracked, 1)});
  normalize(stream, shape, x, gamma, beta, y, save_mean, save_invstd, relu);
}

void sync_batchnorm_backward(const Stream& stream, const BatchNormShape& shape, const float* x, const float* gamma,
                             const float* save_mean, const float* save_invstd, const float* dy, float* dx,
                             float* dgamma, float* dbeta, float* grad_sums, index_t global_count,
                             const AllReduceSum& all_reduce, const float* relu_y, bool accumulate) {
  const char* name = "sync_batchnorm_backward";
  checks::batchnorm(name, shape, false);
  checks::sync_batchnorm_count(name, global_count, static_cast<index_t>(shape.n) * shape.h * shape.w);
  backward(name, stream, shape, x, gamma, save_mean, save_invstd, dy, dx, dgamma, dbeta, grad_sums, global_count,
           &all_reduce, relu_y, accumulate);
}

}  // namespace dp::kernels
