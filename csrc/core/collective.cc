// The collective vocabulary: names and descriptions for messages.
#include "collective.h"

#include <cstdio>

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
  const auto k = static_cast<CollKind>(kind);
  std::string s = std::string(coll_kind_name(k)) + " #" + std::to_string(seq);
  if (k == CollKind::kBarrier) return s;
  if (k == CollKind::kExchange) return s + " (" + dtype_name(static_cast<DType>(dtype)) + ")";
  s += std::string(" (") + dtype_name(static_cast<DType>(dtype)) + ", count " + std::to_string(count);
  if (k == CollKind::kAllReduce || k == CollKind::kReduceScatter)
    s += std::string(", op ") + reduce_op_name(static_cast<ReduceOp>(op));
  if (k == CollKind::kBroadcast) s += ", src " + std::to_string(root);
  if (k == CollKind::kAllReduce && root != 0) s += ", root " + std::to_string(root);  // a reduce's destination
  if ((k == CollKind::kAllGather || k == CollKind::kAllToAll) && root != 0) {
    char tag[24];
    std::snprintf(tag, sizeof(tag), "%#llx", static_cast<unsigned long long>(root));
    s += std::string(", tag ") + tag;
  }
  s += std::string(", algo ") + algo_name(static_cast<Algo>(algo)) + ")";  // algo is a byte: not a character
  return s;
}

}  // namespace braid
