// Runs work in issue order: inline on the caller's thread when nothing is queued (no hand-off
// latency for blocking calls), otherwise on one background thread started on first use.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

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
      inline_owner_.store(std::this_thread::get_id(), std::memory_order_relaxed);
    }
    struct Release {
      ProgressEngine* engine;
      ~Release() { engine->end_inline(); }
    } release{this};
    fn();
    return true;
  }
  // Non-blocking: queues `w` for the progress thread. Everything queued before it becomes due
  // now too (enqueue_lazy's works included): issue order holds.
  void enqueue(const std::shared_ptr<Work>& w);
  // Queues `w` for the progress thread to start no sooner than `delay` from now, unless a thread
  // that waits for it runs it first (run_p2p_here) or an enqueue() behind it makes it due. Where
  // the waiter comes within `delay` (the usual exchange: post, then wait), the progress thread is
  // neither woken nor given a core: on a host with more threads than cores that hand-off costs
  // more than a small transfer. Progress without a waiter is delayed by `delay` at most. While
  // works come this way the thread looks at the queue at least every `delay` (for kLinger after
  // the last one it ran), so a lazy enqueue usually wakes nothing.
  void enqueue_lazy(const std::shared_ptr<Work>& w, std::chrono::nanoseconds delay);

  // Point-to-point works (Work::p2p()) at the head of the queue are handed to `runner` together,
  // all the consecutive ones, instead of one at a time: a send that waits for its receiver must
  // not keep the receive queued behind it from running. The runner completes each work; while it
  // runs it may call take_p2p() for the point-to-point works queued right behind them since.
  using P2PRunner = std::function<void(std::vector<std::shared_ptr<Work>>& batch)>;
  void set_p2p_runner(P2PRunner runner) { p2p_runner_ = std::move(runner); }
  // Appends to `batch` the point-to-point works now at the head of the queue.
  void take_p2p(std::vector<std::shared_ptr<Work>>& batch);
  // A thread that waits for a point-to-point work the progress thread has not taken yet runs the
  // point-to-point works at the head of the queue itself (run_p2p_here): waking the progress
  // thread and then being woken by it costs more than a small transfer takes. The runner gets
  // them and the awaited work, moves them until that one is done, and leaves in `batch` the works
  // it did not finish (their progress kept in their requests), which go back to the head of the
  // queue in order; it may leave every work untouched (a transfer it cannot run there).
  using P2PHereRunner = std::function<void(std::vector<std::shared_ptr<Work>>& batch, const Work* until)>;
  void set_p2p_here_runner(P2PHereRunner runner) { p2p_here_runner_ = std::move(runner); }
  // Runs the point-to-point works at the head of the queue on the calling thread when `w` is among
  // them and nothing runs; returns whether it did. Work::wait calls it.
  bool run_p2p_here(const Work* w);
  // Counts enqueue() calls: a runner that waits watches it to notice new work.
  uint64_t enqueued() const { return enqueued_.load(std::memory_order_seq_cst); }
  // Runs what is queued, then stops the thread. Later submissions are refused by the owner.
  void shutdown();
  // From the progress thread itself, which cannot join itself: the thread runs what is queued,
  // then ends on its own (detached). The engine must outlive it: its owner leaks it.
  void stop_detached();
  // Whether the calling thread is this engine's progress thread (running a work or one of its
  // completion callbacks): a blocking call made there would wait for this very thread.
  bool on_progress_thread() const { return current_engine() == this; }
  // Whether the calling thread is inside run_if_idle's `fn` (a call made from there, e.g. by a
  // signal handler that a wait ran, would wait for the call it interrupted).
  bool inline_on_this_thread() const {
    return inline_owner_.load(std::memory_order_relaxed) == std::this_thread::get_id();
  }
  // The engine whose progress thread is calling, or null.
  static const ProgressEngine* current_engine();

 private:
  void loop();
  void end_inline();

  using Clock = std::chrono::steady_clock;
  // How long the thread keeps looking at the queue every lazy delay after running a lazy work.
  static constexpr std::chrono::milliseconds kLinger{100};
  struct Queued {
    std::shared_ptr<Work> work;
    Clock::time_point due;  // Clock::time_point::min(): at once
  };

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Queued> queue_;
  bool busy_ = false;   // a work is executing (inline or on the thread)
  bool stop_ = false;
  bool untimed_wait_ = false;  // the thread sleeps until notified (enqueue_lazy must wake it)
  std::chrono::nanoseconds lazy_delay_{0};  // the last enqueue_lazy's: the thread's look-again period
  std::thread thread_;
  P2PRunner p2p_runner_;
  P2PHereRunner p2p_here_runner_;
  std::atomic<uint64_t> enqueued_{0};
  std::atomic<std::thread::id> inline_owner_{};  // the thread in run_if_idle's fn, if any
};

}  // namespace braid
