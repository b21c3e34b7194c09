// A set of point-to-point transfers of one collective moved together over a PeerGroup's
// transport: each lane (peer, direction) in issue order, new transfers added while the others run.
#pragma once

#include <memory>
#include <vector>

#include "direct.h"

namespace braid {

// A collective's transfers over its PeerGroup (collective channel, the group's descriptor),
// owned here and moved by the transport's TransferSet.
class Transfers {
 public:
  explicit Transfers(const PeerGroup& g) : g_(g), set_(g.transport) {}

  P2POp& add(int member, bool send, void* data, size_t bytes) {
    auto op = std::make_unique<P2POp>();
    op->peer = g_.members[static_cast<size_t>(member)];
    op->send = send;
    op->data = static_cast<char*>(data);
    op->bytes = bytes;
    op->dtype = DType::kUInt8;
    op->channel = Channel::kCollective;
    op->desc = g_.desc;
    set_.add(op.get());
    ops_.push_back(std::move(op));
    return *ops_.back();
  }

  bool step(bool may_wait = true) { return set_.step(may_wait); }
  void run() { set_.run(); }

 private:
  const PeerGroup& g_;
  TransferSet set_;
  std::vector<std::unique_ptr<P2POp>> ops_;
};

}  // namespace braid
