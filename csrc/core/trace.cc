// The flight recorder's ring buffer, its JSON dump and the dump signal (see trace.h).
#include "trace.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace braid {

int64_t wall_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

long os_thread_id() {
  thread_local const long tid = static_cast<long>(::syscall(SYS_gettid));  // a system call: once
  return tid;
}

namespace {
// The recorder's clock: a tick counter read in a few nanoseconds (the TSC, constant-rate on every
// x86-64 CPU of the last decade; the kernel's own clocksource on such machines), else the steady
// clock's nanoseconds. Converted to wall time at a dump, from two readings of both.
inline uint64_t ticks() {
#if defined(__x86_64__)
  return __rdtsc();
#else
  return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
#endif
}

int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}
}  // namespace

namespace {
size_t ring_size(size_t capacity) {
  size_t n = 1;
  while (n < capacity) n <<= 1;
  return capacity == 0 ? 0 : n;
}
}  // namespace

Recorder::Recorder(size_t capacity)
    : capacity_(capacity),
      mask_(ring_size(capacity) - 1),
      slots_(capacity != 0 ? new Slot[ring_size(capacity)] : nullptr),
      errors_(ring_size(capacity)),
      stacks_(ring_size(capacity)),
      tick0_(ticks()),
      wall0_ns_(wall_ns()) {}

template <class F>
void Recorder::update(uint64_t id, F&& write) {
  if (id == 0) return;
  Slot& e = slot_of(id);
  if (e.id != id) return;  // overwritten by a later call (a ring smaller than the calls in flight)
  const uint32_t v = e.version.load(std::memory_order_relaxed);
  e.version.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  write(e);
  e.version.store(v + 2, std::memory_order_release);
}

uint64_t Recorder::issue(CollKind kind, DType dtype, ReduceOp op, uint64_t count, int root, const char* label,
                         std::string* stack, uint64_t seq, bool started) {
  if (!on()) return 0;
  const uint64_t now = ticks();
  const uint64_t id = recorded_.fetch_add(1, std::memory_order_relaxed) + 1;
  const size_t at = (id - 1) & mask_;
  Slot& e = slots_[at];
  const bool had_text = e.has_text;
  const bool has_stack = stack != nullptr && !stack->empty();
  const uint32_t v = e.version.load(std::memory_order_relaxed);
  e.version.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  e.id = id;
  e.seq = seq;
  e.kind = kind;
  e.dtype = dtype;
  e.op = op;
  e.root = root;
  e.count = count;
  e.label = label;
  e.algo = nullptr;
  e.shm_bytes = e.tcp_bytes = 0;
  e.wire_ratio = -1.0;
  e.state = started ? TraceState::kStarted : TraceState::kIssued;
  e.issued = now;
  e.started = started ? now : 0;
  e.completed = 0;
  e.thread = os_thread_id();
  e.has_text = has_stack;
  e.version.store(v + 2, std::memory_order_release);
  // The next call's slot, last written `capacity` calls ago and long out of the caches: fetched
  // now, while this call runs, rather than on the next call's latency.
  const char* next = reinterpret_cast<const char*>(&slots_[id & mask_]);
  for (size_t line = 0; line < sizeof(Slot); line += 64) __builtin_prefetch(next + line, 1);
  if (had_text || has_stack) {  // rare: a stack recorded, or the slot held one or an error
    std::lock_guard<std::mutex> lk(text_mu_);
    errors_[at].clear();
    if (has_stack)
      stacks_[at] = std::move(*stack);
    else
      stacks_[at].clear();
  }
  return id;
}

void Recorder::start(uint64_t id, uint64_t seq) {
  if (id == 0) return;
  const uint64_t now = ticks();
  update(id, [&](Slot& e) {
    e.seq = seq;
    e.state = TraceState::kStarted;
    e.started = now;
  });
}

void Recorder::set_algo(uint64_t id, const char* algo) {
  update(id, [&](Slot& e) { e.algo = algo; });
}

void Recorder::set_wire_ratio(uint64_t id, double ratio) {
  update(id, [&](Slot& e) { e.wire_ratio = ratio; });
}

void Recorder::complete(uint64_t id, const char* algo, uint64_t shm_bytes, uint64_t tcp_bytes) {
  if (id == 0) return;
  const uint64_t now = ticks();
  update(id, [&](Slot& e) {
    if (algo != nullptr) e.algo = algo;
    e.shm_bytes = shm_bytes;
    e.tcp_bytes = tcp_bytes;
    e.state = TraceState::kCompleted;
    if (e.started == 0) e.started = now;
    e.completed = now;
  });
}

void Recorder::fail(uint64_t id, const std::string& error) {
  if (id == 0) return;
  const uint64_t now = ticks();
  {
    std::lock_guard<std::mutex> lk(text_mu_);
    errors_[(id - 1) & mask_] = error.empty() ? "failed" : error;
  }
  update(id, [&](Slot& e) {
    e.state = TraceState::kFailed;
    e.completed = now;
    e.has_text = true;
  });
}

