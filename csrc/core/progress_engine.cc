// Ordered executor: one work at a time, in issue order, across the caller and progress threads.
#include "progress_engine.h"

#include <algorithm>
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
  for (Queued& q : queue_) q.due = Clock::time_point::min();  // nothing waits behind a lazy work
  queue_.push_back({w, Clock::time_point::min()});
  enqueued_.fetch_add(1, std::memory_order_seq_cst);
  cv_.notify_all();
}

void ProgressEngine::enqueue_lazy(const std::shared_ptr<Work>& w, std::chrono::nanoseconds delay) {
  std::lock_guard<std::mutex> lk(mu_);
  if (stop_) {
    w->fail(ErrorKind::kClosed, "communicator used after close()");
    return;
  }
  const bool started = thread_.joinable();
  if (!started) thread_ = std::thread([this] { loop(); });
  lazy_delay_ = delay;
  queue_.push_back({w, Clock::now() + delay});
  enqueued_.fetch_add(1, std::memory_order_seq_cst);
  if (!started || untimed_wait_) cv_.notify_all();  // a thread in a timed wait looks within `delay`
}

void ProgressEngine::take_p2p(std::vector<std::shared_ptr<Work>>& batch) {
  std::lock_guard<std::mutex> lk(mu_);
  while (!queue_.empty() && queue_.front().work->p2p()) {
    batch.push_back(std::move(queue_.front().work));
    queue_.pop_front();
  }
}

bool ProgressEngine::run_p2p_here(const Work* w) {
  std::vector<std::shared_ptr<Work>> batch;
  std::vector<Clock::time_point> dues;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (busy_ || stop_ || !p2p_here_runner_) return false;
    size_t k = 0;
    bool found = false;
    for (; k < queue_.size() && queue_[k].work->p2p(); ++k) found = found || queue_[k].work.get() == w;
    if (!found) return false;
    for (size_t i = 0; i < k; ++i) {
      batch.push_back(std::move(queue_.front().work));
      dues.push_back(queue_.front().due);
      queue_.pop_front();
    }
    busy_ = true;
    inline_owner_.store(std::this_thread::get_id(), std::memory_order_relaxed);
  }
  p2p_here_runner_(batch, w);  // noexcept: failures complete the works
  std::lock_guard<std::mutex> lk(mu_);
  // What it left goes back in front, due when the earliest of the taken works was, or at once when
  // an enqueue() meanwhile made the queue due (nothing waits behind a lazy work)
  Clock::time_point due = dues.empty() ? Clock::time_point::min() : *std::min_element(dues.begin(), dues.end());
  if (!queue_.empty() && queue_.front().due == Clock::time_point::min()) due = Clock::time_point::min();
  for (auto it = batch.rbegin(); it != batch.rend(); ++it) queue_.push_front({std::move(*it), due});
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
  Clock::time_point linger_until{};  // looks at the queue every lazy delay until then
  for (;;) {
    if (busy_) {  // an inline call runs: it notifies when it ends with work queued, and a lazy
      untimed_wait_ = true;  // enqueue after it ended with nothing queued must notify as well
      cv_.wait(lk);
      untimed_wait_ = false;
      continue;
    }
    if (queue_.empty()) {
      if (stop_) return;
      const auto now = Clock::now();
      if (now < linger_until) {
        cv_.wait_until(lk, std::min(linger_until, now + lazy_delay_));
      } else {
        untimed_wait_ = true;
        cv_.wait(lk);
        untimed_wait_ = false;
      }
      continue;
    }
    const Clock::time_point due = queue_.front().due;
    if (!stop_ && due != Clock::time_point::min()) {
      const auto now = Clock::now();
      linger_until = now + kLinger;  // lazy works come: look without being woken for a while
      if (due > now) {  // its waiter may still come and run it
        cv_.wait_until(lk, due);
        continue;
      }
    }
    auto w = std::move(queue_.front().work);
    queue_.pop_front();
    busy_ = true;
    if (w->p2p() && p2p_runner_) {
      std::vector<std::shared_ptr<Work>> batch{std::move(w)};
      while (!queue_.empty() && queue_.front().work->p2p()) {
        batch.push_back(std::move(queue_.front().work));
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
