// The allowed way down, as a control: kernels see the runtime through its kernel API.
#include "dp/runtime/kernel_api.h"
