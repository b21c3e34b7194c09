// What every transport shares: describing a transfer, and running a set of them to completion.
#include "transport.h"

#include <algorithm>
#include <vector>

namespace braid {

std::string P2POp::describe() const {
  return std::string(send ? "send of " : "recv of ") + std::to_string(bytes) + " bytes " + (send ? "to" : "from") +
         " rank " + std::to_string(peer);
}

void Transport::run(P2POp* const* ops, int nops) {
  TransferSet set(this);
  for (int i = 0; i < nops; ++i) set.add(ops[i]);
  set.run();
}

void TransferSet::add(P2POp* op) {
  auto it = std::find_if(lanes_.begin(), lanes_.end(), [&](const Lane& l) {
    return l.peer == op->peer && l.send == op->send && l.channel == op->channel;
  });
  if (it == lanes_.end()) it = lanes_.insert(lanes_.end(), Lane{op->peer, op->send, op->channel, {}, 0});
  it->ops.push_back(op);
  if (!op->done) ++left_;
}

bool TransferSet::step(bool may_wait) {
  if (left_ == 0) return false;
  bool moved = false;
  heads_.clear();
  // Receives before sends: taking what a peer sent frees its sends, and a failed peer's abort
  // frame is read (its error reported) before a send to it meets the closed socket.
  for (const bool sends : {false, true}) {
    for (Lane& lane : lanes_) {
      if (lane.send != sends) continue;
      advance_lane(lane, moved);
    }
  }
  if (may_wait && left_ > 0 && !moved) t_->wait(heads_.data(), static_cast<int>(heads_.size()), [] { return false; });
  return left_ > 0 || moved;
}

void TransferSet::advance_lane(Lane& lane, bool& moved) {
  for (; lane.next < lane.ops.size(); ++lane.next) {
    P2POp& op = *lane.ops[lane.next];
    if (op.done) continue;  // finished before it was added
    const size_t before = op.off;
    if (t_->advance(op)) {
      --left_;
      moved = true;
      continue;
    }
    moved = moved || op.off != before;
    heads_.push_back(&op);
    return;
  }
}

}  // namespace braid
