// dp/training_state.h — moved to <dp/io/training_state.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/io/training_state.h"
