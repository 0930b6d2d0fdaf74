// conv2d.cu — launchers for kernels/conv2d.h (being written).
#include "kernels/conv2d.h"
