// models sit below the engines.
#include "dp/trainer.h"
