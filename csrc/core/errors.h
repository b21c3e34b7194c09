// Typed communication errors thrown by the core; the binding maps each kind to a Python class.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace braid {

// Values are part of the binding ABI and of the shared-memory status record.
enum class ErrorKind : uint32_t {
  kNone = 0,
  kGeneric = 1,    // CommError
  kTimeout = 2,    // CommTimeout: a deadline passed while waiting for named ranks
  kPeer = 3,       // PeerError: a peer exited, closed or failed
  kMismatch = 4,   // CollectiveMismatch: ranks called different collectives
  kClosed = 5,     // CommClosed: use after close()
};

// Longer timeouts mean "wait for ever" and are cut to this (~31 years): in nanoseconds it still
// fits an int64 added to a clock reading (1e10 s, a common "forever", overflowed to a deadline in
// the past).
constexpr double kMaxTimeoutSeconds = 1e9;

class CommError : public std::runtime_error {
 public:
  CommError(ErrorKind kind, const std::string& msg) : std::runtime_error(msg), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

// The Python class an error kind raises as (CommTimeout, PeerError, ...), for messages.
const char* error_class_name(ErrorKind k);

// Thrown for errno-carrying system call failures during setup.
[[noreturn]] void throw_system_error(const std::string& what, int err);

// A number as messages show it (printf's %g: 6 significant digits, no trailing zeros). The core
// builds its text without iostreams, whose inline code can disagree with an older libstdc++ at
// run time (tunables.cc).
std::string number_text(double x);

}  // namespace braid
