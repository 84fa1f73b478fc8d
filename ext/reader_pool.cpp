#include "reader_pool.h"

#include <atomic>
#include <exception>
#include <memory>

namespace es {

ReaderPool::ReaderPool(int threads) {
  if (threads < 1) threads = 1;
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { worker(); });
}

ReaderPool::~ReaderPool() {
  cancel_prefetches();
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ReaderPool::worker() {
  for (;;) {
    std::function<void()> demand;
    PrefetchTask prefetch;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [this] { return stop_ || !demand_.empty() || !prefetch_.empty(); });
      if (!demand_.empty()) {
        demand = std::move(demand_.front());
        demand_.pop_front();
      } else if (!prefetch_.empty()) {
        prefetch = std::move(prefetch_.front());
        prefetch_.pop_front();
      } else {
        return;  // stop_ and nothing left
      }
    }
    if (demand) {
      demand();
    } else {
      prefetch(false);
    }
  }
}

void ReaderPool::run_demand(std::vector<std::function<void()>> tasks) {
  if (tasks.empty()) return;
  struct Batch {
    std::mutex mu;
    std::condition_variable cv;
    size_t left;
    std::exception_ptr error;
  };
  auto batch = std::make_shared<Batch>();
  batch->left = tasks.size();
  auto wrap = [batch](std::function<void()> fn) {
    return [batch, fn = std::move(fn)] {
      std::exception_ptr err;
      try {
        fn();
      } catch (...) {
        err = std::current_exception();
      }
      std::lock_guard<std::mutex> lk(batch->mu);
      if (err && !batch->error) batch->error = err;
      if (--batch->left == 0) batch->cv.notify_all();
    };
  };
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (size_t i = 1; i < tasks.size(); ++i) demand_.push_back(wrap(std::move(tasks[i])));
  }
  cv_.notify_all();
  wrap(std::move(tasks[0]))();
  // Help with this batch's remaining demand work instead of idling.
  for (;;) {
    std::function<void()> next;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!demand_.empty()) {
        next = std::move(demand_.front());
        demand_.pop_front();
      }
    }
    if (!next) break;
    next();
  }
  std::unique_lock<std::mutex> lk(batch->mu);
  batch->cv.wait(lk, [&] { return batch->left == 0; });
  if (batch->error) std::rethrow_exception(batch->error);
}

void ReaderPool::submit_prefetch(PrefetchTask task) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    prefetch_.push_back(std::move(task));
  }
  cv_.notify_one();
}

size_t ReaderPool::cancel_prefetches() {
  std::deque<PrefetchTask> queued;
  {
    std::lock_guard<std::mutex> lk(mu_);
    queued.swap(prefetch_);
  }
  for (auto& t : queued) t(true);
  return queued.size();
}

}  // namespace es
