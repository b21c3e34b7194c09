// System-call error helper.
#include "errors.h"

#include <cstring>

namespace braid {

void throw_system_error(const std::string& what, int err) {
  throw CommError(ErrorKind::kGeneric, what + ": " + std::strerror(err));
}

}  // namespace braid
