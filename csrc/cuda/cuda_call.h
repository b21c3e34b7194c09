// What every torch-free CUDA engine of csrc/cuda does around its runtime calls: a failing call
// becomes an exception naming it, and a scope makes a device current for the calls in it.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace braid {
namespace cuda {

// Throws std::runtime_error "`who`: `what`: the CUDA error" when `e` is an error.
inline void check_call(cudaError_t e, const char* who, const std::string& what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(who) + ": " + what + ": " + cudaGetErrorString(e));
}

// Makes `device` current for a scope and restores the previous one: the communicator's thread may
// have another device current, and allocations, IPC mappings, events and launches go to the
// current device.
class DeviceScope {
 public:
  DeviceScope(int device, const char* who) {
    check_call(cudaGetDevice(&previous_), who, "cudaGetDevice");
    if (previous_ != device) check_call(cudaSetDevice(device), who, "cudaSetDevice(" + std::to_string(device) + ")");
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace cuda
}  // namespace braid
