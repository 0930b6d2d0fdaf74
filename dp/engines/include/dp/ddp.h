// dp/ddp.h — moved to <dp/engines/ddp.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/engines/ddp.h"
