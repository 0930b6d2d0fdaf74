// <dp/dp.h>, the user's one include, compiles with every layer's public headers on the include
// path but the kernels': users never include kernel headers, not even through dp.h.
#include "dp/dp.h"
