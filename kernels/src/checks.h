// checks.h — the launchers' argument checks and their messages. Compiled by the host compiler
// (checks.cpp): fmt's compile-time format checks do not build under nvcc, and a .cu launcher needs
// nothing of it but a call.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "dp/kernels/batchnorm.h"
#include "dp/kernels/conv2d.h"
#include "dp/kernels/pool_shape.h"

namespace dp::kernels::checks {

// InvalidArgument naming `op` and the first null pointer among the named ones.
using NamedPointers = std::initializer_list<std::pair<const char*, const void*>>;
void present(const char* op, NamedPointers pointers);

// Shapes PyTorch rejects too: non-positive extents, stride < 1, negative padding, a kernel larger
// than the padded input (h_out() rounds toward zero, so it would yield a bogus 1-pixel output).
void conv2d(const char* op, const Conv2dShape& shape);
// The shared im2col path indexes with int: every tensor, col included, below 2^31 elements.
void conv2d_int_range(const char* op, const Conv2dShape& shape, std::int64_t largest_elements);

// Negative extents; in training (statistics), more than one value per channel.
void batchnorm(const char* op, const BatchNormShape& shape, bool training);
// SyncBatchNorm's count over all replicas.
void sync_batchnorm_count(const char* op, std::int64_t global_count, std::int64_t local_count);

// torch's pool2d_shape_check (MaxPool2d and AvgPool2d alike): non-negative extents, kernel and
// stride >= 1, 0 <= pad <= kernel/2, a window that fits in the padded input.
void pool2d(const char* op, const Pool2dShape& shape);
// pool2d, and a plane small enough for int32 argmax.
void maxpool(const char* op, const Pool2dShape& shape);
// n, c >= 0 and a non-empty plane.
void global_avgpool(const char* op, int n, int c, int hw);

// p in [0, 1] (torch's check), n >= 0, element_offset >= 0.
void dropout(const char* op, std::int64_t n, double p, std::int64_t element_offset);

// Negative extents of a (n, in) -> (n, out) linear layer.
void linear(const char* op, int n, int in, int out);

// n >= 0 and classes > 0; mean_over > 0 (when given, backward).
void cross_entropy(const char* op, int n, int classes, int mean_over = 1);
// label_smoothing in [0, 1] (torch's check).
void label_smoothing(const char* op, double label_smoothing);
// A target outside [0, classes) (sim reports it from the stream, see loss.cu).
[[noreturn]] void bad_target(const char* op, std::int64_t target, std::int64_t sample, int classes);

// momentum != 0 needs a momentum buffer of the n parameters.
void sgd_buffer(std::int64_t n, float momentum, const float* buffer);

// AdamW's step counts from 1.
void adamw_step(std::int64_t step);

}  // namespace dp::kernels::checks
