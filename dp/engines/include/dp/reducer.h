// dp/reducer.h — moved to <dp/engines/reducer.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/engines/reducer.h"
