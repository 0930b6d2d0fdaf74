// dp/engine.h — moved to <dp/engines/engine.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/engines/engine.h"
