// dp/tensor.h — moved to <dp/nn/tensor.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/nn/tensor.h"
