// dp/scratch.h — moved to <dp/runtime/scratch.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/runtime/scratch.h"
