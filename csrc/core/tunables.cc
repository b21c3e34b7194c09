// Parsing and validation of the BRAID_* environment knobs.
#include "tunables.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>

namespace braid {
namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

// A byte count: digits with an optional K, M or G suffix (powers of 1024, either case).
size_t env_size(const char* name, size_t dflt) {
  const char* v = env(name);
  if (v == nullptr) return dflt;
  auto bad = [&] {
    return std::invalid_argument(std::string(name) +
                                 " must be a non-negative integer, optionally with a K, M or G suffix; got '" +
                                 v + "'");
  };
  if (*v < '0' || *v > '9') throw bad();
  char* end = nullptr;
  errno = 0;
  unsigned long long x = std::strtoull(v, &end, 10);
  int shift = 0;
  switch (*end) {
    case '\0': break;
    case 'k': case 'K': shift = 10; ++end; break;
    case 'm': case 'M': shift = 20; ++end; break;
    case 'g': case 'G': shift = 30; ++end; break;
    default: throw bad();
  }
  if (*end != '\0' || errno == ERANGE || x > (~0ull >> shift)) throw bad();
  return static_cast<size_t>(x << shift);
}

// env_size narrowed to a signed type: a value past the type's range saturates at its maximum
// (validate() then names the variable and its range) instead of wrapping to a small or negative
// number that would pass, or read as "unset".
template <typename T>
T env_size_as(const char* name, T dflt) {
  const size_t x = env_size(name, static_cast<size_t>(dflt));
  return static_cast<T>(std::min<size_t>(x, static_cast<size_t>(std::numeric_limits<T>::max())));
}

double env_double(const char* name, double dflt) {
  const char* v = env(name);
  if (v == nullptr) return dflt;
  char* end = nullptr;
  double x = std::strtod(v, &end);
  if (end == v || *end != '\0') throw std::invalid_argument(std::string(name) + " must be a number, got '" + v + "'");
  return x;
}

// The first line of a small text file (sysfs), without its newline; empty when it cannot be read.
// C stdio rather than iostreams: an extension built by one GCC may run against an older
// libstdc++ (torch's toolchain, or the system's), whose locale facets the newer headers' inline
// stream code does not match (a crash in Tunables::resolve on such a machine).
std::string first_line(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return std::string();
  char buf[64] = {0};
  const bool ok = std::fgets(buf, sizeof(buf), f) != nullptr;
  std::fclose(f);
  std::string line = ok ? buf : "";
  while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
  return line;
}

// The size of the last-level cache the ranks of the host share: the highest-level cache of CPU 0
// that sysfs lists (the kernel's view; the CPUID figures the C library reports can describe the
// physical host rather than the virtual machine), else sysconf, else 32 MiB.
size_t last_level_cache_bytes() {
  int best_level = 0;
  size_t best = 0;
  for (int i = 0; i < 16; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    const std::string level_text = first_line(dir + "level"), size = first_line(dir + "size");
    if (level_text.empty() || size.empty()) break;
    const int level = std::atoi(level_text.c_str());
    char* end = nullptr;
    size_t bytes = std::strtoull(size.c_str(), &end, 10);
    if (*end == 'K') bytes <<= 10;
    else if (*end == 'M') bytes <<= 20;
    if (level > best_level && bytes > 0) best_level = level, best = bytes;
  }
  if (best_level >= 2) return best;
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return l3 > 0 ? static_cast<size_t>(l3) : (size_t{32} << 20);
}

int usable_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

}  // namespace

const char* algo_name(Algo a) {
  switch (a) {
    case Algo::kAuto: return "auto";
    case Algo::kOneShot: return "oneshot";
    case Algo::kTwoShot: return "twoshot";
    case Algo::kRing: return "ring";
    case Algo::kHierarchical: return "hierarchical";
    case Algo::kLeaders: return "leaders";
    case Algo::kDoubling: return "doubling";
    case Algo::kWindow: return "window";
  }
  return "unknown";
}

Algo parse_algo(const std::string& s) {
  if (s.empty()) return Algo::kAuto;
  std::string names;
  for (int i = 0; i < kNumAlgos; ++i) {
    const Algo a = static_cast<Algo>(i);
    if (s == algo_name(a)) return a;
    names += (i == 0 ? "" : ", ") + std::string(algo_name(a));
  }
  throw std::invalid_argument("BRAID_ALGO must be one of " + names + "; got '" + s + "'");
}

