// the runtime sits below the kernels.
#include "dp/kernels/ops.h"
