// Multi-process rank groups for the core tests: fork, bootstrap (segment names, pids, hosts, a
// barrier before unlinking), run, collect the failures, kill on the deadline, check /dev/shm.
#include "rank_group.h"

#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>

#include "check.h"

namespace braid_test {
namespace {

using Clock = std::chrono::steady_clock;

// Frames on a socketpair: a tag byte, a 32-bit length, the payload.
enum Tag : char {
  kName = 'N',     // rank -> parent: "segment pid host"
  kPeers = 'P',    // parent -> rank: one "segment pid host" line per rank
  kAttached = 'A', // rank -> parent: mapped every peer's segment
  kGo = 'G',       // parent -> rank: everyone attached (unlink and run) / released from a hold
  kHold = 'H',     // rank -> parent: release me when the others have exited
  kReport = 'R',   // rank -> parent: its failures, one per line
};

bool write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    // MSG_NOSIGNAL: a peer that already died must not take this process down with SIGPIPE.
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool send_frame(int fd, char tag, const std::string& payload) {
  char head[5];
  head[0] = tag;
  const auto len = static_cast<uint32_t>(payload.size());
  std::memcpy(head + 1, &len, 4);
  return write_all(fd, head, 5) && write_all(fd, payload.data(), payload.size());
}

// Reads exactly n bytes; false on EOF, error or (when given) the deadline.
bool read_all(int fd, char* p, size_t n, const Clock::time_point* deadline) {
  while (n > 0) {
    if (deadline != nullptr) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - Clock::now()).count();
      if (left <= 0) return false;
      struct pollfd pfd{fd, POLLIN, 0};
      const int r = ::poll(&pfd, 1, static_cast<int>(left));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return false;
    }
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool read_frame(int fd, char* tag, std::string* payload, const Clock::time_point* deadline) {
  char head[5];
  if (!read_all(fd, head, 5, deadline)) return false;
  *tag = head[0];
  uint32_t len;
  std::memcpy(&len, head + 1, 4);
  payload->assign(len, '\0');
  return read_all(fd, payload->data(), len, deadline);
}

// The child's side of the bootstrap, then the body; never returns.
[[noreturn]] void rank_main(const GroupSpec& spec, int rank, int fd, pid_t parent,
                            const std::function<void(RankCtx&)>& body) {
  // Die with the parent, so that a parent killed by ctest's timeout leaves no rank behind.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) std::_Exit(3);
  take_failures();  // the parent's own, inherited through fork: not this rank's to report
  try {
    braid::Tunables t = spec.tunables;
    if (spec.tune_rank) spec.tune_rank(rank, t);
    braid::Communicator comm(rank, spec.world, t, spec.timeout_s);
    char host[256] = {0};
    ::gethostname(host, sizeof(host) - 1);
    send_frame(fd, kName, comm.segment_name() + " " + std::to_string(::getpid()) + " " + host);
    char tag;
    std::string payload;
    if (!read_frame(fd, &tag, &payload, nullptr) || tag != kPeers) std::_Exit(4);
    std::vector<braid::PeerInfo> peers(spec.world);
    std::istringstream lines(payload);
    for (auto& p : peers) lines >> p.segment >> p.pid >> p.host;
    comm.attach(peers);
    send_frame(fd, kAttached, "");
    if (!read_frame(fd, &tag, &payload, nullptr) || tag != kGo) std::_Exit(4);
    comm.unlink_own();
    RankCtx ctx(rank, spec.world, comm, fd);
    body(ctx);
    comm.close();
  } catch (const std::exception& e) {
    record_failure(__FILE__, __LINE__, std::string("uncaught exception: ") + e.what());
  }
  const auto failures = take_failures();
  std::string report;
  for (const auto& f : failures) report += f + "\n";
  send_frame(fd, kReport, report);
  // exit, not _exit: sanitizers report leaks and set the exit status in exit handlers.
  std::exit(failures.empty() ? 0 : 1);
}

struct Child {
  pid_t pid = -1;
  int fd = -1;
  bool eof = false;
  bool reaped = false;
  bool held = false;
  int status = 0;
  std::string report;
};

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("signal ") + strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

}  // namespace

void RankCtx::hold_until_others_exit() {
  send_frame(parent_fd_, kHold, "");
  char tag;
  std::string payload;
  if (!read_frame(parent_fd_, &tag, &payload, nullptr) || tag != kGo) std::_Exit(4);
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void run_group(const GroupSpec& spec, const std::function<void(RankCtx&)>& body) {
  const auto deadline = Clock::now() + spec.deadline;
  const std::string what = "group of " + std::to_string(spec.world) + ": ";
  std::vector<Child> kids(spec.world);
  std::fflush(nullptr);
  const pid_t parent = ::getpid();
  for (int r = 0; r < spec.world; ++r) {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
      record_failure(__FILE__, __LINE__, what + "socketpair: " + std::strerror(errno));
      break;
    }
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(sv[0]);
      for (int k = 0; k < r; ++k) ::close(kids[k].fd);
      rank_main(spec, r, sv[1], parent, body);
    }
    ::close(sv[1]);
    if (pid < 0) {
      ::close(sv[0]);
      record_failure(__FILE__, __LINE__, what + "fork: " + std::strerror(errno));
      break;
    }
    kids[r].pid = pid;
    kids[r].fd = sv[0];
  }
  std::vector<std::string> segments;
  auto bootstrap = [&]() -> std::string {
    for (const auto& k : kids)
      if (k.pid < 0) return "not every rank started";
    std::string peers;
    for (int r = 0; r < spec.world; ++r) {
      char tag;
      std::string payload;
      if (!read_frame(kids[r].fd, &tag, &payload, &deadline) || tag != kName)
        return "rank " + std::to_string(r) + " did not publish its segment";
      segments.push_back(payload.substr(0, payload.find(' ')));
      peers += payload + "\n";
    }
    for (auto& k : kids) send_frame(k.fd, kPeers, peers);
    // The barrier before unlink_own: a segment's name must outlive every peer's attach.
    for (int r = 0; r < spec.world; ++r) {
      char tag;
      std::string payload;
      if (!read_frame(kids[r].fd, &tag, &payload, &deadline) || tag != kAttached)
        return "rank " + std::to_string(r) + " did not attach";
    }
    for (auto& k : kids) send_frame(k.fd, kGo, "");
    return "";
  };
  const std::string boot_error = bootstrap();
  if (!boot_error.empty()) record_failure(__FILE__, __LINE__, what + "bootstrap failed: " + boot_error);

