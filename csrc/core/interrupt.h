// Interrupting long waits. Python runs signal handlers (Ctrl-C's KeyboardInterrupt, a test
// runner's alarm) only on its main thread between bytecodes, so a main thread blocked in a
// collective whose peer never comes would ignore Ctrl-C until the deadline, minutes later. The
// torch binding installs a hook that runs pending handlers; waits that have lasted 100 ms call it
// every 50-100 ms (never on the fast path: it takes the GIL) and end with Interrupted when it
// says so.
#pragma once

#include <string>

#include "errors.h"

namespace braid {

// Returns true when the calling thread must stop waiting. Called without locks held.
using InterruptHook = bool (*)();

void set_interrupt_hook(InterruptHook hook) noexcept;
bool interrupt_hook_installed() noexcept;
// Asks the hook (false without one). A caller that gets true must end its wait by throwing
// Interrupted: the hook may have taken charge of a pending exception that the binding re-raises.
bool interrupt_requested();

// A wait ended by interrupt_requested(). Its kind is kGeneric: the binding re-raises what the
// hook took over (KeyboardInterrupt, ...) instead, and peers see the failure as a PeerError.
class Interrupted : public CommError {
 public:
  explicit Interrupted(const std::string& msg) : CommError(ErrorKind::kGeneric, msg) {}
};

}  // namespace braid
