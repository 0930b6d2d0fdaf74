// dp/optim.h — moved to <dp/nn/optim.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/nn/optim.h"
