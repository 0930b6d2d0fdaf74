// dp/process_group.h — moved to <dp/runtime/process_group.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/runtime/process_group.h"
