// The collective vocabulary: names and descriptions for messages.
#include "collective.h"

#include <sstream>

#include "dtype.h"
#include "tunables.h"

namespace braid {

const char* coll_kind_name(CollKind k) {
  switch (k) {
    case CollKind::kAllReduce: return "all_reduce";
    case CollKind::kReduceScatter: return "reduce_scatter";
    case CollKind::kAllGather: return "all_gather";
    case CollKind::kBroadcast: return "broadcast";
    case CollKind::kBarrier: return "barrier";
    case CollKind::kAllToAll: return "all_to_all";
    case CollKind::kSend: return "send";
    case CollKind::kRecv: return "recv";
    case CollKind::kExchange: return "all_to_all with split sizes";
  }
  return "unknown";
}

bool CollectiveDesc::operator==(const CollectiveDesc& o) const {
  return seq == o.seq && count == o.count && kind == o.kind && dtype == o.dtype && op == o.op &&
         root == o.root && algo == o.algo;
}

std::string CollectiveDesc::describe() const {
  std::ostringstream s;
  const auto k = static_cast<CollKind>(kind);
  s << coll_kind_name(k) << " #" << seq;
  if (k == CollKind::kBarrier) return s.str();
  if (k == CollKind::kExchange) return s.str() + " (" + dtype_name(static_cast<DType>(dtype)) + ")";
  s << " (" << dtype_name(static_cast<DType>(dtype)) << ", count " << count;
  if (k == CollKind::kAllReduce || k == CollKind::kReduceScatter)
    s << ", op " << reduce_op_name(static_cast<ReduceOp>(op));
  if (k == CollKind::kBroadcast) s << ", src " << root;
  if (k == CollKind::kAllReduce && root != 0) s << ", root " << root;  // a reduce's destination
  if ((k == CollKind::kAllGather || k == CollKind::kAllToAll) && root != 0)
    s << ", tag " << std::hex << std::showbase << root << std::dec << std::noshowbase;
  s << ", algo " << algo_name(static_cast<Algo>(algo)) << ")";  // algo is a byte: not a character
  return s.str();
}

}  // namespace braid
