// Stand-in for the CUDA toolkit header of this name in the host emulation of csrc/cuda.
#pragma once
#include "cuda_host/cuda_host.h"
