// Registration of braid's torch.distributed backend class (backend.cpp) in the extension module.
#pragma once

#include <c10/util/intrusive_ptr.h>
#include <pybind11/pybind11.h>

namespace c10::ivalue {
struct Future;
}

namespace braid {

// Adds `Backend` (a c10d::Backend over a braid Communicator) to the module `m`.
void register_backend(pybind11::module_& m);

// `fut` as a torch.futures.Future: the get_future() of a c10d Work holding it (c10d's binding
// makes the Python object; jit/python/pybind_utils.h, which declares its class, costs a binding
// file about 20 s of compile time).
pybind11::object python_future(c10::intrusive_ptr<c10::ivalue::Future> fut);

}  // namespace braid
