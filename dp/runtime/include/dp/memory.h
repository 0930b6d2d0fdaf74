// dp/memory.h — moved to <dp/runtime/memory.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/runtime/memory.h"
