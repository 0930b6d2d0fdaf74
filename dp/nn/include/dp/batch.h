// dp/batch.h — moved to <dp/nn/batch.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/nn/batch.h"