bool Recorder::snapshot(size_t at, TraceEntry& out) const {
  const Slot& e = slots_[at];
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const uint32_t v = e.version.load(std::memory_order_acquire);
    if (v & 1u) continue;
    out.id = e.id;
    out.seq = e.seq;
    out.kind = e.kind;
    out.dtype = e.dtype;
    out.op = e.op;
    out.root = e.root;
    out.count = e.count;
    out.label = e.label;
    out.algo = e.algo;
    out.shm_bytes = e.shm_bytes;
    out.tcp_bytes = e.tcp_bytes;
    out.wire_ratio = e.wire_ratio;
    out.state = e.state;
    out.issued_us = static_cast<int64_t>(e.issued);  // ticks for now: converted by the caller
    out.started_us = static_cast<int64_t>(e.started);
    out.completed_us = static_cast<int64_t>(e.completed);
    out.thread = e.thread;
    const bool text = e.has_text;
    std::atomic_thread_fence(std::memory_order_acquire);
    if (e.version.load(std::memory_order_relaxed) != v) continue;
    if (text) {
      std::lock_guard<std::mutex> lk(text_mu_);
      out.error = errors_[at];
      out.stack = stacks_[at];
    }
    return true;
  }
  return false;
}

namespace {

void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

void json_key(std::string& out, const char* key) {
  out += '"';
  out += key;
  out += "\": ";
}

void json_int_or_null(std::string& out, int64_t v, bool present) { out += present ? std::to_string(v) : "null"; }

const char* kind_name(const TraceEntry& e) {
  if (e.label != nullptr) return e.label;
  return e.kind == CollKind::kExchange ? "all_to_all_v" : coll_kind_name(e.kind);
}

const char* state_name(TraceState s) {
  switch (s) {
    case TraceState::kIssued: return "issued";
    case TraceState::kStarted: return "started";
    case TraceState::kCompleted: return "completed";
    case TraceState::kFailed: return "failed";
  }
  return "issued";
}

void entry_json(std::string& out, const TraceEntry& e) {
  const bool p2p = e.kind == CollKind::kSend || e.kind == CollKind::kRecv;
  const bool reduces = e.kind == CollKind::kAllReduce || e.kind == CollKind::kReduceScatter;
  out += "{";
  json_key(out, "id"), out += std::to_string(e.id), out += ", ";
  json_key(out, "seq"), json_int_or_null(out, static_cast<int64_t>(e.seq), !p2p && e.seq != 0), out += ", ";
  json_key(out, "kind"), json_string(out, kind_name(e)), out += ", ";
  json_key(out, "dtype"), json_string(out, dtype_name(e.dtype)), out += ", ";
  json_key(out, "count"), out += std::to_string(e.count), out += ", ";
  json_key(out, "op");
  if (reduces) json_string(out, reduce_op_name(e.op)); else out += "null";
  out += ", ";
  json_key(out, "root"), json_int_or_null(out, e.root, e.kind == CollKind::kBroadcast), out += ", ";
  json_key(out, "peer"), json_int_or_null(out, e.root, p2p && e.root >= 0), out += ", ";
  json_key(out, "algorithm");
  if (e.algo != nullptr) json_string(out, e.algo); else out += "null";
  out += ", ";
  json_key(out, "bytes"), out += "{\"shm\": " + std::to_string(e.shm_bytes) + ", \"tcp\": " +
                                 std::to_string(e.tcp_bytes) + "}, ";
  json_key(out, "wire_ratio");
  if (e.wire_ratio >= 0 && std::isfinite(e.wire_ratio)) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.6g", e.wire_ratio);
    out += buf;
  } else {
    out += "null";
  }
  out += ", ";
  json_key(out, "state"), json_string(out, state_name(e.state)), out += ", ";
  json_key(out, "issued_us"), out += std::to_string(e.issued_us), out += ", ";
  json_key(out, "started_us"), json_int_or_null(out, e.started_us, e.started_us != 0), out += ", ";
  json_key(out, "completed_us"), json_int_or_null(out, e.completed_us, e.completed_us != 0), out += ", ";
  json_key(out, "error");
  if (e.state == TraceState::kFailed) json_string(out, e.error); else out += "null";
  out += ", ";
  json_key(out, "thread"), json_string(out, std::to_string(e.thread)), out += ", ";
  json_key(out, "stack");
  if (!e.stack.empty()) json_string(out, e.stack); else out += "null";
  out += "}";
}

}  // namespace

