// Hosts and cross-host groups from the ranks' published host identities.
#include "topology.h"

#include <map>
#include <stdexcept>

namespace braid {

Topology Topology::from_host_ids(int rank, const std::vector<int>& host_ids) {
  Topology t;
  t.rank = rank;
  t.world = static_cast<int>(host_ids.size());
  if (rank < 0 || rank >= t.world) throw std::invalid_argument("rank out of range of the host ids");
  std::map<int, int> index;  // host id -> host index, in order of each host's lowest rank
  for (int r = 0; r < t.world; ++r) {
    auto it = index.find(host_ids[static_cast<size_t>(r)]);
    if (it == index.end()) {
      it = index.emplace(host_ids[static_cast<size_t>(r)], static_cast<int>(t.hosts.size())).first;
      t.hosts.emplace_back();
    }
    t.host_of.push_back(it->second);
    t.local_index.push_back(static_cast<int>(t.hosts[static_cast<size_t>(it->second)].size()));
    t.hosts[static_cast<size_t>(it->second)].push_back(r);
  }
  t.host = t.host_of[static_cast<size_t>(rank)];
  return t;
}

Topology Topology::single_host(int rank, int world) { return from_host_ids(rank, std::vector<int>(static_cast<size_t>(world), 0)); }

bool Topology::uniform() const {
  for (const auto& h : hosts)
    if (h.size() != hosts[0].size()) return false;
  return true;
}

std::vector<int> Topology::counterparts(int i) const {
  std::vector<int> out;
  for (const auto& h : hosts)
    if (i < static_cast<int>(h.size())) out.push_back(h[static_cast<size_t>(i)]);
  return out;
}

}  // namespace braid
