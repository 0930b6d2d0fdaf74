// test_loss_optimizer.cpp (being written)
#include <gtest/gtest.h>
