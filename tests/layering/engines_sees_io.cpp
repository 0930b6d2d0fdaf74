// engines and io are beside each other: the tools combine them.
#include "dp/io/training_state.h"
