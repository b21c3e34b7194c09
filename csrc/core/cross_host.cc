// Collectives when the ranks span hosts: exact steps on each host's shared memory, transfers
// between hosts over TCP (directly at two hosts, around a ring or in log2 rounds at more),
// composed so that every byte crosses a host boundary as few times as the collective needs.
// Results are bitwise identical on every rank and from run to run: each element is reduced once,
// in a fixed order (each host's ranks in rank order, then the hosts: in host order for direct
// transfers, cyclically from the chunk's first member around a ring, by the fixed tree of
// recursive doubling), and copied everywhere else.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "algorithms/direct.h"
#include "communicator.h"

namespace braid {

void Communicator::host_step(CollKind kind, DType dt, ReduceOp op, size_t count, int root, const void* in, void* out) {
  if (!group_) {  // the host's only rank: each step is a copy at most
    const size_t bytes = count * dtype_size(dt);
    const bool moves = kind == CollKind::kAllReduce || kind == CollKind::kAllGather ||
                       kind == CollKind::kReduceScatter || kind == CollKind::kAllToAll;
    if (moves && in != out && bytes > 0) std::memmove(out, in, bytes);
    return;
  }
  Request r = make_request(kind, dt, count, in, out);
  r.op = op;
  r.root = root;
  CollectiveDesc d = describe_request(r, ++host_seq_);
  run_on_host(r, d);
}

namespace {
// Scratch slots: 0 is the direct algorithms' reduction staging (PeerGroup::scratch).
constexpr size_t kSlotPart = 1, kSlotWhole = 2, kSlotFull = 3;

// The collective a TCP transport's errors name, for the scope of one call.
struct NamedCollective {
  TcpTransport* tcp;
  NamedCollective(TcpTransport* t, const CollectiveDesc& d) : tcp(t) {
    if (tcp) tcp->set_current(&d);
  }
  ~NamedCollective() {
    if (tcp) tcp->set_current(nullptr);
  }
  NamedCollective(const NamedCollective&) = delete;
  NamedCollective& operator=(const NamedCollective&) = delete;
};

PeerGroup cross_group(TcpTransport* tcp, ScratchBuffers* scratch, const std::vector<int>& members, int rank,
                      const CollectiveDesc& d) {
  PeerGroup g;
  g.transport = tcp;
  g.scratch = scratch;
  g.members = members;
  g.me = static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
  g.desc = &d;
  return g;
}
// All-gather and reduce-scatter between hosts, by the table's choice (between_hosts_algo): around
// the ring (one neighbour each way instead of every member sending to every other at once through
// its uplink, as for all_reduce; the same bytes), else directly (at two members each sends its
// block once either way, in one step).
void gather_between_hosts(const PeerGroup& g, Algo algo, const void* in, void* out,
                          const std::vector<size_t>& bytes, size_t piece_bytes) {
  if (algo == Algo::kRing)
    ring_all_gather(g, in, out, bytes, piece_bytes);
  else
    direct_all_gather(g, in, out, bytes);
}
void reduce_scatter_between_hosts(const PeerGroup& g, Algo algo, DType dt, ReduceOp op, const void* in, void* out,
                                  const std::vector<size_t>& counts, int divisor, size_t piece_bytes) {
  if (algo == Algo::kRing)
    ring_reduce_scatter(g, dt, op, in, out, counts, divisor, piece_bytes);
  else
    direct_reduce_scatter(g, dt, op, in, out, counts, divisor, piece_bytes);
}
}  // namespace

void Communicator::cross_all_reduce(DType dt, ReduceOp op, const void* in, void* out, size_t count,
                                    const CollectiveDesc& d) {
  const size_t es = dtype_size(dt);
  const size_t bytes = count * es;
  const int local = topo_.local_world(), me = topo_.local_rank();
  // Steps on a host sum without the division of avg, which happens once, at the end, by the
  // number of all ranks.
  const ReduceOp host_op = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  const Algo algo = static_cast<Algo>(d.algo);  // choose_algo's (execute)
  const bool can_slice = topo_.uniform() && local > 1;
  // Between hosts: around a ring (BRAID_ALGO=ring, or large messages among more than two hosts),
  // by recursive doubling (small messages among many hosts), else directly (every member with
  // every other; one round trip for small messages).
  auto between_hosts = [&](const PeerGroup& g, const void* from, void* to, size_t n) {
    if (algo == Algo::kRing)
      ring_all_reduce(g, dt, op, from, to, n, world_, tun_.cross_piece_bytes);
    else if (algo == Algo::kDoubling)
      doubling_all_reduce(g, dt, op, from, to, n, world_);
    else
      direct_all_reduce(g, dt, op, from, to, n, world_, tun_.cross_piece_bytes, algo == Algo::kOneShot);
  };
  if (algo == Algo::kHierarchical || (algo == Algo::kRing && can_slice)) {
    // Hierarchical: reduce-scatter on the host, each local rank all-reduces its slice with its
    // counterparts on the other hosts (a host pair carries `local` streams at once), all-gather
    // on the host. A count that does not divide goes through a padded copy.
    const size_t per = (count + local - 1) / static_cast<size_t>(local);
    const size_t padded = per * static_cast<size_t>(local);
    const char* src = static_cast<const char*>(in);
    char* dst = static_cast<char*>(out);
    char* pad = nullptr;
    if (padded != count) {
      pad = scratch_.get(kSlotWhole, padded * es);
      std::memcpy(pad, in, bytes);
      std::memset(pad + bytes, 0, (padded - count) * es);  // never read into a result: elementwise
      src = dst = pad;
    }
    char* slice = scratch_.get(kSlotPart, per * es);
    host_step(CollKind::kReduceScatter, dt, host_op, per, 0, src, slice);
    PeerGroup g = cross_group(tcp_.get(), &scratch_, topo_.counterparts(me), rank_, d);
    between_hosts(g, slice, slice, per);
    host_step(CollKind::kAllGather, dt, host_op, per, 0, slice, dst);
    if (pad != nullptr) std::memcpy(out, pad, bytes);
    return;
  }
  // Through the host leaders (any layout, and every small message): the host's sum on every local
  // rank, the leaders all-reduce the host sums, each leader broadcasts the result on its host.
  host_step(CollKind::kAllReduce, dt, host_op, count, 0, in, out);
  if (me == 0) {
    PeerGroup g = cross_group(tcp_.get(), &scratch_, topo_.counterparts(0), rank_, d);
    between_hosts(g, out, out, count);
  }
  host_step(CollKind::kBroadcast, dt, host_op, count, 0, out, out);
}

void Communicator::cross_reduce_scatter(DType dt, ReduceOp op, const void* in, void* out, size_t count,
                                        const CollectiveDesc& d) {
  const size_t es = dtype_size(dt), bytes = count * es;
  const char* src = static_cast<const char*>(in);
  const ReduceOp host_op = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  if (!topo_.uniform()) {
    // Uneven hosts, through the host leaders: the chunks regrouped host by host (host h's ranks'
    // chunks together, in local order), the host's sum of all of them on every local rank, then
    // the leaders reduce-scatter the host sums with blocks of their hosts' sizes, so each leader
    // sends only the chunks of the other hosts' ranks; each leader broadcasts its host's block and
    // every rank keeps its chunk. Sums run in the order the leaders' all-reduce uses.
    const int hosts = topo_.num_hosts(), me = topo_.local_rank(), local = topo_.local_world();
    char* grouped = scratch_.get(kSlotFull, static_cast<size_t>(world_) * bytes);
    char* summed = scratch_.get(kSlotWhole, static_cast<size_t>(world_) * bytes);
    std::vector<size_t> counts;
    size_t at = 0;
    for (int h = 0; h < hosts; ++h) {
      for (int r : topo_.hosts[static_cast<size_t>(h)]) {
        if (bytes > 0) std::memcpy(grouped + at * bytes, src + static_cast<size_t>(r) * bytes, bytes);
        ++at;
      }
      counts.push_back(topo_.hosts[static_cast<size_t>(h)].size() * count);
    }
    host_step(CollKind::kAllReduce, dt, host_op, static_cast<size_t>(world_) * count, 0, grouped, summed);
    char* block = grouped;  // the regrouped input is no longer needed
    if (me == 0) {
      PeerGroup g = cross_group(tcp_.get(), &scratch_, topo_.counterparts(0), rank_, d);
      reduce_scatter_between_hosts(g, between_hosts_algo(CollKind::kReduceScatter, 0, g.size()), dt, op, summed, block,
                                   counts, world_, tun_.cross_piece_bytes);
    }
    host_step(CollKind::kBroadcast, dt, host_op, static_cast<size_t>(local) * count, 0, block, block);
    if (bytes > 0) std::memcpy(out, block + static_cast<size_t>(me) * bytes, bytes);
    return;
  }
  // Chunks regrouped by local index: block i holds, host by host, the chunks of the ranks with
  // local index i. A reduce-scatter on the host gives local rank i its host's sum of block i; the
  // ranks with local index i then reduce-scatter those across hosts, each keeping its own chunk.
  const int local = topo_.local_world(), hosts = topo_.num_hosts();
  char* grouped = scratch_.get(kSlotFull, static_cast<size_t>(world_) * bytes);
  char* part = scratch_.get(kSlotPart, static_cast<size_t>(hosts) * bytes);
  for (int i = 0; i < local; ++i)
    for (int h = 0; h < hosts; ++h)
      if (bytes > 0)
        std::memcpy(grouped + static_cast<size_t>(i * hosts + h) * bytes,
                    src + static_cast<size_t>(topo_.hosts[static_cast<size_t>(h)][static_cast<size_t>(i)]) * bytes, bytes);
  if (local > 1)
    host_step(CollKind::kReduceScatter, dt, host_op, static_cast<size_t>(hosts) * count, 0, grouped, part);
  else
    part = grouped;
  PeerGroup g = cross_group(tcp_.get(), &scratch_, topo_.counterparts(topo_.local_rank()), rank_, d);
  reduce_scatter_between_hosts(g, between_hosts_algo(CollKind::kReduceScatter, 0, g.size()), dt, op, part, out,
                               std::vector<size_t>(static_cast<size_t>(hosts), count), world_, tun_.cross_piece_bytes);
}

void Communicator::cross_all_gather(const void* in, void* out, size_t bytes, const CollectiveDesc& d) {
  if (topo_.uniform() && topo_.local_world() > 1) {
    // Every local rank gathers from its counterparts on the other hosts (a host pair carries
    // `local` streams at once), then the host gathers those blocks: chunk of rank
    // hosts[h][i] at (i * hosts + h), regrouped into rank order.
    const int local = topo_.local_world(), hosts = topo_.num_hosts();
    char* part = scratch_.get(kSlotPart, static_cast<size_t>(hosts) * bytes);
    char* grouped = scratch_.get(kSlotFull, static_cast<size_t>(world_) * bytes);
    PeerGroup g = cross_group(tcp_.get(), &scratch_, topo_.counterparts(topo_.local_rank()), rank_, d);
    gather_between_hosts(g, between_hosts_algo(CollKind::kAllGather, bytes, g.size()), in, part,
                         std::vector<size_t>(static_cast<size_t>(hosts), bytes), tun_.cross_piece_bytes);
    host_step(CollKind::kAllGather, DType::kUInt8, ReduceOp::kSum, static_cast<size_t>(hosts) * bytes, 0, part,
              grouped);
    for (int i = 0; i < local; ++i)
      for (int h = 0; h < hosts; ++h)
        if (bytes > 0)
          std::memcpy(static_cast<char*>(out) +
                          static_cast<size_t>(topo_.hosts[static_cast<size_t>(h)][static_cast<size_t>(i)]) * bytes,
                      grouped + static_cast<size_t>(i * hosts + h) * bytes, bytes);
    return;
  }
  // Uneven hosts: blocks laid out host by host (each host's ranks in rank order): the host's block is one
  // all-gather on the host, the leaders exchange host blocks, and each leader broadcasts them on
  // its host. When the ranks of each host are consecutive (torchrun, srun) that is rank order
  // already, and no reordering copy is needed.
  std::vector<size_t> host_bytes, host_off;
  std::vector<int> order;  // ranks, host by host
  size_t off = 0;
  for (const auto& h : topo_.hosts) {
    host_off.push_back(off);
    host_bytes.push_back(h.size() * bytes);
    off += h.size() * bytes;
    order.insert(order.end(), h.begin(), h.end());
  }
  bool in_rank_order = true;
  for (int i = 0; i < world_; ++i) in_rank_order = in_rank_order && order[static_cast<size_t>(i)] == i;
  char* by_host = in_rank_order ? static_cast<char*>(out) : scratch_.get(kSlotFull, static_cast<size_t>(world_) * bytes);
  const size_t h = static_cast<size_t>(topo_.host);
  host_step(CollKind::kAllGather, DType::kUInt8, ReduceOp::kSum, bytes, 0, in, by_host + host_off[h]);
  if (topo_.local_rank() == 0) {
    PeerGroup g = cross_group(tcp_.get(), &scratch_, topo_.counterparts(0), rank_, d);
    gather_between_hosts(g, between_hosts_algo(CollKind::kAllGather, bytes, g.size()), by_host + host_off[h], by_host,
                         host_bytes, tun_.cross_piece_bytes);
  }
  host_step(CollKind::kBroadcast, DType::kUInt8, ReduceOp::kSum, static_cast<size_t>(world_) * bytes, 0, by_host,
            by_host);
  if (!in_rank_order)
    for (int i = 0; i < world_; ++i)
      if (bytes > 0)
        std::memcpy(static_cast<char*>(out) + static_cast<size_t>(order[static_cast<size_t>(i)]) * bytes,
                    by_host + static_cast<size_t>(i) * bytes, bytes);
}

void Communicator::cross_broadcast(void* data, size_t bytes, int root, const CollectiveDesc& d) {
  const int root_host = topo_.host_of[static_cast<size_t>(root)];
  // On the root's host everyone gets it first (its leader among them), then the leaders pass it
  // on, then each other host's leader broadcasts it there.
  if (topo_.host == root_host)
    host_step(CollKind::kBroadcast, DType::kUInt8, ReduceOp::kSum, bytes, topo_.local_index[static_cast<size_t>(root)],
              data, data);
  if (topo_.local_rank() == 0) {
    PeerGroup g = cross_group(tcp_.get(), &scratch_, topo_.counterparts(0), rank_, d);
    tree_broadcast(g, data, bytes, root_host);
  }
  if (topo_.host != root_host) host_step(CollKind::kBroadcast, DType::kUInt8, ReduceOp::kSum, bytes, 0, data, data);
}

void Communicator::cross_barrier(const CollectiveDesc& d) {
  host_step(CollKind::kBarrier, DType::kUInt8, ReduceOp::kSum, 0, 0, nullptr, nullptr);
  if (topo_.local_rank() == 0) dissemination_barrier(cross_group(tcp_.get(), &scratch_, topo_.counterparts(0), rank_, d));
  host_step(CollKind::kBarrier, DType::kUInt8, ReduceOp::kSum, 0, 0, nullptr, nullptr);
}

void Communicator::cross_all_to_all(const void* in, void* out, size_t chunk, const CollectiveDesc& d) {
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  // The other hosts' chunks travel directly, each pair's in both directions at once. (In H - 1
  // rounds of host pairs, one host's chunks through each uplink at a time, the int8 all_reduce's
  // all-to-all of 8 MiB at 8 x 1 hosts on 100 Mbit took 490 ms against 429 ms all at once: unlike
  // the reductions, the exchange has no step to pipeline, and rounds only add waits.)
  std::vector<int> everyone(static_cast<size_t>(world_));
  for (int r = 0; r < world_; ++r) everyone[static_cast<size_t>(r)] = r;
  PeerGroup g = cross_group(tcp_.get(), &scratch_, everyone, rank_, d);
  std::vector<DirectBlock> sends, recvs;
  for (int r = 0; r < world_; ++r) {
    if (topo_.host_of[static_cast<size_t>(r)] == topo_.host) continue;
    sends.push_back({r, const_cast<char*>(src) + static_cast<size_t>(r) * chunk, chunk});
    recvs.push_back({r, dst + static_cast<size_t>(r) * chunk, chunk});
  }
  direct_exchange(g, sends, recvs);
  // This host's chunks: one all-to-all on the host, through packed copies.
  const auto& mine = topo_.hosts[static_cast<size_t>(topo_.host)];
  if (mine.size() == 1) {
    if (dst + static_cast<size_t>(rank_) * chunk != src + static_cast<size_t>(rank_) * chunk && chunk > 0)
      std::memcpy(dst + static_cast<size_t>(rank_) * chunk, src + static_cast<size_t>(rank_) * chunk, chunk);
    return;
  }
  char* packed_in = scratch_.get(kSlotPart, mine.size() * chunk);
  char* packed_out = scratch_.get(kSlotFull, mine.size() * chunk);
  for (size_t i = 0; i < mine.size(); ++i)
    if (chunk > 0) std::memcpy(packed_in + i * chunk, src + static_cast<size_t>(mine[i]) * chunk, chunk);
  host_step(CollKind::kAllToAll, DType::kUInt8, ReduceOp::kSum, chunk, 0, packed_in, packed_out);
  for (size_t i = 0; i < mine.size(); ++i)
    if (chunk > 0) std::memcpy(dst + static_cast<size_t>(mine[i]) * chunk, packed_out + i * chunk, chunk);
}

void Communicator::run_between_hosts(Scope scope, CollKind kind, size_t count, uint32_t tag,
                                     const std::function<void(const PeerGroup&)>& body) {
  check_not_poisoned();
  std::vector<int> members;
  if (scope == Scope::kCross) {
    members = topo_.counterparts(topo_.local_rank());
  } else {
    for (int r = 0; r < world_; ++r) members.push_back(r);
  }
  for (int r : members)
    if (r != rank_ && topo_.host_of[static_cast<size_t>(r)] == topo_.host)
      throw std::invalid_argument("run_between_hosts: ranks of the scope share a host");
  Request described;  // what the descriptor says: kind, bytes, the caller's tag
  described.kind = kind;
  described.dtype = DType::kUInt8;
  described.count = count;
  described.tag = tag;
  described.root = static_cast<int>(tag);
  const CollectiveDesc d = describe_request(described, ++seq_);
  try {
    NamedCollective named(tcp_.get(), d);
    body(cross_group(tcp_.get(), &scratch_, members, rank_, d));
  } catch (const CommError& e) {
    poison(e);
    throw;
  }
}

int Communicator::scope_size(Scope s) const {
  if (s == Scope::kHost) return topo_.local_world();
  if (s == Scope::kCross) return static_cast<int>(topo_.counterparts(topo_.local_rank()).size());
  return world_;
}

int Communicator::scope_rank(Scope s) const {
  if (s == Scope::kHost) return topo_.local_rank();
  if (s == Scope::kCross) return topo_.host;  // counterparts are listed host by host
  return rank_;
}

void Communicator::execute_scoped(Request& r, CollectiveDesc& d) {
  const size_t es = dtype_size(r.dtype), bytes = r.count * es;
  if (r.scope == Scope::kHost) {
    host_step(r.kind, r.dtype, r.op, r.count, r.root, r.in, r.out);
    return;
  }
  // kCross: this rank's counterparts (just itself on one host), by the table's choice.
  const std::vector<int> members = topo_.counterparts(topo_.local_rank());
  const Algo algo = between_hosts_algo(r.kind, bytes, static_cast<int>(members.size()), /*scoped=*/true);
  d.algo = static_cast<uint32_t>(algo);
  NamedCollective named(tcp_.get(), d);
  PeerGroup g = cross_group(tcp_.get(), &scratch_, members, rank_, d);
  const int n = g.size();
  const int divisor = r.divisor > 0 ? r.divisor : n;
  switch (r.kind) {
    case CollKind::kAllReduce:
      if (algo == Algo::kRing)
        ring_all_reduce(g, r.dtype, r.op, r.in, r.out, r.count, divisor, tun_.cross_piece_bytes);
      else if (algo == Algo::kDoubling)
        doubling_all_reduce(g, r.dtype, r.op, r.in, r.out, r.count, divisor);
      else
        direct_all_reduce(g, r.dtype, r.op, r.in, r.out, r.count, divisor, tun_.cross_piece_bytes,
                          algo == Algo::kOneShot);
      break;
    case CollKind::kReduceScatter:
      reduce_scatter_between_hosts(g, algo, r.dtype, r.op, r.in, r.out,
                                   std::vector<size_t>(static_cast<size_t>(n), r.count), divisor,
                                   tun_.cross_piece_bytes);
      break;
    case CollKind::kAllGather:
      gather_between_hosts(g, algo, r.in, r.out, std::vector<size_t>(static_cast<size_t>(n), bytes),
                           tun_.cross_piece_bytes);
      break;
    case CollKind::kBroadcast:
      tree_broadcast(g, r.out, bytes, topo_.host_of[static_cast<size_t>(r.root)]);
      break;
    case CollKind::kBarrier:
    case CollKind::kExchange:
      dissemination_barrier(g);
      break;
    case CollKind::kAllToAll: {
      std::vector<DirectBlock> sends, recvs;
      const char* src = static_cast<const char*>(r.in);
      char* dst = static_cast<char*>(r.out);
      for (int m = 0; m < n; ++m) {
        if (m == g.me) continue;
        sends.push_back({m, const_cast<char*>(src) + static_cast<size_t>(m) * bytes, bytes});
        recvs.push_back({m, dst + static_cast<size_t>(m) * bytes, bytes});
      }
      direct_exchange(g, sends, recvs);
      if (bytes > 0) std::memcpy(dst + static_cast<size_t>(g.me) * bytes, src + static_cast<size_t>(g.me) * bytes, bytes);
      break;
    }
    case CollKind::kSend:
    case CollKind::kRecv:
      break;  // point to point is never scoped
  }
}

void Communicator::execute_cross_host(Request& r, const CollectiveDesc& d) {
  NamedCollective named(tcp_.get(), d);
  const size_t es = dtype_size(r.dtype);
  switch (r.kind) {
    case CollKind::kAllReduce:
      cross_all_reduce(r.dtype, r.op, r.in, r.out, r.count, d);
      break;
    case CollKind::kReduceScatter:
      cross_reduce_scatter(r.dtype, r.op, r.in, r.out, r.count, d);
      break;
    case CollKind::kAllGather:
      cross_all_gather(r.in, r.out, r.count * es, d);
      break;
    case CollKind::kBroadcast:
      cross_broadcast(r.out, r.count * es, r.root, d);
      break;
    case CollKind::kBarrier:
    case CollKind::kExchange:
      cross_barrier(d);
      break;
    case CollKind::kAllToAll:
      cross_all_to_all(r.in, r.out, r.count * es, d);
      break;
    case CollKind::kSend:
    case CollKind::kRecv:
      break;  // routed point to point, never here
  }
}

}  // namespace braid
