// dp/collectives.h — moved to <dp/runtime/collectives.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/runtime/collectives.h"
