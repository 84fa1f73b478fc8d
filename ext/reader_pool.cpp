#include "reader_pool.h"

#include <stdexcept>
#include <string>
#include <system_error>

#include "errors.h"

namespace es {

ReaderPool::ReaderPool(int threads) {
  if (threads < 1) threads = 1;
  try {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { worker(false); });
    workers_.emplace_back([this] { worker(true); });
  } catch (const std::system_error& e) {
    // No destructor runs for a constructor that throws: the threads already started are
    // stopped here, or their std::thread objects would end the process (std::terminate).
    stop();
    throw ResourceError("cannot start " + std::to_string(threads + 1) +
                             " reader threads (" + e.what() +
                             "): raise the process's thread or memory limit, or give "
                             "fewer reader threads");
  }
}

ReaderPool::~ReaderPool() {
  cancel_prefetches();
  stop();
}

void ReaderPool::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  demand_cv_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
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
