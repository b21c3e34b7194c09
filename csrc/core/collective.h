// The collective vocabulary shared by the communicator, the algorithms and every transport: what
// a call is (CollKind) and the descriptor that ranks compare before moving data.
#pragma once

#include <cstdint>
#include <string>

namespace braid {

enum class CollKind : uint32_t {
  kAllReduce = 1,
  kReduceScatter = 2,
  kAllGather = 3,
  kBroadcast = 4,
  kBarrier = 5,
  kAllToAll = 6,  // rank r receives every rank's chunk r (compressed reduce-scatter)
  // Point-to-point (not collectives: they carry no descriptor and take no sequence number).
  kSend = 7,
  kRecv = 8,
  // The collective start of an all-to-all with split sizes (Communicator::submit_exchange): every
  // rank arrives with it before the point-to-point transfers, so that ranks that disagree on
  // what they call (one of them an equal-split all_to_all, say) fail with a mismatch at once.
  kExchange = 9,
};
const char* coll_kind_name(CollKind k);

// What a rank is about to do; every rank compares its own with every peer's before moving data.
// 24 bytes: both parities fit the cache line of the step counter, so a peer's arrival and what it
// announced cross between cores in one transfer.
struct CollectiveDesc {
  uint64_t seq = 0;     // 1-based count of collectives issued on this communicator
  uint64_t count = 0;   // elements per rank (all_reduce, broadcast: of the tensor)
  uint32_t root = 0;    // broadcast source; a reduce's destination (all_reduce); all_gather /
                        // all_to_all: the caller's tag (Request::tag). One word for both, as
                        // none of these kinds has both: the step counter and two descriptors
                        // fill one cache line (segment_header.h), which a fifth word overflows.
  uint8_t kind = 0;     // CollKind
  uint8_t dtype = 0;    // DType
  uint8_t op = 0;       // ReduceOp (0 where no reduction)
  uint8_t algo = 0;     // Algo chosen by the tuner; differing choices must not meet
  bool operator==(const CollectiveDesc& o) const;
  std::string describe() const;
};

}  // namespace braid
