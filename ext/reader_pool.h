// Background reader threads with two queues: demand reads (a layer is waiting on them)
// always run before queued prefetch reads, so a speculative read never delays a needed one.
// `threads` workers take both; one more takes demand reads only, standing in for the
// waiting caller, so demand reads get threads + 1 lanes and prefetch never more than
// `threads`.
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

  // Throws ResourceError (errors.h; naming the thread count) when the system refuses a thread.
  explicit ReaderPool(int threads);
  ~ReaderPool();
  ReaderPool(const ReaderPool&) = delete;
  ReaderPool& operator=(const ReaderPool&) = delete;

  // Queues demand tasks ahead of every queued prefetch. The caller waits for them on its
  // own terms (ExpertCache bounds the wait with the read timeout), never by running reads
  // itself: a read that hangs in the kernel must not hold the generation thread.
  void submit_demand(std::vector<std::function<void()>> tasks);

  // Queues a prefetch task behind all demand work.
  void submit_prefetch(PrefetchTask task);

  // Calls every queued, not yet started prefetch task with cancelled=true; returns how many.
  size_t cancel_prefetches();

 private:
  void worker(bool demand_only);
  // Stops and joins the workers (queued demand tasks run first, see worker()).
  void stop();

  std::mutex mu_;
  std::condition_variable cv_;         // workers taking both kinds
  std::condition_variable demand_cv_;  // the demand-only worker
  std::deque<std::function<void()>> demand_;
  std::deque<PrefetchTask> prefetch_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace es
