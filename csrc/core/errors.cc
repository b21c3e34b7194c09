// System-call error helper.
#include "errors.h"

#include <cstdio>
#include <cstring>

namespace braid {

void throw_system_error(const std::string& what, int err) {
  throw CommError(ErrorKind::kGeneric, what + ": " + std::strerror(err));
}

std::string number_text(double x) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", x);
  return buf;
}

}  // namespace braid
