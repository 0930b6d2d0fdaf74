// dp/atomic_file.h — moved to <dp/io/atomic_file.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/io/atomic_file.h"
