// dp/checkpoint.h — moved to <dp/io/checkpoint.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/io/checkpoint.h"
