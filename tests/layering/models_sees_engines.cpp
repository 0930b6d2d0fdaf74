// models sit below the engines.
#include "dp/engines/trainer.h"
