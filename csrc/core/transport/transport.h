// The point-to-point interface that every transport offers (shared memory, TCP) and that the
// cross-host algorithms are written against.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "../dtype.h"

namespace braid {

struct CollectiveDesc;

// Which stream of a peer pair a transfer travels on. Collective traffic has a stream of its own
// so that a user's eager send (delivered before its receive is posted) can never be taken for a
// collective's data, whatever the two ranks issue in between.
enum class Channel : int { kUser = 0, kCollective = 1 };
constexpr int kNumChannels = 2;

// One point-to-point transfer in progress. Transfers with one peer, in one direction and on one
// channel, are matched in issue order: a transport advances only the first unfinished one of each
// such lane, and a receive must name the size and dtype of the matching send (a difference raises
// a mismatch on the receiver).
struct P2POp {
  int peer = 0;          // in the transport's numbering
  bool send = true;
  char* data = nullptr;  // send: read only
  size_t bytes = 0;
  DType dtype = DType::kFloat32;
  Channel channel = Channel::kUser;
  // The collective this transfer belongs to (null for the user's point-to-point): a transport
  // that can carry it (TCP) sends it along and the receiver compares it with its own.
  const CollectiveDesc* desc = nullptr;
  size_t off = 0;        // bytes moved so far
  bool done = false;     // a zero-byte transfer still moves one (empty) chunk
  // send: part of an all-to-all with split sizes, which waits for every receive anyway: a
  // transport may hold the send until its receiver has read the data where it lies (on one host,
  // from a registered buffer: ShmGroup::advance) at any size, not only past its eager capacity.
  bool exchange = false;
  // send: the transport's state of a data-in-place offer awaiting the receiver (ShmGroup: the
  // mailbox chunk number + 1 of the offer; 0: none). Kept with the op so that a send stopped part
  // way resumes where it was.
  uint64_t offer = 0;
  bool declined = false;  // the receiver could not read in place: the data goes through chunks
  bool in_place = false;  // the receiver read the data where the sender holds it (both sides)
  std::string describe() const;
};

class Transport {
 public:
  virtual ~Transport() = default;
  // Moves every byte of `op` it can without waiting; returns whether `op` is finished.
  virtual bool advance(P2POp& op) = 0;
  // Waits until one of `ops` can move or `interrupted()` is true, with the deadline, liveness and
  // abort handling of every wait (CommTimeout naming the peers of `ops`, PeerError, ...).
  virtual void wait(P2POp* const* ops, int nops, const std::function<bool()>& interrupted) = 0;
  // Wakes the thread in wait() (e.g. when what `interrupted` watches changed).
  virtual void wake() noexcept = 0;

  // Runs `ops` to completion together: every op is advanced as its peer allows, in lane order.
  void run(P2POp* const* ops, int nops);
};

// Transfers moved together over one transport, more added while the others run: each lane
// (peer, direction, channel) advances from its head, in issue order. The ops are not owned.
// `t` may be null while no op is added (a group of one).
class TransferSet {
 public:
  explicit TransferSet(Transport* t) : t_(t) {}
  void add(P2POp* op);
  // Advances the head of every lane; waits when none could move, unless `may_wait` is false
  // (the caller has other work in between). Returns false once every transfer is done.
  bool step(bool may_wait = true);
  void run() {
    while (step()) {
    }
  }

 private:
  struct Lane {
    int peer;
    bool send;
    Channel channel;
    std::vector<P2POp*> ops;
    size_t next = 0;  // the head: every op before it is done
  };
  // Moves `lane` from its head as far as it goes (`moved` set when anything did).
  void advance_lane(Lane& lane, bool& moved);

  Transport* t_;
  std::vector<Lane> lanes_;
  std::vector<P2POp*> heads_;
  size_t left_ = 0;
};

}  // namespace braid
