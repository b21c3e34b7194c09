// Where the one-shot collectives read a peer's data: its one-shot buffer, or, when every rank's
// data lies in the same registered buffer (ShmGroup's windows), the data itself, in place.
#pragma once

#include <cstddef>

#include "../transport/shm/group.h"

namespace braid {

// From this many bytes published per rank on, the one-shot collectives look for registered
// buffers (a record per rank beside the descriptor, read after the arrival); below it they run
// as they always did, their latency being the point there. The same on every rank: the choice
// to look depends on the size alone. Measured at 2 ranks (docs/results/
// 2026-11-28-epyc-2vcpu-registered.md, "The one-shot threshold"): reading in place with its
// closing step was 0.89-1.42x slower than the one-shot copies from 4 to 16 KiB, and faster
// (0.68-1.00 of the time) at 32 KiB.
constexpr size_t kOneShotWindowMinBytes = 32 << 10;

// Arrives at the one-shot collective `d` whose peers read this rank's [data, data + bytes), which
// `publish()` copies into its one-shot buffer. Returns true, with `peer_data[r]` rank r's data,
// when every rank's data lies in the same registered buffer: nobody copied, the caller reads the
// peers' data in place and ends with close_windows(). Otherwise returns false once every rank's
// one-shot buffer holds its data: where some ranks' data was registered and others' was not, the
// registered ones copy after the arrival and every rank waits for one more step.
template <class Publish>
bool oneshot_arrive(ShmGroup& g, const CollectiveDesc& d, const void* data, size_t bytes, Publish publish,
                    const char** peer_data) {
  if (bytes < kOneShotWindowMinBytes) {
    publish();
    g.arrive(d);
    return false;
  }
  const bool mine = g.publish_window(d, data, bytes);
  if (!mine) publish();
  g.arrive(d);
  switch (g.windows_at(d, peer_data)) {
    case ShmGroup::Windows::kAll:
      return true;
    case ShmGroup::Windows::kNone:
      return false;
    case ShmGroup::Windows::kSome:
      break;
  }
  if (mine) publish();
  g.wait_all(g.post_next());
  return false;
}

// The closing step of a collective that read its peers' registered buffers: no rank changes its
// buffer while a peer still reads it.
inline void close_windows(ShmGroup& g) { g.wait_all(g.post_next()); }

}  // namespace braid
