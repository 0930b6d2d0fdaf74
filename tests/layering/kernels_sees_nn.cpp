// kernels sit below nn: the model interface is not theirs to include.
#include "dp/nn/model.h"
