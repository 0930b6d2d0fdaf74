// engines and io are beside each other: the tools combine them.
#include "dp/training_state.h"
