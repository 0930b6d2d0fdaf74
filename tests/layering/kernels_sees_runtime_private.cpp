// kernels may not reach into the runtime's backends: only dp/runtime/kernel_api.h and the public headers.
#include "backend.h"
