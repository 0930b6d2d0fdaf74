// dp/trace.h — moved to <dp/runtime/trace.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/runtime/trace.h"
