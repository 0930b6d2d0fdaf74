// nn sits below the engines.
#include "dp/engines/engine.h"
