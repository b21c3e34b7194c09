// The schedules of the collectives between the ranks of one host on device memory (CUDA IPC),
// queued on an IpcEngine piece by piece.
//
// N ranks, this one r; S slots per rank, each of two areas of A bytes; es bytes per element.
// A call moves its data in pieces, piece g (numbered on from seq.piece + 1) in slot (g - 1) % S
// of every rank. Every piece opens with the wait that guards a slot ("guard": before a rank
// writes its slot for piece g > S, it waits for every peer's kReadDone of piece g - S) and ends
// with every rank signalling kReadDone, so whichever kind a later piece of that slot belongs to,
// the record it waits for is the latest one of that slot. Each host step carries the piece
// number in words[0] (the last piece used for steps outside any piece: an empty call's, a
// barrier's, all_to_all_v's exchange of counts), checked equal on every rank after the step.
//
// all_reduce, one-shot (count * es <= ipc_one_shot_max_bytes()), pieces of E = A / es elements:
//   step 0: guard; copy my input's piece into my area 0; signal kReady.
//   host step.
//   step 1: wait every peer's kReady; out piece = reduce of area 0 of ranks 0, 1, ..., N - 1;
//           signal kReadDone.
// all_reduce, two-shot (larger), pieces of E elements, a piece of L elements cut into N chunks:
//   chunk j is [begin(j), begin(j + 1)), begin(j) = min(j * c, L), c = ceil(L / N) rounded up to
//   whole 16 bytes, so that every chunk starts 16-byte aligned (in the area, and in the buffers
//   when they are); the last chunks may be short or empty.
//   step 0: guard; copy my input's piece into my area 0; signal kReady.
//   host step.
//   step 1: wait every peer's kReady; chunk r of my area 1 = reduce of chunk r of area 0 of ranks
//           0..N-1; signal kReduced.
//   host step.
//   step 2: wait every peer's kReduced; chunk j of out piece = chunk j of rank j's area 1, every
//           j; signal kReadDone.
// reduce_scatter and all_to_all (the input is N parts of `count` elements, part p at p * count):
//   a piece is the window [off, off + len) of every part, len <= w = A / (N * es) rounded down to
//   whole 16 bytes; part p's window lies at p * s in area 0, s = min(count, w) (when one window
//   holds the whole part, s = count and the N parts are copied in at once, as they lie).
//   step 0: guard; copy my N windows into my area 0; signal kReady.
//   host step.
//   step 1: reduce_scatter: wait every peer's kReady; out[off, off + len) = reduce of window r of
//           area 0 of ranks 0..N-1. all_to_all: for each p, wait p's kReady, then out part p's
//           window = window r of rank p's area 0. Signal kReadDone.
// all_gather (out part p at p * count receives rank p's input), pieces of E elements:
//   step 0: guard; copy my input's piece into my area 0; signal kReady.
//   host step.
//   step 1: for each p, wait p's kReady, then out part p's piece = rank p's area 0 (my own part
//           too, unless the input is that part: in place). Signal kReadDone.
// broadcast, pieces of E elements: the root's data stays where it is (copied to out when out is
//   another buffer).
//   step 0: the root: guard; copy its piece into its area 0; signal kReady.
//   host step.
//   step 1: the others: wait the root's kReady, copy its area 0 into out. Signal kReadDone.
// barrier: one host step, nothing on the device.
// all_to_all_v: one host step exchanges every rank's send and receive counts (checked on every
//   rank), then rounds of windows of P = A / (N * es) elements (rounded down to whole 16 bytes)
//   per (sender, receiver) pair; round k moves elements [k * P, (k + 1) * P) of each pair's
//   message, this rank's window for receiver q at q * P in its area 0:
//   step 0: guard; copy my nonempty windows into my area 0; signal kReady.
//   host step.
//   step 1: for each p that sends me something in this round, wait p's kReady, then copy window r
//           of p's area 0 to out. Signal kReadDone.
#include "ipc_collectives.h"

#include <algorithm>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "../tunables.h"

