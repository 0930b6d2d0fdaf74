// checks.h — what every launcher's argument checks share: the message builder (numbers written as
// fmt writes "{}", by the host compiler in checks.cpp: fmt does not build under nvcc), null
// operands, and the pooling shapes both pooling ops check. An op's own checks live beside it.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "dp/kernels/pool_shape.h"

namespace dp::kernels::checks {

// One piece of a check's message (implicit: a message is written as a list of pieces).
struct Text {
  std::string value;
  Text(const char* text) : value(text) {}
  Text(std::string text) : value(std::move(text)) {}
  Text(int number);
  Text(long number);
  Text(long long number);
  Text(float number);
  Text(double number);
};

// Throws InvalidArgument whose message is the pieces one after another.
[[noreturn]] void fail(std::initializer_list<Text> message);

// InvalidArgument naming `op` and the first null pointer among the named ones.
using NamedPointers = std::initializer_list<std::pair<const char*, const void*>>;
void present(const char* op, NamedPointers pointers);

// InvalidArgument naming `op` unless its activations (the flags: bf16 or fp32) share one storage type.
void same_storage(const char* op, std::initializer_list<bool> bf16);

// torch's pool2d_shape_check (MaxPool2d and AvgPool2d alike): non-negative extents, kernel and
// stride >= 1, 0 <= pad <= kernel/2, a window that fits in the padded input.
void pool2d(const char* op, const Pool2dShape& shape);
std::string describe(const Pool2dShape& shape);

}  // namespace dp::kernels::checks
