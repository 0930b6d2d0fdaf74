// dp/data.h — moved to <dp/io/data.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/io/data.h"
