// Background reader threads with two queues: demand reads (a layer is waiting on them)
// always run before queued prefetch reads, so a speculative read never delays a needed one.
// `threads` workers take both; one more takes demand reads only, standing in for the
// waiting caller, so demand reads get threads + 1 lanes and prefetch never more than
// `threads`.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
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

  // Queues demand tasks ahead of every queued prefetch. The caller waits for them on its
  // own terms (ExpertCache bounds the wait with the read timeout), never by running reads
  // itself: a read that hangs in the kernel must not hold the generation thread.
  void submit_demand(std::vector<std::function<void()>> tasks);

  // Queues a prefetch task behind all demand work.
  void submit_prefetch(PrefetchTask task);

  // Calls every queued, not yet started prefetch task with cancelled=true; returns how many.
  size_t cancel_prefetches();

 private:
  struct Worker {
    explicit Worker(bool d) : demand_only(d) {}
    const bool demand_only;
    bool woken = false;  // guarded by mu_
    std::condition_variable cv;
    std::thread thread;
  };
  void run(Worker* w);
  // Takes an idle worker for a demand (or prefetch) task off the idle lists, marks it
  // woken and returns it (null: none idle); the caller notifies it after unlocking.
  Worker* take_idle(bool demand);

  std::mutex mu_;
  std::deque<std::function<void()>> demand_;
  std::deque<PrefetchTask> prefetch_;
  // Idle workers are woken one per task, last idle first: on a loaded machine every
  // needless wake-up costs a scheduling slice the reads wait for, and the thread that
  // slept least has the warmest caches and buffer (and the shallowest CPU idle state).
  std::vector<Worker*> idle_;        // workers taking both kinds, in the order they idled
  Worker* demand_idle_ = nullptr;    // the demand-only worker, while it waits
  bool stop_ = false;
  std::vector<std::unique_ptr<Worker>> workers_;
};

}  // namespace es
