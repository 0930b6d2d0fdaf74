// the engines train any dp::Model: they never depend on the reference models.
#include "dp/models/mlp.h"