namespace braid {
namespace {

// Chunk and window starts stay on this boundary where the sizes allow: the device's copies and
// reductions move 16 bytes per thread when their pointers are aligned to it.
constexpr size_t kAlignBytes = 16;

size_t align_elems(size_t es) { return std::max<size_t>(1, kAlignBytes / es); }

// `elems` rounded down to whole 16 bytes, unless that leaves nothing.
size_t align_down(size_t elems, size_t es) {
  const size_t a = align_elems(es);
  return elems >= a ? elems / a * a : elems;
}

size_t align_up(size_t elems, size_t es) {
  const size_t a = align_elems(es);
  return (elems + a - 1) / a * a;
}

// Elements per part (or per pair) of a piece when area 0 holds one window for each of N parts.
size_t window_elems(const IpcEngine& e, int world, size_t es) {
  const size_t w = align_down(e.area_bytes() / (static_cast<size_t>(world) * es), es);
  if (w == 0)
    throw std::invalid_argument("IPC scratch areas of " + std::to_string(e.area_bytes()) + " bytes cannot hold " +
                                std::to_string(world) + " windows of " + std::to_string(es) + "-byte elements");
  return w;
}

// FNV-1a over the fields' bytes: equal calls give equal tags on every rank and in every build.
uint32_t call_tag(std::initializer_list<uint64_t> fields) {
  uint32_t h = 2166136261u;
  for (uint64_t f : fields) {
    for (int b = 0; b < 8; ++b) {
      h ^= static_cast<uint32_t>((f >> (8 * b)) & 0xFF);
      h *= 16777619u;
    }
  }
  return h;
}

// One call on one rank: the piece it is at, its slot, and the engine calls on them.
class Call {
 public:
  Call(IpcEngine& e, IpcSequence& seq, const IpcHostStep& step, int rank, int world, uint32_t tag)
      : e_(e), seq_(seq), step_(step), rank_(rank), world_(world), tag_(tag) {}

  // Starts the next piece. A rank that writes its slot for it first waits until every peer has
  // read what the slot held S pieces ago (the guard).
  void next_piece(bool writes) {
    g_ = ++seq_.piece;
    const auto slots = static_cast<uint64_t>(e_.slots());
    slot_ = static_cast<int>((g_ - 1) % slots);
    if (writes && g_ > slots)
      for (int p = 0; p < world_; ++p)
        if (p != rank_) e_.wait(p, IpcEvent::kReadDone, slot_, g_ - slots);
  }
  char* area(int peer, int a) { return e_.scratch(peer, slot_, a); }
  void signal(IpcEvent ev) { e_.signal(ev, slot_, g_); }
  void wait(int peer, IpcEvent ev) {
    if (peer != rank_) e_.wait(peer, ev, slot_, g_);
  }
  void wait_all(IpcEvent ev) {
    for (int p = 0; p < world_; ++p) wait(p, ev);
  }
  // The host step of the current piece.
  void host_step() { exchange({static_cast<int64_t>(g_)}); }
  // A host step of `words` (words[0]: the piece it belongs to); every rank's words, rank-major.
  // A rank at another piece means the schedules diverged on equal calls (the tag already told
  // different calls apart): a bug, not a user error.
  std::vector<int64_t> exchange(std::vector<int64_t> words) {
    const size_t per = words.size();
    const int64_t piece = words[0];
    step_(tag_, words);
    if (words.size() != per * static_cast<size_t>(world_))
      throw std::logic_error("IPC host step returned " + std::to_string(words.size()) + " words, expected " +
                             std::to_string(per * static_cast<size_t>(world_)));
    for (int p = 0; p < world_; ++p)
      if (words[static_cast<size_t>(p) * per] != piece)
        throw std::logic_error("IPC host step: rank " + std::to_string(p) + " is at piece " +
                               std::to_string(words[static_cast<size_t>(p) * per]) + ", rank " +
                               std::to_string(rank_) + " at piece " + std::to_string(piece));
    return words;
  }
  // The host step of a call that moves nothing.
  void empty_step() { exchange({static_cast<int64_t>(seq_.piece)}); }

