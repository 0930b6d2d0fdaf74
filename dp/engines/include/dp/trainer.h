// dp/trainer.h — moved to <dp/engines/trainer.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/engines/trainer.h"
