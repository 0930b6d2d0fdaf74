// nn sits below the engines.
#include "dp/engine.h"
