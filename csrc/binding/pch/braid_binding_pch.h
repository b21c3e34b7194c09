// The torch headers that the binding's files include, precompiled once per build: parsing them
// takes most of each file's compile time (about 40 of 55 s on 2 cores), so setup.py compiles this
// header into build/pch/braid_binding_pch.h.gch with the binding's own flags, and each binding
// file includes it first. Where no precompiled copy is there (another compiler, a failed
// precompile), the compiler includes this file itself: slower, same result.
#ifndef BRAID_BINDING_PCH_H_
#define BRAID_BINDING_PCH_H_

#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>

#endif  // BRAID_BINDING_PCH_H_
