// Which ranks share a host: hosts numbered by their lowest rank, each host's ranks in rank
// order, and the groups that cross hosts (the ranks with the same local index on every host).
#pragma once

#include <cstddef>
#include <vector>

namespace braid {

struct Topology {
  int rank = 0;
  int world = 1;
  std::vector<int> host_of;              // host index of every rank
  std::vector<std::vector<int>> hosts;   // ranks of each host, ascending
  std::vector<int> local_index;          // index of every rank within its host
  int host = 0;                          // this rank's host

  // `host_ids[r]`: any value that is equal for ranks on one host (from published host identity).
  static Topology from_host_ids(int rank, const std::vector<int>& host_ids);
  // One host holding every rank.
  static Topology single_host(int rank, int world);

  int local_rank() const { return local_index[static_cast<size_t>(rank)]; }
  int local_world() const { return static_cast<int>(hosts[static_cast<size_t>(host)].size()); }
  int num_hosts() const { return static_cast<int>(hosts.size()); }
  bool multi_host() const { return hosts.size() > 1; }
  // Every host holds the same number of ranks.
  bool uniform() const;
  // The ranks with local index `i` on every host that has one, in host order.
  std::vector<int> counterparts(int i) const;
};

}  // namespace braid
