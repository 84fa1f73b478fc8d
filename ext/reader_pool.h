// Background reader threads with two queues: demand reads (a layer is waiting on them)
// always run before queued prefetch reads, so a speculative read never delays a needed one.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace es {

class ReaderPool {
 public:
  // A prefetch task is called once: with cancelled=false on a reader thread, or with
  // cancelled=true by cancel_prefetches() if it had not started.
  using PrefetchTask = std::function<void(bool cancelled)>;

  explicit ReaderPool(int threads);
  ~ReaderPool();
  ReaderPool(const ReaderPool&) = delete;
  ReaderPool& operator=(const ReaderPool&) = delete;

  // Runs every task, on the reader threads and the calling thread, ahead of any queued
  // prefetch; returns when all have finished and rethrows the first exception.
  void run_demand(std::vector<std::function<void()>> tasks);

  // Queues a prefetch task behind all demand work.
  void submit_prefetch(PrefetchTask task);

  // Calls every queued, not yet started prefetch task with cancelled=true; returns how many.
  size_t cancel_prefetches();

  int threads() const { return static_cast<int>(workers_.size()); }

 private:
  void worker();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> demand_;
  std::deque<PrefetchTask> prefetch_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace es
