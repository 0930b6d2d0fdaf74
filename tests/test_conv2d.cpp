// test_conv2d.cpp (being written)
#include <gtest/gtest.h>
