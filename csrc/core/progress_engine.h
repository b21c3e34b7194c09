// Runs work in issue order: inline on the caller's thread when nothing is queued (no hand-off
// latency for blocking calls), otherwise on one background thread started on first use.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include "work.h"

namespace braid {

class ProgressEngine {
 public:
  ProgressEngine() = default;
  ~ProgressEngine() { shutdown(); }
  ProgressEngine(const ProgressEngine&) = delete;
  ProgressEngine& operator=(const ProgressEngine&) = delete;

  // Runs `fn` on the calling thread when nothing is queued or running (the common blocking
  // call: no allocation, no thread hand-off); returns false without running it otherwise.
  // Exceptions from `fn` propagate.
  template <class F>
  bool run_if_idle(F&& fn) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!queue_.empty() || busy_ || stop_) return false;
      busy_ = true;
    }
    struct Release {
      ProgressEngine* engine;
      ~Release() { engine->end_inline(); }
    } release{this};
    fn();
    return true;
  }
  // Non-blocking: queues `w` for the progress thread.
  void enqueue(const std::shared_ptr<Work>& w);
  // Runs what is queued, then stops the thread. Later submissions are refused by the owner.
  void shutdown();

 private:
  void loop();
  void end_inline();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Work>> queue_;
  bool busy_ = false;   // a work is executing (inline or on the thread)
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace braid
