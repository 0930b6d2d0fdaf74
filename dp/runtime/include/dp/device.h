// dp/device.h — moved to <dp/runtime/device.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/runtime/device.h"
