// Registered buffers ("windows"): shared-memory segments that every rank of the host maps, so
// that collectives read the peers' data in place (algorithms/window_collectives.cc).
#include <cstdint>
#include <stdexcept>

#include "group.h"
#include "segment_header.h"

namespace braid {

std::string ShmGroup::window_create(int64_t id, size_t bytes) {
  if (bytes == 0) throw std::invalid_argument("a window needs at least one byte");
  auto w = std::make_shared<ShmWindow>();
  w->own = ShmSegment::create(bytes, bytes);  // backed now: a full /dev/shm fails here, not at a write
  w->bytes = bytes;
  std::string name = w->own.name();
  std::lock_guard<std::mutex> lock(windows_mu_);
  if (windows_.count(id)) throw std::invalid_argument("window " + std::to_string(id) + " exists already");
  windows_.emplace(id, std::move(w));
  return name;
}

std::shared_ptr<const ShmWindow> ShmGroup::window_attach(int64_t id, const std::vector<std::string>& names) {
  if (static_cast<int>(names.size()) != world_)
    throw std::invalid_argument("window_attach needs one segment name per rank of the host");
  std::lock_guard<std::mutex> lock(windows_mu_);
  auto it = windows_.find(id);
  if (it == windows_.end()) throw std::invalid_argument("no window " + std::to_string(id) + " to attach");
  ShmWindow& w = *it->second;
  w.peers.resize(world_);
  w.bases.assign(world_, nullptr);
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) {
      w.bases[r] = static_cast<char*>(w.own.data());
      continue;
    }
    w.peers[r] = ShmSegment::attach(names[r], w.bytes);
    w.bases[r] = static_cast<char*>(w.peers[r].data());
  }
  nwindows_.store(windows_.size(), std::memory_order_release);
  return it->second;
}

void ShmGroup::window_unlink(int64_t id) {
  std::lock_guard<std::mutex> lock(windows_mu_);
  auto it = windows_.find(id);
  if (it != windows_.end()) it->second->own.unlink();
}

void ShmGroup::window_free(int64_t id) noexcept {
  std::lock_guard<std::mutex> lock(windows_mu_);
  windows_.erase(id);  // the mappings go with their last holder
  nwindows_.store(windows_.size(), std::memory_order_release);
}

int64_t ShmGroup::window_of(const void* data, size_t bytes, uint64_t* offset) {
  if (nwindows_.load(std::memory_order_acquire) == 0 || data == nullptr) return -1;
  const auto p = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(windows_mu_);
  for (const auto& [id, w] : windows_) {
    if (w->bases.empty()) continue;  // created, not attached yet
    const auto base = reinterpret_cast<uintptr_t>(w->bases[rank_]);
    if (p >= base && p - base <= w->bytes && bytes <= w->bytes - (p - base)) {
      *offset = p - base;
      return id;
    }
  }
  return -1;
}

bool ShmGroup::publish_window(const CollectiveDesc& d, const void* data, size_t bytes) {
  SegmentHeader* me = header(rank_);
  uint64_t off = 0;
  const int64_t id = window_of(data, bytes, &off);
  const int parity = static_cast<int>(d.seq & 1);
  me->window_id[parity] = id;
  me->window_off[parity] = off;
  return id >= 0;
}

ShmGroup::Windows ShmGroup::windows_at(const CollectiveDesc& d, const char** peer_data) {
  const int parity = static_cast<int>(d.seq & 1);
  const int64_t id = header(rank_)->window_id[parity];
  bool any = id >= 0, all = id >= 0;
  for (int r : all_peers_) {
    const int64_t theirs = header(r)->window_id[parity];
    any = any || theirs >= 0;
    all = all && theirs == id;
  }
  if (!all) return any ? Windows::kSome : Windows::kNone;
  // Every rank's data is in window `id`: each holds its mappings of the id while its data is there.
  std::lock_guard<std::mutex> lock(windows_mu_);
  const ShmWindow& w = *windows_.at(id);
  for (int r = 0; r < world_; ++r) peer_data[r] = w.bases[r] + header(r)->window_off[parity];
  read_windows_ = true;
  return Windows::kAll;
}

bool ShmGroup::arrive_windowed(const CollectiveDesc& d, const void* data, size_t bytes, const char** peer_data) {
  publish_window(d, data, bytes);
  prearrived_ = false;
  prearrived_step_ = arrive(d);  // posts: the record is published with the arrival
  prearrived_seq_ = d.seq;
  prearrived_ = true;
  return windows_at(d, peer_data) == Windows::kAll;
}

}  // namespace braid