std::string Recorder::to_json(const TraceIdentity& who, int rank, int world, const std::string& reason) const {
  std::string out = "{\"format\": \"braid-trace\", \"version\": 1, ";
  json_key(out, "braid_version"), json_string(out, who.version), out += ", ";
  json_key(out, "comm_id"), json_string(out, who.comm_id), out += ", ";
  json_key(out, "rank"), out += std::to_string(rank), out += ", ";
  json_key(out, "world_size"), out += std::to_string(world), out += ", ";
  json_key(out, "hosts"), out += "[";
  for (int r = 0; r < world; ++r) {
    if (r > 0) out += ", ";
    out += std::to_string(static_cast<size_t>(r) < who.hosts.size() ? who.hosts[static_cast<size_t>(r)] : 0);
  }
  out += "], ";
  json_key(out, "hostname"), json_string(out, who.hostname), out += ", ";
  json_key(out, "pid"), out += std::to_string(::getpid()), out += ", ";
  json_key(out, "reason"), json_string(out, reason), out += ", ";
  json_key(out, "dumped_us"), out += std::to_string(wall_us()), out += ", ";
  // Ticks to wall-clock microseconds: the rate from the readings at creation and now, over at
  // least 50 ms (a dump right after creation waits for the rest).
  const auto since = std::chrono::nanoseconds(wall_ns() - wall0_ns_);
  if (since < std::chrono::milliseconds(50)) std::this_thread::sleep_for(std::chrono::milliseconds(50) - since);
  const uint64_t tick1 = ticks();
  const int64_t wall1 = wall_ns();
  const double ns_per_tick = tick1 > tick0_ ? static_cast<double>(wall1 - wall0_ns_) / static_cast<double>(tick1 - tick0_)
                                            : 1.0;
  auto to_us = [&](int64_t t) -> int64_t {
    if (t == 0) return 0;
    const double ns = static_cast<double>(wall0_ns_) +
                      static_cast<double>(static_cast<int64_t>(static_cast<uint64_t>(t) - tick0_)) * ns_per_tick;
    return static_cast<int64_t>(ns / 1000.0);
  };
  const uint64_t recorded = recorded_.load(std::memory_order_acquire);
  json_key(out, "buffer"), out += std::to_string(capacity_), out += ", ";
  std::string entries;
  uint64_t kept = 0;
  const uint64_t n = std::min<uint64_t>(recorded, capacity_);
  for (uint64_t id = recorded - n + 1; id <= recorded; ++id) {
    TraceEntry e;
    if (!snapshot((id - 1) & mask_, e) || e.id != id) continue;  // caught mid-write, or already reused
    e.issued_us = to_us(e.issued_us);
    e.started_us = to_us(e.started_us);
    e.completed_us = to_us(e.completed_us);
    if (kept++ != 0) entries += ",\n  ";
    entry_json(entries, e);
  }
  json_key(out, "recorded"), out += std::to_string(recorded), out += ", ";
  json_key(out, "entries"), out += "[";
  out += entries;
  out += "]}\n";
  return out;
}

std::string write_dump(const std::string& dir, const std::string& name, const std::string& text) {
  if (::mkdir(dir.c_str(), 0777) != 0 && errno != EEXIST)
    throw std::runtime_error("cannot create the trace directory " + dir + ": " + std::strerror(errno));
  const std::string path = dir + "/" + name;
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) throw std::runtime_error("cannot write the trace dump " + tmp + ": " + std::strerror(errno));
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const bool closed = std::fclose(f) == 0;
  if (!ok || !closed || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    throw std::runtime_error("cannot write the trace dump " + path + ": " + why);
  }
  return path;
}

namespace {
std::atomic<uint64_t> g_signals{0};
std::once_flag g_signal_once;
std::atomic<bool> g_signal_installed{false};

void on_trace_signal(int) { g_signals.fetch_add(1, std::memory_order_relaxed); }

int parse_signal(const char* s) {
  std::string v = s;
  if (v.empty()) return 0;
  if (v.find_first_not_of("0123456789") == std::string::npos) return std::atoi(v.c_str());
  if (v.rfind("SIG", 0) == 0) v = v.substr(3);
  static const struct { const char* name; int sig; } kSignals[] = {
      {"USR1", SIGUSR1}, {"USR2", SIGUSR2}, {"HUP", SIGHUP}, {"QUIT", SIGQUIT}, {"TERM", SIGTERM},
      {"INT", SIGINT}, {"ALRM", SIGALRM}, {"PWR", SIGPWR}, {"URG", SIGURG}, {"WINCH", SIGWINCH}};
  for (const auto& k : kSignals)
    if (v == k.name) return k.sig;
  throw std::invalid_argument("BRAID_TRACE_SIGNAL must be a signal number or name (USR1, SIGUSR2, ...); got '" +
                              std::string(s) + "'");
}
}  // namespace

void install_trace_signal() {
  const char* s = std::getenv("BRAID_TRACE_SIGNAL");
  if (s == nullptr || *s == '\0') return;
  const int sig = parse_signal(s);  // outside the once: a bad value raises at every construction
  std::call_once(g_signal_once, [sig] {
    struct sigaction sa {};
    sa.sa_handler = on_trace_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    ::sigaction(sig, &sa, nullptr);
    g_signal_installed.store(true);
  });
}

uint64_t trace_signals_seen() { return g_signals.load(std::memory_order_relaxed); }
bool trace_signals_configured() { return g_signal_installed.load(); }

}  // namespace braid
