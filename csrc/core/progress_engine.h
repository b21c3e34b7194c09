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

  // Blocking: runs `w` after everything issued before it; throws its error.
  void run_blocking(const std::shared_ptr<Work>& w);
  // Non-blocking: queues `w` for the progress thread.
  void enqueue(const std::shared_ptr<Work>& w);
  // Runs what is queued, then stops the thread. Later submissions are refused by the owner.
  void shutdown();

 private:
  void loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Work>> queue_;
  bool busy_ = false;   // a work is executing (inline or on the thread)
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace braid