  // Serve holds and collect reports until every rank has exited or the deadline passes.
  bool released = false, poll_failed = false;
  for (;;) {
    std::vector<struct pollfd> fds;
    std::vector<int> who;
    for (int r = 0; r < spec.world; ++r) {
      if (kids[r].pid < 0 || kids[r].eof) continue;
      fds.push_back({kids[r].fd, POLLIN, 0});
      who.push_back(r);
    }
    if (fds.empty()) break;
    const bool others_gone = std::all_of(kids.begin(), kids.end(), [](const Child& k) { return k.held || k.reaped || k.pid < 0; });
    if (others_gone && !released) {
      released = true;
      for (auto& k : kids)
        if (k.held) send_frame(k.fd, kGo, "");
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0 || !boot_error.empty() || poll_failed) {
      std::string running;
      for (int r : who) {
        ::kill(kids[r].pid, SIGKILL);
        running += " " + std::to_string(r);
      }
      if (left <= 0) record_failure(__FILE__, __LINE__, what + "deadline passed; killed ranks" + running);
      for (int r : who) {
        ::waitpid(kids[r].pid, &kids[r].status, 0);
        kids[r].reaped = true;
        kids[r].eof = true;
      }
      break;
    }
    const int n = ::poll(fds.data(), fds.size(), static_cast<int>(left));
    if (n < 0 && errno != EINTR) {
      record_failure(__FILE__, __LINE__, what + "poll: " + std::strerror(errno));
      poll_failed = true;  // the next turn kills and reaps the ranks
    }
    for (size_t i = 0; n > 0 && i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      Child& k = kids[who[i]];
      char tag;
      std::string payload;
      if (read_frame(k.fd, &tag, &payload, &deadline)) {
        if (tag == kHold) k.held = true;
        if (tag == kReport) k.report = payload;
        continue;
      }
      // EOF: the kernel closes the socket as the process ends, so the wait is short.
      k.eof = true;
      ::waitpid(k.pid, &k.status, 0);
      k.reaped = true;
      k.held = false;
    }
  }

  for (int r = 0; r < spec.world; ++r) {
    Child& k = kids[r];
    if (k.pid < 0) continue;
    ::close(k.fd);
    const std::string who = what + "rank " + std::to_string(r) + ": ";
    std::istringstream lines(k.report);
    for (std::string line; std::getline(lines, line);) record_failure(__FILE__, __LINE__, who + line);
    const bool expect_kill = std::find(spec.killed.begin(), spec.killed.end(), r) != spec.killed.end();
    const bool ok = expect_kill ? (WIFSIGNALED(k.status) && WTERMSIG(k.status) == SIGKILL)
                                : (WIFEXITED(k.status) && WEXITSTATUS(k.status) == 0);
    // A rank whose CHECKs failed exits 1 after reporting them; anything else is a failure of its own.
    const bool reported = WIFEXITED(k.status) && WEXITSTATUS(k.status) == 1 && !k.report.empty();
    if (!ok && !reported)
      record_failure(__FILE__, __LINE__, who + (expect_kill ? "expected SIGKILL, got " : "ended with ") +
                                             describe_status(k.status));
  }
  // Every name must be gone: unlinked after the bootstrap barrier, whatever happened next.
  for (const auto& name : segments) {
    const std::string path = "/dev/shm" + name;
    if (::access(path.c_str(), F_OK) == 0) {
      record_failure(__FILE__, __LINE__, what + "segment left behind: " + path);
      ::unlink(path.c_str());
    }
  }
}

}  // namespace braid_test