Tunables Tunables::from_env() {
  Tunables t;
  if (const char* a = env("BRAID_ALGO")) t.algo = parse_algo(a);
  if (env("BRAID_ONESHOT_MAX_BYTES") != nullptr)
    t.oneshot_max_bytes = env_size_as<int64_t>("BRAID_ONESHOT_MAX_BYTES", 0);
  t.slot_bytes = env_size("BRAID_SLOT_BYTES", t.slot_bytes);
  t.nslots = env_size_as<int>("BRAID_NSLOTS", t.nslots);
  t.p2p_window_min_bytes = env_size("BRAID_P2P_WINDOW_MIN_BYTES", t.p2p_window_min_bytes);
  if (env("BRAID_STREAM_MIN_BYTES") != nullptr)
    t.stream_min_bytes = env_size_as<int64_t>("BRAID_STREAM_MIN_BYTES", 0);
  t.spin_us = env_double("BRAID_SPIN_US", t.spin_us);
  t.yield_us = env_double("BRAID_YIELD_US", t.yield_us);
  t.ipc_one_shot_max_bytes = env_size("BRAID_IPC_ONE_SHOT_MAX_BYTES", t.ipc_one_shot_max_bytes);
  if (env("BRAID_SKEW_ROUNDS") != nullptr)
    t.skew_rounds = static_cast<int>(std::min<size_t>(env_size("BRAID_SKEW_ROUNDS", 0), 2));
  t.nsocks = env_size_as<int>("BRAID_NSOCKS", t.nsocks);
  if (const char* c = env("BRAID_TCP_CONNECT")) {
    const std::string v = c;
    if (v != "lazy" && v != "eager")
      throw std::invalid_argument("BRAID_TCP_CONNECT must be lazy or eager; got '" + v + "'");
    t.tcp_lazy = v == "lazy";
  }
  t.socket_chunk_bytes = env_size("BRAID_SOCKET_CHUNK_BYTES", t.socket_chunk_bytes);
  t.cross_oneshot_max_bytes = env_size("BRAID_CROSS_ONESHOT_MAX_BYTES", t.cross_oneshot_max_bytes);
  t.cross_doubling_min_hosts = env_size_as<int>("BRAID_CROSS_DOUBLING_MIN_HOSTS", t.cross_doubling_min_hosts);
  t.cross_piece_bytes = env_size("BRAID_CROSS_PIECE_BYTES", t.cross_piece_bytes);
  t.trace_buffer = env_size("BRAID_TRACE_BUFFER", t.trace_buffer);
  return t;
}

void Tunables::resolve(int local_world_size, int host_cores) {
  if (oneshot_max_bytes < 0) oneshot_max_bytes = local_world_size == 2 ? (1 << 20) : (32 << 10);
  if (stream_min_bytes < 0) stream_min_bytes = static_cast<int64_t>(last_level_cache_bytes() / 2 / local_world_size);
  // Ranks pinned one per core (as mpirun and `taskset` place them) each see one CPU of their own:
  // the host's ranks together are oversubscribed only when they outnumber the union of their CPUs.
  const bool oversubscribed = local_world_size > (host_cores > 0 ? host_cores : usable_cores());
  if (spin_us < 0) spin_us = oversubscribed ? 0.0 : 20.0;
  if (skew_rounds < 0) skew_rounds = oversubscribed ? 0 : 1;
}

size_t env_bytes(const char* name, size_t dflt) { return env_size(name, dflt); }

void Tunables::validate() const {
  if (slot_bytes < 1024 || slot_bytes > (size_t(1) << 30))
    throw std::invalid_argument("slot_bytes (BRAID_SLOT_BYTES) must be between 1 KiB and 1 GiB");
  if (oneshot_max_bytes < 0 || oneshot_max_bytes > (int64_t(1) << 30))
    throw std::invalid_argument("oneshot_max_bytes (BRAID_ONESHOT_MAX_BYTES) must be between 0 and 1 GiB");
  if (nslots < 2 || nslots > 64) throw std::invalid_argument("nslots (BRAID_NSLOTS) must be between 2 and 64");
  if (skew_rounds < -1 || skew_rounds > 1)
    throw std::invalid_argument("skew_rounds (BRAID_SKEW_ROUNDS) must be 0 or 1");
  if (yield_us < 0) throw std::invalid_argument("yield_us (BRAID_YIELD_US) must be >= 0");
  if (nsocks < 1 || nsocks > kMaxSockets)
    throw std::invalid_argument("nsocks (BRAID_NSOCKS) must be between 1 and " + std::to_string(kMaxSockets));
  if (socket_chunk_bytes < kMinSocketChunkBytes || socket_chunk_bytes > kMaxSocketChunkBytes)
    throw std::invalid_argument("socket_chunk_bytes (BRAID_SOCKET_CHUNK_BYTES) must be between 4 KiB and 1 GiB");
  if (cross_doubling_min_hosts < 2)
    throw std::invalid_argument("cross_doubling_min_hosts (BRAID_CROSS_DOUBLING_MIN_HOSTS) must be at least 2");
  if (cross_oneshot_max_bytes > (size_t(1) << 30))
    throw std::invalid_argument("cross_oneshot_max_bytes (BRAID_CROSS_ONESHOT_MAX_BYTES) must be at most 1 GiB");
  if (trace_buffer > kMaxTraceBuffer)
    throw std::invalid_argument("trace_buffer (BRAID_TRACE_BUFFER) must be at most 16777216 calls");
  if (cross_piece_bytes < 1024 || cross_piece_bytes > (size_t(1) << 30))
    throw std::invalid_argument("cross_piece_bytes (BRAID_CROSS_PIECE_BYTES) must be between 1 KiB and 1 GiB");
}

}  // namespace braid
