// io and engines are beside each other: the tools combine them.
#include "dp/engines/ddp.h"
