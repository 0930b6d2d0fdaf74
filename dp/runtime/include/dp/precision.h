// dp/precision.h — moved to <dp/runtime/precision.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/runtime/precision.h"
