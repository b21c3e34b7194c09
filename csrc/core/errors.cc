// System-call error helper.
#include "errors.h"

#include <cstdio>
#include <cstring>

namespace braid {

const char* error_class_name(ErrorKind k) {
  switch (k) {
    case ErrorKind::kTimeout: return "CommTimeout";
    case ErrorKind::kPeer: return "PeerError";
    case ErrorKind::kMismatch: return "CollectiveMismatch";
    case ErrorKind::kClosed: return "CommClosed";
    default: return "CommError";
  }
}

void throw_system_error(const std::string& what, int err) {
  throw CommError(ErrorKind::kGeneric, what + ": " + std::strerror(err));
}

std::string number_text(double x) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", x);
  return buf;
}

}  // namespace braid
