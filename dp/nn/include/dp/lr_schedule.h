// dp/lr_schedule.h — moved to <dp/nn/lr_schedule.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/nn/lr_schedule.h"
