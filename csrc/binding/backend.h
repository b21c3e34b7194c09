// Registration of braid's torch.distributed backend class (backend.cpp) in the extension module.
#pragma once

#include <pybind11/pybind11.h>

namespace braid {

// Adds `Backend` (a c10d::Backend over a braid Communicator) to the module `m`.
void register_backend(pybind11::module_& m);

}  // namespace braid
