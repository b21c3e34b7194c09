// Collective algorithms over a shared-memory rank group. Every algorithm starts with an arrival
// step in which all ranks post the same step number and compare descriptors (ShmGroup::arrive),
// so ranks that picked different collectives or algorithms detect it before touching data.
#pragma once

#include <cstddef>

#include "../copy.h"
#include "../dtype.h"
#include "../transport/shm/group.h"

namespace braid {

// Elements per piece so that `parts` pieces of `elem_bytes` fit a slot; multiples of 16 elements
// (64-byte lines for float32) when there is room.
size_t slot_elems(size_t slot_bytes, size_t parts, size_t elem_bytes);

// One-shot: data rides with the arrival step in the one-shot buffers.
void oneshot_all_reduce(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out);
void oneshot_reduce_scatter(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out);
void oneshot_all_gather(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out);
void oneshot_broadcast(ShmGroup& g, const CollectiveDesc& d, void* data);
void barrier(ShmGroup& g, const CollectiveDesc& d);

// All-to-all: `in` holds n chunks of d.count elements (chunk j for rank j), `out` receives n
// chunks (chunk j from rank j). One-shot when the published chunks fit, pipelined otherwise.
void oneshot_all_to_all(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out);
void pipelined_all_to_all(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out);

// Pipelined through the slots, several rounds per message.
void twoshot_all_reduce(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out);
void ring_all_reduce(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out);
void pipelined_reduce_scatter(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out);
void pipelined_all_gather(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out);
void pipelined_broadcast(ShmGroup& g, const CollectiveDesc& d, void* data);

// On registered buffers (window_collectives.cc): when the data lies in the same window on every
// rank (all_reduce: in place), read the peers' buffers in place and return true; otherwise
// return false, having arrived, and the caller runs the algorithm above.
bool window_all_reduce(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out);
bool window_reduce_scatter(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out);
bool window_all_gather(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out);
bool window_all_to_all(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out);
bool window_broadcast(ShmGroup& g, const CollectiveDesc& d, void* data);
// The in-place all_reduce on registered buffers once arrived, `data[r]` rank r's buffer (the
// one-shot all_reduce's path for them too).
void window_all_reduce_arrived(ShmGroup& g, const CollectiveDesc& d, const char* const* data, void* out);

}  // namespace braid
