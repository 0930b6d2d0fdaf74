// The allowed way down, as a control: kernels see the runtime through its kernel API.
#include "dp/runtime/detail/kernel_api.h"
