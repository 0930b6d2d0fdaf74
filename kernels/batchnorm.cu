// batchnorm.cu — launchers for kernels/batchnorm.h (being written).
#include "kernels/batchnorm.h"
