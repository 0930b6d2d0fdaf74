// loss.cu — launchers for kernels/loss.h (being written).
#include "kernels/loss.h"
