// dp/error.h — moved to <dp/runtime/error.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/runtime/error.h"
