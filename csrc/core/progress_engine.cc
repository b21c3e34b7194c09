// Ordered executor: one work at a time, in issue order, across the caller and progress threads.
#include "progress_engine.h"
#include "thread_name.h"

namespace braid {

void ProgressEngine::end_inline() {
  std::lock_guard<std::mutex> lk(mu_);
  inline_owner_.store(std::thread::id{}, std::memory_order_relaxed);
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
  enqueued_.fetch_add(1, std::memory_order_seq_cst);
  cv_.notify_all();
}

void ProgressEngine::take_p2p(std::vector<std::shared_ptr<Work>>& batch) {
  std::lock_guard<std::mutex> lk(mu_);
  while (!queue_.empty() && queue_.front()->p2p()) {
    batch.push_back(std::move(queue_.front()));
    queue_.pop_front();
  }
}

bool ProgressEngine::run_p2p_here(const Work* w) {
  std::vector<std::shared_ptr<Work>> batch;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (busy_ || stop_ || !p2p_here_runner_) return false;
    size_t k = 0;
    bool found = false;
    for (; k < queue_.size() && queue_[k]->p2p(); ++k) found = found || queue_[k].get() == w;
    if (!found) return false;
    for (size_t i = 0; i < k; ++i) {
      batch.push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
    busy_ = true;
    inline_owner_.store(std::this_thread::get_id(), std::memory_order_relaxed);
  }
  p2p_here_runner_(batch, w);  // noexcept: failures complete the works
  std::lock_guard<std::mutex> lk(mu_);
  for (auto it = batch.rbegin(); it != batch.rend(); ++it) queue_.push_front(std::move(*it));
  inline_owner_.store(std::thread::id{}, std::memory_order_relaxed);
  busy_ = false;
  if (!queue_.empty() || stop_) cv_.notify_all();
  return true;
}

namespace {
thread_local const ProgressEngine* t_engine = nullptr;
}  // namespace

const ProgressEngine* ProgressEngine::current_engine() { return t_engine; }

void ProgressEngine::loop() {
  t_engine = this;
  name_this_thread("braid-progress");
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return (!queue_.empty() && !busy_) || (stop_ && queue_.empty()); });
    if (queue_.empty()) return;  // stop_ with nothing left
    auto w = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    if (w->p2p() && p2p_runner_) {
      std::vector<std::shared_ptr<Work>> batch{std::move(w)};
      while (!queue_.empty() && queue_.front()->p2p()) {
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
      lk.unlock();
      p2p_runner_(batch);
      batch.clear();  // outside the lock (see Work::finish)
    } else {
      lk.unlock();
      w->run();
      w.reset();
    }
    lk.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

void ProgressEngine::stop_detached() {
  std::lock_guard<std::mutex> lk(mu_);
  stop_ = true;
  cv_.notify_all();
  if (thread_.joinable()) thread_.detach();
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
