// A minimal test registry and CHECK macros for the core tests (no external framework).
// Failures are recorded, not thrown, so that a forked rank can report all of its own to the parent.
#pragma once

#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "core/errors.h"

namespace braid_test {

// The suite is the test file's name without "_test.cc": ctest runs one suite per entry.
int register_test(const char* file, const char* name, void (*fn)());
void record_failure(const char* file, int line, const std::string& what);
// The failures recorded in this process so far, emptied.
std::vector<std::string> take_failures();

template <class A, class B>
std::string describe_pair(const A& a, const B& b) {
  std::ostringstream s;
  s << a << " vs " << b;
  return s.str();
}

// Runs `fn`, which must throw braid::CommError of `kind`; returns its message ("" otherwise).
std::string expect_comm_error(const char* file, int line, braid::ErrorKind kind,
                              const std::function<void()>& fn);

}  // namespace braid_test

#define BRAID_TEST(name)                                                                    \
  static void name();                                                                       \
  [[maybe_unused]] static const int name##_registered =                                     \
      ::braid_test::register_test(__FILE__, #name, name);                                   \
  static void name()

#define CHECK(cond)                                                                         \
  do {                                                                                      \
    if (!(cond)) ::braid_test::record_failure(__FILE__, __LINE__, "CHECK(" #cond ")");      \
  } while (0)

#define CHECK_MSG(cond, msg)                                                                \
  do {                                                                                      \
    if (!(cond)) ::braid_test::record_failure(__FILE__, __LINE__, std::string(msg));        \
  } while (0)

#define CHECK_EQ(a, b)                                                                      \
  do {                                                                                      \
    const auto& check_a_ = (a);                                                             \
    const auto& check_b_ = (b);                                                             \
    if (!(check_a_ == check_b_))                                                            \
      ::braid_test::record_failure(__FILE__, __LINE__,                                      \
                                   "CHECK_EQ(" #a ", " #b "): " +                           \
                                       ::braid_test::describe_pair(check_a_, check_b_));    \
  } while (0)

#define CHECK_THROWS_KIND(kind, ...) \
  ::braid_test::expect_comm_error(__FILE__, __LINE__, kind, [&] { __VA_ARGS__; })
