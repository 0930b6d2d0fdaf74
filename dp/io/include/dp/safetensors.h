// dp/safetensors.h — moved to <dp/io/safetensors.h>: this forwarding header goes away in the next release.
#pragma once

#include "dp/io/safetensors.h"