  IpcEngine& engine() { return e_; }
  int rank() const { return rank_; }
  int world() const { return world_; }

 private:
  IpcEngine& e_;
  IpcSequence& seq_;
  const IpcHostStep& step_;
  const int rank_, world_;
  const uint32_t tag_;
  uint64_t g_ = 0;
  int slot_ = 0;
};

// dst = src, `elems` elements; nothing is queued for none.
void copy_elems(IpcEngine& e, char* dst, const char* src, size_t elems, size_t es) {
  if (elems > 0) e.copy(dst, src, elems * es);
}

// The pointers to the same offset of area `a` of every rank, in rank order.
std::vector<const void*> areas_at(Call& c, int a, size_t byte_offset) {
  std::vector<const void*> srcs(static_cast<size_t>(c.world()));
  for (int p = 0; p < c.world(); ++p) srcs[static_cast<size_t>(p)] = c.area(p, a) + byte_offset;
  return srcs;
}

void all_reduce_one_shot(Call& c, const Request& r, const char* in, char* out, size_t es) {
  IpcEngine& e = c.engine();
  const int me = c.rank(), n = c.world();
  const size_t piece = e.area_bytes() / es;
  for (size_t off = 0; off < r.count; off += piece) {
    const size_t len = std::min(piece, r.count - off);
    c.next_piece(true);
    copy_elems(e, c.area(me, 0), in + off * es, len, es);
    c.signal(IpcEvent::kReady);
    c.host_step();
    c.wait_all(IpcEvent::kReady);
    const auto srcs = areas_at(c, 0, 0);
    e.reduce(out + off * es, srcs.data(), n, len, r.dtype, r.op, n);
    c.signal(IpcEvent::kReadDone);
  }
}

void all_reduce_two_shot(Call& c, const Request& r, const char* in, char* out, size_t es) {
  IpcEngine& e = c.engine();
  const int me = c.rank(), n = c.world();
  const size_t piece = e.area_bytes() / es;
  for (size_t off = 0; off < r.count; off += piece) {
    const size_t len = std::min(piece, r.count - off);
    const size_t chunk = align_up((len + n - 1) / n, es);
    auto begin = [&](int j) { return std::min(static_cast<size_t>(j) * chunk, len); };
    c.next_piece(true);
    copy_elems(e, c.area(me, 0), in + off * es, len, es);
    c.signal(IpcEvent::kReady);
    c.host_step();
    c.wait_all(IpcEvent::kReady);
    const size_t mine = begin(me), mine_len = begin(me + 1) - mine;
    if (mine_len > 0) {
      const auto srcs = areas_at(c, 0, mine * es);
      e.reduce(c.area(me, 1) + mine * es, srcs.data(), n, mine_len, r.dtype, r.op, n);
    }
    c.signal(IpcEvent::kReduced);
    c.host_step();
    for (int j = 0; j < n; ++j) {
      const size_t b = begin(j), l = begin(j + 1) - b;
      if (l == 0) continue;
      c.wait(j, IpcEvent::kReduced);
      copy_elems(e, out + (off + b) * es, c.area(j, 1) + b * es, l, es);
    }
    c.signal(IpcEvent::kReadDone);
  }
}

// reduce_scatter and all_to_all: the windows of the N input parts, piece by piece.
void parts_by_windows(Call& c, const Request& r, const char* in, char* out, size_t es) {
  IpcEngine& e = c.engine();
  const int me = c.rank(), n = c.world();
  const size_t w = window_elems(e, n, es), s = std::min(r.count, w);
  for (size_t off = 0; off < r.count; off += w) {
    const size_t len = std::min(w, r.count - off);
    c.next_piece(true);
    if (r.count <= w) {
      copy_elems(e, c.area(me, 0), in, static_cast<size_t>(n) * r.count, es);
    } else {
      for (int p = 0; p < n; ++p)
        copy_elems(e, c.area(me, 0) + p * s * es, in + (p * r.count + off) * es, len, es);
    }
    c.signal(IpcEvent::kReady);
    c.host_step();
    if (r.kind == CollKind::kReduceScatter) {
      c.wait_all(IpcEvent::kReady);
      const auto srcs = areas_at(c, 0, me * s * es);
      e.reduce(out + off * es, srcs.data(), n, len, r.dtype, r.op, n);
    } else {
      for (int p = 0; p < n; ++p) {
        c.wait(p, IpcEvent::kReady);
        copy_elems(e, out + (p * r.count + off) * es, c.area(p, 0) + me * s * es, len, es);
      }
    }
    c.signal(IpcEvent::kReadDone);
  }
}

void all_gather(Call& c, const Request& r, const char* in, char* out, size_t es) {
  IpcEngine& e = c.engine();
  const int me = c.rank(), n = c.world();
  const size_t piece = e.area_bytes() / es;
  const bool in_place = in == out + me * r.count * es;
  for (size_t off = 0; off < r.count; off += piece) {
    const size_t len = std::min(piece, r.count - off);
    c.next_piece(true);
    copy_elems(e, c.area(me, 0), in + off * es, len, es);
    c.signal(IpcEvent::kReady);
    c.host_step();
    for (int p = 0; p < n; ++p) {
      if (p == me && in_place) continue;
      c.wait(p, IpcEvent::kReady);
      copy_elems(e, out + (p * r.count + off) * es, c.area(p, 0), len, es);
    }
    c.signal(IpcEvent::kReadDone);
  }
}

void broadcast(Call& c, const Request& r, const char* in, char* out, size_t es) {
  IpcEngine& e = c.engine();
  const int me = c.rank(), root = r.root;
  const size_t piece = e.area_bytes() / es;
  for (size_t off = 0; off < r.count; off += piece) {
    const size_t len = std::min(piece, r.count - off);
    c.next_piece(me == root);
    if (me == root) {
      copy_elems(e, c.area(me, 0), in + off * es, len, es);
      c.signal(IpcEvent::kReady);
      if (out != in) copy_elems(e, out + off * es, in + off * es, len, es);
    }
    c.host_step();
    if (me != root) {
      c.wait(root, IpcEvent::kReady);
      copy_elems(e, out + off * es, c.area(root, 0), len, es);
    }
    c.signal(IpcEvent::kReadDone);
  }
}

}  // namespace

size_t ipc_one_shot_max_bytes() {
  static const size_t bytes = Tunables::from_env().ipc_one_shot_max_bytes;
  return bytes;
}

void run_ipc(IpcEngine& engine, IpcSequence& seq, const Request& r, int rank, int world, const IpcHostStep& step) {
  const size_t es = dtype_size(r.dtype);
  const bool reduces = r.kind == CollKind::kAllReduce || r.kind == CollKind::kReduceScatter;
  const bool two_shot = r.kind == CollKind::kAllReduce && r.count * es > ipc_one_shot_max_bytes();
  // The algorithm is part of the call: ranks whose thresholds differ fail at the first step.
  const uint32_t tag = call_tag({static_cast<uint64_t>(r.kind), static_cast<uint64_t>(r.dtype), r.count,
                                 reduces ? static_cast<uint64_t>(r.op) : 0,
                                 r.kind == CollKind::kBroadcast ? static_cast<uint64_t>(r.root) : 0,
                                 two_shot ? 2u : 1u});
  Call c(engine, seq, step, rank, world, tag);
  const auto* in = static_cast<const char*>(r.in);
  auto* out = static_cast<char*>(r.out);
  if (r.count == 0 && r.kind != CollKind::kBarrier) {
    c.empty_step();
    return;
  }
  switch (r.kind) {
    case CollKind::kAllReduce:
      if (two_shot) {
        all_reduce_two_shot(c, r, in, out, es);
      } else {
        all_reduce_one_shot(c, r, in, out, es);
      }
      return;
    case CollKind::kReduceScatter:
    case CollKind::kAllToAll:
      parts_by_windows(c, r, in, out, es);
      return;
    case CollKind::kAllGather:
      all_gather(c, r, in, out, es);
      return;
    case CollKind::kBroadcast:
      broadcast(c, r, in, out, es);
      return;
    case CollKind::kBarrier:
      c.empty_step();
      return;
    case CollKind::kSend:
    case CollKind::kRecv:
    case CollKind::kExchange:
      break;
  }
  throw std::invalid_argument(std::string("run_ipc: ") + coll_kind_name(r.kind) + " has no IPC schedule");
}

void run_ipc_all_to_all_v(IpcEngine& engine, IpcSequence& seq, DType dtype, const void* in, void* out,
                          const std::vector<int64_t>& send_counts, const std::vector<int64_t>& send_offsets,
                          const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_offsets,
                          int rank, int world, const IpcHostStep& step) {
  const size_t es = dtype_size(dtype), n = static_cast<size_t>(world);
  // kExchange: the kind of the collective start of the staged path's all_to_all_v.
  const uint32_t tag = call_tag({static_cast<uint64_t>(CollKind::kExchange), static_cast<uint64_t>(dtype)});
  Call c(engine, seq, step, rank, world, tag);

  // Every rank's words: [piece, sends to 0..N-1, receives from 0..N-1].
  std::vector<int64_t> words{static_cast<int64_t>(seq.piece)};
  words.insert(words.end(), send_counts.begin(), send_counts.end());
  words.insert(words.end(), recv_counts.begin(), recv_counts.end());
  const std::vector<int64_t> all = c.exchange(std::move(words));
  const size_t per = 1 + 2 * n;
  auto sends = [&](size_t p, size_t q) { return all[p * per + 1 + q]; };
  auto expects = [&](size_t q, size_t p) { return all[q * per + 1 + n + p]; };

  // Every rank sees every count, so every rank finds the same disagreements and throws alike.
  constexpr int kNamed = 4;
  std::string bad;
  int disagreements = 0;
  int64_t longest = 0;
  for (size_t p = 0; p < n; ++p) {
    for (size_t q = 0; q < n; ++q) {
      const int64_t s = sends(p, q), x = expects(q, p);
      longest = std::max(longest, s);
      if (s == x && s >= 0) continue;
      if (disagreements++ < kNamed)
        bad += std::string(bad.empty() ? "" : "; ") + "rank " + std::to_string(p) + " sends " + std::to_string(s) +
               " elements to rank " + std::to_string(q) + ", which expects " + std::to_string(x);
    }
  }
  if (disagreements > 0) {
    if (disagreements > kNamed) bad += "; and " + std::to_string(disagreements - kNamed) + " more pairs";
    throw std::invalid_argument("all_to_all_v: the split sizes of the ranks disagree: " + bad);
  }

  const size_t window = window_elems(engine, world, es);
  const auto rounds = (static_cast<size_t>(longest) + window - 1) / window;
  const auto* src = static_cast<const char*>(in);
  auto* dst = static_cast<char*>(out);
  // Elements [base, base + window) of a message of `count`: how many there are.
  auto in_window = [&](int64_t count, size_t base) {
    return std::min(window, static_cast<size_t>(count) - std::min(base, static_cast<size_t>(count)));
  };
  for (size_t k = 0; k < rounds; ++k) {
    const size_t base = k * window;
    c.next_piece(true);
    for (size_t q = 0; q < n; ++q) {
      // Offsets of empty messages are never added to the buffers (an empty tensor's is null).
      const size_t len = in_window(send_counts[q], base);
      if (len == 0) continue;
      copy_elems(engine, c.area(rank, 0) + q * window * es, src + (static_cast<size_t>(send_offsets[q]) + base) * es,
                 len, es);
    }
    c.signal(IpcEvent::kReady);
    c.host_step();
    for (size_t p = 0; p < n; ++p) {
      const size_t len = in_window(recv_counts[p], base);
      if (len == 0) continue;
      c.wait(static_cast<int>(p), IpcEvent::kReady);
      copy_elems(engine, dst + (static_cast<size_t>(recv_offsets[p]) + base) * es,
                 c.area(static_cast<int>(p), 0) + static_cast<size_t>(rank) * window * es, len, es);
    }
    c.signal(IpcEvent::kReadDone);
  }
}

}  // namespace braid
