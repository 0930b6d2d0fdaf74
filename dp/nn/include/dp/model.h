// dp/model.h — moved to <dp/nn/model.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/nn/model.h"
