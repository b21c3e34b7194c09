// Fork detection. A child of fork() inherits the parent's shared-memory mappings and objects but
// none of its threads, and any lock another thread held at that moment stays held in the child.
// A communicator seen from such a child must neither act as its parent's rank (it would steal or
// corrupt the parent's collectives, or announce the parent's departure to the peers) nor touch
// its progress thread or locks (joining a thread that does not exist blocks forever).
#pragma once

#include <cstdint>

namespace braid {

// Counts the forks between the first call in this process and now: each fork() child sees a value
// one higher than its parent did at the moment of the fork. The first call registers the counter
// (pthread_atfork); later calls are one relaxed atomic load.
uint64_t fork_generation() noexcept;

}  // namespace braid
