// test_batchnorm_maxpool.cpp (being written)
#include <gtest/gtest.h>
