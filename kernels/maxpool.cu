// maxpool.cu — launchers for kernels/maxpool.h (being written).
#include "kernels/maxpool.h"
