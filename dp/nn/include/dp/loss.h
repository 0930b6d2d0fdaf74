// dp/loss.h — moved to <dp/nn/loss.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/nn/loss.h"
