#include "reader_pool.h"

namespace es {

ReaderPool::ReaderPool(int threads) {
  if (threads < 1) threads = 1;
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { worker(false); });
  workers_.emplace_back([this] { worker(true); });
}

ReaderPool::~ReaderPool() {
  cancel_prefetches();
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  demand_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ReaderPool::worker(bool demand_only) {
  for (;;) {
    std::function<void()> demand;
    PrefetchTask prefetch;
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (demand_only) {
        demand_cv_.wait(lk, [this] { return stop_ || !demand_.empty(); });
      } else {
        cv_.wait(lk, [this] { return stop_ || !demand_.empty() || !prefetch_.empty(); });
      }
      if (!demand_.empty()) {
        demand = std::move(demand_.front());
        demand_.pop_front();
      } else if (!demand_only && !prefetch_.empty()) {
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

void ReaderPool::submit_demand(std::vector<std::function<void()>> tasks) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& t : tasks) demand_.push_back(std::move(t));
  }
  demand_cv_.notify_one();
  if (tasks.size() == 1) {
    cv_.notify_one();
  } else {
    cv_.notify_all();
  }
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
