// batchnorm.cu — launchers for dp/kernels/batchnorm.h: two split reductions for the batch statistics
// (mean, then centred moments), one for the backward sums, elementwise passes for y and dx.
#include "checks.h"
#include "dp/kernels/batchnorm.h"
#include "dp/kernels/detail/launch.h"
#include "dp/kernels/elementwise.h"
#include "dp/runtime/shape.h"

namespace dp::kernels {
namespace {
std::string describe(const BatchNormShape& s) { return format_dims({{"N", s.n}, {"C", s.c}, {"H", s.h}, {"W", s.w}}); }

// Negative extents; in training (statistics), more than one value per channel.
void check_shape(const char* op, const BatchNormShape& s, bool training) {
  if (s.n < 0 || s.c < 0 || s.h < 0 || s.w < 0) checks::fail({op, ": negative extent in shape ", describe(s)});
  if (training && s.c > 0 && static_cast<std::int64_t>(s.n) * s.h * s.w < 2)
    checks::fail({op, ": expected more than 1 value per channel when training, got shape ", describe(s)});
}

// SyncBatchNorm's count over all replicas.
void check_global_count(const char* op, std::int64_t global_count, std::int64_t local_count) {
  if (global_count < 2 || global_count < local_count || global_count > (std::int64_t{1} << 24))
    checks::fail({op, ": ", global_count, " values per channel over all replicas (this one has ", local_count,
                  "): need at least 2, at least this replica's, and at most 2^24 (exact as a float)"});
}
}  // namespace

namespace {

// The training forward's operands, plain and synchronised alike.
void check_forward_operands(const char* name, In x, const float* gamma, const float* beta, Out y,
                            const float* save_mean, const float* save_invstd, const float* running_mean,
                            const float* running_var, const std::int64_t* num_batches_tracked) {
  checks::same_storage(name, {x.bf16, y.bf16});
  checks::present(name, {{"x", x.data},
                         {"gamma", gamma},
                         {"beta", beta},
                         {"y", y.data},
                         {"save_mean", save_mean},
                         {"save_invstd", save_invstd},
                         {"running_mean", running_mean},
                         {"running_var", running_var},
                         {"num_batches_tracked", num_batches_tracked}});
}

// Once the statistics are in save_mean / save_invstd: y (relu(y) when a ReLU is fused).
template <class T>
void normalize(const Stream& stream, const BatchNormShape& shape, const T* x, const float* gamma, const float* beta,
               T* y, const float* save_mean, const float* save_invstd, bool relu) {
  const index_t c = shape.c, plane = static_cast<index_t>(shape.h) * shape.w;
  const index_t total = static_cast<index_t>(shape.n) * plane * c;
  launch_2d(stream, "batchnorm_normalize", static_cast<index_t>(shape.n) * c, plane,
            BnNormalize<T>{ChannelElement{c, plane}, x, save_mean, save_invstd, gamma, beta, y, relu},
            {operand(x, total), operand(save_mean, c), operand(save_invstd, c), operand(gamma, c), operand(beta, c),
             operand(y, total)});
}

// The backward's sums of this replica: dgamma, dbeta (added to or stored) and grad_sums.
template <class T>
void backward_sums(const char* name, const Stream& stream, const BatchNormShape& shape, const T* x, const float* gamma,
                   const float* save_mean, const float* save_invstd, const T* dy, float* dgamma, float* dbeta,
                   float* grad_sums, const T* relu_y, bool accumulate) {
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
  // A fused ReLU's output is one more operand (total of them); an absent one is checked as nothing.
  const index_t relu_total = relu_y ? total : 0;
  launch_row_reduce<SumPair>(
      stream, "batchnorm_backward_sums", c, count,
      BnGradTerms<T>{ChannelElement{c, plane}, x, dy, save_mean, save_invstd, relu_y},
      BnStoreGradSums{c, dgamma, dbeta, grad_sums, accumulate},
      {operand(x, total), operand(dy, total), operand(save_mean, c), operand(save_invstd, c), operand(dgamma, c),
       operand(dbeta, c), operand(grad_sums, 2 * c), operand(relu_y, relu_total)});
}

// dx from grad_sums (this replica's, or summed over the replicas), over `mean_count` values per channel.
template <class T>
void backward_dx(const Stream& stream, const BatchNormShape& shape, const T* x, const float* gamma,
                 const float* save_mean, const float* save_invstd, const T* dy, T* dx, const float* grad_sums,
                 index_t mean_count, const T* relu_y) {
  if (dx == nullptr) return;
  const index_t c = shape.c, plane = static_cast<index_t>(shape.h) * shape.w;
  const index_t total = static_cast<index_t>(shape.n) * plane * c;
  const index_t relu_total = relu_y ? total : 0;
  const BnInputGradTerm<T> term{x, dy, gamma, save_mean, save_invstd, 1.0f / static_cast<float>(mean_count), relu_y};
  launch_2d(stream, "batchnorm_backward_dx", static_cast<index_t>(shape.n) * c, plane,
            BnInputGrad<T>{ChannelElement{c, plane}, term, grad_sums, dx},
            {operand(x, total), operand(dy, total), operand(gamma, c), operand(save_mean, c), operand(save_invstd, c),
             operand(grad_sums, 2 * c), operand(dx, total), operand(relu_y, relu_total)});
}

}  // namespace

void batchnorm_forward_train(const Stream& stream, const BatchNormShape& shape, In x, const float* gamma,
                             const float* beta, Out y, float* save_mean, float* save_invstd, float* running_mean,
                             float* running_var, std::int64_t* num_batches_tracked, bool relu) {
  const char* name = "batchnorm_forward_train";
  check_shape(name, shape, true);
  check_forward_operands(name, x, gamma, beta, y, save_mean, save_invstd, running_mean, running_var,
                         num_batches_tracked);
  const index_t c = shape.c, plane = static_cast<index_t>(shape.h) * shape.w;
  const index_t count = static_cast<index_t>(shape.n) * plane, total = count * c;
  const ChannelElement at{c, plane};
  with_storage(x.bf16, [&](auto t) {
    using T = decltype(t);
    const T* xs = x.as<T>();
    launch_row_reduce<float>(stream, "batchnorm_mean", c, count, ChannelValue<T>{at, xs},
                             BnStoreMean{save_mean, 1.0f / static_cast<float>(count)},
                             {operand(xs, total), operand(save_mean, c)});
    launch_row_reduce<SumPair>(stream, "batchnorm_variance", c, count, BnCenteredMoments<T>{at, xs, save_mean},
                               BnStoreVariance{save_mean, save_invstd, running_mean, running_var, num_batches_tracked,
                                               static_cast<float>(count), shape.eps, shape.momentum},
                               {operand(xs, total), operand(save_mean, c), operand(save_invstd, c),
                                operand(running_mean, c), operand(running_var, c), operand(num_batches_tracked, 1)});
    normalize(stream, shape, xs, gamma, beta, y.as<T>(), save_mean, save_invstd, relu);
  });
}

void batchnorm_forward_eval(const Stream& stream, const BatchNormShape& shape, In x, const float* gamma,
                            const float* beta, const float* running_mean, const float* running_var, Out y, bool relu) {
  const char* name = "batchnorm_forward_eval";
  check_shape(name, shape, false);
  const index_t c = shape.c, plane = static_cast<index_t>(shape.h) * shape.w;
  const index_t total = static_cast<index_t>(shape.n) * c * plane;
  if (total == 0) return;
  checks::same_storage(name, {x.bf16, y.bf16});
  checks::present(name, {{"x", x.data},
                         {"gamma", gamma},
                         {"beta", beta},
                         {"running_mean", running_mean},
                         {"running_var", running_var},
                         {"y", y.data}});
  with_storage(x.bf16, [&](auto t) {
    using T = decltype(t);
    launch_2d(stream, "batchnorm_forward_eval", static_cast<index_t>(shape.n) * c, plane,
              BnNormalizeEval<T>{ChannelElement{c, plane}, shape.eps, x.as<T>(), running_mean, running_var, gamma, beta,
                                 y.as<T>(), relu},
              {operand(x.as<T>(), total), operand(running_mean, c), operand(running_var, c), operand(gamma, c),
               operand(beta, c), operand(y.as<T>(), total)});
  });
}

void batchnorm_backward(const Stream& stream, const BatchNormShape& shape, In x, const float* gamma,
                        const float* save_mean, const float* save_invstd, In dy, Out dx, float* dgamma, float* dbeta,
                        float* grad_sums, In relu_y, bool accumulate) {
  const char* name = "batchnorm_backward";
  check_shape(name, shape, true);
  checks::same_storage(name, {x.bf16, dy.bf16, dx ? dx.bf16 : x.bf16, relu_y ? relu_y.bf16 : x.bf16});
  with_storage(x.bf16, [&](auto t) {
    using T = decltype(t);
    backward_sums(name, stream, shape, x.as<T>(), gamma, save_mean, save_invstd, dy.as<T>(), dgamma, dbeta, grad_sums,
                  relu_y.as<T>(), accumulate);
    backward_dx(stream, shape, x.as<T>(), gamma, save_mean, save_invstd, dy.as<T>(), dx.as<T>(), grad_sums,
                static_cast<index_t>(shape.n) * shape.h * shape.w, relu_y.as<T>());
  });
}

void sync_batchnorm_sums(const Stream& stream, const BatchNormShape& shape, In x, float* sums, index_t global_count) {
  const char* name = "sync_batchnorm_sums";
  check_shape(name, shape, false);  // a replica may hold one value per channel; the union may not
  check_global_count(name, global_count, static_cast<index_t>(shape.n) * shape.h * shape.w);
  checks::present(name, {{"x", x.data}, {"sums", sums}});
  const index_t c = shape.c, plane = static_cast<index_t>(shape.h) * shape.w;
  const index_t count = static_cast<index_t>(shape.n) * plane;
  with_storage(x.bf16, [&](auto t) {
    using T = decltype(t);
    launch_row_reduce<float>(stream, name, c, count, ChannelValue<T>{ChannelElement{c, plane}, x.as<T>()},
                             BnStoreMean{sums, 1.0f}, {operand(x.as<T>(), count * c), operand(sums, c)});
  });
}

void sync_batchnorm_moments(const Stream& stream, const BatchNormShape& shape, In x, float* mean, float* moments,
                            index_t global_count) {
  const char* name = "sync_batchnorm_moments";
  check_shape(name, shape, false);
  check_global_count(name, global_count, static_cast<index_t>(shape.n) * shape.h * shape.w);
  checks::present(name, {{"x", x.data}, {"mean", mean}, {"moments", moments}});
  const index_t c = shape.c, plane = static_cast<index_t>(shape.h) * shape.w;
  const index_t count = static_cast<index_t>(shape.n) * plane, total = count * c;
  // The summed sums times 1/M: the mean of the union, as one device would form it.
  launch(stream, "sync_batchnorm_mean", c, Scale{1.0f / static_cast<float>(global_count), mean}, {operand(mean, c)});
  with_storage(x.bf16, [&](auto t) {
    using T = decltype(t);
    launch_row_reduce<SumPair>(stream, name, c, count, BnCenteredMoments<T>{ChannelElement{c, plane}, x.as<T>(), mean},
                               BnStorePair{c, moments},
                               {operand(x.as<T>(), total), operand(mean, c), operand(moments, 2 * c)});
  });
}

void sync_batchnorm_normalize(const Stream& stream, const BatchNormShape& shape, In x, const float* gamma,
                              const float* beta, Out y, float* save_mean, float* save_invstd, float* running_mean,
                              float* running_var, std::int64_t* num_batches_tracked, const float* moments,
                              index_t global_count, bool relu) {
  const char* name = "sync_batchnorm_normalize";
  check_shape(name, shape, false);
  check_global_count(name, global_count, static_cast<index_t>(shape.n) * shape.h * shape.w);
  check_forward_operands(name, x, gamma, beta, y, save_mean, save_invstd, running_mean, running_var,
                         num_batches_tracked);
  checks::present(name, {{"moments", moments}});
  const index_t c = shape.c;
  const BnStoreVariance store{save_mean,   save_invstd,         running_mean,
                              running_var, num_batches_tracked, static_cast<float>(global_count),
                              shape.eps,   shape.momentum};
  launch(stream, "sync_batchnorm_variance", c, BnFinishVariance{store, c, moments},
         {operand(moments, 2 * c), operand(save_mean, c), operand(save_invstd, c), operand(running_mean, c),
          operand(running_var, c), operand(num_batches_tracked, 1)});
  with_storage(x.bf16, [&](auto t) {
    using T = decltype(t);
    normalize(stream, shape, x.as<T>(), gamma, beta, y.as<T>(), save_mean, save_invstd, relu);
  });
}

void sync_batchnorm_backward_sums(const Stream& stream, const BatchNormShape& shape, In x, const float* gamma,
                                  const float* save_mean, const float* save_invstd, In dy, float* dgamma, float* dbeta,
                                  float* grad_sums, index_t global_count, In relu_y, bool accumulate) {
  const char* name = "sync_batchnorm_backward_sums";
  check_shape(name, shape, false);
  check_global_count(name, global_count, static_cast<index_t>(shape.n) * shape.h * shape.w);
  checks::same_storage(name, {x.bf16, dy.bf16, relu_y ? relu_y.bf16 : x.bf16});
  with_storage(x.bf16, [&](auto t) {
    using T = decltype(t);
    backward_sums(name, stream, shape, x.as<T>(), gamma, save_mean, save_invstd, dy.as<T>(), dgamma, dbeta, grad_sums,
                  relu_y.as<T>(), accumulate);
  });
}

void sync_batchnorm_backward_dx(const Stream& stream, const BatchNormShape& shape, In x, const float* gamma,
                                const float* save_mean, const float* save_invstd, In dy, Out dx, const float* grad_sums,
                                index_t global_count, In relu_y) {
  const char* name = "sync_batchnorm_backward_dx";
  check_shape(name, shape, false);
  check_global_count(name, global_count, static_cast<index_t>(shape.n) * shape.h * shape.w);
  checks::same_storage(name, {x.bf16, dy.bf16, dx ? dx.bf16 : x.bf16, relu_y ? relu_y.bf16 : x.bf16});
  with_storage(x.bf16, [&](auto t) {
    using T = decltype(t);
    backward_dx(stream, shape, x.as<T>(), gamma, save_mean, save_invstd, dy.as<T>(), dx.as<T>(), grad_sums,
                global_count, relu_y.as<T>());
  });
}

}  // namespace dp::kernels
