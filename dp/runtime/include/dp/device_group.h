// dp/device_group.h — moved to <dp/runtime/device_group.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/runtime/device_group.h"
