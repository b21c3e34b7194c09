// A set of point-to-point transfers of one collective moved together over a PeerGroup's
// transport: each lane (peer, direction) in issue order, new transfers added while the others run.
#pragma once

#include <memory>
#include <vector>

#include "direct.h"

namespace braid {

class Transfers {
 public:
  explicit Transfers(const PeerGroup& g) : g_(g), lanes_(2 * g.members.size()) {}

  P2POp& add(int member, bool send, void* data, size_t bytes) {
    auto op = std::make_unique<P2POp>();
    op->peer = g_.members[static_cast<size_t>(member)];
    op->send = send;
    op->data = static_cast<char*>(data);
    op->bytes = bytes;
    op->dtype = DType::kUInt8;
    op->channel = Channel::kCollective;
    op->desc = g_.desc;
    lanes_[2 * static_cast<size_t>(member) + (send ? 1 : 0)].push_back(op.get());
    ops_.push_back(std::move(op));
    ++left_;
    return *ops_.back();
  }

  // Advances the head of every lane (one peer, one direction: transfers match in issue order);
  // waits when none could move, unless `may_wait` is false (the caller has other work between).
  // Returns false once every transfer is done.
  bool step(bool may_wait = true) {
    if (left_ == 0) return false;
    bool moved = false;
    heads_.clear();
    for (Lane& lane : lanes_) {
      while (lane.next < lane.ops.size()) {
        P2POp& op = *lane.ops[lane.next];
        const size_t before = op.off;
        if (g_.transport->advance(op)) {
          ++lane.next;
          --left_;
          moved = true;
          continue;
        }
        moved = moved || op.off != before;
        heads_.push_back(&op);
        break;
      }
    }
    if (may_wait && left_ > 0 && !moved)
      g_.transport->wait(heads_.data(), static_cast<int>(heads_.size()), [] { return false; });
    return left_ > 0 || moved;
  }

  void run() {
    while (step()) {
    }
  }

 private:
  struct Lane {
    std::vector<P2POp*> ops;
    size_t next = 0;  // the head: every op before it is done
    void push_back(P2POp* op) { ops.push_back(op); }
  };
  const PeerGroup& g_;
  std::vector<std::unique_ptr<P2POp>> ops_;
  std::vector<Lane> lanes_;  // 2 * member + (send ? 1 : 0)
  std::vector<P2POp*> heads_;
  size_t left_ = 0;
};

}  // namespace braid
