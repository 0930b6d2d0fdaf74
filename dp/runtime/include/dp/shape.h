// dp/shape.h — moved to <dp/runtime/shape.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/runtime/shape.h"
