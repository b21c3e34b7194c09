// Work state machine: pending -> done | failed, with callbacks run outside the lock.
#include "work.h"

#include <algorithm>
#include <exception>
#include <thread>
#include <utility>

#include "interrupt.h"
#include "progress_engine.h"

namespace braid {

namespace {
using Clock = std::chrono::steady_clock;
constexpr const char* kIssuedByParent =
    "this work was issued by the process this one was forked from; only that process can wait for it";
// How often an interruptible wait asks whether to stop (the hook takes Python's GIL: a wait
// shorter than this never does).
constexpr auto kInterruptPoll = std::chrono::milliseconds(100);
}  // namespace

void Work::run() noexcept {
  try {
    body_();
  } catch (const CommError& e) {
    return finish(e.kind(), e.what());
  } catch (const std::exception& e) {
    return finish(ErrorKind::kGeneric, e.what());
  } catch (...) {
    return finish(ErrorKind::kGeneric, "unknown error");
  }
  finish(ErrorKind::kNone, {});
}

void Work::fail(ErrorKind kind, const std::string& msg) noexcept { finish(kind, msg); }

void Work::finish(ErrorKind kind, std::string msg) noexcept {
  std::vector<std::function<void(const Work&)>> cbs;
  std::function<void()> body;
  const auto now = std::chrono::steady_clock::now();  // read outside the lock that waiters take
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (done_) return;
    kind_ = kind;
    msg_ = std::move(msg);
    done_at_ = now;
    done_ = true;
    cbs.swap(callbacks_);
    body.swap(body_);
  }
  cv_.notify_all();
  // Released outside the lock: dropping the last reference to a tensor whose Python object died
  // takes the GIL, and a Python thread holding the GIL may be waiting for this lock.
  body = nullptr;
  for (auto& cb : cbs) cb(*this);
}

std::optional<std::chrono::steady_clock::time_point> Work::completed_at() const {
  std::lock_guard<std::mutex> lk(mu_);
  if (!done_) return std::nullopt;
  return done_at_;
}

void Work::check_same_process() const {
  if (fork_generation() != fork_generation_) throw CommError(ErrorKind::kClosed, kIssuedByParent);
}

bool Work::is_completed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return done_;
}

bool Work::succeeded() const {
  std::lock_guard<std::mutex> lk(mu_);
  return done_ && kind_ == ErrorKind::kNone;
}

ErrorKind Work::error_kind() const {
  std::lock_guard<std::mutex> lk(mu_);
  return kind_;
}

std::string Work::error_message() const {
  std::lock_guard<std::mutex> lk(mu_);
  return msg_;
}

bool Work::wait(std::chrono::nanoseconds timeout, bool interruptible) {
  check_same_process();
  std::unique_lock<std::mutex> lk(mu_);
  if (!done_ && engine_ != nullptr && engine_ == ProgressEngine::current_engine())
    throw CommError(ErrorKind::kGeneric, std::string(kOnProgressThread));
  // An untimed wait for a transfer the progress thread has not taken yet: run it here.
  if (!done_ && p2p_ && engine_ != nullptr && timeout.count() <= 0) {
    lk.unlock();
    static_cast<ProgressEngine*>(const_cast<void*>(engine_))->run_p2p_here(this);
    lk.lock();
    // Taken by the progress thread: a small transfer completes within microseconds, sooner than a
    // sleeping thread would be woken. Poll a little, yielding the core to that thread meanwhile.
    const auto until = Clock::now() + std::chrono::microseconds(50);
    while (!done_ && Clock::now() < until) {
      lk.unlock();
      std::this_thread::yield();
      lk.lock();
    }
  }
  if (interruptible && interrupt_hook_installed()) {
    const auto deadline = timeout.count() > 0 ? Clock::now() + timeout : Clock::time_point::max();
    while (!done_) {
      const auto now = Clock::now();
      if (now >= deadline) return false;
      const auto slice = std::min<Clock::duration>(deadline - now, kInterruptPoll);
      if (cv_.wait_for(lk, slice, [&] { return done_; })) break;
      lk.unlock();
      const bool stop = interrupt_requested();
      lk.lock();
      if (stop) throw Interrupted("interrupted by a signal while waiting for a collective");
    }
  } else if (timeout.count() > 0) {
    if (!cv_.wait_for(lk, timeout, [&] { return done_; })) return false;
  } else {
    cv_.wait(lk, [&] { return done_; });
  }
  if (kind_ != ErrorKind::kNone) throw CommError(kind_, msg_);
  return true;
}

void Work::wait_done() noexcept {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return done_; });
}

void Work::on_complete(std::function<void(const Work&)> cb) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!done_) {
      callbacks_.push_back(std::move(cb));
      return;
    }
  }
  cb(*this);
}

}  // namespace braid
