// Ordered executor: one work at a time, in issue order, across the caller and progress threads.
#include "progress_engine.h"

namespace braid {

void ProgressEngine::end_inline() {
  std::lock_guard<std::mutex> lk(mu_);
  busy_ = false;
  if (!queue_.empty() || stop_) cv_.notify_all();
}

void ProgressEngine::enqueue(const std::shared_ptr<Work>& w) {
  std::lock_guard<std::mutex> lk(mu_);
  if (stop_) {
    w->fail(ErrorKind::kClosed, "communicator used after close()");
    return;
  }
  if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  queue_.push_back(w);
  cv_.notify_all();
}

void ProgressEngine::loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return (!queue_.empty() && !busy_) || (stop_ && queue_.empty()); });
    if (queue_.empty()) return;  // stop_ with nothing left
    auto w = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lk.unlock();
    w->run();
    lk.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

void ProgressEngine::shutdown() {
  std::thread t;
  {
    std::unique_lock<std::mutex> lk(mu_);
    stop_ = true;
    cv_.notify_all();
    t = std::move(thread_);
  }
  if (t.joinable()) t.join();
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return !busy_; });  // an inline call on another thread
}

}  // namespace braid
