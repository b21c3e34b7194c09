// A unit of work executed in issue order: its state, its error and its completion callbacks.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "errors.h"
#include "fork_guard.h"

namespace braid {

// The error of a blocking wait on the progress thread that would complete it.
constexpr const char* kOnProgressThread =
    "blocking call on braid's progress thread (inside a future's callback, say): it would wait for "
    "that thread itself, forever; issue it with async_op=True, or after the callback returned";

class Work {
 public:
  explicit Work(std::function<void()> body) : body_(std::move(body)) {}
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  // Runs the body once and records the outcome; called by the progress engine.
  void run() noexcept;
  // Marks the work failed without running it.
  void fail(ErrorKind kind, const std::string& msg) noexcept;
  // Marks the work done without running its body (its job was done by someone else, e.g. the
  // engine's point-to-point runner).
  void complete() noexcept { finish(ErrorKind::kNone, {}); }

  // Point-to-point work carries its request here (opaque to the engine), so that consecutive
  // transfers can be advanced together instead of one blocking the next.
  void set_p2p(std::shared_ptr<void> request) { p2p_ = std::move(request); }
  // The engine that completes this work: wait() on its progress thread, before completion,
  // raises instead of waiting for itself forever.
  void set_engine(const void* engine) { engine_ = engine; }
  const std::shared_ptr<void>& p2p() const { return p2p_; }

  bool is_completed() const;
  // Throws CommError(kClosed) in a process forked after the work was made: only the parent's
  // progress thread can complete it, so waiting for it (or its future) here would never end.
  void check_same_process() const;
  bool succeeded() const;
  // Blocks until completion (or `timeout`, when positive: then returns false). Throws the
  // work's error if it failed, and CommError(kClosed) in a process forked after the work was
  // made (the thread that would complete it exists only in the parent). `interruptible`: polls
  // interrupt_requested() while it waits and throws Interrupted when it says so (the work goes
  // on; whatever it uses must stay alive).
  bool wait(std::chrono::nanoseconds timeout = std::chrono::nanoseconds(0), bool interruptible = false);
  // Blocks until completion, whatever the outcome; never throws.
  void wait_done() noexcept;
  ErrorKind error_kind() const;
  std::string error_message() const;
  // When it completed, on the steady clock (Linux: CLOCK_MONOTONIC, Python's time.perf_counter()
  // and time.monotonic()); nullopt before. Lets a caller time its calls without a callback.
  std::optional<std::chrono::steady_clock::time_point> completed_at() const;

  // Called exactly once, on the completing thread, after the state is final (at once if it is).
  void on_complete(std::function<void(const Work&)> cb);

 private:
  void finish(ErrorKind kind, std::string msg) noexcept;

  std::function<void()> body_;
  std::shared_ptr<void> p2p_;
  const uint64_t fork_generation_ = fork_generation();
  const void* engine_ = nullptr;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::chrono::steady_clock::time_point done_at_{};
  ErrorKind kind_ = ErrorKind::kNone;
  std::string msg_;
  std::vector<std::function<void(const Work&)>> callbacks_;
};

}  // namespace braid
