// Test runner: `braid_core_tests [--suite NAME] [TEST...]` runs the registered tests, reports
// each with its time and exits non-zero when any failed.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "check.h"

namespace braid_test {
namespace {

struct TestCase {
  std::string suite;
  const char* name;
  void (*fn)();
};

std::vector<TestCase>& registry() {
  static std::vector<TestCase> tests;
  return tests;
}

std::vector<std::string>& failures() {
  static std::vector<std::string> f;
  return f;
}

// Beyond this a broken loop would only flood the log.
constexpr size_t kMaxRecorded = 50;
size_t dropped = 0;

std::string suite_of(const char* file) {
  std::string base = file;
  const size_t slash = base.find_last_of('/');
  if (slash != std::string::npos) base = base.substr(slash + 1);
  const std::string suffix = "_test.cc";
  if (base.size() > suffix.size() && base.compare(base.size() - suffix.size(), suffix.size(), suffix) == 0)
    base.resize(base.size() - suffix.size());
  return base;
}

}  // namespace

int register_test(const char* file, const char* name, void (*fn)()) {
  registry().push_back({suite_of(file), name, fn});
  return 0;
}

void record_failure(const char* file, int line, const std::string& what) {
  if (failures().size() >= kMaxRecorded) {
    ++dropped;
    return;
  }
  const char* slash = std::strrchr(file, '/');
  failures().push_back(std::string(slash ? slash + 1 : file) + ":" + std::to_string(line) + ": " + what);
}

std::vector<std::string> take_failures() {
  std::vector<std::string> out;
  out.swap(failures());
  if (dropped > 0) out.push_back("... and " + std::to_string(dropped) + " more failures");
  dropped = 0;
  return out;
}

std::string expect_comm_error(const char* file, int line, braid::ErrorKind kind,
                              const std::function<void()>& fn) {
  try {
    fn();
  } catch (const braid::CommError& e) {
    if (e.kind() != kind)
      record_failure(file, line, "expected CommError kind " + std::to_string(static_cast<int>(kind)) +
                                     ", got kind " + std::to_string(static_cast<int>(e.kind())) + ": " + e.what());
    return e.what();
  } catch (const std::exception& e) {
    record_failure(file, line, std::string("expected CommError, got std::exception: ") + e.what());
    return "";
  }
  record_failure(file, line, "expected CommError kind " + std::to_string(static_cast<int>(kind)) + ", nothing thrown");
  return "";
}

}  // namespace braid_test

int main(int argc, char** argv) {
  using braid_test::registry;
  std::string suite;
  std::vector<std::string> names;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--suite") == 0 && i + 1 < argc) {
      suite = argv[++i];
    } else {
      names.emplace_back(argv[i]);
    }
  }
  int ran = 0, failed = 0;
  for (const auto& t : registry()) {
    if (!suite.empty() && t.suite != suite) continue;
    if (!names.empty() && std::find(names.begin(), names.end(), t.name) == names.end()) continue;
    std::printf("[ RUN  ] %s.%s\n", t.suite.c_str(), t.name);
    // Forked ranks inherit stdio buffers: flush so that nothing is printed twice.
    std::fflush(stdout);
    const auto start = std::chrono::steady_clock::now();
    t.fn();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    const auto f = braid_test::take_failures();
    for (const auto& line : f) std::printf("  FAIL %s\n", line.c_str());
    std::printf("[ %s ] %s.%s (%.0f ms)\n", f.empty() ? " OK " : "FAIL", t.suite.c_str(), t.name, ms);
    std::fflush(stdout);
    ++ran;
    failed += f.empty() ? 0 : 1;
  }
  std::printf("%d tests, %d failed\n", ran, failed);
  if (ran == 0) {
    std::printf("no test matched\n");
    return 1;
  }
  return failed == 0 ? 0 : 1;
}
