// optimizer.cu — launchers for kernels/optimizer.h (being written).
#include "kernels/optimizer.h"
