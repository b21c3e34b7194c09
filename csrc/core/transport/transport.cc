// What every transport shares: describing a transfer, and running a set of them to completion.
#include "transport.h"

#include <vector>

namespace braid {

std::string P2POp::describe() const {
  return std::string(send ? "send of " : "recv of ") + std::to_string(bytes) + " bytes " + (send ? "to" : "from") +
         " rank " + std::to_string(peer);
}

void Transport::run(P2POp* const* ops, int nops) {
  // Only the first unfinished op of a lane (peer, direction, channel) may move.
  auto lane_head = [&](int i) {
    for (int j = 0; j < i; ++j)
      if (!ops[j]->done && ops[j]->peer == ops[i]->peer && ops[j]->send == ops[i]->send &&
          ops[j]->channel == ops[i]->channel)
        return false;
    return true;
  };
  std::vector<P2POp*> heads;
  for (;;) {
    bool moved = false, all_done = true;
    heads.clear();
    for (int i = 0; i < nops; ++i) {
      if (ops[i]->done || !lane_head(i)) {
        all_done = all_done && ops[i]->done;
        continue;
      }
      const size_t before = ops[i]->off;
      if (advance(*ops[i])) {
        moved = true;
        continue;
      }
      all_done = false;
      moved = moved || ops[i]->off != before;
      heads.push_back(ops[i]);
    }
    if (all_done) return;
    if (!moved) wait(heads.data(), static_cast<int>(heads.size()), [] { return false; });
  }
}

}  // namespace braid
