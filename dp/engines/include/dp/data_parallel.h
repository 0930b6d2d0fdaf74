// dp/data_parallel.h — moved to <dp/engines/data_parallel.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/engines/data_parallel.h"
