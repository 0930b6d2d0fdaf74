// cudnn_conv.cpp — cuDNN convolution path (being written).
#include "cudnn_conv.h"
